"""The many-engines sync's plan, without engines (reshard.vllm.sync; DESIGN 21): the relay tree
its cost model picks, the waves a relayed push is cut into, and the arguments refused before
any engine is contacted."""

import pytest

from reshard.vllm.sync import WeightSync, WeightSyncError, cut_waves, depths, relay_tree


def test_relay_tree_prefers_the_same_host_then_the_shallower_engine():
    hosts = ["h0", "h0", "h1", "h1", "h0"]
    parents, order = relay_tree(["s"] * 5, hosts)
    # e1 beside e0; e2 from e0 (both candidates across hosts, e0 shallower); e3 from e2 (same
    # host); e4 from e1 (e0 is full: two receivers).
    assert parents == [-1, 0, 0, 2, 1]
    assert depths(parents) == [0, 1, 1, 2, 2]
    assert order == [0, 1, 2, 3, 4]
    assert all(parents.count(p) <= 2 for p in range(5))


def test_engines_of_other_dtypes_get_their_own_copy_from_the_trainer():
    parents, order = relay_tree(["bf16", "fp32", "bf16", "fp32", "bf16"], ["h"] * 5)
    assert parents == [-1, -1, 0, 1, 0]
    assert order.index(2) > order.index(0) and order.index(3) > order.index(1)


def test_relay_tree_of_many_engines_is_logarithmic():
    parents, order = relay_tree(["s"] * 15, ["h"] * 15)
    assert max(depths(parents)) == 3  # 1 + 2 + 4 + 8 engines
    for e in order:  # every engine after the one it receives from
        assert parents[e] < 0 or order.index(parents[e]) < order.index(e)


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


def test_topology_places_the_engines_for_the_cost_model():
    topology = {"hosts": [{"name": "t", "gpus": 2}, {"name": "n", "count": 2, "gpus": 4}]}
    # Default placement: the trainer's 2 ranks on t, then the engines' workers in turn.
    assert _sync_of(2, [2, 2, 4])._hosts_of(topology) == ["n0", "n0", "n1"]
    placed = dict(topology, placement={"engines": [["n1:0", "n1:1"], ["n0:0", "n0:1"],
                                                  ["n1:2", "n1:3", "n1:4", "n1:5"]]})
    placed["hosts"] = [{"name": "t", "gpus": 2}, {"name": "n", "count": 2, "gpus": 6}]
    assert _sync_of(2, [2, 2, 4])._hosts_of(placed) == ["n1", "n0", "n1"]


@pytest.mark.parametrize("topology,needle", [
    ({"hosts": [{"name": "a", "gpus": 2}], "placement": {"engines": [["nowhere"]]}},
     'no host named "nowhere"'),
    ({"hosts": [{"name": "a", "gpus": 2}]}, "GPUs"),
])
def test_a_topology_that_cannot_hold_the_sync_is_refused_naming_the_path(topology, needle):
    import reshard
    with pytest.raises(reshard.MapError, match=needle):
        _sync_of(2, [2])._hosts_of(topology)
