"""QuantizingRedistributor(source=model): the live trainer of torch_maps_worker.py (a tiny
Llama under FSDP2 ``fully_shard`` over tensor-parallel ``parallelize_module`` on a (2, 2) mesh,
gloo on the CPU, rows split unevenly) pushed into FP8 blocks of 4 x 4 on processes 2 and 3,
its layout read from its DTensors: no hand-written source map.

    torchrun --nproc_per_node 4 quantized_source_worker.py OUT_DIR

Each process writes OUT_DIR/rank-R.json: the source ranks found, per run its last_stats and
(on processes 2 and 3) the tensors whose data or scales differ, byte for byte, from the
reference quantization of ``full_tensor()`` (quantized_sync_worker.py's, independent of
reshard's), and the message of each refusal raised.
"""

import datetime
import json
import os
import pathlib
import sys
import traceback

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import reshard
import reshard.distributed as rd
from maps import replicated_map, split_map
from quantized_sync_worker import reference_quantize, same
from torch_maps_worker import build
from worker_exit import leave

BLOCK = (4, 4)
ENGINE = [2, 3]
SPLIT = "layers.0.q_proj.weight"  # split by rows at a block boundary on the engine: 8 + 2


def engine_maps(state):
    """{name: map} of the engine: each 2-D weight as FP8 data with its scales (replicated,
    but SPLIT by rows), the rest (norms, a buffer) replicated as they are."""
    maps = {}
    for name, t in state.items():
        shape = list(t.shape)
        if t.dim() != 2:
            maps[name] = replicated_map(shape, 2)
            continue
        grid = [-(-s // b) for s, b in zip(shape, BLOCK)]
        if name == SPLIT:
            maps[name] = split_map(shape, 0, [8, shape[0] - 8])
            maps[name + "_scale_inv"] = split_map(grid, 0, [2, grid[0] - 2])
        else:
            maps[name] = replicated_map(shape, 2)
            maps[name + "_scale_inv"] = replicated_map(grid, 2)
    return maps


def mismatches(maps, got, fulls, me):
    """The names whose target shard on engine process `me` is not the reference's."""
    bad = []
    for name, full in fulls.items():
        want = {name: full}
        if name + "_scale_inv" in maps:
            want[name], want[name + "_scale_inv"] = reference_quantize(full, BLOCK)
        for n, w in want.items():
            m = reshard.ParamMap.from_dict(maps[n])
            if not same(got.get(n), reshard.extract(m, w, ENGINE.index(me))):
                bad.append(n)
    return bad


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    me = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = build(mesh)
    result = {"errors": [], "runs": [], "refused": []}
    try:
        maps = engine_maps(model.state_dict())
        sync = rd.QuantizingRedistributor(target_maps=maps, target_ranks=ENGINE,
                                          quantize={"block": list(BLOCK)}, source=model,
                                          bucket_bytes=1 << 12)
        result["source_ranks"] = sync._source_ranks
        result["quantized"] = sorted(q.data for q in sync.quantized)
        for _step in range(2):
            got = sync.run()
            fulls = {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach()
                     for n, t in model.state_dict().items()}
            result["runs"].append({"stats": sync.last_stats,
                                   "keys": sorted(got),
                                   "mismatch": mismatches(maps, got, fulls, me)
                                   if me in ENGINE else None})
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.5).add_(0.25)
        # The same source named twice, and a quantized tensor from a plain integer state
        # dict: refused on every process alike.
        for kwargs in ({"source_maps": {}, "source": model},
                       {"source": {n: torch.zeros(t.shape, dtype=torch.int32)
                                   for n, t in model.state_dict().items()}
                        if me == 0 else {}}):
            try:
                s = rd.QuantizingRedistributor(target_maps=maps, target_ranks=ENGINE,
                                               quantize={"block": list(BLOCK)}, **kwargs)
                s.run()
                result["refused"].append(None)
            except rd.RedistributeError as e:
                result["refused"].append(str(e))
    except Exception:
        result["errors"].append(traceback.format_exc())
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{me}.json").write_text(json.dumps(result, default=str))
    leave()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
