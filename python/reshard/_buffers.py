"""Buffers (DESIGN 16): rank tensors that hold pieces of many checkpoint tensors."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Iterator, Mapping, NamedTuple, Optional, Union

from . import _core
from ._errors import MapError
from ._maps import MapLike, ParamMap, Shape, View, as_map


class Block(NamedTuple):
    """``shape`` elements of a buffer at the strided ``view`` ``(offset, strides)``."""

    shape: Shape
    view: View


class Buffer(NamedTuple):
    """One named rank tensor: its dtype name (``"BF16"``) and, per rank, its shape and the
    blocks that are padding (no checkpoint tensor has them); they hold ``fill`` (0 unless the
    document says otherwise: a constant such as vLLM's attention scale ``_k_scale`` = 1)."""

    name: str
    dtype: str
    shapes: tuple[Shape, ...]
    padding: tuple[tuple[Block, ...], ...]
    fill: float = 0.0

    def shape(self, rank: int) -> Shape:
        return self.shapes[_rank_of(rank, len(self.shapes), f"buffer {self.name!r}")]


def _rank_of(rank: Any, world: int, what: str) -> int:
    """``rank`` checked against a world of ``world`` ranks (an int, not a bool, and no negative
    index from the end)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank {rank!r}: {what} has ranks 0 .. {world - 1}")
    return rank


def _zero_fill(fill: float) -> bool:
    """Whether a fill is +0.0, the default (-0.0 is a fill of its own)."""
    return fill == 0.0 and math.copysign(1.0, fill) > 0


def _buffer_from_dict(name: str, entry: Mapping[str, Any]) -> Buffer:
    ranks = entry["ranks"]
    world = len(ranks)
    shapes = []
    padding = []
    for r in range(world):
        rank = ranks[str(r)]
        shapes.append(tuple(int(d) for d in rank["shape"]))
        padding.append(tuple(
            Block(tuple(int(d) for d in b["shape"]),
                  (int(b["view"][0]), tuple(int(s) for s in b["view"][1])))
            for b in rank.get("padding", ())))
    return Buffer(name, str(entry["dtype"]), tuple(shapes), tuple(padding),
                  float(entry.get("fill", 0.0)))


class BufferSet:
    """The buffers of one topology, validated with the maps that write into them.

    Every element of every buffer on every rank must be written by exactly one piece of one map,
    or be declared padding: ``BufferSet(decls, maps)`` raises :class:`reshard.MapError` naming
    the buffer, rank, element and writers otherwise. ``decls`` is the ``"buffers"`` object of a
    version-2 map document (``{name: {"dtype", "ranks": {"0": {"shape", "padding"?}}}}``) or
    :class:`Buffer` values.
    """

    __slots__ = ("_buffers", "_maps")

    def __init__(self, decls: Union[Mapping[str, Any], "list[Buffer]"],
                 maps: Mapping[str, MapLike]) -> None:
        if isinstance(decls, Mapping):
            decls_dict = dict(decls)
        else:
            decls_dict = {}
            for b in decls:
                if not isinstance(b, Buffer):
                    raise TypeError(f"buffers are reshard.Buffer values or a dict of "
                                    f"declarations, got {type(b).__name__}")
                if b.name in decls_dict:
                    raise MapError(f"buffers: \"{b.name}\" is declared twice")
                decls_dict[b.name] = _buffer_to_dict(b)
        self._maps = {name: as_map(m) for name, m in maps.items()}
        params = [(name, m._handle) for name, m in self._maps.items()]
        text = _core.write_map_document(params, json.dumps(decls_dict))
        buffers = json.loads(text).get("buffers", {})
        self._buffers = {name: _buffer_from_dict(name, b) for name, b in buffers.items()}

    @property
    def maps(self) -> dict[str, ParamMap]:
        """The maps over the buffers (and any others given), by tensor name."""
        return dict(self._maps)

    def __getitem__(self, name: str) -> Buffer:
        return self._buffers[name]

    def __contains__(self, name: object) -> bool:
        return name in self._buffers

    def __iter__(self) -> Iterator[str]:
        return iter(self._buffers)

    def __len__(self) -> int:
        return len(self._buffers)

    def tensors_of(self, buffer: str, rank: int) -> list[str]:
        """The tensors whose pieces rank ``rank``'s ``buffer`` holds, in map order."""
        return [name for name, m in self._maps.items() if m.buffer(rank) == buffer]

    def empty(self, rank: int, *, like: Any = None) -> dict[str, Any]:
        """New buffers of rank ``rank`` (``{name: tensor}``), every element the buffer's ``fill``
        (zero unless declared): torch tensors, or numpy arrays when ``like`` is a numpy array
        (dtypes from the declarations; numpy needs ml_dtypes for BF16 and FP8)."""
        from ._tensors import zeros_of
        if self._buffers:
            world = len(next(iter(self._buffers.values())).shapes)
            _rank_of(rank, world, "the buffer set")
        out = {}
        for name, b in self._buffers.items():
            t = zeros_of(b.dtype, b.shapes[rank], like)
            if not _zero_fill(b.fill):
                t[...] = b.fill
            out[name] = t
        return out

    def to_dict(self) -> dict[str, Any]:
        """The ``"buffers"`` object of a version-2 map document."""
        return {name: _buffer_to_dict(b) for name, b in self._buffers.items()}

    def to_json(self) -> str:
        """A version-2 map document of the maps and their buffers, deterministic."""
        params = [(name, m._handle) for name, m in self._maps.items()]
        return str(_core.write_map_document(params, json.dumps(self.to_dict())))

    def __repr__(self) -> str:
        world = len(next(iter(self._buffers.values())).shapes) if self._buffers else 0
        return f"BufferSet({len(self._buffers)} buffers, {len(self._maps)} maps, world {world})"


def _buffer_to_dict(b: Buffer) -> dict[str, Any]:
    if b.padding and len(b.padding) != len(b.shapes):
        raise MapError(f"buffers[\"{b.name}\"]: padding has {len(b.padding)} entries for "
                       f"{len(b.shapes)} ranks (one tuple of blocks per rank, or none)")
    ranks: dict[str, Any] = {}
    for r, shape in enumerate(b.shapes):
        entry: dict[str, Any] = {"shape": list(shape)}
        if b.padding and b.padding[r]:
            entry["padding"] = [{"shape": list(p.shape), "view": [p.view[0], list(p.view[1])]}
                                for p in b.padding[r]]
        ranks[str(r)] = entry
    out: dict[str, Any] = {"dtype": b.dtype}
    if not _zero_fill(b.fill):
        out["fill"] = b.fill
    out["ranks"] = ranks
    return out


def read_buffers(source: Union[str, os.PathLike[str], Mapping[str, Any]]) -> Optional[BufferSet]:
    """The buffers of a map document (a path, JSON text or a dict, as :func:`reshard.read_maps`
    tells them apart) with its maps, or None when it declares none (a version-1 document)."""
    from ._maps import _document
    text, path = _document(source)
    maps = {name: ParamMap(h) for name, h in _core.read_map_document(text, path)}
    decls = json.loads(_core.read_map_document_buffers(text, path))
    if not decls:
        return None
    return BufferSet(decls, maps)


__all__ = ["Block", "Buffer", "BufferSet", "read_buffers"]
