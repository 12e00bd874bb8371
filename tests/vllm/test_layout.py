"""reshard.vllm.layout: vLLM's layouts learned from its own weight loaders, checked against what
vLLM's tensor parallel layers are known to hold (no engine starts here)."""

import json
import os
import subprocess
import sys

import pytest
import torch

import reshard
import reshard.vllm
from conftest import hf_tensors, run_reshard

LAYOUTS = {}


def learned(model_dir, tp):
    """One layout per (model, degree) for the module (learning one builds every rank's model)."""
    key = (str(model_dir), tp)
    if key not in LAYOUTS:
        LAYOUTS[key] = reshard.vllm.layout(model_dir, tp, dtype="float32", cache=False)
    return LAYOUTS[key]


def rank_tensors(doc, full, rank):
    """Rank `rank`'s tensors under vLLM's names, produced from the full tensors by the maps."""
    buffers = reshard.read_buffers(doc)
    out = buffers.empty(rank)
    for name, m in buffers.maps.items():
        if m.buffer(rank):
            reshard.extract(m, full[name], rank, out=out[m.buffer(rank)])
        else:
            out[name] = reshard.extract(m, full[name], rank)
    return out


def rows(t, r, tp):
    n = t.shape[0] // tp
    return t[r * n:(r + 1) * n]


def cols(t, r, tp):
    n = t.shape[1] // tp
    return t[:, r * n:(r + 1) * n]


@pytest.mark.parametrize("tp", [1, 2])
def test_dense_llama_fuses_qkv_and_gate_up_and_pads_the_vocabulary(toy_llama, tp):
    doc = learned(toy_llama, tp)
    assert doc["version"] == 2
    full = hf_tensors(toy_llama)
    for r in range(tp):
        got = rank_tensors(doc, full, r)
        for layer in range(2):
            p = f"model.layers.{layer}."
            q, k, v = (full[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
            # One key/value head: at TP 2 every rank holds it whole (vLLM replicates it).
            assert torch.equal(got[p + "self_attn.qkv_proj.weight"],
                               torch.cat([rows(q, r, tp), k, v]))
            assert torch.equal(got[p + "self_attn.o_proj.weight"],
                               cols(full[p + "self_attn.o_proj.weight"], r, tp))
            assert torch.equal(got[p + "mlp.gate_up_proj.weight"],
                               torch.cat([rows(full[p + "mlp.gate_proj.weight"], r, tp),
                                          rows(full[p + "mlp.up_proj.weight"], r, tp)]))
            assert torch.equal(got[p + "mlp.down_proj.weight"],
                               cols(full[p + "mlp.down_proj.weight"], r, tp))
            assert torch.equal(got[p + "input_layernorm.weight"], full[p + "input_layernorm.weight"])
            for scale in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale"):
                t = got[p + "self_attn.attn." + scale]
                assert t.shape == () and t.dtype == torch.float32 and float(t) == 1.0
        # The vocabulary (250) padded to a multiple of 64, split over the ranks; the padding zero.
        per = 256 // tp
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            t = got[name]
            assert t.shape == (per, 64)
            held = full[name][r * per:(r + 1) * per]
            assert torch.equal(t[:held.shape[0]], held)
            assert not t[held.shape[0]:].any()
    # Names and shapes as vLLM holds them, with nothing else.
    names = set(doc["buffers"]) | {k for k, v in doc.items()
                                   if k not in ("version", "buffers")
                                   and "buffer" not in v["ranks"]["0"]}
    assert "model.layers.0.self_attn.q_proj.weight" not in names
    assert "model.layers.0.self_attn.qkv_proj.weight" in doc["buffers"]
    # Per layer qkv, o, four scales, gate_up, down, two norms; then embed, norm, lm_head.
    assert len(names) == 2 * 10 + 3


def test_qwen3_moe_places_every_expert_with_gate_and_up_split_together(toy_moe):
    tp = 2
    doc = learned(toy_moe, tp)
    full = hf_tensors(toy_moe)
    buffers = reshard.read_buffers(doc)
    for r in range(tp):
        got = rank_tensors(doc, full, r)
        p = "model.layers.1.mlp."
        w13 = [name for name in doc["buffers"] if name.startswith(p) and name.endswith("w13_weight")]
        w2 = [name for name in doc["buffers"] if name.startswith(p) and name.endswith("w2_weight")]
        assert len(w13) == 1 and len(w2) == 1
        # TP over experts: every rank holds all 4, each with its slice of the intermediate dim.
        assert torch.equal(got[w13[0]], torch.stack([
            torch.cat([rows(full[p + f"experts.{e}.gate_proj.weight"], r, tp),
                       rows(full[p + f"experts.{e}.up_proj.weight"], r, tp)]) for e in range(4)]))
        assert torch.equal(got[w2[0]], torch.stack([
            cols(full[p + f"experts.{e}.down_proj.weight"], r, tp) for e in range(4)]))
        # The router, whole on every rank, in whatever parameter vLLM holds it.
        router = buffers.maps[p + "gate.weight"]
        held = got[router.buffer(r)] if router.buffer(r) else got[p + "gate.weight"]
        assert torch.equal(held, full[p + "gate.weight"])
        for norm in ("q_norm", "k_norm"):
            name = f"model.layers.1.self_attn.{norm}.weight"
            assert torch.equal(got[name], full[name])


def test_layouts_are_cached_by_model_vllm_version_and_degree(toy_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("RESHARD_CACHE_DIR", str(tmp_path))
    assert reshard.vllm.cache_dir() == tmp_path / "vllm"
    cached = lambda: sorted(tmp_path.glob("vllm/*.json"))  # noqa: E731
    before = cached()
    doc = reshard.vllm.layout(toy_llama, 1, dtype="float32")
    files = cached()
    assert len(files) == len(before) + 1
    new = sorted(set(files) - set(before))[0]
    # A second call reads the file: what it holds is what comes back.
    marked = dict(doc, **{"buffers": dict(doc["buffers"])})
    marked["buffers"]["model.norm.weight.extra"] = marked["buffers"]["model.layers.0.self_attn.attn._k_scale"]
    new.write_text(json.dumps(marked))
    assert reshard.vllm.layout(toy_llama, 1, dtype="float32") == marked
    assert reshard.vllm.layout(toy_llama, 1, dtype="float32", cache=False) == doc
    assert cached() == files  # cache=False neither reads nor writes
    reshard.vllm.layout(toy_llama, 1, dtype="bfloat16")  # another key
    assert len(cached()) == len(files) + 1


def test_the_command_writes_the_document_scatter_reads(toy_llama, tmp_path):
    out = tmp_path / "maps.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-m", "reshard.vllm", "layout", str(toy_llama),
                           "--tp", "2", "--dtype", "float32", "-o", str(out)],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text()) == learned(toy_llama, 2)
    bad = subprocess.run([sys.executable, "-m", "reshard.vllm", "layout", str(toy_llama),
                          "--tp", "0", "-o", str(out)], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "--tp 0" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "reshard.vllm", "layout", str(tmp_path),
                              "-o", str(out)], capture_output=True, text=True, env=env)
    assert missing.returncode == 2 and "no config.json" in missing.stderr


def test_tied_embeddings_are_one_parameter_under_the_name_vllm_keeps(tmp_path):
    import transformers
    torch.manual_seed(2)
    config = transformers.LlamaConfig(vocab_size=250, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=32,
                                      max_position_embeddings=256, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).to(torch.float32).save_pretrained(tmp_path)
    full = hf_tensors(tmp_path)
    assert "lm_head.weight" not in full
    doc = reshard.vllm.layout(tmp_path, 1, dtype="float32", cache=False)
    # vLLM's state dict holds the tied pair once, under the smaller name (its sharded-state
    # loader counts it so): the checkpoint's embedding lands in "lm_head.weight".
    assert "lm_head.weight" in doc["buffers"] and "model.embed_tokens.weight" not in doc["buffers"]
    got = rank_tensors(doc, full, 0)
    assert torch.equal(got["lm_head.weight"][:250], full["model.embed_tokens.weight"])


def model_dir_of(tmp_path, config, tensors, drop=()):
    """The toy model (config as a dict) with its tensors, less those of ``drop``."""
    import toy
    return toy.write(str(tmp_path), config, {k: v for k, v in tensors.items() if k not in drop})


@pytest.mark.parametrize("missing, holder", [
    ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.qkv_proj.weight"),
    ("model.layers.1.self_attn.q_proj.bias", "model.layers.1.self_attn.qkv_proj.bias"),
    ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"),
    ("model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"),
], ids=["k_proj", "q_proj_bias", "up_proj", "down_proj"])
def test_a_tensor_missing_from_the_checkpoint_is_refused_never_padding(tmp_path, missing, holder):
    """The elements a missing tensor should have written (a fused parameter's K rows, its Q
    bias) are no padding: padding is only what vLLM's loaders leave for every checkpoint (the
    vocabulary's tail, the attention scales)."""
    import toy
    config = toy.llama_config()
    model = model_dir_of(tmp_path, config, toy.weights(config, 1), drop=[missing])
    with pytest.raises(reshard.vllm.LayoutError) as e:
        reshard.vllm.layout(model, 1, dtype="float32", cache=False)
    assert holder in str(e.value) and "written by no checkpoint tensor" in str(e.value)
    if holder != missing:  # a fused parameter: the missing tensor by name
        assert str(e.value).startswith(f"checkpoint tensor {missing!r} is missing"), e.value


def lying(config_text):
    return lambda d: (d / "config.json").write_text(config_text(json.loads(
        (d / "config.json").read_text())))


@pytest.mark.parametrize("lie, words, status", [
    (lying(lambda c: json.dumps(dict(c, vocab_size=300))),
     "loading checkpoint tensor 'lm_head.weight': AssertionError: \\(no message\\)", 1),
    (lying(lambda c: json.dumps(dict(c, vocab_size=2 ** 31))),
     "config.json does not describe this checkpoint", 1),
    (lying(lambda c: json.dumps(c)[:-1] + ', "model_type": "mistral"}'),
     'duplicate key "model_type"', 2),
    (lying(lambda c: json.dumps(c)[:-1] + ', "x": ' + "[" * 100000 + "]" * 100000 + "}"),
     "nests deeper than 128 levels", 2),
    (lying(lambda c: "[1, 2]"), "expected an object", 2),
], ids=["vocab_past_rows", "vocab_2^31", "model_type_twice", "deep", "not_an_object"])
def test_a_config_that_does_not_describe_the_checkpoint_is_a_layout_error(toy_llama, tmp_path,
                                                                          lie, words, status):
    """Refused with LayoutError naming the problem, before vLLM allocates what the config
    claims (a vocabulary of 2^31 rows) or its reader recurses; malformed JSON is the
    command's exit 2, a config that lies about the checkpoint its exit 1."""
    import shutil
    from reshard.vllm.__main__ import main
    model = tmp_path / "model"
    shutil.copytree(toy_llama, model)
    lie(model)
    with pytest.raises(reshard.vllm.LayoutError, match=words):
        reshard.vllm.layout(model, 1, dtype="float32", cache=False)
    assert main(["layout", str(model), "--no-cache", "-o", str(tmp_path / "o.json")]) == status
    assert not (tmp_path / "o.json").exists()


OLMO2 = """
import sys, torch, transformers
torch.manual_seed(3)
config = transformers.Olmo2Config(vocab_size=250, hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=2, max_position_embeddings=256,
                                  tie_word_embeddings=False, eos_token_id=2, pad_token_id=0,
                                  bos_token_id=1)
transformers.Olmo2ForCausalLM(config).to(torch.float32).save_pretrained(sys.argv[1])
"""


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory):
    """A toy OLMo2, which vLLM 0.32 serves through its Transformers backend (no model class
    of its own). Written in a process of its own: once vLLM is imported, transformers' OLMo2
    modules are vLLM's custom ops, which build only inside vLLM's config."""
    out = tmp_path_factory.mktemp("olmo2")
    subprocess.run([sys.executable, "-c", OLMO2, str(out)], check=True, capture_output=True)
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_a_model_of_the_transformers_backend_is_laid_out(olmo2, tp):
    """vLLM builds it through its Transformers backend (transformers' modules, parameters in
    the model config's dtype, q/k/v and gate/up fused); the layout learned holds what
    transformers' plan gives each rank."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import get_model_architecture
    model = olmo2
    config = EngineArgs(model=str(model), dtype="float32", skip_tokenizer_init=True,
                        enforce_eager=True).create_engine_config()
    assert get_model_architecture(config.model_config)[0].__name__.startswith("Transformers")
    doc = reshard.vllm.layout(model, tp, dtype="float32", cache=False)
    full = hf_tensors(model)
    p = "model.layers.0."
    for r in range(tp):
        got = rank_tensors(doc, full, r)
        assert torch.equal(got[p + "self_attn.qkv_proj.weight"], torch.cat(
            [rows(full[p + f"self_attn.{x}_proj.weight"], r, tp) for x in "qkv"]))
        assert torch.equal(got[p + "mlp.gate_up_proj.weight"], torch.cat(
            [rows(full[p + f"mlp.{x}_proj.weight"], r, tp) for x in ("gate", "up")]))
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            assert torch.equal(got[p + name + ".weight"], cols(full[p + name + ".weight"], r, tp))
        assert torch.equal(got["model.norm.weight"], full["model.norm.weight"])
        assert all(t.dtype == torch.float32 for t in got.values())


def _lora_layers(rank, tp):
    """Rank `rank`'s LoRA layers of the toy Llama's qkv_proj, gate_up_proj and o_proj (down_proj
    is another RowParallelLinear) as vLLM builds them, which slice a PEFT adapter's tensors."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.lora.layers import (MergedColumnParallelLinearWithLoRA,
                                  MergedQKVParallelLinearWithLoRA, RowParallelLinearWithLoRA)
    from vllm.model_executor.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                                   RowParallelLinear)

    from reshard.vllm.layout import _parallel_state
    with set_current_vllm_config(VllmConfig()), _parallel_state(rank, tp), \
            torch.device("meta"):
        return (MergedQKVParallelLinearWithLoRA(QKVParallelLinear(64, 32, 2, 1, bias=False)),
                MergedColumnParallelLinearWithLoRA(
                    MergedColumnParallelLinear(64, [96, 96], bias=False)),
                RowParallelLinearWithLoRA(RowParallelLinear(64, 64, bias=False)))


def test_an_adapter_at_vllms_layout_is_what_vllms_lora_layers_slice(toy_llama, tmp_path):
    """`scatter ADAPTER --maps` with vLLM's layout of the base: on each rank, the lora_B of
    q, k and v stacked as qkv_proj's rows are is what vLLM's MergedQKVParallelLinearWithLoRA
    slices out of them (one key/value head, replicated at TP 2), gate and up's what
    MergedColumnParallelLinearWithLoRA slices, each A whole; o_proj's A is what
    RowParallelLinearWithLoRA slices, its B whole."""
    from safetensors.torch import load_file, save_file
    doc = learned(toy_llama, 2)
    g = torch.Generator().manual_seed(5)
    shapes = {"q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64), "o_proj": (64, 64),
              "gate_proj": (96, 64), "up_proj": (96, 64), "down_proj": (64, 96)}
    pre = "base_model.model.model.layers.{}.{}.{}"
    adapter = {}
    for layer in range(2):
        for m, (out, inp) in shapes.items():
            block = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            adapter[pre.format(layer, block, m) + ".lora_A.weight"] = torch.randn(4, inp, generator=g)
            adapter[pre.format(layer, block, m) + ".lora_B.weight"] = torch.randn(out, 4, generator=g)
    src = tmp_path / "adapter"
    src.mkdir()
    save_file(adapter, src / "adapter_model.safetensors")
    (src / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": list(shapes)}))
    (tmp_path / "maps.json").write_text(json.dumps(doc))
    run_reshard("scatter", src, "--maps", tmp_path / "maps.json", "-o", tmp_path / "tp2")
    manifest = json.loads((tmp_path / "tp2" / "reshard.json").read_text())
    for rank in range(2):
        got = {}
        for f in manifest["files"][str(rank)]:
            got.update(load_file(tmp_path / "tp2" / f))
        qkv, gate_up, o = _lora_layers(rank, 2)
        for layer in range(2):
            a = {m: adapter[pre.format(layer, b, m) + ".lora_A.weight"] for m, b in (
                ("q_proj", "self_attn"), ("k_proj", "self_attn"), ("v_proj", "self_attn"),
                ("gate_proj", "mlp"), ("up_proj", "mlp"), ("o_proj", "self_attn"))}
            b = {m: adapter[pre.format(layer, blk, m) + ".lora_B.weight"] for m, blk in (
                ("q_proj", "self_attn"), ("k_proj", "self_attn"), ("v_proj", "self_attn"),
                ("gate_proj", "mlp"), ("up_proj", "mlp"), ("o_proj", "self_attn"))}
            fused = pre.format(layer, "self_attn", "qkv_proj") + ".lora_B.weight"
            assert torch.equal(got[fused], torch.cat(qkv.slice_lora_b([b["q_proj"], b["k_proj"],
                                                                        b["v_proj"]])))
            for m, want in zip(("q_proj", "k_proj", "v_proj"),
                               qkv.slice_lora_a([a["q_proj"], a["k_proj"], a["v_proj"]])):
                assert torch.equal(got[pre.format(layer, "self_attn", m) + ".lora_A.weight"], want)
            fused = pre.format(layer, "mlp", "gate_up_proj") + ".lora_B.weight"
            assert torch.equal(got[fused], torch.cat(gate_up.slice_lora_b([b["gate_proj"],
                                                                           b["up_proj"]])))
            o_name = pre.format(layer, "self_attn", "o_proj")
            assert torch.equal(got[o_name + ".lora_A.weight"], o.slice_lora_a(a["o_proj"]))
            assert torch.equal(got[o_name + ".lora_B.weight"], o.slice_lora_b(b["o_proj"]))
    # And it gathers back, bit for bit.
    run_reshard("gather", tmp_path / "tp2", "-o", tmp_path / "back")
    back = load_file(tmp_path / "back" / "adapter_model.safetensors")
    assert back.keys() == adapter.keys() and all(torch.equal(back[k], adapter[k]) for k in back)
