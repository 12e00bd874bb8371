"""Megatron-Core dist-ckpt (torch_dist) -> Hugging Face, on checkpoints Megatron itself saves.

megatron-core (in .venv-megatron, see megatron_model.py) builds toy GPT models on the CPU at
TP 2 x PP 2 (world 4, gloo) with grouped-query attention, SwiGLU and MoE layers at EP 2, and
saves them with its own torch_dist writer. reshard gathers them with the model's config.json;
transformers loads the result with nothing missing or unexpected, every tensor equals the one
Megatron itself holds after loading the checkpoint at TP 1 x PP 1 (its own resharding), and the
logits equal Megatron's.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import reshard
from test_checkpoints import run

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
TOKENS = [1, 5, 7, 22, 99, 3, 4, 60, 2]


def megatron_python():
    python = os.environ.get("RESHARD_MEGATRON_PYTHON", str(REPO / ".venv-megatron" / "bin" / "python"))
    assert pathlib.Path(python).exists(), (
        f"{python} is missing: scripts/dev test installs Megatron-Core there "
        "(setup_megatron_venv), or point RESHARD_MEGATRON_PYTHON at a Python that has it")
    return python


def megatron(*args, procs=None, timeout=300, env=None):
    cmd = [megatron_python()]
    if procs:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"]
    cmd += [str(HERE / "megatron_model.py"), *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(env or {}))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]


# Megatron's model (its spec for megatron_model.py) and the Hugging Face config.json of the same
# model. The vocabulary is padded in Megatron (112 rows for 100 tokens).
QWEN3_MOE = (
    {"layers": 4, "hidden": 64, "heads": 8, "groups": 2, "ffn": 96, "vocab": 112, "experts": 4,
     "moe_ffn": 32, "moe_layers": [2, 4], "qk_norm": True, "tp": 2, "pp": 2, "ep": 2, "seed": 11},
    {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 4,
     "hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8,
     "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 4,
     "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
     "mlp_only_layers": [0, 2], "vocab_size": 100, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
     "max_position_embeddings": 64, "tie_word_embeddings": False, "attention_bias": False,
     "hidden_act": "silu", "torch_dtype": "float32"},
)
# Every layer MoE: homogeneous layers, saved stacked ([L, ...] and [L, E, ...]).
MIXTRAL = (
    {"layers": 2, "hidden": 64, "heads": 4, "groups": 2, "ffn": 32, "vocab": 100, "experts": 4,
     "moe_ffn": 32, "moe_layers": [1, 2], "tp": 2, "pp": 2, "ep": 2, "seed": 5},
    {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_hidden_layers": 2,
     "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
     "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
     "vocab_size": 100, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
     "max_position_embeddings": 64, "tie_word_embeddings": False, "hidden_act": "silu",
     "sliding_window": None, "torch_dtype": "float32"},
)
# Dense, with the bias of every projection (Megatron's fused QKV and SwiGLU biases split).
LLAMA_BIAS = (
    {"layers": 2, "hidden": 64, "heads": 4, "groups": 2, "ffn": 96, "vocab": 112, "bias": True,
     "qkv_bias": True, "tp": 2, "pp": 2, "seed": 3},
    {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2,
     "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
     "intermediate_size": 96, "vocab_size": 100, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
     "max_position_embeddings": 64, "tie_word_embeddings": False, "attention_bias": True,
     "mlp_bias": True, "hidden_act": "silu", "torch_dtype": "float32"},
)
MODELS = {"qwen3_moe": QWEN3_MOE, "mixtral": MIXTRAL, "llama_bias": LLAMA_BIAS}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (checkpoint dir, config.json path, Megatron's logits and TP-1 state)."""
    made = {}

    def get(name):
        if name not in made:
            spec, config = MODELS[name]
            d = tmp_path_factory.mktemp(name)
            (d / "spec.json").write_text(json.dumps(spec))
            (d / "config.json").write_text(json.dumps(config))
            (d / "tokens.json").write_text(json.dumps(TOKENS))
            megatron("save", d / "ckpt", d / "spec.json", procs=4)
            megatron("logits", d / "ckpt", d / "spec.json", d / "tokens.json", d / "ref.pt")
            made[name] = (d / "ckpt", d / "config.json", torch.load(d / "ref.pt"))
        return made[name]

    return get


def expected_hf(state, spec, config):
    """The Hugging Face tensors, sliced here from Megatron's own TP-1 state dict."""
    prefix = "block_sparse_moe" if config["model_type"] == "mixtral" else "mlp"
    names = ("w1", "w3", "w2") if prefix == "block_sparse_moe" else ("gate_proj", "up_proj", "down_proj")
    g, heads, d, h = spec["groups"], spec["heads"], spec["hidden"] // spec["heads"], spec["hidden"]
    n = heads // g
    v = config["vocab_size"]
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"][:v],
           "lm_head.weight": state["output_layer.weight"][:v],
           "model.norm.weight": state["decoder.final_layernorm.weight"]}
    for l in range(spec["layers"]):
        m, hf = f"decoder.layers.{l}.", f"model.layers.{l}."
        qkv = state[m + "self_attention.linear_qkv.weight"].view(g, n + 2, d, h)
        out[hf + "self_attn.q_proj.weight"] = qkv[:, :n].reshape(heads * d, h)
        out[hf + "self_attn.k_proj.weight"] = qkv[:, n].reshape(g * d, h)
        out[hf + "self_attn.v_proj.weight"] = qkv[:, n + 1].reshape(g * d, h)
        out[hf + "self_attn.o_proj.weight"] = state[m + "self_attention.linear_proj.weight"]
        if spec.get("qkv_bias"):
            qkv = state[m + "self_attention.linear_qkv.bias"].view(g, n + 2, d)
            out[hf + "self_attn.q_proj.bias"] = qkv[:, :n].reshape(heads * d)
            out[hf + "self_attn.k_proj.bias"] = qkv[:, n].reshape(g * d)
            out[hf + "self_attn.v_proj.bias"] = qkv[:, n + 1].reshape(g * d)
        if spec.get("bias"):
            out[hf + "self_attn.o_proj.bias"] = state[m + "self_attention.linear_proj.bias"]
            gate, up = state[m + "mlp.linear_fc1.bias"].chunk(2)
            out[hf + "mlp.gate_proj.bias"] = gate
            out[hf + "mlp.up_proj.bias"] = up
            out[hf + "mlp.down_proj.bias"] = state[m + "mlp.linear_fc2.bias"]
        if spec.get("qk_norm"):
            out[hf + "self_attn.q_norm.weight"] = state[m + "self_attention.q_layernorm.weight"]
            out[hf + "self_attn.k_norm.weight"] = state[m + "self_attention.k_layernorm.weight"]
        out[hf + "input_layernorm.weight"] = state[m + "input_layernorm.weight"]
        out[hf + "post_attention_layernorm.weight"] = state[m + "pre_mlp_layernorm.weight"]
        if l + 1 in spec.get("moe_layers", []):
            out[hf + f"{prefix}.gate.weight"] = state[m + "mlp.router.weight"]
            for e in range(spec["experts"]):
                x = f"{m}mlp.experts.local_experts.{e}."
                gate, up = state[x + "linear_fc1.weight"].chunk(2)
                for name, t in zip(names, (gate, up, state[x + "linear_fc2.weight"])):
                    out[f"{hf}{prefix}.experts.{e}.{name}.weight"] = t
        else:
            gate, up = state[m + "mlp.linear_fc1.weight"].chunk(2)
            out[hf + "mlp.gate_proj.weight"] = gate
            out[hf + "mlp.up_proj.weight"] = up
            out[hf + "mlp.down_proj.weight"] = state[m + "mlp.linear_fc2.weight"]
    return out


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "llama_bias"])
def test_gather_is_what_megatron_holds_and_transformers_computes_its_logits(
        reshard_bin, tmp_path, saved, name):
    from transformers import AutoModelForCausalLM

    ckpt, config, ref = saved(name)
    out = tmp_path / "hf"
    r = run(reshard_bin, "gather", ckpt, "-o", out, "--config", config)
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "config.json").read_text()) == json.loads(config.read_text())
    got = load_file(str(out / "model.safetensors"))
    spec, cfg = MODELS[name]
    want = expected_hf(ref["state"], spec, cfg)
    assert sorted(got) == sorted(want)
    for k in want:
        assert same_bits(got[k], want[k].contiguous()), k

    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        logits = model(torch.tensor([TOKENS])).logits
    torch.testing.assert_close(logits, ref["logits"][..., :cfg["vocab_size"]], rtol=1e-4, atol=1e-4)


def test_convert_to_tp2_and_back_is_the_same_checkpoint(reshard_bin, tmp_path, saved):
    ckpt, config, _ = saved("qwen3_moe")
    direct, sharded, back = tmp_path / "direct", tmp_path / "tp2", tmp_path / "back"
    assert run(reshard_bin, "gather", ckpt, "-o", direct, "--config", config).returncode == 0
    r = run(reshard_bin, "convert", ckpt, "--config", config, "--tp", 2, "-o", sharded)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((sharded / "reshard.json").read_text())
    assert manifest["world_size"] == 2
    # transformers' TP 2 layout: q_proj split by rows, the experts fused per layer into buffers.
    q = manifest["params"]["model.layers.0.self_attn.q_proj.weight"]["map"]
    assert [q["ranks"][r]["shard_shape"] for r in ("0", "1")] == [[32, 64], [32, 64]]
    # And at EP 2: whole experts per rank, in transformers' stacked buffers.
    ep = tmp_path / "ep2"
    r = run(reshard_bin, "convert", ckpt, "--config", config, "--tp", 2, "-o", ep,
            "--distributed-config", '{"tp_plan": "auto", "ep_size": 2}')
    assert r.returncode == 0, r.stderr
    assert json.loads((ep / "reshard.json").read_text())["buffers"]
    a = load_file(str(direct / "model.safetensors"))
    for src in (sharded, ep):
        r = run(reshard_bin, "gather", src, "-o", back, "--force")
        assert r.returncode == 0, r.stderr
        b = load_file(str(back / "model.safetensors"))
        assert sorted(a) == sorted(b)
        for k in a:
            assert same_bits(a[k], b[k]), (src.name, k)


def test_diff_reads_a_megatron_checkpoint_with_its_config(reshard_bin, tmp_path, saved):
    """reshard diff of the dist-ckpt (named and split by --config) against its own gather: equal;
    against a copy with one element changed: that element. Without --config: exit 2."""
    ckpt, config, _ = saved("qwen3_moe")
    direct = tmp_path / "direct"
    assert run(reshard_bin, "gather", ckpt, "-o", direct, "--config", config).returncode == 0
    r = run(reshard_bin, "diff", ckpt, direct, "--config", config)
    assert r.returncode == 0, r.stdout + r.stderr
    tensors = load_file(str(direct / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name][3, 5] += 1
    changed = tmp_path / "changed"
    changed.mkdir()
    save_file(tensors, str(changed / "model.safetensors"), metadata={"format": "pt"})
    r = run(reshard_bin, "diff", changed, ckpt, "--config", config, "--json")
    assert r.returncode == 1, r.stderr
    found = json.loads(r.stdout)["differences"]
    assert [(d["name"], d["multi_index"]) for d in found] == [(name, [3, 5])]
    r = run(reshard_bin, "diff", ckpt, direct)
    assert r.returncode == 2 and "config" in r.stderr, r.stderr
    r = run(reshard_bin, "diff", direct, changed, "--config", config)
    assert r.returncode == 2 and "neither" in r.stderr, r.stderr


def test_python_gather_takes_the_config(tmp_path, saved):
    ckpt, config, ref = saved("mixtral")
    out = tmp_path / "hf"
    reshard.checkpoint.gather(ckpt, out, config=config)
    got = load_file(str(out / "model.safetensors"))
    want = expected_hf(ref["state"], *MODELS["mixtral"])
    assert same_bits(got["model.layers.1.self_attn.k_proj.weight"],
                     want["model.layers.1.self_attn.k_proj.weight"].contiguous())


def test_refusals_name_the_problem_and_write_nothing(reshard_bin, tmp_path, saved):
    ckpt, config, _ = saved("mixtral")
    out = tmp_path / "hf"
    r = run(reshard_bin, "gather", ckpt, "-o", out)
    assert r.returncode == 2 and "config.json" in r.stderr, r.stderr
    wrong = json.loads(config.read_text())
    wrong["num_key_value_heads"] = 4
    (tmp_path / "wrong.json").write_text(json.dumps(wrong))
    r = run(reshard_bin, "gather", ckpt, "-o", out, "--config", tmp_path / "wrong.json")
    assert r.returncode == 2, r.stderr
    assert "linear_qkv" in r.stderr and "num_key_value_heads" in r.stderr, r.stderr
    wrong = json.loads(config.read_text())
    wrong["num_hidden_layers"] = 3
    (tmp_path / "layers.json").write_text(json.dumps(wrong))
    r = run(reshard_bin, "convert", ckpt, "--tp", 2, "-o", out, "--config", tmp_path / "layers.json")
    assert r.returncode == 2 and "num_hidden_layers" in r.stderr, r.stderr
    assert not out.exists()


def config_with(path, tmp_path, name, **changes):
    config = json.loads(path.read_text())
    config.update(changes)
    out = tmp_path / f"{name}.json"
    out.write_text(json.dumps(config))
    return out


# Configs that do not describe the checkpoint: each leaves a tensor of the checkpoint nowhere, or
# implies one the checkpoint lacks. (model, name, changes, what the message names)
LYING_CONFIGS = [
    # Its own output layer: transformers would tie lm_head to the embedding and drop it.
    ("mixtral", "tied", {"tie_word_embeddings": True}, "output_layer.weight"),
    # Layers 1 and 3 are MoE layers in the checkpoint, all dense in the config.
    ("qwen3_moe", "all_dense", {"mlp_only_layers": [0, 1, 2, 3]}, "layer 1 holds experts"),
    # Layers 0 and 2 are dense in the checkpoint, MoE in the config.
    ("qwen3_moe", "all_moe", {"mlp_only_layers": []}, "layer 0 is a dense MLP"),
    ("qwen3_moe", "sparse_step", {"mlp_only_layers": [], "decoder_sparse_step": 4},
     "layer 1 holds experts"),
]


@pytest.mark.parametrize("model,name,changes,needle", LYING_CONFIGS,
                         ids=[c[1] for c in LYING_CONFIGS])
def test_a_config_that_does_not_describe_the_checkpoint_is_refused(
        reshard_bin, tmp_path, saved, model, name, changes, needle):
    ckpt, config, _ = saved(model)
    wrong = config_with(config, tmp_path, name, **changes)
    for command in (["gather"], ["convert", "--tp", 2]):
        out = tmp_path / "out"
        r = run(reshard_bin, command[0], ckpt, *command[1:], "-o", out, "--config", wrong)
        assert r.returncode == 2, (command, r.stderr)
        assert needle in r.stderr and "does not describe" in r.stderr, r.stderr
        assert not out.exists()


def test_the_layers_a_config_makes_moe_are_the_checkpoints(reshard_bin, tmp_path, saved):
    # decoder_sparse_step 2 makes layers 1 and 3 MoE layers, as mlp_only_layers [0, 2] does.
    ckpt, config, _ = saved("qwen3_moe")
    same = config_with(config, tmp_path, "step", mlp_only_layers=[], decoder_sparse_step=2)
    r = run(reshard_bin, "gather", ckpt, "-o", tmp_path / "a", "--config", config)
    assert r.returncode == 0, r.stderr
    r = run(reshard_bin, "gather", ckpt, "-o", tmp_path / "b", "--config", same)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == \
        (tmp_path / "b" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("text", ["99999999999999999999999", "-7", "../../etc", "garbage\n",
                                  "", "7 8", "0x7"])
def test_a_latest_iteration_file_that_names_no_iteration_is_refused(reshard_bin, tmp_path, saved,
                                                                    text):
    ckpt, config, _ = saved("mixtral")
    save_dir = tmp_path / "save"
    save_dir.mkdir()
    (save_dir / "iter_0000007").symlink_to(ckpt)
    latest = save_dir / "latest_checkpointed_iteration.txt"
    latest.write_text("7\n")
    r = run(reshard_bin, "gather", save_dir, "-o", tmp_path / "ok", "--config", config)
    assert r.returncode == 0, r.stderr
    latest.write_text(text)
    for args in (["gather", save_dir, "-o", tmp_path / "out", "--config", config],
                 ["convert", save_dir, "--tp", 2, "-o", tmp_path / "out", "--config", config]):
        r = run(reshard_bin, *args)
        assert r.returncode == 2, (args, r.returncode, r.stderr)
        assert "latest_checkpointed_iteration.txt" in r.stderr, r.stderr
        assert "not an iteration number" in r.stderr and "uncaught" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_an_unknown_sharded_backend_version_is_refused(reshard_bin, tmp_path, saved):
    ckpt, config, _ = saved("mixtral")
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    meta = json.loads((copy / "metadata.json").read_text())
    assert meta["sharded_backend_version"] == 1  # what Megatron-Core's torch_dist writes
    meta["sharded_backend_version"] = 99
    (copy / "metadata.json").write_text(json.dumps(meta))
    r = run(reshard_bin, "gather", copy, "-o", tmp_path / "out", "--config", config)
    assert r.returncode == 2 and "sharded_backend_version" in r.stderr and "99" in r.stderr, \
        r.stderr
    assert not (tmp_path / "out").exists()


# A Megatron layout written by torch's DCP itself (world 1, gloo): rank 0 saves linear_qkv as
# two local shards cut inside a query group (rows [0, 7) and [7, 36)), so q_proj reads two
# chunks of one rank; everything else is one chunk.
TORCH_WRITER = r'''
import json, os, sys, torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards
out, pg = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", init_method="file://" + pg, rank=0, world_size=1)
g = torch.Generator().manual_seed(3)
def t(*shape):
    return torch.randn(*shape, generator=g)
qkv = t(36, 8)
state = {
    "embedding.word_embeddings.weight": t(12, 8), "output_layer.weight": t(12, 8),
    "decoder.final_layernorm.weight": t(8),
    "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": t(8),
    "decoder.layers.0.self_attention.linear_proj.weight": t(8, 24),
    "decoder.layers.0.mlp.linear_fc1.layer_norm_weight": t(8),
    "decoder.layers.0.mlp.linear_fc1.weight": t(20, 8),
    "decoder.layers.0.mlp.linear_fc2.weight": t(8, 10),
    "decoder.layers.0.self_attention.linear_qkv.weight": init_from_local_shards(
        [Shard(qkv[:7].clone(), ShardMetadata([0, 0], [7, 8], "rank:0/cpu")),
         Shard(qkv[7:].clone(), ShardMetadata([7, 0], [29, 8], "rank:0/cpu"))], [36, 8]),
}
full = {k: (qkv if k.endswith("linear_qkv.weight") else v) for k, v in state.items()}
dcp.save(state, checkpoint_id=out)
json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
           "common_backend": "torch", "common_backend_version": 1}, open(out + "/metadata.json", "w"))
torch.save(full, out + "/../full.pt")
dist.destroy_process_group()
os._exit(0)  # as worker_exit.py ends a worker, and why
'''
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
         "hidden_size": 8, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 3,
         "intermediate_size": 10, "vocab_size": 10, "rms_norm_eps": 1e-6,
         "max_position_embeddings": 16, "tie_word_embeddings": False, "hidden_act": "silu",
         "torch_dtype": "float32"}


def test_torch_written_chunks_inside_a_query_group(reshard_bin, tmp_path):
    from transformers import AutoModelForCausalLM

    ckpt = tmp_path / "ckpt"
    r = subprocess.run([sys.executable, "-c", TORCH_WRITER, str(ckpt), str(tmp_path / "pg")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    out = tmp_path / "hf"
    r = run(reshard_bin, "gather", ckpt, "-o", out, "--config", tmp_path / "config.json")
    assert r.returncode == 0, r.stderr
    full = torch.load(tmp_path / "full.pt")
    got = load_file(str(out / "model.safetensors"))
    qkv = full["decoder.layers.0.self_attention.linear_qkv.weight"].view(2, 6, 3, 8)
    fc1 = full["decoder.layers.0.mlp.linear_fc1.weight"]
    want = {
        "model.embed_tokens.weight": full["embedding.word_embeddings.weight"][:10],
        "lm_head.weight": full["output_layer.weight"][:10],
        "model.norm.weight": full["decoder.final_layernorm.weight"],
        "model.layers.0.input_layernorm.weight":
            full["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"],
        "model.layers.0.post_attention_layernorm.weight":
            full["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"],
        "model.layers.0.self_attn.q_proj.weight": qkv[:, :4].reshape(24, 8),
        "model.layers.0.self_attn.k_proj.weight": qkv[:, 4].reshape(6, 8),
        "model.layers.0.self_attn.v_proj.weight": qkv[:, 5].reshape(6, 8),
        "model.layers.0.self_attn.o_proj.weight":
            full["decoder.layers.0.self_attention.linear_proj.weight"],
        "model.layers.0.mlp.gate_proj.weight": fc1[:10],
        "model.layers.0.mlp.up_proj.weight": fc1[10:],
        "model.layers.0.mlp.down_proj.weight": full["decoder.layers.0.mlp.linear_fc2.weight"],
    }
    assert sorted(got) == sorted(want)
    for k in want:
        assert same_bits(got[k], want[k].contiguous()), k
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    # A training save dir: latest_checkpointed_iteration.txt names the iteration.
    save = tmp_path / "save"
    save.mkdir()
    ckpt.rename(save / "iter_0000020")
    ckpt = save / "iter_0000020"
    (save / "latest_checkpointed_iteration.txt").write_text("20\n")
    r = run(reshard_bin, "gather", save, "-o", tmp_path / "hf1", "--config", tmp_path / "config.json")
    assert r.returncode == 0, r.stderr
    again = load_file(str(tmp_path / "hf1" / "model.safetensors"))
    assert all(same_bits(again[k], got[k]) for k in got)
    # A config with a layer more than the checkpoint holds: refused, naming the layer.
    (tmp_path / "two.json").write_text(json.dumps(dict(LLAMA, num_hidden_layers=2)))
    r = run(reshard_bin, "gather", ckpt, "-o", tmp_path / "hf2", "--config", tmp_path / "two.json")
    assert r.returncode == 2 and "layer 1" in r.stderr, r.stderr


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_live_model_maps_rebuild_what_gather_reads_from_its_checkpoint(tmp_path, saved, name):
    """reshard.torch.megatron_maps in the Megatron processes themselves (TP 2 x PP 2 x EP 2):
    the Hugging Face tensors rebuilt from the ranks' own tensors equal what gather reads from
    the checkpoint of the same model, and Megatron's TP-1 weights."""
    import reshard.torch  # noqa: F401  (the package the Megatron processes import)

    ckpt, config, ref = saved(name)
    spec, cfg = MODELS[name]
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    path = str(pathlib.Path(reshard.__file__).resolve().parents[1])
    megatron("live", tmp_path / "live", tmp_path / "spec.json", config, procs=4,
             env={"PYTHONPATH": path})
    ranks = [torch.load(tmp_path / "live" / f"live{r}.pt") for r in range(4)]
    assert all(r["maps"] == ranks[0]["maps"] for r in ranks)  # every process, one answer
    buffers = reshard.read_buffers(ranks[0]["maps"])
    out = tmp_path / "hf"
    reshard.checkpoint.gather(ckpt, out, config=config)
    gathered = load_file(str(out / "model.safetensors"))
    want = expected_hf(ref["state"], spec, cfg)
    assert sorted(buffers.maps) == sorted(gathered) == sorted(want)
    for hf, m in buffers.maps.items():
        shards = [r["shards"][m.buffer(rank)] if m.buffer(rank) else torch.empty(0)
                  for rank, r in enumerate(ranks)]
        got = reshard.rebuild(m, shards)
        assert same_bits(got, gathered[hf]) and same_bits(got, want[hf].contiguous()), hf
    # The fused tensors are maps over Megatron's own rank tensors (buffers), split per rank.
    q = buffers.maps["model.layers.0.self_attn.q_proj.weight"]
    assert q.buffer(0) == "decoder.layers.0.self_attention.linear_qkv.weight"
    gate = buffers.maps["model.layers.0.mlp.gate_proj.weight"] if name == "qwen3_moe" else \
        buffers.maps["model.layers.0.block_sparse_moe.experts.0.w1.weight"]
    assert gate.buffer(0).endswith("linear_fc1.weight")
    # Refused alike on every process, naming what is wrong.
    for r in ranks:
        assert "intermediate_size" in r["refusals"]["config"], r["refusals"]
        assert "decoder.extra.weight" in r["refusals"]["name"], r["refusals"]


def test_a_live_model_is_a_redistributor_source_without_maps(tmp_path, saved):
    """Redistributor(source=model, config=...) in the Megatron processes (TP 2 x PP 2 x EP 2):
    the Hugging Face tensors arrive whole on one process and split on two others, equal to
    Megatron's own TP-1 weights; after the weights change in place, run() with no arguments
    sends the new ones; a model without its config and processes that disagree on the kind of
    source are refused alike on every process."""
    ckpt, config, ref = saved("qwen3_moe")
    spec, cfg = MODELS["qwen3_moe"]
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    path = str(pathlib.Path(reshard.__file__).resolve().parents[1])
    cmd = [megatron_python(), "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node=4", str(HERE / "megatron_sync_worker.py"), str(tmp_path / "out"),
           str(tmp_path / "spec.json"), str(config)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=path)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    ranks = [torch.load(tmp_path / "out" / f"sync{r}.pt") for r in range(4)]
    want = expected_hf(ref["state"], spec, cfg)
    first, after = ranks[0]["first"], ranks[0]["after"]
    assert sorted(first) == sorted(want)
    for name, w in want.items():
        w = w.contiguous()
        assert same_bits(first[name], w), name
        assert same_bits(after[name], w + 1.0), name
        halves = torch.cat([ranks[2]["halves"][name], ranks[3]["halves"][name]])
        assert same_bits(halves, w), name
    assert ranks[1]["first"] == {} and ranks[1]["halves"] == {}
    # Each element once: a full copy of the model's bytes reaches process 0 (less what it
    # holds itself).
    total = sum(w.numel() * w.element_size() for w in want.values())
    moved = ranks[0]["bytes"]
    assert 0 < moved["received"] <= total, moved
    for r in ranks:
        assert "config" in r["refusals"]["config"], r["refusals"]
        assert "Megatron-Core" in r["refusals"]["kinds"], r["refusals"]
    assert len({r["refusals"]["config"] for r in ranks}) == 1


def test_inspect_reads_the_run_from_the_boxes_and_their_writers(reshard_bin, saved):
    """torch_dist records global tensors' boxes and the ranks that wrote them, not Megatron's
    grid: tp from the embedding's vocabulary chunks, pp (and vpp) from the ranks that wrote each
    layer, stacked ([L, ...]) or one key per layer; ep and expert tp from the experts' boxes and
    writers (TP 2 x PP 2 on 4 ranks; the MoE models' experts EP 2 x ETP 1); cp said unknown."""
    for name, experts in (("llama_bias", None), ("mixtral", [1, 2, 1, 2]),
                          ("qwen3_moe", [1, 2, 1, 2])):
        ckpt, _, _ = saved(name)
        r = subprocess.run([str(reshard_bin), "inspect", str(ckpt), "--json"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        run_ = json.loads(r.stdout)["parallelism"]
        assert run_["world"] == 4, run_
        assert {a["name"]: a["size"] for a in run_["axes"]} == {"tp": 2, "cp": 1, "dp": 1, "pp": 2}
        got = None if run_["experts"] is None else [a["size"] for a in run_["experts"]]
        assert got == experts, run_
        assert (run_["vpp"], run_["unknown"], run_["optimizer"]) == (1, ["cp"], "none")
        info = reshard.checkpoint.inspect(ckpt)
        assert info["parallelism"] == run_


# Blocks per quantized tensor of LLAMA_BIAS (TP 2 x PP 2): Megatron splits q, k, v, gate, up
# and the vocabulary by rows between the two TP ranks (q at row 32, k and v at 16, gate and up
# at 48, the padded vocabulary at 56), o_proj and down_proj by columns (32, 48). Most blocks
# fall at those splits; v_proj's 12 rows, up_proj's 10, o_proj's 12 columns and the
# embedding's 16 rows straddle them (the gather's work). Layer 1 quantizes q_proj and gate_proj
# only: its linear_qkv and linear_fc1 also hold tensors sent as they are.
QUANT_BLOCKS = {
    "model.embed_tokens.weight": [16, 16], "lm_head.weight": [8, 8],
    "model.layers.0.self_attn.q_proj.weight": [8, 8],
    "model.layers.0.self_attn.k_proj.weight": [8, 8],
    "model.layers.0.self_attn.v_proj.weight": [12, 8],
    "model.layers.0.self_attn.o_proj.weight": [8, 12],
    "model.layers.0.mlp.gate_proj.weight": [8, 8],
    "model.layers.0.mlp.up_proj.weight": [10, 8],
    "model.layers.0.mlp.down_proj.weight": [8, 8],
    "model.layers.1.self_attn.q_proj.weight": [16, 16],
    "model.layers.1.mlp.gate_proj.weight": [8, 8],
    "model.layers.1.mlp.down_proj.weight": [4, 4],
}
# Where Megatron's TP 2 splits each quantized tensor: (dim, index).
TP_SPLIT = {"embed_tokens": (0, 56), "lm_head": (0, 56), "q_proj": (0, 32), "k_proj": (0, 16),
            "v_proj": (0, 16), "o_proj": (1, 32), "gate_proj": (0, 48), "up_proj": (0, 48),
            "down_proj": (1, 48)}


def split_block_bytes(shape, block, split):
    """Bytes (bf16) of each block that the TP rank holding less of it sends the other."""
    dim, at = split
    total = 0
    for i in range(0, shape[0], block[0]):
        for j in range(0, shape[1], block[1]):
            lo, hi = (i, j), (min(i + block[0], shape[0]), min(j + block[1], shape[1]))
            whole = (hi[0] - lo[0]) * (hi[1] - lo[1])
            first = max(0, min(hi[dim], at) - lo[dim]) * whole // (hi[dim] - lo[dim])
            total += 2 * min(first, whole - first)
    return total


def test_a_live_model_quantized_into_fp8_blocks_from_its_fused_buffers(tmp_path, saved):
    """QuantizingRedistributor(source=model, config=..., quantize=...) in the Megatron processes
    (a bf16 model at TP 2 x PP 2): q/k/v out of linear_qkv and gate/up out of linear_fc1 arrive
    on processes 2 and 3 as FP8 data and scales equal, byte for byte, to a reference
    quantization (the test's own FP8 rounding) of the Hugging Face tensors sliced from
    Megatron's own TP-1 weights (in bf16); the
    tensors not quantized (in the same buffers or not) arrive as they are; the blocks split
    between the TP ranks are gathered first, their bytes counted independently; after the
    weights change in place, run() sends the new ones; a bad block is refused alike on every
    process."""
    from quantized_sync_worker import reference_quantize

    ckpt, config, ref = saved("llama_bias")
    spec, cfg = MODELS["llama_bias"]
    quantize = {n: {"scale": n + "_scale_inv", "block": b} for n, b in QUANT_BLOCKS.items()}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "quant.json").write_text(json.dumps(quantize))
    path = str(pathlib.Path(reshard.__file__).resolve().parents[1])
    cmd = [megatron_python(), "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node=4", str(HERE / "megatron_quant_worker.py"), str(tmp_path / "out"),
           str(tmp_path / "spec.json"), str(config), str(tmp_path / "quant.json")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=path)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    ranks = [torch.load(tmp_path / "out" / f"quant{r}.pt") for r in range(4)]
    # The trainer holds Megatron's weights in bf16 (a pipeline stage's empty shards too).
    want = {n: w.to(torch.bfloat16).contiguous()
            for n, w in expected_hf(ref["state"], spec, cfg).items()}
    maps = ranks[0]["maps"]
    assert ranks[0]["quantized"] == sorted(QUANT_BLOCKS)
    assert sorted(maps) == sorted([*want, *(n + "_scale_inv" for n in QUANT_BLOCKS)])
    for key, shift in (("first", 0.0), ("after", 1.0)):
        made = {n: w + shift for n, w in want.items()}
        for n, block in QUANT_BLOCKS.items():
            made[n], made[n + "_scale_inv"] = reference_quantize(made[n], block)
        for t, proc in enumerate((2, 3)):
            got = ranks[proc][key]
            assert sorted(got) == sorted(maps), (key, proc)
            for n, m in maps.items():
                w = reshard.extract(reshard.ParamMap.from_dict(m), made[n], t)
                assert same_bits(got[n], w), (key, proc, n)
        assert ranks[0][key] == {} and ranks[1][key] == {}
    # Only the split blocks' pieces travel before quantizing: what the TP rank holding less of
    # each block holds of it, in bf16.
    gathered = sum(split_block_bytes(want[n].shape, b, TP_SPLIT[n.split(".")[-2]])
                   for n, b in QUANT_BLOCKS.items())
    assert gathered > 0
    print(f"split blocks gathered: {gathered} bytes; sent to the targets: "
          f"{sum(r['stats'][0]['sent'] for r in ranks)} bytes")
    for push in range(2):
        stats = [r["stats"][push] for r in ranks]
        assert sum(s["gathered_sent"] for s in stats) == gathered, stats
        assert sum(s["gathered_received"] for s in stats) == gathered, stats
    refusals = {r["refusals"].get("block") for r in ranks}
    assert len(refusals) == 1 and None not in refusals, refusals
    assert "q_proj.bias" in refusals.pop()
