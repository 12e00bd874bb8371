"""DTensors across device meshes (DESIGN 21): :func:`redistribute` moves DTensors from the mesh
they are on to another one — another size, other ranks, overlapping the first or disjoint from
it — which torch's own ``DTensor.redistribute`` refuses ("Cross device mesh comm not supported
yet!").

The source layout is each DTensor's mesh and placements, read as :func:`reshard.torch.maps_of`
reads them; the target layout is what ``distribute_tensor(full, mesh, placements)`` would give
each rank of the new mesh, built the same way (:func:`reshard.torch.layout_map`). The two
compose into a plan and :class:`reshard.distributed.Redistributor` runs it: only the bytes a
target process does not already hold travel, each from one holder, and no process builds a
full tensor.

Every process of the group (default: the world) calls it; the union of both meshes must lie in
the group. Before anything moves the processes agree on the arguments — every tensor's shape,
dtype, mesh and placements, the target mesh and placements — and a mistake anywhere raises the
same :class:`reshard.distributed.RedistributeError` on every process, so that no one is left
waiting in a collective.
"""

from __future__ import annotations

import pickle
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from ._maps import ParamMap
from .distributed import DEFAULT_BUCKET_BYTES, RedistributeError, Redistributor, _message
from .torch import View, _by_rank, _merge, build_all

__all__ = ["RedistributeError", "redistribute", "target_maps"]

Placements = Sequence[Any]
# What one process says of its call: (error, is the input one DTensor (None: it passed none),
# {name: view of its source}, the target mesh's ranks, the target placements per name as
# given (None: one list for all), the same list, the target mesh's device type).
_Said = tuple[Optional[str], Optional[bool], dict[str, View], list[Any],
              Optional[dict[str, list[Any]]], Optional[list[Any]], str]

_ONE = "tensor"  # the name a single DTensor goes by in the plan and in messages


def _mesh_ranks(mesh: Any) -> list[Any]:
    from torch.distributed.device_mesh import DeviceMesh
    if not isinstance(mesh, DeviceMesh):
        raise RedistributeError(f"mesh must be a torch DeviceMesh, got {type(mesh).__name__}")
    ranks: list[Any] = mesh.mesh.tolist()
    return ranks


def _placement_list(placements: Any, what: str) -> list[Any]:
    if isinstance(placements, (str, bytes)) or not isinstance(placements, Sequence):
        raise RedistributeError(f"{what} must be a sequence of placements, got "
                                f"{type(placements).__name__} {placements!r}")
    return list(placements)


def _check_target(name: str, shape: tuple[int, ...], ranks: list[Any],
                  placements: list[Any]) -> list[Any]:
    """The placements a DTensor of ``shape`` may have on a mesh of ``ranks`` (nested list), as
    torch would take them (``Shard(d)`` with d in [-ndim, ndim), normalized); refuses what torch
    refuses and ``Partial``, whose ranks hold addends rather than elements."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    ndim_mesh = torch.as_tensor(ranks).dim()
    where = f"tensor \"{name}\" of shape {list(shape)}: target placements {placements}"
    if len(placements) != ndim_mesh:
        raise RedistributeError(f"{where} are {len(placements)} for a {ndim_mesh}-dimensional "
                                f"mesh {ranks}; give one per mesh dim")
    out: list[Any] = []
    for p in placements:
        if isinstance(p, Partial):
            raise RedistributeError(f"{where}: {p} would hold addends of the elements, not the "
                                    "elements; redistribute to Replicate() or Shard(d)")
        if isinstance(p, (Shard, _StridedShard)):
            d = int(p.dim)
            if not -len(shape) <= d < len(shape):
                raise RedistributeError(f"{where}: {p} names dim {d} of a {len(shape)}-"
                                        f"dimensional tensor (dims -{len(shape)} .. "
                                        f"{len(shape) - 1})")
            if d < 0:
                d += len(shape)
                p = (_StridedShard(d, split_factor=p.split_factor)
                     if isinstance(p, _StridedShard) else Shard(d))
        elif not isinstance(p, Replicate):
            raise RedistributeError(f"{where}: {p!r} ({type(p).__name__}) is not a placement "
                                    "reshard knows (Shard, Replicate, _StridedShard)")
        out.append(p)
    return out


def target_maps(shapes: Mapping[str, Sequence[int]], mesh: Any,
                placements: Union[Placements, Mapping[str, Placements]], *,
                ranks: Optional[Sequence[int]] = None) -> dict[str, ParamMap]:
    """``{name: ParamMap}``: what ``distribute_tensor`` of a tensor of ``shapes[name]`` on
    ``mesh`` (a DeviceMesh, or a tensor or nested list of global ranks) with ``placements``
    (one list for all, or ``{name: list}``) gives each rank, map rank i being process
    ``ranks[i]`` (default: the mesh's ranks in ascending order). Raises RedistributeError for
    placements torch would refuse and for ``Partial``."""
    grid = mesh.mesh.tolist() if hasattr(mesh, "mesh") else torch.as_tensor(mesh).tolist()
    chosen = [int(r) for r in ranks] if ranks is not None else \
        sorted(int(r) for r in torch.as_tensor(grid).flatten().tolist())
    views: dict[str, View] = {}
    for name, shape in shapes.items():
        given = placements.get(name) if isinstance(placements, Mapping) else placements
        if given is None:
            raise RedistributeError(f"no target placements for tensor \"{name}\"")
        shape = tuple(int(s) for s in shape)
        ps = _check_target(name, shape, grid, _placement_list(given, f"placements of \"{name}\""))
        views[name] = (shape, _by_rank(shape, grid, ps, name), "")
    try:
        return build_all(views, chosen)
    except ValueError as e:
        raise RedistributeError(str(e)) from e


def _source_views(tensors: Any) -> tuple[Optional[bool], dict[str, View]]:
    """(whether ``tensors`` is one DTensor, None when this process passed none; each DTensor's
    view: its shape, every rank's region, its dtype)."""
    from torch.distributed.tensor import DTensor
    if tensors is None:
        return None, {}
    single = isinstance(tensors, torch.Tensor)
    items = {_ONE: tensors} if single else tensors
    if not isinstance(items, Mapping):
        raise RedistributeError(f"tensors must be a DTensor or a dict {{name: DTensor}}, got "
                                f"{type(tensors).__name__}")
    if not items and not single:
        return None, {}
    views: dict[str, View] = {}
    for name, t in items.items():
        if not isinstance(t, DTensor):
            raise RedistributeError(f"tensor \"{name}\" is a {type(t).__name__}, not a DTensor: "
                                    "it has no mesh to move from")
        shape = tuple(int(s) for s in t.shape)
        views[str(name)] = (shape, _by_rank(shape, t.device_mesh, t.placements, str(name),
                                            t._spec), str(t.dtype).replace("torch.", ""))
    return single, views


def _say(tensors: Any, mesh: Any, placements: Any, stats: Any) -> _Said:
    """This process's account of its call (an error in place of what it could not read)."""
    single: Optional[bool] = None
    views: dict[str, View] = {}
    ranks: list[Any] = []
    per_name: Optional[dict[str, list[Any]]] = None
    one: Optional[list[Any]] = None
    device = ""
    try:
        if stats is not None and not isinstance(stats, dict):
            raise RedistributeError(f"stats must be a dict (filled with this process's "
                                    f"figures) or None, got {type(stats).__name__} {stats!r}")
        ranks = _mesh_ranks(mesh)
        device = str(mesh.device_type)
        if isinstance(placements, Mapping):
            per_name = {str(n): _placement_list(p, f"placements[\"{n}\"]")
                        for n, p in placements.items()}
        else:
            one = _placement_list(placements, "placements")
        single, views = _source_views(tensors)
        if single and per_name is not None:
            raise RedistributeError("placements is a dict by name, but tensors is one DTensor; "
                                    "give one list of placements")
        return None, single, views, ranks, per_name, one, device
    except Exception as e:  # told to every process by the agreement
        return _message(e), single, views, ranks, per_name, one, device


def _told(comm: Any, said: _Said) -> list[_Said]:
    """Every process's account of its call (a collective). An account that cannot be pickled
    (a placement that is a lambda) or unpickled elsewhere is told as that process's error, so
    that every process raises the same error instead of one raising and the others waiting."""
    try:
        data = pickle.dumps(said)
    except Exception as e:
        data = pickle.dumps((f"its arguments cannot be sent to the other processes "
                             f"({_message(e)})", None, {}, [], None, None, ""))
    told = []
    for payload in comm.gather_object(data):
        try:
            told.append(pickle.loads(payload))
        except Exception as e:
            told.append((f"its arguments cannot be read by the other processes "
                         f"({_message(e)})", None, {}, [], None, None, ""))
    return told


def _agree(said: list[_Said], members: list[int]
           ) -> tuple[bool, dict[str, View], list[Any], dict[str, list[Any]]]:
    """What every process said, checked to be one call: (one DTensor?, the merged source views,
    the target mesh's ranks, the target placements by name). The same answer, or the same
    RedistributeError, on every process (the input is the same everywhere)."""
    errors: dict[str, list[int]] = {}  # the same mistake on many processes is told once
    for p, s in zip(members, said):
        if s[0] is not None:
            errors.setdefault(s[0], []).append(p)
    if errors:
        raise RedistributeError("; ".join(
            f"process{'es' if len(ps) > 1 else ''} {', '.join(map(str, ps))}: {e}"
            for e, ps in errors.items()))
    first = said[0]
    for p, s in zip(members, said):
        if s[3] != first[3] or s[6] != first[6]:
            raise RedistributeError(
                f"processes {members[0]} and {p} were given different target meshes: "
                f"{first[6]} {first[3]} and {s[6]} {s[3]}; every process must pass the same")
        if repr(s[4]) != repr(first[4]) or repr(s[5]) != repr(first[5]):
            raise RedistributeError(
                f"processes {members[0]} and {p} were given different target placements: "
                f"{first[4] if first[4] is not None else first[5]} and "
                f"{s[4] if s[4] is not None else s[5]}; every process must pass the same")
    kinds = {(p, s[1]) for p, s in zip(members, said) if s[1] is not None}
    if len({k for _, k in kinds}) > 1:
        one = sorted(p for p, k in kinds if k)
        many = sorted(p for p, k in kinds if not k)
        raise RedistributeError(f"processes {one} passed one DTensor, processes {many} a dict "
                                "of them; every process must pass the same kind")
    if not kinds:
        raise RedistributeError("no process passed any DTensor to move")
    holding = [(p, s) for p, s in zip(members, said) if s[1] is not None]
    names = sorted(holding[0][1][2])
    for p, s in holding:
        if sorted(s[2]) != names:
            raise RedistributeError(
                f"processes {holding[0][0]} and {p} passed different tensors: "
                f"{names[:6]} and {sorted(s[2])[:6]}; every process of the source mesh must "
                "pass the same names")
    try:
        views = _merge([s[2] for _, s in holding], [p for p, _ in holding])
    except ValueError as e:  # another shape, dtype or layout of one tensor on two processes
        raise RedistributeError(str(e)) from e
    passed = {p for p, _ in holding}
    for name in names:  # a holder that passed nothing would send garbage in its place
        silent = sorted(set(views[name][1]) - passed)
        if silent:
            raise RedistributeError(
                f"tensor \"{name}\" is held by processes {silent} of its mesh, which passed no "
                "tensors; every process of a source mesh must pass its DTensors")
    if first[4] is not None:
        missing = [n for n in names if n not in first[4]]
        extra = sorted(set(first[4]) - set(names))
        if missing or extra:
            raise RedistributeError(
                "placements " + (f"has no entry for {missing[:6]}" if missing else
                                 f"names tensors that are not given: {extra[:6]}")
                + f" (the tensors are {names[:6]}{' ...' if len(names) > 6 else ''})")
        by_name = {n: first[4][n] for n in names}
    else:
        assert first[5] is not None
        by_name = {n: first[5] for n in names}
    return bool(holding[0][1][1]), views, first[3], by_name


def redistribute(tensors: Any, mesh: Any,
                 placements: Union[Placements, Mapping[str, Placements]], *,
                 group: Any = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 stats: Optional[dict[str, Any]] = None) -> Any:
    """DTensors moved onto ``mesh`` (a DeviceMesh every process built) with ``placements``
    (one list for all, or ``{name: list}``): the DTensors ``distribute_tensor(full, mesh,
    placements)`` would give, made without any process building a full tensor.

    ``tensors`` is a DTensor or ``{name: DTensor}`` (a state dict), each on any mesh. Every
    process of ``group`` (default: the world; a group of both meshes' processes leaves the
    others out) calls it: those of the source meshes with their
    DTensors, the others with the same DTensors (which hold nothing there) or ``None``. A
    process of ``mesh`` gets the DTensor (or ``{name: DTensor}``) back; a process outside it
    gets ``None`` (or ``{name: None}``). The results are new tensors with no autograd history.

    ``stats``, a dict, is filled with this process's figures (those of
    :attr:`Redistributor.last_stats`: bytes ``sent``, ``received``, copied ``local``ly, and
    ``lower_bound``, the bytes of its target shards no source shard in the process holds).

    Raises :class:`RedistributeError` on every process alike for a mesh or placements that
    differ between processes, placements torch would refuse (``Shard(d)`` past the tensor's
    dims, the wrong number for the mesh) or that hold addends (``Partial`` as a target), a
    tensor that is not a DTensor, shapes, dtypes or layouts of one tensor that differ between
    processes, a process of a source mesh that passes no tensors, and ``placements`` by name
    that miss or add a name, ``stats`` that is not a dict, arguments that cannot be pickled
    (to be compared), and a process of the group lost during the move (the others raise it).
    """
    try:
        return _redistribute(tensors, mesh, placements, group, bucket_bytes, stats)
    except RuntimeError as e:  # the transport: a process of the group lost (gloo, NCCL)
        raise RedistributeError(f"the move failed in a collective, a process of the group "
                                f"lost or failing ({_message(e)})") from e


def _redistribute(tensors: Any, mesh: Any, placements: Union[Placements, Mapping[str, Placements]],
                  group: Any, bucket_bytes: int, stats: Optional[dict[str, Any]]) -> Any:
    from .distributed import _TorchGroup
    comm = _TorchGroup(group)
    said = _told(comm, _say(tensors, mesh, placements, stats))
    single, views, grid, by_name = _agree(said, comm.members)
    source_ranks = sorted({r for _, by_rank, _ in views.values() for r in by_rank})
    flat_target = sorted(int(r) for r in torch.as_tensor(grid).flatten().tolist())
    outside = sorted(set(source_ranks + flat_target) - set(comm.members))
    if outside:
        raise RedistributeError(f"processes {outside} of the meshes are not in the group "
                                f"(its processes are {comm.members})")
    names = sorted(views)
    try:  # from the agreed arguments alone: the same answer on every process
        src = build_all(views, source_ranks)
        checked = {n: _check_target(n, views[n][0], grid, by_name[n]) for n in names}
        dst = target_maps({n: views[n][0] for n in names}, grid, checked, ranks=flat_target)
    except RedistributeError:
        raise
    except ValueError as e:
        raise RedistributeError(str(e)) from e
    dtypes = {n: getattr(torch, views[n][2]) for n in names}
    me = comm.rank
    shards: dict[str, torch.Tensor] = {}
    if me in source_ranks:
        rank = source_ranks.index(me)
        items = {_ONE: tensors} if single else (tensors or {})
        for n in names:
            t = items.get(n)
            if t is not None and me in views[n][1]:
                shards[n] = t.to_local()
            else:  # a tensor whose mesh leaves this process out: an empty shard
                shards[n] = torch.empty(src[n].shard_shape(rank), dtype=dtypes[n])
    sync = Redistributor(src, dst, source_ranks=source_ranks, target_ranks=flat_target,
                         group=group, dtypes=dtypes, bucket_bytes=bucket_bytes)
    got = sync.run(shards)
    if stats is not None:
        stats.clear()
        stats.update(sync.last_stats or {})
    if me not in flat_target:
        return None if single else {n: None for n in names}
    from torch.distributed.tensor import DTensor
    out: dict[str, Any] = {}
    for n in names:
        local = got[n]
        if mesh.device_type != local.device.type:
            local = local.to(mesh.device_type)
        shape = views[n][0]
        out[n] = DTensor.from_local(local, mesh, checked[n], run_check=False,
                                    shape=torch.Size(shape), stride=_strides(shape))
    return out[_ONE] if single else out


def _strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for s in reversed(shape):
        strides.append(step)
        step *= max(int(s), 1)
    return tuple(reversed(strides))
