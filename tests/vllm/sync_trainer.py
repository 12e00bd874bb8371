"""A trainer process of the live-sync tests: ``python sync_trainer.py SPEC.json RANK``.

Process 0 owns a vLLM engine (``LLM`` with the reshard backend) over the model of
``spec["model"]`` (weights A); every process loads its rank of the sharded checkpoints of
weights A and B (``reshard.checkpoint.load_rank``) and runs the spec's steps in order, each a
push (or a failing push) followed, on process 0, by greedy generation. Process 0 writes
``{"steps": [{"tokens", "stats", "error"}]}`` to ``spec["out"]``.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import toy


class DuringPush(Mapping):
    """Shards that call ``during()`` when the push first reads the shard ``name`` (one split
    between the trainer processes: read by the transfer, once the push has been agreed), once."""

    def __init__(self, shards: dict, during: Callable[[], None], name: str) -> None:
        self._shards, self._during, self._name = shards, during, name

    def __getitem__(self, name: str) -> Any:
        during = self._during if name == self._name else None
        if during is not None:
            self._during = None
            during()
        return self._shards[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._shards)

    def __len__(self) -> int:
        return len(self._shards)


def push_in_thread(sync: Any, shards: dict) -> dict:
    """``sync.push(shards)`` on a thread of its own, waited for: what it returned or raised."""
    out: dict = {}

    def body() -> None:
        try:
            out["stats"] = sync.push(shards).__dict__
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    return out


def two_threads(sync: Any, shards: list, names: list) -> list:
    """``sync.push(shards[i])`` on two threads started together (a barrier releases both at
    once), in the order given: what each returned or raised, with ``names[i]``."""
    gate = threading.Barrier(len(shards))
    out: list = [{"weights": n} for n in names]

    def body(i: int) -> None:
        gate.wait()
        try:
            out[i]["stats"] = sync.push(shards[i]).__dict__
        except Exception as e:
            out[i]["error"] = f"{type(e).__name__}: {e}"
    threads = [threading.Thread(target=body, args=(i,)) for i in range(len(shards))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def push_dtensors(spec: dict, step: dict, llm: Any, syncs: dict) -> dict:
    """The full weights distributed as DTensors over a 1-D mesh of the trainer processes
    (alternately row and column splits, uneven where the sizes are; vectors replicated),
    pushed by a WeightSync built from them (``source=``), then, the same tensors changed in
    place to the other weights, pushed again: the sync reads the model as it is.

    ``spec["trainer_device"]`` (``"cuda"`` on a GPU machine) puts the mesh and the DTensors on
    that device: each process cuts its own shards (``src_data_rank=None``), so that no gloo
    collective sees a CUDA tensor, and the sync stages them through host memory."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from reshard.vllm import WeightSync
    import torch.distributed as dist
    device = spec.get("trainer_device", "cpu")
    if device == "cuda":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    first, then = step["weights"], step["then"]
    full = load_file(os.path.join(spec["full"][first], "model.safetensors"))
    state = {n: distribute_tensor(t, mesh, [Shard(i % 2)] if t.dim() == 2 else [Replicate()],
                                  src_data_rank=None)
             for i, (n, t) in enumerate(sorted(full.items()))}
    devices = sorted({t.to_local().device.type for t in state.values()})
    syncs["sync"] = sync = WeightSync(llm, source=state)
    out: dict = {"stats": sync.push().__dict__, "trainer_devices": devices}
    if llm is not None:
        out["tokens_first"] = generate_with(llm, spec)
    other = load_file(os.path.join(spec["full"][then], "model.safetensors"))
    with torch.no_grad():
        for n, t in state.items():
            t.copy_(distribute_tensor(other[n], mesh, t.placements, src_data_rank=None))
    out["stats_then"] = sync.push().__dict__
    return out


def generate_with(llm: Any, spec: dict) -> list:
    from vllm import SamplingParams
    params = SamplingParams(max_tokens=spec["new_tokens"], temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params,
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def run(spec: dict, rank: int) -> None:
    import torch
    import torch.distributed as dist
    import reshard
    from reshard.vllm import WeightSync, WeightSyncError
    torch.set_num_threads(1)
    world = spec["trainers"]
    dist.init_process_group("gloo", init_method="file://" + spec["rendezvous"], rank=rank,
                            world_size=world)
    llm = None
    if rank == 0:
        from vllm import LLM
        llm = LLM(model=spec["model"], tensor_parallel_size=spec["engine_tp"],
                  enforce_eager=True, skip_tokenizer_init=True, dtype="float32",
                  kv_cache_memory_bytes=32 << 20, max_model_len=128,
                  block_size=spec.get("block_size", 32),  # a long prompt fills a cached block
                  weight_transfer_config={"backend": "reshard"})

    def generate() -> list:
        from vllm import SamplingParams
        params = SamplingParams(max_tokens=spec["new_tokens"], temperature=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params,
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    loaded = {}
    for key, where in spec["sharded"].items():  # {"A": dir, "B": dir, "A1": dir at TP 1, ...}
        if not key.endswith("1") or rank == 0:
            loaded[key] = reshard.checkpoint.load_rank(where, rank)
    results = []
    if rank == 0:
        results.append({"step": "start", "tokens": generate()})
    syncs = {}
    for step in spec["steps"]:
        kind, weights = step["kind"], step.get("weights", "B")
        maps, shards = loaded.get(weights, ({}, {}))
        entry: dict = {"step": step["name"]}
        try:
            if kind == "push":
                if "sync" not in syncs:
                    syncs["sync"] = WeightSync(llm, maps,
                                               overlap_processing=step.get("overlap"))
                stats = syncs["sync"].push(shards, delta=step.get("delta", False),
                                           verify=step.get("verify", False))
                entry["stats"] = stats.__dict__
            elif kind == "corrupted":  # a worker's tensor altered after it arrived, verified
                if rank == 0:
                    hit = llm.collective_rpc(toy.corrupt_before_verify_once, args=(
                        spec["engine_tp"] - 1, step["tensor"]))
                    assert sum(hit) == 1, hit
                dist.barrier()
                syncs["sync"].push(shards, delta=step.get("delta", False), verify=True)
            elif kind == "adamw":  # AdamW steps of a bf16 model, each delta-pushed, checked
                entry.update(toy.adamw_pushes(spec, step, llm, syncs["sync"], maps, rank,
                                              generate))
            elif kind == "dtensors":  # the trainer's own DTensors, no maps written
                entry.update(push_dtensors(spec, step, llm, syncs))
            elif kind == "nan":  # every element NaN: generating fills KV blocks with NaN
                nan = {n: torch.full_like(t, float("nan")) for n, t in shards.items()}
                syncs["sync"].push(nan)
            elif kind == "two_at_once":  # a second push, from another thread, mid-push
                other = loaded[step["second"]][1]
                second: dict = {}
                stats = syncs["sync"].push(DuringPush(
                    shards, lambda second=second, other=other: second.update(push_in_thread(
                        syncs["sync"], other)), "model.layers.1.mlp.down_proj.weight"))
                entry["stats"] = stats.__dict__
                entry["second"] = second
            elif kind == "pushes_differ":  # process 0 pushes these weights, the others "other"
                syncs["sync"].push(shards if rank == 0 else loaded[step["other"]][1])
            elif kind == "two_threads":  # at once, in opposite orders on the two processes
                pair = [weights, step["other"]][::1 if rank == 0 else -1]
                entry["threads"] = two_threads(syncs["sync"], [loaded[k][1] for k in pair], pair)
            elif kind == "extra_name":  # the trainer has a tensor the engine lacks
                bad = dict(maps)
                bad["model.layers.0.mlp.extra.weight"] = maps["model.norm.weight"]
                WeightSync(llm, bad)
            elif kind == "bad_shape":  # a map describing another shape than the engine's
                bad = dict(maps)  # down_proj [H, I] described by q_proj's map [heads * d, H]
                name = "model.layers.0.mlp.down_proj.weight"
                d = maps["model.layers.0.self_attn.q_proj.weight"].to_dict()
                bad[name] = reshard.ParamMap.from_dict(d)
                WeightSync(llm, bad)
            elif kind == "failing_process":  # the last trainer process's shards are wrong
                own = dict(shards)
                if rank == world - 1:
                    own.pop("model.layers.1.mlp.down_proj.weight")
                syncs["sync"] = WeightSync(llm, maps)  # the failed ones above replaced it
                syncs["sync"].push(own)
            elif kind == "processing_fails":  # on the last worker, in layer 1's MLP
                if rank == 0:
                    hit = llm.collective_rpc(toy.fail_processing_once, args=(
                        spec["engine_tp"] - 1, "model.layers.1.mlp.down_proj"))
                    assert sum(hit) == 1, hit
                dist.barrier()
                if "overlap" in step:
                    syncs["sync"] = WeightSync(llm, maps, overlap_processing=step["overlap"])
                syncs["sync"].push(shards, delta=step.get("delta", False))
            elif kind == "single":  # trainer at TP 1: process 0 alone, full tensors
                solo = dist.new_group([0])
                syncs.pop("sync", None)  # the engine now listens to the other sync
                try:
                    if rank == 0:
                        full_maps, full = loaded[weights + "1"]
                        entry["stats"] = WeightSync(llm, full_maps, solo).push(full).__dict__
                finally:
                    dist.barrier()
            else:
                raise ValueError(kind)
        except WeightSyncError as e:
            entry["error"] = str(e)
        if rank == 0:
            entry["tokens"] = generate()
        results.append(entry)
        with open(spec["out"] + ("" if rank == 0 else f".{rank}"), "w") as f:
            json.dump({"steps": results}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    toy.trainer_main(run)
