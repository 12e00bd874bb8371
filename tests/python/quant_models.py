"""Tiny block-quantized checkpoints, made in the test: Qwen3-FP8-shaped (128 x 128 blocks,
float32 `weight_scale_inv`), DeepSeek-V3-shaped per-expert FP8, gpt-oss MXFP4 experts and an
NVFP4 (ModelOpt) Llama.

The FP8 quantizer is the reference one: per 128 x 128 block, scale = amax / 448 and the data
round-to-nearest-even cast of w / scale (what DeepSeek's and transformers' quantizers do).
"""

import json
import pathlib

import torch
from safetensors.torch import save_file

FP8_MAX = 448.0


def quantize_fp8_blocks(w, block=(128, 128)):
    """(float8_e4m3fn data, float32 scales) of a 2-D (or stacked 3-D) tensor."""
    *lead, n, k = w.shape
    bn, bk = block
    gn, gk = -(-n // bn), -(-k // bk)
    w = w.float()
    data = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    scales = torch.empty(*lead, gn, gk, dtype=torch.float32)
    for i in range(gn):
        for j in range(gk):
            blk = w[..., i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            amax = blk.abs().amax(dim=(-2, -1)).clamp(min=1e-12)
            s = amax / FP8_MAX
            scales[..., i, j] = s
            data[..., i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (blk / s[..., None, None]).to(
                torch.float8_e4m3fn)
    return data, scales


FP8_BLOCK_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128], "fmt": "e4m3"}


def _outer_tensors(g, vocab, hidden):
    """The embedding, LM head and final norm every model here has (bf16, unquantized)."""
    return {
        "model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g).bfloat16(),
        "lm_head.weight": torch.randn(vocab, hidden, generator=g).bfloat16(),
        "model.norm.weight": torch.ones(hidden).bfloat16(),
    }


def _write(out, tensors, config):
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def qwen3_fp8(out, *, kv_heads=2, intermediate=512, heads=4, seed=0):
    """A one-layer Qwen3 with FP8 128 x 128 blocks: head_dim 64, so 2 key/value heads are one
    128-row block (half a block a rank at TP 2) and 4 are two; 3 query heads are a block and a
    half."""
    g = torch.Generator().manual_seed(seed)
    hidden, head_dim, vocab = 256, 64, 512
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": FP8_BLOCK_CONFIG,
    }
    t = _outer_tensors(g, vocab, hidden)
    p = "model.layers.0."
    for n in ("input_layernorm", "post_attention_layernorm"):
        t[p + n + ".weight"] = (1 + 0.1 * torch.randn(hidden, generator=g)).bfloat16()
    for n in ("q_norm", "k_norm"):
        t[p + "self_attn." + n + ".weight"] = (1 + 0.1 * torch.randn(head_dim, generator=g)).bfloat16()
    shapes = {"self_attn.q_proj": (heads * head_dim, hidden),
              "self_attn.k_proj": (kv_heads * head_dim, hidden),
              "self_attn.v_proj": (kv_heads * head_dim, hidden),
              "self_attn.o_proj": (hidden, heads * head_dim),
              "mlp.gate_proj": (intermediate, hidden), "mlp.up_proj": (intermediate, hidden),
              "mlp.down_proj": (hidden, intermediate)}
    for n, shape in shapes.items():
        w, s = quantize_fp8_blocks(0.05 * torch.randn(*shape, generator=g))
        t[p + n + ".weight"] = w
        t[p + n + ".weight_scale_inv"] = s
    return _write(out, t, config)


def gpt_oss_mxfp4(out, *, experts=4, seed=0, inter=64, kv=1):
    """A one-layer gpt-oss whose experts are MXFP4: `*_blocks` [E, R, G, 16] (two FP4 values a
    byte) and `*_scales` [E, R, G] (E8M0 exponents near 127); `inter` features, a multiple of
    32 (96 is three groups: half a group a rank at TP 2), and `kv` key/value heads of 2."""
    g = torch.Generator().manual_seed(seed)
    hidden, heads, head_dim, vocab = 64, 2, 32, 128
    config = {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": head_dim, "vocab_size": vocab,
        "num_local_experts": experts, "num_experts_per_tok": 2, "max_position_embeddings": 128,
        "sliding_window": 128, "layer_types": ["full_attention"], "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "mxfp4",
                                "modules_to_not_convert": ["model.layers.*.self_attn",
                                                           "model.layers.*.mlp.router",
                                                           "model.embed_tokens", "lm_head"]},
    }
    t = _outer_tensors(g, vocab, hidden)
    p = "model.layers.0."
    for n in ("input_layernorm", "post_attention_layernorm"):
        t[p + n + ".weight"] = torch.ones(hidden).bfloat16()
    for n, (rows, cols) in {"q_proj": (heads * head_dim, hidden), "k_proj": (kv * head_dim, hidden),
                            "v_proj": (kv * head_dim, hidden), "o_proj": (hidden, heads * head_dim)}.items():
        t[p + "self_attn." + n + ".weight"] = (0.05 * torch.randn(rows, cols, generator=g)).bfloat16()
        t[p + "self_attn." + n + ".bias"] = (0.05 * torch.randn(rows, generator=g)).bfloat16()
    t[p + "self_attn.sinks"] = torch.randn(heads, generator=g).bfloat16()
    t[p + "mlp.router.weight"] = (0.1 * torch.randn(experts, hidden, generator=g)).bfloat16()
    t[p + "mlp.router.bias"] = (0.1 * torch.randn(experts, generator=g)).bfloat16()
    for n, (rows, cols) in {"gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}.items():
        t[p + "mlp.experts." + n + "_blocks"] = torch.randint(
            0, 256, (experts, rows, cols // 32, 16), generator=g, dtype=torch.int32).to(torch.uint8)
        t[p + "mlp.experts." + n + "_scales"] = torch.randint(
            120, 131, (experts, rows, cols // 32), generator=g, dtype=torch.int32).to(torch.uint8)
        t[p + "mlp.experts." + n + "_bias"] = (0.05 * torch.randn(experts, rows, generator=g)).bfloat16()
    return _write(out, t, config)


def llama_nvfp4(out, *, seed=0):
    """A one-layer Llama quantized as ModelOpt NVFP4: `weight` U8 [N, K/2], `weight_scale`
    F8_E4M3 [N, K/16], `weight_scale_2` and `input_scale` F32 scalars."""
    g = torch.Generator().manual_seed(seed)
    hidden, inter, heads, kv, vocab = 64, 128, 4, 2, 128
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4",
                                "group_size": 16, "exclude_modules": ["lm_head"]},
    }
    t = _outer_tensors(g, vocab, hidden)
    p = "model.layers.0."
    for n in ("input_layernorm", "post_attention_layernorm"):
        t[p + n + ".weight"] = torch.ones(hidden).bfloat16()
    shapes = {"self_attn.q_proj": (heads * head_dim, hidden),
              "self_attn.k_proj": (kv * head_dim, hidden),
              "self_attn.v_proj": (kv * head_dim, hidden),
              "self_attn.o_proj": (hidden, heads * head_dim),
              "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
              "mlp.down_proj": (hidden, inter)}
    for n, (rows, cols) in shapes.items():
        t[p + n + ".weight"] = torch.randint(0, 256, (rows, cols // 2), generator=g,
                                             dtype=torch.int32).to(torch.uint8)
        t[p + n + ".weight_scale"] = (torch.rand(rows, cols // 16, generator=g) + 0.5).to(
            torch.float8_e4m3fn)
        t[p + n + ".weight_scale_2"] = torch.tensor(0.01 + torch.rand((), generator=g).item())
        t[p + n + ".input_scale"] = torch.tensor(0.02)
    return _write(out, t, config)


NVFP4_COMPRESSED_TENSORS_CONFIG = {
    "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
    "quantization_status": "compressed", "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16,
                    "strategy": "tensor_group", "dynamic": False, "observer": "minmax"},
        "input_activations": {"num_bits": 4, "type": "float", "symmetric": True,
                              "group_size": 16, "strategy": "tensor_group", "dynamic": "local",
                              "observer": "minmax"}}},
}


def llama_nvfp4_compressed(out, *, global_shape=(1,), seed=0):
    """A one-layer Llama quantized as compressed-tensors NVFP4 (`nvfp4-pack-quantized`):
    `weight_packed` U8 [N, K/2], `weight_scale` F8_E4M3 [N, K/16], `weight_global_scale` and
    `input_global_scale` F32 of shape `global_shape` ([1] as compressed-tensors writes them)."""
    g = torch.Generator().manual_seed(seed)
    hidden, inter, heads, kv, vocab = 64, 128, 4, 2, 128
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "quantization_config": NVFP4_COMPRESSED_TENSORS_CONFIG,
    }
    t = _outer_tensors(g, vocab, hidden)
    p = "model.layers.0."
    for n in ("input_layernorm", "post_attention_layernorm"):
        t[p + n + ".weight"] = torch.ones(hidden).bfloat16()
    shapes = {"self_attn.q_proj": (heads * head_dim, hidden),
              "self_attn.k_proj": (kv * head_dim, hidden),
              "self_attn.v_proj": (kv * head_dim, hidden),
              "self_attn.o_proj": (hidden, heads * head_dim),
              "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
              "mlp.down_proj": (hidden, inter)}
    for n, (rows, cols) in shapes.items():
        t[p + n + ".weight_packed"] = torch.randint(0, 256, (rows, cols // 2), generator=g,
                                                    dtype=torch.int32).to(torch.uint8)
        # Scales over E4M3's range, subnormals included; global scales that make the quotient
        # round (448 x 6 / amax, as compressed-tensors computes them, is no power of two).
        t[p + n + ".weight_scale"] = (torch.rand(rows, cols // 16, generator=g) * 440 + 0.004).to(
            torch.float8_e4m3fn)
        amax = 0.05 + torch.rand((), generator=g).item()
        t[p + n + ".weight_global_scale"] = torch.full(global_shape, 448.0 * 6.0 / amax)
        t[p + n + ".input_global_scale"] = torch.full(global_shape, 448.0 * 6.0 / 3.0)
    return _write(out, t, config)


def deepseek_v3_fp8(out, *, experts=4, seed=0):
    """A one-layer DeepSeek-V3 (MLA attention, routed and shared experts), every linear FP8 in
    128 x 128 blocks as DeepSeek ships it: per-expert tensors, and `kv_a_proj_with_mqa`'s 576
    rows (kv_lora_rank 512 + rope 64) ending in a half block."""
    g = torch.Generator().manual_seed(seed)
    hidden, moe_inter, heads, vocab = 256, 256, 2, 256
    nope, rope, v_dim, kv_rank, q_rank = 64, 64, 64, 512, 256
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": hidden, "intermediate_size": 512, "moe_intermediate_size": moe_inter,
        "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": heads,
        "n_routed_experts": experts, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0, "moe_layer_freq": 1,
        "q_lora_rank": q_rank, "kv_lora_rank": kv_rank, "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope, "v_head_dim": v_dim, "vocab_size": vocab,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "rope_scaling": None,
        "quantization_config": FP8_BLOCK_CONFIG,
    }
    t = _outer_tensors(g, vocab, hidden)
    p = "model.layers.0."
    for n, size in (("input_layernorm", hidden), ("post_attention_layernorm", hidden),
                    ("self_attn.q_a_layernorm", q_rank), ("self_attn.kv_a_layernorm", kv_rank)):
        t[p + n + ".weight"] = torch.ones(size).bfloat16()
    t[p + "mlp.gate.weight"] = (0.1 * torch.randn(experts, hidden, generator=g)).bfloat16()
    t[p + "mlp.gate.e_score_correction_bias"] = torch.zeros(experts)
    shapes = {"self_attn.q_a_proj": (q_rank, hidden),
              "self_attn.q_b_proj": (heads * (nope + rope), q_rank),
              "self_attn.kv_a_proj_with_mqa": (kv_rank + rope, hidden),
              "self_attn.kv_b_proj": (heads * (nope + v_dim), kv_rank),
              "self_attn.o_proj": (hidden, heads * v_dim),
              "mlp.shared_experts.gate_proj": (moe_inter, hidden),
              "mlp.shared_experts.up_proj": (moe_inter, hidden),
              "mlp.shared_experts.down_proj": (hidden, moe_inter)}
    for e in range(experts):
        shapes[f"mlp.experts.{e}.gate_proj"] = (moe_inter, hidden)
        shapes[f"mlp.experts.{e}.up_proj"] = (moe_inter, hidden)
        shapes[f"mlp.experts.{e}.down_proj"] = (hidden, moe_inter)
    for n, shape in shapes.items():
        w, s = quantize_fp8_blocks(0.05 * torch.randn(*shape, generator=g))
        t[p + n + ".weight"] = w
        t[p + n + ".weight_scale_inv"] = s
    return _write(out, t, config)


def dequantize_fp8_reference(w, s, block=(128, 128), dtype=torch.bfloat16):
    """The reference formula: float32(w) * float32(s) per ceil-grid block, then one rounding."""
    n, k = w.shape
    full = s.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return (w.float() * full).to(dtype)
