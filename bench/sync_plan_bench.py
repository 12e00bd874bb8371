"""The fleet sync plan at cluster scale, on paper (DESIGN 21; docs/benchmarks.md): `reshard
sync-plan` on the clusters of published weight-sync results, with the bandwidths each assumes.
For each: one copy of the model, bytes out of the trainer, the busiest link, the lower bound
(its bytes over its bandwidth), the time the simulation of the schedule predicts, and how long
planning took; beside it, the published figure it compares with.

  bars: predicted <= 1.2x the lower bound; bytes out of the trainer = one copy of the model.

    python bench/sync_plan_bench.py [--reshard build/tools/reshard/reshard] [--only NAME]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = REPO / "tests" / "data" / "sync-plan"
DEEPSEEK = CONFIGS / "deepseek-ai--DeepSeek-V3.json"
KIMI = CONFIGS / "kimi-k2-shaped.json"
QWEN3_MOE = CONFIGS / "Qwen--Qwen3-30B-A3B.json"

# Bandwidths per direction, GB/s. H100 / H800 / H20 NVLink 4: 900 GB/s both ways = 450 each;
# 8 x 400 Gb/s InfiniBand / RoCE per host = 400 GB/s, 50 GB/s per GPU (rail-optimised: one NIC
# per GPU).
H100 = {"nvlink_gbps": 450, "nic_gbps": 50, "nic": "gpu"}
H20 = {"nvlink_gbps": 450, "nic_gbps": 50, "nic": "gpu"}


def topology(trainer_gpus: int, engine_gpus: int, links: dict) -> dict:
    hosts = [{"name": "train", "count": trainer_gpus // 8, "gpus": 8},
             {"name": "infer", "count": engine_gpus // 8, "gpus": 8}]
    return {"hosts": hosts, **links}


# name, config, dtype, trainer grid, engines, engine TP, links, reference
CASES = [
    ("DeepSeek-V3 BF16", DEEPSEEK, "BF16", "tp=8,pp=8,ep=8", 16, 16, H100,
     "NeMo-RL refit 47 s, 3.3 s speed of light"),
    ("DeepSeek-V3 FP8", DEEPSEEK, "F8_E4M3", "tp=8,pp=8,ep=8", 16, 16, H100,
     "NeMo-RL refit 47 s, 3.3 s speed of light"),
    ("Kimi-K2 1T BF16, 256 H20", KIMI, "BF16", "tp=8,pp=8,ep=4", 16, 16, H20,
     "checkpoint-engine 16 s (256 H20, every rank gets every bucket)"),
    ("Kimi-K2 1T BF16 -> FP8, 256 -> 128", KIMI, "F8_E4M3", "tp=8,pp=4,ep=8", 16, 8, H100,
     "RDMA point-to-point 1.3 s (256 BF16 -> 128 FP8 GPUs)"),
    ("Qwen3-30B-A3B, 32 H100", QWEN3_MOE, "BF16", "tp=2,ep=8", 4, 4, H100,
     "verl ~7 s (32 H100, colocated)"),
]


def run(reshard: str, case: tuple, tmp: pathlib.Path) -> dict:
    name, config, dtype, trainer, engines, engine_tp, links, _ = case
    grid = dict(part.split("=") for part in trainer.split(","))
    trainer_gpus = 1
    for v in grid.values():
        trainer_gpus *= int(v)
    topo = tmp / "topo.json"
    topo.write_text(json.dumps(topology(trainer_gpus, engines * engine_tp, links)))
    t0 = time.perf_counter()
    r = subprocess.run([reshard, "sync-plan", "--config", str(config), "--trainer", trainer,
                        "--engines", str(engines), "--engine-tp", str(engine_tp),
                        "--dtype", dtype, "--topology", str(topo), "--json"],
                       capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"{name}: {r.stderr}")
    report = json.loads(r.stdout)
    report["wall_s"] = wall
    report["trainer_gpus"] = trainer_gpus
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reshard", default=str(REPO / "build" / "tools" / "reshard" / "reshard"))
    ap.add_argument("--only", default=None, help="run the cases whose name contains this")
    args = ap.parse_args()
    print("| case | trainer | engines | one copy | out of trainer | busiest link | lower bound "
          "| predicted | ratio | rounds | planned in | published |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    failed = []
    with tempfile.TemporaryDirectory() as d:
        for case in CASES:
            if args.only and args.only not in case[0]:
                continue
            r = run(args.reshard, case, pathlib.Path(d))
            name, _, _, trainer, engines, engine_tp, links, ref = case
            busiest = r["busiest_link"]
            ratio = r["predicted_over_lower_bound"]
            print(f"| {name} | {trainer} ({r['trainer_gpus']} GPUs) | {engines} x TP {engine_tp} "
                  f"| {r['one_copy_bytes'] / 1e9:.0f} GB "
                  f"| {r['trainer_egress_bytes'] / 1e9:.0f} GB "
                  f"| {busiest['name']} ({busiest['bytes'] / 1e9:.0f} GB at "
                  f"{busiest['bandwidth_gbps']:.0f} GB/s) "
                  f"| {r['lower_bound_s']:.2f} s | {r['predicted_s']:.2f} s | {ratio:.2f}x "
                  f"| {r['rounds']} | {r['planning_s']:.1f} s ({r['wall_s']:.1f} s in all) "
                  f"| {ref} |", flush=True)
            if ratio > 1.2 or r["trainer_egress_bytes"] != r["one_copy_bytes"]:
                failed.append(name)
    print(f"\nbars (predicted <= 1.2x lower bound, trainer egress = one copy): "
          f"{'met' if not failed else 'missed by ' + ', '.join(failed)}")


if __name__ == "__main__":
    main()
