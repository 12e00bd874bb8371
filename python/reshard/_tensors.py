"""extract / rebuild / transfer on torch tensors and numpy arrays, without copies.

Each tensor is handed to the compiled core as the address of its first element (a view into a
larger buffer starts wherever it starts: torch's ``data_ptr()`` and numpy's array interface
already include the storage offset). A dense row-major input is read where it lies; any other
input (transposed, strided, broadcast, negative strides) is first copied into a dense one. An
``out=`` tensor is written in place; one that is not dense is filled through a dense temporary.
The copies run in C++ with the GIL released. Only host (CPU) memory is accepted.

What an ``out=`` must be (checked before anything is written, ValueError otherwise): writable
(a numpy array's flag; for a torch tensor, which has none, memory that is not mapped read-only
and not the contents of a ``bytes``), without elements that share memory (a zero stride, as
``expand`` or ``broadcast_to`` give), without torch's negative or conjugate bit, and not
requiring grad while grad mode is on (as torch's in-place operations refuse). An input whose
memory the output overlaps (an ``out`` that is a view of ``full``, or of a source shard) is
copied first, so the result is what it would be without the overlap; outputs that overlap
each other are refused. A torch input with the negative or conjugate bit is read as its value.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Mapping, Optional, Sequence, Union

from . import _core
from ._maps import MapLike, ParamMap, Plan, as_map

# torch dtype names (without "torch.") and numpy dtype names (ml_dtypes' for bfloat16 and
# fp8) -> the library's dtype names.
_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}
_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
          "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}

Tensor = Any  # torch.Tensor or numpy.ndarray

# New torch outputs of at least this many bytes get transparent huge pages (numpy's threshold):
# a fresh allocation faults in page by page during the copy, and with 4 KiB pages the faults
# cost several times the copy itself.
_HUGE_PAGE_ADVICE_BYTES = 4 << 20


def _dtype_key(dtype: Any) -> str:
    text = str(getattr(dtype, "name", None) or dtype)
    return text[len("torch."):] if text.startswith("torch.") else text


# torch / numpy dtype objects -> the library's dtype names (None: not one reshard moves), filled
# as dtypes are met: looking a dtype up is then one dict access per tensor.
_NAME_OF: dict[Any, Optional[str]] = {}


def _dtype_name(dtype: Any) -> Optional[str]:
    try:
        return _NAME_OF[dtype]
    except KeyError:
        name = _NAME_OF[dtype] = _DTYPES.get(_dtype_key(dtype))
        return name


def itemsize(dtype: Any) -> int:
    """Bytes per element of a torch or numpy dtype, a dtype name ("BF16") or an int."""
    if isinstance(dtype, int):
        return dtype
    np = sys.modules.get("numpy")
    if np is not None and isinstance(dtype, type) and issubclass(dtype, np.generic):
        dtype = np.dtype(dtype)
    name = dtype if dtype in _SIZES else _DTYPES.get(_dtype_key(dtype))
    if name is None:
        raise ValueError(f"reshard does not move tensors of dtype {dtype}")
    return _SIZES[name]


def zeros_of(dtype_name: str, shape: tuple[int, ...], like: Any = None) -> Tensor:
    """A zeroed tensor of a library dtype name ("BF16"): torch, or numpy when ``like`` is a
    numpy array (ml_dtypes supplies numpy's bfloat16 and fp8)."""
    names = {v: k for k, v in _DTYPES.items()}
    if dtype_name not in names:
        raise ValueError(f"unknown dtype {dtype_name!r}")
    np = sys.modules.get("numpy")
    if like is not None and np is not None and isinstance(like, np.ndarray):
        if dtype_name in ("BF16", "F8_E4M3", "F8_E5M2"):
            import ml_dtypes
            return np.zeros(shape, dtype=getattr(ml_dtypes, names[dtype_name]))
        return np.zeros(shape, dtype=names[dtype_name])
    import torch
    return torch.zeros(shape, dtype=getattr(torch, names[dtype_name]))


# Python types -> "torch", "numpy" or None, as met (a subclass such as torch.nn.Parameter
# counts as its base).
_KIND_OF: dict[type, Optional[str]] = {}


def _kind_of(cls: type) -> Optional[str]:
    try:
        return _KIND_OF[cls]
    except KeyError:
        pass
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    kind = ("torch" if torch is not None and issubclass(cls, torch.Tensor) else
            "numpy" if np is not None and issubclass(cls, np.ndarray) else None)
    if kind is not None:  # a type not (yet) recognised may be once its module is imported
        _KIND_OF[cls] = kind
    return kind


def _strides_in_bytes(x: Tensor, kind: str) -> tuple[int, ...]:
    if kind == "torch":
        size = int(x.element_size())
        return tuple(int(s) * size for s in x.stride())
    return tuple(int(s) for s in x.strides)


def _itemsize_of(x: Tensor, kind: str) -> int:
    return int(x.element_size()) if kind == "torch" else int(x.itemsize)


def _address_of(x: Tensor, kind: str) -> int:
    if kind == "torch":
        return int(x.data_ptr())
    return int(x.__array_interface__["data"][0])


def _extent(x: Tensor, kind: str) -> Optional[tuple[int, int]]:
    """The bytes [lo, hi) the elements of x lie in; None when it has no elements."""
    lo = hi = _address_of(x, kind)
    for n, s in zip(x.shape, _strides_in_bytes(x, kind)):
        if n == 0:
            return None
        if s > 0:
            hi += s * (n - 1)
        else:
            lo += s * (n - 1)
    return lo, hi + _itemsize_of(x, kind)


def _overlap(a: Optional[tuple[int, int]], b: Optional[tuple[int, int]]) -> bool:
    return a is not None and b is not None and a[0] < b[1] and b[0] < a[1]


def _shares_elements(x: Tensor, kind: str) -> bool:
    """Whether two elements of x may lie at the same address (a zero stride, or strides that
    interleave): dimensions sorted by stride, each must step over all of the smaller ones."""
    dims = sorted((abs(s), n) for n, s in zip(x.shape, _strides_in_bytes(x, kind)) if n != 1)
    if any(n == 0 for _, n in dims):
        return False
    span = _itemsize_of(x, kind)
    for s, n in dims:
        if s < span:
            return True
        span = s * (n - 1) + span
    return False


def check_writable(x: Tensor, kind: str, what: str) -> None:
    """Refuses an output that must not be written in place (see the module's docstring)."""
    if _shares_elements(x, kind):
        raise ValueError(f"{what} has elements that share memory (strides {list(_strides_in_bytes(x, kind))} "
                         f"bytes for shape {list(x.shape)}, as expand or broadcast_to give); "
                         "give an output whose every element has its own memory")
    if kind == "numpy":
        if not x.flags.writeable:
            raise ValueError(f"{what} is read-only")
        return
    import torch
    if x.is_neg() or x.is_conj():
        raise ValueError(f"{what} has torch's {'negative' if x.is_neg() else 'conjugate'} bit "
                         "set: reshard writes raw memory, which would hold the wrong sign; give "
                         "a tensor without it (resolve_neg() / resolve_conj() make one)")
    if x.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{what} requires grad: reshard writes it in place, which autograd "
                         "does not see; write under torch.no_grad() or give out.detach()")
    if not x.is_cpu:
        return
    storage = x.untyped_storage()
    if storage.resizable():  # memory torch allocated itself: writable
        return
    extent = _extent(x, kind)
    if extent is None:
        return
    why = _core.why_not_writable(int(storage.data_ptr()), extent[0], extent[1] - extent[0])
    if why:
        raise ValueError(f"{what} is read-only: its memory {why}; give a writable tensor")


class _Array:
    """A CPU tensor or array seen as memory: its kind, dtype name, shape and first address."""

    __slots__ = ("obj", "kind", "dtype", "shape", "dense")

    def __init__(self, x: Tensor, what: str, output: bool = False) -> None:
        kind = _kind_of(type(x))
        if kind == "torch":
            if not x.is_cpu:
                raise ValueError(f"{what} is on device {x.device}; reshard copies host memory: "
                                 "give a CPU tensor")
            if not output and (x.is_neg() or x.is_conj()):
                x = x.resolve_neg().resolve_conj()  # the values, not the raw memory
            self.dense = x.is_contiguous()
        elif kind == "numpy":
            if not x.dtype.isnative:
                x = x.astype(x.dtype.newbyteorder("="))
            self.dense = x.flags.c_contiguous
        else:
            raise TypeError(f"{what} must be a torch.Tensor or a numpy.ndarray, "
                            f"got {type(x).__name__}")
        self.kind = kind
        self.obj = x
        self.shape = tuple(x.shape)  # ints already (torch.Size is a tuple)
        name = _dtype_name(x.dtype)
        if name is None:
            raise ValueError(f"{what} has dtype {x.dtype}, which reshard does not move")
        self.dtype = name

    def address(self) -> int:
        if self.kind == "torch":
            return int(self.obj.data_ptr())
        return int(self.obj.__array_interface__["data"][0])

    def extent(self) -> Optional[tuple[int, int]]:
        return _extent(self.obj, self.kind)

    def copied(self) -> "_Array":
        """A dense copy in memory of its own."""
        if self.kind == "torch":
            import torch
            return _Array(self.obj.clone(memory_format=torch.contiguous_format), "a copy")
        import numpy as np
        return _Array(np.array(self.obj, order="C", copy=True), "a copy")

    def densified(self) -> "_Array":
        """Self when dense; else a dense copy (its elements in row-major order)."""
        if self.dense:
            return self
        import numpy as np  # only reached with a numpy array
        copy = self.obj.contiguous() if self.kind == "torch" else np.ascontiguousarray(self.obj)
        return _Array(copy, "a copy")

    def empty(self, shape: tuple[int, ...]) -> Tensor:
        """A new dense tensor of this kind and dtype, not filled: every output is written in
        full. A large torch tensor's pages are advised huge (numpy advises its own)."""
        if self.kind == "torch":
            import torch
            t = torch.empty(shape, dtype=self.obj.dtype)
            nbytes = t.numel() * t.element_size()
            if nbytes >= _HUGE_PAGE_ADVICE_BYTES:
                _core.advise_huge_pages(t.data_ptr(), nbytes)
            return t
        import numpy as np
        return np.empty(shape, dtype=self.obj.dtype)


def _check_shape(a: _Array, shape: tuple[int, ...], what: str) -> None:
    if a.shape != shape:
        raise ValueError(f"{what} has shape {list(a.shape)}; the map needs {list(shape)}")


class _Output:
    """Where a result goes: a new tensor like `like`, or the caller's `out` (checked: dtype,
    shape, device, writable), through a dense temporary when `out` is not dense."""

    def __init__(self, out: Optional[Tensor], like: _Array, shape: tuple[int, ...], what: str,
                 buffer: str = ""):
        # A buffer (DESIGN 16) is written only where this tensor's pieces lie: a new one starts
        # zeroed, and a non-dense `out` is staged through a copy of itself.
        self.what = what
        self.given = out is not None
        if out is None:
            self.result = like.empty(shape)
            if buffer:
                self.result[...] = 0
            self.target = _Array(self.result, what)
            return
        a = _Array(out, what, output=True)
        if a.dtype != like.dtype:
            raise ValueError(f"{what} has dtype {out.dtype} but the input is {like.obj.dtype}")
        _check_shape(a, shape, what)
        check_writable(out, a.kind, what)
        self.result = out
        if a.dense:
            self.target = a
        else:
            temp = a.empty(shape)
            if buffer:
                temp[...] = out
            self.target = _Array(temp, what)

    def address(self) -> int:
        return self.target.address()

    def extent(self) -> Optional[tuple[int, int]]:
        """The memory the copy writes (the caller's, or a temporary's)."""
        return self.target.extent()

    def finish(self) -> Tensor:
        if self.target.obj is not self.result:  # written through a dense temporary
            if self.target.kind == "torch":
                self.result.copy_(self.target.obj)
            else:
                self.result[...] = self.target.obj
        return self.result


def _staged(inputs: list[_Array], outputs: list[_Output]) -> list[_Array]:
    """The inputs, each copied first where an output writes memory it is read from (a view of
    the input given as out): the copy reads what the input held before anything was written.
    Outputs that overlap each other are refused: one would overwrite the other."""
    outputs = [o for o in outputs if o.given]  # a new tensor overlaps nothing
    if not outputs:
        return inputs
    extents = [o.extent() for o in outputs]
    for i, extent in enumerate(extents):
        for j in range(i):
            if _overlap(extent, extents[j]):
                raise ValueError(f"{outputs[i].what} and {outputs[j].what} overlap in memory; "
                                 "give outputs that do not share memory")
    staged = []
    for a in inputs:
        mine = a.extent()
        staged.append(a.copied() if any(_overlap(mine, e) for e in extents) else a)
    return staged


@functools.lru_cache(maxsize=64)
def _options(scale_power: int, verify_replicas: bool, allow_scaled_optimizer_state: bool,
             allow_lossy_scale: bool, num_threads: int) -> _core.ExecOptions:
    """The options object for these values, made once (the core only reads it)."""
    check_options(scale_power, num_threads)
    return _core.ExecOptions(scale_power, verify_replicas, allow_scaled_optimizer_state,
                             allow_lossy_scale, num_threads)


def check_options(scale_power: Any, num_threads: Any) -> None:
    """ValueError for a scale power or thread count that is not an int the core takes."""
    for name, value, lo in (("scale_power", scale_power, -(2**31)), ("num_threads", num_threads, 0)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if not lo <= value < 2**31:
            raise ValueError(f"{name} is {value}; give an int in [{lo}, 2**31)"
                             + (" (0: one thread per hardware thread)" if lo == 0 else ""))


def _by_rank(shards: Union[Sequence[Tensor], Mapping[int, Tensor]], world: int,
             what: str) -> list[Tensor]:
    """Shards given as a list by rank or a dict rank -> tensor, as a list of `world`."""
    if isinstance(shards, Mapping):
        missing = [r for r in range(world) if r not in shards]
        extra = sorted(set(shards) - set(range(world)), key=str)
        if missing or extra:
            raise ValueError(f"{what}: the map has ranks 0..{world - 1}; "
                             + (f"missing {missing}" if missing else f"unknown ranks {extra}"))
        return [shards[r] for r in range(world)]
    shards = list(shards)
    if len(shards) != world:
        raise ValueError(f"{what}: {len(shards)} given, the map has {world} ranks")
    return shards


def _same_dtype(arrays: list[_Array], what: str) -> None:
    for r, a in enumerate(arrays):
        if a.dtype != arrays[0].dtype:
            raise ValueError(f"{what}: rank {r} has dtype {a.obj.dtype}, rank 0 has "
                             f"{arrays[0].obj.dtype}")


def _shard_arrays(m: ParamMap, shards: Union[Sequence[Tensor], Mapping[int, Tensor]]) -> list[_Array]:
    """The shards of every rank of `m`, checked (one dtype, each its rank's shape) and dense."""
    given = _by_rank(shards, m.world_size, "shards")
    arrays = [_Array(s, f"shards[{r}]") for r, s in enumerate(given)]
    _same_dtype(arrays, "shards")
    for r, a in enumerate(arrays):
        _check_shape(a, m.shard_shape(r), f"shards[{r}]")
    return [a.densified() for a in arrays]


def extract(map: MapLike, full: Tensor, rank: int, out: Optional[Tensor] = None, *,
            scale_power: int = 1, allow_scaled_optimizer_state: bool = False,
            allow_lossy_scale: bool = False, num_threads: int = 0) -> Tensor:
    """F -> the shard of ``rank``: a new tensor of the kind given, or ``out`` filled in place.
    When the map keeps that rank's pieces in a buffer (:meth:`ParamMap.buffer`), the shard is the
    whole buffer: only the tensor's pieces are written (a new buffer starts zeroed), so extracting
    every tensor of a :class:`BufferSet` into one ``out`` fills it.

    ``scale_power`` p: the shard holds F * scale**p (1 for weights, -1 / -2 for Adam's moments).
    """
    m = as_map(map)
    shard_shape = m.shard_shape(rank)
    src = _Array(full, "full")
    _check_shape(src, m.logical_shape, "full")
    src = src.densified()
    dst = _Output(out, src, shard_shape, "out", m.buffer(rank))
    src = _staged([src], [dst])[0]
    _core.extract_into(m._handle, src.dtype, rank, src.address(), dst.address(),
                       _options(scale_power, True, allow_scaled_optimizer_state,
                                allow_lossy_scale, num_threads))
    return dst.finish()


def rebuild(map: MapLike, shards: Union[Sequence[Tensor], Mapping[int, Tensor]],
            out: Optional[Tensor] = None, *, verify_replicas: bool = True, scale_power: int = 1,
            allow_scaled_optimizer_state: bool = False, allow_lossy_scale: bool = False,
            num_threads: int = 0) -> Tensor:
    """Shards (a list by rank, or a dict rank -> tensor) -> F. With ``verify_replicas``, ranks
    that hold the same elements must agree bit for bit (ValueError naming where they differ)."""
    m = as_map(map)
    arrays = _shard_arrays(m, shards)
    dst = _Output(out, arrays[0], m.logical_shape, "out")
    arrays = _staged(arrays, [dst])
    _core.rebuild_into(m._handle, arrays[0].dtype, [a.address() for a in arrays], dst.address(),
                       _options(scale_power, verify_replicas, allow_scaled_optimizer_state,
                                allow_lossy_scale, num_threads))
    return dst.finish()


def transfer(plan: Plan, shards: Union[Sequence[Tensor], Mapping[int, Tensor]],
             out: Union[None, Sequence[Tensor], Mapping[int, Tensor]] = None, *,
             scale_power: int = 1, allow_scaled_optimizer_state: bool = False,
             allow_lossy_scale: bool = False,
             num_threads: int = 0) -> Union[list[Tensor], dict[int, Tensor]]:
    """Runs a plan: source shards (by source rank) -> target shards (by target rank), as a
    list, or a dict when ``shards`` is a dict. ``out`` (a list or dict by target rank) is
    written in place. Where a map keeps a rank's pieces in a buffer (DESIGN 16), that rank's
    shard is the whole buffer and only the tensor's pieces of it are read or written; a new
    target buffer starts zeroed."""
    if not isinstance(plan, Plan):
        raise TypeError(f"expected a reshard.Plan (from reshard.compose), got {type(plan).__name__}")
    src_map, dst_map = plan.source, plan.target
    arrays = _shard_arrays(src_map, shards)
    outs = [None] * dst_map.world_size if out is None else _by_rank(out, dst_map.world_size, "out")
    targets = [_Output(o, arrays[0], dst_map.shard_shape(r), f"out[{r}]", dst_map.buffer(r))
               for r, o in enumerate(outs)]
    arrays = _staged(arrays, targets)
    sizes = [_numel(src_map.shard_shape(r)) for r in range(src_map.world_size)]
    _core.transfer_into(plan._plan, arrays[0].dtype,
                        [(a.address(), n) for a, n in zip(arrays, sizes)],
                        [(t.address(), _numel(dst_map.shard_shape(r))) for r, t in enumerate(targets)],
                        _options(scale_power, True, allow_scaled_optimizer_state,
                                 allow_lossy_scale, num_threads))
    results = [t.finish() for t in targets]
    if isinstance(shards, Mapping):
        return dict(enumerate(results))
    return results


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


__all__ = ["extract", "rebuild", "transfer", "itemsize"]
