"""One weight sync into two vLLM engines (DESIGN 21; docs/benchmarks.md): trainer processes at
TP 2 push a Llama-shaped model of --mb MB (float32) into engines at --engine-tp, over one gloo
group on CPU, three ways, each --repeat times (median):

  one engine    WeightSync(llm): the push into one engine alone (the reference)
  two engines   WeightSync(engines=[llm_a, llm_b]): the sync schedule; the trainer processes
                send each byte once (to the tensor's root engine); the engines' workers relay
                the rest to each other
  two syncs     a WeightSync per engine, pushed one after the other: what users do today,
                every byte leaving the trainer once per engine

  bars: two engines <= 1.4x the time of one; trainer egress of two engines = that of one
  (two syncs: 2x).

    VLLM_CPU_OMP_THREADS_BIND=nobind python bench/fleet_bench.py [--engine-tp 1] [--mb 160]
                                                                 [--waves 4]

Process r of the two trainer processes owns engine r. On a GPU machine (bench/gpu_check.sh):
--gpu-each puts engine r on GPU r; --backend nccl moves everything over NCCL, every process on
a GPU of its own (engine r's worker on GPU r, trainer process r on GPU 2 + r: four GPUs), so the
schedule's lanes run as concurrent NCCL communicators.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import live_sync_main, trainer_arguments  # noqa: E402
from vllm_sync_bench import config_for, write_model  # noqa: E402


def trainer(args: argparse.Namespace) -> None:
    """One trainer process (``--rank``), owning engine ``--rank``."""
    nccl = args.backend == "nccl"
    if nccl:  # the engine's worker (a process of its own) takes cuda:0, this process cuda:1
        os.environ["CUDA_VISIBLE_DEVICES"] = f"{args.rank},{2 + args.rank}"
    elif args.gpu_each:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(args.rank)
    import torch
    import torch.distributed as dist

    import reshard
    from reshard.vllm import WeightSync
    from vllm import LLM
    torch.set_num_threads(1)
    if nccl:
        torch.cuda.set_device(1)
    dist.init_process_group(args.backend, init_method="file://" + os.path.join(args.work, "pg"),
                            rank=args.rank, world_size=2)
    llm = LLM(model=args.model, tensor_parallel_size=args.engine_tp, enforce_eager=True,
              skip_tokenizer_init=True, dtype="float32", kv_cache_memory_bytes=32 << 20,
              max_model_len=128, weight_transfer_config={"backend": "reshard"})
    maps, shards = reshard.checkpoint.load_rank(args.sharded, args.rank)
    if nccl:
        shards = {k: v.cuda() for k, v in shards.items()}
    backend = args.backend
    mine = [llm if r == args.rank else None for r in range(2)]
    times: dict[str, list[float]] = {"one": [], "two": [], "syncs": [], "second": []}
    egress: dict[str, int] = {}
    relayed = 0
    for i in range(args.repeat + 1):  # the first round untimed (one-time costs)
        one = WeightSync(mine[0], maps, backend=backend)
        one.push(shards)
        got = one.push(shards)
        one.close()
        fleet = WeightSync(engines=mine, source_maps=maps, relay_waves=args.waves,
                           backend=backend)
        fleet.push(shards)
        both = fleet.push(shards)
        fleet.close()
        each = [WeightSync(e, maps, backend=backend) for e in mine]
        for s in each:
            s.push(shards)
        apart = [s.push(shards) for s in each]
        for s in each:
            s.close()
        if i:
            times["one"].append(got.seconds)
            times["two"].append(both.seconds)
            times["syncs"].append(sum(a.seconds for a in apart))
            times["second"].append(apart[1].seconds)
        egress = {"one": got.bytes_sent, "two": both.bytes_sent,
                  "syncs": sum(a.bytes_sent for a in apart)}
        relayed = both.bytes_relayed
    if args.rank == 0:
        result = {"engine_tp": args.engine_tp, "egress": egress, "relayed": relayed,
                  "model_bytes": sum(t.numel() * t.element_size() for t in shards.values()) * 2,
                  **{k: statistics.median(v) for k, v in times.items()}, "all": times}
        with open(os.path.join(args.work, "result.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine-tp", type=int, default=1)
    ap.add_argument("--mb", type=int, default=160)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--waves", type=int, default=4, help="relay_waves of the two-engine sync")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--gpu-each", action="store_true", help="engine r on GPU r (gloo)")
    trainer_arguments(ap)
    args = ap.parse_args()
    config = config_for(args.mb)
    r = live_sync_main(__file__, args, trainer, lambda work: write_model(work, config),
                       "fleet-bench-", ["--engine-tp", str(args.engine_tp), "--repeat",
                                        str(args.repeat), "--waves", str(args.waves),
                                        "--backend", args.backend,
                                        *(["--gpu-each"] if args.gpu_each else [])], 1800)
    e = r["egress"]
    print(f"model {r['model_bytes'] / 1e6:.0f} MB float32 ({config['num_hidden_layers']} layers), "
          f"trainer TP 2 -> 2 engines at TP {r['engine_tp']}, {args.backend}, median of "
          f"{args.repeat}")
    print(f"  one engine   {r['one']:.3f} s   trainer egress {e['one'] / 1e6:.1f} MB")
    print(f"  two engines  {r['two']:.3f} s ({args.waves} waves)   trainer egress {e['two'] / 1e6:.1f} MB "
          f"({e['two'] / e['one']:.2f}x), relayed by the engines "
          f"{r['relayed'] / 1e6:.1f} MB; {r['two'] / r['one']:.2f}x the time of one (bar <= 1.4x)")
    print(f"  two syncs    {r['syncs']:.3f} s   trainer egress {e['syncs'] / 1e6:.1f} MB "
          f"({e['syncs'] / e['one']:.2f}x); {r['syncs'] / r['one']:.2f}x the time of one "
          f"(the second engine's alone: {r['second']:.3f} s)")
    ok = r["two"] <= 1.4 * r["one"] and e["two"] == e["one"]
    print("  bars:", "met" if ok else "NOT met")


if __name__ == "__main__":
    main()
