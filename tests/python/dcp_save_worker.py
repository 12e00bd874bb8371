"""Writes PyTorch Distributed Checkpoints (DCP) with torch's own `dcp.save`, for test_dcp.py.

Run under torchrun, 4 processes, gloo on the CPU:

    torchrun --nproc_per_node 4 dcp_save_worker.py OUT_DIR

Makes, under OUT_DIR:
  mesh/   DTensors on a 2 x 2 device mesh ("dp", "tp"): 2-D boxes (Shard(0), Shard(1)), nested
          splits of dim 0 with an uneven last chunk and empty chunks, a tensor replicated over dp,
          a 0-d tensor and plain tensors, bytes items (an int, a string, a list), and optimizer
          state under "optim." in FSDP2's naming.
  fsdp2/  a small model wrapped by FSDP2's `fully_shard` over the 4 ranks, one Adam step, saved
          as {"model": ..., "optim": ...} from `get_state_dict` (skipped, with `fsdp2.txt`
          saying why, if fully_shard does not run on the CPU here).
  perrank/ the mesh state dict saved with use_collectives=False: __{r}.metadata per rank.
  hf/     the mesh state dict's tensors through torch's HuggingFaceStorageWriter with
          save_distributed=True (sharded/shard-*-model-*-of-*.safetensors).
  full.json  on rank 0: every tensor of mesh/ at full size, as lists, for the test to compare.
"""

import json
import os
import pathlib
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from worker_exit import leave


def full_tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed.weight": torch.randn(10, 6, generator=g),
        "model.layers.0.attn.q.weight": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.w": torch.randn(3, 4, generator=g),
        "model.tiny": torch.randn(2, generator=g),
        "model.norm.scale": torch.tensor(1.5),
        "model.bias": torch.arange(4, dtype=torch.int64),
        "model.big": torch.randn(33, 17, generator=g).to(torch.float16),
    }


PLACEMENTS = {
    "model.embed.weight": [Shard(0), Shard(1)],
    "model.layers.0.attn.q.weight": [Shard(0), Shard(0)],
    "model.layers.0.mlp.w": [Replicate(), Shard(0)],
    "model.tiny": [Shard(0), Shard(0)],
    "model.big": [Shard(1), Shard(0)],
}


def mesh_state_dict(mesh, full):
    sd = {}
    for name, t in full.items():
        if name in PLACEMENTS:
            sd[name] = distribute_tensor(t, mesh, PLACEMENTS[name])
        else:
            sd[name] = t
    # Optimizer state as FSDP2's get_state_dict names it.
    sd["optim"] = {
        "state": {
            "model.embed.weight": {
                "step": torch.tensor(3.0),
                "exp_avg": distribute_tensor(full["model.embed.weight"] * 0.5, mesh,
                                             PLACEMENTS["model.embed.weight"]),
            }
        },
        "param_groups": [{"lr": 0.01, "params": ["model.embed.weight"]}],
    }
    sd["step"] = 7
    sd["note"] = "hello"
    return sd


def save_fsdp2(out, rank):
    try:
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(),
                                    torch.nn.Linear(10, 3))
        full = {k: v.detach().clone() for k, v in model.state_dict().items()}
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optim = torch.optim.Adam(model.parameters(), lr=0.01)
        model(torch.randn(2, 6)).sum().backward()
        optim.step()
        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(out / "fsdp2"))
        del full
    except Exception as e:  # noqa: BLE001 - recorded for the test to report
        if rank == 0:
            (out / "fsdp2.txt").write_text(f"{type(e).__name__}: {e}")
        dist.barrier()


def save_hf(out, mesh, full):
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    sd = {name: (distribute_tensor(t, mesh, PLACEMENTS[name]) if name in PLACEMENTS else t)
          for name, t in full.items() if t.dim() > 0}
    writer = HuggingFaceStorageWriter(path=str(out / "hf" / "sharded"), save_distributed=True)
    dcp.save(sd, storage_writer=writer)


def main():
    out = pathlib.Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = full_tensors(0)
    dcp.save(mesh_state_dict(mesh, full), checkpoint_id=str(out / "mesh"))
    if rank == 0:
        doc = {name: {"dtype": str(t.dtype), "shape": list(t.shape),
                      "values": t.float().flatten().tolist()} for name, t in full.items()}
        (out / "full.json").write_text(json.dumps(doc))
    # Every rank on its own (no collectives): one __{r}.metadata per rank, replicated tensors
    # saved by each of their holders.
    dcp.save(mesh_state_dict(mesh, full), checkpoint_id=str(out / "perrank"),
             use_collectives=False)
    save_hf(out, mesh, full)
    save_fsdp2(out, rank)
    dist.barrier()
    if rank == 0:
        (out / "done").write_text("")
    leave()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
