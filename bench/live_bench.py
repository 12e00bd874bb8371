"""Live re-sharding between processes: reshard.distributed vs all_gather + slice.

A model of 8 fp32 matrices of 2048 x 2048 (half split by rows, half by columns, as column- and
row-parallel layers are) moves from TP 4 on processes 0-3 to TP 2 on processes 0-1, over gloo:

- reshard: a Redistributor planned once, then run; only the plan's bytes travel;
- all_gather + slice (what trainers commonly do): every tensor all-gathered in full on every
  process, then the target processes slice their shard out of it.

Prints the median time of each (after a warm-up) and the bytes each process received beside
the lower bound (the bytes of its target shards that its own source shard does not hold).
Every result is checked against the full tensor.

    PYTHONPATH=build/python python -m torch.distributed.run --nproc_per_node 4 bench/live_bench.py
"""

import argparse

import torch
import torch.distributed as dist

from _measure import timed_collective

import reshard
import reshard.distributed as rd


def split(shape, dim, world):
    """A split of `shape` along `dim` into `world` equal parts, as a map dict."""
    rows, cols = shape
    per = shape[dim] // world
    ranks = {}
    for r in range(world):
        if dim == 0:
            piece = {"shape": [per, cols], "source": [r * per * cols, [cols, 1]],
                     "dest": [0, [cols, 1]], "locations": [r]}
            ranks[r] = {"shard_shape": [per, cols], "pieces": [piece]}
        else:
            piece = {"shape": [rows, per], "source": [r * per, [cols, 1]],
                     "dest": [0, [per, 1]], "locations": [r]}
            ranks[r] = {"shard_shape": [rows, per], "pieces": [piece]}
    return reshard.ParamMap.from_dict({"logical_shape": list(shape), "ranks": ranks})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--targets", default="0,1", help="processes of TP 2 ranks 0 and 1")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    me, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, "run with 4 processes"
    source_ranks, target_ranks = [0, 1, 2, 3], [int(p) for p in args.targets.split(",")]
    shape = (args.size, args.size)
    names = [f"layers.{i}.weight" for i in range(args.tensors)]
    dims = {n: i % 2 for i, n in enumerate(names)}
    source = {n: split(shape, dims[n], 4) for n in names}
    target = {n: split(shape, dims[n], 2) for n in names}
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(shape, generator=g) for n in names}
    shards = {n: reshard.extract(source[n], full[n], me) for n in names}

    sync = rd.Redistributor(source, target, source_ranks=source_ranks, target_ranks=target_ranks,
                            dtypes=torch.float32, bucket_bytes=args.bucket_mib << 20)
    out = {}

    def with_reshard():
        out.update(sync.run(shards, out or None))

    gathered = {}

    def with_all_gather():
        for n in names:
            parts = [torch.empty_like(shards[n]) for _ in range(world)]
            dist.all_gather(parts, shards[n])
            if me in target_ranks:
                whole = torch.cat(parts, dim=dims[n])
                t = target_ranks.index(me)
                gathered[n] = whole.chunk(2, dim=dims[n])[t].contiguous()

    ours = timed_collective(with_reshard, args.repeats + 1)
    theirs = timed_collective(with_all_gather, args.repeats + 1)
    for n in names:  # both are right
        if me in target_ranks:
            want = reshard.extract(target[n], full[n], target_ranks.index(me))
            assert torch.equal(out[n], want) and torch.equal(gathered[n], want), n

    stats = sync.last_stats
    gather_bytes = sum(shards[n].numel() * 4 * (world - 1) for n in names)
    rows = [None] * world
    dist.all_gather_object(rows, (stats["received"], stats["lower_bound"], stats["sent"]))
    if me == 0:
        total = sum(full[n].numel() * 4 for n in names)
        print(f"live re-sharding, {args.tensors} x {args.size} x {args.size} fp32 "
              f"({total / 2**20:.0f} MiB), TP 4 on processes 0-3 -> TP 2 on processes "
              f"{target_ranks}, gloo")
        print(f"  reshard.distributed:  {ours * 1e3:8.1f} ms")
        print(f"  all_gather + slice:   {theirs * 1e3:8.1f} ms")
        print(f"  speedup: {theirs / ours:.2f}x (target >= 1.5x)")
        for p, (received, bound, sent) in enumerate(rows):
            print(f"  process {p}: received {received / 2**20:7.1f} MiB (lower bound "
                  f"{bound / 2**20:7.1f} MiB), sent {sent / 2**20:7.1f} MiB; all_gather "
                  f"receives {gather_bytes / 2**20:7.1f} MiB")
        on_wire = sum(r[0] for r in rows)
        bound = sum(r[1] for r in rows)
        print(f"  on the wire: {on_wire / 2**20:.1f} MiB, plan minimum {bound / 2**20:.1f} MiB, "
              f"all_gather {world * gather_bytes / 2**20:.1f} MiB")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
