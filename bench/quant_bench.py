"""Block-quantized checkpoints: `reshard gather --dequantize` of a DeepSeek-V3-shaped FP8
checkpoint (per-expert tensors, one safetensors file per layer) against what users run today — a
torch loop over the files: load_file, per-block dequantize, save_file (DeepSeek's
fp8_cast_bf16.py, on the CPU) — and `reshard scatter --config` at EP 2 against `cp -r` of the
same files. Each figure is printed beside its reference, with peak memory.

    .venv/bin/python bench/quant_bench.py [--gb 1.2] [--repeat 3] [--work DIR]
"""

import argparse
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _measure import dir_bytes, timed  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
BLOCK = 128

# The per-file torch loop, run as a child so that its time and peak memory are its own.
TORCH_LOOP = r'''
import json, pathlib, sys, torch
from safetensors.torch import load_file, save_file
src, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
out.mkdir()
index = json.loads((src / "model.safetensors.index.json").read_text())
weight_map = {}
for f in sorted(set(index["weight_map"].values())):
    sd = load_file(str(src / f))
    new = {}
    for name, t in sd.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = sd[name + "_scale_inv"]
            n, k = t.shape
            full = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
            t = (t.float() * full).to(torch.bfloat16)
        new[name] = t
        weight_map[name] = f
    save_file(new, str(out / f), metadata={"format": "pt"})
    del sd, new
(out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
'''


def build(out, gb):
    """A DeepSeek-V3-shaped FP8 checkpoint of about `gb` GB: hidden 2048, 32 routed experts of
    1024 rows and a shared one per layer, MLA attention; random FP8 bytes (no NaN) and scales."""
    out.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    hidden, inter, experts, heads = 2048, 1024, 32, 16
    per_layer = experts * 3 * inter * hidden
    layers = max(1, round(gb * 1e9 / per_layer))
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": hidden, "intermediate_size": 4 * hidden, "moe_intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
        "n_routed_experts": experts, "n_shared_experts": 1, "num_experts_per_tok": 4,
        "first_k_dense_replace": 0, "q_lora_rank": 768, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 32768,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                "weight_block_size": [BLOCK, BLOCK], "fmt": "e4m3"},
    }

    def fp8(rows, cols):
        b = torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.int32).to(torch.uint8)
        b[(b & 0x7F) == 0x7F] = 0x3C  # no NaN
        s = torch.rand(-(-rows // BLOCK), -(-cols // BLOCK), generator=g) * 1e-3 + 1e-4
        return b.view(torch.float8_e4m3fn), s

    weight_map = {}
    for layer in range(layers):
        p = f"model.layers.{layer}."
        t = {p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
             p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
             p + "mlp.gate.weight": torch.zeros(experts, hidden, dtype=torch.bfloat16)}
        shapes = {"self_attn.q_a_proj": (768, hidden),
                  "self_attn.q_b_proj": (heads * 192, 768),
                  "self_attn.kv_a_proj_with_mqa": (576, hidden),
                  "self_attn.kv_b_proj": (heads * 256, 512),
                  "self_attn.o_proj": (hidden, heads * 128),
                  "mlp.shared_experts.gate_proj": (inter, hidden),
                  "mlp.shared_experts.up_proj": (inter, hidden),
                  "mlp.shared_experts.down_proj": (hidden, inter)}
        for e in range(experts):
            shapes[f"mlp.experts.{e}.gate_proj"] = (inter, hidden)
            shapes[f"mlp.experts.{e}.up_proj"] = (inter, hidden)
            shapes[f"mlp.experts.{e}.down_proj"] = (hidden, inter)
        for n, (r, c) in shapes.items():
            t[p + n + ".weight"], t[p + n + ".weight_scale_inv"] = fp8(r, c)
        t[p + "self_attn.q_a_layernorm.weight"] = torch.ones(768, dtype=torch.bfloat16)
        t[p + "self_attn.kv_a_layernorm.weight"] = torch.ones(512, dtype=torch.bfloat16)
        name = f"model-{layer + 1:05d}-of-{layers + 1:05d}.safetensors"
        save_file(t, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in t})
    last = f"model-{layers + 1:05d}-of-{layers + 1:05d}.safetensors"
    rest = {"model.embed_tokens.weight": torch.zeros(32768, hidden, dtype=torch.bfloat16),
            "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            "lm_head.weight": torch.zeros(32768, hidden, dtype=torch.bfloat16)}
    save_file(rest, str(out / last), metadata={"format": "pt"})
    weight_map.update({k: last for k in rest})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return layers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--work", default=None)
    ap.add_argument("--reshard", default=str(REPO / "build" / "tools" / "reshard" / "reshard"))
    args = ap.parse_args()
    work = pathlib.Path(args.work or tempfile.mkdtemp(prefix="quant_bench."))
    src = work / "src"
    if not src.exists():
        layers = build(src, args.gb)
    else:
        layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    size = dir_bytes(src)
    largest = max(p.stat().st_size for p in src.glob("*.safetensors"))
    print(f"checkpoint: {size / 1e9:.2f} GB FP8, {layers} layers, largest file {largest / 1e6:.0f} MB")
    # Like for like: the torch loop (save_file) and cp leave their output in the page cache, so
    # reshard runs with --no-sync; the default, synced gather is timed beside them. Dirty pages
    # of the previous command are flushed (untimed) before each command.
    rows = {"gather --dequantize --no-sync": [], "torch loop": [], "scatter --config EP 2 --no-sync": [],
            "cp -r": [], "gather --dequantize (synced)": []}
    peaks = {k: 0 for k in rows}
    loop = work / "loop.py"
    loop.write_text(TORCH_LOOP)
    ep = '{"tp_plan": "auto", "ep_size": 2}'
    for _ in range(args.repeat):
        gather = [args.reshard, "gather", str(src), "--dequantize", "--max-shard-size", "400MB"]
        for key, cmd in (
                ("gather --dequantize --no-sync", gather + ["--no-sync", "-o", str(work / "o1")]),
                ("torch loop", [sys.executable, str(loop), str(src), str(work / "o2")]),
                ("scatter --config EP 2 --no-sync",
                 [args.reshard, "scatter", str(src), "--config", str(src / "config.json"), "--tp",
                  "2", "--distributed-config", ep, "--no-sync", "-o", str(work / "o3")]),
                ("cp -r", ["cp", "-r", str(src), str(work / "o4")]),
                ("gather --dequantize (synced)", gather + ["-o", str(work / "o5")])):
            os.sync()
            seconds, peak, anon = timed(cmd)
            rows[key].append(seconds)
            peaks[key] = max(peaks[key], anon or peak)
            shutil.rmtree(work / f"o{list(rows).index(key) + 1}")
    med = {k: statistics.median(v) for k, v in rows.items()}
    best = {k: min(v) for k, v in rows.items()}
    g, e = "gather --dequantize --no-sync", "scatter --config EP 2 --no-sync"
    for k in rows:
        print(f"{k:32s} median {med[k]:6.2f} s  best {best[k]:6.2f} s  peak anon RSS {peaks[k] / 1e6:7.0f} MB")
    print(f"gather --dequantize vs the torch loop: {med['torch loop'] / med[g]:.2f}x "
          f"(median), {best['torch loop'] / best[g]:.2f}x (best); bar >= 3x")
    print(f"scatter --config EP 2 vs cp -r: {med['cp -r'] / med[e]:.2f}x "
          f"(median), {best['cp -r'] / best[e]:.2f}x (best); bar >= 0.5x")
    if not args.work:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
