"""reshard.distributed between live processes: one torchrun launch of 4 processes (gloo on the
CPU) runs every case in distributed_worker.py; each case's results must equal, bit for bit,
the offline reshard.transfer of the same maps, on every process, and move no more bytes than
the processes must exchange. Error cases must raise on every process of the group, and the
next case starting in step shows that none was left waiting."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from conftest import BUILD
from ds_checkpoints import free_loopback_port
from maps import replicated_map, split_map, stacked_expert_maps

torch = pytest.importorskip("torch")

HERE = pathlib.Path(__file__).resolve().parent


def layout(reshard_bin, tmp, descriptor, shape, world):
    """The param map of a layout family at a world size, from `reshard layout`."""
    d, m = tmp / "descriptor.json", tmp / "map.json"
    d.write_text(json.dumps(descriptor))
    subprocess.run([reshard_bin, "layout", d, "--shape", ",".join(map(str, shape)), "--world",
                    str(world), "-o", m, "--force"], check=True, capture_output=True)
    return json.loads(m.read_text())


FAMILIES = {  # name: (descriptor, shape, dtype)
    "fused_qkv": ({"family": "fused", "dim": 0, "parts": [{"size": 8}, {"size": 4}, {"size": 4}],
                   "heads": 4}, [16, 4], "float32"),
    "multi_query": ({"family": "segmented", "dim": 0,
                     "parts": [{"size": 8}, {"size": 4, "replicated": True}]}, [12, 4], "bfloat16"),
    "block_gather": ({"family": "block_gather", "dim": 0, "pairing": "shared_qk", "heads": 8},
                     [32, 4], "float32"),
    "codegen_qkv": ({"family": "codegen_qkv", "dim": 0, "mp_num": 4, "heads": 16}, [96, 4],
                    "float16"),
    "padded_vocab": ({"family": "padded_vocab", "dim": 0}, [13, 4], "float32"),
    "pre_divided_bias": ({"family": "replicated", "pre_divided": True}, [16], "float32"),
    "columns": ({"family": "split", "dim": 1}, [6, 8], "float32"),
    "rows_int": ({"family": "split", "dim": 0}, [8, 3], "int32"),
    "norm": ({"family": "replicated"}, [8], "float32"),
}


def family_params(reshard_bin, tmp, source_world, target_world):
    return {name: {"source": layout(reshard_bin, tmp, d, shape, source_world),
                   "target": layout(reshard_bin, tmp, d, shape, target_world), "dtype": dtype}
            for name, (d, shape, dtype) in FAMILIES.items()}


def llama_params(reshard_bin, tmp, source_world, target_world):
    """A Llama-shaped toy: 2 layers, hidden 32, 8 heads of 4, 4 key/value heads, MLP 64, a
    vocabulary of 50 padded to divide (embedding and untied LM head)."""
    hidden, inter, kv = 32, 64, 16

    def pair(shape, dim):
        return {"source": split_map(shape, dim, [shape[dim] // source_world] * source_world),
                "target": split_map(shape, dim, [shape[dim] // target_world] * target_world)}

    vocab = {"source": layout(reshard_bin, tmp, {"family": "padded_vocab", "dim": 0}, [50, hidden],
                              source_world),
             "target": layout(reshard_bin, tmp, {"family": "padded_vocab", "dim": 0}, [50, hidden],
                              target_world)}
    params = {"model.embed_tokens.weight": vocab, "lm_head.weight": vocab,
              "model.norm.weight": {"source": replicated_map([hidden], source_world),
                                    "target": replicated_map([hidden], target_world)}}
    for layer in range(2):
        p = f"model.layers.{layer}."
        params.update({
            p + "self_attn.q_proj.weight": pair([hidden, hidden], 0),
            p + "self_attn.k_proj.weight": pair([kv, hidden], 0),
            p + "self_attn.v_proj.weight": pair([kv, hidden], 0),
            p + "self_attn.o_proj.weight": pair([hidden, hidden], 1),
            p + "mlp.gate_proj.weight": pair([inter, hidden], 0),
            p + "mlp.up_proj.weight": pair([inter, hidden], 0),
            p + "mlp.down_proj.weight": pair([hidden, inter], 1),
            p + "input_layernorm.weight": params["model.norm.weight"],
            p + "post_attention_layernorm.weight": params["model.norm.weight"],
        })
    return params


def cases(reshard_bin, tmp):
    four_to_two = family_params(reshard_bin, tmp, 4, 2)
    two_to_four = family_params(reshard_bin, tmp, 2, 4)
    rows_to_cols = {"w": {"source": split_map([8, 12], 0, [4, 4]),
                          "target": split_map([8, 12], 1, [6, 6])},
                    "v": {"source": split_map([6, 4, 5], 0, [3, 3]),
                          "target": split_map([6, 4, 5], 2, [2, 3]), "dtype": "bfloat16"}}
    replicated = {f"norm.{i}": {"source": replicated_map([64], 2),
                                "target": split_map([64], 0, [32, 32])} for i in range(8)}
    w = {"w": rows_to_cols["w"]}
    # An MoE layer's 6 experts' gate and up rows stacked in one gate_up_proj per process: EP 2
    # on two processes -> EP 2 (round robin) x expert TP 2 on four, buffer to buffer.
    gate_up = [("experts.{e}.gate_proj.weight", [4, 3]), ("experts.{e}.up_proj.weight", [4, 3])]
    ep_src, _ = stacked_expert_maps([[0, 1, 2], [3, 4, 5]], gate_up)
    ep_dst, _ = stacked_expert_maps([[0, 2, 4], [1, 3, 5]], gate_up, tp=2)
    experts = {n: {"source": ep_src[n], "target": ep_dst[n]} for n in ep_src}
    other_target = split_map([8, 12], 1, [4, 8])
    everyone = [0, 1, 2, 3]
    listed = [
        {"name": "tp4_to_tp2_overlapping", "params": four_to_two, "source_ranks": everyone,
         "target_ranks": [0, 1], "seed": 1},
        {"name": "tp4_to_tp2_small_buckets_two_steps", "params": four_to_two, "seed": 2,
         "source_ranks": everyone, "target_ranks": [3, 1], "bucket_bytes": 64, "steps": 2,
         "reuse_out": True},
        {"name": "rows_to_columns_disjoint", "params": rows_to_cols, "source_ranks": [0, 1],
         "target_ranks": [2, 3], "seed": 3},
        {"name": "tp2_to_tp4", "params": two_to_four, "source_ranks": [1, 2],
         "target_ranks": everyone, "seed": 4},
        {"name": "llama_tp4_to_tp2", "params": llama_params(reshard_bin, tmp, 4, 2),
         "source_ranks": everyone, "target_ranks": [2, 3], "seed": 5, "bucket_bytes": 4096},
        {"name": "replicated_sources_balanced", "params": replicated, "source_ranks": [0, 1],
         "target_ranks": [2, 3], "seed": 6},
        {"name": "subgroup_of_three", "params": {"w": {"source": split_map([8, 12], 0, [3, 3, 2]),
                                                       "target": split_map([8, 12], 1, [5, 7])}},
         "group": [1, 2, 3], "source_ranks": [1, 2, 3], "target_ranks": [3, 1], "seed": 7},
        {"name": "dry_run", "params": four_to_two, "source_ranks": everyone,
         "target_ranks": [0, 1], "dry_run": True},
        {"name": "error_logical_shapes_differ", "source_ranks": [0, 1], "target_ranks": [2, 3],
         "params": {"w": {"source": split_map([8, 12], 0, [4, 4]),
                          "target": split_map([8, 10], 1, [5, 5])}}},
        {"name": "error_world_size", "params": w, "source_ranks": [0, 1, 2],
         "target_ranks": [2, 3]},
        {"name": "error_process_not_in_group", "params": w, "source_ranks": [0, 1],
         "target_ranks": [2, 7]},
        {"name": "error_process_named_twice", "params": w, "source_ranks": [0, 1],
         "target_ranks": [2, 2]},
        {"name": "error_shard_shape", "params": w, "source_ranks": [0, 1], "target_ranks": [2, 3],
         "corrupt": {"process": 1, "param": "w", "kind": "shape"}},
        {"name": "error_shard_dtype", "params": w, "source_ranks": [0, 1], "target_ranks": [2, 3],
         "dtypes": "float32", "corrupt": {"process": 0, "param": "w", "kind": "dtype"}},
        {"name": "error_dtypes_disagree", "params": w, "source_ranks": [0, 1],
         "target_ranks": [2, 3], "corrupt": {"process": 1, "param": "w", "kind": "dtype"}},
        {"name": "error_missing_shard", "params": w, "source_ranks": [0, 1],
         "target_ranks": [2, 3], "corrupt": {"process": 0, "param": "w", "kind": "missing"}},
        {"name": "error_maps_differ_between_processes", "params": w, "source_ranks": [0, 1],
         "target_ranks": [2, 3],
         "different_map": {"process": 3, "param": "w", "source": w["w"]["source"],
                           "target": other_target}},
        {"name": "moe_ep2_to_ep2_tp2_buffers", "params": experts, "source_ranks": [2, 3],
         "target_ranks": [0, 2, 1, 3], "seed": 9, "bucket_bytes": 64},
        # 512 KiB of float32: chunks large enough to travel as messages over the shards.
        {"name": "big_rows_to_rows", "source_ranks": [0, 1], "target_ranks": everyone,
         "params": {"w": {"source": split_map([512, 256], 0, [256, 256]),
                          "target": split_map([512, 256], 0, [128] * 4)}}, "seed": 10},
        {"name": "big_rows_to_columns", "source_ranks": [0, 1], "target_ranks": [2, 3],
         "params": {"w": {"source": split_map([512, 256], 0, [256, 256]),
                          "target": split_map([512, 256], 1, [128, 128])}}, "seed": 11},
        # Three tensors of other sizes in one chunk per pair: several messages between each
        # pair in one round, matched in the order they are posted.
        {"name": "big_three_rows", "source_ranks": [0, 1], "target_ranks": [2, 3], "seed": 12,
         "params": {name: {"source": split_map(shape, 0, [shape[0] // 2] * 2),
                           "target": split_map(shape, 0, [shape[0] // 4, shape[0] * 3 // 4])}
                    for name, shape in (("a", [256, 64]), ("b", [128, 256]),
                                        ("c", [64, 512]))}},
        # A padded vocabulary (13 rows at TP 4: the last rank's last 3 rows are padding).
        {"name": "padded_vocab_tp2_to_tp4", "source_ranks": [0, 1], "target_ranks": everyone,
         "seed": 13, "params": {"emb": {
             "source": layout(reshard_bin, tmp, FAMILIES["padded_vocab"][0], [13, 64], 2),
             "target": layout(reshard_bin, tmp, FAMILIES["padded_vocab"][0], [13, 64], 4),
             "dtype": "float32"}}},
        # Moves of one element between processes (compose gives them no dimensions): an
        # uneven bias's last element, a vector's single elements.
        {"name": "single_elements_travel", "source_ranks": [0, 1, 2], "target_ranks": [3, 1],
         "seed": 14, "params": {
             "bias": {"source": split_map([3], 0, [2, 1, 0]), "target": split_map([3], 0, [1, 2])},
             "v": {"source": split_map([5, 1], 0, [2, 2, 1]),
                   "target": split_map([5, 1], 0, [3, 2])}}},
        {"name": "after_errors", "params": rows_to_cols, "source_ranks": [0, 1],
         "target_ranks": [2, 3], "seed": 8},
    ]
    # The same moves with torch's strided copies where the shards are (a GPU process's copier),
    # run on the CPU; in the small-bucket case the processes holding pre-divided biases keep
    # the host executor (it checks scales), the others use torch: each decides for itself.
    # Outputs given full of 0xFF bytes: padding (the vocabulary's last rows) must be zeroed.
    return listed + [{**case, "name": f"torch_{case['name']}", "torch_copies": True,
                      "garbage_out": True}
                     for case in listed if case["name"] in TORCH_COPIES]


@pytest.fixture(scope="module")
def launch(tmp_path_factory, reshard_bin):
    """Runs every case in one torchrun launch; returns name -> [result of each process]."""
    tmp = tmp_path_factory.mktemp("distributed")
    all_cases = cases(reshard_bin, tmp)
    (tmp / "cases.json").write_text(json.dumps(all_cases))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BUILD / "python"), str(HERE)]),
               OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
                        "--master_addr", "127.0.0.1", "--master_port", str(free_loopback_port()),
                        str(HERE / "distributed_worker.py"), str(tmp / "cases.json"),
                        str(tmp / "out")], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    results = {}
    for case in all_cases:
        ranks = [json.loads((tmp / "out" / case["name"] / f"rank-{p}.json").read_text())
                 for p in range(4)]
        results[case["name"]] = (case, ranks)
    return results


TORCH_COPIES = ["llama_tp4_to_tp2", "moe_ep2_to_ep2_tp2_buffers", "big_rows_to_columns",
                "big_three_rows", "subgroup_of_three", "tp4_to_tp2_small_buckets_two_steps",
                "padded_vocab_tp2_to_tp4", "single_elements_travel"]

GOOD = ["tp4_to_tp2_overlapping", "tp4_to_tp2_small_buckets_two_steps",
        "rows_to_columns_disjoint", "tp2_to_tp4", "llama_tp4_to_tp2", "replicated_sources_balanced",
        "subgroup_of_three", "moe_ep2_to_ep2_tp2_buffers", "big_rows_to_rows",
        "big_rows_to_columns", "big_three_rows", "padded_vocab_tp2_to_tp4",
        "single_elements_travel", "after_errors"]


@pytest.mark.parametrize("name", GOOD + [f"torch_{n}" for n in TORCH_COPIES])
def test_every_process_gets_what_the_offline_transfer_gives(launch, name):
    case, ranks = launch[name]
    for p, r in enumerate(ranks):
        if r.get("skipped"):
            assert p not in case["group"]
            continue
        assert r["error"] is None, (p, r["error"], r.get("traceback"))
        assert r["mismatch"] == [], (p, r["mismatch"])
        assert len(r["stats"]) == case.get("steps", 1)
        for stats in r["stats"]:
            # Only what the process must receive travels: its target elements that no source
            # shard in the process holds, counted on index markers.
            assert stats["received"] == r["lower_bound"] == stats["lower_bound"], (p, stats)


@pytest.mark.parametrize("name", GOOD + [f"torch_{n}" for n in TORCH_COPIES])
def test_on_ready_hands_on_each_target_once_complete(launch, name):
    """run(on_ready=...) names every target shard of the process exactly once, and each held
    its final values when it was handed on."""
    case, ranks = launch[name]
    for p, r in enumerate(ranks):
        if r.get("skipped"):
            continue
        for step, calls in enumerate(r["handed_on"]):
            names = [n for call in calls for n in call]
            assert len(names) == len(set(names)), (p, step, names)
            want = [n for n, prm in case["params"].items() if p in case["target_ranks"]]
            if "moe" not in name:  # buffers are handed on by the buffer's name
                assert sorted(names) == sorted(want), (p, step)
            assert all(ok for call in calls for ok in call.values()), (p, step, calls)


def test_on_ready_hands_targets_on_while_later_rounds_travel(launch):
    """With many rounds (4 KiB buckets), a target process hears of its shards over several
    calls, not all at the end."""
    for name in ("llama_tp4_to_tp2", "torch_llama_tp4_to_tp2"):
        case, ranks = launch[name]
        for p in case["target_ranks"]:
            calls = ranks[p]["handed_on"][0]
            assert ranks[p]["stats"][0]["rounds"] > 10 and len(calls) > 5, (name, p, len(calls))


def test_bytes_sent_equal_bytes_received_over_the_group(launch):
    for name in GOOD:
        case, ranks = launch[name]
        stats = [r["stats"][0] for r in ranks if not r.get("skipped")]
        assert sum(s["sent"] for s in stats) == sum(s["received"] for s in stats) > 0, name


def test_tp4_to_tp2_overlapping_sends_the_quarter_it_lacks(launch):
    case, ranks = launch["tp4_to_tp2_overlapping"]
    # Process 2 and 3 hold source ranks only: they send and receive nothing back.
    assert [r["stats"][0]["received"] > 0 for r in ranks] == [True, True, False, False]
    assert all(r["stats"][0]["local"] > 0 for r in ranks[:2])


def test_small_buckets_cut_moves_into_many_rounds(launch):
    _, ranks = launch["tp4_to_tp2_small_buckets_two_steps"]
    _, reference = launch["tp4_to_tp2_overlapping"]
    assert all(r["stats"][0]["rounds"] > 10 for r in ranks)
    assert reference[0]["stats"][0]["rounds"] == 1
    for r in ranks:
        for rnd, _, n in r["schedule"]["processes"][str(ranks.index(r))]["sends"]:
            assert n <= 64 // 4, (rnd, n)


def test_contiguous_sides_of_a_chunk_use_the_shards_as_they_lie(launch):
    """Rows into rows: each chunk is one run of bytes in the source shard and in the target
    shard, so it is sent from one and received into the other (nothing staged). Rows into
    columns: each box is strided in the source shard (packed by the sender) and one run in
    the target shard (received into it). Small chunks (rows to columns of 8 x 12) are staged
    whole on both sides. All give the offline transfer's result
    (test_every_process_gets_what_the_offline_transfer_gives)."""
    def stats(name):
        return [r["stats"][0] for r in launch[name][1]]

    rows = stats("big_rows_to_rows")
    assert all(s["sent_direct"] == s["sent"] and s["received_direct"] == s["received"]
               for s in rows)
    assert sum(s["received"] for s in rows) == 3 * 128 * 256 * 4
    columns = stats("big_rows_to_columns")
    assert [s["sent_direct"] for s in columns] == [0, 0, 0, 0]
    assert all(s["received_direct"] == s["received"] > 0 for s in columns[2:])
    three = stats("big_three_rows")
    assert [s["received_direct"] for s in three] == [0, 0] + [s["received"] for s in three[2:]]
    assert all(s["sent_direct"] == s["sent"] > 0 for s in three[:2])
    small = stats("rows_to_columns_disjoint")
    assert sum(s["received"] for s in small) > 0
    assert all(s["sent_direct"] == s["received_direct"] == 0 for s in small)


def test_torch_copies_run_where_no_copy_is_scaled(launch):
    """The torch copier ran in every process of the unscaled cases, and only in the processes
    without a pre-divided bias in the scaled one; the host executor everywhere else."""
    for name in TORCH_COPIES:
        torch_ran = [r["stats"][0]["on_device"] for r in launch[f"torch_{name}"][1]
                     if not r.get("skipped")]
        host_ran = [r["stats"][0]["on_device"] for r in launch[name][1] if not r.get("skipped")]
        assert not any(host_ran), name
        if name == "tp4_to_tp2_small_buckets_two_steps":
            assert any(torch_ran) and not all(torch_ran), torch_ran
        else:
            assert all(torch_ran), (name, torch_ran)


def test_replicated_sources_share_the_sending(launch):
    _, ranks = launch["replicated_sources_balanced"]
    sent = [r["stats"][0]["sent"] for r in ranks]
    assert sent[0] == sent[1] == 8 * 64 * 4 // 2 and sent[2:] == [0, 0], sent


def test_dry_run_returns_the_schedule_without_moving(launch):
    _, ranks = launch["dry_run"]
    _, moved = launch["tp4_to_tp2_overlapping"]
    for p, r in enumerate(ranks):
        assert r["error"] is None and r["stats"] == []
        mine = r["schedule"]["processes"][str(p)]
        assert mine["received"] == moved[p]["stats"][0]["received"]
        assert mine["sent"] == moved[p]["stats"][0]["sent"]
        assert r["schedule"] == ranks[0]["schedule"]  # every process knows the whole schedule


ERRORS = {
    "error_logical_shapes_differ": ["parameter \"w\"", "[8, 12]", "[8, 10]"],
    "error_world_size": ["source map has 2 ranks but source_ranks names 3"],
    "error_process_not_in_group": ["target_ranks[1] is process 7", "not in the group"],
    "error_process_named_twice": ["target_ranks names process 2 twice"],
    "error_shard_shape": ["process 1:", "shards[\"w\"] has shape [4, 11]", "holds [4, 12]"],
    "error_shard_dtype": ["process 0:", "has dtype torch.float16", "moves as torch.float32"],
    "error_dtypes_disagree": ["parameter \"w\"", "process 0 holds its shard as torch.float32",
                              "process 1 as torch.float16"],
    "error_missing_shard": ["process 0:", "no shard given for ['w']"],
    "error_maps_differ_between_processes": ["processes 0 and 3", "parameter \"w\""],
}


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_errors_raise_on_every_process(launch, name):
    _, ranks = launch[name]
    for p, r in enumerate(ranks):
        assert r["error"] is not None and r["error"].startswith("RedistributeError"), (p, r)
        for part in ERRORS[name]:
            assert part in r["error"], (p, part, r["error"])


def test_trainer_to_inference_example_runs(tmp_path):
    pytest.importorskip("transformers")
    example = HERE.parents[1] / "examples" / "trainer_to_inference.py"
    env = dict(os.environ, PYTHONPATH=str(BUILD / "python"), OMP_NUM_THREADS="1",
               GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
                        "--master_addr", "127.0.0.1", "--master_port", str(free_loopback_port()),
                        str(example)], capture_output=True, text=True, timeout=300, env=env,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "equal to the trainer's weights" in r.stdout
    # Every process reports each of the 3 syncs, and receives no more than it needs.
    steps = re.findall(r"step \d: process \d received (\d+) bytes \(at least (\d+) needed\)",
                       r.stdout)
    assert len(steps) == 12 and all(a == b for a, b in steps), r.stdout
