"""A Megatron-Core trainer process of the ``vllm serve`` tests, in .venv-megatron (megatron-core,
no vLLM): ``python megatron_trainer.py SPEC.json RANK``.

The processes build a GPT model with megatron-core at TP 2 (gloo, megatron_model.py of the
Python tests) and sync it into the server named by ``spec["url"]`` with one
``WeightSync(url, source=model, config=...)``: no hand-written maps, the engine's layout given
as ``spec["target_maps"]`` (learned from vLLM by the test, since this Python has no vLLM). For
each of two weight sets (the model as initialised, then every weight redrawn in place) process 0
writes the Hugging Face tensors the model holds (rebuilt from every process's own tensors with
the maps of reshard.torch.megatron_maps) to ``spec["out"]/weights{k}.pt``, every process pushes,
and process 0 records the server's greedy tokens and the push's stats in
``spec["out"]/result.json``.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "python"))
import megatron_model  # noqa: E402
import serve_trainer  # noqa: E402
import toy  # noqa: E402


def run(spec: dict, rank: int) -> None:
    import torch
    import torch.distributed as dist

    import reshard
    import reshard.torch as rt
    from reshard.vllm import WeightSync
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    model_spec = spec["model_spec"]
    megatron_model._init(2, 1, 1)
    torch.manual_seed(model_spec["seed"])
    model = megatron_model._model(model_spec, megatron_model._config(model_spec, 2, 1, 1))
    config = json.loads(open(spec["config"]).read())
    sync = WeightSync(spec["url"], source=model, config=config,
                      target_maps=reshard.read_maps(spec["target_maps"]), timeout_s=120)
    buffers = rt.megatron_maps(model, config)
    results = []
    for k in range(2):
        shards = [None] * 2
        dist.all_gather_object(shards, {n: t.clone() for n, t in rt.megatron_shards(model).items()})
        if rank == 0:
            full = {name: reshard.rebuild(m, [s[m.buffer(r)] for r, s in enumerate(shards)])
                    for name, m in buffers.maps.items()}
            torch.save(full, os.path.join(spec["out"], f"weights{k}.pt"))
        stats = sync.push()
        if rank == 0:
            tokens = serve_trainer.completions(spec["url"], spec["prompts"], spec["new_tokens"])
            results.append({"tokens": tokens, "bytes_sent": stats.bytes_sent,
                            "plan_minimum": stats.plan_minimum})
            with open(os.path.join(spec["out"], "result.json"), "w") as f:
                json.dump(results, f)
        with torch.no_grad():  # other weights, in place: the next push sends them
            torch.manual_seed(100 + k)  # the same on both: replicated tensors stay equal
            for p in model.parameters():
                p.normal_(0.0, 0.2)
        dist.barrier()
    sync.close()


if __name__ == "__main__":
    toy.trainer_main(run)
