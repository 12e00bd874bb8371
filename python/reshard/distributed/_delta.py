"""How a delta push encodes a chunk (DESIGN 22; the encodings are src/reshard/exec/delta.h): what changed since the chunk last travelled,
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

from .. import _core

if TYPE_CHECKING:
    import torch

WHOLE, MASK, INDICES = 0, 1, 2
NAMES = {WHOLE: "whole", MASK: "mask", INDICES: "indices"}


def encode(previous: "torch.Tensor", current: "torch.Tensor"
           ) -> "tuple[int, int, torch.Tensor]":
    """(encoding, changed words, payload bytes) of ``current`` against ``previous`` (two dense
    uint8 tensors of one even length: the chunk's words); the payload is ``current`` itself
    when the chunk travels whole."""
    import torch
    payload = torch.empty(current.numel(), dtype=torch.uint8)
    kind, count, n = _core.delta_encode(int(previous.data_ptr()), int(current.data_ptr()),
                                        current.numel() // 2, int(payload.data_ptr()),
                                        payload.numel())
    return kind, count, current if kind == WHOLE else payload[:n]


def decode(previous: "torch.Tensor", kind: int, count: int, payload: "torch.Tensor") -> None:
    """Applies an encoded chunk to ``previous`` (the receiver's copy: dense uint8, even length),
    in place: afterwards it holds the chunk as the sender packed it."""
    _core.delta_apply(int(previous.data_ptr()), previous.numel() // 2, kind, count,
                      int(payload.data_ptr()), payload.numel())
