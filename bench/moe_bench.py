"""Mixture-of-experts scatter speed and memory (DESIGN 9): scattering a >= 1 GB per-expert
checkpoint to EP 2 and to TP 2 must run at >= 0.5x `cp` of the same files in the same run, with
peak memory set by the largest rank tensor, not by the checkpoint.

Writes a Qwen3-MoE-shaped checkpoint as the hub stores one (per-expert tensors, bf16, one
safetensors file per layer and an index): by default 4 layers, 64 experts, hidden 1024, expert
intermediate 768, 16 query heads and 4 key/value heads of 64, vocabulary 32768, untied LM head:
1.35 GB, every tensor transformers' checkpoint holds (`model.layers.L.mlp.experts.E.{gate,up,
down}_proj.weight`, the router `mlp.gate.weight`, attention with its q/k norms, both layer norms,
the embedding, the final norm and `lm_head.weight`). No model is instantiated: the headers and
random bytes are written directly.

Then, --repeat times each, alternating, median reported:
- `reshard scatter FULL --config config.json --tp 2 --distributed-config DC` at EP 2
  (`{"tp_plan": "auto", "ep_size": 2}`: each rank holds 32 whole experts stacked into
  `experts.gate_up_proj` [32, 1536, 1024] and `experts.down_proj`) and at TP 2
  (`{"tp_plan": "auto"}`: each rank holds half of the gate rows and half of the up rows of every
  expert, `gate_up_proj` [64, 768, 1024]);
- `cp -r FULL COPY` of the same files.
Both like-for-like pairs: synced (reshard's default, which flushes its files before the
output's rename, against `cp -r` then `sync`) and unsynced (`--no-sync` against `cp -r`); and
unsynced again with RESHARD_COPY_FILE_RANGE=0, every byte copied through memory, as reshard
did before it had the file system copy unchanged ranges (whole experts, whole tensors, row
blocks) with copy_file_range, as cp does. Bars: 0.5x cp for every pair; 0.8x cp for
`--no-sync` scatter to EP 2.
Every output is removed and `sync` run before each run, so that no run pays for another's
writeback; the input is read once first so that both sides read it from the page cache.
On a shared machine the runs of either side vary by several times (other work competes for the
two cores and the page cache): the medians and the best runs are both printed.
Then `reshard convert TP2 --tp 2 --distributed-config EP2` (TP 2 -> EP 2, buffer to buffer) is
timed the same way against `cp -r` of the TP 2 directory.

Peak memory is the child's maximum resident set (getrusage of the waited child, what GNU time
reports), which counts the pages of the mapped input; its anonymous part (RssAnon, sampled every
20 ms) is the memory reshard allocates itself.

    python bench/moe_bench.py [--reshard build-release/tools/reshard/reshard] [--repeat 5]
                              [--layers 4] [--experts 64] [--work DIR] [--keep]
"""

import argparse
import json
import os
import pathlib
import shutil
import statistics
import struct
import subprocess
import tempfile

import numpy as np

from _measure import dir_bytes, timed

EP2 = json.dumps({"tp_plan": "auto", "ep_size": 2})
TP2 = json.dumps({"tp_plan": "auto"})


def model_config(args):
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": args.hidden, "intermediate_size": 3 * args.hidden,
        "moe_intermediate_size": args.moe_intermediate, "num_experts": args.experts,
        "num_experts_per_tok": 8, "num_hidden_layers": args.layers, "num_attention_heads": 16,
        "num_key_value_heads": 4, "head_dim": args.hidden // 16, "vocab_size": args.vocab,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "max_position_embeddings": 4096,
    }


def layer_tensors(cfg, layer):
    """(name, shape) of every tensor of one decoder layer, in the hub's order."""
    h, i, d = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    p = f"model.layers.{layer}."
    out = [(p + "input_layernorm.weight", [h]), (p + "post_attention_layernorm.weight", [h]),
           (p + "self_attn.q_proj.weight", [q, h]), (p + "self_attn.k_proj.weight", [kv, h]),
           (p + "self_attn.v_proj.weight", [kv, h]), (p + "self_attn.o_proj.weight", [h, q]),
           (p + "self_attn.q_norm.weight", [d]), (p + "self_attn.k_norm.weight", [d]),
           (p + "mlp.gate.weight", [cfg["num_experts"], h])]
    for e in range(cfg["num_experts"]):
        out += [(p + f"mlp.experts.{e}.gate_proj.weight", [i, h]),
                (p + f"mlp.experts.{e}.up_proj.weight", [i, h]),
                (p + f"mlp.experts.{e}.down_proj.weight", [h, i])]
    return out


def write_safetensors(path, tensors, rng):
    """A bf16 safetensors file of random bits, written tensor by tensor (flat memory)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors:
        n = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for _, shape in tensors:
            f.write(rng.integers(0, 1 << 16, int(np.prod(shape)), dtype=np.uint16).tobytes())
    return offset


def make_checkpoint(path, cfg):
    path.mkdir(parents=True)
    rng = np.random.default_rng(0)
    files = [[("model.embed_tokens.weight", [cfg["vocab_size"], cfg["hidden_size"]])]]
    files += [layer_tensors(cfg, layer) for layer in range(cfg["num_hidden_layers"])]
    files += [[("model.norm.weight", [cfg["hidden_size"]]),
               ("lm_head.weight", [cfg["vocab_size"], cfg["hidden_size"]])]]
    weight_map, total = {}, 0
    for k, tensors in enumerate(files):
        name = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        total += write_safetensors(path / name, tensors, rng)
        weight_map.update({t: name for t, _ in tensors})
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return sum(len(f) for f in files)


def largest_tensor(path):
    """(bytes, name) of the largest tensor in the safetensors files of a directory."""
    best = (0, "")
    for f in pathlib.Path(path).glob("*.safetensors"):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name != "__metadata__":
                best = max(best, (t["data_offsets"][1] - t["data_offsets"][0], name))
    return best


def fresh(*dirs):
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    subprocess.run(["sync"], check=True)


def warm(path):
    subprocess.run(["cat", *map(str, sorted(pathlib.Path(path).iterdir()))],
                   stdout=subprocess.DEVNULL, check=True)


THROUGH_MEMORY = {"RESHARD_COPY_FILE_RANGE": "0"}


def compare(label, cmd, src, out, copy, repeat, bar):
    """Runs `cmd` (writing `out`) and `cp -r src copy`, synced and not, alternating; `bar`:
    the least ratio to cp asked of --no-sync."""
    runs = {"synced": [], "no_sync": [], "no_sync_memory": [], "cp_sync": [], "cp": []}
    for _ in range(repeat):
        fresh(out, copy)
        runs["synced"].append(timed(cmd))
        out_bytes = dir_bytes(out)
        fresh(out, copy)
        t, _, _ = timed(["sh", "-c", f"cp -r '{src}' '{copy}' && sync"])
        runs["cp_sync"].append((t, 0, 0))
        fresh(copy)
        runs["no_sync"].append(timed(cmd + ["--no-sync"]))
        fresh(out, copy)
        runs["cp"].append(timed(["cp", "-r", str(src), str(copy)]))
        fresh(out, copy)
        runs["no_sync_memory"].append(timed(cmd + ["--no-sync"], env=THROUGH_MEMORY))
    fresh(out, copy)
    med = {k: statistics.median(r[0] for r in v) for k, v in runs.items()}
    best = {k: min(r[0] for r in v) for k, v in runs.items()}
    rss = max(r[1] for r in runs["synced"] + runs["no_sync"])
    anon = max(r[2] for r in runs["synced"] + runs["no_sync"])
    src_bytes = dir_bytes(src)
    print(f"\n{label}: reads {src_bytes / 1e9:.2f} GB, writes {out_bytes / 1e9:.2f} GB; "
          f"median of {repeat}")
    verdicts = []
    for mine, ref, what, least in (("synced", "cp_sync", "synced (cp -r && sync)", 0.5),
                                   ("no_sync", "cp", "--no-sync (cp -r)", bar),
                                   ("no_sync_memory", "cp", "--no-sync, through memory", 0.5)):
        ratio = med[ref] / med[mine]
        best_ratio = best[ref] / best[mine]
        verdicts.append(ratio)
        times = ", ".join(f"{r[0]:.2f}" for r in runs[mine])
        cp_times = ", ".join(f"{r[0]:.2f}" for r in runs[ref])
        print(f"  {what:24} reshard {med[mine]:6.2f} s ({out_bytes / med[mine] / 1e9:5.2f} GB/s)"
              f"  cp {med[ref]:6.2f} s ({src_bytes / med[ref] / 1e9:5.2f} GB/s)  = {ratio:4.2f}x cp"
              f" (bar {least}x: {'PASS' if ratio >= least else 'MISS'}); best {best[mine]:.2f} s against"
              f" {best[ref]:.2f} s = {best_ratio:4.2f}x\n{'':28}runs {times} | cp {cp_times}")
    print(f"  peak RSS {rss / 2**20:7.1f} MiB (anonymous {anon / 2**20:7.1f} MiB)")
    return verdicts, rss, anon


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reshard", default="build-release/tools/reshard/reshard")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--moe-intermediate", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--work", default=None, help="folder for the checkpoints (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="reshard-moe-bench-", dir=args.work))
    try:
        cfg = model_config(args)
        full = work / "full"
        count = make_checkpoint(full, cfg)
        size = dir_bytes(full)
        big, big_name = largest_tensor(full)
        print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} "
              f"{os.getloadavg()[2]:.2f}; {os.cpu_count()} CPUs")
        print(f"Qwen3-MoE-shaped checkpoint: {cfg['num_hidden_layers']} layers, "
              f"{cfg['num_experts']} experts, hidden {cfg['hidden_size']}, expert intermediate "
              f"{cfg['moe_intermediate_size']}: {count} tensors, {size / 1e9:.2f} GB; largest "
              f"checkpoint tensor {big / 2**20:.1f} MiB ({big_name})")
        warm(full)
        config = str(full / "config.json")
        results, largest = {}, {}
        for label, dc in (("scatter EP 2", EP2), ("scatter TP 2", TP2)):
            out = work / label.split()[-2].lower()
            cmd = [args.reshard, "scatter", str(full), "--config", config, "--tp", "2",
                   "--distributed-config", dc, "-o", str(out)]
            # One untimed run to name the largest rank tensor.
            fresh(out)
            timed(cmd + ["--no-sync"])
            rank_big, rank_name = largest_tensor(out)
            print(f"\n{label}: largest rank tensor {rank_big / 2**20:.1f} MiB ({rank_name})")
            results[label] = compare(label, cmd, full, out, work / "copy", args.repeat,
                                     0.8 if label == "scatter EP 2" else 0.5)
            largest[label] = rank_big
        # TP 2 -> EP 2 of the scattered TP 2 checkpoint.
        tp2 = work / "tp2"
        subprocess.run([args.reshard, "scatter", str(full), "--config", config, "--tp", "2",
                        "--distributed-config", TP2, "-o", str(tp2)], check=True,
                       capture_output=True)
        warm(tp2)
        cmd = [args.reshard, "convert", str(tp2), "--tp", "2", "--distributed-config", EP2, "-o",
               str(work / "ep2")]
        results["convert"] = compare("convert TP 2 -> EP 2", cmd, tp2, work / "ep2",
                                     work / "copy", args.repeat, 0.5)
        print(f"\nsummary: checkpoint {size / 2**20:.0f} MiB; largest rank tensor "
              + ", ".join(f"{k[-4:]} {v / 2**20:.0f} MiB" for k, v in largest.items()))
        for label, (ratios, rss, anon) in results.items():
            print(f"  {label:22} synced {ratios[0]:4.2f}x cp, --no-sync {ratios[1]:4.2f}x cp "
                  f"(through memory {ratios[2]:4.2f}x), peak RSS {rss / 2**20:.0f} MiB (anonymous {anon / 2**20:.0f} MiB)")
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
