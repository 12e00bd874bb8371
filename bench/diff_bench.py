"""Diff speed (DESIGN 9, 22): `reshard diff` of a checkpoint at TP 8 against the same
checkpoint as a Hugging Face directory must take at most 1.5x the time of reading both once
(`cat` of every file of both to /dev/null), in the same run.

Makes a Hugging Face checkpoint of --scale-gb GB (bf16 bit patterns: half its tensors split
by rows, half by columns, so one side is read in place and the other copied out of strided
shards), scatters it to TP 8, reads both once to warm the page cache, then times `cat` of both
against `reshard diff TP8 HF` (equal: every element compared) and against a diff whose one
differing element is the last of the last tensor (the same work, exit 1). Medians of --repeat.

    python bench/diff_bench.py [--reshard build/tools/reshard/reshard] [--scale-gb 1] [--repeat 3]

The load average is printed before and after: on a shared machine, read the ratios of a run
taken while nothing else ran.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import numpy as np
from safetensors.numpy import save_file


def make_checkpoint(path, total_bytes, hidden, rows, seed, change_last=False):
    rng = np.random.default_rng(seed)
    count = max(2, int(total_bytes // (rows * hidden * 2)))
    tensors = {}
    for i in range(count):
        kind = "rows" if i % 2 == 0 else "cols"
        tensors[f"layers.{i}.{kind}.weight"] = rng.integers(0, 1 << 16, (rows, hidden),
                                                            dtype=np.uint16)
    if change_last:
        last = tensors[f"layers.{count - 1}.{'rows' if (count - 1) % 2 == 0 else 'cols'}.weight"]
        last[-1, -1] ^= 1
    os.makedirs(path)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return sum(t.nbytes for t in tensors.values()), list(tensors)


def files_of(*dirs):
    return [os.path.join(d, f) for d in dirs for f in sorted(os.listdir(d))]


def timed(cmd, ok=(0,)):
    t0 = time.perf_counter()
    r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - t0
    if r.returncode not in ok:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr[-2000:]}")
    return elapsed


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reshard", default="build/tools/reshard/reshard")
    ap.add_argument("--scale-gb", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()}")
    work = tempfile.mkdtemp(prefix="diff-bench-")
    try:
        hidden, rows = 4096, 4096  # 32 MiB bf16 tensors
        hf = os.path.join(work, "hf")
        changed = os.path.join(work, "changed")
        total, names = make_checkpoint(hf, args.scale_gb * 1e9, hidden, rows, 0)
        make_checkpoint(changed, args.scale_gb * 1e9, hidden, rows, 0, change_last=True)
        layouts = os.path.join(work, "layouts.json")
        with open(layouts, "w") as f:
            json.dump({"version": 1, **{n: {"family": "split", "dim": 0 if ".rows." in n else 1}
                                        for n in names}}, f)
        tp8 = os.path.join(work, "tp8")
        timed([args.reshard, "scatter", hf, "--layouts", layouts, "--tp", "8", "-o", tp8])
        cat = ["cat", *files_of(tp8, hf)]
        cat_changed = ["cat", *files_of(tp8, changed)]
        for cmd in (cat, cat_changed):  # warm the page cache
            subprocess.run(cmd, stdout=subprocess.DEVNULL, check=True)
        t_cat, t_equal, t_last = [], [], []
        for _ in range(args.repeat):
            t_cat.append(timed(cat))
            t_equal.append(timed([args.reshard, "diff", tp8, hf]))
            t_last.append(timed([args.reshard, "diff", tp8, changed], ok=(1,)))
        cat_s = statistics.median(t_cat)
        equal_s = statistics.median(t_equal)
        last_s = statistics.median(t_last)
        print(f"checkpoint: {total / 1e9:.2f} GB per side ({total // (rows * hidden * 2)} tensors "
              f"of [{rows}, {hidden}] bf16), TP 8 sharded (half by rows, half by columns) vs "
              f"Hugging Face")
        print(f"cat both to /dev/null:      {cat_s:.3f} s (median of {args.repeat})")
        print(f"reshard diff (equal):       {equal_s:.3f} s  = {equal_s / cat_s:.2f}x cat")
        print(f"reshard diff (last differs): {last_s:.3f} s  = {last_s / cat_s:.2f}x cat")
        print(f"bar: <= 1.5x: {'met' if max(equal_s, last_s) <= 1.5 * cat_s else 'NOT met'}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
