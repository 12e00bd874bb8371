"""`reshard sync-plan` and reshard.plan_sync: the schedule of a weight sync from a trainer into
many engines, end to end through the CLI and the package (the schedule's invariants on data are
in src/reshard/sched/sched_test.cc)."""

import json
import os
import pathlib
import re
import subprocess

import pytest

import reshard

ROOT = pathlib.Path(__file__).resolve().parents[2]
QWEN3 = ROOT / "tests" / "data" / "hf-configs" / "Qwen--Qwen3-0.6B.json"
MOE = ROOT / "tests" / "data" / "sync-plan" / "Qwen--Qwen3-30B-A3B.json"


def run(reshard_bin, *args):
    return subprocess.run([reshard_bin, "sync-plan", *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def topology(tmp_path, doc, name="topo.json"):
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def qwen3_params():
    """Qwen3-0.6B's parameter count from its config (tied embeddings: one copy)."""
    c = json.loads(QWEN3.read_text())
    h, i, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    heads, kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    attn = h * heads * hd * 2 + h * kv * hd * 2 + 2 * hd
    return c["vocab_size"] * h + layers * (attn + 3 * h * i + 2 * h) + h


def test_a_real_config_into_four_engines(reshard_bin, tmp_path):
    topo = topology(tmp_path, {"hosts": [{"name": "t", "gpus": 4}, {"name": "e", "count": 2, "gpus": 4}],
                               "nvlink_gbps": 400, "nic_gbps": 50})
    r = run(reshard_bin, "--config", QWEN3, "--trainer", "tp=2,pp=2", "--engines", 4,
            "--engine-tp", 2, "--topology", topo, "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    one_copy = qwen3_params() * 2
    assert report["one_copy_bytes"] == one_copy
    # Each byte leaves the trainer once; every engine gets one copy, so the links carry at
    # least four (plus what replicated pieces add inside an engine).
    assert report["trainer_egress_bytes"] == one_copy
    assert report["total_bytes"] >= 4 * one_copy
    # A small model: the pipeline's fill and drain weigh more than at cluster scale.
    assert 0 < report["lower_bound_s"] <= report["predicted_s"] <= 1.5 * report["lower_bound_s"]
    busiest = report["busiest_link"]
    assert busiest == report["links"][0]
    assert busiest["seconds"] == pytest.approx(report["lower_bound_s"])
    assert busiest["seconds"] == pytest.approx(busiest["bytes"] / (busiest["bandwidth_gbps"] * 1e9))
    # Engines on one host relay over NVLink: each host's NIC takes in about one copy.
    nic_in = [link["bytes"] for link in report["links"] if link["name"].startswith("e") and
              link["name"].endswith("nic in")]
    assert len(nic_in) == 2 and max(nic_in) < 1.5 * one_copy
    text = run(reshard_bin, "--config", QWEN3, "--trainer", "tp=2,pp=2", "--engines", 4,
               "--engine-tp", 2, "--topology", topo)
    assert text.returncode == 0, text.stderr
    assert "lower bound:" in text.stdout and "predicted:" in text.stdout


def test_transfers_and_the_package_agree(reshard_bin, tmp_path):
    doc = {"hosts": [{"name": "n", "count": 3, "gpus": 8}], "nic": "gpu", "nic_gbps": 50}
    topo = topology(tmp_path, doc)
    r = run(reshard_bin, "--config", MOE, "--trainer", "tp=2,pp=2,ep=2", "--engines", 2,
            "--engine-tp", "4,2", "--topology", topo, "--json", "--transfers")
    assert r.returncode == 0, r.stderr
    cli = json.loads(r.stdout)
    plan = reshard.plan_sync(doc, config=MOE, trainer={"tp": 2, "pp": 2, "ep": 2},
                             engine_tp=[4, 2], transfers=True)
    py = plan.to_dict()
    assert json.loads(plan.json()) == py
    cli.pop("planning_s")
    py.pop("planning_s")
    assert py == cli
    # The typed fields are the report's.
    assert plan.engines == (4, 2) and plan.trainer_ranks == cli["trainer_ranks"] == 8
    assert plan.transfers == cli["transfers"] and plan.processes == cli["processes"]
    assert plan.tensor_names == cli["tensor_names"] and plan.tensor_plans == cli["tensor_plans"]
    assert cli["engines"] == [4, 2]
    assert len(cli["transfers"]) == cli["num_transfers"]
    trainer = cli["trainer_ranks"]
    egress = sum(t[3] for t in cli["transfers"] if t[1] < trainer)
    assert egress == cli["trainer_egress_bytes"] == cli["one_copy_bytes"]
    # Every transfer is a move of its step's plan; a relay waits for earlier transfers into its
    # sender of the same tensor, and runs in a later round than each of them.
    transfers = cli["transfers"]
    for i, (rnd, src, _dst, nbytes, tensor, step, move, deps) in enumerate(transfers):
        t = cli["tensor_plans"][tensor]
        s = t["steps"][step]
        m = t["plans"][s["plan"]]["moves"][move]
        elements = 1
        for d in m[2]:
            elements *= d
        assert nbytes == elements * t["element_bytes"]
        assert (src < trainer) == (s["from_engine"] == -1)
        if src < trainer:
            assert rnd == 1 and deps == []
        else:
            assert deps, (i, s)
        for d in deps:
            assert d < i and transfers[d][2] == src and transfers[d][4] == tensor
            assert transfers[d][0] < rnd
    assert cli["processes"][0] == "n0:0" and len(cli["tensor_names"]) == cli["tensors"]


def test_fp8_moves_fewer_bytes_than_bf16(tmp_path):
    ds = ROOT / "tests" / "data" / "sync-plan" / "deepseek-ai--DeepSeek-V3.json"
    cfg = json.loads(ds.read_text())
    cfg.update(num_hidden_layers=4, n_routed_experts=16, first_k_dense_replace=1)
    doc = {"hosts": [{"name": "n", "count": 2, "gpus": 8}]}
    bf16 = reshard.plan_sync(doc, config=cfg, trainer="tp=2,ep=4", engines=2, engine_tp=4)
    fp8 = reshard.plan_sync(doc, config=cfg, trainer="tp=2,ep=4", engines=2, engine_tp=4,
                            dtype="F8_E4M3")
    assert bf16.trainer_egress_bytes == bf16.one_copy_bytes
    assert fp8.trainer_egress_bytes == fp8.one_copy_bytes
    # Linear weights at 1 byte (plus fp32 scales per 128x128 block); the embedding and LM
    # head, which weigh much in this 4-layer cut, stay BF16.
    assert 0.5 < fp8.one_copy_bytes / bf16.one_copy_bytes < 0.75
    assert fp8.tensors > bf16.tensors  # the weight_scale_inv tensors


@pytest.mark.parametrize("doc, path", [
    ({"hosts": [{"name": "a", "gpus": 8}], "placement": {"trainer": ["b:0"]}},
     "placement.trainer[0]: no host named \"b\""),
    ({"hosts": [{"name": "a", "gpus": 8}], "placement": {"engines": [["a:9"]]}},
     "placement.engines[0][0]: host \"a\" has GPUs 0..7"),
    ({"hosts": [{"name": "a", "gpus": 2}]}, "hosts: 2 trainer ranks and 4 engines (10 processes)"),
    ({"hosts": [{"name": "a", "gpus": 8}], "nic": "rack"}, "nic: expected \"host\" or \"gpu\""),
    ({"hosts": [{"name": "a", "gpus": 8}], "nic_gbps": -1}, "nic_gbps: expected a bandwidth"),
    ({"hosts": [{"name": "a", "gpus": 8, "nics": 2}]}, "hosts[0].nics: unknown key"),
    # Bandwidths name their rule: from 1 MB/s (below, a sync's seconds mean nothing) to 1e9.
    ({"hosts": [{"name": "a", "gpus": 8}], "nvlink_gbps": 1e10},
     "nvlink_gbps: expected a bandwidth in GB/s from 0.001 (1 MB/s) to 1e9, got 10000000000"),
    ({"hosts": [{"name": "a", "gpus": 8}], "nic_gbps": 1e-300},
     "nic_gbps: expected a bandwidth in GB/s from 0.001 (1 MB/s) to 1e9, got 1e-300"),
])
def test_bad_topology_is_exit_2_naming_the_path(reshard_bin, tmp_path, doc, path):
    topo = topology(tmp_path, doc)
    r = run(reshard_bin, "--config", QWEN3, "--trainer", "tp=2", "--engines", 4, "--engine-tp", 2,
            "--topology", topo)
    assert r.returncode == 2, r.stderr
    assert str(topo) in r.stderr and path in r.stderr, r.stderr
    assert r.stdout == ""
    with pytest.raises(reshard.MapError, match=re.escape(path.split(":")[0])):
        reshard.plan_sync(doc, config=QWEN3, trainer="tp=2", engines=4, engine_tp=2)


def test_bad_layouts(reshard_bin, tmp_path):
    topo = topology(tmp_path, {"hosts": [{"name": "a", "count": 4, "gpus": 8}]})
    # Qwen3-0.6B cannot be split over 3 ranks: a failed check, exit 1.
    r = run(reshard_bin, "--config", QWEN3, "--trainer", "tp=3", "--engines", 1, "--engine-tp", 2,
            "--topology", topo)
    assert r.returncode == 1 and "tensor parallelism 3 cannot split" in r.stderr, r.stderr
    r = run(reshard_bin, "--config", QWEN3, "--trainer", "tp=2,dp=2", "--engine-tp", 2,
            "--topology", topo)
    assert r.returncode == 2 and "dp=2" in r.stderr, r.stderr
    r = run(reshard_bin, "--trainer", "tp=2", "--topology", topo)
    assert r.returncode == 2, r.stderr


def test_map_documents(reshard_bin, tmp_path):
    # The trainer at TP 2, engines at TP 1 and TP 2, from map documents (reshard layout).
    descriptor = tmp_path / "split.json"
    descriptor.write_text('{"family": "split", "dim": 0}')

    def maps(world):
        return {"version": 1, "w": json.loads(subprocess.run(
            [reshard_bin, "layout", str(descriptor), "--shape", "8,4", "--world", str(world)],
            capture_output=True, text=True, check=True).stdout)}
    src, one, two = (tmp_path / f"{n}.json" for n in ("src", "one", "two"))
    src.write_text(json.dumps(maps(2)))
    one.write_text(json.dumps(maps(1)))
    two.write_text(json.dumps(maps(2)))
    topo = topology(tmp_path, {"hosts": [{"name": "a", "count": 2, "gpus": 4}]})
    r = run(reshard_bin, "--source", src, "--target", one, "--target", two, "--topology", topo,
            "--dtype", "F32", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["one_copy_bytes"] == report["trainer_egress_bytes"] == 8 * 4 * 4
    assert report["engines"] == [1, 2]


def test_the_typed_plan(reshard_bin, tmp_path):
    # reshard.plan_sync's SyncPlan: every field is the CLI's report, links by name busiest
    # first; the JSON and the dict are the report, and the dict is a copy.
    doc = {"hosts": [{"name": "t", "gpus": 4}, {"name": "e", "count": 2, "gpus": 4}],
           "nvlink_gbps": 400, "nic_gbps": 50}
    topo = topology(tmp_path, doc)
    r = run(reshard_bin, "--config", QWEN3, "--trainer", "tp=2,pp=2", "--engines", 4,
            "--engine-tp", 2, "--topology", topo, "--json")
    assert r.returncode == 0, r.stderr
    cli = json.loads(r.stdout)
    plan = reshard.plan_sync(topo, config=QWEN3, trainer="tp=2,pp=2", engines=4, engine_tp=2)
    assert isinstance(plan, reshard.SyncPlan)
    assert plan.one_copy_bytes == cli["one_copy_bytes"] == qwen3_params() * 2
    assert plan.trainer_egress_bytes == plan.one_copy_bytes
    for key in ("trainer_ranks", "hosts", "tensors", "total_bytes", "num_transfers", "rounds"):
        assert getattr(plan, key) == cli[key], key
    for key in ("lower_bound_s", "predicted_s", "predicted_over_lower_bound"):
        assert getattr(plan, key) == pytest.approx(cli[key]), key
    assert plan.engines == (2, 2, 2, 2) and plan.planning_s >= 0
    assert list(plan.links) == [link["name"] for link in cli["links"]]
    assert list(plan.links.values()) == [link["bytes"] for link in cli["links"]]
    assert all(" nvlink " in name or " nic " in name for name in plan.links)
    assert plan.busiest_link == plan.link_details[0]
    assert plan.busiest_link is not None
    assert plan.busiest_link.name == cli["busiest_link"]["name"]
    assert plan.busiest_link.seconds == pytest.approx(plan.lower_bound_s)
    assert plan.busiest_link.bytes == plan.links[plan.busiest_link.name]
    assert plan.transfers is None and plan.tensor_plans is None
    d = plan.to_dict()
    d.pop("planning_s")
    cli.pop("planning_s")
    assert d == cli
    assert json.loads(plan.json())["one_copy_bytes"] == plan.one_copy_bytes
    plan.to_dict()["links"].clear()
    assert plan.to_dict()["links"] and plan.links
    with pytest.raises(AttributeError):
        plan.rounds = 0  # type: ignore[misc]


def _qwen3_with(**changes):
    cfg = json.loads(QWEN3.read_text())
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not None}


@pytest.mark.parametrize("changes, needle", [
    ({"model_type": "bert"}, '"model_type" "bert" is not a model sync-plan lays out'),
    ({"model_type": None}, '"model_type" is missing'),
    ({"num_key_value_heads": 0}, '"num_key_value_heads" is 0'),
    ({"head_dim": 0}, '"head_dim" is 0'),
    # A 1 KB config claiming 2^40 columns: refused before anything is laid out by it.
    ({"hidden_size": 2**40}, "more than 2^44 bytes (16 TiB)"),
])
def test_a_config_it_cannot_lay_out_is_exit_2(reshard_bin, tmp_path, changes, needle):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(_qwen3_with(**changes)))
    topo = topology(tmp_path, {"hosts": [{"name": "a", "count": 2, "gpus": 8}]})
    r = run(reshard_bin, "--config", config, "--trainer", "tp=2,pp=2", "--engines", 4,
            "--engine-tp", 1, "--topology", topo)
    assert r.returncode == 2 and needle in r.stderr, r.stderr
    assert r.stdout == ""
    with pytest.raises(reshard.MapError, match=re.escape(needle)):
        reshard.plan_sync(topo, config=config, trainer="tp=2,pp=2", engines=4, engine_tp=1)


def test_a_grid_degree_given_twice_is_refused(reshard_bin, tmp_path):
    topo = topology(tmp_path, {"hosts": [{"name": "a", "count": 2, "gpus": 8}]})
    r = run(reshard_bin, "--config", QWEN3, "--trainer", "tp=2,tp=4", "--engines", 2,
            "--engine-tp", 1, "--topology", topo)
    assert r.returncode == 2 and "tp is given twice" in r.stderr, r.stderr
    with pytest.raises(reshard.MapError, match="tp is given twice"):
        reshard.plan_sync(topo, config=QWEN3, trainer="tp=2,tp=4", engines=2, engine_tp=1)


def test_a_large_topology_plans_the_sync_processes_links_only(reshard_bin, tmp_path):
    # 2^24 GPUs declared, 12 processes: only the links of the GPUs and NICs in use exist.
    doc = {"hosts": [{"name": "h", "count": 256, "gpus": 65536}], "nic": "gpu"}
    plan = reshard.plan_sync(doc, config=QWEN3, trainer="tp=2,pp=2", engines=4, engine_tp=2)
    assert plan.trainer_ranks == 4 and plan.engines == (2, 2, 2, 2) and plan.hosts == 256
    assert plan.trainer_egress_bytes == plan.one_copy_bytes
    assert all(name.startswith("h0:") for name in plan.links)


@pytest.mark.parametrize("kwargs, needle", [
    ({"engines": True}, "engines: expected an integer from 1 to 65536, got True"),
    ({"engines": 2.5}, "engines: expected an integer from 1 to 65536, got 2.5"),
    ({"engines": 0}, "engines: expected an integer from 1 to 65536, got 0"),
    ({"engines": 65537}, "engines: expected an integer from 1 to 65536, got 65537"),
    ({"engine_tp": 2**31}, "engine_tp: expected an integer from 1 to 65536, got 2147483648"),
    ({"engine_tp": [1, True]}, "engine_tp[1]: expected an integer from 1 to 65536, got True"),
    ({"engine_tp": "2"}, "engine_tp: expected an integer or a list of them, got '2'"),
    ({"trainer": {"tp": 2.0}}, "trainer['tp']: expected an integer from 1 to 65536, got 2.0"),
])
def test_plan_sync_arguments_are_refused_naming_them(kwargs, needle):
    args = {"config": QWEN3, "trainer": "tp=2", "engines": 2, "engine_tp": 1, **kwargs}
    with pytest.raises(reshard.MapError, match=re.escape(needle)):
        reshard.plan_sync({"hosts": [{"name": "a", "gpus": 8}]}, **args)


@pytest.mark.parametrize("which", ["topology", "config"])
def test_plan_sync_refuses_a_fifo_nobody_writes_at_once(tmp_path, which):
    # As the CLI reads its inputs: a blocking open of a FIFO with no writer would never return.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    topo = {"hosts": [{"name": "a", "gpus": 8}]}
    args = {"topology": fifo if which == "topology" else topo,
            "config": fifo if which == "config" else QWEN3}
    with pytest.raises(reshard.MapError, match="is a FIFO with no writer"):
        reshard.plan_sync(args["topology"], config=args["config"], trainer="tp=2", engines=2,
                          engine_tp=1)
