"""One process of a torchrun launch that loads a DCP checkpoint with torch's own
torch.distributed.checkpoint.load (gloo, CPU) and compares it with the expected tensors.

    torchrun --nproc_per_node N dcp_load_worker.py DCP_DIR EXPECTED.safetensors OUT_DIR

EXPECTED holds every tensor under its flattened DCP key. Each tensor of at least one dimension
is loaded as a DTensor sharded along dim 0 (Shard(0) on a 1-D mesh of every process, as FSDP2
holds it), except those listed in EXPECTED's metadata "plain" (comma-separated) and 0-d ones,
which are loaded as whole tensors on every process. Writes OUT_DIR/rank-{r}.json:
{"checked": [keys], "mismatch": [keys whose full tensor or local shard differs bit for bit]}.
"""

import json
import os
import pathlib
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from worker_exit import leave


def bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def nest(flat):
    """{"optim.state.<p>.<s>": t} -> {"optim": {"state": {p: {s: t}}}}; other keys stay."""
    out = {}
    for key, value in flat.items():
        if key.startswith("optim.state."):
            param, state = key[len("optim.state."):].rsplit(".", 1)
            out.setdefault("optim", {"state": {}})["state"].setdefault(param, {})[state] = value
        else:
            out[key] = value
    return out


def main():
    ckpt, expected_path, out = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    with safe_open(expected_path, "pt") as f:
        plain = set(filter(None, (f.metadata() or {}).get("plain", "").split(",")))
        expected = {k: f.get_tensor(k) for k in f.keys()}
    flat = {}
    for key, e in expected.items():
        if e.dim() == 0 or key in plain:
            flat[key] = torch.zeros_like(e)
        else:
            flat[key] = distribute_tensor(torch.zeros_like(e), mesh, [Shard(0)])
    dcp.load(nest(flat), checkpoint_id=ckpt)
    mismatch = []
    for key, e in expected.items():
        t = flat[key]
        if isinstance(t, DTensor):
            local = t.to_local()
            mine = torch.chunk(e, world, dim=0)
            want = mine[rank] if rank < len(mine) else e[0:0]
            if not torch.equal(bits(local), bits(want)):
                mismatch.append(key)
                continue
            t = t.full_tensor()
        if t.dtype != e.dtype or t.shape != e.shape or not torch.equal(bits(t), bits(e)):
            mismatch.append(key)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{rank}.json").write_text(
        json.dumps({"checked": sorted(expected), "mismatch": mismatch}))
    leave()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
