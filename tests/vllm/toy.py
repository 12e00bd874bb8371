"""Toy models for the vLLM tests and benchmarks: small transformers checkpoints written to a
directory, with weights drawn from a seed (A, B, ... are the same model with other weights)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64,
             intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, vocab_size=250, max_position_embeddings=256,
             rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="float32",
             bos_token_id=1, eos_token_id=2)


def llama_config(**overrides: Any) -> dict[str, Any]:
    return {**LLAMA, **overrides}


def weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """The model's checkpoint tensors, drawn from ``seed`` (transformers' own init, then
    re-drawn larger so that different seeds give different greedy tokens)."""
    import transformers
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in config.items()
                                               if k not in ("architectures",)})
    cfg.architectures = config["architectures"]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    out = {}
    g = torch.Generator().manual_seed(seed)
    for name, t in model.state_dict().items():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            out[name] = 1 + 0.1 * torch.randn(t.shape, generator=g)
        else:
            out[name] = 0.08 * torch.randn(t.shape, generator=g)
    return out


def write(model_dir: str, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save_file
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(model_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": config["bos_token_id"],
                   "eos_token_id": config["eos_token_id"]}, f)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
    return model_dir


def greedy(config: dict[str, Any], tensors: dict[str, torch.Tensor],
           prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, ``n`` tokens."""
    import transformers
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in config.items()
                                               if k not in ("architectures",)})
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    model.load_state_dict(tensors)
    model.eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            got = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=0)
            out.append(got[0, len(p):].tolist())
    return out
