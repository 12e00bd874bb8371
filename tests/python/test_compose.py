"""Transfer plans against DeepSpeed: shards DeepSpeed's partition code produces at TP a,
moved by reshard's plan to TP b, equal DeepSpeed's own shards at TP b bit for bit - for every
layout and pair of degrees the producer allows, in both directions. Maps come from `infer` on
marker tensors, so nothing here is written by hand."""

import functools
import itertools
import json
import subprocess

import pytest
import torch

import reshard
from ds_partitions import column_split, fused_qkv, index_maps, row_split, yuan
from maps import split_map
from torch_ref import to_bytes

TPS = [1, 2, 3, 4, 8]

LAYOUTS = {
    # name: (shape, partition(tp) or None where the producer refuses that degree)
    "column": ((48, 16), lambda tp: functools.partial(column_split, tp=tp)),
    "column_uneven": ((50, 8), lambda tp: functools.partial(column_split, tp=tp)),
    "row": ((16, 48), lambda tp: functools.partial(row_split, tp=tp)),
    "head_aligned": ((24, 8), lambda tp: functools.partial(column_split, tp=tp, num_kv_heads=3,
                                                           name="self_attn.k_proj")),
    "bigcode": ((32 + 16, 8), lambda tp: functools.partial(
        fused_qkv, tp=tp, module_name="GPTBigCodeBlock", n_embd=32, num_kv_heads=4,
        num_attention_heads=4)),
    "codegen": ((3 * 64, 8), lambda tp: functools.partial(
        fused_qkv, tp=tp, module_name="CodeGenBlock", num_kv_heads=16, n_embd=64)
        if 16 % (4 * tp) == 0 else None),
    "yuan_value": ((8 * 4, 8), lambda tp: functools.partial(yuan, tp=tp, num_heads=8, shard_value=True)
                   if 8 % tp == 0 and tp <= 4 else None),
    "yuan_oproj": ((8, 8 * 4), lambda tp: functools.partial(yuan, tp=tp, num_heads=8, shard_value=False)
                   if 8 % tp == 0 and tp <= 4 else None),
}


def cases():
    for name, (_shape, make) in LAYOUTS.items():
        for a, b in itertools.permutations(TPS, 2):
            if make(a) is not None and make(b) is not None:
                yield name, a, b


@pytest.mark.parametrize("layout,src_tp,dst_tp", list(cases()))
def test_plans_move_deepspeed_shards_between_degrees(layout, src_tp, dst_tp):
    shape, make = LAYOUTS[layout]
    src_part, dst_part = make(src_tp), make(dst_tp)
    src_map = reshard.infer(index_maps(shape, src_part))
    dst_map = reshard.infer(index_maps(shape, dst_part))
    full = torch.randn(shape, generator=torch.Generator().manual_seed(src_tp * 10 + dst_tp)).to(torch.bfloat16)
    plan = reshard.compose(source=src_map, target=dst_map)
    moved = reshard.transfer(plan, [s.reshape(src_map.shard_shape(r)) for r, s in enumerate(src_part(full))])
    want = dst_part(full)
    assert len(moved) == dst_tp
    for r in range(dst_tp):
        assert to_bytes(moved[r]) == to_bytes(want[r]), f"target rank {r}"
    # Bounded by the topologies and the block structure, never by size.
    assert len(plan.moves) <= 4 * max(src_tp, dst_tp) * max(src_tp, dst_tp)


def test_bigcode_tp2_to_tp4_takes_the_seven_moves_deepspeed_measured():
    # Target rank 3 reads the replicated key/value block from the source rank that sends its
    # query rows, right after them: one move, not two.
    shape, make = LAYOUTS["bigcode"]
    src_map = reshard.infer(index_maps(shape, make(2)))
    dst_map = reshard.infer(index_maps(shape, make(4)))
    assert len(reshard.compose(source=src_map, target=dst_map).moves) == 7


def test_move_counts_do_not_depend_on_size():
    def count(rows, cols, a, b):
        sa = split_map([rows, cols], 1, [cols // a] * a)
        sb = split_map([rows, cols], 1, [cols // b] * b)
        return len(reshard.compose(source=sa, target=sb).moves)
    assert count(16, 64, 8, 2) == count(128, 512, 8, 2) == 8


def run(reshard_bin, *args):
    return subprocess.run([reshard_bin, *map(str, args)], capture_output=True, text=True, timeout=120)


def test_compose_cli_writes_a_plan_and_summarises_it(reshard_bin, tmp_path):
    src = {"version": 1, "w": split_map([16, 4], 0, [4, 4, 4, 4]), "b": split_map([8], 0, [2, 2, 2, 2])}
    dst = {"version": 1, "w": split_map([16, 4], 0, [8, 8]), "b": split_map([8], 0, [4, 4])}
    (tmp_path / "src.json").write_text(json.dumps(src))
    (tmp_path / "dst.json").write_text(json.dumps(dst))
    r = run(reshard_bin, "compose", "--from", tmp_path / "src.json", "--to", tmp_path / "dst.json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["version"] == 1
    assert len(plan["params"]["w"]["moves"]) == 4
    assert plan["params"]["w"]["moves"][1] == {"src_rank": 1, "dst_rank": 0, "shape": [16],
                                               "src": [0, [1]], "dst": [16, [1]]}
    r = run(reshard_bin, "compose", "--from", tmp_path / "src.json", "--to", tmp_path / "dst.json",
            "-o", tmp_path / "plan.json", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["total_moves"] == 8
    assert [p["moves"] for p in summary["params"]] == [4, 4]
    assert json.loads((tmp_path / "plan.json").read_text()) == plan
    # The output exists now: never replaced without --force.
    r = run(reshard_bin, "compose", "--from", tmp_path / "src.json", "--to", tmp_path / "dst.json",
            "-o", tmp_path / "plan.json")
    assert r.returncode == 2 and "--force" in r.stderr


def test_compose_cli_refuses_mismatched_documents(reshard_bin, tmp_path):
    src = {"version": 1, "w": split_map([16, 4], 0, [8, 8])}
    dst = {"version": 1, "w": split_map([16, 4], 0, [16]), "extra": split_map([4], 0, [4])}
    (tmp_path / "src.json").write_text(json.dumps(src))
    (tmp_path / "dst.json").write_text(json.dumps(dst))
    r = run(reshard_bin, "compose", "--from", tmp_path / "src.json", "--to", tmp_path / "dst.json")
    assert r.returncode == 1 and '"extra"' in r.stderr
    dst = {"version": 1, "w": split_map([16, 5], 0, [16])}
    (tmp_path / "dst.json").write_text(json.dumps(dst))
    r = run(reshard_bin, "compose", "--from", tmp_path / "src.json", "--to", tmp_path / "dst.json")
    assert r.returncode == 1 and "different tensors" in r.stderr
    (tmp_path / "dst.json").write_text("{")
    r = run(reshard_bin, "compose", "--from", tmp_path / "src.json", "--to", tmp_path / "dst.json")
    assert r.returncode == 2
