"""Param maps of a trainer's own tensors (DESIGN 21): what a DTensor's mesh and placements say
each rank holds, translated into maps once, never written by hand.

A DTensor's placements are read as torch lays the data out:

- ``Shard(d)``: tensor dim ``d`` split as ``torch.chunk`` splits it over the mesh dim (pieces
  of ``ceil(n / size)``, the last ranks short or empty);
- ``Replicate()``: every rank along the mesh dim holds the same elements (one piece, several
  holders);
- several mesh dims on one tensor dim: applied from the first mesh dim to the last (torch's
  default order), or in the order the DTensor's spec records (``shard_order``);
- ``_StridedShard(d, split_factor=k)`` (what FSDP2's ``fully_shard`` over a tensor-parallel
  ``parallelize_module`` gives on a 2-D mesh): the split factors say in which order the mesh
  dims cut the tensor dim (``k`` is the product of the sizes of the mesh dims to its right that
  cut first), each cutting the chunk the previous ones left as ``Shard`` would: FSDP2's dp
  chunk of each TP chunk, as FSDP2 holds the data and torch's redistribution reads it (also
  where sizes are uneven and torch's ``compute_local_shape_and_global_offset`` says otherwise);
  where a spec says not to read them as an order, or no order gives them, dim ``d`` is cut into
  ``k`` parts, each part over the mesh dim, a rank holding its chunk of every part;
- ``Partial``: refused (:class:`reshard.LayoutError` naming the tensor): a rank holds an addend
  of the elements, not the elements.

Ranks are global ranks (the values of ``mesh.mesh``) unless ``ranks=`` names the processes the
map's ranks stand for. A tensor that is not a DTensor is held whole by every rank (a buffer every
process keeps, such as rotary frequencies), as ``torch.distributed.checkpoint`` reads it.

Each rank's region of F is a product over F's dims of the indices it holds along each; where
regions differ, the dims are cut where any rank's indices start or end, so that every piece has
one set of holders (DESIGN 2.1's homogeneity), and the library folds the pieces into its
canonical form.
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_left, bisect_right
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

from ._buffers import BufferSet
from ._errors import LayoutError
from ._maps import ParamMap

__all__ = ["LayoutError", "TorchSource", "is_megatron", "layout_map", "map_of", "maps_of",
           "megatron_maps", "megatron_shards", "regions", "shards_of"]

TorchSource = Union["torch.nn.Module", Mapping[str, Any]]

Run = tuple[int, int]  # (first index of F along one dim, count): consecutive indices
Region = tuple[tuple[Run, ...], ...]  # per dim of F, a rank's runs in the order its shard holds them
# A tensor as one process sees it: (F's shape, {global rank: region}, dtype name).
View = tuple[tuple[int, ...], dict[int, Region], str]


def _chunk(n: int, parts: int, i: int) -> Run:
    """The i-th of ``torch.chunk``'s ``parts`` pieces of n items, as (first, count): pieces of
    ceil(n / parts) items, the last ones short or empty."""
    size = -(-n // parts)
    start = min(i * size, n)
    return start, min(start + size, n) - start


def _take(runs: tuple[Run, ...], spans: Sequence[Run]) -> tuple[Run, ...]:
    """The items at positions ``spans`` ((first, count) each, in order) of the sequence of F's
    indices that ``runs`` describes."""
    out: list[Run] = []
    for first, count in spans:
        at = 0  # position in the sequence of runs[k]'s first item
        for g, n in runs:
            lo, hi = max(first, at), min(first + count, at + n)
            if lo < hi:
                start = g + lo - at
                if out and out[-1][0] + out[-1][1] == start:
                    out[-1] = (out[-1][0], out[-1][1] + hi - lo)
                else:
                    out.append((start, hi - lo))
            at += n
    return tuple(out)


def _length(runs: tuple[Run, ...]) -> int:
    return sum(n for _, n in runs)


def _placement(p: Any, ndim: int, name: str, placements: Sequence[Any]
               ) -> tuple[str, int, int]:
    """("shard", dim, split factor: 0 for a plain Shard), ("replicate", -1, 0); LayoutError
    for anything else."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    if isinstance(p, Partial):
        raise LayoutError(
            f"tensor \"{name}\" has placements {list(placements)}: a Partial placement holds "
            f"addends ({p.reduce_op}) of F's elements, not the elements, so no map describes it; "
            "redistribute it to Replicate() or Shard(d) first (dtensor.redistribute, or "
            "full_tensor())")
    if isinstance(p, Replicate):
        return "replicate", -1, 0
    if isinstance(p, (_StridedShard, Shard)):
        dim = int(p.dim) + (ndim if int(p.dim) < 0 else 0)
        if not 0 <= dim < ndim:
            raise LayoutError(f"tensor \"{name}\" has placements {list(placements)}: {p} shards "
                              f"dim {p.dim} of a {ndim}-dimensional tensor")
        if not isinstance(p, _StridedShard):
            return "shard", dim, 0
        factor = int(p.split_factor)
        if factor < 1:
            raise LayoutError(f"tensor \"{name}\": {p} has split factor {factor}")
        return "shard", dim, factor
    raise LayoutError(f"tensor \"{name}\" has placement {p!r} ({type(p).__name__}), which reshard "
                      f"does not know (placements {list(placements)})")


def _decoded(mesh_dims: list[int], factors: list[int], mesh_shape: Sequence[int]
             ) -> Optional[list[int]]:
    """The order in which the mesh dims ``mesh_dims`` (ascending) shard one tensor dim, read
    from their split factors: a mesh dim's factor is the product of the sizes of the mesh dims
    after it in the placements that shard the tensor dim before it. None when no order gives
    these factors."""
    order: list[int] = []
    for m, factor in sorted(zip(mesh_dims, factors), reverse=True):
        product, at = 1, None
        for i in range(len(order) + 1):
            if product == max(factor, 1):
                at = i
                break
            if i < len(order):
                product *= mesh_shape[order[i]]
        if at is None:
            return None
        order.insert(at, m)
    return order


def _orders(spec: Any, kinds: list[tuple[str, int, int]], mesh_shape: Sequence[int],
            ndim: int) -> tuple[list[list[int]], bool]:
    """Per tensor dim, the mesh dims that shard it in the order the data is cut, and whether
    split factors apply (_StridedShard read as its own split, not as an order).

    Without _StridedShard: the spec's recorded ``shard_order``, else from the first mesh dim to
    the last. With _StridedShard, torch reads the split factors as an order of nested chunks
    (its redistribution does, and FSDP2 over TP holds its data so: the TP chunk cut over dp),
    unless the spec says otherwise (``use_strided_shard_as_shard_order=False``) or no order
    gives the factors; then each _StridedShard cuts its dim into ``split_factor`` parts and
    every part over its mesh dim, from the first mesh dim to the last."""
    orders: list[list[int]] = [[] for _ in range(ndim)]
    factors: list[list[int]] = [[] for _ in range(ndim)]
    for m, (kind, dim, factor) in enumerate(kinds):
        if kind == "shard":
            orders[dim].append(m)
            factors[dim].append(factor)
    strided = any(f for fs in factors for f in fs)
    if strided:
        if getattr(spec, "use_strided_shard_as_shard_order", True) is False:
            return orders, True
        decoded = [_decoded(orders[d], factors[d], mesh_shape) for d in range(ndim)]
        if any(o is None for o in decoded):
            return orders, True
        return [o for o in decoded if o is not None], False
    recorded = getattr(spec, "shard_order", None)
    for entry in recorded or ():
        dim, mesh_dims = int(entry.tensor_dim), [int(m) for m in entry.mesh_dims]
        if 0 <= dim < ndim and sorted(mesh_dims) == orders[dim]:
            orders[dim] = mesh_dims
    return orders, False


def regions(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Any], *,
            name: str = "", spec: Any = None) -> dict[tuple[int, ...], Region]:
    """Each mesh coordinate's region of a tensor of ``shape`` laid out by ``placements`` over
    a mesh of ``mesh_shape`` (plain values: no process group needed). ``spec`` (a
    DTensorSpec) supplies a recorded ``shard_order`` and how _StridedShard is read."""
    shape = tuple(int(s) for s in shape)
    mesh_shape = tuple(int(s) for s in mesh_shape)
    if len(placements) != len(mesh_shape):
        raise LayoutError(f"tensor \"{name}\" has {len(placements)} placements "
                          f"{list(placements)} for a {len(mesh_shape)}-dimensional mesh")
    kinds = [_placement(p, len(shape), name, placements) for p in placements]
    orders, split = _orders(spec, kinds, mesh_shape, len(shape))
    out: dict[tuple[int, ...], Region] = {}
    for coord in itertools.product(*(range(s) for s in mesh_shape)):
        region = []
        for dim, size in enumerate(shape):
            runs: tuple[Run, ...] = ((0, size),) if size else ()
            for m in orders[dim]:
                factor = max(kinds[m][2], 1) if split else 1
                n, i, length = mesh_shape[m], coord[m], _length(runs)
                spans = []
                for j in range(factor):  # factor 1: one chunk of the whole
                    first, count = _chunk(length, factor, j)
                    at, k = _chunk(count, n, i)
                    spans.append((first + at, k))
                runs = _take(runs, spans)
            region.append(runs)
        out[coord] = tuple(region)
    return out


def _whole(shape: tuple[int, ...]) -> Region:
    return tuple(((0, s),) if s else () for s in shape)


def _by_rank(shape: tuple[int, ...], mesh: Any, placements: Sequence[Any], name: str,
             spec: Any = None) -> dict[int, Region]:
    """Regions by global rank over a DeviceMesh, or a tensor or nested list of global ranks."""
    ranks = mesh.mesh if hasattr(mesh, "mesh") else torch.as_tensor(mesh)
    by_coord = regions(shape, tuple(ranks.shape), placements, name=name, spec=spec)
    out = {int(ranks[coord].item()): region for coord, region in by_coord.items()}
    if len(out) != ranks.numel():
        raise LayoutError(f"tensor \"{name}\": the mesh {ranks.tolist()} names a rank twice")
    return out


def _view_of(name: str, t: torch.Tensor, me: Optional[int]) -> View:
    """A tensor's regions by global rank: a DTensor's over its mesh; a plain tensor's whole on
    ``me`` (None: on every rank, filled in when the world is known: key -1)."""
    from torch.distributed.tensor import DTensor
    dtype = str(t.dtype).replace("torch.", "")
    shape = tuple(int(s) for s in t.shape)
    if not isinstance(t, DTensor):
        return shape, {-1 if me is None else me: _whole(shape)}, dtype
    return shape, _by_rank(shape, t.device_mesh, t.placements, name, t._spec), dtype


def _entries(source: TorchSource) -> list[tuple[str, torch.Tensor]]:
    if isinstance(source, torch.nn.Module):
        items = list(source.state_dict().items())
    elif isinstance(source, Mapping):
        items = list(source.items())
    else:
        raise TypeError(f"expected a torch.nn.Module or a state dict {{name: tensor}}, got "
                        f"{type(source).__name__}")
    return [(str(n), t) for n, t in items if isinstance(t, torch.Tensor)]


def _merge(views: Sequence[Mapping[str, View]], members: Sequence[int]) -> dict[str, View]:
    """The union of what every process said about each tensor; LayoutError where two say
    different things (another shape, dtype or region for one rank)."""
    out: dict[str, View] = {}
    for proc, view in zip(members, views):
        for name, (shape, by_rank, dtype) in view.items():
            known = out.get(name)
            if known is None:
                out[name] = (shape, dict(by_rank), dtype)
                continue
            if known[0] != shape or known[2] != dtype:
                first = next(p for p, v in zip(members, views) if name in v)
                raise LayoutError(f"tensor \"{name}\" is {list(known[0])} {known[2]} on process "
                                  f"{first} but {list(shape)} {dtype} on process {proc}")
            for rank, region in by_rank.items():
                if known[1].setdefault(rank, region) != region:
                    raise LayoutError(
                        f"tensor \"{name}\": process {proc} says rank {rank} holds "
                        f"{_describe(region)} of it, another process {_describe(known[1][rank])}")
    return out


def _describe(region: Region) -> str:
    return "[" + ", ".join(",".join(f"{g}:{g + n}" for g, n in runs) or "-" for runs in region) + "]"


def _segments(runs: tuple[Run, ...], bounds: list[int], holders: list[frozenset[int]]
              ) -> list[tuple[int, int, int, frozenset[int]]]:
    """A rank's runs along one dim cut where any rank's runs start or end, as (first index of
    F, count, first index in the shard, holders), neighbours with the same holders joined."""
    out: list[tuple[int, int, int, frozenset[int]]] = []
    local = 0
    for g, n in runs:
        k = bisect_right(bounds, g) - 1
        while n:
            end = min(bounds[k + 1], g + n)
            h = holders[k]
            if out and out[-1][3] == h and out[-1][0] + out[-1][1] == g and \
                    out[-1][2] + out[-1][1] == local:
                out[-1] = (out[-1][0], out[-1][1] + end - g, out[-1][2], h)
            else:
                out.append((g, end - g, local, h))
            local += end - g
            n -= end - g
            g = end
            k += 1
    return out


def _row_major(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for s in reversed(shape):
        strides.append(step)
        step *= s
    return strides[::-1]


def _map_dict(name: str, shape: tuple[int, ...], by_rank: Mapping[int, Region],
              ranks: Sequence[int]) -> dict[str, Any]:
    """The map over ``ranks`` (map rank i is process ranks[i]) of a tensor whose processes hold
    ``by_rank``; processes of ``ranks`` that hold none of it hold an empty shard."""
    where = {r: i for i, r in enumerate(ranks)}
    outside = sorted(set(by_rank) - set(where))
    if outside:
        raise LayoutError(f"tensor \"{name}\" is held by processes {outside}, which are not among "
                          f"the ranks of the map {list(ranks)}")
    ndim = len(shape)
    bounds: list[list[int]] = []
    holders: list[list[frozenset[int]]] = []
    for d in range(ndim):
        cuts = sorted({0, shape[d]} | {x for region in by_rank.values()
                                       for g, n in region[d] for x in (g, g + n)})
        held: list[set[int]] = [set() for _ in cuts]
        for r, region in by_rank.items():
            for g, n in region[d]:
                for k in range(bisect_left(cuts, g), bisect_left(cuts, g + n)):
                    held[k].add(where[r])
        bounds.append(cuts)
        holders.append([frozenset(h) for h in held])
    everyone = frozenset(where[r] for r in by_rank)
    fs = _row_major(shape)
    out: dict[str, Any] = {}
    for r, process in enumerate(ranks):
        mine = by_rank.get(process)
        if mine is None:
            out[str(r)] = {"shard_shape": [0] * max(ndim, 1), "pieces": []}
            continue
        region = mine
        shard = [_length(runs) for runs in region]
        ss = _row_major(shard)
        pieces = []
        if all(shard):
            cells = [_segments(region[d], bounds[d], holders[d]) for d in range(ndim)]
            for cell in itertools.product(*cells):
                who = everyone.intersection(*(h for _, _, _, h in cell))
                pieces.append({
                    "shape": [n for _, n, _, _ in cell],
                    "source": [sum(g * f for (g, _, _, _), f in zip(cell, fs)), fs],
                    "dest": [sum(lo * s for (_, _, lo, _), s in zip(cell, ss)), ss],
                    "locations": sorted(who)})
        out[str(r)] = {"shard_shape": shard, "pieces": pieces}
    return {"logical_shape": list(shape), "ranks": out}


def _build(name: str, view: View, ranks: Sequence[int]) -> ParamMap:
    shape, by_rank, _ = view
    if -1 in by_rank:  # a plain tensor: whole on every rank
        region = by_rank[-1]
        by_rank = {r: region for r in ranks}
    entry = _map_dict(name, shape, by_rank, ranks)
    try:
        return ParamMap.from_dict(entry).canonical()
    except ValueError as e:  # a layout torch accepts always makes a valid map: say which
        raise LayoutError(f"tensor \"{name}\": its map is not valid: {e}") from e


def build_all(views: Mapping[str, View], ranks: Sequence[int]) -> dict[str, ParamMap]:
    """Every view's map over ``ranks``, each layout built once (a model's layers repeat a few
    shapes and placements)."""
    made: dict[Any, ParamMap] = {}
    out: dict[str, ParamMap] = {}
    for name, view in views.items():
        shape, by_rank, _ = view
        key = (shape, tuple(sorted(by_rank.items())))
        known = made.get(key)
        out[name] = known if known is not None else made.setdefault(key, _build(name, view, ranks))
    return out


def _world(group: Any) -> Optional[list[int]]:
    """The global ranks of ``group`` (None: the world), or None without torch.distributed."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if group is None:
        return list(range(dist.get_world_size()))
    return [int(r) for r in dist.get_process_group_ranks(group)]


def views_of(source: TorchSource, *, me: Optional[int] = None) -> dict[str, View]:
    """Every tensor of ``source`` as this process sees it (plain tensors held by ``me``, or by
    every rank when None)."""
    return {name: _view_of(name, t, me) for name, t in _entries(source)}


def gather_views(source: TorchSource, gather: Callable[[Any], list[Any]], me: int,
                 members: Sequence[int]) -> dict[str, View]:
    """Every process's views of its tensors, merged (a collective: ``gather`` returns every
    member's value in member order)."""
    error: Optional[str] = None
    views: dict[str, View] = {}
    try:
        views = views_of(source, me=me)
    except Exception as e:  # told to every process, raised alike
        error = f"process {me}: {e}" if isinstance(e, ValueError) else \
            f"process {me}: {type(e).__name__}: {e}"
    gathered = gather((error, views))
    errors = [e for e, _ in gathered if e is not None]
    if errors:
        raise LayoutError("; ".join(errors))
    return _merge([v for _, v in gathered], members)


def maps_of(source: TorchSource, *, ranks: Optional[Sequence[int]] = None, merge: bool = False,
            group: Any = None) -> dict[str, ParamMap]:
    """``{name: ParamMap}`` of every tensor of ``source`` (a ``torch.nn.Module``, read through
    its ``state_dict()``, or a state dict ``{name: tensor}``; entries that are not tensors are
    left out), built from the DTensors' meshes and placements.

    ``ranks``: the processes (global ranks) the maps' ranks stand for, map rank i being process
    ``ranks[i]``; default every rank of ``group`` (the world when None) in order, so that map
    ranks are global ranks; without torch.distributed, ranks 0 .. the highest rank of any mesh.
    Processes of ``ranks`` that hold none of a tensor hold an empty shard of it.

    ``merge=True`` makes it a collective over ``group``: each tensor's map is the union of what
    every process holds of it, the same on every process. Use it where one process does not see
    every holder: a DTensor on a submesh (a tensor-parallel group inside each data-parallel
    replica, every replica holding the same elements) or pipeline stages each holding their own
    layers. A plain tensor is then held whole by the processes that have it; without
    ``merge``, by every rank.

    Raises :class:`reshard.LayoutError` naming the tensor for a ``Partial`` placement, for a
    holder outside ``ranks``, and (``merge``) for processes that disagree on a tensor's shape,
    dtype or a rank's region.
    """
    members = _world(group)
    if merge and members is not None:
        import torch.distributed as dist
        count = len(members)

        def gather(value: Any) -> list[Any]:
            out: list[Any] = [None] * count
            dist.all_gather_object(out, value, group=group)
            return out

        views = gather_views(source, gather, dist.get_rank(), members)
    else:
        views = views_of(source)
    if ranks is None:
        if members is None:
            top = max((r for _, by_rank, _ in views.values() for r in by_rank), default=0)
            members = list(range(max(top, 0) + 1))
        ranks = members
    return build_all(views, [int(r) for r in ranks])


def map_of(tensor: torch.Tensor, *, name: str = "", ranks: Optional[Sequence[int]] = None
           ) -> ParamMap:
    """The map of one tensor (see :func:`maps_of`; ``name`` is what errors call it)."""
    return maps_of({name: tensor}, ranks=ranks)[name]


def layout_map(shape: Sequence[int], mesh: Any, placements: Sequence[Any], *, name: str = "",
               ranks: Optional[Sequence[int]] = None) -> ParamMap:
    """The map of a tensor of ``shape`` that a DTensor with ``placements`` on ``mesh`` (a
    DeviceMesh, or a tensor or nested list of global ranks: no process group needed) would
    have; ``ranks`` as in :func:`maps_of` (default: 0 .. the mesh's highest rank)."""
    shape = tuple(int(s) for s in shape)
    by_rank = _by_rank(shape, mesh, placements, name)
    if ranks is None:
        ranks = range(max(by_rank) + 1)
    return _build(name, (shape, by_rank, ""), [int(r) for r in ranks])


def shards_of(source: TorchSource, maps: Optional[Mapping[str, ParamMap]] = None,
              rank: Optional[int] = None, dtypes: Optional[Mapping[str, Any]] = None
              ) -> dict[str, torch.Tensor]:
    """This process's shards of ``source``: a DTensor's ``to_local()``, a plain tensor as it is.
    With ``maps`` (and this process's map ``rank``), the tensors of the maps that this
    process does not have are added as the empty shards the maps give it (of ``dtypes[name]``),
    and a tensor's shard that the maps do not expect (another shape) is refused."""
    from torch.distributed.tensor import DTensor
    out = {name: (t.to_local() if isinstance(t, DTensor) else t) for name, t in _entries(source)}
    if maps is None:
        return out
    if rank is None:
        raise ValueError("shards_of(maps=...) needs this process's map rank")
    for name, m in maps.items():
        need = m.shard_shape(rank)
        have = out.get(name)
        if have is None:
            if math.prod(need):
                raise LayoutError(f"tensor \"{name}\": map rank {rank} holds {list(need)} of it, "
                                  "but this process has no such tensor")
            want = (dtypes or {}).get(name, torch.float32)
            dtype = want if isinstance(want, torch.dtype) else \
                getattr(torch, str(want).replace("torch.", ""))
            out[name] = torch.empty(need, dtype=dtype)
        elif tuple(have.shape) != need:
            raise LayoutError(f"tensor \"{name}\": this process holds {list(have.shape)} of it, "
                              f"map rank {rank} {list(need)}")
    return out


# ---------------------------------------------------------------------------------------------
# Megatron-Core: a live model's sharded_state_dict() as Hugging Face tensors over its rank tensors

_DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
                torch.bfloat16: "BF16"}

# (key, global shape, dtype, rank, offsets, sizes, rank tensor, its elements, offset in it)
_LiveShard = tuple[str, list[int], str, int, list[int], list[int], str, int, int]


def _sharded_state_dict(source: Any) -> Mapping[str, Any]:
    if isinstance(source, Mapping):
        return source
    sharded = getattr(source, "sharded_state_dict", None)
    if sharded is None:
        raise TypeError(f"megatron_maps takes a Megatron-Core model or its sharded_state_dict(), "
                        f"not {type(source).__name__}")
    return dict(sharded())


def _leaves(value: Any) -> list[Any]:
    """The ShardedTensors (and factories) of a sharded state dict's value, nested or not."""
    if isinstance(value, Mapping):
        return [x for v in value.values() for x in _leaves(v)]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _leaves(v)]
    return [value]


def _flat(t: torch.Tensor, what: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise LayoutError(f"{what}: its local tensor is not contiguous (strides {t.stride()}), "
                          "so it is not one row-major rank tensor")
    return t.reshape(-1)


def _shard_entry(name: str, st: Any, base: torch.Tensor, rank: int) -> _LiveShard:
    """One ShardedTensor as (key, ..., offset in ``base``), ``base`` the rank tensor holding it."""
    what = f"\"{name}\" (Megatron tensor \"{st.key}\")"
    if getattr(st, "flattened_range", None) is not None:
        raise LayoutError(f"{what} holds the flattened range {st.flattened_range} of its box (a "
                          "distributed optimizer's layout): megatron_maps reads the model's own "
                          "sharded_state_dict(), whose tensors are whole boxes")
    data = st.data
    dtype = _DTYPE_NAMES.get(data.dtype)
    if dtype is None:
        raise LayoutError(f"{what} is {data.dtype}, which megatron_maps does not map")
    if data.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
        raise LayoutError(f"{what}: its data does not lie in the tensor \"{name}\" holds")
    _flat(data, what)
    prepend = int(getattr(st, "prepend_axis_num", 0) or 0)
    sizes = [1] * prepend + [int(s) for s in data.shape]
    return (str(st.key), [int(s) for s in st.global_shape], dtype, rank,
            [int(o) for o in st.global_offset], sizes, name, base.numel(),
            int(data.storage_offset() - base.storage_offset()))


def _live_shards(sharded: Mapping[str, Any], rank: int) -> list[_LiveShard]:
    """This process's ShardedTensors of ``sharded``, each in the tensor its entry holds."""
    out: list[_LiveShard] = []
    for name, value in sharded.items():
        for leaf in _leaves(value):
            kind = type(leaf).__name__
            if kind == "ShardedTensorFactory":  # the fused QKV and SwiGLU splits of one tensor
                _flat(leaf.data, f"\"{name}\"")
                for st in _leaves(leaf.build()):
                    out.append(_shard_entry(name, st, leaf.data, rank))
            elif kind == "ShardedTensor":
                out.append(_shard_entry(name, leaf, leaf.data, rank))
            # ShardedObjects (extra state) and anything else hold no tensor of the model
    return out


def _config_text(config: Any) -> str:
    import json
    import os
    if isinstance(config, Mapping):
        return json.dumps(dict(config))
    to_dict = getattr(config, "to_dict", None)  # a transformers PretrainedConfig
    if callable(to_dict):
        return json.dumps(to_dict())
    text: str = os.fspath(config)
    if text.lstrip().startswith("{"):
        return text
    with open(text, encoding="utf-8") as f:
        return f.read()


def is_megatron(source: Any) -> bool:
    """Whether ``source`` is a Megatron-Core model (it has ``sharded_state_dict()``), which
    :func:`megatron_maps` reads, rather than a module or state dict of DTensors."""
    return not isinstance(source, Mapping) and callable(getattr(source, "sharded_state_dict", None))


def gather_megatron(source: Any, config: Any, gather: Callable[[Any], list[Any]], me: int,
                    *, holders_only: bool = False) -> tuple[BufferSet, list[int]]:
    """(A collective: ``gather`` returns every member's value in member order; ``me`` is this
    process's position in it.) The maps of :func:`megatron_maps` over the members' models, and
    the positions of the members whose ranks the maps' ranks are. A member whose ``source`` is
    an empty mapping holds none of the model. ``holders_only``: map rank i is the i-th member
    that holds tensors (else member i). Raises :class:`reshard.LayoutError` on every member
    alike."""
    error: Optional[str] = None
    shards: list[_LiveShard] = []
    text = ""
    try:
        if not (isinstance(source, Mapping) and not source):
            if config is None:
                raise ValueError("a Megatron-Core model's tensors are named by the model's "
                                 "Hugging Face config: give it (config=)")
            text = _config_text(config)
            shards = _live_shards(_sharded_state_dict(source), me)
    except (ValueError, TypeError, OSError) as e:  # told to every process, raised alike
        error = f"process {me}: {e}"
    gathered = gather((error, text, shards))
    errors = [e for e, _, _ in gathered if e is not None]
    if errors:
        raise LayoutError("; ".join(errors))
    held = [i for i, (_, _, mine) in enumerate(gathered) if mine]
    if not held:
        raise LayoutError("no process holds a tensor of the Megatron model")
    if len({t for _, t, mine in gathered if mine}) > 1:
        raise LayoutError("the processes holding the Megatron model were given different "
                          "configs")
    members = held if holders_only else list(range(len(gathered)))
    position = {m: i for i, m in enumerate(members)}
    every = [(k, g, d, position[r], o, s, n, c, f)
             for _, _, mine in gathered for (k, g, d, r, o, s, n, c, f) in mine]
    what = f"the Megatron model's sharded_state_dict() on {len(members)} processes"
    from . import _core
    from ._buffers import read_buffers
    from ._errors import MapError
    try:
        document = _core.megatron_live_maps(gathered[held[0]][1], every, len(members), what)
    except MapError as e:
        raise LayoutError(str(e)) from None
    buffers = read_buffers(document)
    assert buffers is not None
    return buffers, members


def megatron_maps(source: Any, config: Any, *, group: Any = None) -> BufferSet:
    """The Hugging Face tensors of a live Megatron-Core model (a GPTModel, or its
    ``sharded_state_dict()``) over its ranks' tensors: a :class:`reshard.BufferSet` whose
    buffers are the model's tensors by their ``sharded_state_dict()`` names (each rank's buffer
    that rank's tensor, flat) and whose ``maps`` are ``{hf_name: ParamMap}`` (``q_proj``,
    ``k_proj``, ``v_proj`` out of ``linear_qkv``, ``gate_proj`` and ``up_proj`` out of a SwiGLU
    ``linear_fc1``, the vocabulary without its padding, ...), by the same name table as the
    torch_dist checkpoint reader. ``config``: the model's Hugging Face config.json (a dict, its
    text or path, or a transformers config).

    A collective over ``group`` (default the world): map rank i is process i of the group.
    Raises :class:`reshard.LayoutError` (the same on every process) for a tensor the name table
    does not know, a config that does not describe the model, a flattened (distributed
    optimizer) range, or a model the processes do not hold whole.
    """
    import torch.distributed as dist
    members = _world(group)
    if members is None:
        return gather_megatron(source, config, lambda value: [value], 0)[0]
    count = len(members)

    def gather(value: Any) -> list[Any]:
        out: list[Any] = [None] * count
        dist.all_gather_object(out, value, group=group)
        return out

    return gather_megatron(source, config, gather, dist.get_rank(group))[0]


def megatron_shards(source: Any) -> dict[str, torch.Tensor]:
    """This process's buffers of :func:`megatron_maps`: ``{name: flat tensor}``, each a view of
    the model's own tensor (what ``extract`` writes into and ``rebuild`` reads)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in _sharded_state_dict(source).items():
        for leaf in _leaves(value):
            if type(leaf).__name__ in ("ShardedTensor", "ShardedTensorFactory"):
                out.setdefault(name, _flat(leaf.data, f"\"{name}\""))
    return out


def megatron_source_shards(source: Any, maps: Mapping[str, ParamMap], rank: int,
                           dtypes: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The shards map rank ``rank`` sends of a Megatron model (``{}``: none of it): its
    :func:`megatron_shards` by buffer name, and an empty tensor for each buffer the maps give the
    rank with no element (a pipeline stage's view of another stage's layers)."""
    have = {} if isinstance(source, Mapping) and not source else megatron_shards(source)
    out: dict[str, torch.Tensor] = {}
    for name, m in maps.items():
        key = m.buffer(rank) or name
        if key in out:
            continue
        shard = have.get(key)
        need = m.shard_shape(rank)
        if shard is None:
            if math.prod(need):
                raise LayoutError(f"tensor \"{key}\": map rank {rank} holds {list(need)} of it, "
                                  "but this process's model has no such tensor")
            want = dtypes.get(name, torch.float32)
            shard = torch.empty(need, dtype=want if isinstance(want, torch.dtype) else
                                getattr(torch, str(want).replace("torch.", "")))
        out[key] = shard
    return out

