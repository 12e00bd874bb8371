"""A trainer process of the many-engines test: ``python fleet_trainer.py SPEC.json RANK``.

Process r owns engine r (an ``LLM`` at ``spec["engine_tps"][r]`` over the model of
``spec["model"]``, weights A); both processes load their rank of the TP 2 sharded checkpoints of
weights A and B (``reshard.checkpoint.load_rank``) and push through one
``WeightSync(engines=[...])`` into both engines. Steps (``spec["steps"]``): ``{"kind":
"push", "weights": W}``, and ``{"kind": "processing_fails", "weights": W, "engine": E}``: the
last worker of engine E fails its post-load processing of layer 1's MLP once, then W is
pushed; ``{"kind": "engine_lost", "weights": W, "engine": E}``: worker 0 of the engine process
E owns dies (SIGKILL) at its first exchange of the push of W (the process owning it records no
tokens until it owns an engine again); ``{"kind": "add_engine", "owner": R}``: process R
starts a fresh engine (weights A, TP 1) and every process adds it to the sync (``"again":
true``: process R's engine, which the sync has already); ``{"kind": "add_other_model", "owner":
R}``: process R starts an engine of a model whose MLP is narrower and every process adds it;
``{"kind": "verify"}``: ``sync.verify()`` of the weights last pushed (``"weights"``);
``{"kind": "corrupt_verify", "engine": E, "worker": W, "tensor": T}``: element 0 of the
parameter T that worker W of process E's engine serves altered (one bit), then verify;
``{"kind": "new_sync", "on_engine_lost": ...}``: a new WeightSync over the engines the
processes own; ``{"kind": "lora_push", "adapter": K, "parallel": P, "lora_name": N}``: the PEFT
model of the adapter saved in ``spec["lora_dirs"][K]``, split over the two processes as ``P``
says (``peft_model``), pushed with ``sync.push_lora(N, model)``, then each engine's greedy
tokens for ``sync.lora_request(N)`` recorded besides its base model's (with ``"fail_engine":
E``, the last worker of the engine process E owns fails to stage it first). The engines run with
``enable_lora``. The sync is built with ``spec["on_engine_lost"]``. After each step every
process records its own engine's greedy tokens.
First, a WeightSync whose engine lists differ between the processes, and one whose topology
places an engine on a host it does not have, are refused. Process r writes
``{"steps": [{"step", "tokens", "stats", "error"}]}`` to ``spec["out"] + ".r"``.
"""

from __future__ import annotations

import json
import time
import warnings
from typing import Any, Optional

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

    def start(tp: int) -> Any:
        return LLM(model=spec["model"], tensor_parallel_size=tp, enforce_eager=True,
                   skip_tokenizer_init=True, dtype="float32", kv_cache_memory_bytes=32 << 20,
                   max_model_len=128, weight_transfer_config={"backend": "reshard"},
                   enable_lora=True, max_lora_rank=toy.LORA_R, max_loras=1)
    llm = start(tp)

    def generate(lora: Any = None) -> Optional[list]:
        if llm is None:
            return None
        params = SamplingParams(max_tokens=spec["new_tokens"], temperature=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params,
                            use_tqdm=False, lora_request=lora)
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
    lost = spec.get("on_engine_lost", "fail")
    sync = WeightSync(engines=engines, source_maps=loaded["A"][0], timeout_s=spec["timeout_s"],
                      on_engine_lost=lost)
    last = "A"
    for step in spec["steps"]:
        entry: dict = {"step": step["kind"], "name": step.get("name")}
        kind = step["kind"]
        start_s = time.monotonic()
        try:
            if kind == "add_engine":
                if rank == step["owner"] and not step.get("again"):
                    llm = start(1)
                entry["engine_ids"] = sync.engine_ids  # as they were, should the add fail
                entry["number"] = sync.add_engine(llm if rank == step["owner"] else None)
                entry["engine_ids"] = sync.engine_ids
            elif kind == "add_other_model":  # shapes the trainer's tensors do not take
                other = None
                if rank == step["owner"]:
                    config = toy.llama_config(intermediate_size=96)
                    path = toy.write(spec["out"] + ".other", config, toy.weights(config, 3))
                    other = LLM(model=path, tensor_parallel_size=1, enforce_eager=True,
                                skip_tokenizer_init=True, dtype="float32",
                                kv_cache_memory_bytes=32 << 20, max_model_len=128,
                                weight_transfer_config={"backend": "reshard"})
                dist.barrier()
                try:
                    sync.add_engine(other)
                finally:
                    entry["engine_ids"] = sync.engine_ids
                    if other is not None:
                        other.llm_engine.engine_core.shutdown()
            elif kind == "new_sync":
                lost = step["on_engine_lost"]
                sync.close()
                sync = WeightSync(engines=[llm if r == rank else None for r in range(2)],
                                  source_maps=loaded["A"][0], timeout_s=spec["timeout_s"],
                                  on_engine_lost=lost)
            elif kind == "lora_push":
                model = peft_model(spec["lora_dirs"][step["adapter"]], step["parallel"])
                if "fail_engine" in step:  # its last worker fails to stage the adapter
                    if rank == step["fail_engine"]:
                        assert sum(llm.collective_rpc(toy.fail_adapter_staging_once,
                                                      args=(tp - 1,))) == 1
                    dist.barrier()
                entry["stats"] = sync.push_lora(step["lora_name"], model).__dict__
                entry["adapter_names"] = sync.adapter_names
            elif kind == "adamw":  # AdamW steps of a bf16 model, delta-pushed, then B whole
                entry.update(toy.adamw_pushes(spec, step, llm, sync, loaded["A"][0], rank,
                                              generate, then=loaded[step["then"]][1]))
                last = step["then"]
            elif kind in ("verify", "corrupt_verify"):
                if kind == "corrupt_verify":
                    if rank == step["engine"]:
                        assert sum(llm.collective_rpc(toy.corrupt_served, args=(
                            step["worker"], step["tensor"]))) == 1
                    dist.barrier()
                entry["verified"] = sync.verify(loaded[last][1]).__dict__
            else:
                if kind == "processing_fails" and rank == step["engine"]:
                    hit = llm.collective_rpc(toy.fail_processing_once,
                                             args=(tp - 1, "model.layers.1.mlp.down_proj"))
                    assert sum(hit) == 1, hit
                elif kind == "engine_lost" and rank == step["engine"]:
                    assert sum(llm.collective_rpc(toy.die_at_first_exchange)) == 1
                if kind != "push":
                    dist.barrier()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    entry["stats"] = sync.push(loaded[step["weights"]][1],
                                               delta=step.get("delta", False),
                                               verify=step.get("verify", False)).__dict__
                entry["warnings"] = [str(w.message) for w in caught]
                entry["last_stats"] = sync.last_stats.__dict__ if sync.last_stats else None
                entry["engine_ids"] = sync.engine_ids
                last = step["weights"]
        except WeightSyncError as e:
            entry["error"] = str(e)
        entry["seconds"] = time.monotonic() - start_s
        if kind == "engine_lost" and rank == step["engine"]:
            llm = None  # its engine is gone
        entry["tokens"] = generate()
        if kind == "lora_push" and step["lora_name"] in sync.adapter_names:
            entry["lora_tokens"] = generate(sync.lora_request(step["lora_name"]))
        results.append(entry)
        with open(spec["out"] + f".{rank}", "w") as f:
            json.dump({"steps": results}, f)
    dist.barrier()
    dist.destroy_process_group()


MLP = ("gate_proj", "up_proj", "down_proj")


def peft_model(directory: str, parallel: str) -> Any:
    """The toy Llama with the PEFT adapter saved in ``directory`` (``peft.PeftModel``), split
    over the two trainer processes. ``"fsdp2"``: every decoder layer, then the whole model,
    ``fully_shard``-ed over a mesh of both (every adapter tensor a DTensor, its rows split).
    ``"tp"``: the base model parallelized by torch's tensor parallelism before PEFT wraps it
    (q, k, v, gate and up column-wise, o and down row-wise), then each adapter split as its
    layer is: B of a column-parallel layer by rows, A of a row-parallel layer by columns (as
    ``ColwiseParallel`` / ``RowwiseParallel`` split a Linear's weight); the A of a
    column-parallel layer and the B of a row-parallel one stay whole on both processes."""
    import peft
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    config = toy.llama_config()
    mesh = init_device_mesh("cpu", (2,))
    model = toy._model(config)
    columns = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    rows = ("o_proj", "down_proj")

    def modules(names: tuple[str, ...]) -> list[str]:
        return [f"model.layers.{i}.{'mlp' if n in MLP else 'self_attn'}.{n}"
                for i in range(config["num_hidden_layers"]) for n in names]
    if parallel == "tp":
        parallelize_module(model, mesh, {**{m: ColwiseParallel() for m in modules(columns)},
                                         **{m: RowwiseParallel() for m in modules(rows)}})
    adapted = peft.PeftModel.from_pretrained(model, directory)
    if parallel == "fsdp2":
        for layer in adapted.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(adapted, mesh=mesh)
    elif parallel == "tp":
        stem = "base_model.model."
        parallelize_module(adapted, mesh, {
            **{f"{stem}{m}.lora_B.default": ColwiseParallel() for m in modules(columns)},
            **{f"{stem}{m}.lora_A.default": RowwiseParallel() for m in modules(rows)}})
    else:
        raise ValueError(f"parallel is \"fsdp2\" or \"tp\", got {parallel!r}")
    return adapted


if __name__ == "__main__":
    toy.trainer_main(run)
