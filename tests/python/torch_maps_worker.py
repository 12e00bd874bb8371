"""reshard.torch on a live trainer: a tiny Llama-like model under FSDP2 ``fully_shard`` over
tensor-parallel ``parallelize_module`` on a (2, 2) mesh (dp, tp), gloo on the CPU.

    torchrun --nproc_per_node 4 torch_maps_worker.py OUT_DIR

(6 processes: a (3, 2) mesh, where the vocabulary's 13 rows, cut 7 + 6 by TP and each part
over dp, leave (dp 2, tp 0) one row and (dp 2, tp 1) two.)

Each process writes OUT_DIR/rank-R.json: per parameter its placements, whether this process's
own map (no merge) is valid and canonical and extracts its ``to_local()`` from the full tensor,
whether the merged maps are the same on every process, extract every rank's ``to_local()`` and
rebuild ``full_tensor()`` from all of them; and what a Redistributor built with ``source=``
delivered to its targets.
"""

import datetime
import json
import os
import pathlib
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import (DeviceMesh, DTensor, Partial, Replicate, Shard,
                                      distribute_tensor)
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

import reshard
import reshard.distributed as rd
import reshard.torch as rt
from worker_exit import leave

# Sizes that split unevenly: 10 heads' rows over tp 2 are 5 per rank, which fsdp 2 cuts 3 + 2;
# 22 MLP rows are 11 per tp rank; a vocabulary of 13 rows.
HIDDEN, QKV, MLP, VOCAB = 10, 10, 22, 13


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.randn(HIDDEN))
        self.q_proj = nn.Linear(HIDDEN, QKV, bias=False)
        self.k_proj = nn.Linear(HIDDEN, QKV, bias=True)
        self.o_proj = nn.Linear(QKV, HIDDEN, bias=False)
        self.gate_proj = nn.Linear(HIDDEN, MLP, bias=False)
        self.down_proj = nn.Linear(MLP, HIDDEN, bias=False)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.Parameter(torch.randn(HIDDEN))
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.register_buffer("inv_freq", torch.arange(5, dtype=torch.float32))


def build(mesh):
    torch.manual_seed(0)  # the same weights on every process before sharding
    model = Tiny()
    for block in model.layers:
        parallelize_module(block, mesh["tp"], {
            "q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(),
            "o_proj": RowwiseParallel(), "gate_proj": ColwiseParallel(),
            "down_proj": RowwiseParallel()})
    parallelize_module(model, mesh["tp"], {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate())})
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    me, world = dist.get_rank(), dist.get_world_size()
    dp = world // 2
    mesh = init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp", "tp"))
    model = build(mesh)
    state = model.state_dict()
    result = {"params": {}, "errors": []}
    try:
        own = rt.maps_of(model)
        merged = rt.maps_of(model, merge=True)
        texts = [None] * world
        dist.all_gather_object(texts, {n: m.to_json() for n, m in merged.items()})
        result["merged_same_everywhere"] = all(t == texts[0] for t in texts)
        locals_ = {n: (t.to_local() if isinstance(t, DTensor) else t).contiguous()
                   for n, t in state.items()}
        every = [None] * world
        dist.all_gather_object(every, locals_)
        for name, t in state.items():
            full = t.full_tensor() if isinstance(t, DTensor) else t
            m, g = own[name], merged[name]
            info = {"placements": [str(p) for p in t.placements] if isinstance(t, DTensor) else
                    "plain",
                    "mesh": t.device_mesh.mesh.tolist() if isinstance(t, DTensor) else None,
                    "own_canonical": m == m.canonical(),
                    "own_extract": torch.equal(reshard.extract(m, full, me), locals_[name]),
                    "merged_canonical": g == g.canonical(),
                    "merged_world": g.world_size,
                    "merged_extract": [torch.equal(reshard.extract(g, full, r), every[r][name])
                                       for r in range(world)],
                    "merged_rebuild": torch.equal(
                        reshard.rebuild(g, [every[r][name] for r in range(world)]), full),
                    "pieces": [len(g.pieces(r)) for r in range(world)],
                    "locations": [[list(q.locations) for q in g.pieces(r)] for r in range(world)],
                    "own_holders": [r for r in range(world) if m.pieces(r)],
                    "local_shape": list(locals_[name].shape)}
            m.validate()
            g.validate()
            result["params"][name] = info
        # Into "engine" processes 2 and 3 at TP 2 by rows (the last dim for 1-D tensors too),
        # from the model as it lies, twice: after a change to the weights the second run
        # delivers the new values.
        target = {n: rt.layout_map(t.shape, [2, 3], [Shard(0)] if t.dim() else [Replicate()],
                                   ranks=[2, 3]) for n, t in state.items()}
        sync = rd.Redistributor(target_maps=target, target_ranks=[2, 3], source=model)
        result["source_ranks"] = sync._source_ranks
        runs = []
        for _step in range(2):
            got = sync.run()
            fulls = {n: (t.full_tensor() if isinstance(t, DTensor) else t)
                     for n, t in model.state_dict().items()}
            if me in (2, 3):
                runs.append(all(torch.equal(got[n], reshard.extract(target[n], fulls[n], me - 2))
                                for n in fulls))
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        result["redistributed"] = runs
        result["sent"] = sync.last_stats["sent"] if sync.last_stats else None
        # Trainer processes 0 and 1 (a mesh of their own, rows split unevenly) into processes
        # 2 and 3, which hold none (source={}): the source ranks are the holders.
        pair = DeviceMesh("cpu", [0, 1])
        full = torch.arange(35, dtype=torch.float32).reshape(7, 5)
        held = {"w": distribute_tensor(full, pair, [Shard(0)])} if me < 2 else {}
        into = {"w": rt.layout_map([7, 5], [2, 3], [Shard(1)], ranks=[2, 3])}
        pairs = rd.Redistributor(target_maps=into, target_ranks=[2, 3], source=held)
        got = pairs.run()
        result["pair_source_ranks"] = pairs._source_ranks
        result["pair_moved"] = (torch.equal(got["w"], reshard.extract(into["w"], full, me - 2))
                                if me in (2, 3) else got == {})
        # A Partial DTensor (on process 1 alone) is refused naming it: by maps_of there, and
        # by a Redistributor built from the model on every process alike.
        partial = DTensor.from_local(torch.ones(2, 2), mesh, [Partial(), Replicate()])
        if me == 1:
            try:
                rt.maps_of({"o_proj.partial": partial})
            except reshard.LayoutError as e:
                result["partial_refused"] = str(e)
        source = {**state, "o_proj.partial": partial} if me == 1 else state
        try:
            rd.Redistributor(target_maps=target, target_ranks=[2, 3], source=source)
        except rd.RedistributeError as e:
            result["partial_refused_by_redistributor"] = str(e)
    except Exception:
        result["errors"].append(traceback.format_exc())
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{me}.json").write_text(json.dumps(result))
    leave()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
