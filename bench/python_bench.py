"""The Python package against DeepSpeed's affine.py (DESIGN 9, docs/benchmarks.md): same
process, same maps, one thread on both sides (torch.set_num_threads(1), num_threads=1).

  extract / rebuild into out=      bar: >= 3x DeepSpeed's extract / rebuild (which allocate)
  extract / rebuild allocating     bar: >= 1x DeepSpeed's
  compose, a 70B-shaped model      bar: >= 10x DeepSpeed's plan_transfer

    python bench/python_bench.py [--rows 16384 --cols 8192 --tp 4]
"""

import argparse
import logging
import time

import torch

logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
import deepspeed.checkpoint.affine as affine  # noqa: E402
from deepspeed.checkpoint.affine_transfer import plan_transfer  # noqa: E402

import reshard  # noqa: E402


def best(fn, repeat=3):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def near_even(n, tp):
    return [n // tp + (1 if r < n % tp else 0) for r in range(tp)]


def data_bench(rows, cols, tp):
    ds_map = affine.contiguous_split_map((rows, cols), near_even(cols, tp), 1)  # column split
    pm = reshard.ParamMap.from_dict(ds_map.to_dict())
    full = torch.randn(rows, cols).to(torch.bfloat16)
    outs = [torch.empty(pm.shard_shape(r), dtype=full.dtype) for r in range(tp)]
    whole = torch.empty_like(full)
    shards = {r: ds_map.extract(full, r) for r in range(tp)}
    t = {
        "ds extract": best(lambda: [ds_map.extract(full, r) for r in range(tp)]),
        "extract": best(lambda: [reshard.extract(pm, full, r, num_threads=1) for r in range(tp)]),
        "extract out=": best(lambda: [reshard.extract(pm, full, r, out=outs[r], num_threads=1)
                                      for r in range(tp)]),
        "ds rebuild": best(lambda: ds_map.rebuild(shards)),
        "rebuild": best(lambda: reshard.rebuild(pm, shards, num_threads=1)),
        "rebuild out=": best(lambda: reshard.rebuild(pm, shards, out=whole, num_threads=1)),
        "memcpy": best(lambda: whole.copy_(full)),
    }
    gb = full.numel() * full.element_size() / 1e9
    print(f"{rows}x{cols} bf16 ({gb:.2f} GB), column split at TP {tp}, one thread:")
    for k, v in t.items():
        print(f"  {k:14s} {v * 1e3:8.1f} ms  {gb / v:6.2f} GB/s")
    for op in ("extract", "rebuild"):
        print(f"  {op} out= / DeepSpeed {t['ds ' + op] / t[op + ' out=']:.2f}x (bar 3x); "
              f"allocating / DeepSpeed {t['ds ' + op] / t[op]:.2f}x (bar 1x); "
              f"out= / memcpy {t['memcpy'] / t[op + ' out=']:.2f}x")


def model_maps(tp):
    """Llama-70B's weights (80 layers; hidden 8192, 64 heads, 8 key/value heads, MLP 28672,
    vocabulary 128256), column- and row-split as transformers does, norms replicated."""
    h, kv, mlp, vocab = 8192, 1024, 28672, 128256
    layer = [((h, h), 0), ((kv, h), 0), ((kv, h), 0), ((h, h), 1), ((mlp, h), 0), ((mlp, h), 0),
             ((h, mlp), 1), ((h,), None), ((h,), None)]
    shapes = [((vocab, h), 0)] + layer * 80 + [((h,), None), ((vocab, h), 0)]
    maps = []
    for shape, dim in shapes:
        if dim is None:
            maps.append(affine.replicated_map(shape, tp))
        else:
            maps.append(affine.contiguous_split_map(shape, near_even(shape[dim], tp), dim))
    return maps


def compose_bench(src_tp, dst_tp):
    src, dst = model_maps(src_tp), model_maps(dst_tp)
    ours_src = [reshard.ParamMap.from_dict(m.to_dict()) for m in src]
    ours_dst = [reshard.ParamMap.from_dict(m.to_dict()) for m in dst]
    theirs = best(lambda: [plan_transfer(d, s) for s, d in zip(src, dst)], repeat=1)
    ours = best(lambda: [reshard.compose(source=s, target=d) for s, d in zip(ours_src, ours_dst)])
    print(f"compose, 70B-shaped model ({len(src)} tensors), TP {src_tp} -> {dst_tp}: "
          f"DeepSpeed plan_transfer {theirs * 1e3:.1f} ms, reshard.compose {ours * 1e3:.1f} ms: "
          f"{theirs / ours:.1f}x (bar 10x)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--cols", type=int, default=8192)
    parser.add_argument("--tp", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    data_bench(args.rows, args.cols, args.tp)
    compose_bench(8, 4)


if __name__ == "__main__":
    main()
