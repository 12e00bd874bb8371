"""Param maps and transfer plans as Python objects (DESIGN 6.1, 6.4)."""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, NamedTuple, Union

from . import _core
from ._errors import MapError

Shape = tuple[int, ...]
View = tuple[int, Shape]  # (offset, strides), in elements


class Piece(NamedTuple):
    """One affine block of a rank's shard: ``shape`` elements of F read at ``source`` and held
    at ``dest`` (both ``(offset, strides)`` in elements), multiplied by ``scale``, held by
    every rank in ``locations``."""

    shape: Shape
    source: View
    dest: View
    locations: tuple[int, ...]
    scale: float = 1.0


class Move(NamedTuple):
    """One copy of a plan: ``shape`` elements from source rank ``src_rank``'s shard at ``src``
    to target rank ``dst_rank``'s shard at ``dst``, multiplied by ``factor``."""

    src_rank: int
    dst_rank: int
    shape: Shape
    src: View
    dst: View
    factor: float = 1.0


def _view(value: Any) -> View:
    offset, strides = value
    return int(offset), tuple(int(s) for s in strides)


class ParamMap:
    """Which elements of a parameter's full tensor F each rank's shard holds.

    Build one with :meth:`from_dict` or :meth:`from_json` (our form or DeepSpeed's
    ``ParamAffineMap.to_dict()``). A map is validated when it is built unless
    ``validate=False``, in which case :meth:`validate` (or anything that needs a valid map)
    raises :class:`reshard.MapError` naming the first violation.
    """

    __slots__ = ("_handle", "_shapes")

    def __init__(self, handle: _core.Map) -> None:
        self._handle = handle
        self._shapes: dict[int, Shape] = {}  # shard shapes by rank, as first asked for

    @classmethod
    def from_json(cls, text: Union[str, bytes], *, validate: bool = True) -> "ParamMap":
        if isinstance(text, bytes):
            text = text.decode()
        return cls(_core.Map.from_json(text, validate))

    @classmethod
    def from_dict(cls, entry: Mapping[str, Any], *, validate: bool = True) -> "ParamMap":
        if isinstance(entry, ParamMap):
            return entry
        return cls.from_json(json.dumps(entry), validate=validate)

    def to_json(self) -> str:
        """Deterministic JSON: the same map always gives the same text."""
        return str(self._handle.to_json())

    def to_dict(self) -> dict[str, Any]:
        """Plain values (rank keys are strings, as in JSON); DeepSpeed's
        ``ParamAffineMap.from_dict`` reads it."""
        result: dict[str, Any] = json.loads(self.to_json())
        return result

    def validate(self) -> None:
        """Raises MapError naming the parameter's first violation of DESIGN 2.1."""
        self._handle.validate()

    def canonical(self) -> "ParamMap":
        """The same map with as few pieces per rank as the geometry allows."""
        return ParamMap(self._handle.canonical())

    @property
    def logical_shape(self) -> Shape:
        return tuple(self._handle.logical_shape)

    @property
    def valid_shape(self) -> Shape:
        """The unpadded shape (equal to logical_shape without padding)."""
        return tuple(self._handle.valid_shape)

    @property
    def world_size(self) -> int:
        return int(self._handle.world_size)

    def shard_shape(self, rank: int) -> Shape:
        shape = self._shapes.get(rank)
        if shape is None:
            shape = self._shapes[rank] = tuple(self._handle.shard_shape(rank))
        return shape

    def buffer(self, rank: int) -> str:
        """The buffer (DESIGN 16) whose elements rank ``rank``'s pieces write, or "" when the rank
        holds a shard of its own. A buffered rank's :meth:`shard_shape` is the buffer's shape."""
        return str(self._handle.buffer(rank))

    def pieces(self, rank: int) -> list[Piece]:
        self.shard_shape(rank)  # IndexError for a rank outside the world
        entries = self.to_dict()["ranks"][str(rank)]["pieces"]
        return [Piece(tuple(e["shape"]), _view(e["source"]), _view(e["dest"]),
                      tuple(e["locations"]), float(e.get("scale", 1.0))) for e in entries]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ParamMap):
            return NotImplemented
        return bool(self._handle == other._handle)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        try:
            summary = self._handle.summary()
        except MapError as e:  # an invalid map still prints
            return f"<ParamMap logical_shape={self.logical_shape} world_size={self.world_size} invalid: {e}>"
        padding = "" if self.valid_shape == self.logical_shape else f" valid_shape={self.valid_shape}"
        ranks = ", ".join(f"{r}: {self.shard_shape(r)} in {p} piece{'s' if p != 1 else ''}"
                          + (f", {rep} replicated" if rep else "") + (f", {sc} scaled" if sc else "")
                          for r, (p, _, rep, sc) in enumerate(summary))
        return (f"<ParamMap logical_shape={self.logical_shape}{padding} "
                f"world_size={self.world_size} shards {{{ranks}}}>")


MapLike = Union[ParamMap, Mapping[str, Any]]


def as_map(value: MapLike) -> ParamMap:
    """A ParamMap, or a dict in our form or DeepSpeed's, as a validated ParamMap."""
    if isinstance(value, ParamMap):
        return value
    if isinstance(value, Mapping):
        return ParamMap.from_dict(value)
    raise TypeError(f"expected a reshard.ParamMap or a dict, got {type(value).__name__}")


class Plan:
    """The moves that take shards laid out by ``source`` to shards laid out by ``target``
    without building F (DESIGN 4). Made by :func:`reshard.compose`."""

    __slots__ = ("_plan", "source", "target", "_moves")

    def __init__(self, plan: _core.Plan, source: ParamMap, target: ParamMap) -> None:
        self._plan = plan
        self.source = source
        self.target = target
        self._moves: list[Move] | None = None

    @property
    def moves(self) -> list[Move]:
        if self._moves is None:
            self._moves = [Move(d["src_rank"], d["dst_rank"], tuple(d["shape"]), _view(d["src"]),
                                _view(d["dst"]), float(d["factor"]))
                           for d in (self._plan.move(i) for i in range(self._plan.num_moves))]
        return self._moves

    @property
    def source_world(self) -> int:
        return int(self._plan.source_world)

    @property
    def target_world(self) -> int:
        return int(self._plan.target_world)

    @property
    def elements_moved(self) -> int:
        return int(self._plan.num_moved_elements())

    def bytes_moved(self, dtype: Any) -> int:
        """Bytes the moves copy for elements of ``dtype`` (a torch or numpy dtype, a
        safetensors name such as "BF16", or an element size in bytes)."""
        from ._tensors import itemsize
        return self.elements_moved * itemsize(dtype)

    def to_json(self) -> str:
        """The plan as a plan document (DESIGN 6.4) of one parameter named ""."""
        return str(self._plan.to_json())

    def to_dict(self) -> dict[str, Any]:
        """``{"source_world", "target_world", "moves": [...], "unwritten"?}``."""
        result: dict[str, Any] = json.loads(self.to_json())["params"][""]
        return result

    def __repr__(self) -> str:
        return (f"<Plan {self.source_world} -> {self.target_world} ranks, "
                f"{self._plan.num_moves} moves, {self.elements_moved} elements>")


def compose(*, source: MapLike, target: MapLike) -> Plan:
    """The transfer plan from shards laid out by ``source`` to shards laid out by ``target``."""
    src, dst = as_map(source), as_map(target)
    return Plan(_core.compose(dst._handle, src._handle), src, dst)


def infer(index_maps: Union[str, Mapping[str, Any]], *, allow_uncovered: bool = False) -> ParamMap:
    """The canonical map that explains observed index maps (DESIGN 6.3)."""
    text = index_maps if isinstance(index_maps, str) else json.dumps(index_maps)
    return ParamMap(_core.infer(text, allow_uncovered))


def _is_json_text(source: str) -> bool:
    """Whether a str is a document's JSON text rather than a path: an object (``{`` ... ``}``,
    after a byte-order mark and whitespace) that names no file."""
    text = source.lstrip("\ufeff \t\r\n").rstrip(" \t\r\n")
    return text.startswith("{") and text.endswith("}") and not os.path.lexists(source)


def _document(source: Union[str, os.PathLike[str], Mapping[str, Any]]
              ) -> tuple[Union[str, bytes], str]:
    """A map document's text and the path it was read from ("" for text or a dict). A path is
    read as the CLI reads its inputs (a FIFO nobody writes is refused at once)."""
    if isinstance(source, Mapping):
        return json.dumps(source), ""
    if isinstance(source, str) and _is_json_text(source):
        return source, ""
    path = os.fspath(source)
    if not isinstance(path, str):
        raise TypeError(f"a map document is a path, JSON text or a dict, got {type(path).__name__}")
    if "\0" in path:
        raise ValueError(f"embedded null byte in path {path!r}")
    return _core.read_text_file(path), path


def read_maps(source: Union[str, os.PathLike[str], Mapping[str, Any]]) -> dict[str, ParamMap]:
    """A map document (a path, JSON text or a dict) as ``{name: ParamMap}`` in file order;
    ``^name$`` keys are read as names; a bare param map is one entry named "". A version-2
    document's buffers are checked with its maps (:func:`reshard.read_buffers` returns them).
    A str is JSON text when it is an object (``{...}``, a byte-order mark allowed) and names no
    file; otherwise a path, read as the CLI reads it."""
    text, path = _document(source)
    return {name: ParamMap(h) for name, h in _core.read_map_document(text, path)}


def maps_to_json(maps: Mapping[str, MapLike]) -> str:
    """``{name: map}`` as a map document (DESIGN 6.2), deterministic."""
    params = [(name, as_map(m)._handle) for name, m in maps.items()]
    return str(_core.write_map_document(params))

