"""reshard convert across 1, 2 and 4 MPI processes on the same >= 2 GB checkpoint, and a paper
model of a 2 TB conversion from the measured per-process throughput.

Makes a full checkpoint of 64 MiB U16 tensors (split along dim 0), scatters it to TP 8, and
times `mpirun -n K reshard convert --tp 4 --max-shard-size 300MB` (files shared out by bytes)
for K = 1, 2, 4, each best of three, alternating, with the input in the page cache and no dirty
pages at the start of a run. Reports the wall time, the rate (bytes written / s), and every
process's bytes written and read (from --json). Each process also reports its own time to
finish writing (the wall time includes mpirun's start-up, opening and planning).

    python bench/mpi_bench.py [--reshard build/tools/reshard/reshard] [--scale-gb 2.1]
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

MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe"]


def make_checkpoint(path, count, rows, hidden):
    rng = np.random.default_rng(0)
    os.makedirs(path)
    tensors = {f"layers.{i}.weight": rng.integers(0, 1 << 16, (rows, hidden), dtype=np.uint16)
               for i in range(count)}
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return sum(t.nbytes for t in tensors.values())


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def run_convert(args, k, src, out):
    subprocess.run(["sync"], check=True)
    cmd = MPIRUN + ["-n", str(k), args.reshard, "convert", src, "--tp", "4", "--max-shard-size",
                    "300MB", "-o", out, "--json"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{cmd} failed: {r.stderr}")
    return elapsed, json.loads(r.stdout)


def startup_cost(args, work, k):
    """The wall time of the same command on a tiny checkpoint: mpirun's start-up, MPI's
    initialisation and the exchanges, with next to nothing to write."""
    tiny = os.path.join(work, "tiny-full")
    make_checkpoint(tiny, 8, 64, 64)
    layouts = os.path.join(work, "layouts.json")
    tp8 = os.path.join(work, "tiny-tp8")
    subprocess.run([args.reshard, "scatter", tiny, "--layouts", layouts, "--tp", "8", "-o", tp8],
                   check=True, capture_output=True)
    best = float("inf")
    for _ in range(3):
        out = os.path.join(work, "tiny-out")
        t, _ = run_convert(args, k, tp8, out)
        best = min(best, t)
        shutil.rmtree(out)
    shutil.rmtree(tiny)
    shutil.rmtree(tp8)
    return best


def model_2tb(rate_1, fixed):
    """Prints the paper model: T = fixed + 2 TB / min(N x r, nodes x node storage, shared file
    system), with r the one-process rate measured here, the fixed cost measured here, and the
    storage figures assumed (a node's link to shared storage: 2 GB/s; a parallel file system's
    aggregate: 100 GB/s)."""
    size, node_bw, fs_bw = 2e12, 2e9, 100e9
    print(f"\npaper model, 2 TB conversion: every process at the one-process rate measured here "
          f"({rate_1 / 1e9:.2f} GB/s), plus a fixed {fixed:.1f} s:")
    print(f"{'nodes x procs':>14} {'CPU only':>10} {'+ 2 GB/s per node':>18} {'+ 100 GB/s FS':>14}")
    for nodes, per_node in ((1, 1), (1, 8), (4, 8), (16, 8), (64, 8)):
        n = nodes * per_node
        cpu = fixed + size / (n * rate_1)
        node = fixed + size / min(n * rate_1, nodes * node_bw)
        fs = fixed + size / min(n * rate_1, nodes * node_bw, fs_bw)
        print(f"{nodes:>5} x {per_node:<6} {cpu / 60:8.1f} min {node / 60:15.1f} min "
              f"{fs / 60:11.1f} min")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reshard", default="build/tools/reshard/reshard")
    ap.add_argument("--scale-gb", type=float, default=2.1)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="reshard-mpi-bench-", dir=args.workdir)
    try:
        rows, hidden = 8192, 4096  # 64 MiB tensors
        count = max(4, int(args.scale_gb * 1e9 / (rows * hidden * 2)))
        full = os.path.join(work, "full")
        make_checkpoint(full, count, rows, hidden)
        layouts = os.path.join(work, "layouts.json")
        with open(layouts, "w") as f:
            json.dump({"version": 1, "*": {"family": "split", "dim": 0}}, f)
        tp8 = os.path.join(work, "tp8")
        subprocess.run([args.reshard, "scatter", full, "--layouts", layouts, "--tp", "8", "-o", tp8],
                       check=True, capture_output=True)
        shutil.rmtree(full)
        size = dir_bytes(tp8)
        subprocess.run(["cat"] + [os.path.join(tp8, f) for f in os.listdir(tp8)],
                       stdout=subprocess.DEVNULL, check=True)
        print(f"convert TP 8 -> 4 of {size / 1e9:.2f} GB ({count} tensors of 64 MiB), "
              f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, best of 3:")
        best = {}
        for _ in range(3):
            for k in (1, 2, 4):
                out = os.path.join(work, "tp4")
                t, report = run_convert(args, k, tp8, out)
                shutil.rmtree(out)
                if t < best.get(k, (float("inf"),))[0]:
                    best[k] = (t, report)
        for k, (t, report) in best.items():
            print(f"  {k} process(es): {t:6.2f} s, {size / t / 1e9:5.2f} GB/s "
                  f"(x{best[1][0] / t:4.2f} of one process)")
            for p in report["processes"]:
                print(f"      process {p['rank']}: {len(p['files'])} files, "
                      f"wrote {p['bytes_written'] / 1e9:5.2f} GB, read {p['bytes_read'] / 1e9:5.2f} GB")
        fixed = {k: startup_cost(args, work, k) for k in (1, 4)}
        print(f"fixed cost (same command on a 2 MB checkpoint): 1 process {fixed[1]:.2f} s, "
              f"4 processes {fixed[4]:.2f} s")
        rate_1 = size / (best[1][0] - fixed[1])
        model_2tb(rate_1, fixed[4])
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
