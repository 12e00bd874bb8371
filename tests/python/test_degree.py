"""reshard degree (DESIGN 8) against the installed transformers: its plans, its style registry,
its config classes' defaults and its DistributedConfig."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import transformers
from safetensors.numpy import load_file as load_numpy
from safetensors.numpy import save_file
from transformers import AutoConfig

import moe_truth as truth
from conftest import REPO

CONFIGS = REPO / "tests" / "data" / "hf-configs"
REGISTRY = REPO / "src" / "reshard" / "hf" / "tp_plans.json"

# Largest degree per config under the registry's transformers release (None: no plan).
EXPECTED_MAX = {
    "HuggingFaceTB--SmolLM2-1.7B-Instruct": 32,
    "HuggingFaceTB--SmolLM2-135M.printout": 3,
    "Qwen--Qwen2-72B": 8,
    "Qwen--Qwen3-0.6B": 8,
    "Qwen--Qwen3-32B": 8,
    "Qwen--Qwen3-8B": 8,
    "meta-llama--Llama-4-Scout-17B-16E-Instruct": 8,
    "meta-llama--Meta-Llama-3.1-8B": 8,
    "mistralai--Mixtral-8x7B-v0.1": 8,
    "mlc_preset--gemma2_2b": 4,
    "mlc_preset--gemma3_1b_it": 1,
    "mlc_preset--gpt2": None,
    "mlc_preset--gpt_bigcode": None,
    "mlc_preset--llama3_2_1b": 8,
    "mlc_preset--mistral_7b": 8,
    "mlc_preset--olmo2_7b": 4096,
    "mlc_preset--phi-3_5": 1024,
    "mlc_preset--qwen2_0_5b": 2,
    "mlc_preset--smollm2_360m": 5,
    "mlc_preset--starcoder2": 4,
    "tiiuae--falcon-7b-instruct": None,
}
SPLIT_STYLES = {"colwise", "rowwise"}
MLP = {"gate_proj", "up_proj", "down_proj", "c_fc", "c_proj"}


def run(reshard_bin, *args):
    return subprocess.run([reshard_bin, "degree", *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def degree_json(reshard_bin, *args):
    r = run(reshard_bin, *args, "--json")
    assert r.returncode in (0, 1), r.stderr
    return r, json.loads(r.stdout)


def hf_config(path):
    d = json.loads(path.read_text())
    d.pop("source", None)
    return AutoConfig.for_model(d.pop("model_type"), **d)


def test_registry_is_what_the_installed_transformers_generates(tmp_path):
    out = tmp_path / "tp_plans.json"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_tp_plans.py"), "-o", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    fresh, committed = out.read_text(), REGISTRY.read_text()
    assert fresh == committed, (
        "src/reshard/hf/tp_plans.json drifted from transformers "
        f"{transformers.__version__}: run scripts/gen_tp_plans.py and commit it")


def test_registry_styles_are_transformers_registered_styles():
    from transformers.distributed import expert_parallel, tensor_parallel  # noqa: F401
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
    reg = json.loads(REGISTRY.read_text())
    assert reg["transformers_version"] == transformers.__version__
    assert reg["styles"] == sorted(ALL_PARALLEL_STYLES.keys())


def test_every_sample_config_is_covered():
    assert {p.stem for p in CONFIGS.glob("*.json")} == set(EXPECTED_MAX)


@pytest.mark.parametrize("name", sorted(EXPECTED_MAX))
def test_degree_of_every_sample_config(reshard_bin, name):
    path = CONFIGS / f"{name}.json"
    r, answer = degree_json(reshard_bin, path)
    cfg = hf_config(path)
    text = cfg.get_text_config()
    plan = type(cfg).base_model_tp_plan or type(text).base_model_tp_plan
    assert answer["max_tp_degree"] == EXPECTED_MAX[name], answer
    if not plan:
        # transformers has no plan: refused, exit 1.
        assert answer["refusal"]["reason"] == "no_tp_plan" and r.returncode == 1
        assert "full copy" in answer["refusal"]["message"]
        return
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    # The counts come from the config object transformers builds (its defaults included).
    by_meaning = {"attention heads": heads, "key/value heads": kv, "vocabulary entries": text.vocab_size}
    for c in answer["constraints"]:
        if c["meaning"] in by_meaning:
            assert c["count"] == by_meaning[c["meaning"]], c
    # Every plain split attention entry of transformers' plan is a constraint; the vocabulary and
    # the MLP are split in ceil chunks (a shorter last rank) and bind nothing.
    reported = {c["module"] for c in answer["constraints"]}
    for module, style in type(text).base_model_tp_plan.items():
        if style in SPLIT_STYLES and "experts" not in module:
            assert (module in reported) == ("attn" in module), (module, style)
    assert all(c["meaning"] not in ("vocabulary entries", "intermediate features")
               for c in answer["constraints"] if c["style"] in SPLIT_STYLES), answer["constraints"]
    # The answer is the gcd of the counts reported, and its divisors are the degrees.
    g = 0
    for c in answer["constraints"]:
        g = math.gcd(g, c["count"])
    assert answer["max_tp_degree"] == g
    assert answer["degrees"] == [d for d in range(1, g + 1) if g % d == 0]
    # Dense llama-like plans: gcd(heads, kv heads, intermediate, vocabulary), computed here.
    styles = set(type(text).base_model_tp_plan.values()) - {"replicated_with_grad_allreduce"}
    leaves = {m.rsplit(".", 1)[-1] for m in type(text).base_model_tp_plan}
    if styles <= SPLIT_STYLES and leaves <= {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm",
                                             "k_norm"} | MLP:
        assert g == math.gcd(heads, kv)
    assert (r.returncode == 1) == (g == 1)


def test_smollm2_135m_refuses_two_ranks_naming_nine_heads(reshard_bin):
    path = CONFIGS / "HuggingFaceTB--SmolLM2-135M.printout.json"
    r, answer = degree_json(reshard_bin, path, "--tp", 2)
    assert r.returncode == 1
    assert answer["refusal"]["reason"] == "degree_does_not_divide"
    msg = "layers.*.self_attn.q_proj (colwise) splits 9 attention heads; 2 does not divide 9"
    assert msg in answer["refusal"]["message"]
    assert msg in r.stderr
    assert answer["requested"] == 2 and answer["chosen"] == 3
    r, answer = degree_json(reshard_bin, path, "--tp", 3)
    assert r.returncode == 0 and answer["chosen"] == 3 and answer["refusal"] is None
    r, answer = degree_json(reshard_bin, path, "--tp", 4)
    assert r.returncode == 1 and answer["chosen"] is None
    assert "pipeline or expert parallelism" in answer["refusal"]["message"]
    # The text form says the same.
    r = run(reshard_bin, path, "--tp", 2)
    assert r.returncode == 1 and "largest tensor-parallel degree: 3" in r.stdout
    assert msg in r.stderr


def test_json_has_exactly_the_documented_keys(reshard_bin):
    _, answer = degree_json(reshard_bin, CONFIGS / "Qwen--Qwen3-8B.json", "--tp", 4)
    assert list(answer) == ["max_tp_degree", "degrees", "requested", "chosen", "constraints",
                            "refusal", "vllm_mxfp4", "combinations"]
    assert answer["vllm_mxfp4"] is None  # only vLLM's MXFP4 experts (gpt-oss) have one
    assert list(answer["combinations"]) == ["tp", "tp_ep"]
    assert answer["requested"] == 4 and answer["chosen"] == 4 and answer["refusal"] is None
    for c in answer["constraints"]:
        assert list(c) == ["module", "style", "count", "meaning"]
    _, answer = degree_json(reshard_bin, CONFIGS / "mlc_preset--gpt2.json")
    assert list(answer["refusal"]) == ["reason", "message"]


def test_model_without_plan_is_refused(reshard_bin):
    r = run(reshard_bin, CONFIGS / "tiiuae--falcon-7b-instruct.json", "--tp", 2)
    assert r.returncode == 1
    assert 'model type "falcon" has no tensor-parallel plan' in r.stderr
    assert "N times the memory" in r.stderr


def test_unregistered_style_is_refused_as_transformers_would(reshard_bin):
    from transformers.distributed import tensor_parallel  # noqa: F401
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
    path = CONFIGS / "mlc_preset--llama3_2_1b.json"
    # local_colwise: a style of older releases that the installed one does not register.
    assert "local_colwise" not in ALL_PARALLEL_STYLES
    dist = json.dumps({"tp_size": 2, "tp_plan": {"layers.*.mlp.up_proj": "local_colwise"}})
    r, answer = degree_json(reshard_bin, path, "--distributed-config", dist)
    assert r.returncode == 1
    assert answer["refusal"]["reason"] == "unregistered_style"
    assert "layers.*.mlp.up_proj (local_colwise)" in answer["refusal"]["message"]
    assert "fail" in answer["refusal"]["message"]
    # Llama 4's projector style: refused exactly when the installed transformers does not
    # register it (transformers 5.24 registers colwise_rep; releases that did not, failed).
    dist = json.dumps({"tp_size": 2,
                       "tp_plan": {"layers.*.mlp.up_proj": "colwise_rep"}})
    r, answer = degree_json(reshard_bin, path, "--distributed-config", dist)
    refused = answer["refusal"] is not None and answer["refusal"]["reason"] == "unregistered_style"
    assert refused == ("colwise_rep" not in ALL_PARALLEL_STYLES)
    # Llama 4's own plan, as the installed release writes it, uses only registered styles.
    llama4 = json.loads(REGISTRY.read_text())["model_types"]["llama4"]["tp_plan"]
    assert llama4 == transformers.Llama4Config.base_model_tp_plan
    assert set(llama4.values()) <= set(ALL_PARALLEL_STYLES.keys())


def test_vllm_replicates_kv_heads_and_pads_the_vocabulary(reshard_bin):
    path = CONFIGS / "meta-llama--Meta-Llama-3.1-8B.json"
    r, answer = degree_json(reshard_bin, path, "--tp", 16)
    assert r.returncode == 1
    assert "splits 8 key/value heads; 16 does not divide 8" in answer["refusal"]["message"]
    r, answer = degree_json(reshard_bin, path, "--tp", 16, "--engine", "vllm")
    assert r.returncode == 0, answer
    assert answer["max_tp_degree"] == 32 and 16 in answer["degrees"]
    # Falcon-less example with an odd vocabulary: vLLM pads 32001 to 32064 = 64 * 501.
    phi = CONFIGS / "mlc_preset--phi-3_5.json"
    _, answer = degree_json(reshard_bin, phi, "--engine", "vllm")
    vocab = [c for c in answer["constraints"] if c["module"] == "lm_head"]
    assert vocab and vocab[0]["count"] == 32064  # 32064 is already a multiple of 64
    assert answer["max_tp_degree"] == 32


def test_distributed_config(reshard_bin, tmp_path):
    path = CONFIGS / "HuggingFaceTB--SmolLM2-135M.printout.json"
    r, answer = degree_json(reshard_bin, path, "--distributed-config", '{"tp_size": 2}')
    assert r.returncode == 1 and answer["requested"] == 2
    r = run(reshard_bin, path, "--distributed-config", '{"tp_size": 3, "tp_sise": 4}')
    assert r.returncode == 2
    assert 'unknown key(s) "tp_sise"' in r.stderr and "tp_size" in r.stderr
    r = run(reshard_bin, path, "--tp", 3, "--distributed-config", '{"tp_size": 9}')
    assert r.returncode == 2 and "disagree" in r.stderr
    # The keys accepted are DistributedConfig's fields.
    from transformers.distributed.configuration_utils import DistributedConfig
    import dataclasses
    fields = [f.name for f in dataclasses.fields(DistributedConfig)]
    assert json.loads(REGISTRY.read_text())["distributed_config_keys"] == fields
    file = tmp_path / "dist.json"
    file.write_text(json.dumps({"tp_size": 3, "pp_size": 1}))
    r, answer = degree_json(reshard_bin, path, "--distributed-config", file)
    assert r.returncode == 0 and answer["chosen"] == 3


def test_expert_parallel_uses_the_ep_plan(reshard_bin):
    path = CONFIGS / "mistralai--Mixtral-8x7B-v0.1.json"
    plan = transformers.MixtralConfig.base_model_ep_plan
    r, answer = degree_json(reshard_bin, path, "--tp", "8", "--distributed-config",
                            '{"tp_plan": "auto", "ep_size": 8}')
    assert r.returncode == 0, answer
    modules = {c["module"]: c for c in answer["constraints"]}
    for module, style in plan.items():
        if style == "grouped_gemm":
            assert modules[module]["count"] == 8 and modules[module]["meaning"] == "experts"
    assert answer["combinations"]["tp_ep"] == [1, 2, 4, 8]
    # The deprecated flag alone sets tp_plan = {}, which transformers refuses at tp_size 8.
    r, answer = degree_json(reshard_bin, path, "--distributed-config",
                            '{"tp_size": 8, "enable_expert_parallel": true}')
    assert r.returncode == 1 and answer["refusal"]["reason"] == "distributed_config", answer
    r, answer = degree_json(reshard_bin, CONFIGS / "Qwen--Qwen3-8B.json", "--distributed-config",
                            '{"tp_size": 2, "ep_size": 2}')
    assert r.returncode == 1 and answer["refusal"]["reason"] == "no_ep_plan"
    assert answer["combinations"]["tp_ep"] is None


# transformers' own verdicts on the MoE toy models (moe_truth.py), per load mode.
MOE_VERDICTS = sorted((name, mode) for name, case in truth.CASES.items() for mode in case.works)


@pytest.mark.parametrize("name,mode", MOE_VERDICTS)
def test_degree_verdict_on_moe_matches_what_transformers_does(name, mode, moe_truth,
                                                              reshard_bin, tmp_path):
    works = moe_truth.works(name, mode)
    assert works == truth.CASES[name].works[mode], moe_truth.statuses(name, mode)
    config = moe_truth.checkpoint_dir(name) / "config.json"
    distributed = json.dumps(truth.MODES[mode])
    r = run(reshard_bin, config, "--tp", truth.WORLD, "--distributed-config", distributed)
    errors = [s["error"] for s in moe_truth.statuses(name, mode)]
    assert r.returncode == (0 if works else 1), (errors, r.stdout, r.stderr)
    if not works and "Cannot evenly shard" in errors[0]:
        assert errors[0].split(": ", 1)[1] in r.stderr  # transformers' own words
    # scatter --config refuses the same degrees (at TP, where it takes no distributed config)
    if mode == "tp2":
        s = subprocess.run([reshard_bin, "scatter", str(moe_truth.checkpoint_dir(name)),
                            "--config", str(config), "--tp", str(truth.WORLD), "-o",
                            str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
        if not works:
            assert s.returncode == 1 and r.stderr.split(": ", 1)[1].strip() in s.stderr, s.stderr


def test_older_transformers_rules_leave_out_the_lm_head(reshard_bin, tmp_path):
    config = {"model_type": "llama", "num_attention_heads": 8, "num_key_value_heads": 8,
              "intermediate_size": 64, "vocab_size": 49155, "tie_word_embeddings": True}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    # 5.15 to 5.23: the LM head splits the vocabulary evenly.
    r, answer = degree_json(reshard_bin, path, "--transformers-version", "5.20")
    assert answer["max_tp_degree"] == 1 and r.returncode == 1
    assert {"module": "lm_head", "style": "colwise_gather_output", "count": 49155,
            "meaning": "vocabulary entries"} in answer["constraints"]
    # 5.24 gives the last rank a shorter slice: the vocabulary binds nothing.
    r, answer = degree_json(reshard_bin, path)
    assert answer["max_tp_degree"] == 8 and r.returncode == 0
    r, answer = degree_json(reshard_bin, path, "--transformers-version", "5.14.1")
    assert answer["max_tp_degree"] == 8 and r.returncode == 0
    assert all(c["meaning"] != "vocabulary entries" for c in answer["constraints"])
    r = run(reshard_bin, path, "--transformers-version", "latest")
    assert r.returncode == 2


def test_malformed_config_exits_2(reshard_bin, tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"hidden_size": 4}')
    r = run(reshard_bin, path)
    assert r.returncode == 2 and "model_type" in r.stderr
    path.write_text('{"model_type": "llama", "num_attention_heads": "nine"}')
    r = run(reshard_bin, path)
    assert r.returncode == 2 and "num_attention_heads" in r.stderr


def test_emit_maps_from_safetensors_headers(reshard_bin, tmp_path):
    config = {"model_type": "llama", "hidden_size": 16, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 4, "intermediate_size": 8,
              "vocab_size": 32, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = tmp_path / "ckpt"
    weights.mkdir()
    z = lambda *s: np.zeros(s, dtype=np.float32)  # noqa: E731
    tensors = {"model.embed_tokens.weight": z(32, 16),
               "model.layers.0.self_attn.q_proj.weight": z(16, 16),
               "model.layers.0.self_attn.k_proj.weight": z(8, 16),
               "model.layers.0.self_attn.o_proj.weight": z(16, 16),
               "model.layers.0.mlp.down_proj.weight": z(16, 8),
               "model.norm.weight": z(16),
               "lm_head.weight": z(32, 16)}
    save_file(tensors, str(weights / "model.safetensors"))
    out = tmp_path / "maps.json"
    r = run(reshard_bin, tmp_path / "config.json", "--tp", 2, "--emit-maps", out,
            "--weights", weights)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert set(doc) - {"version"} == set(tensors)
    shard = lambda n: [doc[n]["ranks"][r]["shard_shape"] for r in ("0", "1")]  # noqa: E731
    assert shard("model.layers.0.self_attn.q_proj.weight") == [[8, 16]] * 2
    assert shard("model.layers.0.self_attn.k_proj.weight") == [[4, 16]] * 2
    assert shard("model.layers.0.self_attn.o_proj.weight") == [[16, 8]] * 2
    assert shard("model.layers.0.mlp.down_proj.weight") == [[16, 4]] * 2
    assert shard("lm_head.weight") == [[16, 16]] * 2
    assert shard("model.norm.weight") == [[16]] * 2
    assert shard("model.embed_tokens.weight") == [[16, 16]] * 2    # embedding_rowwise
    # A shape that disagrees with the config is an error, and nothing is written.
    tensors["model.layers.0.self_attn.k_proj.weight"] = z(7, 16)
    save_file(tensors, str(weights / "model.safetensors"))
    out2 = tmp_path / "maps2.json"
    r = run(reshard_bin, tmp_path / "config.json", "--tp", 2, "--emit-maps", out2,
            "--weights", weights)
    assert r.returncode == 1 and "disagrees with the config" in r.stderr
    assert not out2.exists()


def qwen2_checkpoint(path, kv_heads=2):
    """A tiny Qwen2: 4 heads of 4, `kv_heads` key/value heads, MLP 8, vocabulary 32."""
    config = {"model_type": "qwen2", "hidden_size": 16, "num_attention_heads": 4,
              "num_key_value_heads": kv_heads, "head_dim": 4, "intermediate_size": 8,
              "vocab_size": 32, "num_hidden_layers": 1, "tie_word_embeddings": False}
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(3)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    kv = kv_heads * 4
    tensors = {"model.embed_tokens.weight": r(32, 16),
               "model.layers.0.self_attn.q_proj.weight": r(16, 16),
               "model.layers.0.self_attn.q_proj.bias": r(16),
               "model.layers.0.self_attn.k_proj.weight": r(kv, 16),
               "model.layers.0.self_attn.k_proj.bias": r(kv),
               "model.layers.0.self_attn.v_proj.weight": r(kv, 16),
               "model.layers.0.self_attn.v_proj.bias": r(kv),
               "model.layers.0.self_attn.o_proj.weight": r(16, 16),
               "model.layers.0.mlp.gate_proj.weight": r(8, 16),
               "model.layers.0.mlp.up_proj.weight": r(8, 16),
               "model.layers.0.mlp.down_proj.weight": r(16, 8),
               "model.norm.weight": r(16),
               "lm_head.weight": r(32, 16)}
    save_file(tensors, str(path / "model.safetensors"))
    return path / "config.json", tensors


def test_convert_refuses_a_degree_the_models_plan_cannot_take(reshard_bin, tmp_path):
    config, _ = qwen2_checkpoint(tmp_path / "full")
    r = subprocess.run([reshard_bin, "scatter", tmp_path / "full", "--config", config, "--tp", "2",
                        "-o", tmp_path / "tp2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((tmp_path / "tp2" / "reshard.json").read_text())
    kv = {"module": "layers.*.self_attn.k_proj", "style": "colwise", "count": 2,
          "meaning": "key/value heads"}
    assert kv in manifest["constraints"]
    # convert --tp 8 would split 2 key/value heads in 8: refused as `degree` refuses it.
    r = subprocess.run([reshard_bin, "convert", tmp_path / "tp2", "--tp", "8", "-o", tmp_path / "tp8"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert not (tmp_path / "tp8").exists()
    refusal = json.loads(run(reshard_bin, config, "--tp", 8, "--json").stdout)["refusal"]["message"]
    assert refusal in r.stderr
    # A degree the plan takes converts, and the constraints travel with the checkpoint.
    r = subprocess.run([reshard_bin, "convert", tmp_path / "tp2", "--tp", "1", "-o", tmp_path / "tp1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "tp1" / "reshard.json").read_text())["constraints"] == \
        manifest["constraints"]


@pytest.mark.parametrize("key,value", [
    ("num_attention_heads", 0), ("num_attention_heads", None), ("vocab_size", 0),
    ("vocab_size", None), ("intermediate_size", 0), ("intermediate_size", None),
    ("num_key_value_heads", 0), ("hidden_size", 0), ("head_dim", 0),
    ("num_attention_heads", 2**63), ("vocab_size", 10**30)])
def test_zero_null_or_out_of_range_counts_are_refused_naming_the_key(reshard_bin, tmp_path, key,
                                                                     value):
    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 8,
              "num_key_value_heads": 8, "intermediate_size": 64, "vocab_size": 32}
    config[key] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    r = run(reshard_bin, path, "--tp", 2)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert key in r.stderr and "works" not in r.stdout


def test_null_key_value_heads_and_head_dim_are_derived(reshard_bin, tmp_path):
    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 8,
              "num_key_value_heads": None, "head_dim": None, "intermediate_size": 64,
              "vocab_size": 32}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    r, answer = degree_json(reshard_bin, path)
    assert r.returncode == 0 and answer["max_tp_degree"] == 8


@pytest.mark.parametrize("tp", ["99999999999999999999", "9223372036854775808", "0", "-2", "2x",
                                "1048577", ""])
def test_out_of_range_or_malformed_degree_is_a_usage_error(reshard_bin, tp):
    r = run(reshard_bin, CONFIGS / "Qwen--Qwen2-72B.json", "--tp", tp)
    assert r.returncode == 2, (tp, r.stdout, r.stderr)
    assert "works" not in r.stdout


@pytest.mark.parametrize("weight_map", [
    {"model.norm.weight": "part.safetensors"},                                  # lm_head unlisted
    {"model.norm.weight": "part.safetensors", "lm_head.weight": ".."},
    {"model.norm.weight": "part.safetensors", "lm_head.weight": ""},
    {"model.norm.weight": "part.safetensors", "lm_head.weight": "part.safetensors",
     "model.gone.weight": "part.safetensors"}])                                # listed, not stored
def test_emit_maps_reads_the_index_as_the_checkpoint_reader_does(reshard_bin, tmp_path, weight_map):
    config = {"model_type": "llama", "hidden_size": 16, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 8, "vocab_size": 32}
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = tmp_path / "ckpt"
    weights.mkdir()
    save_file({"model.norm.weight": np.zeros(16, np.float32),
               "lm_head.weight": np.zeros((32, 16), np.float32)}, str(weights / "part.safetensors"))
    (weights / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    out = tmp_path / "maps.json"
    r = run(reshard_bin, tmp_path / "config.json", "--tp", 2, "--emit-maps", out, "--weights", weights)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert not out.exists()


@pytest.mark.parametrize("text,what", [
    ('{"model_type": "llama", "num_attention_heads": 8, "num_attention_heads": 9}',
     'duplicate key "num_attention_heads"'),
    ('{"model_type": "llama", "text_config": {"vocab_size": 4, "vocab_size": 8}}',
     'duplicate key'),
    ('{"model_type": "llama"}\x00garbage{{{', "after the JSON value")])
def test_config_with_duplicate_keys_or_trailing_bytes_is_refused(reshard_bin, tmp_path, text,
                                                                 what):
    path = tmp_path / "config.json"
    path.write_bytes(text.encode())
    r = run(reshard_bin, path, "--tp", 2)
    assert r.returncode == 2 and what in r.stderr, (r.stdout, r.stderr)
    assert "works" not in r.stdout


@pytest.mark.parametrize("dist,what", [
    ('{"tp_size": 2, "tp_size": 4}', 'duplicate key "tp_size"'),
    ('{"tp_plan": {"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.up_proj": "rowwise"}}',
     "duplicate key"),
    ('{"tp_size": 2} trailing', "malformed JSON")])
def test_distributed_config_with_duplicate_keys_or_trailing_bytes_is_refused(reshard_bin, dist,
                                                                             what):
    r = run(reshard_bin, CONFIGS / "Qwen--Qwen2-72B.json", "--distributed-config", dist)
    assert r.returncode == 2 and what in r.stderr, (r.stdout, r.stderr)


def scatter_config(reshard_bin, full, config, tp, out):
    return subprocess.run([reshard_bin, "scatter", full, "--config", config, "--tp", str(tp),
                           "-o", out], capture_output=True, text=True, timeout=120)


def test_scatter_stacks_per_expert_tensors_as_transformers_does(reshard_bin, tmp_path):
    # Mixtral stores one tensor per expert; transformers stacks them into experts.gate_up_proj
    # (each expert's w1 rows, then its w3 rows) and experts.down_proj at load and splits those:
    # at TP 2 rank r holds rows [3r, 3r + 3) of every expert's w1 and w3 (docs/moe.md).
    config = {"model_type": "mixtral", "hidden_size": 8, "num_attention_heads": 2,
              "num_key_value_heads": 2, "head_dim": 4, "intermediate_size": 6,
              "num_local_experts": 2, "vocab_size": 16}
    full = tmp_path / "full"
    full.mkdir()
    (full / "config.json").write_text(json.dumps(config))
    values = iter(range(10**6))
    t = lambda *s: np.array([next(values) for _ in range(math.prod(s))],  # noqa: E731
                            dtype=np.float32).reshape(s)
    experts = {f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight": t(*shape)
               for e in range(2) for w, shape in (("w1", (6, 8)), ("w2", (8, 6)), ("w3", (6, 8)))}
    save_file({"model.layers.0.block_sparse_moe.gate.weight": t(2, 8), **experts},
              str(full / "model.safetensors"))
    out = tmp_path / "tp2"
    r = scatter_config(reshard_bin, full, full / "config.json", 2, out)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((out / "reshard.json").read_text())
    for rank in range(2):
        held = {}
        for file in manifest["files"][str(rank)]:
            held.update(load_numpy(str(out / file)))
        rows = slice(3 * rank, 3 * rank + 3)
        prefix = "model.layers.0.block_sparse_moe.experts"
        want = np.stack([np.concatenate([experts[f"{prefix}.{e}.w1.weight"][rows],
                                         experts[f"{prefix}.{e}.w3.weight"][rows]])
                         for e in range(2)])
        np.testing.assert_array_equal(held["model.layers.0.mlp.experts.gate_up_proj"], want)


def test_scatter_gives_the_last_rank_the_short_vocabulary_slice(reshard_bin, tmp_path):
    config = {"model_type": "llama", "hidden_size": 16, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 4, "intermediate_size": 9,
              "vocab_size": 251, "tie_word_embeddings": False}
    full = tmp_path / "full"
    full.mkdir()
    (full / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(5)
    emb = rng.standard_normal((251, 16)).astype(np.float32)
    up = rng.standard_normal((9, 16)).astype(np.float32)
    save_file({"model.embed_tokens.weight": emb, "model.layers.0.mlp.up_proj.weight": up},
              str(full / "model.safetensors"))
    r = scatter_config(reshard_bin, full, full / "config.json", 2, tmp_path / "tp2")
    assert r.returncode == 0, r.stderr
    from safetensors.numpy import load_file
    for rank, rows, mlp in ((0, slice(0, 126), slice(0, 5)), (1, slice(126, 251), slice(5, 9))):
        shard = load_file(str(tmp_path / "tp2" / f"model-rank-{rank}-part-0.safetensors"))
        assert np.array_equal(shard["model.embed_tokens.weight"], emb[rows])
        assert np.array_equal(shard["model.layers.0.mlp.up_proj.weight"], up[mlp])
