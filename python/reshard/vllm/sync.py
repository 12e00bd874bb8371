"""Live weight sync from trainer processes into a running vLLM engine (DESIGN 18).

Every trainer process builds one :class:`WeightSync` and calls :meth:`WeightSync.push` after
each step with the shards it holds. One process group spans the trainer processes (ranks 0 ..
T-1) and the engine's workers (T .. T+W-1), built over a TCPStore the first trainer process
serves, beside whatever default groups either side has. One plan goes from the trainer's maps
to the engine's (:class:`reshard.distributed.Redistributor`): each worker receives only the
bytes it lacks, from the trainer process that holds them, packed by the strided-copy engine in
chunks of at most ``bucket_bytes`` per round, and written straight into its (fused)
parameters; then vLLM's post-load processing runs (see :mod:`reshard.vllm.engine`). Into
several engines, the push executes the sync schedule ``reshard.plan_sync`` plans (DESIGN 21):
each byte out of the trainer processes once, the engines' workers relaying the rest
(:mod:`reshard.vllm._schedule` plans the exchanges, :mod:`reshard.vllm._exchange` runs them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import socket
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import (TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional, Sequence,
                    Union)

from .._errors import LayoutError
from .._maps import MapLike, ParamMap, as_map
from ..distributed import (DEFAULT_BUCKET_BYTES, QuantizingRedistributor, RedistributeError,
                           Redistributor, _megatron_dtypes, _message, _torch_dtype)
from ._client import _Background, _Client
from ._group import StoreGroup, join_store, serve_store

# What the sync is made of, offered here as before (the names are the modules' own).
from ._agreement import (PushClaim as PushClaim, push_refusal as push_refusal,
                         whole_digests as whole_digests, whole_tensors as whole_tensors)
from ._client import WeightSyncError as WeightSyncError
from ._exchange import (lane_groups as lane_groups, raw_exchange as raw_exchange,
                        run_stages as run_stages, verify_engines)
from ._schedule import (RELAY_WAVES as RELAY_WAVES, AnyRedistributor as AnyRedistributor,
                        Stage as Stage, _step_levels as _step_levels, carry_delta,
                        cut_waves as cut_waves, identities,
                        default_topology as default_topology, engine_ranks as engine_ranks,
                        plan_stages as plan_stages, schedule_topology as schedule_topology,
                        stage_bytes as stage_bytes, sync_schedule as sync_schedule,
                        torch_dtypes as torch_dtypes)

if TYPE_CHECKING:
    import torch

    from ..torch import TorchSource


def torch_dtype_of(name: str) -> "torch.dtype":
    """A library dtype name ("BF16") as torch's."""
    return _torch_dtype(name)


@dataclass(frozen=True)
class SyncStats:
    """One push: ``bytes_sent`` by all trainer processes together, ``plan_minimum`` (the
    bytes the engine's workers lack, summed: what any transfer must move; equal to
    ``bytes_sent``), ``bytes_sent_here`` by this process, the ``seconds`` it took, and
    ``worker_seconds``: how long the slowest worker took to ``prepare`` (its layers back in
    loading form), to ``transfer`` (receive and unpack; with ``overlap_processing``, each
    layer processed as soon as it has arrived), to ``process`` (vLLM's post-load processing,
    during the transfer or after it) and to ``commit`` (the processed layers into the tensors
    the engine serves). ``bytes_gathered``: with ``quantize=``, the bytes of blocks split
    between trainer processes sent to the one that quantizes them (among the trainer processes,
    in the source dtype; not in ``bytes_sent``). With several engines, ``bytes_sent`` is what
    left the trainer processes (one copy of what the engines lack, however many engines),
    ``bytes_relayed`` what engines' workers sent on to other engines' workers, ``links`` the
    bytes of each (sender -> receiver) pair of processes (``"trainer 0 -> engine 1 worker
    0"``), and ``busiest_link`` the pair that moved the most. After ``push(..., delta=True)``,
    ``bytes_sent_here`` is what this process sent (the changes, encoded, and 24 bytes of header
    per chunk); the others stay the plan's."""

    bytes_sent: int
    plan_minimum: int
    bytes_sent_here: int
    seconds: float
    worker_seconds: Optional[dict[str, float]] = None
    bytes_gathered: int = 0
    bytes_relayed: int = 0
    links: Optional[dict[str, int]] = None
    busiest_link: Optional[str] = None
    dropped: Optional[list[str]] = None


@dataclass(frozen=True)
class VerifyStats:
    """One :meth:`WeightSync.verify`: the (tensor, engine worker) ``pairs`` whose served
    values were proven equal to the trainer's, the tensors left ``unverified`` (on some
    engine a worker serves them in a form its post-load processing made, not as loaded), and
    the ``seconds`` it took; with ``on_engine_lost="drop"``, the engines it ``dropped`` (lost
    before or during it: what it proved is of the others)."""

    pairs: int
    unverified: list[str]
    seconds: float
    dropped: Optional[list[str]] = None


def _calls_differ(what: str, told: Sequence[Any]) -> Optional[str]:
    """Why the trainer processes cannot go on with the collective call ``what`` of a sync
    (``told``: each process's ``(call, value)``, gathered over the trainer's group), or None:
    a process that made another call of the sync (one calling remove_engine() while the
    others push) is paired with theirs by the group, and none may read the other's value."""
    calls = [t[0] if isinstance(t, tuple) and len(t) == 2 and isinstance(t[0], str) else None
             for t in told]
    if all(c == what for c in calls):
        return None
    return ("the trainer processes made different calls of this WeightSync at once ("
            + ", ".join(f"process {r}: {f'{c}()' if c else 'another call'}"
                        for r, c in enumerate(calls))
            + "); nothing was changed: every trainer process makes the same calls of the sync "
            "in the same order")


class _Regrouped(Exception):
    """A push lost engines, which were dropped; the others joined again (``dropped``)."""

    def __init__(self, dropped: list[str]) -> None:
        super().__init__("; ".join(dropped))
        self.dropped = dropped


def engine_maps(model_dir: str, tensor_parallel_size: int, dtype: str = "auto"
                ) -> dict[str, Any]:
    """The maps of every checkpoint tensor of the model in ``model_dir`` onto vLLM's workers
    at ``tensor_parallel_size`` ranks holding ``dtype`` (the engine's: ``LLM(dtype=...)``),
    learned from vLLM (:func:`reshard.vllm.layout`)."""
    from .._maps import read_maps
    from .layout import layout
    return dict(read_maps(layout(model_dir, tensor_parallel_size, dtype=dtype)))


# The longest wait a sync takes (the store's and the group's timeouts are timedeltas, in
# milliseconds in C++): about 31 years.
_MAX_TIMEOUT_S = 1e9


def _seconds_problem(timeout_s: Any) -> Optional[str]:
    """Why ``timeout_s`` is not a wait the sync can bound itself by, or None."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or \
            not math.isfinite(timeout_s) or not 0 < timeout_s <= _MAX_TIMEOUT_S:
        return (f"timeout_s must be a number of seconds above 0 and at most {_MAX_TIMEOUT_S:g} "
                f"(it bounds every wait), got {timeout_s!r}")
    return None


def _check_host(host: str) -> None:
    """Raises OSError unless ``host`` resolves to an address of this machine (one a socket can
    be bound to): the store is served there, and its own client would otherwise wait out the
    timeout connecting to it."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise OSError(f"it does not resolve ({e})") from None
    problems = []
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind((address[0], 0) + tuple(address[2:]))
            return
        except OSError as e:
            problems.append(f"{address[0]}: {e.strerror or e}")
    raise OSError(f"it is not an address of this machine ({'; '.join(problems)})")


class WeightSync:
    """Pushes the trainer's weights into a running vLLM engine, planned once.

    Every trainer process constructs it (a collective over the trainer processes and the
    engine's workers). ``engine`` is the ``vllm.LLM`` in the process that owns it (None in
    the others), or the URL of a ``vllm serve`` server (in one process, or in all);
    ``source`` is the trainer's model (a ``torch.nn.Module``) or state dict as it lies: its
    DTensors' meshes and placements are its layout (:func:`reshard.torch.maps_of`, merged over
    the trainer processes, map rank i being trainer process i of ``group``), and each push sends
    its current weights; a Megatron-Core model is read as :func:`reshard.torch.megatron_maps`
    reads it, its tensors named by ``config`` (the model's Hugging Face config.json: a dict,
    its text or path); or ``source_maps`` gives the layout explicitly: ``{checkpoint name:
    ParamMap | dict}`` (any reshard describes: TP splits, DeepSpeed AutoTP, FSDP rows, TP 1;
    buffers too), the same in every process, each push then given the shards. ``group`` is
    the torch.distributed group of the trainer processes (None: the world, or this process
    alone when torch.distributed is not initialized).
    ``target_maps`` defaults to vLLM's layout of the engine's model; ``dtypes`` (one dtype or
    ``{name: dtype}``) to the engine's parameter dtypes. ``bucket_bytes`` bounds the memory
    each process stages per round; ``backend`` is "gloo" (CPU) or "nccl" (GPU); ``host`` the
    address of this machine the engine's workers reach (the store is served there).
    ``overlap_processing``: whether a worker runs vLLM's post-load processing of each layer
    as soon as the layer has arrived, while the next ones travel (True), or of every layer
    after the transfer (False); None (default) overlaps on GPU engines and not on CPU
    engines, where processing and transport compete for the same cores. Either way nothing
    the engine serves changes until every worker has every layer processed.
    ``quantize`` (:class:`reshard.distributed.QuantizingRedistributor`'s: ``{"block": [128,
    128]}`` for every ``X`` the engine holds as FP8 ``X`` + ``X_scale_inv``) pushes bf16
    shards into an FP8-block engine, quantized at the trainer.

    ``engines`` instead of ``engine``: several engines (each an LLM in the process that owns
    it, None in the others, or a URL; the same length in every trainer process), pushed with
    one plan: the sync schedule ``reshard.plan_sync`` plans for the same maps (each byte out of
    the trainer processes once, to the tensor's root engine, replicated pieces to one holder;
    the engines' workers hand on and relay the rest, :func:`plan_stages`); every engine
    commits or none does. ``target_maps`` is then a list, one map set (or None) per engine.
    ``relay_waves``: how many waves a push into several engines is cut into (an engine relays
    one wave while it receives the next; 1: each engine relays once it has received
    everything). ``topology`` (``reshard sync-plan``'s topology JSON: hosts, GPUs, placement;
    its path or a dict) says where the processes run, for the schedule's cost model; by
    default each process is a GPU of the host its host name says.

    Engines come and go between pushes (:meth:`add_engine`, :meth:`remove_engine`): the
    sync's own group over the trainer processes and the engines' workers is rebuilt over the
    same store and the schedule planned anew for the engines present; the trainer's groups
    are not touched. Each engine keeps the number it was given (the constructor's engines
    0 .. M-1, then one more per added engine: :attr:`engine_ids`). ``on_engine_lost``:
    "fail" (default) makes a push that loses an engine fail on every trainer process and the
    sync unusable; "drop" drops the lost engine and completes the push on the others (see
    :meth:`push`).
    """

    def __init__(self, engine: Any = None, source_maps: Optional[Mapping[str, MapLike]] = None,
                 group: Any = None, *, engines: Optional[Sequence[Any]] = None,
                 source: Optional["TorchSource"] = None,
                 target_maps: Union[None, Mapping[str, MapLike],
                                    Sequence[Optional[Mapping[str, MapLike]]]] = None,
                 dtypes: Union[None, Any, Mapping[str, Any]] = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, backend: Optional[str] = None,
                 host: str = "127.0.0.1", timeout_s: float = 600.0,
                 overlap_processing: Optional[bool] = None, quantize: Any = None,
                 config: Any = None, relay_waves: int = RELAY_WAVES,
                 topology: Any = None, on_engine_lost: str = "fail") -> None:
        import torch.distributed as dist
        self._group = group
        self._overlap = overlap_processing
        if dist.is_initialized():
            self._rank = dist.get_rank(group)
            self._trainers = dist.get_world_size(group)
        else:
            self._rank, self._trainers = 0, 1
        if backend is None:
            import torch
            backend = "nccl" if torch.cuda.is_available() and \
                dist.is_initialized() and "nccl" in str(dist.get_backend(group)) else "gloo"
        self._steps = 0  # pushes begun: agreed among the trainer processes in each push
        self._guard = threading.Lock()  # over the two below
        self._in_push = False  # a push in progress (one at a time)
        self._busy = "a push"  # what holds _in_push: a push, or a membership change
        self._overlapped = False  # another push was asked for while it was in progress
        self._whole: list[str] = []  # the tensors every trainer process holds whole
        self._lost: Optional[str] = None  # why this sync's group broke (a process lost)
        self._comm: Optional[StoreGroup] = None
        self._sync: Optional[AnyRedistributor] = None
        # Who drives each engine: the process holding its LLM, or the first naming its URL;
        # and an argument wrong on any process, refused on all.
        bad = None
        if engines is not None and engine is not None:
            bad = f"give engine or engines=, not both (trainer process {self._rank})"
        elif engines is not None and (isinstance(engines, (str, bytes)) or
                                      not isinstance(engines, Sequence) or not engines):
            bad = (f"engines= is a non-empty list of engines (an LLM, a URL or None each), got "
                   f"{engines!r} (trainer process {self._rank})")
        elif isinstance(relay_waves, bool) or not isinstance(relay_waves, int) or \
                relay_waves < 1:
            bad = (f"relay_waves must be a positive int, got {relay_waves!r} (trainer process "
                   f"{self._rank})")
        elif overlap_processing is not None and not isinstance(overlap_processing, bool):
            bad = (f"overlap_processing must be True, False or None, got "
                   f"{overlap_processing!r} (trainer process {self._rank})")
        elif _seconds_problem(timeout_s) is not None:
            bad = f"{_seconds_problem(timeout_s)} (trainer process {self._rank})"
        elif not isinstance(host, str) or not host:
            bad = (f"host must be the name or address of this machine that the engine's "
                   f"workers reach, got {host!r} (trainer process {self._rank})")
        elif on_engine_lost not in ("fail", "drop"):
            bad = (f"on_engine_lost must be \"fail\" or \"drop\", got {on_engine_lost!r} "
                   f"(trainer process {self._rank})")
        elif (source is None) == (source_maps is None):
            bad = (f"give the trainer's layout as source= (its module or state dict) or as "
                   f"source_maps=, one of the two (trainer process {self._rank})")
        mine = [engine] if bad is not None or engines is None else list(engines)
        gathered = self._trainer_gather(([e is not None for e in mine], bad, source is not None))
        refusals = [b for _, b, _ in gathered if b is not None]
        if not refusals and len({s for _, _, s in gathered}) > 1:
            refusals = ["some trainer processes gave source=, others source_maps=; give the "
                        "same on every trainer process"]
        if not refusals and len({len(h) for h, _, _ in gathered}) > 1:
            refusals = ["the trainer processes were given different numbers of engines ("
                        + ", ".join(str(len(h)) for h, _, _ in gathered) + "); give every "
                        "trainer process the same list, None where another process holds "
                        "the LLM"]
        if refusals:
            raise WeightSyncError("; ".join(refusals))
        self._engines = len(mine)
        self._drivers = [self._driver_of(e, [h[e] for h, _, _ in gathered], mine[e])
                         for e in range(self._engines)]
        # The engines present, by number (stable while engines come and go), with this
        # process's handle of each (its LLM, a URL, or None) and the process that drives it.
        self._ids = list(range(self._engines))
        self._next_id = self._engines
        self._handles = dict(enumerate(mine))
        self._driver_by_id = dict(enumerate(self._drivers))
        self._target_arg = target_maps  # the constructor's engines' target maps
        self._added_targets: dict[int, Any] = {}  # an added engine's, by number
        self._on_lost = on_engine_lost
        self.last_stats: Optional[SyncStats] = None
        self._source = source
        self._megatron = False  # source= is a Megatron-Core model (its maps are buffers)
        self._source_maps: dict[str, ParamMap] = {}
        self._source_dtypes: dict[str, Any] = {}  # the trainer's tensors', by name
        if source is not None:  # a collective over the trainer processes, raising alike
            try:
                source_maps = self._source_maps_of(source, config)
            except (LayoutError, TypeError) as e:
                raise WeightSyncError(str(e)) from None
            self._source_maps = source_maps
        assert source_maps is not None
        self._maps = source_maps
        self._options = dict(backend=backend, timeout_s=timeout_s, bucket_bytes=bucket_bytes,
                             quantize=quantize, relay_waves=relay_waves, dtypes=dtypes)
        self._topology = topology  # for the constructor's engines; later joins: given anew
        self._timeout = float(timeout_s)
        self._generation = 0  # joins of the sync's group
        self._old_who: list[tuple[int, int]] = []  # the group's processes at the last join
        self._comms: list[StoreGroup] = []
        self._stages: list[Stage] = []
        self._verifiers: dict[Any, Redistributor] = {}  # see verify()
        self._adapter_stages: dict[str, list[Stage]] = {}  # push_lora's exchanges, by plan
        self._adapters: dict[str, None] = {}  # the names pushed, in order
        self._clients = {e: _Client(mine[e], timeout_s) for e, d in enumerate(self._drivers)
                         if d == self._rank}
        self._client = self._clients.get(0)
        prefix = f"reshard-{uuid.uuid4().hex}"
        store, where = None, None
        self._serving = self._drivers[0]  # the trainer process serving the store, for good
        if self._rank == self._serving:  # the store is served by the first engine's driver
            try:  # a host that is not this machine's is refused before the store waits on it
                _check_host(host)
                store = serve_store(host, timeout_s)
                where = (host, int(store.port), prefix)
            except Exception as e:  # agreed: every trainer process raises it
                where = ("", 0, f"trainer process {self._rank} could not serve the sync's "
                         f"store on host {host!r}: {_message(e)}")
        host, port, prefix = [w for w in self._trainer_gather(where) if w is not None][0]
        if not port:
            raise WeightSyncError(prefix)
        joined: Optional[str] = None  # why this process could not reach the store
        if store is None:
            try:
                store = join_store(host, port, timeout_s)
            except Exception as e:  # agreed once the engines have joined or failed to
                joined = (f"trainer process {self._rank} could not reach the sync's store at "
                          f"{host}:{port}: {_message(e)}")
        self._store, self._host, self._port, self._prefix = store, host, port, prefix
        self._join(joined)

    def _join(self, problem: Optional[str] = None, drop: bool = False) -> list[str]:
        """(a collective over the trainer processes) The sync's group over the trainer
        processes and the workers of the engines present (:attr:`_ids`), built over the
        store under a prefix of its own, and the push's plan. ``drop``: an engine that does
        not join (refuses, or does not join within ``timeout_s``) is dropped from the
        membership and the others join again; what was dropped, and why, is returned.
        Otherwise any refusal raises WeightSyncError on every trainer process."""
        self._generation += 1
        prefix = f"{self._prefix}/g{self._generation}"
        self._engines = len(self._ids)
        self._drivers = [self._driver_by_id[i] for i in self._ids]
        self._clients = {e: _Client(self._handles[i], self._timeout)
                         for e, i in enumerate(self._ids) if self._drivers[e] == self._rank}
        self._client = self._clients.get(0)
        self._verifiers = {}
        self._adapter_stages = {}
        backend, timeout_s = self._options["backend"], self._options["timeout_s"]
        store, host, port = self._store, self._host, self._port
        inits = {k: client.later("init_weight_transfer_engine", {"init_info": {
            "host": host, "port": port, "prefix": prefix, "trainers": self._trainers,
            "backend": backend, "timeout_s": timeout_s, "engine": k, "engines": self._engines,
            "sync": self._prefix}})
            for k, client in self._clients.items()} if problem is None else {}
        refused: dict[int, str] = {}  # (drop) engines that did not join, by position
        try:
            self._workers = self._workers_of(store, prefix, inits, timeout_s, problem,
                                             refused if drop else None)
            comm = StoreGroup(store, prefix + "/pg", self._rank,
                              self._trainers + sum(self._workers), backend, timeout_s)
            self._comm = comm
            self._comms = [comm]
            reports = [r for r in comm.gather_object(None) if r is not None]
            trainer_hosts = self._trainer_gather(socket.gethostname())
            plan = None
            if self._rank == 0:
                try:
                    if refused:  # the others join again, without them
                        raise WeightSyncError("the engines join again without "
                                              + ", ".join(map(self._which, refused)))
                    plan = self._plan(reports, self._maps, self._given_targets(),
                                      self._options["dtypes"], self._options["bucket_bytes"],
                                      self._options["quantize"], self._options["relay_waves"],
                                      self._topology, trainer_hosts)
                except Exception as e:
                    plan = {"error": _message(e), "source": {}, "targets": [{}] * self._engines,
                            "dtypes": [None] * self._engines,
                            "bucket_bytes": self._options["bucket_bytes"],
                            "quantize": None, "workers": self._workers, "waves": None,
                            "topology": None}
            plan = comm.gather_object(plan)[0]
            self._plan_json = plan
            old = self._stages
            self._stages = plan_stages(
                self._maps, plan, self._trainers,
                lane_groups(store, prefix, self._rank, comm, backend, timeout_s, self._comms),
                plan["error"])
            carry_delta(old, self._old_who, self._rank, self._stages,
                        identities(self._trainers, self._workers, self._ids), self._rank,
                        fresh=False)
            self._old_who = identities(self._trainers, self._workers, self._ids)
            self._sync = self._stages[0].redistributor
            for stage in self._stages:  # verify's messages name engines and workers
                for r in (stage.redistributor, getattr(stage.redistributor, "_final", None)):
                    if isinstance(r, Redistributor):
                        r._process_name = self._process_name
            self._whole = whole_tensors(self._maps, self._trainers)
        except RedistributeError as e:
            self._finish_all(inits)
            if refused:
                return self._join_without(refused)
            raise WeightSyncError(str(e)) from None
        except BaseException as e:
            problem_ = self._finish_all(inits)
            if problem_ is not None:
                raise WeightSyncError(f"the engine could not join: {problem_}") from e
            raise
        problem_ = self._finish_all(inits)
        if problem_ is not None:
            raise WeightSyncError(f"the engine could not join: {problem_}")
        for k, client in self._clients.items():
            if any(r.get("open") for r in reports if r.get("engine", 0) == k):
                # An update whose driving process was lost mid-push (the engine kept its old
                # weights) is still open in vLLM, which refuses to start another until it is
                # finished.
                client.call("finish_weight_update")
        return []

    def _given_targets(self) -> Any:
        """The target maps given for the engines present: the constructor's argument as it
        was for the constructor's engines, else one map set (or None) per engine."""
        if self._generation == 1:
            return self._target_arg
        given = self._target_arg
        out = []
        for i in self._ids:
            if i in self._added_targets:
                out.append(self._added_targets[i])
            elif isinstance(given, Mapping) or given is None:
                out.append(given)
            else:
                out.append(list(given)[i])
        return out

    def _join_without(self, refused: Mapping[int, str]) -> list[str]:
        """The engines at positions ``refused`` dropped (their reasons agreed), the others
        joined again: what was dropped, and why."""
        self._shut_groups()
        dropped = [f"{self._which(e)}: {why}" for e, why in sorted(refused.items())]
        gone = {self._ids[e] for e in refused}
        self._ids = [i for i in self._ids if i not in gone]
        if not self._ids:
            raise WeightSyncError("no engine is left to push to: " + "; ".join(dropped))
        return dropped + self._join(drop=True)

    def _shut_groups(self) -> None:
        for group in self._comms:
            group.shutdown()
        self._comms = []

    def _which(self, e: int) -> str:
        """Engine at position ``e``, by its number."""
        ids = getattr(self, "_ids", None)
        number = ids[e] if ids is not None and e < len(ids) else e
        return "the engine" if self._engines == 1 and number == 0 else f"engine {number}"

    @property
    def engine_ids(self) -> list[int]:
        """The numbers of the engines the next push goes to, in the schedule's order."""
        return list(self._ids)

    def _driver_of(self, e: int, has: list[bool], engine: Any) -> int:
        """The trainer process that drives engine ``e``: the one given its LLM, or the first
        given its URL."""
        if not any(has):
            raise WeightSyncError(f"no trainer process was given {self._which(e)}: pass the "
                                  "vllm.LLM (or the server's URL) in the process that has it")
        if sum(has) > 1 and not isinstance(engine, (str, type(None))):
            raise WeightSyncError(f"more than one trainer process was given an LLM object for "
                                  f"{self._which(e)}; give it in the process that owns it, "
                                  "None in the others")
        return has.index(True)

    def _finish_all(self, calls: Mapping[int, "_Background"]) -> Optional[BaseException]:
        """The first failure of ``calls`` (by engine position), each waited for at most the
        sync's timeout in all: an engine that hangs never answers."""
        deadline = time.monotonic() + self._timeout
        problems: list[BaseException] = []
        for e, call in calls.items():
            if not call.wait(max(0.0, deadline - time.monotonic())):
                problems.append(WeightSyncError(f"{self._which(e)} did not answer within "
                                                f"{self._timeout:g} s (is it hung?)"))
            elif call.result() is not None:
                problems.append(call.result())  # type: ignore[arg-type]
        return problems[0] if problems else None

    # -- construction -------------------------------------------------------------------

    def _source_maps_of(self, source: "TorchSource", config: Any) -> dict[str, ParamMap]:
        """The maps of the trainer's tensors, map rank i being trainer process i of the group,
        merged over the trainer processes: its DTensors', or a Megatron-Core model's tensors
        named by ``config`` (the same kind on every trainer process)."""
        import torch.distributed as dist
        from ..torch import _entries, gather_megatron, is_megatron, maps_of
        kinds = set(self._trainer_gather(is_megatron(source)))
        if len(kinds) > 1:
            raise LayoutError("some trainer processes gave a Megatron-Core model as source=, "
                              "others DTensors; give the same kind on every trainer process")
        self._megatron = kinds == {True}
        if self._megatron:
            buffers = gather_megatron(source, config, self._trainer_gather, self._rank)[0]
            self._source_dtypes = _megatron_dtypes(buffers)
            return buffers.maps
        if config is not None:
            raise LayoutError("config= names the tensors of a Megatron-Core source; the "
                              "source here is DTensors")
        ranks = [0]
        if dist.is_initialized():
            ranks = (list(range(dist.get_world_size())) if self._group is None else
                     [int(r) for r in dist.get_process_group_ranks(self._group)])
        maps = maps_of(source, ranks=ranks, merge=True, group=self._group)
        import torch
        for held in self._trainer_gather({n: str(t.dtype).replace("torch.", "")
                                          for n, t in _entries(source)}):
            for name, dtype in held.items():  # for the processes that hold none of a tensor
                self._source_dtypes.setdefault(name, getattr(torch, dtype))
        return maps

    def _trainer_gather(self, value: Any) -> list[Any]:
        import torch.distributed as dist
        if self._trainers == 1:
            return [value]
        out: list[Any] = [None] * self._trainers
        dist.all_gather_object(out, value, group=self._group)
        return out

    def _workers_of(self, store: Any, prefix: str, inits: Mapping[int, "_Background"],
                    timeout_s: float, problem: Optional[str],
                    refused: Optional[dict[int, str]] = None) -> list[int]:
        """Each engine's worker count, which its worker 0 publishes on joining; an engine's
        driver publishes the engine's refusal instead when its init call fails first. Read
        from the store by the process that serves it alone, and agreed among the trainer
        processes (a collective), with ``problem`` (this process could not reach the store)
        and any store error: a process that read the store earlier never reads it after the
        serving process has gone, and every trainer process raises the same
        WeightSyncError. ``refused`` (a dict, filled): an engine that refuses or does not join
        within ``timeout_s`` is put there with its reason and counted as 0 workers, and the
        others' counts returned (its workers read the refusal and stay out of the group)."""
        keys = [f"{prefix}/workers/{e}" for e in range(self._engines)]
        serving = self._rank == self._serving
        seen: Union[None, str, list[str]] = problem
        if problem is None and (serving or inits):
            try:  # the serving process waits for every engine, a driver for its own
                seen = self._joined(store, keys, inits, timeout_s, serving, refused is not None)
            except WeightSyncError as e:
                seen = str(e)
            except Exception as e:  # the store's process gone, or its timeout
                seen = (f"trainer process {self._rank} lost the sync's store while the "
                        f"engines joined: {_message(e)}")
        told = self._trainer_gather(seen)
        errors = [t for t in told if isinstance(t, str)]
        if errors:
            raise WeightSyncError(errors[0])
        values = told[self._serving]
        refusals = {e: v[7:] for e, v in enumerate(values) if not v.isdigit()}
        if refusals and refused is not None:
            refused.update(refusals)
        elif refusals:
            raise WeightSyncError("; ".join(
                f"{self._which(e)} could not join: {v}" if self._engines > 1 else
                f"the engine could not join: {v}" for e, v in refusals.items()))
        return [int(v) if v.isdigit() else 0 for v in values]

    def _joined(self, store: Any, keys: list[str], inits: Mapping[int, "_Background"],
                timeout_s: float, serving: bool, drop: bool = False) -> Optional[list[str]]:
        """(the serving process, or an engine's driver) Polls the store until every engine
        (the serving process) or this process's engines have joined or refused: the values
        of the keys (the serving process), else None. A key is set once (the first of the
        engine's worker 0 and its refusal wins). ``drop``: an engine late at the deadline is
        marked as refused rather than failing the join."""
        wanted = keys if serving else [keys[e] for e in inits]
        deadline = time.monotonic() + timeout_s
        while not store.check(wanted):
            for e, init in inits.items():
                if not init.running() and not store.check([keys[e]]):
                    # the engine refused to join
                    store.compare_set(keys[e], "", f"error: {init.result()}")
            if time.monotonic() > deadline:
                late = [e for e, k in enumerate(keys) if k in wanted and not store.check([k])]
                if drop and serving:
                    for e in late:
                        store.compare_set(keys[e], "", f"error: its workers did not join "
                                          f"within {timeout_s} s")
                    continue
                which = self._which(late[0]) if len(late) == 1 else \
                    f"engines {[self._ids[e] for e in late]}"
                raise WeightSyncError(f"the workers of {which} did not join within "
                                      f"{timeout_s} s")
            time.sleep(0.05)
        return [store.get(k).decode() for k in keys] if serving else None

    @staticmethod
    def _finish(call: Optional[_Background]) -> Optional[BaseException]:
        return None if call is None else call.result()

    def _plan(self, reports: list[dict[str, Any]], source_maps: Mapping[str, MapLike],
              target_maps: Any, dtypes: Any, bucket_bytes: int, quantize: Any,
              relay_waves: int, topology: Any, trainer_hosts: Sequence[str]) -> dict[str, Any]:
        """(trainer process 0) Every engine's maps and the dtypes its workers receive, from
        what the workers report of themselves, where the processes run (the schedule's
        topology), and the waves a push into several engines is cut into."""
        count = self._engines
        if target_maps is None or isinstance(target_maps, Mapping):
            if target_maps is not None and count > 1:
                raise WeightSyncError(f"with {count} engines, give target_maps as a list: one "
                                      "map set (or None) per engine")
            given: list[Any] = [target_maps] * count
        else:
            given = list(target_maps)
            if len(given) != count:
                raise WeightSyncError(f"target_maps has {len(given)} map sets for {count} "
                                      "engines")
        targets, types, hosts = [], [], []
        for e in range(count):
            mine = sorted((r for r in reports if r.get("engine", 0) == e),
                          key=lambda r: int(r.get("rank", 0)))
            target, typed = self._engine_plan(mine, source_maps, given[e], dtypes, e)
            targets.append(target)
            types.append(typed)
            hosts.append([str(r.get("host", "")) for r in mine])
        text = schedule_topology(topology, trainer_hosts, hosts)
        if quantize is not None and count > 1:  # one quantizing at the trainer serves all
            from ..distributed._quantize import check_quantized_targets
            sets = []
            for e, target in enumerate(targets):
                try:
                    sets.append(check_quantized_targets(quantize, source_maps, target))
                except RedistributeError as ex:
                    raise WeightSyncError(f"engine {e}: {ex}") from None
            for e, names in enumerate(sets):
                if names != sets[0]:
                    raise WeightSyncError(
                        f"quantize= quantizes {len(sets[0])} tensors into engine 0 and "
                        f"{len(names)} into engine {e} (first differing: "
                        f"{sorted(set(names) ^ set(sets[0]))[:2]}); FP8 engines of one "
                        "WeightSync hold the same tensors as FP8 blocks")
        source = {n: json.loads(as_map(m).to_json()) for n, m in source_maps.items()}
        waves = None
        if count > 1:  # relays: waves, each relayed as the next arrives
            import torch
            sizes = {n: math.prod(as_map(m).logical_shape) *
                     torch.empty(0, dtype=getattr(torch, types[0][n])).element_size()
                     for n, m in source.items() if n in types[0]}
            waves = cut_waves([source, *targets], sizes, relay_waves)
        return {"error": None, "source": source, "targets": targets, "dtypes": types,
                "bucket_bytes": bucket_bytes, "quantize": quantize, "workers": self._workers,
                "waves": waves, "topology": text,
                "ids": list(getattr(self, "_ids", range(count)))}

    def _engine_plan(self, reports: list[dict[str, Any]], source_maps: Mapping[str, MapLike],
                     target_maps: Optional[Mapping[str, MapLike]], dtypes: Any, e: int
                     ) -> tuple[dict[str, Any], dict[str, str]]:
        """One engine's maps (JSON) and dtypes, from its workers' reports."""
        first = reports[0]
        tp = int(first["tp"])
        if len(reports) != tp:
            raise WeightSyncError(f"{self._which(e)} has {len(reports)} workers for tensor "
                                  f"parallel size {tp}; reshard syncs engines without pipeline "
                                  "or data parallelism")
        if target_maps is None:  # learned for the dtype the engine runs, not the config's
            target_maps = engine_maps(first["model"], tp, first.get("dtype", "auto"))
        target = {n: json.loads(as_map(m).to_json()) for n, m in target_maps.items()}
        if dtypes is None:
            dtypes = {}
            params = first["params"]
            for name, m in target.items():
                key = as_map(m).buffer(0) or name
                if key in params:
                    dtypes[name] = params[key][1].replace("torch.", "")
            missing = sorted(set(target) - set(dtypes))
            if missing:
                raise WeightSyncError(f"{self._which(e)} has no parameter for {missing[:4]}")
        elif not isinstance(dtypes, Mapping):
            dtypes = {n: str(dtypes).replace("torch.", "") for n in target}
        else:
            dtypes = {n: str(d).replace("torch.", "") for n, d in dtypes.items()}
        unknown = sorted(set(source_maps) - set(target))  # the scales of quantize= are made
        if unknown:
            raise WeightSyncError(f"{self._which(e)} has no parameter for {unknown[:4]} "
                                  f"({len(unknown)} of the trainer's tensors)")
        return target, dtypes

    # -- pushes -------------------------------------------------------------------------

    @property
    def redistributor(self) -> AnyRedistributor:
        assert self._sync is not None
        return self._sync

    @property
    def transport(self) -> StoreGroup:
        assert self._comm is not None
        return self._comm

    def plan_minimum(self, stages: Optional[Sequence[Stage]] = None) -> int:
        """The bytes the engine's workers lack (what any push must move at least out of the
        trainer processes): with several engines, one copy of every tensor per dtype the
        engines take it at (the schedule's exchanges from the trainer processes). ``stages``:
        an adapter push's (default the weights')."""
        total = 0
        for stage in self._stages if stages is None else stages:
            ex = stage.redistributor._exchange
            if stage.source < 0 and ex is not None:
                total += sum(int(ex.stats(p)["lower_bound"])
                             for p in engine_ranks(self._trainers, self._workers, stage.engine))
        return total

    def _process_name(self, p: int) -> str:
        if p < self._trainers:
            return f"trainer {p}"
        ids = getattr(self, "_ids", range(self._engines))
        for e in range(self._engines):
            ranks = engine_ranks(self._trainers, self._workers, e)
            if p in ranks:
                return f"engine {ids[e]} worker {p - ranks.start}"
        return f"process {p}"

    def _worker_problem(self, p: int, error: str) -> str:
        """The problem a worker (process ``p`` of the group) reported, naming its engine where
        there are several (a worker names itself by its rank in its engine alone)."""
        name = self._process_name(p)
        if self._engines > 1 and name.startswith("engine ") and error.startswith("worker "):
            return f"{name.rsplit(' worker ', 1)[0]} {error}"
        return error

    def _moved(self, stages: Optional[Sequence[Stage]] = None
               ) -> tuple[int, int, int, dict[str, int]]:
        """The last push's bytes (of ``stages``, default the weights'): out of the trainer
        processes, out of this process, relayed by engines' workers, and per link (sender ->
        receiver)."""
        sent, here, relayed, links = stage_bytes(self._stages if stages is None else stages,
                                                 self._trainers, self._workers, self._rank)
        return sent, here, relayed, {f"{self._process_name(a)} -> {self._process_name(b)}": n
                                     for (a, b), n in links.items()}

    def push(self, shards: Union[None, "TorchSource", Mapping[str, "torch.Tensor"]] = None,
             *, delta: bool = False, verify: bool = False, lora: Optional[str] = None,
             config: Any = None) -> SyncStats:
        """This process's shards ``{checkpoint name (or buffer): tensor}`` -> the engine's
        weights. Every trainer process calls it; it returns once every worker holds the new
        weights, or raises :class:`WeightSyncError` on every trainer process with the
        engine serving the weights it had. A process lost mid-push (see :meth:`_lost_peer`)
        makes the others raise it within ``timeout_s``; this sync cannot push again. With
        ``on_engine_lost="drop"``, an engine lost mid-push (or before it: one that cannot
        start an update) is dropped instead and the push made again, whole, on the others
        (:meth:`_recover`), which commit it; :attr:`SyncStats.dropped` names what was
        dropped, a RuntimeWarning says so, and :attr:`last_stats` keeps the stats.
        Before any byte moves the trainer processes agree that they make the same push
        (:func:`push_refusal`): one push of the sync at a time (another, from another thread,
        raises at once), the same tensors held whole on every process equal.
        Built with ``source=``, ``shards`` defaults to that source as it is now (a module's
        current weights); a module or state dict of DTensors is taken too (each DTensor's
        ``to_local()``).

        ``delta=True``: between each pair of processes of every exchange of the schedule (the
        trainer's sends, the engines' relays) only what changed since the last delta push
        travels (:meth:`reshard.distributed.Redistributor.run`); every worker's parameters
        come out bit-equal to a full push's. The first delta push, and one after a push that
        failed anywhere, sends everything.

        ``verify=True``: after each exchange of the push, before any layer is processed (the
        workers then process every layer after the transfer), every worker's received tensors
        are checked against the trainer's shards by fingerprints
        (:meth:`reshard.distributed.Redistributor.verify`: a few integers travel, not the
        tensors). What is proven is what each worker loaded, before vLLM's post-load processing
        (which may repack, transpose or requantize it: that the proof cannot see). A difference
        fails the push on every trainer process, naming the tensor, the worker (its process in
        the sync's group and its rank in the engine) and the first differing element; the
        engine keeps serving the weights it had.

        ``lora="NAME"``: ``shards`` is a LoRA adapter (and ``config`` its config), pushed as
        :meth:`push_lora` pushes it."""
        if lora is not None:
            if delta or verify:
                raise WeightSyncError("an adapter push (lora=) takes no delta= or verify=")
            return self.push_lora(lora, shards, config=config)
        try:
            return self._push_plan(shards, self._overlap, delta, verify)
        except WeightSyncError:
            # A push that failed anywhere (even once every byte had arrived) makes the next one
            # whole: this process asks for no delta, and the exchanges agree on that.
            for stage in self._stages:
                if hasattr(stage.redistributor, "_delta_base"):
                    stage.redistributor._delta_base = None
            raise

    def push_lora(self, name: str, adapter: Any, *, config: Any = None) -> SyncStats:
        """The trainer's LoRA adapter -> every engine, servable under ``name``
        (:meth:`lora_request`). Every trainer process calls it with what it holds of the
        adapter: a PEFT model (its active adapter; plain, under FSDP2 or TP, its DTensors read
        as :func:`reshard.torch.maps_of` reads them), or a mapping of the adapter's tensors
        under PEFT's saved names (``base_model.model.M.lora_A.weight``) with ``config`` (its
        adapter_config.json: a dict, its text or its path). The engines run with
        ``enable_lora=True``.

        Each worker receives only its part of each adapter tensor, laid out as its base
        weight is (A whole and B split by rows for a column-parallel layer, A split by columns
        and B whole for a row-parallel one; fused qkv_proj / gate_up_proj as vLLM slices
        them): the adapter's plan minimum, out of the trainer processes once, over the sync's
        schedule (several engines: relayed as a push is). Then two phases: every worker of
        every engine stages the adapter (vLLM's LoRAModel, checked as vLLM checks one it
        loads), and only when all have is it committed on all, kept by each worker and
        registered in its adapter cache under :func:`lora_id` ``(name)`` (a ``vllm serve``
        server serves it as ``"model": name``); a failure anywhere leaves the adapter
        that was served under ``name`` (or none) served everywhere, and raises
        WeightSyncError on every trainer process. A second push under the same name replaces
        the adapter, on every engine or on none; what the engines computed with the old one
        (their prefix caches) is dropped. An engine added later (:meth:`add_engine`) holds
        none of the adapters pushed before it joined: push them again."""
        from . import _lora
        import hashlib

        import torch
        from ..torch import maps_of, shards_of
        if self._lost is not None:
            raise WeightSyncError(f"{self._lost}; build a new WeightSync")
        problem = None
        tensors: dict[str, Any] = {}
        adapter_config: dict[str, Any] = {}
        if not isinstance(name, str) or not name:
            problem = f"push_lora() needs the adapter's name (a non-empty str), got {name!r}"
        else:
            try:
                tensors, adapter_config = _lora.adapter_state(adapter, config)
            except Exception as e:
                problem = _message(e)
        # Tagged: a process making another call of the sync meanwhile (add_engine) is
        # refused with the others, on every process, before anything is planned.
        told = self._agree("push_lora", (problem, name, adapter_config))
        problems = [f"trainer process {r}: {p}" for r, (p, _, _) in enumerate(told) if p]
        if not problems and len({json.dumps([n, c], sort_keys=True) for _, n, c in told}) > 1:
            problems = ["the trainer processes pushed different adapters (names or configs)"]
        if problems:
            raise WeightSyncError("; ".join(problems))
        import torch.distributed as dist
        ranks = [0]
        if dist.is_initialized():
            ranks = (list(range(dist.get_world_size())) if self._group is None else
                     [int(r) for r in dist.get_process_group_ranks(self._group)])
        try:
            source = maps_of(tensors, ranks=ranks, merge=True, group=self._group)
            shapes = {n: list(m.logical_shape) for n, m in source.items()}
            plan = self._adapter_plan(source, shapes)
            error = None
        except (LayoutError, WeightSyncError) as e:
            error = _message(e)
        errors = [e for e in self._trainer_gather(error) if e is not None]
        if errors:
            raise WeightSyncError(f"adapter {name!r}: {errors[0]}")
        regions = plan.pop("regions")
        key = hashlib.sha256(json.dumps([self._generation, plan], sort_keys=True).encode()
                             ).hexdigest()[:24]
        types = {n: getattr(torch, d) for n, d in plan["dtypes"][0].items()}
        local_error = None
        try:
            local = {n: t.to(types[n]) for n, t in
                     shards_of(tensors, source, self._rank, types).items()}
        except Exception as e:
            local, local_error = {}, f"trainer process {self._rank}: {_message(e)}"
        pushed: dict[str, Any] = {
            "name": name, "id": _lora.lora_id(name), "config": adapter_config, "plan": plan,
            "regions": regions, "key": key,
            "prefix": f"{self._prefix}/g{self._generation}/lora{len(self._adapter_stages)}"}
        update: dict[str, Any] = {"mode": "lora", "lora": pushed}

        def send() -> None:
            stages = self._adapter_exchanges(pushed)
            run_stages(stages, -1, self._rank, local, None, None, local_error)
        return self._push(update, send, stages=lambda: self._adapter_stages[key])

    @property
    def adapter_names(self) -> list[str]:
        """The names of the adapters pushed with :meth:`push_lora`, in order."""
        return list(self._adapters)

    def lora_request(self, name: str) -> Any:
        """vLLM's ``LoRARequest`` of the adapter pushed under ``name`` (its id
        :func:`reshard.vllm.lora_id` of the name; its path a placeholder that vLLM requires,
        which the workers answer from the adapter they keep, never reading it)."""
        from . import _lora
        return _lora.lora_request(name)

    def _adapter_plan(self, source: Mapping[str, ParamMap], shapes: Mapping[str, Any]
                      ) -> dict[str, Any]:
        """The plan of an adapter push: the adapter's maps on every engine, derived from the
        engine's maps of the base weights (the sync's plan), the dtypes it moves at (the base
        weights'), and each worker's region of each adapter tensor."""
        from . import _lora
        base = self._plan_json
        targets, types, regions = [], [], []
        for e in range(self._engines):
            t, d, r = _lora.adapter_targets(shapes, base["targets"][e], base["dtypes"][e],
                                            self._workers[e])
            targets.append(t)
            types.append(d)
            regions.append(r)
        src = {n: json.loads(as_map(m).to_json()) for n, m in source.items()}
        waves = None
        if self._engines > 1:
            import torch
            sizes = {n: math.prod(shapes[n]) *
                     torch.empty(0, dtype=getattr(torch, types[0][n])).element_size()
                     for n in src}
            waves = cut_waves([src, *targets], sizes, self._options["relay_waves"])
        return {"error": None, "source": src, "targets": targets, "dtypes": types,
                "bucket_bytes": self._options["bucket_bytes"], "quantize": None,
                "workers": self._workers, "waves": waves, "topology": base.get("topology"),
                "ids": list(self._ids), "regions": regions}

    def _adapter_exchanges(self, lora: Mapping[str, Any]) -> list[Stage]:
        """The exchanges of an adapter's plan (a collective with the engines' workers, which
        build them in the same order), kept for the next push of the same plan."""
        stages = self._adapter_stages.get(lora["key"])
        if stages is not None:
            return stages
        comm = self.transport
        made = len(self._comms)
        backend, timeout_s = self._options["backend"], self._options["timeout_s"]

        def group_of(lane: int) -> StoreGroup:
            if lane < made:  # the sync's own lanes, idle between pushes
                return self._comms[lane]
            group = StoreGroup(self._store, f"{lora['prefix']}/lane{lane}", self._rank,
                               len(comm.members), backend, timeout_s)
            self._comms.append(group)
            return group
        plan = lora["plan"]
        stages = plan_stages(plan["source"], plan, self._trainers, group_of, plan.get("error"))
        for stage in stages:
            if isinstance(stage.redistributor, Redistributor):
                stage.redistributor._process_name = self._process_name
        self._adapter_stages[lora["key"]] = stages
        return stages

    def verify(self, shards: Union[None, "TorchSource", Mapping[str, "torch.Tensor"]] = None
               ) -> VerifyStats:
        """Proves what every engine's workers serve now, without a push and without moving
        the tensors (every trainer process calls it, between pushes, with its shards as for
        :meth:`push`; built with ``source=``, the source as it is now): the fingerprints of
        :meth:`push` (``verify=True``), computed by the trainer processes over what they hold
        and by each worker over the parameters it serves. A worker can show a parameter only
        where its served tensor still is in loading form (the shape and dtype the layout
        loads): what vLLM's post-load processing replaced (on CPU, every linear layer's
        weight, packed for oneDNN) is not compared, and is named in
        :attr:`VerifyStats.unverified`. A difference raises WeightSyncError on every trainer
        process, naming the engine, the worker, the tensor and the first differing element
        with the value the worker holds; the engines' weights are left as they are."""
        if self._options["quantize"] is not None:
            raise WeightSyncError("verify() proves unquantized engines; with quantize=, "
                                  "push(..., verify=True) proves what each worker loaded")
        local, error = self._local_shards(shards)
        found: dict[str, Any] = {}

        def send() -> None:
            found["pairs"], found["unverified"] = verify_engines(
                self.transport, self._plan_json, self._trainers, -1, self._rank, local, None,
                self._verifiers, error, self._process_name)
        stats = self._push({"mode": "verify"}, send)
        return VerifyStats(int(found.get("pairs", 0)), list(found.get("unverified", [])),
                           stats.seconds, stats.dropped)

    def _local_shards(self, shards: Union[None, "TorchSource", Mapping[str, "torch.Tensor"]]
                      ) -> tuple[Mapping[str, "torch.Tensor"], Optional[str]]:
        """The shards a push sends, and why not where they cannot be had (agreed in the
        push, so that every process refuses alike)."""
        if self._source is None:
            if shards is None:
                return {}, ("push() needs this process's shards (the sync was built with "
                            "source_maps)")
            given: Any = shards  # checked by the push, alike on every process
            return given, None
        from ..torch import megatron_source_shards, shards_of
        given = self._source if shards is None else shards
        types: dict[str, Any] = {}  # what each tensor moves as, from the trainer processes
        quantized: set[str] = set()  # sent as FP8 blocks: given in the trainer's dtype
        for stage in self._stages:
            sync = stage.redistributor
            if stage.prepare and isinstance(sync, QuantizingRedistributor):
                quantized = {n for q in sync.quantized for n in (q.data, q.scale)}
            elif stage.source < 0:
                for n, d in zip(getattr(sync, "_names", []), getattr(sync, "_dtypes", None) or []):
                    if n not in quantized:
                        types.setdefault(n, torch_dtype_of(d))
        try:
            # a quantized tensor's empty shard (a process holding none): the trainer's dtype
            types = {**self._source_dtypes, **types}
            if self._megatron:
                return megatron_source_shards(given, self._source_maps, self._rank, types), None
            return shards_of(given, self._source_maps, self._rank, types), None
        except Exception as e:
            return {}, f"trainer process {self._rank}: {_message(e)}"

    def _push_plan(self, shards: Union[None, "TorchSource", Mapping[str, "torch.Tensor"]],
                   overlap: Optional[bool], delta: bool = False,
                   verify: bool = False) -> SyncStats:
        """A push, the workers processing layers during the transfer or after it (``overlap``,
        None: the engine's default; the benchmark forces each way)."""
        local, error = self._local_shards(shards)

        def send() -> None:  # the schedule: from the trainer processes, then between the engines
            run_stages(self._stages, -1, self._rank, local, None, None, error, delta, verify)

        def digests() -> Optional[dict[str, str]]:  # compared among the trainer processes
            return whole_digests(local, self._whole) if error is None else None
        return self._push({"mode": "plan", "overlap": overlap, "delta": delta,
                           "verify": verify}, send, digests)

    def _push(self, update: dict[str, Any], send: Callable[[], Any],
              digest: Callable[[], Optional[dict[str, str]]] = lambda: None,
              stages: Optional[Callable[[], list[Stage]]] = None) -> SyncStats:
        # A second push while one is in progress (another thread) is refused at once, before
        # it touches the engine or the group; and the push in progress, if it has not been
        # agreed among the trainer processes yet, is refused on every one of them (which of
        # two racing calls won may differ between processes: each would push other weights).
        with self._guard:
            if self._in_push:
                self._overlapped = True
                busy = getattr(self, "_busy", "a push")
                raise WeightSyncError(f"{busy} of this WeightSync is in progress (in another "
                                      "thread); push again once it has returned")
            self._in_push, self._overlapped = True, False
            self._busy = "a push"
        dropped: list[str] = []
        began = time.perf_counter()
        try:
            while True:
                try:
                    stats = self._push_alone(update, send, digest, stages)
                    break
                except _Regrouped as r:  # an engine lost: the push again, on the others
                    dropped += r.dropped
                    self._warn_dropped(r.dropped)
                    if update.get("mode") == "lora":  # planned for the engines it had
                        raise WeightSyncError(
                            f"an adapter push lost engines, dropped: {'; '.join(r.dropped)}; "
                            "no engine serves the new adapter: push it again") from None
            if dropped:  # the seconds of the push made again, and of the loss before it
                stats = dataclasses.replace(stats, dropped=dropped,
                                            seconds=time.perf_counter() - began)
            if update.get("mode") in ("plan", "lora"):
                self.last_stats = stats
            if update.get("mode") == "lora":
                self._adapters.setdefault(update["lora"]["name"], None)
            return stats
        finally:
            with self._guard:
                self._in_push = False

    def _warn_dropped(self, dropped: Sequence[str]) -> None:
        warnings.warn(f"reshard WeightSync dropped {'; '.join(dropped)}; later pushes go to "
                      f"engines {self._ids}", RuntimeWarning, stacklevel=4)

    def _push_alone(self, update: dict[str, Any], send: Callable[[], Any],
                    digest: Callable[[], Optional[dict[str, str]]],
                    stages: Optional[Callable[[], list[Stage]]] = None) -> SyncStats:
        if self._lost is not None:
            raise WeightSyncError(f"{self._lost}; build a new WeightSync")
        comm = self.transport
        start = time.perf_counter()
        self._steps += 1
        update["step"] = self._steps
        refused: Optional[str] = None
        try:
            digests = digest()
        except Exception as ex:  # a shard that cannot be read: refused alike
            digests, refused = None, f"trainer process {self._rank}: {_message(ex)}"
        started = []
        gone: dict[int, str] = {}  # (on_engine_lost="drop") engines that could not start
        for e, client in self._clients.items():
            if refused is not None:
                break
            try:
                client.call("start_weight_update")
                started.append(client)
            except Exception as ex:
                if self._on_lost == "drop" and update.get("mode") in ("plan", "verify"):
                    gone[e] = f"it did not start an update: {_message(ex)}"
                    continue
                refused = f"{self._which(e)} did not start an update: {_message(ex)}"
                break
        # Agreed among the trainer processes before any sends (the workers wait for none):
        # every engine started, the same push on every process.
        with self._guard:
            overlapped = self._overlapped
        what = {"verify": "verify", "lora": "push_lora"}.get(update.get("mode", ""), "push")
        told = self._trainer_gather((what, (PushClaim(refused, self._steps, digests,
                                                      overlapped), gone)))
        problem = _calls_differ(what, told)
        if problem is not None:
            self._steps -= 1  # not made anywhere: the processes stay at the same push
        else:
            told = [value for _, value in told]
            problem = push_refusal([claim for claim, _ in told])
        lost = {} if problem is not None else {e: why for _, g in told for e, why in g.items()}
        if problem is not None or lost:
            for client in started:  # the engines that did start close their update
                client.call("finish_weight_update")
            if problem is not None:
                raise WeightSyncError(problem)
            raise self._regroup(lost)
        calls = {k: client.later("update_weights", {"update_info": update})
                 for k, client in self._clients.items()}
        try:
            send()
        except RedistributeError as e:
            # The workers refused alike and put their old weights back; their update calls
            # return, and the sessions are closed as after a push.
            self._close_updates(calls)
            raise WeightSyncError(str(e)) from None
        except Exception as e:  # the transport: a process lost mid-transfer
            raise self._lost_peer(calls, e) from None
        except BaseException:
            self._finish_all(calls)
            raise
        try:
            returned = comm.gather_object(None)
        except Exception as e:
            raise self._lost_peer(calls, e) from None
        if update.get("mode") == "verify":
            self._close_updates(calls)
            return SyncStats(0, 0, 0, time.perf_counter() - start)
        # Every worker of every engine has committed, or (a worker's problem) every one kept
        # its old weights.
        replies = [r for r in returned if isinstance(r, dict)]
        failed = [self._worker_problem(p, r["error"]) for p, r in enumerate(returned)
                  if isinstance(r, dict) and r["error"]]
        worker = {k: max(r["seconds"].get(k, 0.0) for r in replies)
                  for k in ("prepare", "transfer", "process", "commit")} if replies else {}
        problems = self._close_updates(calls)
        if failed:
            raise WeightSyncError("; ".join(failed))
        # Only the driving processes know how the engines' own calls went: agreed, so that
        # every trainer process raises alike.
        outcome = None
        if problems:
            outcome = "; ".join(f"{self._which(k)}'s update failed: {p}"
                                for k, p in problems.items())
        elif update.get("mode") not in ("raw", "verify"):
            # The new weights are served (each worker cleared its KV cache as it committed):
            # nothing computed with the old ones may answer a request.
            for k, client in self._clients.items():
                try:
                    client.reset_caches()
                except Exception as ex:
                    outcome = (f"{self._which(k)} serves the new weights but could not drop "
                               f"what it computed with the old ones: {_message(ex)}")
        outcomes = [o for o in self._trainer_gather(outcome) if o is not None]
        if outcomes:
            raise WeightSyncError(outcomes[0])
        seconds = time.perf_counter() - start
        used = self._stages if stages is None else stages()
        sent, here, relayed, links = self._moved(used)
        if update.get("delta"):  # what this process sent: the encoded chunks and headers
            here = sum(int((st.redistributor.last_stats or {}).get("sent", 0))
                       for st in self._stages if not st.prepare)
        sync = self.redistributor
        gathered = sync.gathered() if isinstance(sync, QuantizingRedistributor) else 0
        busiest = max(links, key=lambda k: links[k]) if links else None
        return SyncStats(sent, self.plan_minimum(used), here, seconds, worker, gathered,
                         relayed, links, busiest)

    def _close_updates(self, calls: Mapping[int, "_Background"]) -> dict[int, BaseException]:
        """Wait for each engine's update call; finish the update of each whose call returned.
        The calls' failures, by engine."""
        problems = {}
        for e, call in calls.items():
            problem = self._finish(call)
            if problem is None:
                self._clients[e].call("finish_weight_update")
            else:
                problems[e] = problem
        return problems

    def _lost_peer(self, calls: Mapping[int, "_Background"], e: Exception) -> Exception:
        """A process of the group (a trainer process, a worker) was lost mid-push. The workers
        of all engines commit together, so each engine serves either the weights it had or,
        when every byte had reached every worker, the new ones; never a mix. The group is
        unusable. With ``on_engine_lost="drop"`` and every trainer process alive, the engines
        that were lost are dropped and the push is made again on the others
        (:meth:`_recover`)."""
        if self._on_lost == "drop":
            return self._recover(calls, e)
        self._lost = (f"a push failed in the transfer, a process of the group lost "
                      f"({type(e).__name__}: {e}); the engine serves the weights it had, or "
                      "the new ones if every byte had reached it, never a mix")
        deadline = time.monotonic() + 3 * self._timeout  # a hung engine's call never returns
        for engine, call in calls.items():
            if call.wait(max(0.0, deadline - time.monotonic())) and call.result() is None:
                try:  # the workers returned: close the update in vLLM
                    self._clients[engine].call("finish_weight_update")
                except WeightSyncError:
                    pass  # the next WeightSync finishes it
        return WeightSyncError(f"{self._lost}; build a new WeightSync to push again")

    def _recover(self, calls: Mapping[int, "_Background"], e: Exception) -> Exception:
        """(on_engine_lost="drop") A push lost a process. Every step here waits at most a
        bounded time, so that no trainer process is left waiting on one that is gone:

        1. Each driving process waits for its engines' update calls (the survivors' workers
           agree that the push is lost within ``timeout_s`` of the loss, put their old weights
           back and return; a dead engine's call fails, or is given up after three times
           ``timeout_s``): an engine whose call failed or did not return is lost.
        2. The trainer processes check, through the sync's store (at most four times
           ``timeout_s``, the first verdict written read by all), that every one of them is
           alive: a lost trainer process (or the store's) fails the push as with "fail", and
           the sync cannot push again.
        3. They agree (over their own group, now known whole) on the lost engines, drop them,
           and join the others in a new group of the sync; an engine that does not join is
           dropped too. With no engine lost, the push fails (the new group is usable).
        The caller then makes the push again, whole, on the engines left."""
        why = f"{type(e).__name__}: {e}"
        self._shut_groups()  # the workers still waiting on this process hear of it at once
        deadline = time.monotonic() + 3 * self._timeout
        dead: dict[int, str] = {}
        for k, call in calls.items():
            if not call.wait(max(0.0, deadline - time.monotonic())):
                dead[k] = f"its update did not return within {3 * self._timeout:g} s"
                continue
            problem = call.result()
            if problem is not None:
                dead[k] = f"lost mid-push ({type(problem).__name__}: {problem})"
                continue
            try:  # the workers returned: close the update in vLLM
                self._clients[k].call("finish_weight_update")
            except Exception as ex:
                dead[k] = f"lost mid-push ({_message(ex)})"
        alive = self._trainers_alive()
        if alive is not None:
            self._lost = (f"a push failed in the transfer, a process of the group lost "
                          f"({why}), and {alive}; the engines serve the weights they had, or "
                          "the new ones if every byte had reached them, never a mix")
            return WeightSyncError(f"{self._lost}; build a new WeightSync to push again")
        return self._regroup({e_: w for d in self._trainer_gather(dead) for e_, w in d.items()},
                             why)

    def _regroup(self, lost: Mapping[int, str], why: Optional[str] = None) -> Exception:
        """(a collective over the trainer processes) The engines at positions ``lost``
        dropped, the others joined again: :class:`_Regrouped` for the caller to push again,
        or the WeightSyncError to raise when nothing was dropped."""
        for stage in self._stages:  # the push made again is whole
            if hasattr(stage.redistributor, "_delta_base"):
                stage.redistributor._delta_base = None
        self._shut_groups()
        self._topology = None  # a topology given for other engines: from host names now
        dropped = [f"{self._which(e)} ({w})" for e, w in sorted(lost.items())]
        gone = {self._ids[e] for e in lost}
        self._ids = [i for i in self._ids if i not in gone]
        if not self._ids:
            self._lost = "every engine was lost: " + "; ".join(dropped)
            return WeightSyncError(f"{self._lost}; build a new WeightSync to push again")
        try:
            dropped += self._join(drop=True)
        except WeightSyncError as ex:
            self._lost = f"the engines left could not join again: {ex}"
            return WeightSyncError(f"{self._lost}; build a new WeightSync to push again")
        if not dropped:
            return WeightSyncError(f"a push failed in the transfer ({why}), and no engine was "
                                   "lost; the engines keep the weights they had, and the "
                                   "sync's group was joined again: push again")
        return _Regrouped(dropped)

    def _trainers_alive(self) -> Optional[str]:
        """Every trainer process says it is alive through the store, and waits (at most four
        times ``timeout_s``: the others may still be waiting for their engines' calls) to hear
        the others; the verdict is the first one written, so that every trainer process reads
        the same: None (all alive), or what is missing."""
        import datetime
        key = f"{self._prefix}/alive/{self._generation}/{self._steps}"
        assert self._store is not None
        try:
            self._store.set(f"{key}/{self._rank}", "1")
            try:
                self._store.wait([f"{key}/{r}" for r in range(self._trainers)],
                                 datetime.timedelta(seconds=4 * self._timeout))
                verdict = "alive"
            except Exception as e:  # a trainer process is missing
                verdict = f"not every trainer process is alive ({_message(e)})"
            verdict = self._store.compare_set(f"{key}/verdict", "", verdict).decode()
        except Exception as e:  # the store's process is gone
            verdict = f"the sync's store is lost ({_message(e)})"
        return None if verdict == "alive" else verdict

    # -- membership -------------------------------------------------------------------

    def add_engine(self, engine: Any = None, *, target_maps: Optional[Mapping[str, MapLike]]
                   = None, topology: Any = None) -> int:
        """Adds an engine (a collective over the trainer processes, between pushes): its
        ``LLM`` in the process that owns it (None in the others), or a server's URL (in one
        process, or in all). The sync's group is joined again with it and the schedule
        planned anew (``topology``: where the processes of the new membership run, None: from
        their host names; ``target_maps``: the new engine's, None: learned from vLLM). The
        next push sends the new engine the whole model; an exchange of the new schedule that
        is the same as before for a process (same peers, same chunks) keeps its delta state,
        so with ``delta=True`` the others take a delta there. Returns the engine's number. An
        engine that cannot join (it refuses, does not answer, or its model does not take the
        trainer's tensors) raises WeightSyncError on every trainer process; the others stay
        joined. An engine the sync has already, or something that is not an engine, is
        refused before any engine is touched."""
        with self._between_pushes("add_engine"):
            return self._add_engine(engine, target_maps, topology)

    def _add_engine(self, engine: Any, target_maps: Optional[Mapping[str, MapLike]],
                    topology: Any) -> int:
        problem = None
        if engine is not None and not isinstance(engine, str) and \
                not callable(getattr(engine, "init_weight_transfer_engine", None)):
            problem = (f"add_engine() takes the engine's vllm.LLM, a server's URL or None, got "
                       f"{type(engine).__name__} (trainer process {self._rank})")
        elif engine is not None:
            present = next((i for i in self._ids if self._is_handle(i, engine)), None)
            if present is not None:
                problem = (f"add_engine() was given engine {present}, which the sync has "
                           f"already (trainer process {self._rank})")
        url = engine.rstrip("/") if isinstance(engine, str) else None
        told = self._agree("add_engine", (engine is not None, url, problem))
        problems = [p for _, _, p in told if p is not None]
        if problems:
            raise WeightSyncError("; ".join(problems))
        flags = [f for f, _, _ in told]
        if not any(flags):
            raise WeightSyncError("add_engine() was given no engine on any trainer process: "
                                  "pass the LLM (or the server's URL) in the process that has "
                                  "it, None in the others")
        given = {u for f, u, _ in told if f}
        if sum(flags) > 1 and (None in given or len(given) > 1):
            raise WeightSyncError(
                f"add_engine() was given an engine on trainer processes "
                f"{[r for r, f in enumerate(flags) if f]}, not the same server's URL on each: "
                "give the LLM in the process that owns it (None in the others), or one URL")
        number = self._next_id
        driver = flags.index(True)
        self._check_usable()
        self._next_id += 1
        self._ids.append(number)
        self._handles[number] = engine
        self._driver_by_id[number] = driver
        self._added_targets[number] = target_maps
        before, self._topology = self._topology, topology
        self._shut_groups()
        try:
            dropped = self._join(drop=True)
        except WeightSyncError as e:  # agreed: the plan refused the new membership
            if number not in self._ids:
                raise
            self._ids.remove(number)
            self._topology = before
            self._join_again("the engines could not join again without the one added")
            raise WeightSyncError(f"the engine added could not join: {e}; the sync goes on "
                                  f"with engines {self._ids}") from None
        mine = [d for d in dropped if d.startswith(f"engine {number} ")
                or d.startswith(f"engine {number}:")]
        others = [d for d in dropped if d not in mine]
        if others:
            self._warn_dropped(others)
        if mine:
            raise WeightSyncError(f"the engine added could not join: {mine[0]}; the sync "
                                  f"goes on with engines {self._ids}")
        if getattr(self, "_adapters", None):
            warnings.warn(f"reshard WeightSync: engine {number} serves none of the adapters "
                          f"pushed before it joined ({', '.join(map(repr, self._adapters))}); "
                          "a request naming one there makes vLLM read its placeholder path, "
                          "which fails and ends the engine: push_lora() them again first",
                          RuntimeWarning, stacklevel=3)
        return number

    def remove_engine(self, engine: Any = None, *, topology: Any = None) -> None:
        """Removes an engine (a collective over the trainer processes, between pushes): its
        number (:attr:`engine_ids`, what :meth:`add_engine` returned) in every process, or
        its ``LLM`` / URL in the processes that have it (None in the others). The engine
        leaves the sync's group (it keeps serving the weights it has); the others join a new
        one and the schedule is planned anew for them (``topology`` as for
        :meth:`add_engine`)."""
        with self._between_pushes("remove_engine"):
            self._remove_engine(engine, topology)

    def _remove_engine(self, engine: Any, topology: Any) -> None:
        mine = None
        if isinstance(engine, int) and not isinstance(engine, bool):
            mine = engine
        elif engine is not None:
            mine = next((i for i in self._ids if self._is_handle(i, engine)), -1)
        told = {m for m in self._agree("remove_engine", mine) if m is not None}
        if len(told) != 1 or next(iter(told)) not in self._ids:
            raise WeightSyncError(f"remove_engine() names no single engine of this sync "
                                  f"(engines {self._ids}; given {sorted(told)}, -1: an engine "
                                  "this sync does not have)")
        if len(self._ids) == 1:
            raise WeightSyncError("remove_engine() would leave no engine; close() the sync")
        number = next(iter(told))
        self._check_usable()
        e = self._ids.index(number)
        if e in self._clients:
            try:
                self._clients[e].call("shutdown_weight_transfer_engine")
            except Exception:  # gone already: it leaves the group all the same
                pass
        self._ids.remove(number)
        self._topology = topology
        self._shut_groups()
        try:
            dropped = self._join(drop=True)
        except WeightSyncError as e:  # agreed: the plan refused the membership left
            if topology is None:
                self._lost = f"the engines left could not join again: {e}"
                raise WeightSyncError(f"{self._lost}; build a new WeightSync") from None
            self._topology = None
            self._join_again("the engines left could not join again")
            raise WeightSyncError(f"engine {number} left the sync, but the topology given does "
                                  f"not hold the engines left ({e}); they joined again, placed "
                                  f"by their host names: engines {self._ids}") from None
        if dropped:
            self._warn_dropped(dropped)

    def _join_again(self, lost: str) -> None:
        """After a membership change the plan refused, the engines join again as they were (or
        without the one that left): the sync goes on, or is lost (``lost`` says why) when they
        cannot."""
        self._shut_groups()
        try:
            dropped = self._join(drop=True)
        except WeightSyncError as e:
            self._lost = f"{lost}: {e}"
            raise WeightSyncError(f"{self._lost}; build a new WeightSync") from None
        if dropped:
            self._warn_dropped(dropped)

    def _is_handle(self, number: int, engine: Any) -> bool:
        """Whether ``engine`` (an LLM or a URL) is this process's handle of engine ``number``."""
        mine = self._handles.get(number)
        if isinstance(engine, str):
            return isinstance(mine, str) and mine.rstrip("/") == engine.rstrip("/")
        return mine is engine

    def _agree(self, what: str, value: Any) -> list[Any]:
        """(a collective over the trainer processes) Each process's ``value`` of the call
        ``what``; WeightSyncError on every process when some made another call of the sync
        meanwhile (each raises, nothing changed, and their next calls pair up again)."""
        told = self._trainer_gather((what, value))
        problem = _calls_differ(what, told)
        if problem is not None:
            raise WeightSyncError(problem)
        return [v for _, v in told]

    @contextlib.contextmanager
    def _between_pushes(self, what: str) -> Iterator[None]:
        """A membership change: refused at once while a push of the sync runs on another
        thread (which, not agreed yet, is refused on every trainer process), and refusing
        a push asked for while it runs."""
        with self._guard:
            if self._in_push:
                self._overlapped = True
                raise WeightSyncError(f"{what}() while {self._busy} of this WeightSync is in "
                                      "progress (in another thread); call it between pushes")
            self._in_push, self._busy = True, f"{what}()"
        try:
            yield
        finally:
            with self._guard:
                self._in_push = False

    def _check_usable(self) -> None:
        if self._lost is not None:
            raise WeightSyncError(f"{self._lost}; build a new WeightSync")

    # -- the paths a push is measured against (bench/vllm_sync_bench.py) ------------------

    def _push_raw(self) -> SyncStats:
        """The plan's bytes sent as they are, unpacked and dropped on arrival: the transport's
        own time for what a push moves."""
        comm = self.transport
        self._one_engine("the raw path")
        ex = self.redistributor._exchange
        assert ex is not None
        transfers = ex.sends(self._rank)
        return self._push({"mode": "raw"},
                          lambda: raw_exchange(comm, transfers, sending=True))

    def _push_full(self, maps: Mapping[str, MapLike], shards: Mapping[str, "torch.Tensor"]
                   ) -> SyncStats:
        """The full-tensor path: the trainer processes gather every tensor whole on process
        0, which sends each to every worker, where vLLM's own loaders slice it (layer-wise
        reload). Unbuffered source maps only."""
        import torch
        import torch.distributed as dist
        from .._tensors import rebuild
        comm = self.transport
        self._one_engine("the full-tensor path")
        names = sorted(maps)
        tensors = []
        for n in names:
            m = as_map(maps[n])
            tensors.append([n, str(shards[n].dtype).replace("torch.", ""),
                            list(m.logical_shape)])

        def send() -> None:
            workers = engine_ranks(self._trainers, self._workers, 0)
            for _, n in zip(tensors, names):
                mine = shards[n].contiguous()
                parts = [mine]
                if self._trainers > 1:
                    parts = [torch.empty_like(mine) for _ in range(self._trainers)]
                    dist.all_gather(parts, mine, group=self._group)
                if self._rank == 0:
                    full = rebuild(as_map(maps[n]), parts)
                    for w in comm.exchange([(full, p) for p in workers], []):
                        w.wait()
        return self._push({"mode": "full", "tensors": tensors}, send)

    def _one_engine(self, what: str) -> None:
        if self._engines > 1:
            raise WeightSyncError(f"{what} measures a push into one engine")

    def close(self) -> None:
        """Leave the group (the engines keep their weights and keep serving). The sync takes
        no push, verify or membership change after it."""
        if self._lost is None:
            self._lost = "this WeightSync was closed"
        for client in self._clients.values():
            try:
                client.call("shutdown_weight_transfer_engine")
            except Exception:  # the engine may be gone already
                pass
        for group in getattr(self, "_comms", [self._comm]):
            if group is not None:
                group.shutdown()
        self._comm = None


__all__ = ["SyncStats", "VerifyStats", "WeightSync", "WeightSyncError", "engine_maps"]
