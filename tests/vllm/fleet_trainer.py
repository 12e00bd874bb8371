"""A trainer process of the many-engines test: ``python fleet_trainer.py SPEC.json RANK``.

Process r owns engine r (an ``LLM`` at ``spec["engine_tps"][r]`` over the model of
``spec["model"]``, weights A); both processes load their rank of the TP 2 sharded checkpoints of
weights A and B (``reshard.checkpoint.load_rank``) and push through one
``WeightSync(engines=[...])`` into both engines. Steps (``spec["steps"]``): ``{"kind":
"push", "weights": W}``, and ``{"kind": "processing_fails", "weights": W, "engine": E}``: the
last worker of engine E fails its post-load processing of layer 1's MLP once, then W is
pushed; ``{"kind": "engine_lost", "weights": W, "engine": E}``: worker 0 of engine E dies
(SIGKILL) at its first exchange of the push of W (the process owning engine E records no
tokens after it). After each step every process records its own engine's greedy tokens.
First, a WeightSync whose engine lists differ between the processes, and one whose topology
places an engine on a host it does not have, are refused. Process r writes
``{"steps": [{"step", "tokens", "stats", "error"}]}`` to ``spec["out"] + ".r"``.
"""

from __future__ import annotations

import json
import time

import toy


def run(spec: dict, rank: int) -> None:
    import os
    if spec.get("gpu_each"):  # on a GPU machine: engine r on GPU r (bench/gpu_check.sh)
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    import torch
    import torch.distributed as dist

    import reshard
    from reshard.vllm import WeightSync, WeightSyncError
    from vllm import LLM, SamplingParams
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + spec["rendezvous"], rank=rank,
                            world_size=2)
    tp = spec["engine_tps"][rank]
    llm = LLM(model=spec["model"], tensor_parallel_size=tp, enforce_eager=True,
              skip_tokenizer_init=True, dtype="float32", kv_cache_memory_bytes=32 << 20,
              max_model_len=128, weight_transfer_config={"backend": "reshard"})

    def generate() -> list:
        params = SamplingParams(max_tokens=spec["new_tokens"], temperature=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params,
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    loaded = {key: reshard.checkpoint.load_rank(spec["sharded"][key], rank) for key in "AB"}
    results = [{"step": "start", "tokens": generate()}]
    engines = [llm if r == rank else None for r in range(2)]
    try:  # process 1 names a third engine: refused on both, before any engine is touched
        WeightSync(engines=engines + [None] * rank, source_maps=loaded["A"][0], timeout_s=120)
        results[0]["mismatched"] = None
    except WeightSyncError as e:
        results[0]["mismatched"] = str(e)
    try:  # a topology placing engine 1 on a host it does not have: refused on both
        WeightSync(engines=engines, source_maps=loaded["A"][0], timeout_s=120, topology={
            "hosts": [{"name": "here", "gpus": 8}],
            "placement": {"engines": [["here:0", "here:1"][:spec["engine_tps"][0]],
                                      ["elsewhere:0"]]}})
        results[0]["bad_topology"] = None
    except WeightSyncError as e:
        results[0]["bad_topology"] = str(e)
    sync = WeightSync(engines=engines, source_maps=loaded["A"][0], timeout_s=spec["timeout_s"])
    for step in spec["steps"]:
        entry: dict = {"step": step["kind"]}
        if step["kind"] == "processing_fails":
            if rank == step["engine"]:
                hit = llm.collective_rpc(toy.fail_processing_once,
                                         args=(tp - 1, "model.layers.1.mlp.down_proj"))
                assert sum(hit) == 1, hit
            dist.barrier()
        elif step["kind"] == "engine_lost":
            if rank == step["engine"]:
                assert sum(llm.collective_rpc(toy.die_at_first_exchange)) == 1
            dist.barrier()
        start = time.monotonic()
        try:
            entry["stats"] = sync.push(loaded[step["weights"]][1], delta=step.get("delta", False),
                                       verify=step.get("verify", False)).__dict__
        except WeightSyncError as e:
            entry["error"] = str(e)
        entry["seconds"] = time.monotonic() - start
        if step["kind"] == "engine_lost" and rank == step["engine"]:
            entry["tokens"] = None  # its engine is gone
        else:
            entry["tokens"] = generate()
        results.append(entry)
        with open(spec["out"] + f".{rank}", "w") as f:
            json.dump({"steps": results}, f)
    if not any(step["kind"] == "engine_lost" for step in spec["steps"]):
        sync.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    toy.trainer_main(run)
