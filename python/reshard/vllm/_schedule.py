"""The plan of a push (DESIGN 21): the exchanges that move the trainer's shards into one or
many engines' workers. Into one engine, one :class:`reshard.distributed.Redistributor` (or a
quantizing one) from the trainer processes to its workers; into several, the sync schedule
``reshard.plan_sync`` plans (each byte out of the trainer processes once, the engines' workers
relaying the rest), cut into waves and lanes (:func:`plan_stages`). Every process of the sync's
group builds the same stages from the same agreed plan; :mod:`reshard.vllm._exchange` runs them.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from .._maps import ParamMap, as_map
from ..distributed import QuantizingRedistributor, Redistributor, _message


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


def torch_dtypes(names: Optional[Mapping[str, str]]) -> Optional[dict[str, Any]]:
    """{name: "bfloat16"} -> {name: torch.bfloat16}."""
    import torch
    return None if names is None else {n: getattr(torch, d) for n, d in names.items()}


def identities(trainers: int, workers: Sequence[int], ids: Sequence[int]
               ) -> list[tuple[int, int]]:
    """Each process of a sync's group as it stays while engines come and go: (-1, r) for
    trainer process r, (number, w) for worker w of the engine of that number (``ids``, in the
    engines' order)."""
    out = [(-1, r) for r in range(trainers)]
    for e, n in enumerate(workers):
        out += [(ids[e], w) for w in range(n)]
    return out


def _stage_key(stage: Stage, who: Sequence[tuple[int, int]], ranks: Callable[[int], range]
               ) -> tuple[Any, ...]:
    """A stage by what it moves and between which engines (by number)."""
    def number(e: int) -> int:
        return -1 if e < 0 else who[ranks(e).start][0] if len(ranks(e)) else -2
    names = tuple(getattr(stage.redistributor, "_names", ()))
    return (number(stage.source), number(stage.engine), stage.wave, stage.level, names)


def _traffic(sync: Redistributor, me: int, who: Sequence[tuple[int, int]]) -> Any:
    """What process ``me`` sends and receives in an exchange, chunk by chunk, its peers by
    identity: equal for two exchanges whose chunks between the same processes hold the same
    elements in the same places."""
    ex = sync._exchange
    if ex is None:
        return None
    sends = sorted((k, who[p], n, ex.messages(me, p, k), ex.boxes(me, "pack", p, k))
                   for k, p, n in ex.sends(me))
    receives = sorted((k, who[p], n, ex.messages(p, me, k), ex.boxes(me, "unpack", p, k))
                      for k, p, n in ex.receives(me))
    return ex.num_rounds, sends, receives


def carry_delta(old: Sequence[Stage], old_who: Sequence[tuple[int, int]], old_me: int,
                new: Sequence[Stage], new_who: Sequence[tuple[int, int]], new_me: int, *,
                fresh: bool) -> None:
    """After the sync's group is joined again (engines added or removed), the delta state
    (:meth:`reshard.distributed.Redistributor.run`, ``delta=True``) of each exchange of
    ``old`` that ``new`` has again as it was for this process: the same engines, wave, depth
    and tensors, and the same chunks to and from the same processes (``*_who``:
    :func:`identities` of the two groups; ``*_me``: this process's rank in each). Such an
    exchange sends a delta again where every process of it carried its chunks; any other sends
    whole chunks once (the exchanges agree on it). A process that takes no part in an exchange
    holds an empty state where it had one (``fresh``: it is new to the sync), so that it does
    not make the others send whole chunks."""
    def ranks_of(who: Sequence[tuple[int, int]]) -> Callable[[int], range]:
        starts: dict[int, list[int]] = {}
        order: list[int] = []
        for p, (number, _) in enumerate(who):
            if number >= 0:
                if number not in starts:
                    order.append(number)
                starts.setdefault(number, []).append(p)

        def ranks(e: int) -> range:
            if e >= len(order):
                return range(0)
            ps = starts[order[e]]
            return range(ps[0], ps[-1] + 1)
        return ranks
    old_ranks, new_ranks = ranks_of(old_who), ranks_of(new_who)
    before = {_stage_key(st, old_who, old_ranks): st for st in old
              if not st.prepare and isinstance(st.redistributor, Redistributor)}
    at = {w: p for p, w in enumerate(new_who)}
    for st in new:
        sync = st.redistributor
        if st.prepare or not isinstance(sync, Redistributor) or sync._exchange is None:
            continue
        ex = sync._exchange
        was = before.get(_stage_key(st, new_who, new_ranks))
        base = None if was is None else getattr(was.redistributor, "_delta_base", None)
        if not ex.sends(new_me) and not ex.receives(new_me):
            if fresh or base is not None:
                sync._delta_base = {}
            continue
        if was is None or base is None or old_me < 0 or not isinstance(
                was.redistributor, Redistributor) or \
                _traffic(was.redistributor, old_me, old_who) != _traffic(sync, new_me, new_who):
            continue
        sync._delta_base = {(d, at[old_who[p]], k): t for (d, p, k), t in base.items()
                            if old_who[p] in at}
