"""The many-engines sync's plan, without engines (reshard.vllm.sync; DESIGN 21): where the
schedule places the processes, the depth of its steps, the waves a relayed push is cut into,
and the arguments refused before any engine is contacted."""

import json

import pytest

from reshard.distributed import Transport
from reshard.vllm.sync import (WeightSync, WeightSyncError, _step_levels, cut_waves,
                               default_topology, schedule_topology)


def test_by_default_every_process_is_a_gpu_of_its_host():
    topology = default_topology(["t", "t"], [["t", "n"], ["n"]])
    assert topology == {"hosts": [{"name": "t", "gpus": 3}, {"name": "n", "gpus": 2}],
                        "placement": {"trainer": ["t:0", "t:1"],
                                      "engines": [["t:2", "n:0"], ["n:1"]]}}
    import reshard
    slots = reshard._core.place_processes(json.dumps(topology), 2, [2, 1])
    assert slots == ["t:0", "t:1", "t:2", "n:0", "n:1"]


def test_a_given_topology_places_the_processes():
    topology = {"hosts": [{"name": "t", "gpus": 2}, {"name": "n", "count": 2, "gpus": 4}]}
    text = schedule_topology(topology, ["x", "x"], [["y", "y"], ["y", "y"], ["y"] * 4])
    assert json.loads(text) == topology


@pytest.mark.parametrize("topology,needle", [
    ({"hosts": [{"name": "a", "gpus": 2}], "placement": {"engines": [["nowhere"]]}},
     'no host named "nowhere"'),
    ({"hosts": [{"name": "a", "gpus": 2}]}, "GPUs"),
])
def test_a_topology_that_cannot_hold_the_sync_is_refused_naming_the_path(topology, needle):
    import reshard
    with pytest.raises(reshard.MapError, match=needle):
        schedule_topology(topology, ["a", "a"], [["a", "a"]])


def test_a_relay_is_one_deeper_than_the_deepest_step_into_its_sender():
    steps = [("from_trainer", -1, 0, []), ("within_root", 0, 0, [0]),
             ("relay", 0, 1, [0, 1]), ("relay", 1, 2, [2]), ("relay", 0, 3, [0, 1]),
             ("relay", 3, 4, [4])]
    # Handing on within the root runs after the trainer's step on its thread (depth 0).
    assert _step_levels(steps) == [0, 0, 1, 2, 1, 2]


def _map(buffer=None):
    rank = {"shard_shape": [4], "pieces": []}
    if buffer:
        rank["buffer"] = buffer
    return {"logical_shape": [4], "ranks": {"0": rank}}


def test_waves_keep_tensors_of_one_buffer_together_and_balance_bytes():
    names = [f"l{i}.{p}" for i in range(4) for p in ("q", "k", "v", "o")]
    source = {n: _map() for n in names}
    # The engine fuses q, k, v of each layer into one parameter (a buffer).
    target = {n: _map(n.rsplit(".", 1)[0] + ".qkv" if not n.endswith("o") else None)
              for n in names}
    sizes = {n: 100 for n in names}
    waves = cut_waves([source, target], sizes, 4)
    assert sorted(n for w in waves for n in w) == sorted(names)
    assert len(waves) == 4
    for w in waves:
        for layer in range(4):
            fused = {f"l{layer}.{p}" for p in "qkv"}
            assert not (fused & set(w)) or fused <= set(w), w
    assert max(sum(sizes[n] for n in w) for w in waves) <= 2 * 400 / 4 + 300


def test_one_wave_holds_everything():
    source = {n: _map() for n in "abc"}
    assert cut_waves([source], {n: 1 for n in "abc"}, 1) == [["a", "b", "c"]]


@pytest.mark.parametrize("kwargs,needle", [
    ({"engine": "http://a", "engines": ["http://b"]}, "give engine or engines=, not both"),
    ({"engines": []}, "engines= is a non-empty list"),
    ({"engines": "http://a"}, "engines= is a non-empty list"),
    ({"engines": ["http://a"], "relay_waves": 0}, "relay_waves must be a positive int"),
])
def test_bad_engine_arguments_are_refused_before_any_engine_is_contacted(kwargs, needle):
    with pytest.raises(WeightSyncError, match=needle):
        WeightSync(source_maps={}, **kwargs)


def _sync_of(trainers, workers):
    """A WeightSync's plan state alone (no group, no engine): trainers, engines' workers."""
    sync = WeightSync.__new__(WeightSync)
    sync._trainers, sync._workers, sync._engines = trainers, list(workers), len(workers)
    return sync


def _plan(targets, quantize):
    from maps import split_map
    source = {"x": split_map([256, 128], 0, [128, 128]), "y": split_map([256, 128], 0, [128, 128])}
    reports = [{"engine": e, "tp": 1, "rank": 0, "host": "h", "params": {}}
               for e in range(len(targets))]
    dtypes = {"x": "float8_e4m3fn", "x_scale_inv": "float32", "y": "float8_e4m3fn",
              "y_scale_inv": "float32"}
    return _sync_of(2, [1] * len(targets))._plan(reports, source, targets, dtypes, 1 << 20,
                                                   quantize, 4, None, ["h", "h"])


def test_fp8_engines_of_one_sync_hold_the_same_tensors_as_fp8_blocks():
    from maps import split_map
    both = {n: m for x in "xy" for n, m in ((x, split_map([256, 128], 0, [256])),
                                            (x + "_scale_inv", split_map([2, 1], 0, [2])))}
    plan = _plan([both, both], {"block": [128, 128]})
    assert plan["error"] is None and plan["quantize"] == {"block": [128, 128]}
    assert json.loads(plan["topology"])["hosts"] == [{"name": "h", "gpus": 4}]
    plain = {"x": both["x"], "y": both["y"]}
    with pytest.raises(WeightSyncError, match="engine 1: quantize= applies to no tensor"):
        _plan([both, plain], {"block": [128, 128]})
    with pytest.raises(WeightSyncError, match=r"quantizes 2 tensors into engine 0 and 1 into "
                                              r"engine 1 \(first differing: \['y'\]\)"):
        _plan([both, {**plain, "x_scale_inv": both["x_scale_inv"]}], {"block": [128, 128]})


class _Agreeing(Transport):
    """One process standing in for its whole group: every collective hears this process's own
    value from each member (every process plans the same, so each would say the same)."""

    def __init__(self, rank, size):
        self.rank, self.members = rank, list(range(size))

    def gather_object(self, value):
        return [value] * len(self.members)

    def max_of(self, value):
        return int(value)

    def any_flag(self, flag):
        return bool(flag)



def _fleet_plan(ids):
    """Two trainer processes' row split into engines at TP 2 and TP 1 (numbered ``ids``)."""
    from maps import replicated_map, split_map
    source = {"w": split_map([8, 6], 0, [4, 4]), "u": split_map([8, 6], 0, [4, 4]),
              "norm": replicated_map([6], 2)}
    tp2 = {"w": split_map([8, 6], 1, [3, 3]), "u": split_map([8, 6], 0, [4, 4]),
           "norm": replicated_map([6], 2)}
    tp1 = {"w": split_map([8, 6], 0, [8]), "u": split_map([8, 6], 0, [8]),
           "norm": replicated_map([6], 1)}
    targets = [tp2, tp1]
    reports = [{"engine": e, "tp": len(workers), "rank": r, "host": "h", "params": {}}
               for e, workers in enumerate([[0, 1], [0]]) for r in workers]
    sync = _sync_of(2, [2, 1])
    plan = sync._plan(reports, source, targets, "float32", 1 << 20, None, 2, None, ["h", "h"])
    plan["ids"] = ids
    return plan


def _stages_of(plan, me):
    from reshard.vllm._schedule import plan_stages
    size = 2 + sum(plan["workers"])
    return plan_stages(plan["source"], plan, 2, lambda lane: _Agreeing(me, size), None)


def _with_bases(stages, me):
    """Every exchange of this process given delta state: its chunks as they travelled."""
    import torch
    for st in stages:
        ex = st.redistributor._exchange
        st.redistributor._delta_base = {
            **{("send", p, k): torch.full([n], p, dtype=torch.uint8) for k, p, n in ex.sends(me)},
            **{("recv", p, k): torch.full([n], p, dtype=torch.uint8)
               for k, p, n in ex.receives(me)}}
    return stages


def test_a_join_keeps_the_delta_state_of_exchanges_left_as_they_were():
    """Engines joined again (identities(): trainer processes, then each engine's workers by
    number): an exchange of the new schedule that is the old one for a process keeps that
    process's chunks, its peers renumbered; one into or out of an engine that is new to the sync
    starts without; a process holds empty state in an exchange it takes no part in where it had
    state in the same exchange before, or where it is new to the sync itself."""
    from reshard.vllm._schedule import carry_delta, identities
    old_plan, same_plan, new_plan = _fleet_plan([0, 1]), _fleet_plan([0, 1]), _fleet_plan([0, 2])
    who = {k: identities(2, [2, 1], p["ids"]) for k, p in
           (("old", old_plan), ("same", same_plan), ("new", new_plan))}
    for me in range(5):  # trainer processes 0, 1; engine 0's workers 2, 3; engine 1's 4
        old = _with_bases(_stages_of(old_plan, me), me)
        same = _stages_of(same_plan, me)
        carry_delta(old, who["old"], me, same, who["same"], me, fresh=False)
        for a, b in zip(old, same):  # the same schedule: every state kept, as it was
            assert b.redistributor._delta_base is not None
            assert sorted(b.redistributor._delta_base) == sorted(a.redistributor._delta_base)
        new = _stages_of(new_plan, me)
        carry_delta(old, who["old"], me, new, who["new"], me, fresh=me == 4)
        for st in new:
            ex, base = st.redistributor._exchange, st.redistributor._delta_base
            involved = bool(ex.sends(me) or ex.receives(me))
            if not involved:  # empty where it had state (or is new itself); else none
                new_engine = 1 in (st.source, st.engine)
                assert base == ({} if me == 4 or not new_engine else None), (me, st.source)
            elif 1 in (st.source, st.engine):  # engine 2, new: whole chunks once
                assert base is None, (me, st.source, st.engine)
            else:  # between the trainer and engine 0: as it was
                assert base and all(t.numel() for t in base.values()), (me, st.source)
    # A process that was not in the old group (engine 2's worker) is fresh: nothing carried.
    fresh = _stages_of(new_plan, 4)
    carry_delta([], [], -1, fresh, who["new"], 4, fresh=True)
    assert all(st.redistributor._delta_base in ({}, None) for st in fresh)
    assert any(st.redistributor._delta_base is None for st in fresh)
