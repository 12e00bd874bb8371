"""Redistributor.verify between live processes: one torchrun launch of 4 processes (gloo on the
CPU) runs every case in verify_worker.py. A re-sharding verified as it landed passes on every
process; one element changed behind the re-sharding's back (in a target shard, or in a source
shard after the run) raises on every process, naming the tensor, the target process and the
element, which must be the element changed (checked against the full-tensor index that the
same maps give an index marker). Padding is not data: garbage in it passes. Replicas, scaled
pieces, buffers and FP8 targets quantized at the source are checked too."""

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
    d, m = tmp / "descriptor.json", tmp / "map.json"
    d.write_text(json.dumps(descriptor))
    subprocess.run([reshard_bin, "layout", d, "--shape", ",".join(map(str, shape)), "--world",
                    str(world), "-o", m, "--force"], check=True, capture_output=True)
    return json.loads(m.read_text())


def cases(reshard_bin, tmp):
    rows_to_cols = {"w": {"source": split_map([8, 12], 0, [4, 4]),
                          "target": split_map([8, 12], 1, [6, 6])},
                    "v": {"source": split_map([6, 4, 5], 0, [3, 3]),
                          "target": split_map([6, 4, 5], 2, [2, 3]), "dtype": "bfloat16"},
                    "i": {"source": split_map([5, 3], 0, [2, 3]),
                          "target": split_map([5, 3], 0, [4, 1]), "dtype": "int64"}}
    # Every target process holds the norm whole; the sources hold it twice.
    replicas = {"norm": {"source": replicated_map([64], 2), "target": replicated_map([64], 4),
                         "dtype": "bfloat16"},
                "w": {"source": split_map([16, 8], 0, [8, 8]),
                      "target": split_map([16, 8], 0, [2, 6, 4, 4])}}
    vocab = {"family": "padded_vocab", "dim": 0}
    padded = {"emb": {"source": layout(reshard_bin, tmp, vocab, [13, 64], 2),
                      "target": layout(reshard_bin, tmp, vocab, [13, 64], 4)}}
    bias = {"family": "replicated", "pre_divided": True}
    scaled = {"bias": {"source": layout(reshard_bin, tmp, bias, [16], 4),
                       "target": layout(reshard_bin, tmp, bias, [16], 2)}}
    gate_up = [("experts.{e}.gate_proj.weight", [4, 3]), ("experts.{e}.up_proj.weight", [4, 3])]
    ep_src, _ = stacked_expert_maps([[0, 1, 2], [3, 4, 5]], gate_up)
    ep_dst, _ = stacked_expert_maps([[0, 2, 4], [1, 3, 5]], gate_up, tp=2)
    experts = {n: {"source": ep_src[n], "target": ep_dst[n]} for n in ep_src}
    # bf16 rows split 40 / 24 (a 32-row block split between the sources) -> FP8 column halves.
    fp8 = {"w": {"source": split_map([64, 64], 0, [40, 24]),
                 "target": split_map([64, 64], 1, [32, 32]), "dtype": "bfloat16"},
           "n": {"source": replicated_map([64], 2), "target": replicated_map([64], 2),
                 "dtype": "bfloat16"}}
    fp8_case = {"params": fp8, "source_ranks": [0, 1], "target_ranks": [2, 3], "seed": 7,
                "target_only": {"w_scale_inv": split_map([2, 2], 1, [1, 1])},
                "quantize": {"w": {"scale": "w_scale_inv", "block": [32, 32]}}}
    # The AdamW model's tensors: rows over the sources, columns (or halves) over the targets.
    adamw = {"up.weight": {"source": split_map([128, 64], 0, [64, 64]),
                           "target": split_map([128, 64], 1, [32, 32])},
             "up.bias": {"source": replicated_map([128], 2),
                         "target": split_map([128], 0, [64, 64])},
             "down.weight": {"source": split_map([64, 128], 0, [32, 32]),
                             "target": split_map([64, 128], 1, [96, 32])},
             "down.bias": {"source": split_map([64], 0, [40, 24]),
                           "target": replicated_map([64], 2)}}
    everyone = [0, 1, 2, 3]
    return [
        {"name": "rows_to_columns", "params": rows_to_cols, "source_ranks": [0, 1],
         "target_ranks": [2, 3], "seed": 1},
        {"name": "rows_to_columns_explicit", "params": rows_to_cols, "source_ranks": [0, 1],
         "target_ranks": [2, 3], "seed": 1, "explicit": True},
        {"name": "target_element_altered", "params": rows_to_cols, "source_ranks": [0, 1],
         "target_ranks": [2, 3], "seed": 1,
         "alter": {"side": "target", "process": 3, "param": "v", "flat": 37}},
        {"name": "int_element_altered_overlapping", "params": rows_to_cols,
         "source_ranks": [0, 1], "target_ranks": [1, 0], "seed": 2,
         "alter": {"side": "target", "process": 1, "param": "i", "flat": 10}},
        {"name": "source_changed_after_the_run", "params": rows_to_cols, "source_ranks": [0, 1],
         "target_ranks": [2, 3], "seed": 3,
         "alter": {"side": "source", "process": 1, "param": "w", "flat": 5}},
        {"name": "replicas", "params": replicas, "source_ranks": [0, 1],
         "target_ranks": everyone, "seed": 4},
        {"name": "one_target_replica_altered", "params": replicas, "source_ranks": [0, 1],
         "target_ranks": everyone, "seed": 4,
         "alter": {"side": "target", "process": 2, "param": "norm", "flat": 63}},
        {"name": "padding_garbage_passes", "params": padded, "source_ranks": [0, 1],
         "target_ranks": everyone, "seed": 5,  # target rank 3: row 12, then 3 rows of padding
         "alter": {"side": "target", "process": 3, "param": "emb", "flat": 100}},
        {"name": "padded_row_altered", "params": padded, "source_ranks": [0, 1],
         "target_ranks": everyone, "seed": 5,
         "alter": {"side": "target", "process": 3, "param": "emb", "flat": 63}},
        {"name": "scaled_pieces", "params": scaled, "source_ranks": everyone,
         "target_ranks": [1, 2], "seed": 6},
        {"name": "buffer_altered", "params": experts, "source_ranks": [2, 3],
         "target_ranks": [0, 2, 1, 3], "seed": 9,
         "alter": {"side": "target", "process": 1, "param": "experts.gate_up_proj",
                   "flat": 20}},
        {"name": "fp8", **fp8_case},
        {"name": "fp8_delta", **fp8_case, "delta_after": [[5, 7], [40, 50]]},
        {"name": "fp8_data_altered", **fp8_case,
         "alter": {"side": "target", "process": 3, "param": "w", "flat": 64 * 32 - 1}},
        {"name": "fp8_scale_altered", **fp8_case,
         "alter": {"side": "target", "process": 2, "param": "w_scale_inv", "flat": 1}},
        {"name": "delta_adamw", "delta": True, "steps": 10, "lr": 1e-5, "seed": 11,
         "params": adamw, "source_ranks": [0, 1], "target_ranks": [2, 3]},
        {"name": "delta_adamw_overlapping_copy_lost", "delta": True, "steps": 6, "lr": 1e-4,
         "seed": 12, "params": adamw, "source_ranks": [0, 1], "target_ranks": [1, 2],
         "lose_copy_at": 4, "lose_copy_on": 2},
        {"name": "after_errors", "params": rows_to_cols, "source_ranks": [0, 1],
         "target_ranks": [2, 3], "seed": 8},
    ]


@pytest.fixture(scope="module")
def launch(tmp_path_factory, reshard_bin):
    tmp = tmp_path_factory.mktemp("verify")
    all_cases = cases(reshard_bin, tmp)
    (tmp / "cases.json").write_text(json.dumps(all_cases))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BUILD / "python"), str(HERE)]),
               OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
                        "--master_addr", "127.0.0.1", "--master_port", str(free_loopback_port()),
                        str(HERE / "verify_worker.py"), str(tmp / "cases.json"),
                        str(tmp / "out")], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    got = {case["name"]: (case, [json.loads((tmp / "out" / case["name"] / f"rank-{p}.json")
                                            .read_text()) for p in range(4)])
           for case in all_cases}
    got[" threads at exit"] = [json.loads((tmp / "out" / "exit" / f"rank-{p}.json").read_text())
                               for p in range(4)]
    return got


PASSING = {  # name: (tensor, target process) pairs compared
    "rows_to_columns": 6, "rows_to_columns_explicit": 6, "replicas": 8,
    "padding_garbage_passes": 4, "scaled_pieces": 2, "fp8": 6, "fp8_delta": 6,
    "after_errors": 6}



@pytest.mark.parametrize("name", sorted(PASSING))
def test_what_landed_verifies_on_every_process(launch, name):
    _, ranks = launch[name]
    for p, r in enumerate(ranks):
        assert r["error"] is None, (p, r["error"], r.get("traceback"))
        assert r["checked"] == PASSING[name], (p, r["checked"])


def named_element(error):
    """(tensor, target process, flat index in its shard, index in F or None) of an error."""
    m = re.search(r'"([^"]+)" on target process (\d+) \(target rank \d+[^)]*\): first differing '
                  r'element \[[\d, ]+\] of its shard \(flat (\d+)\)(, element \[([\d, ]+)\] of '
                  r'the tensor)?', error)
    assert m, error
    at = [int(v) for v in m.group(5).split(", ")] if m.group(5) else None
    return m.group(1), int(m.group(2)), int(m.group(3)), at


def unravel(flat, shape):
    out = []
    for n in reversed(shape):
        out.append(flat % n)
        flat //= n
    return out[::-1]


ALTERED = ["target_element_altered", "int_element_altered_overlapping", "one_target_replica_altered",
           "padded_row_altered", "buffer_altered", "fp8_data_altered", "fp8_scale_altered"]


@pytest.mark.parametrize("name", ALTERED)
def test_an_altered_target_element_is_named_on_every_process(launch, name):
    case, ranks = launch[name]
    alter = case["alter"]
    errors = [r["error"] for r in ranks]
    assert all(e is not None and e.startswith("RedistributeError") for e in errors), errors
    assert len(set(errors)) == 1, errors  # every process raises the same
    tensor, process, flat, at = named_element(errors[0])
    assert process == alter["process"] and flat == alter["flat"], errors[0]
    indices = ranks[alter["process"]]["indices"]
    if alter["param"] in case["params"] or alter["param"] in case.get("target_only", {}):
        assert tensor == alter["param"]
        shape = (case["params"].get(tensor) or {}).get("target", {}).get("logical_shape") or \
            case["target_only"][tensor]["logical_shape"]
        assert at == unravel(indices[flat], shape), (at, indices[flat])
    else:  # a buffer: the tensor named is the one whose element lies there
        assert tensor.startswith("experts.") and "in buffer \"experts.gate_up_proj\"" in errors[0]
    assert "1 more" not in errors[0] and "more (tensor" not in errors[0]


def test_a_source_changed_after_the_run_is_found_at_its_target(launch):
    case, ranks = launch["source_changed_after_the_run"]
    errors = [r["error"] for r in ranks]
    assert all(e is not None for e in errors) and len(set(errors)) == 1, errors
    tensor, process, flat, at = named_element(errors[0])
    # Source rank 1 holds rows 4-7 of w [8, 12]: its flat 5 is w[4, 5], which target rank 0
    # (process 2, columns 0-5) holds at row 4, column 5.
    assert (tensor, process, at, flat) == ("w", 2, [4, 5], 4 * 6 + 5), errors[0]


def test_fp8_target_error_shows_the_bits_held(launch):
    _, ranks = launch["fp8_data_altered"]
    assert re.search(r"holds 0x[0-9a-f]{2}\b", ranks[0]["error"]), ranks[0]["error"]


def test_delta_pushes_equal_full_pushes_after_every_adamw_step(launch):
    """Ten AdamW steps (bf16 weights from fp32 masters): after every delta push each target
    shard is bit-equal to a full push's, and verify passes; the first push sends whole chunks,
    the others only what changed, in fewer bytes."""
    case, ranks = launch["delta_adamw"]
    for p, r in enumerate(ranks):
        assert r["error"] is None, (p, r["error"], r.get("traceback"))
        assert len(r["steps"]) == case["steps"]
        for step, s in enumerate(r["steps"]):
            assert s["equal"] and s["verified"] == 8, (p, step, s)
            assert s["stats"]["delta"] == (step > 0), (p, step, s["stats"])
    sent = [sum(r["steps"][step]["stats"]["sent"] for r in ranks) for step in range(10)]
    changed = [ranks[0]["steps"][step]["changed"] for step in range(1, 10)]
    print("changed per step:", [f"{100 * c:.2f}%" for c in changed], "bytes sent:", sent)
    assert all(0 < c < 1 for c in changed), changed
    # Words compared as travelled: what changed is what the targets lacked, no more.
    for step in range(1, 10):
        words = sum(r["steps"][step]["stats"]["words"] for r in ranks)
        moved = sum(r["steps"][step]["stats"]["changed_words"] for r in ranks)
        assert moved <= words and sent[step] < sent[0], (step, moved, words, sent)


def test_a_process_without_the_last_chunks_makes_the_next_push_whole(launch):
    """Process 2 lost its copy of the chunks before step 4: that push sends whole chunks on
    every process (never a delta against a state one process lacks), the next is a delta
    again, and every target is bit-equal to a full push throughout."""
    case, ranks = launch["delta_adamw_overlapping_copy_lost"]
    for p, r in enumerate(ranks):
        assert r["error"] is None, (p, r["error"], r.get("traceback"))
        kinds = [s["stats"]["delta"] for s in r["steps"]]
        assert kinds == [False, True, True, True, False, True], (p, kinds)
        assert all(s["equal"] and s["verified"] == 8 for s in r["steps"]), p


def test_fp8_delta_sends_only_the_changed_blocks_bytes(launch):
    """Into FP8 targets quantized at the source: after one element of the bf16 weight changes,
    a delta run leaves the targets equal to the block quantization of the whole new weight and
    sends a small part of what the first (whole) run sent: the changed block's FP8 bytes and
    its scale (each block quantized again at its owner; unchanged blocks give the same bytes)."""
    _, ranks = launch["fp8_delta"]
    for p, r in enumerate(ranks):
        assert r["error"] is None, (p, r["error"], r.get("traceback"))
        assert [s["equal"] for s in r["delta"]] == [True] * 3, (p, r["delta"])
        assert [s["delta"] for s in r["delta"]] == [False, True, True], (p, r["delta"])
    sent = [sum(r["delta"][k]["sent"] for r in ranks) for k in range(3)]
    assert 0 < sent[1] < sent[0] // 2 and 0 < sent[2] < sent[0] // 2, sent


def test_no_gloo_thread_is_left_when_the_interpreter_finalizes(launch):
    """The AdamW cases import torch.distributed.nn.functional after init_process_group, which
    keeps the destroyed group alive; reshard's exit handler frees it, so its gloo threads are
    joined before the interpreter finalizes (where one letting go of a tensor would abort)."""
    for p, names in enumerate(launch[" threads at exit"]):
        assert not [n for n in names if "gloo" in n], (p, names)
