"""`reshard infer` against DeepSpeed's real partition code: run it on marker tensors at
several sizes and TP degrees, infer the map, rebuild from shards of independent random data
produced by the same code, and compare bit for bit. Also the committed index maps from
DeepSpeed (tests/data/deepspeed)."""

import functools
import json
import pathlib

import pytest
import torch

import reshard
from ds_partitions import column_split, fused_qkv, index_maps, row_split, yuan
from torch_ref import to_bytes

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "deepspeed"


def pieces_per_rank(m):
    return [len(m["ranks"][str(r)]["pieces"]) for r in range(len(m["ranks"]))]


def infer_and_rebuild(shape, partition, dtype=torch.bfloat16, seed=0):
    """Infers the map from the marker, then rebuilds random data's shards with it."""
    pm = reshard.infer(index_maps(shape, partition))
    full = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    shards = partition(full)
    for r, s in enumerate(shards):
        assert to_bytes(reshard.extract(pm, full, r)) == to_bytes(s), f"rank {r}"
    rebuilt = reshard.rebuild(pm, [s.reshape(pm.shard_shape(r)) for r, s in enumerate(shards)])
    assert to_bytes(rebuilt) == to_bytes(full)
    return pm.to_dict()


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("rows", [16, 24, 40, 100])
def test_column_and_row_splits_are_one_piece_per_rank(tp, rows):
    m = infer_and_rebuild((rows, 12), functools.partial(column_split, tp=tp))
    assert all(n <= 1 for n in pieces_per_rank(m))
    m = infer_and_rebuild((12, rows), functools.partial(row_split, tp=tp))
    assert pieces_per_rank(m) == [1] * tp


@pytest.mark.parametrize("tp,kv_heads", [(2, 4), (4, 3), (3, 8), (8, 2)])
def test_head_aligned_splits(tp, kv_heads):
    m = infer_and_rebuild((kv_heads * 8, 16), functools.partial(column_split, tp=tp,
                                                                num_kv_heads=kv_heads,
                                                                name="self_attn.k_proj"))
    assert all(n <= 1 for n in pieces_per_rank(m))


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_grain_aligned_splits(tp):
    m = infer_and_rebuild((200, 8), functools.partial(column_split, tp=tp, grain=32,
                                                      name="mlp.up_proj"))
    assert all(n <= 1 for n in pieces_per_rank(m))


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("n_embd", [32, 64, 256])
def test_bigcode_is_query_rows_plus_shared_key_value_block(tp, n_embd):
    head_dim = 8
    shape = (n_embd + 2 * head_dim, 16)
    part = functools.partial(fused_qkv, tp=tp, module_name="GPTBigCodeBlock", n_embd=n_embd,
                             num_kv_heads=4, num_attention_heads=4)
    m = infer_and_rebuild(shape, part)
    assert pieces_per_rank(m) == [1 if tp == 1 else 2] * tp
    if tp > 1:
        kv = m["ranks"]["0"]["pieces"][1]
        assert kv["locations"] == list(range(tp))
        assert kv["source"][0] == n_embd * 16


# DeepSpeed's CodeGen partition needs hidden % (4 * tp) == 0.
@pytest.mark.parametrize("tp,hidden", [(tp, h) for tp in (1, 2, 4) for h in (8, 16, 32, 64, 128)
                                       if h % (4 * tp) == 0])
def test_codegen_is_one_piece_per_rank_at_every_hidden_size(tp, hidden):
    shape = (3 * hidden, 8)
    # DeepSpeed asserts num_kv_heads % (tp * codegen_mp_num) == 0.
    part = functools.partial(fused_qkv, tp=tp, module_name="CodeGenBlock", num_kv_heads=16,
                             n_embd=hidden, num_attention_heads=16)
    m = infer_and_rebuild(shape, part)
    assert pieces_per_rank(m) == [1] * tp, json.dumps(m)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [4, 8, 64])
def test_yuan_value_and_o_proj_are_one_piece_per_rank_at_even_heads(tp, head_dim):
    heads = 8
    m = infer_and_rebuild((heads * head_dim, 16),
                          functools.partial(yuan, tp=tp, num_heads=heads, shard_value=True))
    assert pieces_per_rank(m) == [1] * tp
    m = infer_and_rebuild((16, heads * head_dim),
                          functools.partial(yuan, tp=tp, num_heads=heads, shard_value=False))
    assert pieces_per_rank(m) == [1] * tp


@pytest.mark.parametrize("tp", [2, 4])
def test_other_fused_layouts_rebuild(tp):
    # bloom (one split), glm/qwen (q, k, v split separately), phi3 (q, k, v of other widths)
    infer_and_rebuild((48, 8), functools.partial(fused_qkv, tp=tp, module_name="BloomBlock"))
    infer_and_rebuild((48, 8), functools.partial(fused_qkv, tp=tp, module_name="GLMBlock",
                                                 num_kv_heads=8))
    infer_and_rebuild((32 + 2 * 8, 32), functools.partial(fused_qkv, tp=tp,
                                                          module_name="Phi3DecoderLayer",
                                                          num_kv_heads=2, num_attention_heads=8))


@pytest.mark.parametrize("path", sorted(DATA.glob("*.json")), ids=lambda p: p.name)
def test_committed_deepspeed_index_maps_rebuild_bit_exactly(path):
    observed = json.loads(path.read_text())
    m = reshard.infer(path.read_text())
    shape = observed["logical_shape"]
    n = 1
    for d in shape:
        n *= d
    full = torch.randn(n, generator=torch.Generator().manual_seed(1), dtype=torch.float32)
    shards = []
    for r in observed["ranks"]:
        shard = full[torch.tensor(r["index_map"], dtype=torch.int64)]
        scale = r.get("scale", 1.0)
        if not isinstance(scale, list) and scale != 1.0:
            shard = shard * scale
        shards.append(shard)
        assert to_bytes(reshard.extract(m, full.view(shape), r["rank"])) == to_bytes(shard)
    shards = [s.view(m.shard_shape(r)) for r, s in enumerate(shards)]
    assert to_bytes(reshard.rebuild(m, shards)) == to_bytes(full)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_pre_divided_bias_is_replicated_at_one_over_tp(tp):
    # LinearAllreduce keeps the whole bias on every rank, divided by the world size.
    bias = torch.randn(24, generator=torch.Generator().manual_seed(tp))
    doc = {"logical_shape": [24],
           "ranks": [{"rank": r, "shard_shape": [24], "index_map": list(range(24)), "scale": 1.0 / tp}
                     for r in range(tp)]}
    pm = reshard.infer(doc)
    m = pm.to_dict()
    assert pieces_per_rank(m) == [1] * tp
    piece = m["ranks"]["1"]["pieces"][0]
    assert piece["locations"] == list(range(tp)) and piece["scale"] == 1.0 / tp
    shards = [bias / float(tp) for _ in range(tp)]  # as DeepSpeed divides it
    assert torch.equal(reshard.rebuild(pm, shards), bias)


def test_infer_is_deterministic_and_canonical():
    doc = json.dumps(index_maps((24, 8), functools.partial(fused_qkv, tp=2, module_name="CodeGenBlock",
                                                           num_kv_heads=8, n_embd=8)))
    first = reshard.infer(doc)
    assert reshard.infer(doc).to_json() == first.to_json()
    assert first.canonical().to_json() == first.to_json()
