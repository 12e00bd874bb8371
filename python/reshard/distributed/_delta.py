"""How a delta push encodes a chunk (DESIGN 22): what changed since the chunk last travelled,
found by the sender against its own copy of what it sent, rebuilt by the receiver from its own
copy of what it received.

A chunk is compared as 16-bit words (one bf16 or fp16 element, half of a float32, two FP8
elements): the sender and the receiver both hold the chunk as it last travelled, so any word
granularity rebuilds the exact bytes. Three encodings, the smallest in bytes chosen per chunk:

- ``WHOLE``: the chunk as it is (every word changed, or most);
- ``MASK``: one bit per word (changed or not), then the changed words in order: about
  ``n / 16 + 2 c`` bytes for ``c`` changed words of ``n`` bytes;
- ``INDICES``: the changed words' int32 indices, then the words: ``6 c`` bytes.

The indices win up to one changed word in 32 (3.1 %), the mask up to 15 in 16, the whole chunk
above. An encoded chunk travels as one message; a header of three int64 per (sender,
receiver) pair (encoding, changed words, bytes) travels first, in the same round.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

WHOLE, MASK, INDICES = 0, 1, 2
NAMES = {WHOLE: "whole", MASK: "mask", INDICES: "indices"}


def words(n: int) -> int:
    """The 16-bit words of a chunk of ``n`` bytes (an odd last byte rounds up: staging is
    64-byte aligned, so the word is there on both sides)."""
    return (n + 1) // 2


def _mask_head(words: int) -> int:
    """The bytes of the changed-word bits of a mask encoding, even (the words follow)."""
    return ((words + 7) // 8 + 1) // 2 * 2


def encode(previous: "torch.Tensor", current: "torch.Tensor"
           ) -> "tuple[int, int, torch.Tensor]":
    """(encoding, changed words, payload bytes) of ``current`` against ``previous`` (two uint8
    tensors of one even length: the chunk's words)."""
    import torch
    old, new = previous.view(torch.int16), current.view(torch.int16)
    changed = old != new
    count = int(changed.sum())
    n = current.numel()
    mask_bytes = _mask_head(old.numel()) + 2 * count
    if n <= min(mask_bytes, 6 * count):
        return WHOLE, count, current
    values = new[changed].view(torch.uint8)
    if 6 * count <= mask_bytes:
        where = changed.nonzero().reshape(-1).to(torch.int32).view(torch.uint8)
        return INDICES, count, torch.cat([where, values])
    bits = torch.nn.functional.pad(changed, (0, _mask_head(old.numel()) * 8 - old.numel()))
    bits = bits.view(-1, 8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
    packed = (bits.to(torch.uint8) * weights).sum(1, dtype=torch.uint8)
    return MASK, count, torch.cat([packed, values])


def payload_bytes(kind: int, count: int, n: int) -> int:
    """The bytes an encoded chunk of ``n`` bytes with ``count`` changed words travels as."""
    if kind == WHOLE:
        return n
    if kind == INDICES:
        return 6 * count
    return _mask_head(n // 2) + 2 * count


def decode(previous: "torch.Tensor", kind: int, count: int, payload: "torch.Tensor") -> None:
    """Applies an encoded chunk to ``previous`` (the receiver's copy, uint8, even length), in
    place: afterwards it holds the chunk as the sender packed it."""
    import torch
    old = previous.view(torch.int16)
    if kind == WHOLE:
        previous.copy_(payload)
        return
    if kind == INDICES:
        where = payload[:4 * count].view(torch.int32).to(torch.int64)
        old[where] = payload[4 * count:].view(torch.int16)
        return
    head = _mask_head(old.numel())
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
    bits = (payload[:head].reshape(-1, 1) & weights) != 0
    old[bits.reshape(-1)[:old.numel()]] = payload[head:].view(torch.int16)
