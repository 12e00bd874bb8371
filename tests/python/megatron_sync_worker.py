"""A Megatron-Core model as the source of reshard.distributed.Redistributor (DESIGN 21): no
hand-written maps, the model's own tensors sent.

    torchrun --nproc_per_node 4 megatron_sync_worker.py OUT_DIR SPEC_JSON CONFIG_JSON

builds the model of megatron_model.py at the spec's TP x PP x EP (gloo) and, in the same four
processes, moves its Hugging Face tensors (config.json names them) to process 0 whole and to
processes 2 and 3 split in two along dim 0; then adds 1 to every weight in place and moves them
again (run() with no arguments: the model as it is then). Writes OUT_DIR/sync{rank}.pt: what
each process received, the bytes each run moved, and the RedistributeErrors of a Megatron model
given without its config and of processes that disagree on the source's kind. Runs in
.venv-megatron with reshard importable (PYTHONPATH: the build's python directory).
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_model  # noqa: E402
from worker_exit import leave


def main(out_dir, spec_path, config_path):
    from torch.distributed.tensor import Replicate, Shard

    import reshard.torch as rt
    from reshard.distributed import RedistributeError, Redistributor

    spec = json.loads(open(spec_path).read())
    config = json.loads(open(config_path).read())
    tp, pp, ep = spec["tp"], spec["pp"], spec.get("ep", 1)
    megatron_model._init(tp, pp, ep)
    rank = torch.distributed.get_rank()
    torch.manual_seed(spec["seed"])
    model = megatron_model._model(spec, megatron_model._config(spec, tp, pp, ep))
    shapes = {n: m.logical_shape for n, m in rt.megatron_maps(model, config).maps.items()}
    whole = {n: rt.layout_map(s, [0], [Replicate()], name=n) for n, s in shapes.items()}
    halves = {n: rt.layout_map(s, [0, 1], [Shard(0)], name=n) for n, s in shapes.items()}
    to_one = Redistributor(source=model, config=config, target_maps=whole, target_ranks=[0])
    to_two = Redistributor(source=model, config=config, target_maps=halves, target_ranks=[2, 3])
    result = {"first": to_one.run(), "halves": to_two.run(), "bytes": to_one.last_stats}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    result["after"] = to_one.run()
    refusals = {}
    try:
        Redistributor(source=model, target_maps=whole, target_ranks=[0])
    except RedistributeError as e:
        refusals["config"] = str(e)
    try:  # process 3 gives DTensors' kind of source (a state dict), the others the model
        Redistributor(source={"w": torch.zeros(2)} if rank == 3 else model, config=config,
                      target_maps=whole, target_ranks=[0])
    except RedistributeError as e:
        refusals["kinds"] = str(e)
    result["refusals"] = refusals
    os.makedirs(out_dir, exist_ok=True)
    torch.save(result, os.path.join(out_dir, f"sync{rank}.pt"))
    leave()


if __name__ == "__main__":
    main(*sys.argv[1:4])
