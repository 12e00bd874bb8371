"""Block-quantized checkpoints (DESIGN 20, docs/quantization.md): scales move with their data as
the block image of the data's map, gather gives the input back byte for byte, splits that would
cut a block so that one local block needs two scales are refused, and `--dequantize` equals
transformers' own dequantization on the CPU bit for bit."""

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

import quant_models


def run(*args, ok=True):
    r = subprocess.run([str(a) for a in args], capture_output=True, text=True)
    if ok:
        assert r.returncode == 0, r.stderr
    return r


def manifest(d):
    return json.loads((d / "reshard.json").read_text())


def rank_tensors(d, rank):
    out = {}
    for f in manifest(d)["files"][str(rank)]:
        out.update(load_file(str(d / f)))
    return out


def assert_same_tensors(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k


def half_block_layouts(path):
    """Layouts that split the key/value rows at TP 2 (64 rows a rank, half a 128-row block),
    every other tensor replicated; the scales are not named: they follow their data."""
    k = "model.layers.0.self_attn."
    doc = {"version": 1, "*": {"family": "replicated"},
           k + "k_proj.weight": {"family": "split", "dim": 0},
           k + "v_proj.weight": {"family": "split", "dim": 0},
           k + "o_proj.weight": {"family": "split", "dim": 1}}
    path.write_text(json.dumps(doc))
    return path


def test_half_blocks_are_refused_for_transformers_and_exact_through_layouts(reshard_bin, tmp_path):
    src = quant_models.qwen3_fp8(tmp_path / "m", kv_heads=2)
    full = load_file(str(src / "model.safetensors"))
    # transformers splits the [1, 2] key/value scales as it splits the weight: rank 1 would get
    # no scale row. scatter --config follows transformers, so it refuses, in those words.
    r = run(reshard_bin, "scatter", src, "--config", src / "config.json", "--tp", 2, "-o",
            tmp_path / "refused", ok=False)
    assert r.returncode == 1, r.stderr
    assert "k_proj" in r.stderr and "Fp8Dequantize" in r.stderr, r.stderr
    d = run(reshard_bin, "degree", src / "config.json", "--tp", 2, ok=False)
    assert d.returncode == 1 and "FP8 blocks of 128 rows" in d.stdout + d.stderr
    # The exact layout exists: both ranks hold the block's scale row (a replica).
    out = tmp_path / "tp2"
    run(reshard_bin, "scatter", src, "--layouts", half_block_layouts(tmp_path / "l.json"), "--tp",
        2, "-o", out)
    k = "model.layers.0.self_attn.k_proj"
    assert manifest(out)["params"][k + ".weight_scale_inv"]["block_scales"]["of"] == k + ".weight"
    for r in range(2):
        t = rank_tensors(out, r)
        assert torch.equal(t[k + ".weight"].view(torch.uint8),
                           full[k + ".weight"][64 * r:64 * r + 64].view(torch.uint8))
        assert torch.equal(t[k + ".weight_scale_inv"], full[k + ".weight_scale_inv"])
    g = tmp_path / "g"
    run(reshard_bin, "gather", out, "-o", g)
    assert_same_tensors(load_file(str(g / "model.safetensors")), full)
    # convert derives the scales' target maps from their data's recorded layouts.
    tp1, tp4 = tmp_path / "tp1", tmp_path / "tp4"
    run(reshard_bin, "convert", out, "--tp", 1, "-o", tp1)
    assert_same_tensors(rank_tensors(tp1, 0), full)
    run(reshard_bin, "convert", out, "--tp", 4, "-o", tp4)
    for r in range(4):
        # 32 key/value rows a rank: all four hold the one block row of scales.
        assert torch.equal(rank_tensors(tp4, r)[k + ".weight_scale_inv"], full[k + ".weight_scale_inv"])
    # A replica that disagrees is found when gathering.
    files = manifest(out)["files"]["1"]
    t1 = load_file(str(out / files[0]))
    t1[k + ".weight_scale_inv"][0, 0] *= 2
    save_file(t1, str(out / files[0]))
    r = run(reshard_bin, "gather", out, "-o", tmp_path / "g2", ok=False)
    assert r.returncode == 1 and "k_proj.weight_scale_inv" in r.stderr, r.stderr


def test_fp8_scatter_puts_each_ranks_blocks_scales_beside_them(reshard_bin, tmp_path):
    kv_heads = 4
    src = quant_models.qwen3_fp8(tmp_path / "m", kv_heads=kv_heads)
    full = load_file(str(src / "model.safetensors"))
    out = tmp_path / "tp2"
    run(reshard_bin, "scatter", src, "--config", src / "config.json", "--tp", 2, "-o", out)
    m = manifest(out)
    k = "model.layers.0.self_attn.k_proj"
    assert m["params"][k + ".weight_scale_inv"]["block_scales"] == {
        "of": k + ".weight", "block": [128, 128], "format": "fp8-block"}
    for r in range(2):
        t = rank_tensors(out, r)
        rows = kv_heads * 64 // 2
        # Data: a row split. Scales: the block row the rank's rows lie in.
        assert torch.equal(t[k + ".weight"].view(torch.uint8),
                           full[k + ".weight"][r * rows:(r + 1) * rows].view(torch.uint8))
        assert torch.equal(t[k + ".weight_scale_inv"], full[k + ".weight_scale_inv"][r:r + 1])
        # o_proj is split by columns (rowwise): each rank holds one block column.
        o = "model.layers.0.self_attn.o_proj"
        assert torch.equal(t[o + ".weight_scale_inv"], full[o + ".weight_scale_inv"][:, r:r + 1])
    gathered = tmp_path / "g"
    run(reshard_bin, "gather", out, "-o", gathered)
    assert_same_tensors(load_file(str(gathered / "model.safetensors")), full)


def test_fp8_convert_moves_scales_with_their_data(reshard_bin, tmp_path):
    src = quant_models.qwen3_fp8(tmp_path / "m", kv_heads=4)
    full = load_file(str(src / "model.safetensors"))
    tp2, tp1 = tmp_path / "tp2", tmp_path / "tp1"
    run(reshard_bin, "scatter", src, "--config", src / "config.json", "--tp", 2, "-o", tp2)
    run(reshard_bin, "convert", tp2, "--tp", 1, "-o", tp1)
    assert_same_tensors(rank_tensors(tp1, 0), full)
    back = tmp_path / "back"
    run(reshard_bin, "convert", tp1, "--tp", 2, "-o", back)
    for r in range(2):
        assert_same_tensors(rank_tensors(back, r), rank_tensors(tp2, r))


def test_a_split_that_cuts_a_block_across_two_is_refused(reshard_bin, tmp_path):
    # 384 MLP rows at TP 2: rank 1 starts at row 192, half way into block 1.
    src = quant_models.qwen3_fp8(tmp_path / "m", kv_heads=4, intermediate=384)
    out = tmp_path / "tp2"
    r = run(reshard_bin, "scatter", src, "--config", src / "config.json", "--tp", 2, "-o", out,
            ok=False)
    assert r.returncode == 1, r.stderr
    assert "gate_proj" in r.stderr and "3 FP8 blocks of 128 rows (384 intermediate" in r.stderr
    assert not out.exists()
    d = run(reshard_bin, "degree", src / "config.json", "--json", ok=False)
    assert json.loads(d.stdout)["max_tp_degree"] == 1, d.stdout
    # A layout that asks for it anyway: rank 1's first local block would need two scales.
    layouts = tmp_path / "l.json"
    layouts.write_text(json.dumps({"version": 1, "*": {"family": "replicated"},
                                   "model.layers.0.mlp.gate_proj.weight": {"family": "split"}}))
    r = run(reshard_bin, "scatter", src, "--layouts", layouts, "--tp", 2, "-o", out, ok=False)
    assert r.returncode == 1, r.stderr
    assert "gate_proj.weight_scale_inv" in r.stderr and "blocks 1 and 2" in r.stderr, r.stderr
    assert not out.exists()


def test_manifest_whose_scale_map_is_not_the_block_image_is_refused(reshard_bin, tmp_path):
    src = quant_models.qwen3_fp8(tmp_path / "m", kv_heads=4)
    out = tmp_path / "tp2"
    run(reshard_bin, "scatter", src, "--config", src / "config.json", "--tp", 2, "-o", out)
    m = manifest(out)
    # Claim o_proj's scales are blocks of 64 columns: its map is then not their block image.
    m["params"]["model.layers.0.self_attn.o_proj.weight_scale_inv"]["block_scales"]["block"] = [128, 64]
    (out / "reshard.json").write_text(json.dumps(m))
    r = run(reshard_bin, "gather", out, "-o", tmp_path / "g", ok=False)
    assert r.returncode in (1, 2), r.stderr
    assert "o_proj.weight_scale_inv" in r.stderr and "o_proj.weight" in r.stderr, r.stderr
    assert not (tmp_path / "g").exists()


@pytest.mark.parametrize("via_shards", [False, True])
def test_fp8_dequantize_equals_transformers_dequantized_load(reshard_bin, tmp_path, via_shards):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    src = quant_models.qwen3_fp8(tmp_path / "m", kv_heads=4)
    inp = src
    if via_shards:
        inp = tmp_path / "tp2"
        run(reshard_bin, "scatter", src, "--config", src / "config.json", "--tp", 2, "-o", inp)
    out = tmp_path / "bf16"
    run(reshard_bin, "gather", inp, "--dequantize", "-o", out)
    ours = load_file(str(out / "model.safetensors"))
    assert not any(k.endswith("_scale_inv") for k in ours)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    model = AutoModelForCausalLM.from_pretrained(
        str(src), quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.bfloat16)
    theirs = {k: v for k, v in model.state_dict().items()}
    assert ours.keys() == theirs.keys()
    for k, v in theirs.items():
        assert ours[k].dtype == v.dtype, k
        assert torch.equal(ours[k].view(torch.int16), v.view(torch.int16)), k
    # The output is a plain bf16 checkpoint transformers loads as it is, to the same logits.
    plain = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    ids = torch.tensor([[1, 5, 9, 200, 33]])
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, model(ids).logits)


def test_dequantize_into_fp32_and_fp16(reshard_bin, tmp_path):
    src = quant_models.qwen3_fp8(tmp_path / "m", kv_heads=2)
    full = load_file(str(src / "model.safetensors"))
    w = "model.layers.0.mlp.down_proj.weight"
    s = full[w + "_scale_inv"]
    expected = full[w].float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    for dtype, torch_dtype in (("fp32", torch.float32), ("fp16", torch.float16)):
        out = tmp_path / dtype
        run(reshard_bin, "gather", src, "--dequantize", "--dtype", dtype, "-o", out)
        got = load_file(str(out / "model.safetensors"))[w]
        assert got.dtype == torch_dtype
        assert torch.equal(got, expected.to(torch_dtype))


BAD_SCALES = {
    "nan": float("nan"),
    "inf": float("inf"),
    "negative": -1.0,
}


@pytest.mark.parametrize("case", sorted(BAD_SCALES))
def test_dequantize_refuses_bad_scales_and_writes_nothing(reshard_bin, tmp_path, case):
    src = quant_models.qwen3_fp8(tmp_path / "m", kv_heads=2)
    t = load_file(str(src / "model.safetensors"))
    t["model.layers.0.mlp.up_proj.weight_scale_inv"][1, 1] = BAD_SCALES[case]
    save_file(t, str(src / "model.safetensors"))
    r = run(reshard_bin, "gather", src, "--dequantize", "-o", tmp_path / "out", ok=False)
    assert r.returncode == 1, r.stderr
    assert "up_proj.weight_scale_inv" in r.stderr and "block [1, 1]" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_scales_that_do_not_fit_the_data_or_are_missing_are_refused(reshard_bin, tmp_path):
    src = quant_models.qwen3_fp8(tmp_path / "m", kv_heads=4)
    t = load_file(str(src / "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj.weight"
    cases = {
        "shape": lambda d: d.__setitem__(q + "_scale_inv", torch.ones(3, 2)),
        "missing": lambda d: d.pop(q + "_scale_inv"),
        "orphan": lambda d: d.pop(q),
    }
    for name, tamper in cases.items():
        d = dict(t)
        tamper(d)
        bad = tmp_path / name
        bad.mkdir()
        save_file(d, str(bad / "model.safetensors"))
        (bad / "config.json").write_text((src / "config.json").read_text())
        for cmd in (["scatter", bad, "--config", bad / "config.json", "--tp", 2],
                    ["gather", bad, "--dequantize"]):
            r = run(reshard_bin, *cmd, "-o", tmp_path / f"out-{name}", ok=False)
            assert r.returncode == 1, (name, cmd[0], r.stderr)
            assert "q_proj.weight" in r.stderr, (name, r.stderr)
            assert not (tmp_path / f"out-{name}").exists()


def test_a_config_that_lies_about_the_block_is_refused(reshard_bin, tmp_path):
    src = quant_models.qwen3_fp8(tmp_path / "m", kv_heads=4)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [64, 128]
    (src / "config.json").write_text(json.dumps(config))
    r = run(reshard_bin, "scatter", src, "--config", src / "config.json", "--tp", 2, "-o",
            tmp_path / "out", ok=False)
    assert r.returncode == 1, r.stderr
    assert "not the block grid" in r.stderr, r.stderr
    config["quantization_config"] = {"quant_method": "awq"}
    (src / "config.json").write_text(json.dumps(config))
    r = run(reshard_bin, "scatter", src, "--config", src / "config.json", "--tp", 2, "-o",
            tmp_path / "out", ok=False)
    assert r.returncode == 2 and "awq" in r.stderr, r.stderr


def test_mxfp4_experts_scatter_at_ep2_and_gather_back(reshard_bin, tmp_path):
    src = quant_models.gpt_oss_mxfp4(tmp_path / "m")
    full = load_file(str(src / "model.safetensors"))
    out = tmp_path / "ep2"
    run(reshard_bin, "scatter", src, "--config", src / "config.json", "--tp", 2,
        "--distributed-config", '{"tp_plan": "auto", "ep_size": 2}', "-o", out)
    e = "model.layers.0.mlp.experts."
    for r in range(2):
        t = rank_tensors(out, r)
        for n in ("gate_up_proj", "down_proj"):
            assert torch.equal(t[e + n + "_blocks"], full[e + n + "_blocks"][2 * r:2 * r + 2])
            assert torch.equal(t[e + n + "_scales"], full[e + n + "_scales"][2 * r:2 * r + 2])
    g = tmp_path / "g"
    run(reshard_bin, "gather", out, "-o", g)
    assert_same_tensors(load_file(str(g / "model.safetensors")), full)


def test_mxfp4_dequantize_equals_transformers(reshard_bin, tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src = quant_models.gpt_oss_mxfp4(tmp_path / "m")
    full = load_file(str(src / "model.safetensors"))
    out = tmp_path / "bf16"
    run(reshard_bin, "gather", src, "--dequantize", "-o", out)
    ours = load_file(str(out / "model.safetensors"))
    e = "model.layers.0.mlp.experts."
    for n in ("gate_up_proj", "down_proj"):
        theirs = convert_moe_packed_tensors(full[e + n + "_blocks"], full[e + n + "_scales"])
        assert ours[e + n].shape == theirs.shape  # [E, H, 2I]: as a bf16 gpt-oss holds it
        assert torch.equal(ours[e + n].view(torch.int16), theirs.view(torch.int16)), n
        assert e + n + "_blocks" not in ours and e + n + "_scales" not in ours
        assert torch.equal(ours[e + n + "_bias"], full[e + n + "_bias"])


def test_nvfp4_scatter_and_gather_move_every_scale(reshard_bin, tmp_path):
    src = quant_models.llama_nvfp4(tmp_path / "m")
    full = load_file(str(src / "model.safetensors"))
    out = tmp_path / "tp2"
    run(reshard_bin, "scatter", src, "--config", src / "config.json", "--tp", 2, "-o", out)
    q = "model.layers.0.self_attn.q_proj."
    o = "model.layers.0.self_attn.o_proj."
    for r in range(2):
        t = rank_tensors(out, r)
        assert torch.equal(t[q + "weight_scale"].view(torch.uint8),
                           full[q + "weight_scale"][32 * r:32 * r + 32].view(torch.uint8))
        # Row-parallel o_proj: 16 packed bytes (32 values, two scales) a rank.
        assert torch.equal(t[o + "weight"], full[o + "weight"][:, 16 * r:16 * r + 16])
        assert torch.equal(t[o + "weight_scale"].view(torch.uint8),
                           full[o + "weight_scale"][:, 2 * r:2 * r + 2].view(torch.uint8))
        for s in ("weight_scale_2", "input_scale"):
            assert torch.equal(t[q + s], full[q + s])
    g = tmp_path / "g"
    run(reshard_bin, "gather", out, "-o", g)
    assert_same_tensors(load_file(str(g / "model.safetensors")), full)


NVFP4_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.mark.parametrize("global_shape", [(1,), ()], ids=["global-1", "global-0d"])
@pytest.mark.parametrize("via_shards", [False, True], ids=["hf-dir", "tp2-shards"])
def test_nvfp4_compressed_tensors_dequantize_equals_its_decompression(reshard_bin, tmp_path,
                                                                      global_shape, via_shards):
    """compressed-tensors' own NVFP4 decompression (what transformers runs to load such a model
    unquantized) divides each FP8 scale by the global scale: bfloat16(fp4 x (scale / global))."""
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    src = quant_models.llama_nvfp4_compressed(tmp_path / "m", global_shape=global_shape)
    full = load_file(str(src / "model.safetensors"))
    given = src
    if via_shards:
        given = tmp_path / "tp2"
        run(reshard_bin, "scatter", src, "--config", src / "config.json", "--tp", 2, "-o", given)
    out = tmp_path / "bf16"
    run(reshard_bin, "gather", given, "--dequantize", "-o", out)
    ours = load_file(str(out / "model.safetensors"))
    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    for n in NVFP4_LINEARS:
        x = "model.layers.0." + n + "."
        state = {k: full[x + k] for k in ("weight_packed", "weight_scale", "weight_global_scale")}
        theirs = NVFP4PackedCompressor.decompress(state, scheme)["weight"]
        assert ours[x + "weight"].dtype == theirs.dtype == torch.bfloat16
        assert torch.equal(ours[x + "weight"].view(torch.int16), theirs.view(torch.int16)), n
        for k in ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"):
            assert x + k not in ours, k
    # The arithmetic differs from ModelOpt's (a product with weight_scale_2): the test can tell.
    q = "model.layers.0.self_attn.q_proj."
    times = NVFP4PackedCompressor.decompress(
        {"weight_packed": full[q + "weight_packed"], "weight_scale": full[q + "weight_scale"],
         "weight_global_scale": 1.0 / full[q + "weight_global_scale"]}, scheme)["weight"]
    assert not torch.equal(ours[q + "weight"], times)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def test_nvfp4_compressed_tensors_dequantize_into_fp32(reshard_bin, tmp_path):
    from compressed_tensors.compressors.nvfp4 import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    src = quant_models.llama_nvfp4_compressed(tmp_path / "m")
    full = load_file(str(src / "model.safetensors"))
    out = tmp_path / "fp32"
    run(reshard_bin, "gather", src, "--dequantize", "--dtype", "fp32", "-o", out)
    ours = load_file(str(out / "model.safetensors"))
    for n in NVFP4_LINEARS:
        x = "model.layers.0." + n + "."
        packed = full[x + "weight_packed"]
        fp4 = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, torch.float32)
        theirs = dequantize(fp4, full[x + "weight_scale"].float(),
                            global_scale=full[x + "weight_global_scale"], dtype=torch.float32)
        assert torch.equal(ours[x + "weight"].view(torch.int32), theirs.view(torch.int32)), n


@pytest.mark.parametrize("bad", [0.0, -2.0, float("nan"), float("inf")])
def test_nvfp4_compressed_tensors_bad_global_scale_is_refused(reshard_bin, tmp_path, bad):
    src = quant_models.llama_nvfp4_compressed(tmp_path / "m")
    t = load_file(str(src / "model.safetensors"))
    t["model.layers.0.mlp.up_proj.weight_global_scale"] = torch.tensor([bad])
    save_file(t, str(src / "model.safetensors"))
    r = run(reshard_bin, "gather", src, "--dequantize", "-o", tmp_path / "out", ok=False)
    assert r.returncode == 1, r.stderr
    assert "up_proj.weight_global_scale" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_inspect_shows_each_quantized_pair(reshard_bin, tmp_path):
    src = quant_models.qwen3_fp8(tmp_path / "m", kv_heads=4)
    out = tmp_path / "tp2"
    run(reshard_bin, "scatter", src, "--config", src / "config.json", "--tp", 2, "-o", out)
    r = run(reshard_bin, "inspect", out)
    assert "fp8-block" in r.stdout and "[128, 128]" in r.stdout, r.stdout
    assert "k_proj.weight_scale_inv" in r.stdout, r.stdout
    # A Hugging Face directory: the pairs its config.json says, in text and JSON (CLI, Python).
    k = "model.layers.0.self_attn.k_proj.weight"
    text = run(reshard_bin, "inspect", src).stdout
    assert f'{k}_scale_inv  F32 [2, 2]  model.safetensors  fp8-block scales of "{k}" in blocks ' \
           "of [128, 128]" in text, text
    import reshard
    for doc in (json.loads(run(reshard_bin, "inspect", src, "--json").stdout),
                reshard.checkpoint.inspect(src)):
        tensors = {t["name"]: t for t in doc["model"]["tensors"]}
        assert tensors[k + "_scale_inv"]["block_scales"] == {
            "of": k, "block": [128, 128], "format": "fp8-block", "dequantizes": True}
        assert "block_scales" not in tensors[k]
        assert sum("block_scales" in t for t in tensors.values()) == 7
    # A quantization_config reshard cannot read is reported, not raised.
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq"}
    (src / "config.json").write_text(json.dumps(config))
    text = run(reshard_bin, "inspect", src).stdout
    assert "quantization: " in text and "awq" in text, text


QWEN3_30B_A3B_FP8 = {
    # Qwen/Qwen3-30B-A3B-FP8's config.json (the fields the planner reads).
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
    "num_experts_per_tok": 8, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_hidden_layers": 48, "vocab_size": 151936, "torch_dtype": "bfloat16",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}


@pytest.mark.parametrize("engine", ["vllm", "transformers"])
def test_degree_knows_the_block_rules(reshard_bin, tmp_path, engine):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN3_30B_A3B_FP8))
    # 768 expert rows at TP 4 are 192 a rank: one and a half blocks.
    r = run(reshard_bin, "degree", config, "--engine", engine, "--tp", 4, ok=False)
    assert r.returncode == 1, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "6 FP8 blocks of 128" in out and "768 expert intermediate features" in out, out
    assert "vLLM" in out if engine == "vllm" else "Fp8Dequantize" in out, out
    r = run(reshard_bin, "degree", config, "--engine", engine, "--tp", 2)
    # The same model unquantized splits 4 ways: the blocks are what binds.
    plain = dict(QWEN3_30B_A3B_FP8)
    del plain["quantization_config"]
    config.write_text(json.dumps(plain))
    run(reshard_bin, "degree", config, "--engine", engine, "--tp", 4)


GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
    "intermediate_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 64, "num_hidden_layers": 36, "num_local_experts": 128, "num_experts_per_tok": 4,
    "vocab_size": 201088,
    "quantization_config": {"quant_method": "mxfp4",
                            "modules_to_not_convert": ["model.layers.*.self_attn",
                                                       "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"]},
}


def test_degree_says_where_vllm_pads_mxfp4_experts(reshard_bin, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(GPT_OSS_120B))
    # TP 8: 90 groups of 32 are 11.25 a rank; vLLM gives ranks 12 groups, the last one 6.
    r = run(reshard_bin, "degree", config, "--engine", "vllm", "--tp", 8)
    assert "tp 8: works, with the MXFP4 experts padded" in r.stdout, r.stdout
    assert "ranks 0 to 6 take 384, rank 7 takes 192" in r.stderr, r.stderr
    assert "384 features on vLLM's CPU backend" in r.stderr, r.stderr
    answer = json.loads(run(reshard_bin, "degree", config, "--engine", "vllm", "--tp", 2,
                            "--json").stdout)
    m = answer["vllm_mxfp4"]
    assert m["whole_group_degrees"] == [1, 2] and m["padded_degrees"] == [4, 8]
    assert m["requested"]["whole_groups"] and m["requested"]["features_per_rank"] == 1440
    assert m["requested"]["parameter_features"] == {"cpu": 1440, "align_64": 1472,
                                                     "align_128": 1536, "align_256": 1536}
    # What vLLM refuses, in its words: no key/value head at TP 16; its MLP block's assertion
    # where the degree does not divide the experts' 96 features (three groups).
    r = run(reshard_bin, "degree", config, "--engine", "vllm", "--tp", 16, ok=False)
    assert r.returncode == 1 and "0 key/value heads a rank" in r.stderr, r.stderr
    small = dict(GPT_OSS_120B, intermediate_size=96, num_key_value_heads=64, vocab_size=256)
    config.write_text(json.dumps(small))
    r = run(reshard_bin, "degree", config, "--engine", "vllm", "--tp", 64, ok=False)
    assert r.returncode == 1
    assert "assert config.intermediate_size % self.world_size == 0" in r.stderr, r.stderr
    # transformers' plan for gpt-oss splits only the embedding: no rule of vLLM's there.
    assert json.loads(run(reshard_bin, "degree", config, "--tp", 2, "--json").stdout)[
        "vllm_mxfp4"] is None


def test_deepseek_v3_per_expert_fp8_at_ep2_stacks_scales_beside_the_experts(reshard_bin, tmp_path):
    src = quant_models.deepseek_v3_fp8(tmp_path / "m")
    full = load_file(str(src / "model.safetensors"))
    out = tmp_path / "ep2"
    run(reshard_bin, "scatter", src, "--config", src / "config.json", "--tp", 2,
        "--distributed-config", '{"tp_plan": "auto", "ep_size": 2}', "-o", out)
    p = "model.layers.0.mlp.experts."
    for r in range(2):
        t = rank_tensors(out, r)
        # transformers' FP8 experts: gate_up_proj [E, 2I, H] beside gate_up_proj_scale_inv
        # [E, 2I / 128, H / 128], two experts a rank.
        data = torch.stack([torch.cat([full[f"{p}{e}.gate_proj.weight"].view(torch.uint8),
                                       full[f"{p}{e}.up_proj.weight"].view(torch.uint8)])
                            for e in (2 * r, 2 * r + 1)])
        scales = torch.stack([torch.cat([full[f"{p}{e}.gate_proj.weight_scale_inv"],
                                         full[f"{p}{e}.up_proj.weight_scale_inv"]])
                              for e in (2 * r, 2 * r + 1)])
        assert torch.equal(t[p + "gate_up_proj"].view(torch.uint8), data)
        assert torch.equal(t[p + "gate_up_proj_scale_inv"], scales)
        down = torch.stack([full[f"{p}{e}.down_proj.weight_scale_inv"] for e in (2 * r, 2 * r + 1)])
        assert torch.equal(t[p + "down_proj_scale_inv"], down)
    g = tmp_path / "g"
    run(reshard_bin, "gather", out, "-o", g)
    assert_same_tensors(load_file(str(g / "model.safetensors")), full)
    # Dequantized from the shards: the reference formula on every tensor, the 576-row edge
    # block of kv_a_proj_with_mqa included (transformers' converter refuses that grid).
    deq = tmp_path / "bf16"
    run(reshard_bin, "gather", out, "--dequantize", "-o", deq)
    ours = load_file(str(deq / "model.safetensors"))
    for name, w in full.items():
        if name.endswith("_scale_inv"):
            assert name not in ours
        elif w.dtype == torch.float8_e4m3fn:
            want = quant_models.dequantize_fp8_reference(w, full[name + "_scale_inv"])
            assert torch.equal(ours[name].view(torch.int16), want.view(torch.int16)), name
        else:
            assert torch.equal(ours[name], w), name


def test_python_gather_dequantizes_as_the_cli_does(reshard_bin, tmp_path):
    import reshard

    src = quant_models.qwen3_fp8(tmp_path / "m", kv_heads=4)
    run(reshard_bin, "gather", src, "--dequantize", "-o", tmp_path / "cli")
    reshard.checkpoint.gather(src, tmp_path / "py", dequantize="bf16")
    assert_same_tensors(load_file(str(tmp_path / "py" / "model.safetensors")),
                        load_file(str(tmp_path / "cli" / "model.safetensors")))
    with pytest.raises(ValueError, match="bf16"):
        reshard.checkpoint.gather(src, tmp_path / "bad", dequantize="int4")
    with pytest.raises(ValueError, match="nothing to gather"):
        reshard.checkpoint.gather(src, tmp_path / "plain")


def test_fp8_shards_dequantized_equal_transformers_own_tp2_load(reshard_bin, tmp_path):
    """transformers' TP 2 load on the CPU (torchrun, gloo) dequantizes each rank's FP8 shard
    with the scale rows it gets; reshard's shards of the same checkpoint, each dequantized with
    the rank's own scales, are those tensors bit for bit."""
    import tp_load_worker

    src = quant_models.qwen3_fp8(tmp_path / "m", kv_heads=4)
    dumps = tp_load_worker.launch([{"name": "fp8", "dir": str(src)}], tmp_path, 2)
    out = tmp_path / "tp2"
    run(reshard_bin, "scatter", src, "--config", src / "config.json", "--tp", 2, "-o", out)
    for r in range(2):
        status = json.loads((dumps / "fp8" / f"rank-{r}.json").read_text())
        assert status["loaded"] and status["forward"], status
        theirs = load_file(str(dumps / "fp8" / f"rank-{r}.safetensors"))
        ours = rank_tensors(out, r)
        for name, t in theirs.items():
            mine = ours[name]
            if mine.dtype == torch.float8_e4m3fn:
                mine = quant_models.dequantize_fp8_reference(mine, ours[name + "_scale_inv"])
            assert torch.equal(mine.view(torch.int16), t.view(torch.int16)), (r, name)


def dequantized_then_scattered(reshard_bin, src, tmp_path, *scatter_args):
    """The oracle of a dequantizing scatter: gather --dequantize, then a plain scatter --config of
    the bf16 checkpoint (its config.json has no quantization_config)."""
    bf16 = tmp_path / "bf16-full"
    run(reshard_bin, "gather", src, "--dequantize", "-o", bf16)
    assert "quantization_config" not in json.loads((bf16 / "config.json").read_text())
    out = tmp_path / "oracle"
    run(reshard_bin, "scatter", bf16, "--config", bf16 / "config.json", *scatter_args, "-o", out)
    return out


def assert_same_shards(a, b):
    ma, mb = manifest(a), manifest(b)
    assert ma["world_size"] == mb["world_size"]
    assert "block_scales" not in json.dumps(ma)
    for r in range(ma["world_size"]):
        assert_same_tensors(rank_tensors(a, r), rank_tensors(b, r))
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())


@pytest.mark.parametrize("model,args", [
    # Half blocks: scatter --config refuses the FP8 checkpoint at TP 2, not its numbers.
    ("qwen3-kv2", ("--tp", 2)),
    ("deepseek-v3-ep2", ("--tp", 2, "--distributed-config", '{"tp_plan": "auto", "ep_size": 2}')),
    ("gpt-oss-ep2", ("--tp", 2, "--distributed-config", '{"tp_plan": "auto", "ep_size": 2}')),
    # compressed-tensors NVFP4: X.weight_packed is laid out as the bf16 model's X.weight.
    ("llama-nvfp4-compressed-tp2", ("--tp", 2)),
])
def test_scatter_dequantize_equals_scatter_of_the_dequantized_model(reshard_bin, tmp_path, model,
                                                                    args):
    make = {"qwen3-kv2": lambda p: quant_models.qwen3_fp8(p, kv_heads=2),
            "deepseek-v3-ep2": quant_models.deepseek_v3_fp8,
            "gpt-oss-ep2": quant_models.gpt_oss_mxfp4,
            "llama-nvfp4-compressed-tp2": quant_models.llama_nvfp4_compressed}[model]
    src = make(tmp_path / "m")
    oracle = dequantized_then_scattered(reshard_bin, src, tmp_path, *args)
    out = tmp_path / "out"
    run(reshard_bin, "scatter", src, "--config", src / "config.json", *args, "--dequantize",
        "-o", out)
    assert_same_shards(out, oracle)
    # The manifest records the bf16 model's config: convert lays it out from that again.
    assert "quantization_config" not in manifest(out)["model_config"]
    run(reshard_bin, "convert", out, "--tp", 1, "-o", tmp_path / "tp1")
    run(reshard_bin, "convert", oracle, "--tp", 1, "-o", tmp_path / "oracle-tp1")
    assert_same_shards(tmp_path / "tp1", tmp_path / "oracle-tp1")


def test_convert_dequantize_of_fp8_shards_and_of_a_hugging_face_dir(reshard_bin, tmp_path):
    src = quant_models.qwen3_fp8(tmp_path / "m", kv_heads=4)
    tp2 = tmp_path / "tp2"
    run(reshard_bin, "scatter", src, "--config", src / "config.json", "--tp", 2, "-o", tp2)
    oracle = dequantized_then_scattered(reshard_bin, src, tmp_path, "--tp", 4)
    # FP8 TP 2 -> bf16 TP 4 (4 key/value heads: one a rank), laid out from the kept config.
    out = tmp_path / "tp4"
    run(reshard_bin, "convert", tp2, "--tp", 4, "--dequantize", "-o", out)
    assert_same_shards(out, oracle)
    import reshard
    reshard.checkpoint.convert(tp2, tmp_path / "py", tp=4, dequantize="bf16")
    assert_same_shards(tmp_path / "py", oracle)
    with pytest.raises(ValueError, match="not to='dcp'"):
        reshard.checkpoint.convert(tp2, tmp_path / "dcp", to="dcp", world=2, dequantize="bf16")
    # fp32 through target maps that name the dequantized tensors.
    maps = tmp_path / "maps.json"
    run(reshard_bin, "degree", tmp_path / "bf16-full" / "config.json", "--tp", 4, "--emit-maps",
        maps, "--weights", tmp_path / "bf16-full")
    f32 = tmp_path / "f32"
    run(reshard_bin, "convert", src, "--tp", 4, "--dequantize", "--dtype", "fp32",
        "--target-maps", maps, "-o", f32)
    bf16, compared = rank_tensors(oracle, 3), 0
    for name, t in rank_tensors(f32, 3).items():
        if bf16[name].dtype == torch.bfloat16 and t.dtype == torch.float32:
            assert torch.equal(t.to(torch.bfloat16), bf16[name]), name
            compared += 1
    assert compared >= 7  # q, k, v, o, gate, up, down
    # What cannot be dequantized is refused before anything is written.
    plain = tmp_path / "plain"
    run(reshard_bin, "gather", src, "--dequantize", "-o", plain)
    r = run(reshard_bin, "scatter", plain, "--config", plain / "config.json", "--tp", 2,
            "--dequantize", "-o", tmp_path / "none", ok=False)
    assert r.returncode == 1 and "nothing to dequantize" in r.stderr, r.stderr
    assert not (tmp_path / "none").exists()
    r = run(reshard_bin, "convert", tp2, "--to", "dcp", "--world", 2, "--dequantize", "-o",
            tmp_path / "dcp", ok=False)
    assert r.returncode == 2 and "--dequantize" in r.stderr, r.stderr


def test_show_draws_which_rank_holds_each_block(reshard_bin, tmp_path):
    src = quant_models.qwen3_fp8(tmp_path / "m", kv_heads=4)
    tp2 = tmp_path / "tp2"
    run(reshard_bin, "scatter", src, "--config", src / "config.json", "--tp", 2, "-o", tp2)
    # o_proj [256, 256] split by columns at TP 4 through layouts: 64 columns a rank, so ranks 0
    # and 1 share block column 0 and ranks 2 and 3 block column 1.
    tp4 = tmp_path / "tp4"
    run(reshard_bin, "scatter", src, "--layouts", half_block_layouts(tmp_path / "l.json"), "--tp",
        4, "-o", tp4)
    a = "model.layers.0.self_attn."

    def holders(d):
        shown = json.loads(run(reshard_bin, "show", d, "--json").stdout)
        return {e["block_scales"]["of"]: e["block_scales"]["holders"]
                for e in shown if "block_scales" in e}

    whole = holders(tp2)
    assert whole[a + "k_proj.weight"] == ["00", "11"]  # [2, 2] grid: a block row a rank
    assert whole[a + "o_proj.weight"] == ["01", "01"]  # split by columns: a block column a rank
    cut = holders(tp4)
    assert cut[a + "o_proj.weight"] == ["++", "++"]
    assert cut[a + "q_proj.weight"] == ["**", "**"]  # replicated
    text = run(reshard_bin, "show", tp4, "--svg", tmp_path / "b.svg").stdout
    assert f'blocks of "{a}o_proj.weight" (fp8-block [128, 128], grid [2, 2])' in text
    svg = (tmp_path / "b.svg").read_text()
    plus = sum(line.count("+") for picture in cut.values() for line in picture)
    assert plus == 12  # o_proj's 4 blocks, and k_proj's and v_proj's (64 rows a rank)
    assert svg.startswith("<?xml") and svg.count("several ranks: a block cut") == plus


def tampered_copy(src, dst, tamper, config=None):
    """A copy of the one-file checkpoint `src` with its tensors passed through `tamper` (and its
    config.json through `config`)."""
    t = load_file(str(src / "model.safetensors"))
    tamper(t)
    dst.mkdir()
    save_file(t, str(dst / "model.safetensors"))
    c = json.loads((src / "config.json").read_text())
    if config is not None:
        config(c)
    (dst / "config.json").write_text(json.dumps(c))
    return dst


def assert_refused(reshard_bin, tmp_path, cmd, code, *named):
    out = tmp_path / "refused-out"
    r = run(reshard_bin, *cmd, "-o", out, ok=False)
    assert r.returncode == code, (cmd, r.returncode, r.stderr)
    for name in named:
        assert name in r.stderr, (cmd, name, r.stderr)
    assert not out.exists(), cmd
    return r.stderr


UP = "model.layers.0.mlp.up_proj."


def _drop(*names):
    def tamper(t):
        for n in names:
            del t[n]
    return tamper


def _fp8_without_scale_beside_activation_scale(t):
    del t[UP + "weight_scale_inv"]
    t[UP + "activation_scale"] = torch.tensor(0.5)


# A quantized weight whose block scale is gone, with per-tensor scalars still beside it.
MISSING_SCALE = {
    "fp8-activation-scale": (lambda p: quant_models.qwen3_fp8(p, kv_heads=4),
                             _fp8_without_scale_beside_activation_scale, "weight_scale_inv"),
    "fp8-input-scale": (lambda p: quant_models.qwen3_fp8(p, kv_heads=4),
                        lambda t: (t.pop(UP + "weight_scale_inv"),
                                   t.__setitem__(UP + "input_scale", torch.tensor(0.5))),
                        "weight_scale_inv"),
    "nvfp4-modelopt": (quant_models.llama_nvfp4, _drop(UP + "weight_scale"), "weight_scale"),
    "nvfp4-compressed-tensors": (quant_models.llama_nvfp4_compressed, _drop(UP + "weight_scale"),
                                 "weight_scale"),
}


@pytest.mark.parametrize("case", sorted(MISSING_SCALE))
def test_a_quantized_weight_without_its_scale_is_refused_by_every_command(reshard_bin, tmp_path,
                                                                          case):
    make, tamper, scale = MISSING_SCALE[case]
    bad = tampered_copy(make(tmp_path / "m"), tmp_path / "bad", tamper)
    data = UP + ("weight_packed" if case == "nvfp4-compressed-tensors" else "weight")
    for cmd in (["gather", bad, "--dequantize"],
                ["scatter", bad, "--config", bad / "config.json", "--tp", 2],
                ["scatter", bad, "--config", bad / "config.json", "--tp", 2, "--dequantize"],
                ["convert", bad, "--tp", 1, "--dequantize"]):
        assert_refused(reshard_bin, tmp_path, cmd, 1, f'"{data}"', f'"{UP}{scale}"')


def test_modelopt_nvfp4_without_weight_scale_2_is_refused(reshard_bin, tmp_path):
    """ModelOpt's NVFP4 values are FP4 x per-16 scale x weight_scale_2: without the last the
    numbers are unknown (taking 1.0 would write them 1 / weight_scale_2 times too large)."""
    src = quant_models.llama_nvfp4(tmp_path / "m")
    bad = tampered_copy(src, tmp_path / "bad", _drop(UP + "weight_scale_2"))
    for cmd in (["gather", bad, "--dequantize"],
                ["scatter", bad, "--config", bad / "config.json", "--tp", 2],
                ["scatter", bad, "--config", bad / "config.json", "--tp", 2, "--dequantize"]):
        assert_refused(reshard_bin, tmp_path, cmd, 1, f'"{UP}weight"', f'"{UP}weight_scale_2"')
    # From shards whose manifest no longer ties it: refused too.
    tp2 = tmp_path / "tp2"
    run(reshard_bin, "scatter", src, "--config", src / "config.json", "--tp", 2, "-o", tp2)
    m = manifest(tp2)
    del m["params"][UP + "weight_scale_2"]["block_scales"]
    (tp2 / "reshard.json").write_text(json.dumps(m))
    assert_refused(reshard_bin, tmp_path, ["gather", tp2, "--dequantize"], 1,
                   f'"{UP}weight_scale_2"')


@pytest.mark.parametrize("tamper", ["no-block-scales", "not-dequantizing"])
def test_a_manifest_that_unties_a_block_scale_is_refused(reshard_bin, tmp_path, tamper):
    src = quant_models.qwen3_fp8(tmp_path / "m", kv_heads=4)
    tp2 = tmp_path / "tp2"
    run(reshard_bin, "scatter", src, "--config", src / "config.json", "--tp", 2, "-o", tp2)
    m = manifest(tp2)
    param = m["params"][UP + "weight_scale_inv"]
    if tamper == "no-block-scales":
        del param["block_scales"]
    else:
        param["block_scales"]["dequantizes"] = False
    (tp2 / "reshard.json").write_text(json.dumps(m))
    # Plain gather too: the output would hold the scales untied under a quantization_config.
    for cmd in (["gather", tp2, "--dequantize"], ["gather", tp2], ["convert", tp2, "--tp", 1],
                ["convert", tp2, "--tp", 4, "--dequantize"]):
        assert_refused(reshard_bin, tmp_path, cmd, 1, f'"{UP}weight_scale_inv"', f'"{UP}weight"')


def test_fp8_data_without_a_recorded_scale_is_not_dequantized_into_raw_numbers(reshard_bin,
                                                                               tmp_path):
    """Shards scattered without a config.json: only the manifest says what scales what, and FP8
    data it ties to no scale has no numbers to write."""
    src = quant_models.qwen3_fp8(tmp_path / "m", kv_heads=4)
    tp2 = tmp_path / "tp2"
    run(reshard_bin, "scatter", src, "--layouts", half_block_layouts(tmp_path / "l.json"), "--tp",
        2, "-o", tp2)
    m = manifest(tp2)
    assert not m.get("model_config")
    (tp2 / "config.json").unlink()
    del m["params"][UP + "weight_scale_inv"]["block_scales"]
    (tp2 / "reshard.json").write_text(json.dumps(m))
    assert_refused(reshard_bin, tmp_path, ["gather", tp2, "--dequantize"], 1, f'"{UP}weight"',
                   "F8_E4M3")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_mxfp4_scales_that_are_not_e8m0_bytes_are_refused(reshard_bin, tmp_path, dtype):
    """MXFP4 scales are E8M0 exponents, one U8 each. A float tensor holding 127 is no exponent
    (transformers would truncate it to one, reshard would have multiplied by it): refused."""
    e = "model.layers.0.mlp.experts.gate_up_proj_scales"

    def tamper(t):
        t[e] = t[e].to(dtype) if dtype != torch.int8 else t[e].view(torch.int8)

    bad = tampered_copy(quant_models.gpt_oss_mxfp4(tmp_path / "m"), tmp_path / "bad", tamper)
    for cmd in (["gather", bad, "--dequantize"],
                ["scatter", bad, "--config", bad / "config.json", "--tp", 2]):
        err = assert_refused(reshard_bin, tmp_path, cmd, 1, f'"{e}"', "U8")
        assert "nan" not in err, err


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_fp8_scales_of_a_dtype_the_format_does_not_store_are_named(reshard_bin, tmp_path, dtype):
    s = UP + "weight_scale_inv"
    bad = tampered_copy(quant_models.qwen3_fp8(tmp_path / "m", kv_heads=4), tmp_path / "bad",
                        lambda t: t.__setitem__(s, t[s].to(dtype)))
    name = {torch.float64: "F64", torch.int32: "I32"}[dtype]
    err = assert_refused(reshard_bin, tmp_path, ["gather", bad, "--dequantize"], 1, f'"{s}"', name,
                         "F32, BF16, F16")
    assert "nan" not in err, err


def test_a_block_scale_beside_a_one_dimensional_tensor_names_it(reshard_bin, tmp_path):
    w = "model.layers.0.post_attention_layernorm.weight"

    def tamper(t):
        t[w] = t[w].to(torch.float8_e4m3fn)
        t[w + "_scale_inv"] = torch.ones(2)

    bad = tampered_copy(quant_models.qwen3_fp8(tmp_path / "m", kv_heads=4), tmp_path / "bad",
                        tamper)
    assert_refused(reshard_bin, tmp_path, ["gather", bad, "--dequantize"], 1, f'"{w}"',
                   f'"{w}_scale_inv"')


def test_compressed_tensors_nvfp4_with_weight_and_weight_packed_is_refused(reshard_bin, tmp_path):
    def tamper(t):
        t[UP + "weight"] = t[UP + "weight_packed"].clone()

    bad = tampered_copy(quant_models.llama_nvfp4_compressed(tmp_path / "m"), tmp_path / "bad",
                        tamper)
    for cmd in (["gather", bad, "--dequantize"],
                ["scatter", bad, "--config", bad / "config.json", "--tp", 2]):
        assert_refused(reshard_bin, tmp_path, cmd, 1, f'"{UP}weight"', f'"{UP}weight_packed"')


def _modelopt_group_32(c):
    c["quantization_config"]["group_size"] = 32


def _compressed_group_32(c):
    c["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 32


@pytest.mark.parametrize("make,config", [(quant_models.llama_nvfp4, _modelopt_group_32),
                                         (quant_models.llama_nvfp4_compressed,
                                          _compressed_group_32)],
                         ids=["modelopt", "compressed-tensors"])
def test_nvfp4_group_size_that_is_not_the_scales_grid_is_refused(reshard_bin, tmp_path, make,
                                                                 config):
    bad = tampered_copy(make(tmp_path / "m"), tmp_path / "bad", lambda t: None, config)
    for cmd in (["gather", bad, "--dequantize"],
                ["scatter", bad, "--config", bad / "config.json", "--tp", 2]):
        assert_refused(reshard_bin, tmp_path, cmd, 1, "not the block grid", "weight_scale")
    # A group size that is not a whole number of bytes is malformed.
    text = (bad / "config.json").read_text().replace('"group_size": 32', '"group_size": 15')
    (bad / "config.json").write_text(text)
    assert_refused(reshard_bin, tmp_path, ["gather", bad, "--dequantize"], 2, "group_size", "15")


def test_fused_layouts_keep_whole_blocks_or_are_refused_as_a_split_that_cuts_one(reshard_bin,
                                                                                tmp_path):
    """A fused layout gives each rank a run of every part. Parts of whole blocks at TP 2 keep each
    local block inside one block of the data; parts of 1.5 blocks make a local block take rows of
    two (exit 1, as any split that cuts a block)."""
    g = "model.layers.0.mlp.gate_proj.weight"
    layouts = tmp_path / "l.json"
    layouts.write_text(json.dumps({"version": 1, "*": {"family": "replicated"},
                                   g: {"family": "fused", "dim": 0, "parts": 2}}))
    src = quant_models.qwen3_fp8(tmp_path / "m", kv_heads=4, intermediate=512)
    full = load_file(str(src / "model.safetensors"))
    out = tmp_path / "tp2"
    run(reshard_bin, "scatter", src, "--layouts", layouts, "--tp", 2, "-o", out)
    for r in range(2):
        # Rank r: rows 128r..128r+127 of each 256-row part: block rows r and 2 + r.
        assert torch.equal(rank_tensors(out, r)[g + "_scale_inv"],
                           full[g + "_scale_inv"][[r, 2 + r]])
    run(reshard_bin, "gather", out, "-o", tmp_path / "g")
    assert_same_tensors(load_file(str(tmp_path / "g" / "model.safetensors")), full)
    cut = quant_models.qwen3_fp8(tmp_path / "m384", kv_heads=4, intermediate=384)
    assert_refused(reshard_bin, tmp_path, ["scatter", cut, "--layouts", layouts, "--tp", 2], 1,
                   g + "_scale_inv")


@pytest.mark.parametrize("field,value", [("head_dim", 2 ** 61), ("num_key_value_heads", 2 ** 62)])
def test_fp8_configs_whose_head_widths_overflow_are_refused(reshard_bin, tmp_path, field, value):
    config = dict(QWEN3_30B_A3B_FP8, **{field: value})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    for cmd in (["degree", path], ["degree", path, "--engine", "vllm", "--tp", 4]):
        r = run(reshard_bin, *cmd, ok=False)
        assert r.returncode == 2, (cmd, r.returncode, r.stdout, r.stderr)
        assert field in r.stderr and str(value) in r.stderr, r.stderr
    src = quant_models.qwen3_fp8(tmp_path / "m", kv_heads=4)
    c = json.loads((src / "config.json").read_text())
    c[field] = value
    (tmp_path / "big.json").write_text(json.dumps(c))
    assert_refused(reshard_bin, tmp_path, ["scatter", src, "--config", tmp_path / "big.json",
                                           "--tp", 2], 2, field)
