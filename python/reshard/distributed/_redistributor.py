"""The re-sharding itself (:class:`Redistributor`, :func:`redistribute`) and the transport it
runs over; the package's :mod:`reshard.distributed` describes how the bytes move. FP8 block
quantization at the source builds on it (:mod:`._quantize`), never the other way round."""

from __future__ import annotations

import atexit
import bisect
import dataclasses
import functools
import hashlib
import json
import math
import weakref
from typing import (TYPE_CHECKING, Any, Callable, Iterable, Literal, Mapping, Optional,
                    Sequence, Union, overload)

from .. import _core
from .._errors import ReshardError
from .._maps import MapLike, ParamMap, as_map
from .._tensors import _DTYPES, _SIZES, _dtype_key, _extent, _overlap, check_options, \
    check_writable
from . import _delta, _proof

if TYPE_CHECKING:
    import torch

    from ..torch import TorchSource

DEFAULT_BUCKET_BYTES = 64 << 20


class RedistributeError(ReshardError, ValueError):
    """A re-sharding that cannot run, raised on every process of the group alike."""

    code = "INVALID_ARGUMENT"


def _message(e: Exception) -> str:
    """An exception as the other processes are told of it."""
    return str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"


class Transport:
    """How a :class:`Redistributor` reaches the other processes: the group's members (ranks
    as the rank lists name them), this process's rank, one collective (every member's value)
    and point-to-point exchange of byte chunks. The default, made from ``group=`` (a
    torch.distributed group or None for the world), uses torch.distributed's own functions;
    a group that torch.distributed does not know of (a ``ProcessGroup`` built over a store
    of its own, beside a default group of other processes) gives its own subclass as
    ``group=``."""

    rank: int
    members: list[int]

    def gather_object(self, value: Any) -> list[Any]:
        """Every member's ``value``, in member order (a collective)."""
        raise NotImplementedError

    def any_flag(self, flag: bool) -> bool:
        """Whether any member passed True (a collective)."""
        return any(self.gather_object(bool(flag)))

    def max_of(self, value: int) -> int:
        """The largest ``value`` any member passed (a collective)."""
        return max(int(v) for v in self.gather_object(int(value)))

    def device(self) -> "torch.device":
        """Where the chunks sent and received live (the CPU for gloo, the GPU for NCCL)."""
        import torch
        return torch.device("cpu")

    def exchange(self, sends: "list[tuple[torch.Tensor, int]]",
                 receives: "list[tuple[torch.Tensor, int]]") -> list[Any]:
        """Start sending and receiving the ``(chunk, peer)`` pairs at once; the handles
        returned are waited on (``wait()``) before the chunks are reused."""
        raise NotImplementedError


def _free_destroyed_groups() -> None:
    """At exit, before the interpreter finalizes: lets go of process groups that
    ``destroy_process_group`` already dropped but that ``torch.distributed.nn.functional`` still
    holds as its functions' ``group=`` defaults (bound when it is imported after
    ``init_process_group``, as ``torch.optim``'s optimizers, ``torch.compile`` and FSDP import
    it). Such a group is otherwise freed only while the interpreter finalizes, and a gloo worker
    thread that is still letting go of a collective's tensors then needs the GIL and is ended by
    the interpreter inside a destructor: ``terminate called without an active exception``.
    Freed here, the group's threads are joined while the interpreter is whole."""
    import sys
    functional = sys.modules.get("torch.distributed.nn.functional")
    if functional is None:
        return
    import torch.distributed as dist
    live = dist.group.WORLD  # the default group now (None once destroyed): left as it is

    def stale(d: Any) -> bool:
        return isinstance(d, dist.ProcessGroup) and d is not live
    for fn in list(vars(functional).values()):
        defaults = getattr(fn, "__defaults__", None)
        if defaults and any(stale(d) for d in defaults):
            # None is what the defaults are when the module is imported before any group.
            fn.__defaults__ = tuple(None if stale(d) else d for d in defaults)


@functools.cache
def _free_destroyed_groups_at_exit() -> None:
    atexit.register(_free_destroyed_groups)


class _TorchGroup(Transport):
    def __init__(self, group: Any) -> None:
        import torch.distributed as dist
        _free_destroyed_groups_at_exit()
        self._group = group
        self.rank = dist.get_rank()
        self.members = (list(range(dist.get_world_size())) if group is None else
                        [int(r) for r in dist.get_process_group_ranks(group)])

    def gather_object(self, value: Any) -> list[Any]:
        import torch.distributed as dist
        out: list[Any] = [None] * len(self.members)
        dist.all_gather_object(out, value, group=self._group)
        return out

    def any_flag(self, flag: bool) -> bool:
        import torch
        import torch.distributed as dist
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device())
        dist.all_reduce(t, group=self._group)
        return bool(int(t.item()))

    def max_of(self, value: int) -> int:
        import torch
        import torch.distributed as dist
        t = torch.tensor([int(value)], dtype=torch.int64, device=self.device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
        return int(t.item())

    def device(self) -> "torch.device":
        import torch
        import torch.distributed as dist
        backend = str(dist.get_backend(self._group)).lower()
        if "nccl" in backend:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def exchange(self, sends: "list[tuple[torch.Tensor, int]]",
                 receives: "list[tuple[torch.Tensor, int]]") -> list[Any]:
        import torch.distributed as dist
        ops = [dist.P2POp(dist.isend, t, peer, self._group) for t, peer in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, self._group) for t, peer in receives]
        return list(dist.batch_isend_irecv(ops)) if ops else []


def _torch_dtype(name: str) -> "torch.dtype":
    import torch
    for key, value in _DTYPES.items():
        if value == name and hasattr(torch, key):
            dtype: torch.dtype = getattr(torch, key)
            return dtype
    raise RedistributeError(f"torch has no dtype for {name}")


def _dtype_name(dtype: Any) -> str:
    name = dtype if dtype in _SIZES else _DTYPES.get(_dtype_key(dtype))
    if name is None:
        raise RedistributeError(f"reshard does not move tensors of dtype {dtype}")
    return str(name)


def _ranks(ranks: Sequence[int], what: str, members: list[int]) -> list[int]:
    ranks = [int(r) for r in ranks]
    seen: set[int] = set()
    for i, r in enumerate(ranks):
        if r in seen:
            raise RedistributeError(f"{what} names process {r} twice ({what}[{i}]); a process "
                                    "holds at most one map rank of each side")
        seen.add(r)
        if r not in members:
            raise RedistributeError(f"{what}[{i}] is process {r}, which is not in the group "
                                    f"(its processes are {members})")
    return ranks


def _maps(source_maps: Mapping[str, MapLike], target_maps: Mapping[str, MapLike],
          source_ranks: list[int], target_ranks: list[int]
          ) -> tuple[list[str], list[ParamMap], list[ParamMap]]:
    missing = sorted(set(target_maps) - set(source_maps))
    extra = sorted(set(source_maps) - set(target_maps))
    if missing or extra:
        raise RedistributeError(
            "the source and target maps name different parameters: "
            + "; ".join(s for s in (f"no source map for {missing}" if missing else "",
                                    f"no target map for {extra}" if extra else "") if s))
    names = sorted(target_maps)
    src = [as_map(source_maps[n]) for n in names]
    dst = [as_map(target_maps[n]) for n in names]
    for name, s, d in zip(names, src, dst):
        if s.world_size != len(source_ranks):
            raise RedistributeError(f"parameter \"{name}\": the source map has {s.world_size} "
                                    f"ranks but source_ranks names {len(source_ranks)} processes")
        if d.world_size != len(target_ranks):
            raise RedistributeError(f"parameter \"{name}\": the target map has {d.world_size} "
                                    f"ranks but target_ranks names {len(target_ranks)} processes")
        if s.valid_shape != d.valid_shape or s.logical_shape[1:] != d.logical_shape[1:]:
            raise RedistributeError(
                f"parameter \"{name}\": the source map describes a tensor of shape "
                f"{list(s.logical_shape)} (valid {list(s.valid_shape)}) and the target map one "
                f"of {list(d.logical_shape)} (valid {list(d.valid_shape)})")
    return names, src, dst


@dataclasses.dataclass(frozen=True)
class _SourceLayout:
    """What ``source=`` (a live model or state dict) lays out: its maps merged over the group,
    the processes that hold it (map rank i being ``ranks[i]``), its tensors' dtypes, and
    whether it is a Megatron-Core model (its maps then keep its tensors in buffers)."""

    maps: dict[str, ParamMap]
    ranks: list[int]
    dtypes: dict[str, Any]
    megatron: bool


def _megatron_dtypes(buffers: Any) -> dict[str, Any]:
    """{Hugging Face name: torch dtype} of a Megatron model's maps (a BufferSet): its buffer's,
    also for the processes whose pipeline stage holds none of it (an empty shard)."""
    dtypes: dict[str, Any] = {}
    for name, m in buffers.maps.items():
        held_in = [m.buffer(r) for r in range(m.world_size) if m.buffer(r)]
        if held_in:
            dtypes[name] = _torch_dtype(buffers[held_in[0]].dtype)
    return dtypes


def _layout_of_source(comm: Transport, source: "TorchSource", ranks: Optional[Sequence[int]],
                      config: Any) -> _SourceLayout:
    """The maps of every process's tensors, merged over ``comm`` (a collective), and the
    processes that hold any: the source ranks unless ``ranks`` is given. DTensors, or
    Megatron-Core models (on every process that holds tensors; ``{}`` elsewhere), with
    ``config`` their Hugging Face config."""
    import torch

    from ..torch import build_all, gather_megatron, gather_views, is_megatron
    members = list(comm.members)
    kind = "megatron" if is_megatron(source) else \
        "none" if isinstance(source, Mapping) and not source else "torch"
    kinds = {k for k in comm.gather_object(kind) if k != "none"}
    if len(kinds) > 1:
        raise RedistributeError("some processes gave a Megatron-Core model as source=, "
                                "others DTensors; give the same kind on every process")
    if kinds == {"megatron"}:
        buffers, held = gather_megatron(source, config, comm.gather_object,
                                        members.index(comm.rank), holders_only=True)
        found = [members[i] for i in held]
        if ranks is not None and len(ranks) != len(found):
            raise RedistributeError(f"source_ranks names {len(ranks)} processes; "
                                    f"{len(found)} hold the Megatron model's tensors")
        return _SourceLayout(dict(buffers.maps),
                             [int(r) for r in ranks] if ranks is not None else found,
                             _megatron_dtypes(buffers), True)
    if config is not None:
        raise RedistributeError("config= names the tensors of a Megatron-Core source; "
                                "the source here is DTensors")
    views = gather_views(source, comm.gather_object, comm.rank, members)
    found = sorted({r for _, by_rank, _ in views.values() for r in by_rank})
    chosen = [int(r) for r in ranks] if ranks is not None else found
    return _SourceLayout(build_all(views, chosen), chosen,
                         {name: getattr(torch, dtype) for name, (_, _, dtype) in views.items()},
                         False)


def _shards_of_source(source: "TorchSource", megatron: bool, maps: Mapping[str, ParamMap],
                      source_ranks: Sequence[int], me: int,
                      dtypes: Mapping[str, Any]) -> dict[str, "torch.Tensor"]:
    """Process ``me``'s shards of a torch source under its ``maps`` (``{}`` when it is none of
    ``source_ranks``): DTensors' ``to_local()``, a Megatron model's own tensors; the tensors it
    lacks as the empty shards of ``dtypes`` its maps give it."""
    from ..torch import megatron_source_shards, shards_of
    if me not in source_ranks:
        return {}
    rank = list(source_ranks).index(me)
    try:
        if megatron:
            return megatron_source_shards(source, maps, rank, dtypes)
        return shards_of(source, maps, rank, dtypes)
    except (TypeError, ValueError) as e:
        raise RedistributeError(str(e)) from e


class Redistributor:
    """A re-sharding planned once and run many times (a weight sync every step).

    ``source_maps`` and ``target_maps`` are ``{name: ParamMap | dict}`` with the same names;
    ``source_ranks[i]`` is the global rank of the process that holds map rank i of the source
    side, ``target_ranks[j]`` likewise of the target side (the two may overlap, nest or be
    disjoint; each names every process at most once). Every process of ``group`` (default: the
    world) constructs it with the same arguments: construction is collective, and refuses
    maps that differ between processes.

    Buffers (DESIGN 16): where a map keeps a rank's pieces in a buffer (an MoE layer's
    ``experts.gate_up_proj``), that process's shards and results are keyed by the buffer's name,
    one tensor standing for every parameter over it; a new target buffer starts zeroed and each
    parameter's moves write only its own elements of it.

    ``dtypes`` (one dtype, or ``{name: dtype}``) lets processes that hold no source shard know
    what they receive; without it the first run learns the dtypes from the source shards.
    ``bucket_bytes`` bounds the chunks a process stages per round in each direction (it packs
    one round ahead and unpacks one round behind, so up to twice that each way). ``scale_power``,
    ``allow_scaled_optimizer_state``, ``allow_lossy_scale`` and ``num_threads`` are those of
    :func:`reshard.transfer`.

    ``source=`` instead of ``source_maps``: the trainer's model or state dict as it lies, its
    DTensors' meshes and placements being its layout (:func:`reshard.torch.maps_of`, merged
    over the group: a collective in which every process passes ``source=``, ``{}`` where it
    holds none). ``source_ranks`` then defaults to the processes that hold any tensor, map rank
    i being the i-th of them; a mesh's ranks are read as the group's (global ranks for a
    torch.distributed group; a :class:`Transport`'s own ranks otherwise); ``dtypes`` defaults
    to the tensors'; and :meth:`run` takes the model (by default the one given here, as it is
    then). A Megatron-Core model (anything with ``sharded_state_dict()``) is taken as
    :func:`reshard.torch.megatron_maps` reads it, with ``config`` its Hugging Face config.json
    (a dict, its text or path): its tensors move as the Hugging Face tensors of the target maps,
    map rank i of the source being the i-th process that holds the model; :meth:`run` then
    sends the model's own tensors (its buffers, :func:`reshard.torch.megatron_shards`).
    """

    def __init__(self, source_maps: Optional[Mapping[str, MapLike]] = None,
                 target_maps: Optional[Mapping[str, MapLike]] = None, *,
                 source_ranks: Optional[Sequence[int]] = None, target_ranks: Sequence[int],
                 group: Any = None, dtypes: Union[None, Any, Mapping[str, Any]] = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, scale_power: int = 1,
                 allow_scaled_optimizer_state: bool = False, allow_lossy_scale: bool = False,
                 num_threads: int = 0, source: Optional["TorchSource"] = None,
                 config: Any = None, _error: Optional[str] = None,
                 _plans: Optional[Callable[[list[str]], Any]] = None) -> None:
        # _plans: the composed plans of the names, in order (a PlanSet), instead of composing
        # the maps here: a sync schedule's steps (reshard.vllm._schedule).
        self._plans_of = _plans
        self._comm = group if isinstance(group, Transport) else _TorchGroup(group)
        self._me = self._comm.rank
        self._members = list(self._comm.members)
        self._source: Optional[TorchSource] = source
        self._source_dtypes: dict[str, Any] = {}
        self._megatron = False  # source= is a Megatron-Core model (its maps are buffers)
        if source is not None:  # a collective: every process's tensors, before any check
            try:
                if source_maps is not None:
                    raise RedistributeError("give source_maps or source=, not both")
                layout = _layout_of_source(self._comm, source, source_ranks, config)
                source_maps, source_ranks = layout.maps, layout.ranks
                self._source_dtypes, self._megatron = layout.dtypes, layout.megatron
            except Exception as e:  # the same on every process; told by the agreement below
                _error = _error or _message(e)
                source_maps, source_ranks = {}, []
        self._exchange: Optional[_core.Exchange] = None
        self._dtypes: Optional[list[str]] = None
        self.last_stats: Optional[dict[str, int]] = None
        self._scale = (scale_power, allow_scaled_optimizer_state, allow_lossy_scale)
        self._written: list[tuple[int, int]] = []  # the memory of this run's given outs
        # Copy with torch's strided copies on the shards' device instead of the host executor
        # (see _torch_copies); forced on by tests to run that path on the CPU.
        self._force_torch_copies = False
        self._boxes_allow_torch: Optional[bool] = None
        self._last_rounds_cache: Optional[list[int]] = None  # see _last_rounds
        # What the last run read and wrote, by weak reference (no copy, nothing kept alive):
        # what verify() checks by default.
        self._last_shards: Optional[dict[str, Any]] = None
        self._last_out: Optional[dict[str, Any]] = None
        # The chunks of the last delta run as they travelled: ("send" | "recv", peer, round)
        # -> uint8 (see _move_delta); None: the next delta run sends them whole.
        self._delta_base: Optional[dict[tuple[str, int, int], "torch.Tensor"]] = None
        # Chunk buffers no delta run holds any more (a copy replaced by the next run's), by
        # bytes: the next chunks are packed or received into them, whose pages are already
        # mapped (a fresh buffer's first touch costs more than packing it). At most one a
        # chunk size in the steady state.
        self._delta_spare: dict[int, list["torch.Tensor"]] = {}
        # How verify's messages name a process of the group (a sync names engines' workers).
        self._process_name: Callable[[int], str] = lambda p: f"process {p}"
        error, fingerprint = _error, None
        try:  # every check, so that a mistake on one process is told to all (DESIGN 14)
            if error is not None:
                raise RedistributeError(error)
            if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int):
                raise RedistributeError(f"bucket_bytes must be an int, got "
                                        f"{type(bucket_bytes).__name__} {bucket_bytes!r}")
            self._bucket_bytes = int(bucket_bytes)
            if self._bucket_bytes < 64:
                raise RedistributeError(f"bucket_bytes is {bucket_bytes}; give at least 64")
            check_options(scale_power, num_threads)
            for flag, value in (("allow_scaled_optimizer_state", allow_scaled_optimizer_state),
                                ("allow_lossy_scale", allow_lossy_scale)):
                if not isinstance(value, bool):
                    raise RedistributeError(f"{flag} must be a bool, got {value!r}")
            self._options = _core.ExecOptions(scale_power, True, allow_scaled_optimizer_state,
                                              allow_lossy_scale, num_threads)
            if source_ranks is None:
                raise RedistributeError("source_ranks is required with source_maps (with "
                                        "source=, it defaults to the processes holding tensors)")
            for what, maps in (("source_maps", source_maps), ("target_maps", target_maps)):
                if not isinstance(maps, Mapping):
                    raise RedistributeError(f"{what} must be a mapping {{name: map}}, got "
                                            f"{type(maps).__name__}")
            self._source_ranks = _ranks(source_ranks, "source_ranks", self._members)
            self._target_ranks = _ranks(target_ranks, "target_ranks", self._members)
            if target_maps is None:
                raise RedistributeError("target_maps is required")
            assert source_maps is not None
            self._names, self._src, self._dst = _maps(source_maps, target_maps,
                                                      self._source_ranks, self._target_ranks)
            if dtypes is None and self._source_dtypes:
                dtypes = self._source_dtypes
            if dtypes is not None:
                self._dtypes = self._dtypes_of(dtypes)
            fingerprint = self._fingerprint()
        except Exception as e:  # told to every process by the agreement below
            error = _message(e)
        self._agree_on_construction(error, fingerprint)
        if self._dtypes is not None:
            self._plan()

    def _dtypes_of(self, dtypes: Any) -> list[str]:
        if not isinstance(dtypes, Mapping):
            return [_dtype_name(dtypes)] * len(self._names)
        missing = [n for n in self._names if n not in dtypes]
        extra = sorted(set(dtypes) - set(self._names), key=str)
        if missing or extra:
            raise RedistributeError(
                "dtypes= " + (f"has no dtype for {missing[:4]}" if missing else
                              f"names unknown parameters {extra[:4]}")
                + "; give one dtype, or one for every parameter of the maps")
        return [_dtype_name(dtypes[n]) for n in self._names]

    # -- agreement ------------------------------------------------------------------------

    def _gather(self, value: Any) -> list[Any]:
        return self._comm.gather_object(value)

    def _raise_any(self, errors: list[Optional[str]]) -> None:
        failed = [(self._members[i], e) for i, e in enumerate(errors) if e is not None]
        if failed:
            raise RedistributeError("; ".join(f"process {p}: {e}" for p, e in failed))

    def _fingerprint(self) -> dict[str, str]:
        def digest(text: str) -> str:
            return hashlib.sha256(text.encode()).hexdigest()[:16]
        prints = {n: digest(s.to_json() + d.to_json())
                  for n, s, d in zip(self._names, self._src, self._dst)}
        prints[" ranks"] = digest(json.dumps([self._source_ranks, self._target_ranks,
                                              self._dtypes, self._bucket_bytes,
                                              list(self._scale)]))
        return prints

    def _agree_on_construction(self, error: Optional[str],
                               fingerprint: Optional[dict[str, str]]) -> None:
        gathered = self._gather((error, fingerprint))
        self._raise_any([e for e, _ in gathered])
        first = gathered[0][1]
        for i, (_, prints) in enumerate(gathered):
            if prints == first:
                continue
            keys = sorted(set(prints) | set(first))
            key = next(k for k in keys if prints.get(k) != first.get(k))
            what = ("the rank lists, dtypes, bucket size or scale options" if key == " ranks"
                    else f"the maps of parameter \"{key}\"")
            raise RedistributeError(f"processes {self._members[0]} and {self._members[i]} were "
                                    f"given different {what}; every process must pass the same")

    # -- planning -------------------------------------------------------------------------

    def _plan(self) -> None:
        assert self._dtypes is not None
        # Each process stages at most bucket_bytes per direction per round: a process talks to
        # at most max(|sources|, |targets|) peers.
        peers = max(len(self._source_ranks), len(self._target_ranks))
        chunk = max(self._bucket_bytes // peers, 8)
        try:  # the same agreed arguments on every process: each fails alike, without waiting
            self._last_rounds_cache = None
            if self._plans_of is not None:
                self._exchange = _core.Exchange(self._plans_of(self._names), self._names,
                                                self._dtypes, self._source_ranks,
                                                self._target_ranks, chunk)
                return
            self._exchange = _core.Exchange([m._handle for m in self._dst],
                                            [m._handle for m in self._src], self._names,
                                            self._dtypes, self._source_ranks, self._target_ranks,
                                            chunk)
        except ValueError as e:
            raise RedistributeError(f"planning the exchange: {e}") from e

    def schedule(self) -> dict[str, Any]:
        """What a run moves, without moving it: ``{"rounds", "processes": {rank: {"sent",
        "received", "local", "lower_bound", "segments_sent", "sends": [(round, peer, bytes)],
        "receives": [...]}}}`` in bytes. ``lower_bound`` is what the process must receive at
        least: the bytes of its target shards that no source shard in the process holds.
        Needs the dtypes (given, or learned by a first run)."""
        if self._exchange is None:
            raise RedistributeError("the dtypes are not known yet: pass dtypes= or run once")
        ex = self._exchange
        procs = sorted(set(self._source_ranks) | set(self._target_ranks))
        return {"rounds": ex.num_rounds,
                "processes": {p: {**ex.stats(p), "sends": ex.sends(p),
                                  "receives": ex.receives(p)} for p in procs}}

    # -- a run ----------------------------------------------------------------------------

    def _check_shards(self, shards: Mapping[str, "torch.Tensor"]) -> list[Optional["torch.Tensor"]]:
        import torch
        me = self._me
        if not isinstance(shards, Mapping):
            raise RedistributeError(f"shards must be a mapping {{name: tensor}}, got "
                                    f"{type(shards).__name__}")
        rank = self._source_ranks.index(me) if me in self._source_ranks else None
        if rank is None:
            if shards:
                raise RedistributeError(f"holds no source rank but was given shards for "
                                        f"{sorted(shards)[:4]}")
            return [None] * len(self._names)
        # A buffered rank's shard is its buffer (DESIGN 16): shards are keyed by rank tensor,
        # a buffer's name standing for every parameter whose pieces it holds.
        keys = [self._src[i].buffer(rank) or n for i, n in enumerate(self._names)]
        missing = sorted({k for k in keys if k not in shards})
        extra = sorted(set(shards) - set(keys))
        if missing or extra:
            raise RedistributeError(
                f"holds source rank {rank}: " + (f"no shard given for {missing[:4]}" if missing
                                                  else f"shards of unknown parameters {extra[:4]}"))
        out: list[Optional[torch.Tensor]] = []
        for i, name in enumerate(keys):
            t = shards[name]
            if not isinstance(t, torch.Tensor):
                raise RedistributeError(f"shards[\"{name}\"] is a {type(t).__name__}, "
                                        "not a torch.Tensor")
            if t.device.type == "meta":
                raise RedistributeError(f"shards[\"{name}\"] is on the meta device: it has no "
                                        "data to send; give the shard itself")
            if t.is_neg() or t.is_conj():
                t = t.resolve_neg().resolve_conj()  # the values, not the raw memory
            need = self._src[i].shard_shape(rank)
            if tuple(t.shape) != need:
                raise RedistributeError(f"shards[\"{name}\"] has shape {list(t.shape)}; source "
                                        f"rank {rank} of its map holds {list(need)}")
            name_of = _dtype_name(t.dtype)
            if self._dtypes is not None and name_of != self._dtypes[i]:
                raise RedistributeError(
                    f"shards[\"{name}\"] has dtype {t.dtype}; it moves as "
                    f"{_torch_dtype(self._dtypes[i])}")
            out.append(t)
        return out

    def _local_of(self, source: "TorchSource") -> dict[str, "torch.Tensor"]:
        """A torch source's shards as :meth:`_check_shards` takes them."""
        dtypes = {n: _torch_dtype(d) for n, d in zip(self._names, self._dtypes or [])}
        return _shards_of_source(source, self._megatron, dict(zip(self._names, self._src)),
                                 self._source_ranks, self._me, dtypes)

    def _learn_dtypes(self, local: list[Optional["torch.Tensor"]], error: Optional[str]) -> None:
        held = error is None and self._me in self._source_ranks
        names = [_dtype_name(t.dtype) for t in local if t is not None] if held else None
        gathered = self._gather((error, names))
        self._raise_any([e for e, _ in gathered])
        known = [(self._members[i], d) for i, (_, d) in enumerate(gathered) if d is not None]
        first_proc, first = known[0]
        for proc, d in known[1:]:
            for name, a, b in zip(self._names, first, d):
                if a != b:
                    raise RedistributeError(f"parameter \"{name}\": process {first_proc} holds "
                                            f"its shard as {_torch_dtype(a)}, process {proc} "
                                            f"as {_torch_dtype(b)}")
        self._dtypes = list(first)

    def _agree_on_run(self, error: Optional[str], device: "torch.device") -> None:
        if self._comm.any_flag(error is not None):
            self._raise_any([e for e in self._gather(error)])

    def _targets(self, out: Optional[Mapping[str, "torch.Tensor"]], device: Any,
                 stage: Any = "cpu"
                 ) -> tuple[list[Optional["torch.Tensor"]], list[Optional["torch.Tensor"]]]:
        """(the tensors returned, the dense tensors written, on ``stage``) per parameter."""
        import torch
        assert self._dtypes is not None
        me = self._me
        if out is not None:
            if not isinstance(out, Mapping):
                raise RedistributeError(f"out must be a mapping {{name: tensor}}, got "
                                        f"{type(out).__name__}")
        rank = self._target_ranks.index(me) if me in self._target_ranks else None
        if out is not None:
            known = set(self._names) if rank is None else \
                {self._dst[i].buffer(rank) or n for i, n in enumerate(self._names)}
            extra = sorted(set(out) - known, key=str)
            if extra:
                raise RedistributeError(f"out names unknown parameters {extra[:4]}")
        results: list[Optional[torch.Tensor]] = []
        dense: list[Optional[torch.Tensor]] = []
        given_extents: list[tuple[int, int, str]] = []
        # A buffer is one target tensor for every parameter over it: made (zeroed) or checked
        # once, then written by each parameter's moves in turn.
        by_key: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._target_keys = []
        for i, param in enumerate(self._names):
            if rank is None:
                results.append(None)
                dense.append(None)
                continue
            buffer = self._dst[i].buffer(rank)
            name = buffer or param
            self._target_keys.append(name)
            if name in by_key:
                results.append(by_key[name][0])
                dense.append(by_key[name][1])
                continue
            shape = self._dst[i].shard_shape(rank)
            dtype = _torch_dtype(self._dtypes[i])
            given = None if out is None else out.get(name)
            what = f"out[\"{name}\"]"
            if given is None:
                given = (torch.zeros if buffer else torch.empty)(shape, dtype=dtype, device=device)
            else:
                if not isinstance(given, torch.Tensor):
                    raise RedistributeError(f"{what} is a {type(given).__name__}, not a "
                                            "torch.Tensor")
                if given.device.type == "meta":
                    raise RedistributeError(f"{what} is on the meta device, which holds no "
                                            "memory to write; give a real tensor")
                if tuple(given.shape) != shape or given.dtype != dtype:
                    raise RedistributeError(f"{what} is {given.dtype} of shape "
                                            f"{list(given.shape)}; target rank {rank} needs "
                                            f"{dtype} of shape {list(shape)}")
                check_writable(given, "torch", what)
                extent = _extent(given, "torch") if given.device.type == "cpu" else None
                if extent is not None:
                    given_extents.append((*extent, what))
            results.append(given)
            if given.device == torch.device(stage) and given.is_contiguous():
                host = given
            else:  # a buffer's other elements are kept: staged through a copy of it
                host = given.detach().to(stage).contiguous().clone() if buffer else \
                    torch.empty(shape, dtype=dtype, device=stage)
            dense.append(host)
            by_key[name] = (given, host)
        given_extents.sort()
        for a, b in zip(given_extents, given_extents[1:]):
            if b[0] < a[1]:
                raise RedistributeError(f"{a[2]} and {b[2]} overlap in memory; give outputs "
                                        "that do not share memory")
        self._written = [(lo, hi) for lo, hi, _ in given_extents]
        return results, dense

    def _host_sources(self, local: list[Optional["torch.Tensor"]]
                      ) -> list[Optional["torch.Tensor"]]:
        """The source shards as dense host tensors; one that an ``out`` overlaps is copied
        first, so that it is read as it was before anything is written."""
        written = self._written  # sorted, disjoint (checked in _targets)
        starts = [lo for lo, _ in written]
        out: list[Optional[torch.Tensor]] = []
        for t in local:
            if t is None:
                out.append(None)
                continue
            h = t.detach().to("cpu").contiguous()
            extent = _extent(h, "torch")
            if extent is not None and written:
                k = bisect.bisect_left(starts, extent[1]) - 1
                if k >= 0 and _overlap(extent, written[k]):
                    h = h.clone()
            out.append(h)
        return out

    def _torch_copies(self, local: list[Optional["torch.Tensor"]],
                      out: Optional[Mapping[str, "torch.Tensor"]], comm: "torch.device") -> bool:
        """Whether this process copies with torch's strided copies on the transport's device
        (a GPU: no host staging) rather than with the host executor: when the transport is on
        a GPU and every source shard and given output of this process is there too, and no
        copy of its plan is scaled (the host executor checks scales for exactness) or has a
        negative stride. Each process decides for itself; the messages are the same."""
        if comm.type == "cpu" and not self._force_torch_copies:
            return False
        given = [t for t in (out or {}).values() if hasattr(t, "device")]
        if any(t.device != comm for t in [*(t for t in local if t is not None), *given]):
            return False
        if self._boxes_allow_torch is None:
            ex = self._exchange
            assert ex is not None
            me = self._me
            boxes = ex.boxes(me, "local") + ex.boxes(me, "padding")
            for k, peer, _ in ex.sends(me):
                boxes += ex.boxes(me, "pack", peer, k)
            for k, peer, _ in ex.receives(me):
                boxes += ex.boxes(me, "unpack", peer, k)
            self._boxes_allow_torch = all(f == 1.0 and min([*ss, *ds, 0]) >= 0
                                          for _, _, _, ss, _, ds, f in boxes)
        return self._boxes_allow_torch

    @staticmethod
    def _device_sources(local: list[Optional["torch.Tensor"]],
                        targets: list[Optional["torch.Tensor"]]) -> list[Optional["torch.Tensor"]]:
        """The source shards as dense tensors where they are; one sharing memory with a
        target is copied first, so that it is read as it was before anything is written."""
        written = {t.untyped_storage().data_ptr() for t in targets if t is not None}
        out: list[Optional["torch.Tensor"]] = []
        for t in local:
            if t is None:
                out.append(None)
                continue
            d = t.detach().contiguous()
            out.append(d.clone() if d.untyped_storage().data_ptr() in written else d)
        return out

    def _comm_device(self) -> "torch.device":
        return self._comm.device()

    def run(self, shards: Union[None, "TorchSource", Mapping[str, "torch.Tensor"]] = None,
            out: Optional[Mapping[str, "torch.Tensor"]] = None, *,
            dry_run: bool = False,
            on_ready: Optional[Callable[[dict[str, "torch.Tensor"]], None]] = None,
            delta: bool = False, _error: Optional[str] = None) -> Any:
        """This process's source shards ``{name: tensor}`` (empty when it holds none) -> its
        target shards ``{name: tensor}`` (empty when it holds none), written into ``out`` where
        given. With ``dry_run`` the shards are checked and :meth:`schedule` is returned;
        nothing moves. Every process of the group must call it.

        ``on_ready``, when given, is called with ``{name: tensor}`` of this process's target
        shards (a buffer by its own name) as soon as every element of them is in place: after
        the local copies, then after each round that completes some, while later rounds
        travel, so that a receiver can start on one tensor (an engine processes a layer)
        before the others arrive. Each shard comes once, as the tensor ``run`` returns. An
        exception it raises stops the calls and is raised once this process's transfer has
        completed, so that no peer is left waiting.

        Built with ``source=``, ``shards`` is a module or state dict of DTensors and tensors
        (default: the ``source`` given then, as it is now), each DTensor giving its
        ``to_local()``; the tensors this process lacks are the empty shards its maps give it.

        ``delta=True`` (on every process) sends, between each pair of processes, only what
        changed since the last completed run with ``delta=True`` (see :mod:`._delta`): each
        process keeps a copy of the chunks it sent and received then (memory: its bytes sent
        plus received per run), and the targets come out bit-equal to a full run's. The first
        such run, and any run after a failed one or one without ``delta`` on some process, sends
        the chunks whole (and keeps them). A delta that some process could not apply fails the
        run on every process, and the next one sends whole chunks."""
        comm = self._comm_device()
        error = None
        local: list[Optional[torch.Tensor]] = [None] * len(self._names)
        try:
            if _error is not None:  # a caller's own failure, agreed like the checks' failures
                raise RedistributeError(_error)
            given: Any = shards
            if self._source is not None:
                given = self._local_of(self._source if shards is None else shards)
            if given is None:
                raise RedistributeError("run() needs this process's shards (it was built with "
                                        "source_maps, not source=)")
            local = self._check_shards(given)
            if not dry_run:
                self._last_shards = _weak(given)
        except Exception as e:  # told to every process by the agreement
            error = _message(e)
        if self._exchange is None:
            self._learn_dtypes(local, error)
            self._plan()
            error = None
        device = next((t.device for t in local if t is not None), comm)
        results: list[Optional[torch.Tensor]] = []
        dense: list[Optional[torch.Tensor]] = []
        sources: list[Optional[torch.Tensor]] = []
        on_device = False
        if error is None:
            try:
                self._written = []
                on_device = not delta and self._torch_copies(local, out, comm)
                if on_device:
                    results, dense = self._targets(out, comm, comm)
                    sources = self._device_sources(local, dense)
                else:
                    results, dense = self._targets(out, device)
                    sources = self._host_sources(local)
                    # A scale that loses values shows in the data, on the process that holds
                    # it: found now, every process hears of it before anything is sent.
                    assert self._exchange is not None
                    self._exchange.check_sources(self._me, _addresses(sources), self._options)
            except Exception as e:
                error = _message(e)
        self._agree_on_run(error, comm)
        if dry_run:
            return self.schedule()
        # Every process: 0 when it asks for a delta and holds the last chunks, 1 when it asks
        # without them, 2 when it does not ask. The worst decides, alike everywhere.
        mode = self._comm.max_of(0 if delta and self._delta_base is not None else
                                 1 if delta else 2)
        if mode == 2:
            self._delta_base = None
        keys = getattr(self, "_target_keys", None) or self._names
        # Each target shard once (a buffer stands for every parameter over it), with the round
        # after which it is complete: the last of its parameters'.
        targets: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        complete: dict[str, int] = {}
        lasts = self._last_rounds() if on_ready is not None else [-1] * len(keys)
        for name, result, host, last in zip(keys, results, dense, lasts):
            if result is not None and host is not None:
                targets.setdefault(name, (result, host))
                complete[name] = max(complete.get(name, -1), last)
        by_round: dict[int, list[str]] = {}
        for name, k in complete.items():
            by_round.setdefault(k, []).append(name)
        answer: dict[str, torch.Tensor] = {}
        failure: list[BaseException] = []

        def deliver(names: Iterable[str]) -> dict[str, "torch.Tensor"]:
            done = {}
            for name in names:
                result, host = targets[name]
                if host is not result:
                    result.copy_(host)
                answer[name] = done[name] = result
            return done

        def finished(k: int) -> None:
            """Round k (-1: the local copies) is unpacked: hand on what it completed."""
            names = by_round.get(k)
            if not names or failure or on_ready is None:
                return
            try:
                on_ready(deliver(names))
            except BaseException as e:  # raised once the transfer is through
                failure.append(e)

        self._last_out = None
        if mode == 2:
            self._move(sources, dense, comm, on_device, finished)
        else:
            self._move_delta(sources, dense, comm, mode == 0, finished)
        deliver([n for n in targets if n not in answer])
        self._last_out = _weak(answer)
        if failure:
            raise failure[0]
        return answer

    # -- a proof of what the targets hold --------------------------------------------------

    def verify(self, out: Optional[Mapping[str, "torch.Tensor"]] = None,
               shards: Union[None, "TorchSource", Mapping[str, "torch.Tensor"]] = None, *,
               _error: Optional[str] = None) -> int:
        """Checks, without sending the tensors, that every target process holds what the
        source processes' shards give (DESIGN 22), and returns how many (tensor, target
        process) pairs were compared. Every process of the group calls it.

        ``out`` is this process's target shards as :meth:`run` returns them, ``shards`` its
        source shards; each defaults to those of the last run (held by weak reference: the
        tensors as they are now, if the caller still holds them), and, built with ``source=``,
        ``shards`` to that source as it is now.

        Each source process computes, for every target process, a fingerprint of the elements
        it sends (or copies) there: a sum modulo 2^64 of a keyed term of each element's flat
        index in the target's shard and its bits, after the plan's scale factor; replicas count
        once (the holder the plan reads) and padding not at all. Each target computes the same
        over what it holds. The parts travel (a few integers per pair), not the tensors. Where a
        pair differs, sub-boxes narrow it: the positions are cut into 64 buckets whose sums are
        compared again, until one element is left. A difference raises
        :class:`RedistributeError` on every process, naming the tensor, the target process and
        rank, and the first differing element (in the shard and in the full tensor) with the
        value the target holds. Two different shards give the same fingerprint with probability
        about 2^-64 (a fresh random key each time; see docs/design.md)."""
        error = _error
        sources: list[Optional["torch.Tensor"]] = [None] * len(self._names)
        targets: list[Optional["torch.Tensor"]] = [None] * len(self._names)
        try:
            if error is not None:
                raise RedistributeError(error)
            if self._exchange is None:
                raise RedistributeError("nothing to verify yet: the dtypes are unknown until "
                                        "dtypes= is given or a first run has moved the tensors")
            given: Any = shards
            if self._source is not None:
                given = self._local_of(self._source if shards is None else shards)
            elif given is None:
                given = _alive(self._last_shards, "source shards", "shards")
            local = self._check_shards(given)
            sources = [None if t is None else t.detach().to("cpu").contiguous() for t in local]
            held = out if out is not None else _alive(self._last_out, "target shards", "out")
            targets = self._held_targets(held)
        except Exception as e:  # agreed below, with the key
            error = _message(e)
        gathered = self._gather((error, _proof.new_key()))
        self._raise_any([e for e, _ in gathered])
        key = int(gathered[0][1])
        want, have = self._fingerprint_parts(sources, targets, key, [])
        found = _proof.differing(want, have)
        if found:
            self._narrow_and_raise(sources, targets, key, found)
        return len(set(want) | set(have))

    def _held_targets(self, out: Any) -> list[Optional["torch.Tensor"]]:
        """This process's target shards as dense host tensors, per parameter (a buffer's for
        every parameter over it), checked against the maps; [None...] on other processes."""
        import torch
        me = self._me
        if me not in self._target_ranks:
            if out:
                raise RedistributeError("holds no target rank but was given target shards")
            return [None] * len(self._names)
        if not isinstance(out, Mapping):
            raise RedistributeError(f"out must be a mapping {{name: tensor}}, got "
                                    f"{type(out).__name__}")
        rank = self._target_ranks.index(me)
        assert self._dtypes is not None
        host: dict[str, torch.Tensor] = {}
        result: list[Optional[torch.Tensor]] = []
        for i, param in enumerate(self._names):
            key = self._dst[i].buffer(rank) or param
            if key not in host:
                t = out.get(key)
                shape = self._dst[i].shard_shape(rank)
                dtype = _torch_dtype(self._dtypes[i])
                if not isinstance(t, torch.Tensor):
                    raise RedistributeError(f"out[\"{key}\"] is missing or not a tensor")
                if tuple(t.shape) != shape or t.dtype != dtype:
                    raise RedistributeError(f"out[\"{key}\"] is {t.dtype} of shape "
                                            f"{list(t.shape)}; target rank {rank} holds {dtype} "
                                            f"of shape {list(shape)}")
                if t.device.type == "meta":
                    raise RedistributeError(f"out[\"{key}\"] is on the meta device: it holds "
                                            "no values to check")
                host[key] = t.detach().resolve_neg().resolve_conj().to("cpu").contiguous()
            result.append(host[key])
        return result

    def _fingerprint_parts(self, sources: list[Optional["torch.Tensor"]],
                           targets: list[Optional["torch.Tensor"]], key: int,
                           requests: list[tuple[int, int, int, int, int]]
                           ) -> tuple[dict[_proof.Pair, list[int]], dict[_proof.Pair, list[int]]]:
        """Every process's fingerprint parts (a collective), added up: (what the sources give,
        what the targets hold) per (parameter, target process)."""
        ex = self._exchange
        assert ex is not None
        me, error = self._me, None
        source: _proof.Parts = []
        target: _proof.Parts = []
        try:
            if me in self._source_ranks:
                source = ex.fingerprints(me, True, _addresses(sources), key, requests,
                                         self._options)
            if me in self._target_ranks:
                mine = [r for r in requests if r[1] == me]
                if mine or not requests:
                    target = ex.fingerprints(me, False, _addresses(targets), key, mine,
                                             self._options)
        except Exception as e:  # agreed just below
            error = _message(e)
        gathered = self._gather((error, source, target))
        self._raise_any([e for e, _, _ in gathered])
        return _proof.add_parts(gathered)

    def _narrow_and_raise(self, sources: list[Optional["torch.Tensor"]],
                          targets: list[Optional["torch.Tensor"]], key: int,
                          found: dict[_proof.Pair, int]) -> None:
        """Narrows the first differing pairs to one element by sub-boxes (collectives that
        every process runs alike), then raises on every process."""
        ranges: dict[_proof.Pair, tuple[int, int]] = {}
        for param, proc in list(found)[:_proof.MAX_NAMED]:
            rank = self._target_ranks.index(proc)
            ranges[(param, proc)] = (0, math.prod(self._dst[param].shard_shape(rank)))
        while True:
            active = [(p, t, lo, hi, _proof.BUCKETS) for (p, t), (lo, hi) in ranges.items()
                      if hi - lo > 1]
            if not active:
                break
            want, have = self._fingerprint_parts(sources, targets, key, active)
            first = _proof.differing(want, have)
            for p, t, lo, hi, _ in active:
                k = first.get((p, t))
                if k is None:  # the buckets agree: changed meanwhile, or sums that cancel
                    ranges[(p, t)] = (lo, lo)
                    continue
                w = _proof.width(lo, hi)
                ranges[(p, t)] = (lo + k * w, min(hi, lo + (k + 1) * w))
        values = self._held_values(targets, ranges)
        parts = []
        for (param, proc), (lo, hi) in ranges.items():
            parts.append(self._difference(param, proc, lo, hi, values))
        more = len(found) - len(ranges)
        if more:
            parts.append(f"{more} more (tensor, process) pairs differ")
        raise RedistributeError("the targets do not hold what the sources have: "
                                + "; ".join(parts))

    def _held_values(self, targets: list[Optional["torch.Tensor"]],
                     ranges: dict[_proof.Pair, tuple[int, int]]) -> dict[_proof.Pair, str]:
        """The values the targets hold at the narrowed elements (a collective)."""
        mine = {}
        for (param, proc), (lo, hi) in ranges.items():
            t = targets[param]
            if proc == self._me and t is not None and hi - lo == 1:
                mine[(param, proc)] = _element(t.reshape(-1)[lo])
        out: dict[_proof.Pair, str] = {}
        for values in self._gather(mine):
            out.update(values)
        return out

    def _difference(self, param: int, proc: int, lo: int, hi: int,
                    values: dict[_proof.Pair, str]) -> str:
        name, rank = self._names[param], self._target_ranks.index(proc)
        m = self._dst[param]
        buffer = m.buffer(rank)
        where = f"\"{name}\" on target {self._process_name(proc)} (target rank {rank}" + \
            (f", in buffer \"{buffer}\")" if buffer else ")")
        if hi - lo != 1:
            return (f"{where}: its fingerprint differs from the sources', but no single element "
                    "could be named (did the shards change during the check?)")
        shape = m.shard_shape(rank)
        at = _proof.full_index(m, rank, lo)
        return (f"{where}: first differing element {_proof.unravel(lo, shape)} of its shard "
                f"(flat {lo})" + (f", element {at} of the tensor" if at is not None else "")
                + (f", holds {values[(param, proc)]}" if (param, proc) in values else ""))

    def _move_delta(self, sources: list[Optional["torch.Tensor"]],
                    targets: list[Optional["torch.Tensor"]], comm: "torch.device",
                    base_ok: bool, finished: Callable[[int], None]) -> None:
        """Every round's chunks packed whole by the host executor, each sent as what changed
        since it last travelled between the pair (``base_ok``: every process holds the chunks
        of the last delta run; else whole), rebuilt in the receiver's copy of the chunk and
        unpacked whole from it, so that the targets equal a full run's whatever they held. A
        round's headers (encoding, changed words, bytes per pair) travel before its payloads.
        A chunk that cannot be applied fails the run on every process once every round has
        travelled, and no chunk is kept: the next delta run sends whole chunks."""
        import torch
        ex = self._exchange
        assert ex is not None
        me, options = self._me, self._options
        src, dst = _addresses(sources), _addresses(targets)
        previous = self._delta_base if base_ok else None
        spare = self._delta_spare
        if previous is None and self._delta_base:  # copies no run will compare with again
            for t in self._delta_base.values():
                spare.setdefault(t.numel(), []).append(t)
        self._delta_base = None  # kept again only once this run has completed everywhere

        def take(n: int) -> "torch.Tensor":
            free = spare.get(n)
            return free.pop() if free else torch.empty(n, dtype=torch.uint8)

        def give(t: "torch.Tensor") -> None:
            spare.setdefault(t.numel(), []).append(t)
        kept: dict[tuple[str, int, int], torch.Tensor] = {}
        sends: list[list[tuple[int, int]]] = [[] for _ in range(ex.num_rounds)]
        receives: list[list[tuple[int, int]]] = [[] for _ in range(ex.num_rounds)]
        for k, peer, n in ex.sends(me):
            sends[k].append((peer, n))
        for k, peer, n in ex.receives(me):
            receives[k].append((peer, n))
        run = _DeltaRun()

        on_cpu = comm.type == "cpu"

        def post(out: "list[tuple[torch.Tensor, int]]",
                 into: "list[tuple[torch.Tensor, int]]") -> Callable[[], None]:
            """Starts sending and receiving host tensors (through the transport's device);
            the call returned waits for them."""
            if on_cpu:
                sent = self._comm.exchange(out, into)

                def wait() -> None:
                    for r in sent:
                        r.wait()
                return wait
            staged = [(torch.empty(t.shape, dtype=t.dtype, device=comm), p) for t, p in into]
            requests = self._comm.exchange([(t.to(comm), p) for t, p in out], staged)

            def settle() -> None:
                for r in requests:
                    r.wait()
                for (t, _), (d, _) in zip(into, staged):
                    t.copy_(d)
            return settle

        def prepare(k: int) -> "tuple[list[tuple[torch.Tensor, int]], list[Any]]":
            """Round k's chunks packed, compared and encoded: (headers, payloads)."""
            headers, payloads = [], []
            for peer, n in sends[k]:
                chunk = take(_even(n))
                if n % 2:  # an odd chunk's last word is half padding, alike everywhere
                    chunk[-1] = 0
                ex.pack(me, peer, k, int(chunk.data_ptr()), n, src, options, False)
                before = previous.get(("send", peer, k)) if previous is not None else None
                kind, count, payload = (_delta.WHOLE, _even(n) // 2, chunk) if before is None \
                    else _delta.encode(before, chunk)
                if before is not None:
                    give(before)  # compared: this run keeps the chunk just packed instead
                kept[("send", peer, k)] = chunk
                headers.append((torch.tensor([kind, count, payload.numel()]), peer))
                payloads.append((payload, peer))
                run.sent += payload.numel() + 24  # and the header
                run.changed += count
                run.words += _even(n) // 2
                run.encodings[_delta.NAMES[kind]] = run.encodings.get(_delta.NAMES[kind], 0) + 1
            return headers, payloads

        def told_of(k: int, headers: "list[tuple[torch.Tensor, int]]"
                    ) -> "list[tuple[torch.Tensor, int]]":
            told = [(torch.empty(3, dtype=torch.int64), peer) for peer, _ in receives[k]]
            post(headers, told)()
            return told

        def apply(k: int, told: "list[tuple[torch.Tensor, int]]",
                  arriving: "list[tuple[torch.Tensor, int]]") -> None:
            """Round k's payloads into the copies of its chunks, unpacked into the targets."""
            for (h, peer), (payload, _), (_, n) in zip(told, arriving, receives[k]):
                run.received += payload.numel() + 24
                if run.failure is not None:
                    continue
                try:
                    kind, count = int(h[0]), int(h[1])
                    held = previous.get(("recv", peer, k)) if previous is not None else None
                    if kind == _delta.WHOLE and payload.numel() == _even(n):
                        held = payload  # received into a chunk of its own
                    elif held is None:
                        raise RedistributeError(f"a delta from process {peer} in round {k} "
                                                "against a chunk this process does not hold")
                    else:
                        _delta.decode(held, kind, count, payload)
                    kept[("recv", peer, k)] = held
                    ex.unpack(me, peer, k, int(held.data_ptr()), n, dst, options, False)
                except Exception as e:  # agreed once every round has travelled
                    run.failure = _message(e)
            if run.failure is None:
                finished(k)

        def arrival(k: int, h: "torch.Tensor", peer: int, n: int) -> "torch.Tensor":
            """Where a payload of round k is received: a whole chunk into the copy it replaces
            (or a spare chunk), the others into a buffer of their own."""
            size = int(h[2])
            if int(h[0]) != _delta.WHOLE or size != _even(n):
                return torch.empty(size, dtype=torch.uint8)
            held = previous.pop(("recv", peer, k), None) if previous is not None else None
            return held if held is not None and held.numel() == size else take(size)

        # Round k travels while round k + 1 is packed and encoded and round k - 1 applied.
        ex.copy_local(me, src, dst, options)
        finished(-1)
        rounds = ex.num_rounds
        headers, payloads = prepare(0) if rounds else ([], [])
        told = told_of(0, headers) if rounds else []
        pending: Optional[tuple[int, Any, Any]] = None
        for k in range(rounds):
            arriving = [(arrival(k, h, peer, n), peer)
                        for (h, peer), (_, n) in zip(told, receives[k])]
            # An unchanged chunk's payload is empty: its header says so, and nothing travels.
            settle = post([(p, peer) for p, peer in payloads if p.numel()],
                          [(t, peer) for t, peer in arriving if t.numel()])
            if pending is not None:
                apply(*pending)
            if k + 1 < rounds:
                headers, payloads = prepare(k + 1)
            settle()
            pending = (k, told, arriving)
            if k + 1 < rounds:
                told = told_of(k + 1, headers)
        if pending is not None:
            apply(*pending)
        if self._comm.any_flag(run.failure is not None):
            failures = [f for f in self._gather(run.failure)]
            self._raise_any(failures)
        self._delta_base = kept
        stats = ex.stats(me)
        self.last_stats = {"sent": run.sent, "received": run.received, "sent_direct": 0,
                           "received_direct": 0, "local": int(stats["local"]),
                           "lower_bound": int(stats["lower_bound"]), "rounds": ex.num_rounds,
                           "on_device": False, "delta": base_ok,
                           "changed_words": run.changed, "words": run.words,
                           **{f"chunks_{n}": c for n, c in sorted(run.encodings.items())}}

    def _last_rounds(self) -> list[int]:
        """Per parameter, the last round in which this process receives any of its bytes (-1:
        none; its elements come from local copies and padding). Planned once."""
        if self._last_rounds_cache is not None:
            return self._last_rounds_cache
        ex = self._exchange
        assert ex is not None
        me = self._me
        last = [-1] * len(self._names)
        for k, peer, _ in ex.receives(me):
            _, rest, messages = ex.messages(peer, me, k)
            for _, _, param, _, _ in messages:
                if param >= 0:
                    last[param] = max(last[param], k)
            if rest:
                for box in ex.boxes(me, "unpack", peer, k):
                    last[box[0]] = max(last[box[0]], k)
        self._last_rounds_cache = last
        return last

    def _move(self, sources: list[Optional["torch.Tensor"]],
              targets: list[Optional["torch.Tensor"]], comm: "torch.device",
              on_device: bool, finished: Callable[[int], None]) -> None:
        """Every round's messages, with the staged sides packed and unpacked by the host
        executor (shards in host memory; over a GPU transport every message is copied between
        host and device) or, ``on_device``, by torch's strided copies where the shards are.
        ``finished(k)`` is called once round k is unpacked (k = -1: the local copies)."""
        import torch
        ex = self._exchange
        assert ex is not None
        me = self._me
        src, dst = _addresses(sources), _addresses(targets)
        rounds = ex.num_rounds
        # A chunk travels as its messages: a side where a box is one run of bytes in the shard
        # sends from (or receives into) the shard as it lies, the other side packs it into (or
        # unpacks it from) staging. Both sides derive the same messages from the plan.
        # (round, peer, staging bytes, [(shard's parameter or -1 for staging, byte, bytes)])
        sends: list[tuple[int, int, int, list[tuple[int, int, int]]]] = []
        receives: list[tuple[int, int, int, list[tuple[int, int, int]]]] = []
        for k, peer, _ in ex.sends(me):
            rest, _, ms = ex.messages(me, peer, k)
            sends.append((k, peer, rest, [(sp, sb, b) for sp, sb, _, _, b in ms]))
        for k, peer, _ in ex.receives(me):
            _, rest, ms = ex.messages(peer, me, k)
            receives.append((k, peer, rest, [(dp, db, b) for _, _, dp, db, b in ms]))

        def by_round(items: list[tuple[int, int, int, list[tuple[int, int, int]]]]
                     ) -> list[list[tuple[int, int, int, list[tuple[int, int, int]]]]]:
            """Per round: (peer, offset in the round's staging, staging bytes, messages)."""
            out: list[list[tuple[int, int, int, list[tuple[int, int, int]]]]] = \
                [[] for _ in range(rounds)]
            offset = [0] * rounds
            for k, peer, n, ms in items:
                out[k].append((peer, offset[k], n, ms))
                offset[k] += (n + 63) // 64 * 64
            return out

        send_rounds, recv_rounds = by_round(sends), by_round(receives)

        def size(items: list[list[tuple[int, int, int, list[tuple[int, int, int]]]]]) -> int:
            return max([off + (n + 63) // 64 * 64 for r in items for _, off, n, _ in r] or [0])

        # Two buffers each way: round k's chunks travel while round k+1 is packed and round
        # k-1's are unpacked, so a receiver has posted round k before it unpacks round k-1.
        where = comm if on_device else torch.device("cpu")
        send_bufs = [torch.empty(size(send_rounds), dtype=torch.uint8, device=where)
                     for _ in range(2)]
        recv_bufs = [torch.empty(size(recv_rounds), dtype=torch.uint8, device=where)
                     for _ in range(2)]
        base = [int(b.data_ptr()) for b in send_bufs]
        dtypes = [_torch_dtype(d) for d in self._dtypes or []]

        def flat(t: Optional["torch.Tensor"]) -> "torch.Tensor":
            assert t is not None
            return t.reshape(-1)

        def staging(buf: "torch.Tensor", off: int, n: int, param: int) -> "torch.Tensor":
            return buf[off:off + (n + 63) // 64 * 64].view(dtypes[param])

        def box(t: "torch.Tensor", shape: list[int], strides: list[int],
                offset: int) -> "torch.Tensor":
            return t.as_strided(shape, strides, t.storage_offset() + offset)

        def copy(boxes: list[Any], source: Callable[[int], "torch.Tensor"],
                 target: Callable[[int], "torch.Tensor"]) -> None:
            """Boxes between two flat tensors per parameter, by torch's strided copies."""
            for param, shape, so, ss, do, ds, _ in boxes:
                box(target(param), shape, ds, do).copy_(box(source(param), shape, ss, so))

        def pack(k: int) -> None:
            for peer, off, n, _ in send_rounds[k]:
                if not n:
                    continue
                if on_device:
                    copy(ex.boxes(me, "pack", peer, k), lambda p: flat(sources[p]),
                         functools.partial(staging, send_bufs[k % 2], off, n))
                else:
                    ex.pack(me, peer, k, base[k % 2] + off, n, src, self._options, True)

        def unpack(k: int, staged: list[tuple["torch.Tensor", "torch.Tensor"]]) -> None:
            for into, buf in staged:  # host staging of messages that travelled on a device
                into.copy_(buf)
            recv_buf = recv_bufs[k % 2]
            for peer, off, n, _ in recv_rounds[k]:
                if not n:
                    continue
                if on_device:
                    copy(ex.boxes(me, "unpack", peer, k),
                         functools.partial(staging, recv_buf, off, n), lambda p: flat(targets[p]))
                else:
                    ex.unpack(me, peer, k, int(recv_buf.data_ptr()) + off, n, dst,
                              self._options, True)

        def copy_local() -> None:
            if not on_device:
                ex.copy_local(me, src, dst, self._options)
                return
            copy(ex.boxes(me, "local"), lambda p: flat(sources[p]), lambda p: flat(targets[p]))
            for param, shape, _, _, do, ds, _ in ex.boxes(me, "padding"):
                box(flat(targets[param]), shape, ds, do).zero_()

        # Over a GPU transport, host memory travels through device copies of each message.
        through = comm.type != "cpu" and not on_device
        sent = received = sent_direct = received_direct = 0
        if rounds:
            pack(0)
        pending: Optional[tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]] = None
        for k in range(rounds):
            outgoing: list[tuple[torch.Tensor, int]] = []
            incoming: list[tuple[torch.Tensor, int]] = []
            staged: list[tuple[torch.Tensor, torch.Tensor]] = []
            for peer, off, _, parts in send_rounds[k]:
                for param, at, n in parts:
                    if param >= 0:
                        buf = _bytes_of(sources[param])[at:at + n]
                        sent_direct += n
                    else:
                        buf = send_bufs[k % 2][off + at:off + at + n]
                    outgoing.append((buf.to(comm) if through else buf, peer))
                    sent += n
            for peer, off, _, parts in recv_rounds[k]:
                for param, at, n in parts:
                    if param >= 0:
                        buf = _bytes_of(targets[param])[at:at + n]
                        received_direct += n
                    else:
                        buf = recv_bufs[k % 2][off + at:off + at + n]
                    if through:
                        staged.append((buf, torch.empty(n, dtype=torch.uint8, device=comm)))
                        buf = staged[-1][1]
                    incoming.append((buf, peer))
                    received += n
            requests = self._comm.exchange(outgoing, incoming)
            if k == 0:
                copy_local()
            if pending is not None:  # round k-1 arrived (waited below, last iteration)
                unpack(*pending)
            if k + 1 < rounds:  # its buffer's last sends (round k-1) have completed
                pack(k + 1)
            # What the local copies and round k-1 completed is used while round k travels.
            if k == 0:
                finished(-1)
            if pending is not None:
                finished(pending[0])
            for request in requests:
                request.wait()
            pending = (k, staged)
        if pending is not None:
            unpack(*pending)
            finished(pending[0])
        if not rounds:
            copy_local()
            finished(-1)
        stats = ex.stats(me)
        self.last_stats = {"sent": sent, "received": received, "sent_direct": sent_direct,
                           "received_direct": received_direct,
                           "local": int(stats["local"]),
                           "lower_bound": int(stats["lower_bound"]), "rounds": rounds,
                           "on_device": on_device}


class _DeltaRun:
    """What one delta run moved: bytes on the wire, and words changed of words compared."""

    def __init__(self) -> None:
        self.sent = self.received = self.changed = self.words = 0
        self.encodings: dict[str, int] = {}
        self.failure: Optional[str] = None


def _even(n: int) -> int:
    return n + n % 2


def _bytes_of(t: Optional["torch.Tensor"]) -> "torch.Tensor":
    """A dense shard's bytes, as a flat uint8 view (the exchange's byte offsets index it)."""
    import torch
    assert t is not None and t.is_contiguous()
    return t.reshape(-1).view(torch.uint8)


def _weak(tensors: Mapping[str, Any]) -> Optional[dict[str, Any]]:
    """Weak references to a mapping's tensors (None when one cannot be referenced weakly)."""
    try:
        return {n: weakref.ref(t) for n, t in tensors.items()}
    except TypeError:
        return None


def _alive(refs: Optional[dict[str, Any]], what: str, argument: str) -> dict[str, Any]:
    """The tensors that weak references still reach; RedistributeError when any is gone."""
    if refs is None:
        raise RedistributeError(f"no {what} to check: give {argument}= (no run has kept them)")
    out = {n: r() for n, r in refs.items()}
    gone = sorted(n for n, t in out.items() if t is None)
    if gone:
        raise RedistributeError(f"the {what} of the last run are gone ({gone[:4]}); give "
                                f"{argument}=")
    return out


def _element(v: "torch.Tensor") -> str:
    """One element as a message shows it: its value, an FP8 element's bits."""
    import torch
    if v.element_size() == 1 and v.dtype.is_floating_point:
        return f"0x{int(v.view(torch.uint8).item()):02x}"
    return str(v.item())


def _addresses(ts: list[Optional["torch.Tensor"]]) -> list[tuple[int, int]]:
    return [(0, 0) if t is None else (int(t.data_ptr()), t.numel()) for t in ts]


@overload
def redistribute(source_maps: Mapping[str, MapLike], target_maps: Mapping[str, MapLike],
                 shards: Mapping[str, "torch.Tensor"], *, source_ranks: Sequence[int],
                 target_ranks: Sequence[int], group: Any = ...,
                 out: Optional[Mapping[str, "torch.Tensor"]] = ..., dry_run: Literal[False] = ...,
                 **options: Any) -> dict[str, "torch.Tensor"]: ...


@overload
def redistribute(source_maps: Mapping[str, MapLike], target_maps: Mapping[str, MapLike],
                 shards: Mapping[str, "torch.Tensor"], *, source_ranks: Sequence[int],
                 target_ranks: Sequence[int], group: Any = ...,
                 out: Optional[Mapping[str, "torch.Tensor"]] = ..., dry_run: Literal[True],
                 **options: Any) -> dict[str, Any]: ...


def redistribute(source_maps: Mapping[str, MapLike], target_maps: Mapping[str, MapLike],
                 shards: Mapping[str, "torch.Tensor"], *, source_ranks: Sequence[int],
                 target_ranks: Sequence[int], group: Any = None,
                 out: Optional[Mapping[str, "torch.Tensor"]] = None, dry_run: bool = False,
                 **options: Any) -> Any:
    """One re-sharding: this process's source shards -> its target shards (see
    :class:`Redistributor`, whose keyword options it takes; use one to sync repeatedly).
    With ``dry_run=True`` it returns :meth:`Redistributor.schedule` and moves nothing."""
    known = {"dtypes", "bucket_bytes", "scale_power", "allow_scaled_optimizer_state",
             "allow_lossy_scale", "num_threads"}
    unknown = sorted(set(options) - known)
    error = None
    if unknown:  # told to every process by the constructor's agreement, not raised here alone
        error = f"redistribute() got unknown options {unknown}; it takes {sorted(known)}"
        options = {k: v for k, v in options.items() if k in known}
    r = Redistributor(source_maps, target_maps, source_ranks=source_ranks,
                      target_ranks=target_ranks, group=group, _error=error, **options)
    return r.run(shards, out, dry_run=dry_run)



__all__ = ["DEFAULT_BUCKET_BYTES", "RedistributeError", "Redistributor", "Transport",
           "redistribute"]
