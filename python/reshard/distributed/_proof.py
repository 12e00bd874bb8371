"""What :meth:`Redistributor.verify` compares, without the collectives around it: fingerprint
parts added up per (tensor, target process), the bucket that narrows a difference, and where an
element of a target shard lies in the full tensor.

A fingerprint (src/reshard/exec/fingerprint.h) is a sum modulo 2^64 of one keyed term per
element of (its flat index in the target's shard, its bits). The source processes compute it
over the elements each one sends (or copies) to a target, the target over what it holds, so for
every (tensor, target process) the sources' parts add up to the target's sum exactly when every
element agrees, but with probability about 2^-64 per comparison (a fresh random key each time).
"""

from __future__ import annotations

import secrets
from typing import Any, Optional, Sequence

from .._maps import ParamMap

MASK = (1 << 64) - 1
BUCKETS = 64  # sub-boxes per narrowing round: a shard of 2^30 elements takes 5 rounds
MAX_NAMED = 4  # differing (tensor, target process) pairs narrowed down to their element

Pair = tuple[int, int]  # (parameter index, target process)
Parts = list[tuple[int, int, list[int]]]  # what Exchange.fingerprints returns


def new_key() -> int:
    """A fresh random 64-bit key."""
    return secrets.randbits(64)


def add_parts(gathered: Sequence[tuple[Any, Parts, Parts]]
              ) -> tuple[dict[Pair, list[int]], dict[Pair, list[int]]]:
    """Every process's (error, source parts, target parts) -> (what the sources give, what the
    targets hold), bucket by bucket, per pair."""
    want: dict[Pair, list[int]] = {}
    held: dict[Pair, list[int]] = {}
    for _, source, target in gathered:
        for into, parts in ((want, source), (held, target)):
            for param, proc, sums in parts:
                acc = into.setdefault((param, proc), [0] * len(sums))
                for k, s in enumerate(sums):
                    acc[k] = (acc[k] + s) & MASK
    return want, held


def differing(want: dict[Pair, list[int]], held: dict[Pair, list[int]]) -> dict[Pair, int]:
    """The pairs whose sums differ, each with its first differing bucket."""
    out: dict[Pair, int] = {}
    for pair in sorted(set(want) | set(held)):
        a, b = want.get(pair), held.get(pair)
        n = len(a or b or [])
        a, b = a or [0] * n, b or [0] * n
        first = next((k for k in range(n) if a[k] != b[k]), None)
        if first is not None:
            out[pair] = first
    return out


def width(lo: int, hi: int) -> int:
    """The width of the buckets [lo, hi) is cut into (as the C++ side cuts it)."""
    return (hi - lo + BUCKETS - 1) // BUCKETS


def unravel(flat: int, shape: Sequence[int]) -> list[int]:
    out = []
    for n in reversed(shape):
        out.append(flat % max(int(n), 1))
        flat //= max(int(n), 1)
    return out[::-1]


def full_index(m: ParamMap, rank: int, position: int) -> Optional[list[int]]:
    """The multi-index in F of the element at flat ``position`` of rank ``rank``'s shard (or
    buffer), from the map's pieces; None when no piece writes it (padding)."""
    for p in m.pieces(rank):
        index = _solve(position - p.dest[0], p.shape, p.dest[1])
        if index is None:
            continue
        flat = p.source[0] + sum(i * s for i, s in zip(index, p.source[1]))
        return unravel(flat, m.logical_shape)
    return None


def _solve(rest: int, shape: Sequence[int], strides: Sequence[int]) -> Optional[list[int]]:
    """The multi-index i inside ``shape`` with ``i . strides == rest``, read greedily from the
    largest stride (a view into a dense shard nests its strides), or None."""
    if rest < 0:
        return None
    order = sorted(range(len(shape)), key=lambda k: -int(strides[k]))
    index = [0] * len(shape)
    for k in order:
        s = int(strides[k])
        if s > 0 and shape[k] > 1:
            index[k] = min(rest // s, int(shape[k]) - 1)
            rest -= index[k] * s
    return index if rest == 0 else None
