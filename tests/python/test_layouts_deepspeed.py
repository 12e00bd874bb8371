"""Layout descriptors and the lowering of DeepSpeed's metadata, against DeepSpeed itself.

Every family is laid out by `reshard layout` at TP 1, 2, 3, 4 and 8 (where the producer
allows the degree) and checked three ways: the shards our map extracts from random data
equal, bit for bit, the shards DeepSpeed's own partition code cuts; the map equals, byte for
byte, the map `reshard.infer` derives from DeepSpeed's shards of a marker tensor; and it
equals the map DeepSpeed's `deepspeed.checkpoint.affine` builder describes for the layout.
The metadata lowering is checked on the metadata real AutoTP layers attach to their
parameters, and on DeepSpeed's universal-checkpoint restore of the legacy categories."""

import functools
import json
import logging
import math
import subprocess
import types

import pytest
import torch

logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
import deepspeed.checkpoint.affine as affine  # noqa: E402
import deepspeed.module_inject.layers as ds_layers  # noqa: E402
from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META  # noqa: E402
from deepspeed.checkpoint.universal_checkpoint import (  # noqa: E402
    _resolve_autotp_partition, load_hp_checkpoint_state)
from deepspeed.module_inject.fusedqkv_utils import (  # noqa: E402
    codegen_block_layout, shared_qk_value_head_ids)
from deepspeed.module_inject.tp_shard import AutoTPMeta, get_shard_size_list  # noqa: E402

import reshard  # noqa: E402
from ds_partitions import (_NamedModule, column_split, conv2d, ds_layer, fused_qkv,  # noqa: E402
                           index_maps, row_split, subparam_split, yuan)
from torch_ref import to_bytes  # noqa: E402

TPS = [1, 2, 3, 4, 8]


@pytest.fixture
def layout(reshard_bin, tmp_path):
    """`reshard layout DESCRIPTOR --shape --world`: the map's JSON text."""
    def run(descriptor, shape, world, expect=0):
        path = tmp_path / "descriptor.json"
        path.write_text(json.dumps(descriptor))
        r = subprocess.run([reshard_bin, "layout", str(path), "--shape", ",".join(map(str, shape)),
                            "--world", str(world)], capture_output=True, text=True)
        assert r.returncode == expect, f"{descriptor} at {world}: {r.stderr}"
        return r.stdout if expect == 0 else r.stderr
    return run


@pytest.fixture
def from_deepspeed(reshard_bin, tmp_path):
    """`reshard layout --from-deepspeed META --world`: (exit status, stdout, stderr)."""
    def run(meta, world):
        path = tmp_path / "meta.json"
        path.write_text(json.dumps(meta))
        r = subprocess.run([reshard_bin, "layout", "--from-deepspeed", str(path), "--world", str(world)],
                           capture_output=True, text=True)
        return r.returncode, r.stdout, r.stderr
    return run


def random_full(shape, dtype=torch.bfloat16, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def check_shards(map_text, full, shards):
    """Our map's extraction of `full` equals DeepSpeed's shards, bit for bit."""
    pm = reshard.ParamMap.from_json(map_text)
    assert pm.world_size == len(shards)
    for r, shard in enumerate(shards):
        ours = reshard.extract(pm, full, r)
        assert to_bytes(ours) == to_bytes(shard), f"rank {r} differs from DeepSpeed's shard"


def check_family(map_text, shape, partition, ds_map=None, valid_shape=None):
    """Bit-exact shards, the same canonical map as inference on DeepSpeed's marker shards,
    and (when DeepSpeed has a builder for the layout) the same map as the builder's."""
    full = random_full(shape)
    check_shards(map_text, full, partition(full))
    observed = index_maps(shape, partition)
    if valid_shape is not None:
        observed["valid_shape"] = list(valid_shape)
    assert reshard.infer(observed).to_json() == map_text
    if ds_map is not None:
        assert reshard.ParamMap.from_json(ds_json(ds_map.to_dict())).canonical().to_json() == map_text


def ds_json(ds_dict):
    """A DeepSpeed map's JSON without its zero-element pieces: its builders emit one for a
    rank that holds nothing, with shard strides our validator refuses (a zero stride on an
    extent > 1); a piece of no elements says nothing either way."""
    ranks = {str(r): {**v, "pieces": [p for p in v["pieces"] if math.prod(p["shape"]) > 0]}
             for r, v in ds_dict["ranks"].items()}
    return json.dumps({**ds_dict, "ranks": ranks})


def near_even(n, tp):
    return [n // tp + (1 if r < n % tp else 0) for r in range(tp)]


# --- replicated ---------------------------------------------------------------------------

@pytest.mark.parametrize("tp", TPS)
def test_replicated_and_pre_divided_bias_match_deepspeeds_conv2d(tp, layout):
    # TensorParallelIcShardConv2d keeps its bias whole on every rank, divided by the world size.
    weight = random_full((6, 10, 3, 3), torch.float32)
    bias = random_full((6,), torch.float32, seed=1)
    _, biases = conv2d(weight, tp, shard_by_oc=False, bias=bias)
    m = layout({"family": "replicated", "pre_divided": True}, [6], tp)
    if tp & (tp - 1) == 0:
        check_shards(m, bias, biases)
    else:
        # DeepSpeed divides by 3; a map holds the scale 1/3, which is not exact in binary, so
        # the two roundings may differ in the last bit (DESIGN 2.1 P3): equal to within 1 ulp.
        for r, shard in enumerate(biases):
            ours = reshard.extract(reshard.ParamMap.from_json(m), bias, r, allow_lossy_scale=True)
            assert torch.equal(ours.view(torch.int32).sub(shard.view(torch.int32)).abs() <= 1,
                               torch.ones(6, dtype=torch.bool)), f"rank {r}"
    assert reshard.ParamMap.from_dict(affine.replicated_map((6,), tp, scale=1.0 / tp).to_dict()).canonical().to_json() == m
    m = layout({"family": "replicated"}, [6, 4], tp)
    check_family(m, (6, 4), lambda full: [full] * tp, affine.replicated_map((6, 4), tp))


# --- split ----------------------------------------------------------------------------------

SPLITS = [
    # (shape, DeepSpeed's AutoTPMeta fields and layer name, descriptor)
    ((40, 12), dict(name="self_attn.q_proj"), {"family": "split", "dim": 0}),
    ((24, 12), dict(num_kv_heads=3, name="self_attn.k_proj"), {"family": "split", "dim": 0, "heads": 3}),
    ((64, 12), dict(num_kv_heads=8, name="self_attn.q_proj"), {"family": "split", "dim": 0, "heads": 8}),
    ((200, 8), dict(grain=32, name="mlp.up_proj"), {"family": "split", "dim": 0, "grain": 32}),
    ((13, 8), dict(grain=32, name="mlp.up_proj"), {"family": "split", "dim": 0, "grain": 32}),
]


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("shape,fields,descriptor", SPLITS, ids=lambda v: json.dumps(v) if isinstance(v, dict) else None)
def test_front_loaded_split_matches_deepspeeds_linear_layers(tp, shape, fields, descriptor, layout):
    fields = dict(fields)
    name = fields.pop("name")
    meta = AutoTPMeta(num_kv_heads=fields.get("num_kv_heads"), tp_grain_size=fields.get("grain", 1))
    sizes = get_shard_size_list(shape[0], tp, meta, name)
    m = layout(descriptor, shape, tp)
    check_family(m, shape, functools.partial(column_split, tp=tp, name=name, **fields),
                 affine.contiguous_split_map(shape, sizes, 0))
    # The same rule along the input dimension (LinearAllreduce).
    rows = (shape[1], shape[0])
    m = layout({**descriptor, "dim": 1}, rows, tp)
    check_family(m, rows, functools.partial(row_split, tp=tp, name=name, **fields),
                 affine.contiguous_split_map(rows, sizes, 1))


def test_heads_fewer_than_ranks_leave_ranks_empty(layout):
    m = json.loads(layout({"family": "split", "dim": 0, "heads": 3}, [24, 12], 4))
    assert [m["ranks"][str(r)]["shard_shape"][0] for r in range(4)] == [8, 8, 8, 0]


@pytest.mark.parametrize("tp", TPS)
def test_back_loaded_split_matches_deepspeeds_conv2d(tp, layout):
    oc = random_full((10, 6, 3, 3))
    m = layout({"family": "split", "dim": 0, "remainder": "back"}, oc.shape, tp)
    check_family(m, tuple(oc.shape), lambda full: conv2d(full, tp, shard_by_oc=True)[0])
    ic = random_full((6, 10, 3, 3))
    m = layout({"family": "split", "dim": 1, "remainder": "back"}, ic.shape, tp)
    check_family(m, tuple(ic.shape), lambda full: conv2d(full, tp, shard_by_oc=False)[0])


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("rows", [5, 10, 24])
def test_ceil_split_matches_torch_chunk_with_a_short_or_empty_last_rank(tp, rows, layout):
    def chunk(full):
        parts = list(full.chunk(tp, dim=0))
        return parts + [full[:0]] * (tp - len(parts))
    m = layout({"family": "split", "dim": 0, "remainder": "ceil"}, [rows, 3], tp)
    check_family(m, (rows, 3), chunk)


def test_exact_split_refuses_a_world_that_does_not_divide(layout):
    err = layout({"family": "split", "dim": 0, "remainder": "exact"}, [10, 3], 4, expect=1)
    assert "10 indices cannot be split evenly over 4 ranks" in err


# --- fused and segmented --------------------------------------------------------------------

@pytest.mark.parametrize("tp", TPS)
def test_fused_qkv_with_narrow_key_value_matches_phi3_and_glm(tp, layout):
    # Phi-3: q 32 rows, k and v 8 rows each, every part aligned to the 2 key/value heads.
    shape = (48, 32)
    meta = AutoTPMeta(num_kv_heads=2, num_attention_heads=8)
    widths = [get_shard_size_list(s, tp, meta) for s in (32, 8, 8)]
    m = layout({"family": "fused", "dim": 0, "parts": [{"size": 32}, {"size": 8}, {"size": 8}], "heads": 2},
               shape, tp)
    check_family(m, shape, functools.partial(fused_qkv, tp=tp, module_name="Phi3DecoderLayer",
                                             num_kv_heads=2, num_attention_heads=8),
                 affine.sub_param_map(shape, [32, 8, 8], widths, 0))
    # GLM: three equal thirds, each split by its 8 heads.
    m = layout({"family": "fused", "dim": 0, "parts": 3, "heads": 8}, (48, 8), tp)
    widths = [get_shard_size_list(16, tp, AutoTPMeta(num_kv_heads=8))] * 3
    check_family(m, (48, 8), functools.partial(fused_qkv, tp=tp, module_name="GLMBlock", num_kv_heads=8),
                 affine.sub_param_map((48, 8), [16, 16, 16], widths, 0))


@pytest.mark.parametrize("tp", TPS)
def test_packed_gate_up_matches_deepspeeds_sub_parameter_split(tp, layout):
    shape = (100, 8)
    shards, widths = subparam_split(random_full(shape), tp, (50, 50), name="mlp", tp_grain_size=8)
    m = layout({"family": "fused", "dim": 0, "parts": 2, "grain": 8}, shape, tp)
    check_family(m, shape, lambda full: subparam_split(full, tp, (50, 50), name="mlp", tp_grain_size=8)[0],
                 affine.sub_param_map(shape, [50, 50], widths, 0))
    assert len(shards) == tp


@pytest.mark.parametrize("tp", TPS)
def test_multi_query_segments_match_gpt_bigcode(tp, layout):
    n_embd, head_dim = 32, 8
    shape = (n_embd + 2 * head_dim, 16)
    qwidths = get_shard_size_list(n_embd, tp, AutoTPMeta(num_kv_heads=4))
    m = layout({"family": "segmented", "dim": 0,
                "parts": [{"size": n_embd, "heads": 4}, {"size": 2 * head_dim, "replicated": True}]}, shape, tp)
    check_family(m, shape, functools.partial(fused_qkv, tp=tp, module_name="GPTBigCodeBlock", n_embd=n_embd,
                                             num_kv_heads=4, num_attention_heads=4),
                 affine.segmented_map(shape, [(n_embd, False), (2 * head_dim, True)], 0, tp, [qwidths]))


# --- block gather (Yuan) and CodeGen --------------------------------------------------------

YUAN = [(8, 1), (8, 2), (8, 4), (12, 3), (6, 2), (12, 4), (24, 8)]  # (heads, tp); the last 3: odd heads per rank


@pytest.mark.parametrize("heads,tp", YUAN)
def test_shared_qk_block_gather_matches_yuan(heads, tp, layout):
    head_dim = 4
    ids = {r: shared_qk_value_head_ids(heads, tp, r) for r in range(tp)}
    odd = (heads // tp) % 2 == 1
    for dim, shape, shard_value in ((0, (heads * head_dim, 6), True), (1, (6, heads * head_dim), False)):
        m = layout({"family": "block_gather", "dim": dim, "pairing": "shared_qk", "heads": heads}, shape, tp)
        ds_map = None if odd else affine.block_gather_map(shape, ids, head_dim, dim)
        check_family(m, shape, functools.partial(yuan, tp=tp, num_heads=heads, shard_value=shard_value), ds_map)
        if odd:
            # A head paired across two ranks is held by both: replicated, never owned by one.
            shared = [p for p in json.loads(m)["ranks"]["0"]["pieces"] if len(p["locations"]) == 2]
            assert shared, m


@pytest.mark.parametrize("heads,tp", [(8, 3), (8, 8)])
def test_shared_qk_refuses_degrees_yuan_cannot_take(heads, tp, layout):
    with pytest.raises((AssertionError, RuntimeError)):
        yuan(random_full((heads * 4, 2)), tp, heads, True)
    err = layout({"family": "block_gather", "dim": 0, "pairing": "shared_qk", "heads": heads}, [heads * 4, 2],
                 tp, expect=1)
    assert f"{heads} heads" in err


@pytest.mark.parametrize("tp", TPS)
def test_codegen_interleave_matches_deepspeed(tp, layout):
    heads, hidden = 96, 96
    shape = (3 * hidden, 4)
    m = layout({"family": "codegen_qkv", "dim": 0, "heads": heads}, shape, tp)
    ds_map = None
    if tp > 1:
        block, ids = codegen_block_layout(shape[0], tp, heads)
        ds_map = affine.block_gather_map(shape, ids, block, 0)
    check_family(m, shape, functools.partial(fused_qkv, tp=tp, module_name="CodeGenBlock", num_kv_heads=heads,
                                             n_embd=hidden, num_attention_heads=heads), ds_map)
    if 4 % tp == 0:
        assert all(len(r["pieces"]) == 1 for r in json.loads(m)["ranks"].values())


def test_codegen_refuses_heads_that_do_not_divide(layout):
    err = layout({"family": "codegen_qkv", "dim": 0, "heads": 16}, [96, 4], 8, expect=1)
    assert "16 heads do not split over 8 ranks" in err


# --- padded vocabulary (DeepSpeed's universal-checkpoint restore) ---------------------------

def ds_restore(tmp_path, ckpt, shard_shape, tp, rank):
    """DeepSpeed's `load_hp_checkpoint_state` restoring rank `rank`'s slice from a universal
    checkpoint entry `ckpt` (the dict it stores as fp32.pt)."""
    folder = tmp_path / f"restore-{tp}-{rank}"
    folder.mkdir()
    torch.save(ckpt, folder / "fp32.pt")
    n = math.prod(shard_shape)
    dst = torch.zeros(n, dtype=ckpt["param"].dtype)
    mapping = types.SimpleNamespace(optim_fragment={}, get_hp_fragment=lambda: dst,
                                    lp_fragment_address=types.SimpleNamespace(start=0, numel=n))
    param = types.SimpleNamespace(_hp_mapping=mapping, shape=torch.Size(shard_shape), numel=lambda: n)
    load_hp_checkpoint_state(param, str(folder), rank, tp)
    return dst.reshape(shard_shape)


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("pad_multiple", [1, 8])
def test_padded_vocabulary_matches_deepspeeds_restore(tp, pad_multiple, layout, from_deepspeed, tmp_path):
    vocab, hidden = 50, 4
    padded = -(-vocab // (pad_multiple * tp)) * pad_multiple * tp
    real = random_full((vocab, hidden), torch.float32)
    ckpt = {"param": real, "vocab_tensor": True, "cat_dim": 0}
    shards = [ds_restore(tmp_path, ckpt, (padded // tp, hidden), tp, r) for r in range(tp)]
    full = torch.cat([real, torch.zeros(padded - vocab, hidden)])  # the padding reads as zeros
    m = layout({"family": "padded_vocab", "dim": 0, "pad_multiple": pad_multiple}, [vocab, hidden], tp)
    doc = json.loads(m)
    assert doc["logical_shape"] == [padded, hidden] and doc.get("valid_shape", doc["logical_shape"]) == [
        vocab if padded > vocab else padded, hidden]
    check_shards(m, full, shards)
    observed = index_maps((padded, hidden), lambda t: list(t.chunk(tp)))
    if padded > vocab:
        observed["valid_shape"] = [vocab, hidden]
    assert reshard.infer(observed).to_json() == m
    # The lowering of the metadata DeepSpeed keeps for it gives the same map.
    rc, lowered, err = from_deepspeed({"vocab_tensor": True, "cat_dim": 0, "original_vocab_size": vocab,
                                       "padded_vocab_size": padded, "logical_shape": [vocab, hidden]}, tp)
    assert rc == 0, err
    assert lowered == m


# --- DeepSpeed's metadata, from real AutoTP layers ------------------------------------------

def fused_module(name):
    return _NamedModule(name)


LAYERS = [
    # (id, layer class, shape, parameter, layer kwargs, TP degrees)
    ("k_proj heads", ds_layers.LinearLayer, (24, 12), "weight",
     dict(tp_meta=AutoTPMeta(num_kv_heads=3), name="self_attn.k_proj"), TPS),
    ("up_proj grain", ds_layers.LinearLayer, (200, 8), "weight",
     dict(tp_meta=AutoTPMeta(tp_grain_size=32), name="mlp.up_proj"), TPS),
    ("o_proj row", ds_layers.LinearAllreduce, (12, 40), "weight", dict(name="self_attn.o_proj"), TPS),
    ("o_proj heads", ds_layers.LinearAllreduce, (12, 24), "weight",
     dict(tp_meta=AutoTPMeta(num_kv_heads=3), name="self_attn.o_proj"), TPS),
    ("o_proj bias", ds_layers.LinearAllreduce, (12, 40), "bias", dict(name="self_attn.o_proj"), TPS),
    ("phi3 qkv", ds_layers.fused_LinearLayer, (48, 32), "weight",
     dict(tp_meta=AutoTPMeta(num_kv_heads=2, num_attention_heads=8), fused_module=fused_module("Phi3DecoderLayer")),
     TPS),
    ("glm qkv", ds_layers.fused_LinearLayer, (48, 8), "weight",
     dict(tp_meta=AutoTPMeta(num_kv_heads=8), fused_module=fused_module("GLMBlock")), TPS),
    ("gate_up", ds_layers.GateUpPack_LinearLayer, (100, 8), "weight",
     dict(tp_meta=AutoTPMeta(tp_grain_size=8)), TPS),
    ("bigcode qkv", ds_layers.fused_LinearLayer, (48, 16), "weight",
     dict(tp_meta=AutoTPMeta(num_kv_heads=4, num_attention_heads=4, n_embd=32),
          fused_module=fused_module("GPTBigCodeBlock")), [2, 3, 4, 8]),
    ("codegen qkv", ds_layers.fused_LinearLayer, (288, 4), "weight",
     dict(tp_meta=AutoTPMeta(num_kv_heads=96, num_attention_heads=96, n_embd=96),
          fused_module=fused_module("CodeGenBlock")), [2, 3, 4, 8]),
    ("yuan value", ds_layers.Yuan_LinearLayer, (32, 6), "weight", dict(tp_meta=AutoTPMeta(num_kv_heads=8)),
     [2, 4]),
]


def build_layers(cls, shape, param, kwargs, tp):
    """Each rank's layer built from the same full weight: (shards, metadata, full)."""
    full = random_full(shape, torch.float32, seed=tp)
    bias = random_full((shape[0],), torch.float32, seed=tp + 1)
    shards, meta = [], None
    for r in range(tp):
        module = torch.nn.Linear(shape[1], shape[0], bias=param == "bias")
        with torch.no_grad():
            module.weight.copy_(full)
            if param == "bias":
                module.bias.copy_(bias)
        p = getattr(ds_layer(cls, module, tp, r, **kwargs), param)
        shards.append(p)
        meta = getattr(p, DS_AUTOTP_UC_META)
    return shards, meta, (bias if param == "bias" else full)


@pytest.mark.parametrize("case", LAYERS, ids=lambda c: c[0])
def test_metadata_of_real_autotp_layers_lowers_to_their_shards(case, from_deepspeed):
    _, cls, shape, param, kwargs, tps = case
    for tp in tps:
        shards, meta, full = build_layers(cls, shape, param, kwargs, tp)
        rc, m, err = from_deepspeed(meta, tp)
        assert rc == 0, f"TP {tp}: {err}"
        # The layer's own shards, and what DeepSpeed's restore cuts from the same metadata.
        check_shards(m, full, [s.data for s in shards])
        restored = [_resolve_autotp_partition(s, {}, full, r, tp).reshape(s.shape) for r, s in enumerate(shards)]
        check_shards(m, full, restored)
        recorded = meta.get("conversion", {}).get("affine_map")
        if recorded is not None:
            assert reshard.ParamMap.from_json(ds_json(recorded)).canonical().to_json() == m


def test_metadata_with_recorded_sizes_is_refused_at_another_degree(from_deepspeed):
    _, meta, _ = build_layers(ds_layers.LinearLayer, (24, 12), "weight",
                              dict(tp_meta=AutoTPMeta(num_kv_heads=3), name="self_attn.k_proj"), 4)
    rc, _, err = from_deepspeed(meta, 8)
    assert rc == 1 and "are for 4 ranks, not 8" in err


# --- the legacy universal-checkpoint categories ---------------------------------------------

LEGACY = [
    # (DeepSpeed's per-parameter checkpoint keys, shape, TP degrees it can restore)
    ({"cat_dim": 0}, (24, 6), [1, 2, 3, 4, 8]),
    ({"cat_dim": 1}, (6, 24), [1, 2, 3, 4, 8]),
    ({"cat_dim": 0, "param_n_sub_params": 2}, (48, 6), [1, 2, 3, 4, 8]),
]


@pytest.mark.parametrize("keys,shape,tps", LEGACY, ids=lambda v: json.dumps(v) if isinstance(v, dict) else None)
def test_legacy_categories_match_deepspeeds_restore(keys, shape, tps, from_deepspeed, tmp_path):
    full = random_full(shape, torch.float32)
    for tp in tps:
        rc, m, err = from_deepspeed({**keys, "logical_shape": list(shape)}, tp)
        assert rc == 0, err
        doc = json.loads(m)
        shards = [ds_restore(tmp_path, {"param": full, **keys}, doc["ranks"][str(r)]["shard_shape"], tp, r)
                  for r in range(tp)]
        check_shards(m, full, shards)


def test_legacy_sub_param_shape_matches_deepspeeds_restore(from_deepspeed, tmp_path):
    from deepspeed.checkpoint.universal_checkpoint import SubparamShape
    shape = (48, 4)
    full = random_full(shape, torch.float32)
    for tp in (1, 2, 4, 8):
        sub = SubparamShape(patterns=["x"], shape=((32, 8, 8), 4), partition_dim=0)
        rc, m, err = from_deepspeed({"sub_param_shape": {"shape": [[32, 8, 8], 4], "partition_dim": 0},
                                     "logical_shape": list(shape)}, tp)
        assert rc == 0, err
        doc = json.loads(m)
        shards = [ds_restore(tmp_path, {"param": full, "sub_param_shape": sub}, doc["ranks"][str(r)]["shard_shape"],
                             tp, r) for r in range(tp)]
        check_shards(m, full, shards)


def test_averaged_parameter_is_a_checked_replica_never_an_average(from_deepspeed, tmp_path):
    full = random_full((6,), torch.float32)
    rc, m, err = from_deepspeed({"average": True, "logical_shape": [6]}, 4)
    assert rc == 0 and "instead of averaging" in err
    # DeepSpeed restores the same full tensor on every rank; so does the map.
    check_shards(m, full, [ds_restore(tmp_path, {"param": full}, (6,), 4, r) for r in range(4)])
    # Replicas that disagree (what DeepSpeed would have averaged) are refused on read.
    other = full.clone()
    other[2] += 1
    with pytest.raises(ValueError):
        reshard.rebuild(reshard.ParamMap.from_json(m), [full, other, full, full])


@pytest.mark.parametrize("meta,status,message", [
    ({"partition_dim": 0, "logical_shape": [24, 8], "partition_sizes": [8, 8, 7]}, 2, "sum to 23"),
    ({"partition_dim": 0, "logical_shape": [48, 8], "sub_param_sizes": [32, 8, 8],
      "sub_param_shard_widths": [[16, 16], [4, 4], [4, 3]]}, 2, "sum to 7"),
    ({"cat_dim": 0, "logical_shape": [10, 4]}, 1, "cannot be split evenly over 4 ranks"),
    ({"partition_dim": 0, "logical_shape": [8, 4], "conversion": {"unsupported_reason": "noncontiguous heads"}},
     1, "noncontiguous heads"),
    ({"logical_shape": [4], "replicated": True, "shards": 2}, 2, "unknown key"),
])
def test_inconsistent_metadata_is_refused(meta, status, message, from_deepspeed):
    rc, out, err = from_deepspeed(meta, 4)
    assert rc == status and message in err and out == ""


def test_layout_writes_atomically_and_refuses_usage_errors(reshard_bin, tmp_path):
    d = tmp_path / "d.json"
    d.write_text('{"family": "split", "dim": 0}')
    out = tmp_path / "map.json"
    cmd = [reshard_bin, "layout", str(d), "--shape", "8,2", "--world", "2", "-o", str(out)]
    assert subprocess.run(cmd, capture_output=True).returncode == 0
    reshard.ParamMap.from_json(out.read_text())
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 2 and "--force" in r.stderr
    assert subprocess.run(cmd + ["--force"], capture_output=True).returncode == 0
    for bad in (["--shape", "8,x", "--world", "2"], ["--world", "2"], ["--shape", "8", "--world", "0"]):
        r = subprocess.run([reshard_bin, "layout", str(d), *bad], capture_output=True, text=True)
        assert r.returncode == 2, bad
