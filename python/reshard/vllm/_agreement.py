"""What the trainer processes agree on before a push moves any byte: each process's claim of
the push it makes (:class:`PushClaim`), and the refusal every process raises alike when the
claims differ (:func:`push_refusal`): a push overlapped by another, processes at different
pushes, or tensors every process holds whole that differ between them (compared by digest,
:func:`whole_digests`).
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping, NamedTuple, Optional, Sequence

from .._maps import MapLike, as_map


class PushClaim(NamedTuple):
    """What one trainer process says of the push it is about to make, before any byte moves:
    why it cannot (an engine that did not start an update, a shard it cannot read), which
    push of the sync it is, the digests of the tensors every trainer process holds whole
    (:func:`whole_digests`), and whether another push was asked for (from another thread)
    while it began."""

    refused: Optional[str]
    number: int
    digests: Optional[dict[str, str]]
    overlapped: bool


def push_refusal(claims: Sequence[PushClaim]) -> Optional[str]:
    """Why the trainer processes (``claims``, by process) must not make their push, or None
    when each makes the same one: every process refuses alike, before any byte moves. Two
    threads pushing at once may each win on some process, which would push one set of
    weights from some processes and the other from the rest (an engine serving a mix): a
    push overlapped by another one on any process is refused, and so is one whose tensors
    held whole everywhere differ between processes."""
    refusals = [c.refused for c in claims if c.refused is not None]
    if refusals:
        return refusals[0]
    overlapped = [p for p, c in enumerate(claims) if c.overlapped]
    if overlapped:
        return (f"trainer process{'es' if len(overlapped) > 1 else ''} "
                f"{', '.join(map(str, overlapped))} began another push of this WeightSync (from "
                f"another thread) while push {claims[overlapped[0]].number} began; which of the "
                "two each process makes could differ, so every trainer process refuses it and "
                "the engines keep the weights they had: push from one thread at a time")
    numbers = [c.number for c in claims]
    if len(set(numbers)) > 1:
        return (f"the trainer processes are at different pushes of this WeightSync "
                f"({', '.join(f'process {p}: push {n}' for p, n in enumerate(numbers))}); "
                "every trainer process pushes each time")
    first = claims[0].digests
    for p, c in enumerate(claims[1:], 1):
        if first is None or c.digests is None:
            continue
        differ = sorted(n for n in first if n in c.digests and first[n] != c.digests[n])
        if differ:
            return (f"trainer processes 0 and {p} push different weights: tensor "
                    f"\"{differ[0]}\", which every trainer process holds whole, differs between "
                    f"them ({len(differ)} such tensors differ); the engines keep the weights "
                    "they had. Push the same weights from every process (pushes from two "
                    "threads at once can pair one thread's weights on one process with the "
                    "other's elsewhere)")
    return None


def whole_tensors(maps: Mapping[str, MapLike], trainers: int) -> list[str]:
    """The tensors of ``maps`` that every one of ``trainers`` processes (at least two) holds
    whole and laid out alike: their shards must be equal byte for byte."""
    if trainers < 2:
        return []
    out = []
    for name, m in maps.items():
        ranks = as_map(m).to_dict().get("ranks", {})
        first = ranks.get("0")
        if first is None or len(ranks) != trainers or \
                any(r.get("buffer") for r in ranks.values()):
            continue
        pieces = first.get("pieces") or []
        if pieces and all(len(p.get("locations", [])) == trainers for p in pieces) and \
                all(r.get("pieces") == pieces for r in ranks.values()):
            out.append(name)
    return out


# The most elements of one tensor a push's agreement digests: a tensor above it is sampled at
# evenly spaced elements (its last one included), so the check costs the same for a model held
# whole on every process (data parallel) as for the few norms of tensor parallelism. Two pushes
# of different weights differ in a share of the elements (an optimizer step changes a few percent
# of bf16 values), which a sample this large misses with a vanishing chance.
_DIGEST_ELEMENTS = 1 << 20


def whole_digests(shards: Mapping[str, Any], names: Sequence[str]) -> dict[str, str]:
    """A digest of the elements of each of ``names`` among ``shards`` (all of them, or an
    evenly spaced sample of ``_DIGEST_ELEMENTS`` of a larger tensor; those missing or not
    tensors are left to the push's own checks)."""
    import torch
    out = {}
    for name in names:
        t = shards.get(name)
        if isinstance(t, torch.Tensor):
            flat = t.detach().reshape(-1)
            if flat.numel() > _DIGEST_ELEMENTS:
                step = -(-flat.numel() // _DIGEST_ELEMENTS)
                flat = torch.cat([flat[::step], flat[-1:]])
            data = flat.contiguous().view(torch.uint8).cpu().numpy()
            out[name] = hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest()
    return out
