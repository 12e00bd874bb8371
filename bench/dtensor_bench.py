"""DTensors between device meshes: reshard.dtensor.redistribute vs full_tensor + distribute_tensor.

Six processes on gloo. A model of ``--tensors`` fp32 matrices of ``--size`` x ``--size`` (half
column-parallel, half row-parallel) moves, in two cases:

- (2, 2) on processes 0-3 -> (3,) on processes 3-5 (overlapping at 3): the source as FSDP2 over
  TP holds it (column-parallel: ``[_StridedShard(0, 2), Shard(0)]``, row-parallel:
  ``[Shard(0), Shard(1)]``), the target TP 3 (``Shard(0)`` / ``Shard(1)``);
- (4,) on processes 0-3 -> (2,) on processes 4-5 (disjoint): TP 4 to TP 2.

Compared, each a complete move of every tensor:

- reshard: ``reshard.dtensor.redistribute(state, mesh, placements)``, one call (it agrees on the
  arguments, plans and moves only the plan's bytes);
- full_tensor + distribute_tensor (what users do today, as torch will not redistribute across
  meshes): per tensor, ``full_tensor()`` on the source mesh (an all-gather), the full tensor
  sent by the source mesh's first process to the target mesh's first process (nothing when
  that process is on the source mesh: full_tensor() gave it the tensor), and ``distribute_tensor(full, mesh, placements)`` on the target mesh,
  which scatters from its first process.

Prints the median time of each (after a warm-up), the speed-up, and the bytes on the wire: for
reshard what the processes sent beside the plan minimum (the bytes of each target shard that no
source shard in its process holds); for the baseline what its collectives must move at least.
Every result is checked bit for bit against the shard torch computes from the full tensor
(``distribute_tensor(full, mesh, placements, src_data_rank=None)``, no communication) and
against the baseline's.

    PYTHONPATH=build/python python -m torch.distributed.run --nproc_per_node 6 bench/dtensor_bench.py

On a GPU machine, ``--device cuda`` puts both meshes on CUDA (process r on GPU r modulo the
GPUs): ``--backend nccl`` needs a GPU per process (6); ``--backend gloo`` (any number of GPUs)
makes reshard stage the shards through host memory. Where torch's own path cannot run on the
backend and device (gloo's collectives on CUDA tensors), the baseline is reported as not run
and reshard's results are still checked against torch's shards.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DeviceMesh, DTensor, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from _measure import timed_collective

import reshard.dtensor as rdt


def fsdp_over_tp_rows(full, mesh):
    """A column-parallel weight as FSDP2 over TP holds it: dp's chunk of each TP chunk."""
    coord = mesh.get_coordinate()
    local = full[:0]
    if coord is not None:
        dp, tp = coord
        local = torch.chunk(torch.chunk(full, mesh.size(1))[tp], mesh.size(0))[dp].clone()
    local = local.to(mesh.device_type)
    return DTensor.from_local(local, mesh, [_StridedShard(0, split_factor=mesh.size(1)), Shard(0)],
                              run_check=False, shape=full.shape, stride=full.stride())


def model(args, source, me):
    """The source DTensors, their target placements and the full tensors (on the CPU): even
    tensors column-parallel (rows split), odd ones row-parallel (columns split)."""
    state, placements, fulls = {}, {}, {}
    for i in range(args.tensors):
        gen = torch.Generator().manual_seed(i)
        full = torch.randn(args.size, args.size, generator=gen)
        fulls[f"w{i}"] = full
        rows = i % 2 == 0
        if source.ndim == 2:
            state[f"w{i}"] = fsdp_over_tp_rows(full, source) if rows else \
                distribute_tensor(full, source, [Shard(0), Shard(1)], src_data_rank=None)
        else:
            state[f"w{i}"] = distribute_tensor(full, source, [Shard(0 if rows else 1)],
                                               src_data_rank=None)
        placements[f"w{i}"] = [Shard(0 if rows else 1)]
    return state, placements, fulls


def baseline(state, target, placements, me):
    out = {}
    for name, t in state.items():
        ranks = t.device_mesh.mesh.flatten().tolist()
        first, into = ranks[0], target.mesh.flatten().tolist()[0]
        full = t.full_tensor() if me in ranks else None
        device = t.device_mesh.device_type
        if into not in ranks:  # the target's first process has it already when it is a source
            if me == first:
                dist.send(full, into)
            elif me == into:
                full = torch.empty(t.shape, dtype=t.dtype, device=device)
                dist.recv(full, first)
        if full is None:  # not read: scattered from `into`
            full = torch.empty(t.shape, dtype=t.dtype, device=device)
        out[name] = distribute_tensor(full, target, placements[name])
    return out


def synced(fn):
    """`fn`, then (on CUDA) every kernel it queued finished, so that a time covers them."""
    def call():
        fn()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    return call


def run_case(title, source, target, args, me):
    state, placements, fulls = model(args, source, me)
    ours_out, theirs_out, stats = {}, {}, {}

    @synced
    def with_reshard():
        ours_out.clear()
        ours_out.update(rdt.redistribute(state, target, placements, stats=stats))

    @synced
    def with_baseline():
        theirs_out.clear()
        theirs_out.update(baseline(state, target, placements, me))

    with_reshard()  # warm-up (and the results compared below)
    for name, got in ours_out.items():
        if got is None:
            continue
        want = distribute_tensor(fulls[name], target, placements[name], src_data_rank=None)
        if not torch.equal(got.to_local().cpu(), want.to_local().cpu()):
            raise SystemExit(f"process {me}: {name} differs from torch's shard of the full tensor")
    # torch's own path, where it runs on this backend and device (every process agrees)
    failed = None
    try:
        with_baseline()
    except Exception as e:  # gloo's collectives refusing CUDA tensors, say
        failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    failures = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failed)
    failed = next((f for f in failures if f), None)
    for name, got in ours_out.items():
        if failed is None and got is not None and \
                not torch.equal(got.to_local(), theirs_out[name].to_local()):
            raise SystemExit(f"process {me}: {name} differs from distribute_tensor's")
    ours = timed_collective(with_reshard, args.repeats)
    theirs = None if failed else timed_collective(with_baseline, args.repeats)
    figures = [None] * dist.get_world_size()
    dist.all_gather_object(figures, (stats["sent"], stats["lower_bound"]))
    if me != 0:
        return
    total = args.tensors * args.size * args.size * 4
    src_ranks = source.mesh.flatten().tolist()
    tgt_ranks = target.mesh.flatten().tolist()
    # the baseline's least: the all-gather gives each source process the 1 - 1/n it lacks, the
    # full tensor crosses to the target's first process when it is not a source, the scatter
    # sends each other target process its shard
    n, m = len(src_ranks), len(tgt_ranks)
    their_bytes = total * (n - 1) + (total if tgt_ranks[0] not in src_ranks else 0) + \
        total * (m - 1) // m
    sent = sum(s for s, _ in figures)
    bound = sum(b for _, b in figures)
    print(f"{title}: {args.tensors} x {args.size} x {args.size} fp32 "
          f"({total / 2**20:.0f} MiB), 6 processes, {args.backend} on {args.device}, "
          f"median of {args.repeats}")
    print(f"  reshard.dtensor.redistribute:          {ours * 1e3:8.1f} ms "
          f"(equal to torch's shards of the full tensors)")
    if theirs is None:
        print(f"  full_tensor + send + distribute_tensor: not run here ({failed})")
    else:
        print(f"  full_tensor + send + distribute_tensor: {theirs * 1e3:8.1f} ms")
        print(f"  speedup: {theirs / ours:.2f}x (target >= 1.5x)")
    print(f"  on the wire: reshard {sent / 2**20:.1f} MiB, plan minimum {bound / 2**20:.1f} MiB "
          f"({'equal' if sent == bound else 'NOT equal'}); full_tensor path at least "
          f"{their_bytes / 2**20:.1f} MiB")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--size", type=int, default=2560)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="the meshes' device (cuda: process r on GPU r modulo the GPUs)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="nccl needs --device cuda and a GPU per process")
    args = parser.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    elif args.backend == "nccl":
        raise SystemExit("--backend nccl needs --device cuda")
    dist.init_process_group(args.backend)
    me = dist.get_rank()
    if dist.get_world_size() != 6:
        raise SystemExit("run with --nproc_per_node 6")
    square = DeviceMesh(args.device, [[0, 1], [2, 3]])
    three = DeviceMesh(args.device, [3, 4, 5])
    four = DeviceMesh(args.device, [0, 1, 2, 3])
    two = DeviceMesh(args.device, [4, 5])
    run_case("(2, 2) on 0-3 -> (3,) on 3-5", square, three, args, me)
    run_case("(4,) on 0-3 -> (2,) on 4-5", four, two, args, me)
    dist.barrier()  # nobody tears gloo down while a peer is still talking
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
