"""Block quantization at the source of a live re-sharding (DESIGN 14, 20).

A trainer holds a weight in bf16, split its own way; an engine holds it as FP8 blocks: data
(float8_e4m3fn, the weight's shape) and one float32 scale per block (128 x 128 for DeepSeek's
and Qwen3's FP8, vLLM's ``weight`` + ``weight_scale_inv``). :class:`QuantizingRedistributor`
moves the one into the other sending only FP8 bytes and scales:

1. each block of the weight gets an owner among the trainer processes: one that holds the
   block whole (among several, the blocks are dealt out in turn), else the one holding most
   of it. Every process stacks the blocks it owns, ``[n, *block]`` in the source dtype
   (edge blocks zero-filled): the pieces of split blocks travel to their owner, the rest are
   local copies (the first exchange, among the trainer processes only; its bytes are counted
   as ``gathered_sent`` / ``gathered_received``);
2. each owner quantizes its blocks (:func:`quantize_blocks`);
3. the FP8 blocks and their scales, with every tensor that is not quantized, go to the
   targets in one exchange of :class:`reshard.distributed.Redistributor`, the stacked blocks
   and their scales being source maps like any other.

The quantizer is vLLM's per-block FP8 cast (``per_block_cast_to_fp8``, from DeepGEMM), so an
engine's weights equal what vLLM makes of the same bf16 tensor: per block, amax = max |x| in
float32, clamped below at 1e-4; scale = amax / 448 (the largest finite E4M3 value) in
float32; data = (x * (1 / scale)) in float32, rounded to nearest even into float8_e4m3fn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, Union

from .. import _core
from .._maps import MapLike, ParamMap, as_map
from .._tensors import extract
from ._redistributor import (DEFAULT_BUCKET_BYTES, RedistributeError, Redistributor, Transport,
                             _alive, _layout_of_source, _message, _shards_of_source, _TorchGroup,
                             _weak)

if TYPE_CHECKING:
    import torch

    from ..torch import TorchSource

FP8_MAX = 448.0  # the largest finite float8_e4m3fn value
AMAX_FLOOR = 1e-4  # a block's amax is clamped below at this (vLLM's per_block_cast_to_fp8)
FORMATS = ("float8_e4m3fn",)
_SOURCE_DTYPES = ("bfloat16", "float16", "float32")  # widened exactly to float32


@dataclass(frozen=True)
class BlockQuant:
    """One tensor quantized at the source: ``data`` (its name on both sides), ``scale`` (the
    target name of its scales), ``block`` (one extent per dimension of the data)."""

    data: str
    scale: str
    block: tuple[int, ...]
    format: str = "float8_e4m3fn"


def quantize_blocks(blocks: "torch.Tensor") -> "tuple[torch.Tensor, torch.Tensor]":
    """``[n, *block]`` blocks (bf16, fp16 or fp32) -> (``[n, *block]`` float8_e4m3fn,
    ``[n]`` float32 scales), the arithmetic of the module's docstring. Zeros in a block (an
    edge block's padding) change neither its amax nor its other values."""
    import torch
    x = blocks.float()
    amax = x.abs().amax(dim=tuple(range(1, x.dim()))) if x.numel() else \
        torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    scale = amax.clamp(min=AMAX_FLOOR) / FP8_MAX
    inverse = (1.0 / scale).reshape((-1,) + (1,) * (x.dim() - 1))
    return (x * inverse).to(torch.float8_e4m3fn), scale


def quantize_fp8_blocks(full: "torch.Tensor", block: Sequence[int] = (128, 128)
                        ) -> "tuple[torch.Tensor, torch.Tensor]":
    """A whole tensor -> (FP8 data of its shape, float32 scales of its block grid
    ``ceil(shape / block)``), as :class:`QuantizingRedistributor` quantizes it."""
    import torch
    block = tuple(int(b) for b in block)
    if len(block) != full.dim():
        raise RedistributeError(f"block {list(block)} for a tensor of shape {list(full.shape)}: "
                                "give one extent per dimension")
    grid = [-(-s // b) for s, b in zip(full.shape, block)]
    padded = torch.zeros([g * b for g, b in zip(grid, block)], dtype=full.dtype,
                         device=full.device)
    padded[tuple(slice(0, s) for s in full.shape)] = full
    # [g0, b0, g1, b1, ...] -> [g0, g1, ..., b0, b1, ...]
    split = padded.reshape([v for g, b in zip(grid, block) for v in (g, b)])
    order = list(range(0, 2 * len(block), 2)) + list(range(1, 2 * len(block), 2))
    stacked = split.permute(order).reshape([-1, *block])
    data, scale = quantize_blocks(stacked)
    back = [0] * (2 * len(block))
    for i, k in enumerate(order):
        back[k] = i
    whole = data.reshape(grid + list(block)).permute(back).reshape(padded.shape)
    return whole[tuple(slice(0, s) for s in full.shape)].contiguous(), scale.reshape(grid)


def quant_specs(quantize: Any, source: Mapping[str, Any], target: Mapping[str, Any]
                ) -> list[BlockQuant]:
    """``quantize=`` -> the tensors it names. Either one spec for every target pair ``X`` +
    ``X{scale_suffix}`` whose scales the source lacks (``{"block": [128, 128], "format":
    "float8_e4m3fn", "scale_suffix": "_scale_inv"}``), or ``{X: {"scale": S, "block": [..],
    "format": ..}}``."""
    if not isinstance(quantize, Mapping):
        raise RedistributeError(f"quantize= must be a mapping, got {type(quantize).__name__}")
    if "block" in quantize:
        suffix = quantize.get("scale_suffix", "_scale_inv")
        shared = {k: v for k, v in quantize.items() if k != "scale_suffix"}
        specs: Mapping[str, Any] = {
            n: {**shared, "scale": n + str(suffix)} for n in sorted(source)
            if n + str(suffix) in target and n + str(suffix) not in source}
        if not specs:
            raise RedistributeError(f"quantize= applies to no tensor: no target map names "
                                    f"X{suffix} beside a source tensor X")
    else:
        specs = quantize
    return [_spec(str(name), spec, source, target) for name, spec in sorted(specs.items())]


def _spec(name: str, spec: Any, source: Mapping[str, Any], target: Mapping[str, Any]
          ) -> BlockQuant:
    what = f"quantize[\"{name}\"]"
    if not isinstance(spec, Mapping) or "scale" not in spec or "block" not in spec:
        raise RedistributeError(f"{what} must be {{\"scale\": name, \"block\": [..]}}, got "
                                f"{spec!r}")
    extra = sorted(set(spec) - {"scale", "block", "format"})
    if extra:
        raise RedistributeError(f"{what} has unknown keys {extra}")
    fmt = str(spec.get("format", FORMATS[0]))
    if fmt not in FORMATS:
        raise RedistributeError(f"{what}: format \"{fmt}\" is not one of {list(FORMATS)}")
    block = tuple(spec["block"])
    if not block or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in block):
        raise RedistributeError(f"{what}: block {list(block)} must be positive ints")
    scale = str(spec["scale"])
    for missing, side, where in ((name, "source", source), (name, "target", target),
                                 (scale, "target", target)):
        if missing not in where:
            raise RedistributeError(f"{what}: no {side} map for \"{missing}\"")
    if scale in source:
        raise RedistributeError(f"{what}: the source has a map for the scales \"{scale}\"; "
                                "they are made at the source, not moved")
    return BlockQuant(name, scale, block, fmt)


# -- where the blocks are --------------------------------------------------------------------

Box = tuple[tuple[int, ...], tuple[int, ...]]  # [start, stop) per dimension of F
_MAX_BOXES = 1 << 16  # per piece; a piece that needs more is refused


def _row_major(shape: Sequence[int]) -> list[int]:
    strides = [1] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        strides[k] = strides[k + 1] * max(int(shape[k + 1]), 1)
    return strides


def _flat_boxes(a: int, b: int, shape: Sequence[int]) -> list[Box]:
    """Flat indices [a, b) of a row-major ``shape`` as boxes (at most 2 per dimension)."""
    if a >= b:
        return []
    if len(shape) == 1:
        return [((a,), (b,))]
    inner = math.prod(shape[1:])
    first, last = a // inner, (b - 1) // inner

    def row(i: int, lo: int, hi: int) -> list[Box]:
        return [((i, *s), (i + 1, *e)) for s, e in _flat_boxes(lo, hi, shape[1:])]
    if first == last:
        return row(first, a - first * inner, b - first * inner)
    out: list[Box] = []
    if a % inner:
        out += row(first, a % inner, inner)
        first += 1
    tail = row(last, 0, b % inner) if b % inner else []
    if b % inner == 0:
        last += 1
    if first < last:
        out.append(((first,) + (0,) * (len(shape) - 1), (last, *shape[1:])))
    return out + tail


def _view_boxes(shape: Sequence[int], offset: int, strides: Sequence[int],
                logical: Sequence[int], budget: list[int]) -> list[Box]:
    """The boxes of F (row-major ``logical``) that a view reads: itself when it is a box,
    its flat run when contiguous, else its slices along its first dimension."""
    if 0 in shape:
        return []
    rm = _row_major(logical)
    if len(shape) == len(logical) and all(n == 1 or s == f for n, s, f in
                                          zip(shape, strides, rm)):
        start = [(offset // f) % max(L, 1) for f, L in zip(rm, logical)]
        if sum(s * f for s, f in zip(start, rm)) == offset and \
                all(s + n <= L for s, n, L in zip(start, shape, logical)):
            budget[0] -= 1
            return [(tuple(start), tuple(s + n for s, n in zip(start, shape)))]
    if all(n == 1 or s == f for n, s, f in zip(shape, strides, _row_major(shape))):
        budget[0] -= 1
        return _flat_boxes(offset, offset + math.prod(shape), logical)
    if len(shape) < 2 or budget[0] - shape[0] < 0:
        raise RedistributeError("a piece reads a strided or transposed view of the tensor "
                                "that is not a union of a few boxes")
    return [box for i in range(shape[0]) for box in
            _view_boxes(shape[1:], offset + i * strides[0], strides[1:], logical, budget)]


def _block_counts(m: ParamMap, block: Sequence[int], grid: list[int]) -> "torch.Tensor":
    """[ranks, *grid]: how many elements of each block each rank's shard holds."""
    import torch
    logical = m.logical_shape
    counts = torch.zeros([m.world_size, *grid], dtype=torch.int64)
    for r in range(m.world_size):
        for p in m.pieces(r):
            budget = [_MAX_BOXES]
            for lo, hi in _view_boxes(p.shape, p.source[0], p.source[1], logical, budget):
                ranges: list[Any] = [r]
                lengths: Optional[torch.Tensor] = None
                for a, b, n in zip(lo, hi, block):
                    j0, j1 = a // n, (b - 1) // n + 1
                    j = torch.arange(j0, j1)
                    length = torch.minimum(torch.tensor(b), (j + 1) * n) - \
                        torch.maximum(torch.tensor(a), j * n)
                    lengths = length if lengths is None else lengths.unsqueeze(-1) * length
                    ranges.append(slice(j0, j1))
                assert lengths is not None
                counts[tuple(ranges)] += lengths
    return counts


def _block_volumes(logical: Sequence[int], block: Sequence[int], grid: list[int]
                   ) -> "torch.Tensor":
    import torch
    out: Optional[torch.Tensor] = None
    for L, n, g in zip(logical, block, grid):
        j = torch.arange(g)
        ext = torch.minimum(torch.tensor(L), (j + 1) * n) - j * n
        out = ext if out is None else out.unsqueeze(-1) * ext
    assert out is not None
    return out


def block_owners(m: ParamMap, block: Sequence[int]) -> "tuple[torch.Tensor, torch.Tensor]":
    """(the owning source rank of every block, grid-shaped; whether it holds the block
    whole). A block held whole by several ranks goes to the (i mod holders)-th of them for
    block i in row-major order; one held whole by none to the rank holding most of it."""
    import torch
    logical = list(m.logical_shape)
    grid = [-(-L // n) for L, n in zip(logical, block)]
    counts = _block_counts(m, block, grid)
    whole = counts == _block_volumes(logical, block, grid)
    holders = whole.sum(0)
    turn = torch.arange(math.prod(grid)).reshape(grid) % holders.clamp(min=1)
    pick = whole & (whole.cumsum(0) == (turn + 1))
    owner = torch.where(holders > 0, pick.to(torch.int8).argmax(0), counts.argmax(0))
    return owner, holders > 0


def _owned_runs(owner: "torch.Tensor", rank: int, block: Sequence[int],
                logical: Sequence[int]) -> list[tuple[tuple[int, ...], int, int]]:
    """Rank ``rank``'s blocks as runs (grid index of the first, blocks in the run, stack
    index of the first): consecutive blocks of one grid row, all full along the last
    dimension but perhaps the last of the run."""
    grid = list(owner.shape)
    flat = (owner.reshape(-1) == rank).nonzero().reshape(-1).tolist()
    runs: list[tuple[tuple[int, ...], int, int]] = []
    last_full = logical[-1] % block[-1] == 0
    for i, f in enumerate(flat):
        g = tuple((f // s) % n for s, n in zip(_row_major(grid), grid))
        if runs:
            start, count, at = runs[-1]
            edge = start[-1] + count == grid[-1] and not last_full  # the run ends full
            if f == flat[i - 1] + 1 and g[:-1] == start[:-1] and not edge and \
                    (g[-1] < grid[-1] - 1 or last_full):
                runs[-1] = (start, count + 1, at)
                continue
        runs.append((g, 1, i))
    return runs


Run = tuple[int, int, tuple[int, ...]]  # (element offset in the shard, blocks, block extents)


def _world_of(owner: "torch.Tensor", world: Optional[int]) -> int:
    return world if world is not None else int(owner.max()) + 1 if owner.numel() else 0


def stacked_blocks_map(owner: "torch.Tensor", block: Sequence[int], logical: Sequence[int],
                       world: Optional[int] = None
                       ) -> tuple[dict[str, Any], dict[int, list[Run]]]:
    """The map of the blocks each rank owns, one after another in row-major grid order in a
    flat shard (an edge block takes only its own elements), and each rank's runs of blocks
    of one extent, for :func:`quantize_blocks`. ``world``: the ranks of the map (default: up
    to the last owner; a rank that owns no block holds an empty shard)."""
    fs = _row_major(logical)
    ranks, runs_of = {}, {}
    for r in range(_world_of(owner, world)):
        pieces, runs, at = [], [], 0
        for g, count, _ in _owned_runs(owner, r, block, logical):
            start = [j * n for j, n in zip(g, block)]
            ext = tuple(min(n, L - s) for n, L, s in zip(block, logical, start))
            volume = math.prod(ext)
            pieces.append({"shape": [count, *ext],
                           "source": [sum(s * f for s, f in zip(start, fs)),
                                      [block[-1] * fs[-1], *fs]],
                           "dest": [at, [volume, *_row_major(ext)]], "locations": [r]})
            runs.append((at, count, ext))
            at += count * volume
        ranks[str(r)] = {"shard_shape": [at], "pieces": pieces}
        runs_of[r] = runs
    return {"logical_shape": list(logical), "ranks": ranks}, runs_of


def quantize_runs(blocks: "torch.Tensor", runs: list[Run]
                  ) -> "tuple[torch.Tensor, torch.Tensor]":
    """A flat shard of :func:`stacked_blocks_map` -> (its FP8 bytes, one scale per block)."""
    import torch
    data = torch.empty(blocks.shape, dtype=torch.float8_e4m3fn, device=blocks.device)
    scales = []
    for at, count, ext in runs:
        n = count * math.prod(ext)
        q, s = quantize_blocks(blocks[at:at + n].view(count, *ext))
        data[at:at + n] = q.reshape(-1)
        scales.append(s)
    return data, (torch.cat(scales) if scales else
                  torch.empty(0, dtype=torch.float32, device=blocks.device))


def stacked_scales_map(owner: "torch.Tensor", scale_shape: Sequence[int],
                       world: Optional[int] = None) -> dict[str, Any]:
    """The map of the scales of the blocks each rank owns, ``[n]`` in the order of
    :func:`stacked_blocks_map`, over the scale tensor as stored (``scale_shape``: the grid up
    to unit dimensions, same row-major order), over ``world`` ranks as there."""
    flat_owner = owner.reshape(-1)
    ranks = {}
    for r in range(_world_of(owner, world)):
        flat = (flat_owner == r).nonzero().reshape(-1).tolist()
        pieces: list[dict[str, Any]] = []
        for i, f in enumerate(flat):
            if pieces and f == flat[i - 1] + 1:
                pieces[-1]["shape"][0] += 1
                continue
            pieces.append({"shape": [1], "source": [f, [1]], "dest": [i, [1]],
                           "locations": [r]})
        ranks[str(r)] = {"shard_shape": [len(flat)], "pieces": pieces}
    return {"logical_shape": list(scale_shape), "ranks": ranks}


# -- the two exchanges -----------------------------------------------------------------------

@dataclass
class _Planned:
    """One quantized tensor: its stacked blocks' map (over the source ranks), their runs per
    rank, and its scales' map in the same order."""

    spec: BlockQuant
    blocks: dict[str, Any]
    runs: dict[int, list[Run]]
    scales: dict[str, Any]


def _plan_tensor(spec: BlockQuant, source: ParamMap, data: ParamMap, scale: ParamMap
                 ) -> _Planned:
    what = f"quantizing \"{spec.data}\""
    if len(spec.block) != len(source.logical_shape):
        raise RedistributeError(f"{what}: block {list(spec.block)} for a tensor of shape "
                                f"{list(source.logical_shape)}: one extent per dimension")
    if source.valid_shape != source.logical_shape:
        raise RedistributeError(f"{what}: its source map pads the tensor (valid shape "
                                f"{list(source.valid_shape)}); block-quantized data has none")
    try:  # the engine's scales must be the block image of its data (ir/block_grid.h)
        _core.check_block_tie(data._handle, scale._handle, list(spec.block))
    except ValueError as e:
        raise RedistributeError(f"{what}: the target scales \"{spec.scale}\" cannot follow "
                                f"its target map: {e}") from None
    try:
        owner, _ = block_owners(source, spec.block)
    except RedistributeError as e:
        raise RedistributeError(f"{what}: {e}") from None
    world = source.world_size
    blocks, runs = stacked_blocks_map(owner, spec.block, source.logical_shape, world)
    return _Planned(spec, blocks, runs, stacked_scales_map(owner, scale.logical_shape, world))


def _check_scale_buffers(planned: list[_Planned], target: Mapping[str, ParamMap]) -> None:
    """Refuses target scale buffers in which two tensors' scales land on one element: a local
    block of the data buffer that takes elements of two tensors with scales of their own
    (vLLM's qkv_proj when k and v have 64 rows a rank), which no scale is right for."""
    import torch
    for t in range(next(iter(target.values())).world_size if target else 0):
        seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # buffer -> (count, owner)
        for i, p in enumerate(planned):
            m = target[p.spec.scale]
            buffer = m.buffer(t)
            if not buffer:
                continue
            count, first = seen.setdefault(buffer, (
                torch.zeros(m.shard_shape(t), dtype=torch.float32),
                torch.full(m.shard_shape(t), -1, dtype=torch.int64)))
            mine = torch.zeros(m.shard_shape(t), dtype=torch.float32)
            extract(m, torch.ones(m.logical_shape, dtype=torch.float32), t, out=mine)
            both = (mine > 0) & (count > 0)
            if bool(both.any()):
                other = planned[int(first[both][0])].spec
                at = [int(v) for v in both.nonzero()[0].tolist()]
                raise RedistributeError(
                    f"target rank {t}: the scale of local block {at} of buffer \"{buffer}\" "
                    f"would serve elements of \"{other.data}\" and \"{p.spec.data}\", which "
                    "have scales of their own: not exact without requantizing the fused "
                    "tensor; choose a degree at which each local block lies in one tensor")
            count += mine
            first[mine > 0] = i


def _check_buffer_names(planned: list[_Planned], source: Mapping[str, ParamMap]) -> None:
    """Refuses a source buffer of tensors that are not quantized named as a quantized tensor or
    its scales: the final exchange keys the quantized tensor's FP8 blocks by its name, so the
    two shards would take one key."""
    made = {n for p in planned for n in (p.spec.data, p.spec.scale)}
    quantized = {p.spec.data for p in planned}
    for name, m in sorted(source.items()):
        if name in quantized:
            continue
        clash = sorted({m.buffer(r) for r in range(m.world_size)} & made)
        if clash:
            raise RedistributeError(f"the source map of \"{name}\" keeps it in a buffer named "
                                    f"\"{clash[0]}\", the name of a quantized tensor or its "
                                    "scales; name the buffer otherwise")


def check_quantized_targets(quantize: Any, source_maps: Mapping[str, Any],
                            target_maps: Mapping[str, Any]) -> list[str]:
    """The tensors ``quantize`` quantizes into ``target_maps`` (sorted), after the checks
    :class:`QuantizingRedistributor` makes of them (RedistributeError otherwise)."""
    targets = {n: as_map(m) for n, m in target_maps.items()}
    planned = [_plan_tensor(spec, as_map(source_maps[spec.data]), targets[spec.data],
                            targets[spec.scale])
               for spec in quant_specs(quantize, source_maps, target_maps)]
    _check_scale_buffers(planned, targets)
    _check_buffer_names(planned, {n: as_map(m) for n, m in source_maps.items()})
    return sorted(p.spec.data for p in planned)


class QuantizingRedistributor:
    """A :class:`reshard.distributed.Redistributor` whose targets hold some tensors as FP8
    blocks (data + scales) that the sources hold in bf16, fp16 or fp32: each block quantized
    by one source process (see the module's docstring), only FP8 bytes and scales sent.

    Arguments as :class:`~reshard.distributed.Redistributor`'s, and ``quantize``: ``{name:
    {"scale": scale name, "block": [128, 128], "format": "float8_e4m3fn"}}``, or one spec
    ``{"block": [128, 128]}`` for every ``X`` whose target maps have ``X_scale_inv``
    (``"scale_suffix"`` to name it otherwise) and whose source maps do not. ``target_maps``
    names the data and its scales (the scales' map must be the block image of the data's,
    ir/block_grid.h); ``source_maps`` the data, unpadded, alone or in a buffer (a fused QKV:
    :meth:`run` then takes that rank's shard by the buffer's name, its quantized tensors'
    pieces gathered into blocks from it and the others sent from it as they are). ``dtypes``
    covers the tensors that are not quantized (the quantized move as float8_e4m3fn and
    float32).

    ``last_stats`` is the final exchange's, with ``gathered_sent`` / ``gathered_received``:
    the bytes of split blocks sent to their owners before quantizing (source dtype).

    ``source=`` (and ``config=``) instead of ``source_maps``, as for
    :class:`~reshard.distributed.Redistributor`: the trainer's model or state dict of DTensors
    as it lies (every process passes it, ``{}`` where it holds none), ``source_ranks``
    defaulting to the processes that hold any tensor and ``dtypes`` to the tensors'; :meth:`run`
    then takes the model (by default the one given here, as it is then). A Megatron-Core
    model (with ``config`` its Hugging Face config.json) is read as
    :func:`reshard.torch.megatron_maps` reads it: ``q_proj``, ``k_proj`` and ``v_proj`` are
    quantized out of its fused ``linear_qkv``, ``gate_proj`` and ``up_proj`` out of
    ``linear_fc1``, each block at one owner as for any other source.
    """

    def __init__(self, source_maps: Optional[Mapping[str, MapLike]] = None,
                 target_maps: Optional[Mapping[str, MapLike]] = None, *,
                 quantize: Any, source_ranks: Optional[Sequence[int]] = None,
                 target_ranks: Sequence[int], group: Any = None,
                 dtypes: Union[None, Any, Mapping[str, Any]] = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 source: Optional["TorchSource"] = None, config: Any = None,
                 _error: Optional[str] = None, _prepare_only: bool = False,
                 **options: Any) -> None:
        # _prepare_only: only the split blocks' gather and the quantizing (:meth:`prepare`);
        # the sources' quantized layout (:attr:`prepared_maps`) travels by another plan.
        import torch
        comm = group if isinstance(group, Transport) else _TorchGroup(group)
        self._me = comm.rank
        self._source_ranks: list[int] = []
        self._planned: list[_Planned] = []
        self._source = source
        self._source_maps: dict[str, ParamMap] = {}
        self._source_dtypes: dict[str, Any] = {}
        self._megatron = False
        self.last_stats: Optional[dict[str, int]] = None
        self._last_shards: Optional[dict[str, Any]] = None  # weakly, for verify()
        error, gather_src, gather_dst, final_src = _error, {}, {}, {}
        if source is not None:  # a collective: every process's tensors, before any check
            try:
                if source_maps is not None:
                    raise RedistributeError("give source_maps or source=, not both")
                layout = _layout_of_source(comm, source, source_ranks, config)
                source_maps, source_ranks = layout.maps, layout.ranks
                self._source_dtypes, self._megatron = layout.dtypes, layout.megatron
                dtypes = dtypes if dtypes is not None or not layout.dtypes else layout.dtypes
            except Exception as e:  # the same on every process; told by the agreement below
                error = error or _message(e)
                source_maps, source_ranks = {}, []
        final_dtypes: Union[None, Any, Mapping[str, Any]] = dtypes
        try:
            if error is not None:
                raise RedistributeError(error)
            if source_ranks is None:
                raise RedistributeError("source_ranks is required with source_maps (with "
                                        "source=, it defaults to the processes holding tensors)")
            if not isinstance(source_maps, Mapping) or not isinstance(target_maps, Mapping):
                raise RedistributeError("source_maps and target_maps must be mappings "
                                        "{name: map}")
            self._source_ranks = [int(r) for r in source_ranks]
            self._source_maps = {n: as_map(m) for n, m in source_maps.items()}
            final_src = dict(source_maps)
            targets = {n: as_map(m) for n, m in target_maps.items()}
            for spec in quant_specs(quantize, source_maps, target_maps):
                src = as_map(source_maps[spec.data])
                self._planned.append(_plan_tensor(spec, src, targets[spec.data],
                                                  targets[spec.scale]))
            _check_scale_buffers(self._planned, targets)
            _check_buffer_names(self._planned, self._source_maps)
            for p in self._planned:
                gather_src[p.spec.data] = source_maps[p.spec.data]
                gather_dst[p.spec.data] = final_src[p.spec.data] = p.blocks
                final_src[p.spec.scale] = p.scales
            if dtypes is not None:
                plain = dtypes if isinstance(dtypes, Mapping) else {n: dtypes for n in targets}
                final_dtypes = {**plain, **{p.spec.data: torch.float8_e4m3fn
                                            for p in self._planned},
                                **{p.spec.scale: torch.float32 for p in self._planned}}
        except Exception as e:  # told to every process by the constructors' agreement
            error = _message(e)
        # Raises on every process what any of them refused, before the second is built.
        ranks = self._source_ranks if error is None else []
        self._gather = Redistributor(gather_src if error is None else {},
                                     gather_dst if error is None else {},
                                     source_ranks=ranks, target_ranks=ranks, group=comm,
                                     bucket_bytes=bucket_bytes, _error=error, **options)
        self._prepared = final_src if error is None else {}
        self._final: Optional[Redistributor] = None
        if not _prepare_only:
            self._final = Redistributor(final_src, target_maps, source_ranks=self._source_ranks,
                                        target_ranks=target_ranks, group=comm,
                                        dtypes=final_dtypes, bucket_bytes=bucket_bytes, **options)

    @property
    def prepared_maps(self) -> dict[str, MapLike]:
        """The maps of what :meth:`prepare` gives over the source ranks: each quantized tensor's
        FP8 data and scales as their block owners hold them, every other tensor as given."""
        return dict(self._prepared)

    def _final_one(self) -> Redistributor:
        assert self._final is not None, "built to prepare only"
        return self._final

    @property
    def _exchange(self) -> Optional[_core.Exchange]:
        """The final exchange (what the targets receive), as a Redistributor's."""
        return self._final._exchange if self._final is not None else None

    @property
    def _names(self) -> list[str]:
        return self._final_one()._names

    @property
    def _dst(self) -> list[ParamMap]:
        return self._final_one()._dst

    def gathered(self) -> int:
        """The bytes of split blocks that the source processes send their owners per run."""
        ex = self._gather._exchange
        return 0 if ex is None else sum(int(ex.stats(p)["sent"]) for p in self._source_ranks)

    @property
    def quantized(self) -> list[BlockQuant]:
        return [p.spec for p in self._planned]

    def schedule(self) -> dict[str, Any]:
        """The final exchange's :meth:`Redistributor.schedule`, with ``"gather"``: the
        split blocks' exchange among the source processes (once planned)."""
        out = self._final_one().schedule()
        if self._gather._exchange is not None:
            out["gather"] = self._gather.schedule()
        return out

    def _split(self, shards: Mapping[str, "torch.Tensor"]
               ) -> "tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]":
        """This process's shards (by tensor, or by buffer where its source map keeps one: a
        Megatron-Core model's fused ``linear_qkv``) -> (those the split blocks' gather reads,
        those the final exchange sends), the first checked to be floats that widen exactly to
        float32. A buffer holding quantized tensors and others goes to both."""
        import torch
        if not isinstance(shards, Mapping):
            raise RedistributeError(f"shards must be a mapping {{name: tensor}}, got "
                                    f"{type(shards).__name__}")
        rank = self._source_ranks.index(self._me) if self._me in self._source_ranks else None

        def key(name: str) -> str:
            m = self._source_maps.get(name)
            return (m.buffer(rank) if m is not None and rank is not None else "") or name
        names = {p.spec.data for p in self._planned}
        gathered = {key(n) for n in names}
        sent = {key(n) for n in self._source_maps if n not in names}
        mine = {n: t for n, t in shards.items() if n in gathered}
        for name, t in mine.items():
            kind = str(getattr(t, "dtype", type(t).__name__)).replace("torch.", "")
            if not isinstance(t, torch.Tensor) or kind not in _SOURCE_DTYPES:
                raise RedistributeError(
                    f"shards[\"{name}\"] is {kind}; quantizing it to FP8 blocks takes "
                    f"{', '.join(_SOURCE_DTYPES)}")
        return mine, {n: t for n, t in shards.items() if n not in gathered or n in sent}

    def _empty_stacks(self) -> dict[str, "torch.Tensor"]:
        import torch
        if self._me not in self._source_ranks:
            return {}
        rank = self._source_ranks.index(self._me)
        return {p.spec.data: torch.zeros(as_map(p.blocks).shard_shape(rank)) for p in self._planned}

    def _quantize(self, blocks: Mapping[str, "torch.Tensor"]) -> dict[str, "torch.Tensor"]:
        """This process's stacked blocks -> their FP8 data and scales; a block that is not
        finite (NaN or infinity) is refused, naming the tensor and the block."""
        import torch
        if self._me not in self._source_ranks:
            return {}
        rank = self._source_ranks.index(self._me)
        out: dict[str, torch.Tensor] = {}
        for p in self._planned:
            data, scales = quantize_runs(blocks[p.spec.data], p.runs[rank])
            bad = (~torch.isfinite(scales)).nonzero()
            if bad.numel():
                block = _grid_index(p.scales, rank, int(bad[0]), p.spec.block,
                                    as_map(p.blocks).logical_shape)
                raise RedistributeError(
                    f"\"{p.spec.data}\": the block at {block} (blocks of {list(p.spec.block)}) "
                    "holds NaN or infinity; it has no FP8 scale")
            out[p.spec.data], out[p.spec.scale] = data, scales
        return out

    def run(self, shards: Union[None, "TorchSource", Mapping[str, "torch.Tensor"]] = None,
            out: Optional[Mapping[str, "torch.Tensor"]] = None, *, dry_run: bool = False,
            on_ready: Optional[Callable[[dict[str, "torch.Tensor"]], None]] = None,
            delta: bool = False, _error: Optional[str] = None) -> Any:
        """As :meth:`Redistributor.run`: this process's source shards (the quantized ones in
        their source dtype) -> its target shards (the quantized ones as FP8 data and float32
        scales). Every process of the group calls it. Nothing reaches a target before every
        process has checked its shards and quantized its blocks. Built with ``source=``,
        ``shards`` is a module or state dict of DTensors (default: the ``source`` given then,
        as it is now). ``delta=True``: the final exchange sends only what changed (every block
        is quantized again at its owner; a block whose elements did not change gives the same
        FP8 bytes and scale, which do not travel)."""
        prepared, error = self._prepare(shards, dry_run, _error)
        if not dry_run and isinstance(shards, Mapping):
            self._last_shards = _weak(shards)
        gathered = dict(self._gather.last_stats or {})
        final = self._final_one()
        result = final.run(prepared, out, dry_run=dry_run, on_ready=on_ready, delta=delta,
                           _error=error)
        if not dry_run:
            self.last_stats = {**(final.last_stats or {}),
                               "gathered_sent": int(gathered.get("sent", 0)),
                               "gathered_received": int(gathered.get("received", 0))}
        return result

    def verify(self, out: Optional[Mapping[str, "torch.Tensor"]] = None,
               shards: Union[None, "TorchSource", Mapping[str, "torch.Tensor"]] = None, *,
               _error: Optional[str] = None) -> int:
        """As :meth:`Redistributor.verify`: checks without sending them that the targets hold
        the FP8 data and scales (and the tensors not quantized) that the sources' shards give
        now. The sources quantize their blocks again (the split blocks' gather among the source
        processes included, as in :meth:`run`), then the fingerprints of the final exchange are
        compared; nothing reaches the targets. ``shards`` defaults to the last run's (held by
        weak reference) or, built with ``source=``, to that source as it is now; ``out`` to
        the last run's target shards."""
        error = _error
        if shards is None and self._source is None and error is None:
            try:
                shards = _alive(self._last_shards, "source shards", "shards")
            except RedistributeError as e:  # agreed by the gather in _prepare
                error = str(e)
        prepared, error = self._prepare(shards, False, error)
        return self._final_one().verify(out, prepared, _error=error)

    def prepare(self, shards: Mapping[str, "torch.Tensor"], *, _error: Optional[str] = None
                ) -> "tuple[dict[str, torch.Tensor], Optional[str]]":
        """This process's source shards -> its shards of :attr:`prepared_maps` (a collective
        over the group: the split blocks gathered at their owners, quantized), and the error
        that stopped it (agreed by the exchange that sends them)."""
        return self._prepare(shards, False, _error)

    def _prepare(self, shards: Union[None, "TorchSource", Mapping[str, "torch.Tensor"]],
                 dry_run: bool, error: Optional[str]
                 ) -> "tuple[dict[str, torch.Tensor], Optional[str]]":
        quantized: dict[str, torch.Tensor] = {}
        rest: dict[str, torch.Tensor] = {}
        try:
            if error is not None:
                raise RedistributeError(error)
            given: Any = shards
            if self._source is not None:
                given = _shards_of_source(self._source if shards is None else shards,
                                          self._megatron, self._source_maps, self._source_ranks,
                                          self._me, self._source_dtypes)
            if given is None:
                raise RedistributeError("run() needs this process's shards (it was built with "
                                        "source_maps, not source=)")
            quantized, rest = self._split(given)
        except Exception as e:  # agreed in the gather below
            error = _message(e)
        if dry_run:  # the split blocks stay where they are; the stacks stand in, unset
            self._gather.run(quantized, dry_run=True, _error=error)
            blocks = self._empty_stacks()
        else:
            blocks = self._gather.run(quantized, _error=error)
        error, made = None, {}
        try:
            made = self._quantize(blocks)
        except Exception as e:  # agreed in the final exchange, before it moves anything
            error = _message(e)
        return {**rest, **made}, error


def _grid_index(scales: Mapping[str, Any], rank: int, at: int, block: Sequence[int],
                logical: Sequence[int]) -> list[int]:
    """Element offsets of the block whose scale is element ``at`` of rank ``rank``'s stack."""
    grid = [-(-L // n) for L, n in zip(logical, block)]
    for piece in scales["ranks"][str(rank)]["pieces"]:
        first, length = piece["dest"][0], piece["shape"][0]
        if first <= at < first + length:
            flat = piece["source"][0] + at - first
            return [(flat // s) % g * n for s, g, n in zip(_row_major(grid), grid, block)]
    return []
