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
(:func:`plan_stages`, :func:`run_stages`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import socket
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass
from typing import (TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, Optional, Sequence,
                    Union)

from .._errors import LayoutError
from .._maps import MapLike, ParamMap, as_map
from ..distributed import (DEFAULT_BUCKET_BYTES, QuantizingRedistributor, RedistributeError,
                           Redistributor, _megatron_dtypes, _message, _torch_dtype)
from ._group import StoreGroup, join_store, serve_store

if TYPE_CHECKING:
    import torch

    from ..torch import TorchSource


def torch_dtype_of(name: str) -> "torch.dtype":
    """A library dtype name ("BF16") as torch's."""
    return _torch_dtype(name)


class WeightSyncError(RedistributeError):
    """A weight sync that cannot run; raised on every trainer process alike, the engine left
    serving the weights it had."""


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
    0"``), and ``busiest_link`` the pair that moved the most."""

    bytes_sent: int
    plan_minimum: int
    bytes_sent_here: int
    seconds: float
    worker_seconds: Optional[dict[str, float]] = None
    bytes_gathered: int = 0
    bytes_relayed: int = 0
    links: Optional[dict[str, int]] = None
    busiest_link: Optional[str] = None


class _Client:
    """The engine's four weight-transfer calls: on an ``LLM`` object, or as the HTTP routes of
    a ``vllm serve`` server (started with ``VLLM_SERVER_DEV_MODE=1``)."""

    def __init__(self, engine: Any, timeout_s: float) -> None:
        self._engine = engine
        self._timeout = timeout_s

    def _post(self, route: str, body: dict[str, Any]) -> None:
        url = str(self._engine).rstrip("/") + "/" + route
        request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as reply:
                reply.read()
        except urllib.error.HTTPError as e:
            raise WeightSyncError(f"{url}: HTTP {e.code}: {e.read().decode(errors='replace')}") from e
        except OSError as e:
            raise WeightSyncError(f"{url}: {e}; is it a vllm serve server started with "
                                  "VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config "
                                  "'{\"backend\": \"reshard\"}'?") from e

    def call(self, method: str, body: Optional[dict[str, Any]] = None) -> None:
        if isinstance(self._engine, str):
            self._post(method, body or {})
        elif body is None:
            getattr(self._engine, method)()
        else:
            getattr(self._engine, method)(body)

    def later(self, method: str, body: Optional[dict[str, Any]] = None) -> "_Background":
        """:meth:`call` on a thread of its own (the engine's RPC returns once the trainer
        processes have done their part)."""
        return _Background(lambda: self.call(method, body))

    def reset_caches(self) -> None:
        """Drops what the engine computed with the weights it had: its prefix cache (requests
        in flight are preempted and computed again) and its encoder cache."""
        if isinstance(self._engine, str):
            self._post("reset_prefix_cache?reset_running_requests=true", {})
            self._post("reset_encoder_cache", {})
            return
        self._engine.reset_prefix_cache(reset_running_requests=True)
        reset_encoder = getattr(getattr(self._engine, "llm_engine", None),
                                "reset_encoder_cache", None)
        if reset_encoder is not None:
            reset_encoder()

    def tensor_parallel_size(self) -> Optional[int]:
        if isinstance(self._engine, str):
            return None
        return int(self._engine.llm_engine.vllm_config.parallel_config.tensor_parallel_size)


def engine_maps(model_dir: str, tensor_parallel_size: int, dtype: str = "auto"
                ) -> dict[str, Any]:
    """The maps of every checkpoint tensor of the model in ``model_dir`` onto vLLM's workers
    at ``tensor_parallel_size`` ranks holding ``dtype`` (the engine's: ``LLM(dtype=...)``),
    learned from vLLM (:func:`reshard.vllm.layout`)."""
    from .._maps import read_maps
    from .layout import layout
    return dict(read_maps(layout(model_dir, tensor_parallel_size, dtype=dtype)))


def raw_exchange(comm: StoreGroup, transfers: list[tuple[int, int, int]], *,
                 sending: bool) -> None:
    """The plan's chunks ``[(round, peer, bytes)]`` as scratch bytes, round by round: sent, or
    received and dropped (the transport alone, for measuring a push against)."""
    import torch
    by_round: dict[int, list[tuple[int, int]]] = {}
    for k, peer, n in transfers:
        by_round.setdefault(k, []).append((peer, n))
    top = max((sum(n for _, n in r) for r in by_round.values()), default=0)
    scratch = torch.zeros(top, dtype=torch.uint8, device=comm.device())
    for k in sorted(by_round):
        at, parts = 0, []
        for peer, n in by_round[k]:
            parts.append((scratch[at:at + n], peer))
            at += n
        for w in comm.exchange(parts, []) if sending else comm.exchange([], parts):
            w.wait()


AnyRedistributor = Union[Redistributor, QuantizingRedistributor]


@dataclass
class Stage:
    """One exchange of a push: the trainer processes (``source`` -1) or the workers of engine
    ``source`` send the workers of engine ``engine`` the pieces of the schedule's steps of wave
    ``wave`` at depth ``level`` (:func:`_step_levels`), over the group of its ``lane`` (one per
    depth and receiving engine, :func:`plan_stages`: the exchanges of different lanes run at
    once). ``source == engine``: the engine's workers hand replicated pieces from their primary
    holders to the others."""

    source: int
    engine: int
    redistributor: AnyRedistributor
    wave: int = 0
    level: int = 0
    prepare: bool = False  # the trainer processes quantize FP8 blocks before any exchange
    lane: int = 0


# The waves a relayed push is cut into: an engine relays wave w while it receives wave w + 1,
# so a tree of depth D takes about (W + D - 1) / W of one exchange's time.
RELAY_WAVES = 4


def engine_ranks(trainers: int, workers: Sequence[int], engine: int) -> range:
    """The sync group's ranks of ``engine``'s workers: the trainer processes come first
    (0 .. T-1), then each engine's workers in the engines' order."""
    start = trainers + sum(workers[:engine])
    return range(start, start + workers[engine])


def default_topology(trainer_hosts: Sequence[str], worker_hosts: Sequence[Sequence[str]]
                     ) -> dict[str, Any]:
    """The topology of the sync's processes from their host names (the trainer processes',
    each engine's workers'), for the schedule's cost model: one GPU per process, the hosts in
    the order they first appear, the default bandwidths."""
    used: dict[str, int] = {}

    def slot(host: str) -> str:
        used[host] = used.get(host, 0) + 1
        return f"{host}:{used[host] - 1}"
    placement = {"trainer": [slot(h) for h in trainer_hosts],
                 "engines": [[slot(h) for h in hosts] for hosts in worker_hosts]}
    return {"hosts": [{"name": h, "gpus": n} for h, n in used.items()],
            "placement": placement}


def schedule_topology(topology: Any, trainer_hosts: Sequence[str],
                      worker_hosts: Sequence[Sequence[str]]) -> str:
    """The topology JSON the schedule places the sync's processes by: ``topology`` (a
    sync-plan topology: its path, text or dict) or, when None, :func:`default_topology` of the
    processes' host names. MapError naming the JSON path for one that cannot hold them."""
    from .. import _core
    from .._degree import _json_text
    text = _json_text(topology) if topology is not None else \
        json.dumps(default_topology(trainer_hosts, worker_hosts))
    _core.place_processes(text, len(trainer_hosts), [len(w) for w in worker_hosts])
    return text


@dataclass
class _Entry:
    """One tensor of the schedule: ``name`` into the engines that take it as ``dtype``."""

    name: str
    dtype: str
    engines: list[int]


def sync_schedule(source: Mapping[str, ParamMap], targets: Sequence[Mapping[str, ParamMap]],
                  dtypes: Sequence[Mapping[str, str]], trainers: int, workers: Sequence[int],
                  topology: str) -> tuple[Any, list[_Entry]]:
    """The schedule of a push (``reshard.plan_sync``'s planner, DESIGN 21): each tensor of
    ``source`` (in its order) into the engines whose ``targets`` have it, the engines that take
    it at one dtype sharing one copy from the trainer processes (a root per tensor, replicated
    pieces to one holder, relays between engines chosen by the cost model of ``topology``, the
    JSON of a sync-plan topology). Every process builds the same from the same plan."""
    import torch

    from .. import _core
    schedule = _core.SyncSchedule(topology, trainers, list(workers))
    entries = []
    for name, m in source.items():
        classes: dict[str, list[int]] = {}
        for e, target in enumerate(targets):
            if name in target:
                classes.setdefault(dtypes[e][name], []).append(e)
        for dtype, engines in classes.items():
            size = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
            schedule.add(name, size, m._handle,
                         [targets[e][name]._handle if e in engines else None
                          for e in range(len(targets))])
            entries.append(_Entry(name, dtype, engines))
    schedule.finish()
    return schedule, entries


def _step_levels(steps: Sequence[tuple[str, int, int, list[int]]]) -> list[int]:
    """Each step's depth: 0 from the trainer processes; handing replicated pieces on within
    the root, the depth of what it comes after (run after it on the same thread: a peer lost
    there skips it at once); a relay, one more than the deepest step into its sender."""
    levels: list[int] = []
    for kind, _, _, after in steps:
        deepest = max((levels[a] for a in after), default=0)
        levels.append(0 if kind == "from_trainer" else
                      deepest if kind == "within_root" else deepest + 1)
    return levels


def cut_waves(map_sets: Sequence[Mapping[str, Any]], sizes: Mapping[str, int],
                count: int) -> list[list[str]]:
    """The tensors cut into at most ``count`` waves of about equal bytes (``sizes``), in the
    order of the first map set, such that tensors sharing a rank tensor (a buffer of any of
    ``map_sets``: a fused QKV, an MoE layer's experts) travel in the same wave."""
    names = list(map_sets[0])
    index = {n: i for i, n in enumerate(names)}
    root = list(range(len(names)))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i
    for maps in map_sets:
        owner: dict[str, int] = {}
        for name, m in maps.items():
            ranks = m.get("ranks", {}) if isinstance(m, Mapping) else {}
            for r in ranks.values():
                buffer = r.get("buffer")
                if buffer and name in index:
                    first = owner.setdefault(buffer, index[name])
                    root[find(index[name])] = find(first)
    groups: dict[int, list[str]] = {}
    for n in names:
        groups.setdefault(find(index[n]), []).append(n)
    total = sum(sizes.get(n, 0) for n in names)
    waves: list[list[str]] = [[]]
    done = 0
    for group in groups.values():  # in the order of each group's first tensor
        if waves[-1] and done >= total * len(waves) / count and len(waves) < count:
            waves.append([])
        waves[-1].extend(group)
        done += sum(sizes.get(n, 0) for n in group)
    return waves


def _plans_of(schedule: Any, chosen: Mapping[str, tuple[int, int]], names: list[str]) -> Any:
    """The schedule's plans of ``names`` (their (entry, step) in ``chosen``), in order."""
    return schedule.plans([chosen[n] for n in names])


def plan_stages(source: Mapping[str, Any], plan: Mapping[str, Any], trainers: int,
                group_of: Callable[[int], Any], error: Optional[str]) -> list[Stage]:
    """The exchanges of an agreed plan (a collective: every process of the group builds them, in
    order): the schedule's steps (:func:`sync_schedule`), grouped per wave, depth, sending and
    receiving engine. The exchanges into one engine at one depth form a lane (those handing
    pieces on within the engine one of their own), which runs its exchanges in order (by wave,
    then sender) over a group of its own (``group_of(lane)``, called in increasing order of
    lanes), while the other lanes run theirs: the trainer processes feed every root engine at
    once, and the engines relay to each other at once, each link carrying its own bytes as the
    schedule's simulation has it; what shares a receiving engine's links takes turns. FP8
    blocks are quantized at the trainer where the plan says
    ``quantize`` (one engine: the trainer sends every holder its piece)."""
    workers = plan["workers"]
    options: dict[str, Any] = dict(bucket_bytes=plan["bucket_bytes"], _error=error)
    quantize = plan.get("quantize")
    if error is None and quantize is not None and len(plan["targets"]) > 1 and source:
        # FP8 engines: the trainer processes quantize each block once (at its owner), and the
        # schedule moves the FP8 data and scales from there.
        q = QuantizingRedistributor(source, plan["targets"][0], quantize=quantize,
                                    source_ranks=range(trainers), target_ranks=[],
                                    group=group_of(0), _prepare_only=True, **options)
        scale_of = {spec.data: spec.scale for spec in q.quantized}
        waves = [[m for n in names for m in (n, scale_of.get(n)) if m is not None]
                 for names in plan.get("waves") or [list(source)]]
        return [Stage(-1, -1, q, prepare=True)] + plan_stages(
            q.prepared_maps, {**plan, "quantize": None, "waves": waves}, trainers, group_of,
            None)
    if error is not None or quantize is not None or not source:
        comm = group_of(0)
        stages = []
        for e, target in enumerate(plan["targets"]):
            sync: AnyRedistributor
            if plan.get("quantize") is not None:
                sync = QuantizingRedistributor(source, target, quantize=plan["quantize"],
                                               source_ranks=range(trainers),
                                               target_ranks=engine_ranks(trainers, workers, e),
                                               group=comm, dtypes=torch_dtypes(plan["dtypes"][e]),
                                               **options)
            else:
                sync = Redistributor(source, target, source_ranks=range(trainers),
                                     target_ranks=engine_ranks(trainers, workers, e), group=comm,
                                     dtypes=torch_dtypes(plan["dtypes"][e]), **options)
            stages.append(Stage(-1, e, sync))
        return stages
    try:  # the same on every process: a refusal (maps of different tensors) agreed as such
        src = {n: as_map(m) for n, m in source.items()}
        targets = [{n: as_map(m) for n, m in t.items()} for t in plan["targets"]]
        schedule, entries = sync_schedule(src, targets, plan["dtypes"], trainers, workers,
                                          plan["topology"])
    except Exception as e:
        return plan_stages(source, plan, trainers, group_of, _message(e))
    wave_of = {n: w for w, names in enumerate(plan.get("waves") or [list(source)])
               for n in names}
    # (wave, level, from, to) -> [(entry, step)]
    groups: dict[tuple[int, int, int, int], list[tuple[int, int]]] = {}
    for i, entry in enumerate(entries):
        steps = schedule.steps(i)
        for k, ((_, sender, receiver, _), level) in enumerate(zip(steps, _step_levels(steps))):
            groups.setdefault((wave_of[entry.name], level, sender, receiver), []).append((i, k))
    def lane_of(key: tuple[int, int, int, int]) -> tuple[int, int, bool]:
        _, level, sender, receiver = key
        return level, receiver, sender == receiver
    lanes = {lane: i for i, lane in enumerate(sorted({lane_of(k) for k in groups}))}
    comms: dict[int, Any] = {}
    stages = []
    for key in sorted(groups, key=lambda k: (lane_of(k), k[0], k[2])):
        wave, level, sender, receiver = key
        lane = lanes[lane_of(key)]
        if lane not in comms:
            comms[lane] = group_of(lane)
        chosen = {entries[i].name: (i, k) for i, k in groups[key]}
        maps = src if sender < 0 else targets[sender]
        sent = {n: maps[n] for n in chosen}
        wanted = {n: targets[receiver][n] for n in chosen}
        sync = Redistributor(
            sent, wanted,
            source_ranks=range(trainers) if sender < 0 else
            engine_ranks(trainers, workers, sender),
            target_ranks=engine_ranks(trainers, workers, receiver), group=comms[lane],
            dtypes=torch_dtypes({n: plan["dtypes"][receiver][n] for n in chosen}),
            _plans=functools.partial(_plans_of, schedule, chosen), **options)
        stages.append(Stage(sender, receiver, sync, wave, level, lane=lane))
    return stages


def lane_groups(store: Any, prefix: str, rank: int, comm: StoreGroup, backend: str,
                timeout_s: float, made: list[StoreGroup]) -> Callable[[int], StoreGroup]:
    """The group of each lane of the schedule for :func:`plan_stages`: ``comm`` for the first,
    a group of its own over the same processes for each other one (made when first asked
    for: a collective), appended to ``made``."""
    def group_of(lane: int) -> StoreGroup:
        if lane == 0:
            return comm
        group = StoreGroup(store, f"{prefix}/lane{lane}", rank, len(comm.members), backend,
                           timeout_s)
        made.append(group)
        return group
    return group_of


def stage_bytes(stages: Sequence[Stage], trainers: int, workers: Sequence[int], me: int
                ) -> tuple[int, int, int, dict[tuple[int, int], int]]:
    """What the exchanges of a push move: bytes out of the trainer processes, out of process
    ``me``, out of engines' workers (relays, and replicated pieces handed on within an
    engine), and per (sending, receiving) process of the group."""
    sent = here = relayed = 0
    links: dict[tuple[int, int], int] = {}
    for stage in stages:
        if stage.prepare:
            continue
        ex = stage.redistributor._exchange
        assert ex is not None
        senders = range(trainers) if stage.source < 0 else \
            engine_ranks(trainers, workers, stage.source)
        for p in senders:
            n = int(ex.stats(p)["sent"])
            if stage.source < 0:
                sent += n
            else:
                relayed += n
            if p == me:
                here += n
            for _, peer, count in ex.sends(p):
                if peer != p:
                    links[(p, peer)] = links.get((p, peer), 0) + int(count)
    return sent, here, relayed, links


def _keys(sync: AnyRedistributor, rank: int, side: str) -> set[str]:
    """The shards (by tensor or buffer name) map rank ``rank`` holds on one side of an
    exchange."""
    if side == "target":
        return {m.buffer(rank) or n for n, m in zip(sync._names, sync._dst)}
    assert isinstance(sync, Redistributor)  # relays and waves: plain exchanges only
    maps = sync._src
    return {m.buffer(rank) or n for n, m in zip(sync._names, maps)}


class _Finished:
    """Hands a worker's shards on (``on_ready``) once every exchange of the push that writes or
    reads each has done so on this worker: the shard has arrived whole and no later exchange
    sends from it, so the engine may process it in place. Thread-safe (each tree level runs
    on a thread of its own)."""

    def __init__(self, stages: Sequence[Stage], engine: int, rank: int,
                 on_ready: Optional[Callable[[dict[str, Any]], None]]) -> None:
        self._on_ready = on_ready
        self._lock = threading.Lock()
        self._left: dict[str, int] = {}
        for st in stages:
            for side, who in (("target", st.engine), ("source", st.source)):
                if who == engine:
                    for k in _keys(st.redistributor, rank, side):
                        self._left[k] = self._left.get(k, 0) + 1

    def done(self, shards: Mapping[str, Any]) -> None:
        if self._on_ready is None:
            return
        with self._lock:
            ready = {}
            for k, t in shards.items():
                self._left[k] -= 1
                if self._left[k] == 0:
                    ready[k] = t
            if ready:
                self._on_ready(ready)


def run_stages(stages: Sequence[Stage], engine: int, rank: int,
               shards: Mapping[str, Any], out: Optional[dict[str, Any]],
               on_ready: Optional[Callable[[dict[str, Any]], None]], error: Optional[str]
               ) -> None:
    """Every exchange of a push, as this process takes part in it (a collective over the
    sync's groups): a trainer process (``engine`` -1) sends its ``shards`` in the exchanges
    from the trainer processes; a worker (map rank ``rank`` of its ``engine``) receives into
    ``out`` in its engine's exchanges and sends from ``out`` in those where its engine relays.
    Each lane (:func:`plan_stages`) runs on a thread of its own over a group of its own, so
    that the trainer processes feed every engine at once and an engine relays what it has
    received of wave w (every exchange into it of that wave at a lesser depth) while wave w + 1
    arrives. An exchange waits only for exchanges of earlier lanes on this process (what its
    engine sends must have arrived; a buffer staged through a copy is written by one exchange
    at a time), so no two processes can wait on each other. A failure in one exchange is told to the later ones as an agreed
    error, so that no process waits for a peer that gave up; the first failure is raised (a
    refusal before a transport error). Once a peer is lost, the exchanges not yet begun are
    skipped: each would only wait out the timeout on the broken group."""
    if stages and stages[0].prepare:  # FP8 blocks quantized where the trainer holds them
        quantizer = stages[0].redistributor
        assert isinstance(quantizer, QuantizingRedistributor)
        shards, failed = quantizer.prepare(shards if engine < 0 else {}, _error=error)
        error = error or failed  # agreed by the exchanges that would send them
        stages = stages[1:]
    received = [threading.Event() for _ in stages]
    failures: list[BaseException] = []
    lock = threading.Lock()
    finished = _Finished(stages, engine, rank, on_ready) if engine >= 0 else None

    def why() -> Optional[str]:
        with lock:
            if error is not None or not failures:
                return error
            first = failures[0]
            return f"an earlier exchange of this push failed ({type(first).__name__}: {first})"

    def held(sync: AnyRedistributor, side: str) -> dict[str, Any]:
        return {k: out[k] for k in _keys(sync, rank, side) if out is not None and k in out}

    def lost() -> bool:  # a peer lost: the group is unusable, later exchanges only wait
        with lock:
            return any(not isinstance(f, RedistributeError) for f in failures)

    def staged(sync: AnyRedistributor) -> set[str]:
        """This worker's target shards of ``sync`` that a run writes through a staging copy
        (not contiguous where the transport reads): two exchanges writing one must not
        overlap, as each copies the whole shard back."""
        if out is None:
            return set()
        plain = sync._gather if isinstance(sync, QuantizingRedistributor) else sync
        device = plain._comm.device()
        return {k for k in _keys(sync, rank, "target")
                if k in out and not (out[k].is_contiguous() and out[k].device == device)}

    def waits(i: int) -> list[int]:
        """The exchanges (of earlier lanes) that exchange ``i`` waits for on this process."""
        st = stages[i]
        if engine < 0:
            return []
        out_of = []
        if st.source == engine:  # what this engine sends has arrived: every exchange into it
            # of the wave at a lesser depth (and for handing on within the engine, those into
            # it at the same depth from elsewhere)
            out_of = [j for j, b in enumerate(stages)
                      if j != i and b.engine == engine and b.wave == st.wave and
                      (b.level < st.level or (b.level == st.level and b.source != engine and
                                              st.engine == engine))]
        into = []
        if st.engine == engine and staged_keys[i]:
            into = [j for j, b in enumerate(stages[:i]) if b.lane != st.lane and
                    b.engine == engine and b.wave == st.wave and staged_keys[j] & staged_keys[i]]
        return sorted(set(out_of + into))

    def lane_body(lane: int) -> None:
        for i, st in enumerate(stages):
            if st.lane != lane or lost():
                continue
            sync = st.redistributor
            try:
                for j in waits(i):
                    received[j].wait()
                if lost():
                    continue
                mine: Mapping[str, Any] = {}
                if st.source == engine:
                    if engine >= 0:  # a relay, or pieces handed on within this engine
                        mine = held(sync, "source")
                    else:  # the stage's shards (the first wave's also any the plan lacks,
                        # which its checks refuse)
                        keys = _keys(sync, rank, "source") | (extra if st.wave == 0 else set())
                        mine = {k: v for k, v in shards.items() if k in keys}
                if st.engine == engine:
                    assert finished is not None
                    sync.run(mine, out=held(sync, "target"), on_ready=finished.done,
                             _error=why())
                else:
                    sync.run(mine, _error=why())
                if st.source == engine and finished is not None:
                    finished.done(mine)
            except BaseException as e:  # later exchanges are told, and the first is raised
                with lock:
                    failures.append(e)
                for event in received:
                    event.set()
            finally:
                received[i].set()

    extra = set(shards) - {k for st in stages if st.source < 0
                           for k in _keys(st.redistributor, rank, "source")} \
        if engine < 0 else set()
    staged_keys = [staged(st.redistributor) if st.engine == engine else set()
                   for st in stages]
    lanes = sorted({st.lane for st in stages})
    threads = [threading.Thread(target=lane_body, args=(lane,), daemon=True)
               for lane in lanes[1:]]
    for t in threads:
        t.start()
    if lanes:
        lane_body(lanes[0])
    for t in threads:
        t.join()
    if failures:
        refusals = [f for f in failures if isinstance(f, RedistributeError)]
        raise (refusals or failures)[0]


def torch_dtypes(names: Optional[Mapping[str, str]]) -> Optional[dict[str, Any]]:
    """{name: "bfloat16"} -> {name: torch.bfloat16}."""
    import torch
    return None if names is None else {n: getattr(torch, d) for n, d in names.items()}


class PushClaim(NamedTuple):
    """What one trainer process says of the push it is about to make, before any byte moves:
    why it cannot (an engine that did not start an update, a shard it cannot read), which
    push of the sync it is, the digests of the tensors every trainer process holds whole
    (:func:`whole_digests`), and whether another push was asked for (from another thread)
    while it began."""

    refused: Optional[str]
    number: int
    digests: Optional[dict[str, str]]
    overlapped: bool


def push_refusal(claims: Sequence[PushClaim]) -> Optional[str]:
    """Why the trainer processes (``claims``, by process) must not make their push, or None
    when each makes the same one: every process refuses alike, before any byte moves. Two
    threads pushing at once may each win on some process, which would push one set of
    weights from some processes and the other from the rest (an engine serving a mix): a
    push overlapped by another one on any process is refused, and so is one whose tensors
    held whole everywhere differ between processes."""
    refusals = [c.refused for c in claims if c.refused is not None]
    if refusals:
        return refusals[0]
    overlapped = [p for p, c in enumerate(claims) if c.overlapped]
    if overlapped:
        return (f"trainer process{'es' if len(overlapped) > 1 else ''} "
                f"{', '.join(map(str, overlapped))} began another push of this WeightSync (from "
                f"another thread) while push {claims[overlapped[0]].number} began; which of the "
                "two each process makes could differ, so every trainer process refuses it and "
                "the engines keep the weights they had: push from one thread at a time")
    numbers = [c.number for c in claims]
    if len(set(numbers)) > 1:
        return (f"the trainer processes are at different pushes of this WeightSync "
                f"({', '.join(f'process {p}: push {n}' for p, n in enumerate(numbers))}); "
                "every trainer process pushes each time")
    first = claims[0].digests
    for p, c in enumerate(claims[1:], 1):
        if first is None or c.digests is None:
            continue
        differ = sorted(n for n in first if n in c.digests and first[n] != c.digests[n])
        if differ:
            return (f"trainer processes 0 and {p} push different weights: tensor "
                    f"\"{differ[0]}\", which every trainer process holds whole, differs between "
                    f"them ({len(differ)} such tensors differ); the engines keep the weights "
                    "they had. Push the same weights from every process (pushes from two "
                    "threads at once can pair one thread's weights on one process with the "
                    "other's elsewhere)")
    return None


def whole_tensors(maps: Mapping[str, MapLike], trainers: int) -> list[str]:
    """The tensors of ``maps`` that every one of ``trainers`` processes (at least two) holds
    whole and laid out alike: their shards must be equal byte for byte."""
    if trainers < 2:
        return []
    out = []
    for name, m in maps.items():
        ranks = as_map(m).to_dict().get("ranks", {})
        first = ranks.get("0")
        if first is None or len(ranks) != trainers or \
                any(r.get("buffer") for r in ranks.values()):
            continue
        pieces = first.get("pieces") or []
        if pieces and all(len(p.get("locations", [])) == trainers for p in pieces) and \
                all(r.get("pieces") == pieces for r in ranks.values()):
            out.append(name)
    return out


# The most elements of one tensor a push's agreement digests: a tensor above it is sampled at
# evenly spaced elements (its last one included), so the check costs the same for a model held
# whole on every process (data parallel) as for the few norms of tensor parallelism. Two pushes
# of different weights differ in a share of the elements (an optimizer step changes a few percent
# of bf16 values), which a sample this large misses with a vanishing chance.
_DIGEST_ELEMENTS = 1 << 20


def whole_digests(shards: Mapping[str, Any], names: Sequence[str]) -> dict[str, str]:
    """A digest of the elements of each of ``names`` among ``shards`` (all of them, or an
    evenly spaced sample of ``_DIGEST_ELEMENTS`` of a larger tensor; those missing or not
    tensors are left to the push's own checks)."""
    import torch
    out = {}
    for name in names:
        t = shards.get(name)
        if isinstance(t, torch.Tensor):
            flat = t.detach().reshape(-1)
            if flat.numel() > _DIGEST_ELEMENTS:
                step = -(-flat.numel() // _DIGEST_ELEMENTS)
                flat = torch.cat([flat[::step], flat[-1:]])
            data = flat.contiguous().view(torch.uint8).cpu().numpy()
            out[name] = hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest()
    return out


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


class _Background:
    """A call on a thread of its own, its exception kept for :meth:`result`."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._error: Optional[BaseException] = None

        def body() -> None:
            try:
                fn()
            except BaseException as e:  # handed to result()
                self._error = e
        self._thread = threading.Thread(target=body, daemon=True)
        self._thread.start()

    def running(self) -> bool:
        return self._thread.is_alive()

    def result(self) -> Optional[BaseException]:
        self._thread.join()
        return self._error


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
                 topology: Any = None) -> None:
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
        self._clients = {e: _Client(mine[e], timeout_s) for e, d in enumerate(self._drivers)
                         if d == self._rank}
        self._client = self._clients.get(0)
        prefix = f"reshard-{uuid.uuid4().hex}"
        store, where = None, None
        if self._rank == self._drivers[0]:  # the store is served by the first engine's driver
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
        self._store = store
        inits = {k: client.later("init_weight_transfer_engine", {"init_info": {
            "host": host, "port": port, "prefix": prefix, "trainers": self._trainers,
            "backend": backend, "timeout_s": timeout_s, "engine": k, "engines": self._engines}})
            for k, client in self._clients.items()} if joined is None else {}
        try:
            self._workers = self._workers_of(store, prefix, inits, timeout_s, joined)
            comm = StoreGroup(store, prefix + "/pg", self._rank,
                              self._trainers + sum(self._workers), backend, timeout_s)
            self._comm = comm
            reports = [r for r in comm.gather_object(None) if r is not None]
            trainer_hosts = self._trainer_gather(socket.gethostname())
            plan = None
            if self._rank == 0:
                try:
                    plan = self._plan(reports, source_maps, target_maps, dtypes, bucket_bytes,
                                      quantize, relay_waves, topology, trainer_hosts)
                except Exception as e:
                    plan = {"error": _message(e), "source": {}, "targets": [{}] * self._engines,
                            "dtypes": [None] * self._engines, "bucket_bytes": bucket_bytes,
                            "quantize": None, "workers": self._workers, "waves": None,
                            "topology": None}
            plan = comm.gather_object(plan)[0]
            self._comms = [comm]
            self._stages = plan_stages(
                source_maps, plan, self._trainers,
                lane_groups(store, prefix, self._rank, comm, backend, timeout_s, self._comms),
                plan["error"])
            self._sync = self._stages[0].redistributor
            self._whole = whole_tensors(source_maps, self._trainers)
        except RedistributeError as e:
            self._finish_all(inits)
            raise WeightSyncError(str(e)) from None
        except BaseException as e:
            problem = self._finish_all(inits)
            if problem is not None:
                raise WeightSyncError(f"the engine could not join: {problem}") from e
            raise
        problem = self._finish_all(inits)
        if problem is not None:
            raise WeightSyncError(f"the engine could not join: {problem}")
        for k, client in self._clients.items():
            if any(r.get("open") for r in reports if r.get("engine", 0) == k):
                # An update whose driving process was lost mid-push (the engine kept its old
                # weights) is still open in vLLM, which refuses to start another until it is
                # finished.
                client.call("finish_weight_update")

    def _which(self, e: int) -> str:
        return "the engine" if self._engines == 1 else f"engine {e}"

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
        problems = [p for p in (self._finish(c) for c in calls.values()) if p is not None]
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
                    timeout_s: float, problem: Optional[str]) -> list[int]:
        """Each engine's worker count, which its worker 0 publishes on joining; an engine's
        driver publishes the engine's refusal instead when its init call fails first. Read
        from the store by the process that serves it alone, and agreed among the trainer
        processes (a collective), with ``problem`` (this process could not reach the store)
        and any store error: a process that read the store earlier never reads it after the
        serving process has gone, and every trainer process raises the same
        WeightSyncError."""
        keys = [f"{prefix}/workers/{e}" for e in range(self._engines)]
        serving = self._rank == self._drivers[0]
        seen: Union[None, str, list[str]] = problem
        if problem is None and (serving or inits):
            try:  # the serving process waits for every engine, a driver for its own
                seen = self._joined(store, keys, inits, timeout_s, serving)
            except WeightSyncError as e:
                seen = str(e)
            except Exception as e:  # the store's process gone, or its timeout
                seen = (f"trainer process {self._rank} lost the sync's store while the "
                        f"engines joined: {_message(e)}")
        told = self._trainer_gather(seen)
        errors = [t for t in told if isinstance(t, str)]
        if errors:
            raise WeightSyncError(errors[0])
        values = told[self._drivers[0]]
        refusals = [f"{self._which(e)} could not join: {v[7:]}" if self._engines > 1 else
                    f"the engine could not join: {v[7:]}"
                    for e, v in enumerate(values) if v.startswith("error: ")]
        if refusals:
            raise WeightSyncError("; ".join(refusals))
        return [int(v) for v in values]

    def _joined(self, store: Any, keys: list[str], inits: Mapping[int, "_Background"],
                timeout_s: float, serving: bool) -> Optional[list[str]]:
        """(the serving process, or an engine's driver) Polls the store until every engine
        (the serving process) or this process's engines have joined or refused: the values
        of the keys (the serving process), else None."""
        wanted = keys if serving else [keys[e] for e in inits]
        deadline = time.monotonic() + timeout_s
        while not store.check(wanted):
            for e, init in inits.items():
                if not init.running() and not store.check([keys[e]]):
                    store.set(keys[e], f"error: {init.result()}")  # the engine refused to join
            if time.monotonic() > deadline:
                late = [e for e, k in enumerate(keys) if k in wanted and not store.check([k])]
                which = self._which(late[0]) if len(late) == 1 else f"engines {late}"
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
                "waves": waves, "topology": text}

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

    def plan_minimum(self) -> int:
        """The bytes the engine's workers lack (what any push must move at least out of the
        trainer processes): with several engines, one copy of every tensor per dtype the
        engines take it at (the schedule's exchanges from the trainer processes)."""
        total = 0
        for stage in self._stages:
            ex = stage.redistributor._exchange
            if stage.source < 0 and ex is not None:
                total += sum(int(ex.stats(p)["lower_bound"])
                             for p in engine_ranks(self._trainers, self._workers, stage.engine))
        return total

    def _process_name(self, p: int) -> str:
        if p < self._trainers:
            return f"trainer {p}"
        for e in range(self._engines):
            ranks = engine_ranks(self._trainers, self._workers, e)
            if p in ranks:
                return f"engine {e} worker {p - ranks.start}"
        return f"process {p}"

    def _moved(self) -> tuple[int, int, int, dict[str, int]]:
        """The last push's bytes: out of the trainer processes, out of this process, relayed
        by engines' workers, and per link (sender -> receiver)."""
        sent, here, relayed, links = stage_bytes(self._stages, self._trainers, self._workers,
                                                 self._rank)
        return sent, here, relayed, {f"{self._process_name(a)} -> {self._process_name(b)}": n
                                     for (a, b), n in links.items()}

    def push(self, shards: Union[None, "TorchSource", Mapping[str, "torch.Tensor"]] = None
             ) -> SyncStats:
        """This process's shards ``{checkpoint name (or buffer): tensor}`` -> the engine's
        weights. Every trainer process calls it; it returns once every worker holds the new
        weights, or raises :class:`WeightSyncError` on every trainer process with the
        engine serving the weights it had. A process lost mid-push (see :meth:`_lost_peer`)
        makes the others raise it within ``timeout_s``; this sync cannot push again.
        Before any byte moves the trainer processes agree that they make the same push
        (:func:`push_refusal`): one push of the sync at a time (another, from another thread,
        raises at once), the same tensors held whole on every process equal.
        Built with ``source=``, ``shards`` defaults to that source as it is now (a module's
        current weights); a module or state dict of DTensors is taken too (each DTensor's
        ``to_local()``)."""
        return self._push_plan(shards, self._overlap)

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
                   overlap: Optional[bool]) -> SyncStats:
        """A push, the workers processing layers during the transfer or after it (``overlap``,
        None: the engine's default; the benchmark forces each way)."""
        local, error = self._local_shards(shards)

        def send() -> None:  # the schedule: from the trainer processes, then between the engines
            run_stages(self._stages, -1, self._rank, local, None, None, error)

        def digests() -> Optional[dict[str, str]]:  # compared among the trainer processes
            return whole_digests(local, self._whole) if error is None else None
        return self._push({"mode": "plan", "overlap": overlap}, send, digests)

    def _push(self, update: dict[str, Any], send: Callable[[], Any],
              digest: Callable[[], Optional[dict[str, str]]] = lambda: None) -> SyncStats:
        # A second push while one is in progress (another thread) is refused at once, before
        # it touches the engine or the group; and the push in progress, if it has not been
        # agreed among the trainer processes yet, is refused on every one of them (which of
        # two racing calls won may differ between processes: each would push other weights).
        with self._guard:
            if self._in_push:
                self._overlapped = True
                raise WeightSyncError("a push of this WeightSync is in progress (in another "
                                      "thread); push again once it has returned")
            self._in_push, self._overlapped = True, False
        try:
            return self._push_alone(update, send, digest)
        finally:
            with self._guard:
                self._in_push = False

    def _push_alone(self, update: dict[str, Any], send: Callable[[], Any],
                    digest: Callable[[], Optional[dict[str, str]]]) -> SyncStats:
        comm = self.transport
        if self._lost is not None:
            raise WeightSyncError(f"{self._lost}; build a new WeightSync")
        start = time.perf_counter()
        self._steps += 1
        update["step"] = self._steps
        refused: Optional[str] = None
        try:
            digests = digest()
        except Exception as ex:  # a shard that cannot be read: refused alike
            digests, refused = None, f"trainer process {self._rank}: {_message(ex)}"
        started = []
        for e, client in self._clients.items():
            if refused is not None:
                break
            try:
                client.call("start_weight_update")
                started.append(client)
            except Exception as ex:
                refused = f"{self._which(e)} did not start an update: {_message(ex)}"
                break
        # Agreed among the trainer processes before any sends (the workers wait for none):
        # every engine started, the same push on every process.
        with self._guard:
            overlapped = self._overlapped
        told = self._trainer_gather(PushClaim(refused, self._steps, digests, overlapped))
        problem = push_refusal(told)
        if problem is not None:
            for client in started:  # the engines that did start close their update
                client.call("finish_weight_update")
            raise WeightSyncError(problem)
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
            replies = [r for r in comm.gather_object(None) if isinstance(r, dict)]
        except Exception as e:
            raise self._lost_peer(calls, e) from None
        # Every worker of every engine has committed, or (a worker's problem) every one kept
        # its old weights.
        failed = [r["error"] for r in replies if r["error"]]
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
        elif update.get("mode") != "raw":
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
        sent, here, relayed, links = self._moved()
        sync = self.redistributor
        gathered = sync.gathered() if isinstance(sync, QuantizingRedistributor) else 0
        busiest = max(links, key=lambda k: links[k]) if links else None
        return SyncStats(sent, self.plan_minimum(), here, seconds, worker, gathered, relayed,
                         links, busiest)

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

    def _lost_peer(self, calls: Mapping[int, "_Background"], e: Exception) -> WeightSyncError:
        """A process of the group (a trainer process, a worker) was lost mid-push. The workers
        of all engines commit together, so each engine serves either the weights it had or,
        when every byte had reached every worker, the new ones; never a mix. The group is
        unusable."""
        self._lost = (f"a push failed in the transfer, a process of the group lost "
                      f"({type(e).__name__}: {e}); the engine serves the weights it had, or "
                      "the new ones if every byte had reached it, never a mix")
        for engine, call in calls.items():
            if self._finish(call) is None:
                try:  # the workers returned: close the update in vLLM
                    self._clients[engine].call("finish_weight_update")
                except WeightSyncError:
                    pass  # the next WeightSync finishes it
        return WeightSyncError(f"{self._lost}; build a new WeightSync to push again")

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
        """Leave the group (the engines keep their weights and keep serving)."""
        for client in self._clients.values():
            try:
                client.call("shutdown_weight_transfer_engine")
            except Exception:  # the engine may be gone already
                pass
        for group in getattr(self, "_comms", [self._comm]):
            if group is not None:
                group.shutdown()
        self._comm = None


__all__ = ["SyncStats", "WeightSync", "WeightSyncError", "engine_maps"]
