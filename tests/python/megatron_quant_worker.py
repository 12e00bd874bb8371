"""A Megatron-Core model as the source of reshard.distributed.QuantizingRedistributor (DESIGN 14,
21): its fused linear_qkv and linear_fc1 quantized into FP8 blocks, no hand-written maps.

    torchrun --nproc_per_node 4 megatron_quant_worker.py OUT_DIR SPEC_JSON CONFIG_JSON QUANT_JSON

builds the model of megatron_model.py at the spec's TP x PP (gloo), in bf16, and, in the same four
processes, pushes its Hugging Face tensors to processes 2 and 3: the tensors QUANT_JSON names
({name: {"scale": name, "block": [r, c]}}) as FP8 data and float32 scales, each replicated on
both but the first named, split by rows at its second block row; every other tensor as it is,
replicated. Then adds 1 to every weight in place and pushes again (run() with no arguments: the
model as it is then). Writes OUT_DIR/quant{rank}.pt: what each process received per push, its
last_stats, the target maps, and the RedistributeError of a quantized tensor given a block of
the wrong rank (on every process alike). Runs in .venv-megatron with reshard importable
(PYTHONPATH: the build's python directory).
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_model  # noqa: E402
from worker_exit import leave

TARGETS = [2, 3]


def target_maps(shapes, quantize):
    """{name: map} over the 2 target processes: everything replicated, but the first quantized
    tensor (and its scales) split by rows at its second block row."""
    from torch.distributed.tensor import Replicate

    import reshard.torch as rt

    maps = {n: rt.layout_map(s, [0, 1], [Replicate()], name=n) for n, s in shapes.items()}
    first = sorted(quantize)[0]
    for name, spec in quantize.items():
        grid = [-(-s // b) for s, b in zip(shapes[name], spec["block"])]
        maps[spec["scale"]] = rt.layout_map(grid, [0, 1], [Replicate()], name=spec["scale"])
        if name == first:
            rows = 2 * spec["block"][0]
            maps[name] = split_rows(shapes[name], rows)
            maps[spec["scale"]] = split_rows(grid, 2)
    return maps


def split_rows(shape, first):
    """Rows [0, first) on target rank 0, the rest on rank 1."""
    cols = shape[1]
    sizes = [first, shape[0] - first]
    ranks, row0 = {}, 0
    for r, rows in enumerate(sizes):
        ranks[str(r)] = {"shard_shape": [rows, cols], "pieces": [
            {"shape": [rows, cols], "source": [row0 * cols, [cols, 1]],
             "dest": [0, [cols, 1]], "locations": [r]}]}
        row0 += rows
    return {"logical_shape": list(shape), "ranks": ranks}


def main(out_dir, spec_path, config_path, quant_path):
    from reshard.distributed import QuantizingRedistributor, RedistributeError

    import reshard.torch as rt

    spec = json.loads(open(spec_path).read())
    config = json.loads(open(config_path).read())
    quantize = json.loads(open(quant_path).read())
    tp, pp, ep = spec["tp"], spec["pp"], spec.get("ep", 1)
    megatron_model._init(tp, pp, ep)
    rank = torch.distributed.get_rank()
    torch.manual_seed(spec["seed"])
    model = megatron_model._model(spec, megatron_model._config(spec, tp, pp, ep))
    megatron_model._draw_biases(model)
    model.bfloat16()  # a bf16 trainer, as FP8 engines are fed
    shapes = {n: m.logical_shape for n, m in rt.megatron_maps(model, config).maps.items()}
    maps = target_maps(shapes, quantize)
    sync = QuantizingRedistributor(source=model, config=config, target_maps=maps,
                                   target_ranks=TARGETS, quantize=quantize, bucket_bytes=1 << 14)
    result = {"maps": {n: m if isinstance(m, dict) else m.to_dict() for n, m in maps.items()},
              "quantized": sorted(q.data for q in sync.quantized),
              "first": sync.run()}
    result["stats"] = [sync.last_stats]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    result["after"] = sync.run()
    result["stats"].append(sync.last_stats)
    refusals = {}
    try:  # a 2-D block for a 1-D bias: refused alike on every process
        bias = "model.layers.0.self_attn.q_proj.bias"
        QuantizingRedistributor(source=model, config=config, target_ranks=TARGETS,
                                target_maps={**maps, bias + "_scale_inv": maps[bias]},
                                quantize={bias: {"scale": bias + "_scale_inv", "block": [8, 8]}})
    except RedistributeError as e:
        refusals["block"] = str(e)
    result["refusals"] = refusals
    os.makedirs(out_dir, exist_ok=True)
    torch.save(result, os.path.join(out_dir, f"quant{rank}.pt"))
    leave()


if __name__ == "__main__":
    main(*sys.argv[1:5])
