"""Sync a transformers model's weights from a TP 4 trainer to a TP 2 inference group, live.

Four processes (gloo on the CPU; the same code runs NCCL on GPUs) play both roles: processes
0-3 are the trainer, holding the model at tensor parallelism 4; processes 2-3 (change
INFERENCE below, e.g. to [4, 5] with 6 processes) are the inference engine at TP 2. After
every "training step" the trainer's shards go straight to the inference shards: no process
builds a full tensor, and only the bytes the inference processes lack travel.

The maps come from the model's config.json, exactly as `reshard scatter --config` shards a
checkpoint: reshard knows transformers' tensor-parallel plans. The model is a small Llama with
random weights (nothing is downloaded).

    PYTHONPATH=build/python python -m torch.distributed.run --nproc_per_node 4 \\
        examples/trainer_to_inference.py
"""

import json
import pathlib
import tempfile

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import reshard
import reshard.distributed as rd

TRAINER = [0, 1, 2, 3]  # process of trainer TP rank i
INFERENCE = [2, 3]      # process of inference TP rank j
CONFIG = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)


def maps_at(model_dir, tp):
    """{name: ParamMap} of every weight at `tp`, from the model's config (via a scatter of the
    saved model: the manifest records each parameter's map)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / f"tp{tp}"
        reshard.checkpoint.scatter(model_dir, out, config=model_dir / "config.json", tp=tp)
        manifest = json.loads((out / "reshard.json").read_text())
    return {name: p["map"] for name, p in manifest["params"].items()}


def main():
    dist.init_process_group("gloo")
    me = dist.get_rank()
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG)  # the same random weights on every process
    full = {k: v.detach() for k, v in model.state_dict().items()}

    # Process 0 derives both topologies' maps from config.json; everyone gets them.
    maps = [None]
    if me == 0:
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            maps = [(maps_at(pathlib.Path(tmp), len(TRAINER)),
                     maps_at(pathlib.Path(tmp), len(INFERENCE)))]
    dist.broadcast_object_list(maps, src=0)
    trainer_maps, inference_maps = maps[0]

    # The trainer's TP 4 shards (a real trainer already holds these).
    def trainer_shards():
        if me not in TRAINER:
            return {}
        rank = TRAINER.index(me)
        return {n: reshard.extract(trainer_maps[n], full[n], rank) for n in trainer_maps}

    # Planned once, run after every step.
    sync = rd.Redistributor(trainer_maps, inference_maps, source_ranks=TRAINER,
                            target_ranks=INFERENCE, dtypes=torch.float32)
    weights = None
    for step in range(3):
        with torch.no_grad():  # a stand-in for an optimizer step
            for t in full.values():
                t.add_(0.001 * (step + 1))
        weights = sync.run(trainer_shards(), weights)
        if me in INFERENCE:
            rank = INFERENCE.index(me)
            for n, w in weights.items():
                assert torch.equal(w, reshard.extract(inference_maps[n], full[n], rank)), n
        s = sync.last_stats
        print(f"step {step}: process {me} received {s['received']} bytes (at least "
              f"{s['lower_bound']} needed), sent {s['sent']}, copied {s['local']} locally", flush=True)
    if me == INFERENCE[0]:
        print(f"inference rank 0 holds {len(weights)} tensors at TP {len(INFERENCE)}, "
              "equal to the trainer's weights")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
