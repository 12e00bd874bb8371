"""`.pt` reading speed (issue bar in docs/benchmarks.md): listing a file of 1000 tensors takes
milliseconds; `reshard export` of a >= 1 GB `.pt` beats `torch.load(mmap=True)` +
`safetensors.torch.save_file` in the same run, at flat memory.

Both sides run as separate processes under GNU time (maximum RSS), alternating, best of
`--repeat`, outputs deleted between runs; all inputs are in the page cache.

    python bench/torch_file_bench.py [--reshard build/tools/reshard/reshard] [--scale-gb 1]
"""

import argparse
import os
import sys
import tempfile

import torch

from convert_bench import timed  # (seconds, peak RSS in KiB) of one command

TORCH_EXPORT = """
import sys, torch
from safetensors.torch import save_file
sd = torch.load(sys.argv[1], mmap=True, weights_only=True)
save_file({k: v.contiguous() for k, v in sd.items()}, sys.argv[2], metadata={"format": "pt"})
"""

TORCH_LIST = """
import sys, torch
sd = torch.load(sys.argv[1], mmap=True, weights_only=True)
print(sum(len(v.shape) for v in sd.values()))
"""


def best(runs, cmds, cleanup=lambda: None):
    results = {name: [] for name in cmds}
    for _ in range(runs):
        for name, cmd in cmds.items():
            cleanup()
            elapsed, peak_kb = timed(cmd)
            results[name].append((elapsed, peak_kb / 1024))
    return {name: min(r) for name, r in results.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reshard", default="build/tools/reshard/reshard")
    ap.add_argument("--scale-gb", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="reshard-pt-bench-", dir=args.workdir) as work:
        many = os.path.join(work, "many.pt")
        torch.save({f"model.layers.{i // 10}.w{i % 10}": torch.zeros(64, 64) for i in range(1000)},
                   many)
        listing = best(args.repeat, {
            "reshard inspect --json": [args.reshard, "inspect", "--json", many],
            "torch.load(mmap) + shapes": [py, "-c", TORCH_LIST, many],
        })
        print(f"listing 1000 tensors ({os.path.getsize(many) / 1e6:.1f} MB):")
        for name, (t, rss) in listing.items():
            print(f"  {name:28s} {t * 1000:8.1f} ms  peak RSS {rss:7.1f} MiB")

        big = os.path.join(work, "big.pt")
        n = max(1, int(args.scale_gb * 1e9 / (64 << 20)))
        g = torch.Generator().manual_seed(0)
        torch.save({f"layers.{i}.weight": torch.randn(4096, 4096, generator=g) for i in range(n)},
                   big)
        out = os.path.join(work, "out.safetensors")

        def cleanup():
            if os.path.exists(out):
                os.remove(out)

        size = os.path.getsize(big)
        export = best(args.repeat, {
            "reshard export": [args.reshard, "export", big, "-o", out],
            "torch.load(mmap)+save_file": [py, "-c", TORCH_EXPORT, big, out],
        }, cleanup)
        print(f"export of {n} tensors, {size / 1e9:.2f} GB:")
        for name, (t, rss) in export.items():
            print(f"  {name:28s} {t:8.2f} s ({size / t / 1e9:.2f} GB/s)  peak RSS {rss:7.1f} MiB")
        ratio = export["torch.load(mmap)+save_file"][0] / export["reshard export"][0]
        print(f"  reshard is {ratio:.2f}x the speed of the torch route")


if __name__ == "__main__":
    main()
