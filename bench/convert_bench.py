"""File conversion speed and memory (DESIGN 9): re-sharding a multi-GB checkpoint must run at
>= 0.5x the throughput of `cp` of the same files in the same run, with peak memory set by the
largest tensor, not by the checkpoint size.

Makes two full checkpoints with the same largest tensor (1x and 4x the total size), scatters
each to TP 8, then times `cp -r` of the TP 8 directory against `reshard convert --tp 2` of it
and reports the peak resident memory of each convert (GNU time's maximum RSS).

    python bench/convert_bench.py [--reshard build-release/tools/reshard/reshard] [--scale-gb 1]
        [--repeat 2] [--only 1|4]

The load average is printed before and after: on a shared machine, read the ratios of a run
taken while nothing else ran (more --repeat narrows the noise: the best of each is kept).

With --replica-cost it measures instead what verifying replicas costs convert: a checkpoint
whose every tensor is replicated (the worst case: every byte is compared) is scattered to
TP 2 and converted to TP 1 with and without --no-verify-replicas.
"""

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time

import numpy as np
from safetensors.numpy import save_file


def make_checkpoint(path, largest_rows, hidden, others, other_rows, seed):
    rng = np.random.default_rng(seed)
    tensors = {"embed.weight": rng.integers(0, 1 << 16, (largest_rows, hidden), dtype=np.uint16)}
    for i in range(others):
        tensors[f"layers.{i}.weight"] = rng.integers(0, 1 << 16, (other_rows, hidden), dtype=np.uint16)
    os.makedirs(path)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return sum(t.nbytes for t in tensors.values())


def timed(cmd):
    t0 = time.perf_counter()
    r = subprocess.run(["/usr/bin/time", "-f", "%M"] + cmd, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{cmd} failed: {r.stderr}")
    peak_kb = int(r.stderr.strip().splitlines()[-1])
    return elapsed, peak_kb


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def replica_cost(args, work):
    hidden, rows = 4096, 8192  # 64 MiB tensors
    count = max(1, int(args.scale_gb * 1e9 / (rows * hidden * 2)))
    full = os.path.join(work, "full")
    total = make_checkpoint(full, rows, hidden, count - 1, rows, 0)
    layouts = os.path.join(work, "layouts.json")
    with open(layouts, "w") as f:
        json.dump({"version": 1, "*": {"family": "replicated"}}, f)
    tp2 = os.path.join(work, "tp2")
    subprocess.run([args.reshard, "scatter", full, "--layouts", layouts, "--tp", "2", "-o", tp2],
                   check=True, capture_output=True)
    shutil.rmtree(full)
    subprocess.run(["cat"] + [os.path.join(tp2, f) for f in os.listdir(tp2)], stdout=subprocess.DEVNULL,
                   check=True)
    out = os.path.join(work, "tp1")
    best = {"verified": float("inf"), "--no-verify-replicas": float("inf")}
    for _ in range(3):
        for mode in best:
            subprocess.run(["sync"], check=True)
            extra = [mode] if mode.startswith("--") else []
            t, _ = timed([args.reshard, "convert", tp2, "--tp", "1", "-o", out] + extra)
            best[mode] = min(best[mode], t)
            shutil.rmtree(out)
    size = dir_bytes(tp2)
    print(f"every tensor replicated: {total / 1e9:.2f} GB of F, TP 2 directory {size / 1e9:.2f} GB; "
          f"convert TP 2 -> 1, best of 3:")
    for mode, t in best.items():
        print(f"  {mode:<22} {t:6.2f} s ({size / t / 1e9:5.2f} GB/s read)")
    print(f"  verification costs {best['verified'] / best['--no-verify-replicas']:.2f}x the time")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reshard", default="build-release/tools/reshard/reshard")
    ap.add_argument("--scale-gb", type=float, default=1.0, help="size of the 1x checkpoint")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--repeat", type=int, default=2, help="measurements of each, best kept")
    ap.add_argument("--only", type=int, choices=(1, 4), help="measure one checkpoint size only")
    ap.add_argument("--replica-cost", action="store_true",
                    help="measure the cost of verifying replicas in convert instead")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="reshard-bench-", dir=args.workdir)
    if args.replica_cost:
        try:
            replica_cost(args, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    try:
        hidden = 4096
        largest_rows = 32768  # 256 MiB of 16-bit elements: the largest tensor of both
        other_rows = 8192     # 64 MiB each
        base_others = max(1, int((args.scale_gb * 1e9 - largest_rows * hidden * 2) / (other_rows * hidden * 2)))
        layouts = os.path.join(work, "layouts.json")
        with open(layouts, "w") as f:
            json.dump({"version": 1, "*": {"family": "split", "dim": 0}}, f)
        print(f"reshard convert vs cp; largest tensor {largest_rows}x{hidden} U16 = "
              f"{largest_rows * hidden * 2 / 2**20:.0f} MiB in both checkpoints")
        results = {}
        print(f"load average at start: {os.getloadavg()[0]:.2f}")
        for factor in (args.only,) if args.only else (1, 4):
            full = os.path.join(work, f"full{factor}")
            make_checkpoint(full, largest_rows, hidden, base_others * factor + (factor - 1) * 3,
                            other_rows, factor)
            tp8 = os.path.join(work, f"tp8-{factor}")
            subprocess.run([args.reshard, "scatter", full, "--layouts", layouts, "--tp", "8", "-o", tp8], check=True,
                           capture_output=True)
            shutil.rmtree(full)
            size = dir_bytes(tp8)
            # Warm the page cache the same way for both (read once), and start each measurement
            # with no dirty pages. reshard syncs its outputs before renaming them into place,
            # so the like-for-like reference is a copy that is synced too (cp, then sync).
            subprocess.run(["cat"] + [os.path.join(tp8, f) for f in os.listdir(tp8)], stdout=subprocess.DEVNULL, check=True)
            # Each measured --repeat times, alternating, best kept; outputs are deleted (and the
            # deletion synced) before the next run so neither inherits the other's page cache.
            copy, tp2 = os.path.join(work, "copy"), os.path.join(work, "tp2")
            t_cp = t_cv = float("inf")
            peak = 0
            for _ in range(args.repeat):
                subprocess.run(["sync"], check=True)
                t, p = timed([args.reshard, "convert", tp8, "--tp", "2", "-o", tp2])
                if t < t_cv:
                    t_cv, peak = t, p
                shutil.rmtree(tp2)
                subprocess.run(["sync"], check=True)
                t, _ = timed(["sh", "-c", f"cp -r {tp8} {copy} && sync"])
                t_cp = min(t_cp, t)
                shutil.rmtree(copy)
            shutil.rmtree(tp8)
            cp_rate = size / t_cp / 1e9
            cv_rate = size / t_cv / 1e9
            results[factor] = peak
            print(f"{factor}x checkpoint {size / 1e9:5.2f} GB: cp+sync {t_cp:6.2f} s ({cp_rate:5.2f} GB/s), "
                  f"convert TP 8 -> 2 {t_cv:6.2f} s ({cv_rate:5.2f} GB/s) = {cv_rate / cp_rate:4.2f}x cp "
                  f"(bar 0.5x: {'PASS' if cv_rate >= 0.5 * cp_rate else 'MISS'}); "
                  f"convert peak RSS {peak / 1024:7.1f} MiB")
        if len(results) == 2:
            print(f"peak RSS 4x / 1x: {results[4] / results[1]:.2f} (the largest tensor is the "
                  f"same: memory follows it, not the checkpoint)")
        print(f"load average at end: {os.getloadavg()[0]:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
