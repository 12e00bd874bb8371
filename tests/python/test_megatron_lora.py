"""Megatron-Core LoRA adapters in a dist-ckpt (Megatron-Bridge's PEFT save) -> a PEFT adapter.

megatron-core (in .venv-megatron, see megatron_model.py) builds a toy Llama with grouped-query
attention (2 query groups of 2 heads, so the per-group interleave of linear_qkv matters) and
SwiGLU at TP 2, puts a LoRA adapter on its four linear layers laid out and saved as
Megatron-Bridge's LoRALinear / ParallelLinearAdapter (megatron_model._with_lora), and saves the
weights and the adapters apart with its own torch_dist writer, beside the run_config.yaml that
Megatron-Bridge writes (PyYAML's safe_dump of its config, `peft:` section included). reshard
gathers the adapters with the model's config.json into a PEFT directory: its tensors are
Megatron's own, each rank's shards put together here, and PEFT's model on the gathered weights
gives the logits Megatron computed at TP 2 with the adapters; merge-lora merges it like any
adapter.
"""

import json
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors.torch import load_file

from test_checkpoints import run
from test_megatron import TOKENS, megatron

# Megatron's model and the Hugging Face config.json of the same model (vocabulary padded to 112).
SPEC = {"layers": 2, "hidden": 64, "heads": 4, "groups": 2, "ffn": 96, "vocab": 112, "tp": 2,
        "seed": 7, "lora": {"dim": 8, "alpha": 16}}
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2,
          "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "intermediate_size": 96, "vocab_size": 100, "rms_norm_eps": 1e-6,
          "rope_theta": 10000.0, "max_position_embeddings": 64, "tie_word_embeddings": False,
          "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
          "torch_dtype": "float32"}
# Megatron-Bridge's LoRA fields as its ConfigContainer writes them into run_config.yaml.
PEFT = {"_target_": "megatron.bridge.peft.lora.LoRA", "a2a_experimental": False, "alpha": 16,
        "dim": 8, "dropout": 0.0, "dropout_position": "pre", "exclude_modules": [],
        "lora_A_init_method": "xavier", "lora_B_init_method": "zero", "lora_dtype": None,
        "normalize_moe_lora": False,
        "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]}


def write_run_config(iteration_dir, peft):
    cfg = {"checkpoint": {"save": "checkpoints", "save_interval": 10},
           "model": {"tensor_model_parallel_size": SPEC["tp"], "num_layers": SPEC["layers"]},
           "peft": peft}
    (iteration_dir / "run_config.yaml").write_text(yaml.safe_dump(cfg))


def as_save_dir(root, name, ckpt, peft=PEFT):
    """A Megatron-Bridge save dir around a saved checkpoint: iter_0000010/ and its tracker."""
    it = root / name / "iter_0000010"
    shutil.copytree(ckpt, it)
    write_run_config(it, peft)
    (root / name / "latest_checkpointed_iteration.txt").write_text("10")
    return root / name


@pytest.fixture(scope="module")
def saved(tmp_path_factory, reshard_bin):
    d = tmp_path_factory.mktemp("megatron_lora")
    (d / "spec.json").write_text(json.dumps(SPEC))
    (d / "config.json").write_text(json.dumps(CONFIG))
    (d / "tokens.json").write_text(json.dumps(TOKENS))
    megatron("lora_save", d / "out", d / "spec.json", d / "tokens.json", procs=SPEC["tp"])
    ranks = [torch.load(d / "out" / f"rank{r}.pt") for r in range(SPEC["tp"])]
    r = run(reshard_bin, "gather", d / "out" / "base", "--config", d / "config.json", "-o",
            d / "hf")
    assert r.returncode == 0, r.stderr
    (d / "hf" / "config.json").write_text(json.dumps(CONFIG))
    adapter = as_save_dir(d, "lora", d / "out" / "adapter")
    return d, adapter, ranks


def megatron_adapters(ranks):
    """The adapters as PEFT tensors, from each rank's shards: A of a column-parallel layer split
    along r and of a row-parallel one along its columns, B along its rows (SwiGLU's as [gate;
    up] on each rank), linear_qkv's B interleaved per query group, a fused layer's A every
    projection's."""
    g, heads, d = SPEC["groups"], SPEC["heads"], SPEC["hidden"] // SPEC["heads"]
    n = heads // g
    out = {}
    for l in range(SPEC["layers"]):
        m = f"decoder.layers.{l}."
        hf = f"base_model.model.model.layers.{l}."

        def cat(key, dim, m=m):
            return torch.cat([r["adapters"][m + key] for r in ranks], dim=dim)

        a = cat("self_attention.linear_qkv.adapter.linear_in.weight", 0)
        b = cat("self_attention.linear_qkv.adapter.linear_out.weight", 0).view(g, n + 2, d, -1)
        for name, part in (("q", b[:, :n]), ("k", b[:, n]), ("v", b[:, n + 1])):
            out[hf + f"self_attn.{name}_proj.lora_A.weight"] = a
            out[hf + f"self_attn.{name}_proj.lora_B.weight"] = part.reshape(-1, a.shape[0])
        out[hf + "self_attn.o_proj.lora_A.weight"] = cat(
            "self_attention.linear_proj.adapter.linear_in.weight", 1)
        out[hf + "self_attn.o_proj.lora_B.weight"] = cat(
            "self_attention.linear_proj.adapter.linear_out.weight", 0)
        a = cat("mlp.linear_fc1.adapter.linear_in.weight", 0)
        halves = [r["adapters"][m + "mlp.linear_fc1.adapter.linear_out.weight"].chunk(2)
                  for r in ranks]
        for k, name in enumerate(("gate", "up")):
            out[hf + f"mlp.{name}_proj.lora_A.weight"] = a
            out[hf + f"mlp.{name}_proj.lora_B.weight"] = torch.cat([h[k] for h in halves])
        out[hf + "mlp.down_proj.lora_A.weight"] = cat("mlp.linear_fc2.adapter.linear_in.weight", 1)
        out[hf + "mlp.down_proj.lora_B.weight"] = cat("mlp.linear_fc2.adapter.linear_out.weight", 0)
    return out


def megatron_logits(ranks):
    return torch.cat([r["logits"] for r in ranks], dim=-1)[..., :CONFIG["vocab_size"]]


def hf_logits(model):
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits


def test_gather_writes_the_peft_adapter_megatron_trained(saved, reshard_bin, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    d, adapter, ranks = saved
    out = tmp_path / "peft"
    r = run(reshard_bin, "gather", adapter, "--config", d / "config.json", "-o", out)
    assert r.returncode == 0, r.stderr
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and config["lora_alpha"] == 16
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    got = load_file(out / "adapter_model.safetensors")
    want = megatron_adapters(ranks)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name

    base = AutoModelForCausalLM.from_pretrained(d / "hf", dtype=torch.float32)
    without = hf_logits(base)
    model = PeftModel.from_pretrained(base, out)
    ref = megatron_logits(ranks)
    assert (without - ref).abs().max() > 0.1  # the adapters change the logits
    torch.testing.assert_close(hf_logits(model), ref, rtol=1e-4, atol=1e-4)

    # The gathered adapter merges like any PEFT adapter.
    merged = tmp_path / "merged"
    r = run(reshard_bin, "merge-lora", d / "hf", out, "-o", merged)
    assert r.returncode == 0, r.stderr
    torch.testing.assert_close(
        hf_logits(AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)), ref,
        rtol=1e-4, atol=1e-4)


def test_adapters_it_cannot_map_are_refused_by_name(saved, reshard_bin, tmp_path):
    d, adapter, _ = saved
    config = d / "config.json"

    def gather(ckpt):
        out = tmp_path / "out"
        r = run(reshard_bin, "gather", ckpt, "--config", config, "-o", out)
        assert not out.exists()
        return r

    # DoRA's magnitude beside the LoRA pair: named, nothing written.
    dora = as_save_dir(tmp_path, "dora_tensor", d / "out" / "dora")
    r = gather(dora)
    assert r.returncode == 1, r.stderr
    assert "decoder.layers.0.self_attention.linear_qkv.adapter.weight_magnitude" in r.stderr
    assert "DoRA" in r.stderr
    # A PEFT class other than LoRA in run_config.yaml.
    r = gather(as_save_dir(tmp_path, "dora_class", d / "out" / "adapter",
                           dict(PEFT, _target_="megatron.bridge.peft.dora.DoRA")))
    assert r.returncode == 1 and "megatron.bridge.peft.dora.DoRA" in r.stderr, r.stderr
    # A rank that is not the tensors'.
    r = gather(as_save_dir(tmp_path, "rank", d / "out" / "adapter", dict(PEFT, dim=4)))
    assert r.returncode == 2 and "peft.dim" in r.stderr, r.stderr
    # No run_config.yaml: alpha is nowhere else.
    bare = tmp_path / "bare"
    shutil.copytree(d / "out" / "adapter", bare)
    r = gather(bare)
    assert r.returncode == 2 and "run_config.yaml" in r.stderr, r.stderr
    # An adapter's TP shards after the first lost on save (what Megatron-Bridge's PEFT-filtered
    # save did at TP > 1): the metadata's chunks no longer cover B of linear_qkv.
    lost = as_save_dir(tmp_path, "lost", d / "out" / "adapter")
    it = lost / "iter_0000010"
    meta = dcp.FileSystemReader(it).read_metadata()
    key = "decoder.layers.self_attention.linear_qkv.adapter.linear_out.weight"
    chunks = meta.state_dict_metadata[key].chunks
    meta.state_dict_metadata[key].chunks = [c for c in chunks if c.offsets[1] == 0]
    for index in [i for i in meta.storage_data if i.fqn == key and i.offset[1] != 0]:
        del meta.storage_data[index]
    (it / ".metadata").write_bytes(pickle.dumps(meta))
    r = gather(lost)
    assert r.returncode == 2 and key in r.stderr and "incomplete" in r.stderr, r.stderr
    # linear_proj's B gone: o_proj's A alone, which PEFT would not load.
    lone = as_save_dir(tmp_path, "lone", d / "out" / "adapter")
    meta = dcp.FileSystemReader(lone / "iter_0000010").read_metadata()
    key = "decoder.layers.self_attention.linear_proj.adapter.linear_out.weight"
    del meta.state_dict_metadata[key]
    for index in [i for i in meta.storage_data if i.fqn == key]:
        del meta.storage_data[index]
    (lone / "iter_0000010" / ".metadata").write_bytes(pickle.dumps(meta))
    r = gather(lone)
    assert r.returncode == 2 and "o_proj.lora_A" in r.stderr, r.stderr
    # A PEFT adapter keeps no optimizer state.
    r = run(reshard_bin, "gather", adapter, "--config", config, "-o", tmp_path / "o",
            "--optimizer-state")
    assert r.returncode == 2 and "optimizer" in r.stderr, r.stderr
    # convert lays an adapter out from its base model's layout: through its PEFT directory.
    r = run(reshard_bin, "convert", adapter, "--config", config, "-o", tmp_path / "c", "--tp", 2)
    assert r.returncode == 2 and "PEFT adapter directory" in r.stderr, r.stderr
