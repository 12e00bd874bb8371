"""The Python package against DeepSpeed's affine.py (DESIGN 9, docs/benchmarks.md): same
process, same maps, one thread on both sides (torch.set_num_threads(1), num_threads=1).

  extract / rebuild into out=      bar: >= 3x DeepSpeed's extract / rebuild (which allocate)
                                   and >= 0.8x the C++ executor on the same buffers
  extract / rebuild allocating     bar: >= 1x DeepSpeed's
  compose, a 70B-shaped model      bar: >= 10x DeepSpeed's plan_transfer

The C++ executor's figure is reshard._core's extract_into / rebuild_into called directly on
the same buffers' addresses (one call per operation, none of the package's Python checks).
Every figure is the median of --repeat rounds; each round runs every case once, in turn.

    python bench/python_bench.py [--rows 16384 --cols 8192 --tp 4 --repeat 7]
"""

import argparse
import logging
import os
import statistics
import time

import torch

logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
import deepspeed.checkpoint.affine as affine  # noqa: E402
from deepspeed.checkpoint.affine_transfer import plan_transfer  # noqa: E402

import reshard  # noqa: E402
from reshard import _core  # noqa: E402

REPEAT = 7


def median(fn, repeat=None):
    times = []
    for _ in range(repeat or REPEAT):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_medians(cases):
    """Median time of each case over REPEAT rounds, each round running every case once, so a
    change of load on a shared machine falls on all of them alike."""
    times = {name: [] for name in cases}
    for _ in range(REPEAT):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def near_even(n, tp):
    return [n // tp + (1 if r < n % tp else 0) for r in range(tp)]


def data_bench(rows, cols, tp):
    ds_map = affine.contiguous_split_map((rows, cols), near_even(cols, tp), 1)  # column split
    pm = reshard.ParamMap.from_dict(ds_map.to_dict())
    full = torch.randn(rows, cols).to(torch.bfloat16)
    outs = [torch.empty(pm.shard_shape(r), dtype=full.dtype) for r in range(tp)]
    whole = torch.empty_like(full)
    shards = {r: ds_map.extract(full, r) for r in range(tp)}
    options = _core.ExecOptions(1, True, False, False, 1)
    shard_list = [shards[r] for r in range(tp)]

    def executor_extract():
        for r in range(tp):
            _core.extract_into(pm._handle, "BF16", r, full.data_ptr(), outs[r].data_ptr(), options)

    def executor_rebuild():
        _core.rebuild_into(pm._handle, "BF16", [s.data_ptr() for s in shard_list],
                           whole.data_ptr(), options)

    cases = {
        "ds extract": lambda: [ds_map.extract(full, r) for r in range(tp)],
        "extract": lambda: [reshard.extract(pm, full, r, num_threads=1) for r in range(tp)],
        "extract out=": lambda: [reshard.extract(pm, full, r, out=outs[r], num_threads=1)
                                 for r in range(tp)],
        "exec extract": executor_extract,
        "ds rebuild": lambda: ds_map.rebuild(shards),
        "rebuild": lambda: reshard.rebuild(pm, shards, num_threads=1),
        "rebuild out=": lambda: reshard.rebuild(pm, shards, out=whole, num_threads=1),
        "exec rebuild": executor_rebuild,
        "memcpy": lambda: whole.copy_(full),
    }
    t = interleaved_medians(cases)
    gb = full.numel() * full.element_size() / 1e9
    print(f"{rows}x{cols} bf16 ({gb:.2f} GB), column split at TP {tp}, one thread, median of "
          f"{REPEAT}, load average {os.getloadavg()[0]:.2f}:")
    for k, v in t.items():
        print(f"  {k:14s} {v * 1e3:8.1f} ms  {gb / v:6.2f} GB/s")
    for op in ("extract", "rebuild"):
        print(f"  {op} out= / DeepSpeed {t['ds ' + op] / t[op + ' out=']:.2f}x (bar 3x); "
              f"out= / C++ executor {t['exec ' + op] / t[op + ' out=']:.2f}x (bar 0.8x); "
              f"allocating / DeepSpeed {t['ds ' + op] / t[op]:.2f}x (bar 1x); "
              f"out= / memcpy {t['memcpy'] / t[op + ' out=']:.2f}x")


def small_bench(tp, calls=500):
    """Per-call cost on a small tensor (64x64 F32, column split), the package's defaults (no
    num_threads): what converting a model of many small tensors pays on top of its bytes."""
    ds_map = affine.contiguous_split_map((64, 64), near_even(64, tp), 1)
    pm = reshard.ParamMap.from_dict(ds_map.to_dict())
    full = torch.randn(64, 64)
    out = torch.empty(pm.shard_shape(1))
    shards = {r: ds_map.extract(full, r) for r in range(tp)}

    def many(fn):
        return lambda: [fn() for _ in range(calls)]
    t = interleaved_medians({
        "ds extract": many(lambda: ds_map.extract(full, 1)),
        "extract": many(lambda: reshard.extract(pm, full, 1)),
        "extract out=": many(lambda: reshard.extract(pm, full, 1, out=out)),
        "ds rebuild": many(lambda: ds_map.rebuild(shards)),
        "rebuild": many(lambda: reshard.rebuild(pm, shards)),
    })
    print("64x64 F32, column split at TP 4, per call: " + ", ".join(
        f"{k} {v / calls * 1e6:.1f} us" for k, v in t.items()))


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
    theirs = median(lambda: [plan_transfer(d, s) for s, d in zip(src, dst)], repeat=1)
    ours = median(lambda: [reshard.compose(source=s, target=d) for s, d in zip(ours_src, ours_dst)])
    print(f"compose, 70B-shaped model ({len(src)} tensors), TP {src_tp} -> {dst_tp}: "
          f"DeepSpeed plan_transfer {theirs * 1e3:.1f} ms, reshard.compose {ours * 1e3:.1f} ms: "
          f"{theirs / ours:.1f}x (bar 10x)")


def main():
    global REPEAT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--cols", type=int, default=8192)
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=REPEAT)
    args = parser.parse_args()
    REPEAT = args.repeat
    torch.set_num_threads(1)
    data_bench(args.rows, args.cols, args.tp)
    small_bench(args.tp)
    compose_bench(8, 4)


if __name__ == "__main__":
    main()
