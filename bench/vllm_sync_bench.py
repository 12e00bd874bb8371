"""Live weight sync into a running vLLM engine (DESIGN 9, 18; docs/benchmarks.md): trainer
processes at TP 2 push a Llama-shaped model of --mb MB (float32) into an engine at --engine-tp,
over one gloo group on CPU (NCCL with --backend nccl, every process on a GPU of its own), three
ways, each --repeat times (median):

  reshard      WeightSync.push: each worker receives only the bytes it lacks, written
               straight into its (fused) parameters, each layer run through vLLM's post-load
               processing as soon as it has arrived (and, to measure that overlap, the same
               push with every layer processed after the transfer)
  full tensor  the trainer processes gather each tensor whole on process 0, which sends it
               to every worker, where vLLM's own loaders slice it (layer-wise reload): what
               a full-tensor weight sync does
  raw          the plan's bytes, sent as they are and dropped on arrival (the transport's
               own limit for what reshard moves)

  bars: reshard >= 2x faster than full tensor; reshard <= 1.25x raw; bytes on the wire equal
  the plan minimum.

With ``--lora R``, the engine runs with enable_lora and a rank-R adapter on q, k, v, o, gate,
up and down (held whole by both trainer processes) is pushed with WeightSync.push_lora, --repeat
times, beside the push of the whole (merged) model: its time and bytes (its plan minimum).

    VLLM_CPU_OMP_THREADS_BIND=nobind python bench/vllm_sync_bench.py [--engine-tp 2] [--mb 320]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from _measure import live_sync_main, trainer_arguments


def config_for(mb: int) -> dict:
    """A Llama of about ``mb`` MB in float32 (hidden 1024, vocabulary 8192, layers to fit)."""
    hidden, inter, vocab = 1024, 2816, 8192
    per_layer = (2 * hidden * hidden + 2 * 256 * hidden + 3 * hidden * inter + 2 * hidden) * 4
    fixed = (2 * vocab * hidden + hidden) * 4
    layers = max(1, round((mb * 1e6 - fixed) / per_layer))
    return dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=hidden,
                intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=16,
                num_key_value_heads=4, head_dim=64, vocab_size=vocab,
                max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
                torch_dtype="float32", bos_token_id=1, eos_token_id=2)


def write_model(root: str, config: dict) -> tuple[str, str]:
    """The model (random weights) and its transformers-TP-2 sharded checkpoint."""
    import torch
    from safetensors.torch import save_file
    import reshard
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    q = config["num_attention_heads"] * config["head_dim"]
    g = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": [v, h], "lm_head.weight": [v, h],
               "model.norm.weight": [h]}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        tensors.update({p + "self_attn.q_proj.weight": [q, h], p + "self_attn.k_proj.weight": [kv, h],
                        p + "self_attn.v_proj.weight": [kv, h], p + "self_attn.o_proj.weight": [h, q],
                        p + "mlp.gate_proj.weight": [i, h], p + "mlp.up_proj.weight": [i, h],
                        p + "mlp.down_proj.weight": [h, i], p + "input_layernorm.weight": [h],
                        p + "post_attention_layernorm.weight": [h]})
    full = os.path.join(root, "model")
    os.makedirs(full)
    save_file({n: 0.02 * torch.randn(s, generator=g) for n, s in tensors.items()},
              os.path.join(full, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(full, "config.json"), "w") as f:
        json.dump(config, f)
    sharded = os.path.join(root, "tp2")
    reshard.checkpoint.scatter(full, sharded, config=os.path.join(full, "config.json"), tp=2,
                               sync=False)
    return full, sharded


def adapter_for(maps: dict, r: int) -> tuple[dict, dict]:
    """A rank-``r`` adapter (PEFT's names, float32, drawn from one seed) on every attention and
    MLP projection of the model whose maps are ``maps``, and its config."""
    import torch
    g = torch.Generator().manual_seed(1)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    out = {}
    for name, m in sorted(maps.items()):
        module = name.removesuffix(".weight")
        if module.rpartition(".")[2] in targets:
            rows, cols = m.logical_shape
            out[f"base_model.model.{module}.lora_A.weight"] = 0.01 * torch.randn(r, cols,
                                                                                   generator=g)
            out[f"base_model.model.{module}.lora_B.weight"] = 0.01 * torch.randn(rows, r,
                                                                                   generator=g)
    return out, {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules":
                 list(targets)}


def trainer(args: argparse.Namespace) -> None:
    """One trainer process (``--rank``): process 0 owns the engine."""
    import torch
    import torch.distributed as dist
    import reshard
    from reshard.vllm import WeightSync
    torch.set_num_threads(max(1, args.threads))
    if args.backend == "nccl":  # the engine's workers take GPUs 0 .. tp-1, the trainer the next
        torch.cuda.set_device(args.engine_tp + args.rank)
    dist.init_process_group("nccl" if args.backend == "nccl" else "gloo", init_method="file://" + os.path.join(args.work, "pg"),
                            rank=args.rank, world_size=2)
    llm = None
    if args.rank == 0:
        from vllm import LLM
        llm = LLM(model=args.model, tensor_parallel_size=args.engine_tp, enforce_eager=True,
                  skip_tokenizer_init=True, dtype="float32", kv_cache_memory_bytes=32 << 20,
                  max_model_len=128, weight_transfer_config={"backend": "reshard"},
                  **({"enable_lora": True, "max_lora_rank": args.lora} if args.lora else {}))
    maps, shards = reshard.checkpoint.load_rank(args.sharded, args.rank)
    if args.backend == "nccl":
        shards = {k: v.cuda() for k, v in shards.items()}
    sync = WeightSync(llm, maps, backend=args.backend)
    # The push as WeightSync makes it by default (layers processed after the transfer on a
    # CPU engine, during it on a GPU engine), and the other way, to show what the choice gives.
    default_overlap = torch.cuda.is_available()
    parts = ("transfer", "prepare", "process", "commit")
    times: dict[str, list[float]] = {k: [] for k in ("reshard", "other", "full", "raw", *parts,
                                                      *(f"other_{p}" for p in parts))}
    stats = None
    # One untimed round of every path first (the first push of a process pays one-time costs:
    # its first oneDNN repack, fresh memory).
    sync.push(shards)
    sync._push_plan(shards, not default_overlap)
    sync._push_full(maps, shards)
    sync._push_raw()
    for i in range(args.repeat):  # interleaved, so that drift hits every path alike
        # The two pushes take turns going first (the first after the other paths pays more
        # for fresh memory).
        for which in (("reshard", "other") if i % 2 == 0 else ("other", "reshard")):
            if which == "reshard":
                stats = sync.push(shards)
                got, prefix = stats, ""
            else:
                got, prefix = sync._push_plan(shards, not default_overlap), "other_"
            times[which].append(got.seconds)
            for part, seconds in (got.worker_seconds or {}).items():
                times[prefix + part].append(seconds)
        times["full"].append(sync._push_full(maps, shards).seconds)
        times["raw"].append(sync._push_raw().seconds)
    assert stats is not None
    lora: dict = {}
    if args.lora:
        adapter, config = adapter_for(maps, args.lora)
        sync.push_lora("bench", adapter, config=config)  # untimed, as above
        runs = [sync.push_lora("bench", adapter, config=config) for _ in range(args.repeat)]
        lora = {"lora_seconds": statistics.median(r.seconds for r in runs),
                "lora_bytes": runs[0].bytes_sent, "lora_minimum": runs[0].plan_minimum,
                "adapter_bytes": sum(t.numel() * t.element_size() for t in adapter.values())}
    if args.rank == 0:
        model_bytes = sum(t.numel() * t.element_size() for t in shards.values()) * 2
        # full tensor: the gather to process 0 (half the model), then the model to each worker
        full_wire = model_bytes // 2 + args.engine_tp * model_bytes
        result = {"engine_tp": args.engine_tp, "model_bytes": model_bytes,
                  "overlap": default_overlap,
                  "bytes_sent": stats.bytes_sent, "plan_minimum": stats.plan_minimum,
                  "full_bytes": full_wire,
                  **{k: statistics.median(v) for k, v in times.items()},
                  **{f"min_{k}": min(v) for k, v in times.items()},
                  "all": times, **lora}
        with open(os.path.join(args.work, "result.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine-tp", type=int, default=2)
    ap.add_argument("--mb", type=int, default=320)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lora", type=int, default=0)
    trainer_arguments(ap)
    args = ap.parse_args()
    config = config_for(args.mb)
    # With nccl, process 0's engine workers take GPUs 0..tp-1.
    gpus = {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(args.engine_tp + 2))} \
        if args.backend == "nccl" else {}
    r = live_sync_main(__file__, args, trainer, lambda work: write_model(work, config),
                       "vllm-sync-bench-", ["--engine-tp", str(args.engine_tp), "--repeat",
                                            str(args.repeat), "--backend", args.backend,
                                            "--threads", str(args.threads),
                                            "--lora", str(args.lora)], 1200, gpus)
    mb = r["model_bytes"] / 1e6
    print(f"model {mb:.0f} MB float32 ({config['num_hidden_layers']} layers), trainer TP 2 -> "
          f"engine TP {r['engine_tp']}, {args.backend}, median of {args.repeat}")
    print(f"  bytes on the wire: reshard {r['bytes_sent'] / 1e6:.1f} MB "
          f"(plan minimum {r['plan_minimum'] / 1e6:.1f} MB), full tensor "
          f"{r['full_bytes'] / 1e6:.1f} MB")
    ways = ("processed during the transfer", "processed after the transfer")
    default, other = ways if r["overlap"] else ways[::-1]
    print(f"  reshard push   {r['reshard']:.3f} s (default: layers {default}; fastest "
          f"{r['min_reshard']:.3f} s)")
    print(f"  full tensor    {r['full']:.3f} s   reshard is {r['full'] / r['reshard']:.2f}x "
          f"faster (bar >= 2x)")
    print(f"    of which, on the slowest worker: prepare {r['prepare']:.3f} s, transfer "
          f"{r['transfer']:.3f} s, post-load processing {r['process']:.3f} s, commit "
          f"{r['commit']:.3f} s")
    print(f"  reshard push with layers {other}: {r['other']:.3f} s (fastest "
          f"{r['min_other']:.3f} s; transfer {r['other_transfer']:.3f} s, processing "
          f"{r['other_process']:.3f} s)")
    print(f"  raw send       {r['raw']:.3f} s (fastest {r['min_raw']:.3f} s)   reshard's transfer takes "
          f"{r['transfer'] / r['raw']:.2f}x of it (bar <= 1.25x), the whole push "
          f"{r['reshard'] / r['raw']:.2f}x")
    ok = (r["bytes_sent"] == r["plan_minimum"] and r["full"] >= 2 * r["reshard"]
          and r["transfer"] <= 1.25 * r["raw"])
    print("  bars:", "met" if ok else "NOT met")
    if args.lora:
        print(f"  rank-{args.lora} adapter ({r['adapter_bytes'] / 1e6:.2f} MB): push_lora "
              f"{r['lora_seconds']:.3f} s, {r['lora_bytes'] / 1e6:.2f} MB on the wire (plan "
              f"minimum {r['lora_minimum'] / 1e6:.2f} MB); the merged model's push "
              f"{r['reshard']:.3f} s, {r['bytes_sent'] / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
