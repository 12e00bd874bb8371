"""A trainer process of the ``vllm serve`` tests: ``python serve_trainer.py SPEC.json RANK``.

Every process names the server's URL (``spec["url"]``), loads its rank of the sharded
checkpoints of weights A and B (``reshard.checkpoint.load_rank``) and runs the spec's steps in
order against one :class:`reshard.vllm.WeightSync`:

- ``{"kind": "push", "weights": W}``: push W; then every process asks the server for its
  greedy tokens (``/v1/completions``).
- ``{"kind": "killed_push", "weights": W, "victim": R}``: push W, during which process R dies
  by SIGKILL inside the transfer: at its first exchange of the push (every process past the
  agreement that shards are well formed, the engine's workers receiving), it sends its chunks
  to every worker but the last it has chunks for, waits until they are sent, and kills
  itself; so one worker can have every byte it lacks while another cannot. The others record
  the error they get and how long it took, then the server's tokens, and stop (their group
  has lost a member).
- ``{"kind": "push_lora", "lora": N, "adapter": DIR}``: push the PEFT adapter saved in DIR
  (its tensors, and its adapter_config.json by path) under the name N.

Each push is followed by the server's greedy tokens (``/v1/completions``): ``tokens`` with no
model named, and (process 0) ``served``, {model: tokens}, for each name in the step's ``ask``. Each process
writes ``{"steps": [{"step", "tokens", "served", "stats", "error", "seconds"}]}`` to
``spec["out"] + ".RANK"`` after every step.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
import urllib.request

import toy


def completions(url: str, prompts: list, n: int, timeout: float = 60,
                model: str | None = None) -> list:
    """The server's greedy continuations of ``prompts`` (token ids in, token ids out), by the
    model named ``model`` (a base model's name or an adapter's; None: the base model)."""
    body = {"prompt": prompts, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    if model is not None:
        body["model"] = model
    request = urllib.request.Request(url.rstrip("/") + "/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        choices = json.loads(reply.read())["choices"]
    return [c["token_ids"] for c in sorted(choices, key=lambda c: c["index"])]


def die_inside_the_transfer(sync, record) -> None:
    """This process is SIGKILLed in its first exchange of the next push (see the module's
    docstring), having sent to every worker but the last; ``record`` notes the workers."""
    transport = sync.transport
    post = transport.exchange

    def exchange(sends, receives):
        peers = sorted({peer for _, peer in sends})
        for work in post([(t, peer) for t, peer in sends if peer != peers[-1]], receives):
            work.wait()
        record({"sent_to": peers[:-1], "withheld": peers[-1]})
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    transport.exchange = exchange


def run(spec: dict, rank: int) -> None:
    import torch
    import torch.distributed as dist
    import reshard
    from reshard.vllm import WeightSync
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + spec["rendezvous"], rank=rank,
                            world_size=spec["trainers"])
    url = spec["url"]
    loaded = {key: reshard.checkpoint.load_rank(where, rank)
              for key, where in spec["sharded"].items()}
    results: list = []
    out = spec["out"] + f".{rank}"

    def record(entry: dict) -> None:
        results.append(entry)
        with open(out, "w") as f:
            json.dump({"steps": results}, f)

    maps = loaded["A"][0]
    sync = WeightSync(url, maps, timeout_s=spec["timeout_s"])  # the URL in every process
    for step in spec["steps"]:
        shards = loaded[step["weights"]][1] if "weights" in step else None
        entry: dict = {"step": step["name"]}
        if step["kind"] == "killed_push" and rank == step["victim"]:
            die_inside_the_transfer(sync, lambda peers, entry=entry: record({**entry, **peers}))
        start = time.monotonic()
        try:
            if step["kind"] == "push_lora":
                from safetensors.torch import load_file
                adapter = load_file(os.path.join(step["adapter"], "adapter_model.safetensors"))
                entry["stats"] = sync.push_lora(
                    step["lora"], adapter,
                    config=os.path.join(step["adapter"], "adapter_config.json")).__dict__
            else:
                entry["stats"] = sync.push(shards).__dict__
        except Exception as e:  # what the surviving processes get
            traceback.print_exc()
            entry["error"] = f"{type(e).__name__}: {e}"
        entry["seconds"] = time.monotonic() - start
        entry["tokens"] = completions(url, spec["prompts"], spec["new_tokens"])
        if step.get("ask"):
            # Process 0 alone asks, one model at a time: vLLM's CPU LoRA ops apply the adapter
            # in the last slot to the base model's rows of a batch that mixes both (its
            # torch_ops index the no-adapter sentinel -1 as a slot).
            dist.barrier()
            if rank == 0:
                entry["served"] = {model: completions(url, spec["prompts"],
                                                      spec["new_tokens"], model=model)
                                   for model in step["ask"]}
        record(entry)
        if step["kind"] == "killed_push":
            return  # the group lost a member: nothing more to do together
        # The engine serves no request while it takes an update: every process has its tokens
        # before the next push begins.
        dist.barrier()
    sync.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    toy.trainer_main(run)
