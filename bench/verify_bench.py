"""What a proof of the targets and a delta push cost beside a full push (DESIGN 22;
docs/benchmarks.md): a Redistributor from 2 trainer processes (TP 2, rows) to 2 engine processes
(TP 2, columns), each process in a network namespace of its own on the link bench's shaped links
(link_bench.py: --rate-mbit each direction).

The model: --layers matrices of 4096 x 4096 bf16 (32 MiB each) and one norm vector replicated on
every process. Timed: run() (a full push) and verify() (fingerprints on every process, a few
integers sent), and run(delta=True) after --changed of the elements changed (each element's
lowest bit flipped, at random places) and after all of them changed; medians of --repeat after
one untimed of each, between barriers.

  bars (issue 38): a verify takes <= 10 % of a full push on these links; a delta push at the
  changed fraction of a bf16 AdamW step is >= 3x faster than a full push and moves <= 15 % of
  its bytes; at 100 % changed it takes <= 1.1x a full push.

--loopback runs the four processes on this host's loopback instead (no namespaces, no root):
what the fingerprints cost where the cores, not the links, set the push's time.

Needs root with CAP_NET_ADMIN without --loopback.

    PYTHONPATH=build/python .venv/bin/python bench/verify_bench.py [--layers 8] [--repeat 3]
        [--rate-mbit 800] [--loopback]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _measure import wait_all  # noqa: E402
from link_bench import address, build_links, namespace, tear_down  # noqa: E402

SOURCES, TARGETS = [0, 1], [2, 3]
SIZE = 4096


def split(shape: list[int], dim: int, parts: int) -> dict:
    """The map of ``shape`` split evenly along ``dim`` over ``parts`` ranks."""
    strides = [shape[1], 1]
    n = shape[dim] // parts
    ranks = {}
    for r in range(parts):
        local = list(shape)
        local[dim] = n
        ranks[str(r)] = {"shard_shape": local, "pieces": [{
            "shape": local, "source": [r * n * strides[dim], strides],
            "dest": [0, [local[1], 1]], "locations": [r]}]}
    return {"logical_shape": shape, "ranks": ranks}


def process(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import reshard.distributed as rd
    torch.set_num_threads(1)
    rank = args.rank
    host = "127.0.0.1" if args.loopback else address(0)
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{args.port}", rank=rank,
                            world_size=4, timeout=datetime.timedelta(seconds=300))
    shape = [SIZE, SIZE]
    names = [f"layers.{i}.weight" for i in range(args.layers)]
    source = {n: split(shape, 0, 2) for n in names}
    target = {n: split(shape, 1, 2) for n in names}
    sync = rd.Redistributor(source, target, source_ranks=SOURCES, target_ranks=TARGETS,
                            dtypes=torch.bfloat16)
    g = torch.Generator().manual_seed(rank)
    shards = {n: torch.randn([SIZE // 2, SIZE], generator=g).to(torch.bfloat16)
              for n in names} if rank in SOURCES else {}
    times: dict[str, list[float]] = {"push": [], "verify": [], "delta": [], "delta_all": []}
    sent: dict[str, list[int]] = {"push": [], "delta": [], "delta_all": []}

    def change(fraction: float) -> None:
        for t in shards.values():
            bits = t.view(-1).view(torch.int16)
            if fraction >= 1:
                bits ^= 1
            else:
                at = torch.randint(0, bits.numel(), (int(fraction * bits.numel()),), generator=g)
                bits[at] ^= 1

    def timed(what: str, call: Any) -> Any:
        dist.barrier()
        start = time.perf_counter()
        result = call()
        dist.barrier()
        times[what].append(time.perf_counter() - start)
        if what in sent:
            moved = torch.tensor([sync.last_stats["sent"]], dtype=torch.int64)
            dist.all_reduce(moved)
            sent[what].append(int(moved))
        return result
    checked = 0
    out = sync.run(shards)
    for _ in range(args.repeat + 1):
        timed("push", functools.partial(sync.run, shards, out))
        checked = timed("verify", sync.verify)
    sync.run(shards, out, delta=True)  # the chunks each process keeps
    for _ in range(args.repeat + 1):
        change(args.changed)
        timed("delta", functools.partial(sync.run, shards, out, delta=True))
    for _ in range(args.repeat + 1):
        change(1.0)
        timed("delta_all", functools.partial(sync.run, shards, out, delta=True))
    if rank == 0:
        r = {k: statistics.median(v[1:]) for k, v in times.items()}
        with open(os.path.join(args.work, "result.json"), "w") as f:
            json.dump({**{f"{k}_s": v for k, v in r.items()},
                       **{f"{k}_sent": statistics.median(v[1:]) for k, v in sent.items()},
                       "pairs": checked, "bytes": args.layers * SIZE * SIZE * 2,
                       "changed": args.changed, "all": times}, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rate-mbit", type=int, default=800)
    parser.add_argument("--loopback", action="store_true")
    parser.add_argument("--changed", type=float, default=0.025)
    parser.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--work", default="", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=29533, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank >= 0:
        process(args)
        return
    work = tempfile.mkdtemp(prefix="verify-bench-")
    if not args.loopback:
        build_links(4, args.rate_mbit)
    try:
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo" if args.loopback else "eth0",
                   OMP_NUM_THREADS="1")
        logs = [open(os.path.join(work, f"p{p}.log"), "w") for p in range(4)]
        prefix = (lambda p: []) if args.loopback else \
            (lambda p: ["ip", "netns", "exec", namespace(p)])
        procs = [subprocess.Popen([*prefix(p), sys.executable, os.path.abspath(__file__),
                                   "--rank", str(p), "--work", work, "--port", str(args.port),
                                   "--layers", str(args.layers), "--repeat", str(args.repeat),
                                   "--changed", str(args.changed)]
                                  + (["--loopback"] if args.loopback else []),
                                  env=env, stdout=logs[p], stderr=subprocess.STDOUT,
                                  start_new_session=True) for p in range(4)]
        wait_all(procs, 1800)
    finally:
        if not args.loopback:
            tear_down(4)
    path = os.path.join(work, "result.json")
    if not os.path.exists(path):
        sys.exit(f"a process failed; see {work}/p*.log")
    with open(path) as f:
        r = json.load(f)
    where = "loopback" if args.loopback else f"{args.rate_mbit} Mbit/s links"
    push = r["push_s"]
    print(f"{r['bytes'] / 1e6:.1f} MB bf16, TP 2 rows -> TP 2 columns, {where}:")
    print(f"  full push      {push:.3f} s, {r['push_sent'] / 1e6:.1f} MB sent")
    print(f"  verify         {r['verify_s']:.3f} s ({r['pairs']} pairs): "
          f"{100 * r['verify_s'] / push:.1f} % of the push")
    print(f"  delta, {100 * r['changed']:.1f} % changed: {r['delta_s']:.3f} s "
          f"({push / r['delta_s']:.2f}x faster), {r['delta_sent'] / 1e6:.1f} MB sent "
          f"({100 * r['delta_sent'] / r['push_sent']:.1f} % of the push's)")
    print(f"  delta, all changed: {r['delta_all_s']:.3f} s ({r['delta_all_s'] / push:.2f}x the "
          f"push), {r['delta_all_sent'] / 1e6:.1f} MB sent")


if __name__ == "__main__":
    main()
