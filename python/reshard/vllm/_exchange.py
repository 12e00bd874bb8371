"""The transport of a push: the stages of a plan (:mod:`reshard.vllm._schedule`) run by every
process of the sync's group, each lane of exchanges on a thread and a group of its own
(:func:`run_stages`, :func:`lane_groups`), and the plan's bytes sent bare for measuring a push
against (:func:`raw_exchange`). The trainer processes and the engine's workers
(:mod:`reshard.vllm.engine`) run the same functions from their own side.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping, Optional, Sequence

from .._maps import as_map
from ..distributed import QuantizingRedistributor, RedistributeError, Redistributor
from ._group import StoreGroup
from ._schedule import AnyRedistributor, Stage, engine_ranks, torch_dtypes

# What a worker serves: {key: tensor} of the keys it can show as loaded, and the keys it cannot
# (their served form is not their loading form), for {key: (shape, dtype name)} asked.
Served = Callable[[Mapping[str, tuple[tuple[int, ...], str]]], tuple[dict[str, Any], list[str]]]


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


def lane_groups(store: Any, prefix: str, rank: int, comm: StoreGroup, backend: str,
                timeout_s: float, made: list[StoreGroup]) -> Callable[[int], StoreGroup]:
    """The group of each lane of the schedule (:func:`reshard.vllm._schedule.plan_stages`):
    ``comm`` for the first, a group of its own over the same processes for each other one
    (made when first asked for: a collective), appended to ``made``."""
    def group_of(lane: int) -> StoreGroup:
        if lane == 0:
            return comm
        group = StoreGroup(store, f"{prefix}/lane{lane}", rank, len(comm.members), backend,
                           timeout_s)
        made.append(group)
        return group
    return group_of


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
               on_ready: Optional[Callable[[dict[str, Any]], None]], error: Optional[str],
               delta: bool = False, verify: bool = False) -> None:
    """Every exchange of a push, as this process takes part in it (a collective over the
    sync's groups; ``delta``: each exchange sends only what changed since the last delta push,
    :meth:`reshard.distributed.Redistributor.run`; ``verify``: each exchange is followed by
    :meth:`~reshard.distributed.Redistributor.verify` of what its targets received): a trainer process (``engine`` -1) sends its ``shards`` in the exchanges
    from the trainer processes; a worker (map rank ``rank`` of its ``engine``) receives into
    ``out`` in its engine's exchanges and sends from ``out`` in those where its engine relays.
    Each lane (:func:`reshard.vllm._schedule.plan_stages`) runs on a thread of its own over a
    group of its own, so that the trainer processes feed every engine at once and an engine
    relays what it has received of wave w (every exchange into it of that wave at a lesser
    depth) while wave w + 1 arrives. An exchange waits only for exchanges of earlier lanes on
    this process (what its engine sends must have arrived; a buffer staged through a copy is
    written by one exchange at a time), so no two processes can wait on each other. A failure
    in one exchange is told to the later ones as an agreed error, so that no process waits for
    a peer that gave up; the first failure is raised (a refusal before a transport error). Once
    a peer is lost, the exchanges not yet begun are skipped: each would only wait out the
    timeout on the broken group."""
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
                             delta=delta, _error=why())
                else:
                    sync.run(mine, delta=delta, _error=why())
                if verify:  # what the targets received, before any processing of it
                    sync.verify(held(sync, "target") if st.engine == engine else {}, mine)
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


def verify_engines(comm: StoreGroup, plan: Mapping[str, Any], trainers: int, engine: int,
                   rank: int, shards: Mapping[str, Any], served: Optional[Served],
                   cache: dict[Any, Redistributor], error: Optional[str],
                   name_of: Optional[Callable[[int], str]] = None) -> tuple[int, list[str]]:
    """What every engine's workers serve now, proven against the trainer processes' shards
    (a collective over the sync's group, every process calling it alike: a trainer process,
    ``engine`` -1, with its ``shards``; a worker, map rank ``rank`` of its ``engine``, with
    ``served``, what it holds). Each worker first says which of its keys it cannot show (a
    parameter whose served form vLLM's post-load processing changed: on CPU, a linear layer's
    weight packed for oneDNN); then, per engine, the tensors every worker of it can show are
    checked by :meth:`reshard.distributed.Redistributor.verify`, straight from the trainer
    processes to that engine's workers (one exchange per engine and set of tensors, planned
    once and kept in ``cache``). Returns the (tensor, worker) pairs compared and the tensors
    no worker of some engine could show; raises RedistributeError, on every process alike,
    naming each difference (engine, worker, tensor, first differing element)."""
    workers = plan["workers"]
    source = plan["source"]
    hidden: list[str] = []
    held: dict[str, Any] = {}
    if engine >= 0 and served is not None and not plan.get("error"):
        wanted: dict[str, tuple[tuple[int, ...], str]] = {}
        for name, m in plan["targets"][engine].items():
            pm = as_map(m)
            wanted[pm.buffer(rank) or name] = (tuple(pm.shard_shape(rank)),
                                               plan["dtypes"][engine][name])
        try:
            held, hidden = served(wanted)
        except Exception as ex:  # agreed below: every process raises it
            error = error or f"engine worker {rank}: {type(ex).__name__}: {ex}"
    told = comm.gather_object((hidden, error))
    error = next((why for _, why in told if why is not None), None)
    if error is not None or plan.get("error"):
        raise RedistributeError(error or plan["error"])
    pairs, unseen, failures = 0, set(), []
    for e, target in enumerate(plan["targets"]):
        ranks = engine_ranks(trainers, workers, e)
        maps = {n: as_map(m) for n, m in target.items()}
        names = []
        for n in source:
            if n not in maps:
                continue
            if any((maps[n].buffer(w) or n) in told[p][0] for w, p in enumerate(ranks)):
                unseen.add(n)
            else:
                names.append(n)
        if not names:
            continue
        sync = cache.get((e, tuple(names)))
        if sync is None:
            sync = Redistributor({n: source[n] for n in names}, {n: target[n] for n in names},
                                 source_ranks=range(trainers), target_ranks=ranks, group=comm,
                                 dtypes=torch_dtypes({n: plan["dtypes"][e][n] for n in names}),
                                 bucket_bytes=plan["bucket_bytes"])
            cache[(e, tuple(names))] = sync
            if name_of is not None:
                sync._process_name = name_of
        mine: dict[str, Any] = {}
        if engine < 0:
            keys = {as_map(source[n]).buffer(rank) or n for n in names}
            mine = {k: v for k, v in shards.items() if k in keys}
        try:
            pairs += sync.verify(held if engine == e else {}, mine)
        except RedistributeError as ex:  # the same on every process: the next engine's too
            failures.append(str(ex))
    if failures:
        raise RedistributeError("; ".join(failures))
    return pairs, sorted(unseen)
