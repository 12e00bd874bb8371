"""Train toy transformers models with DeepSpeed for a few steps and save checkpoints.

Run under torchrun, one process per rank (gloo on the CPU, DS_ACCELERATOR=cpu):

    torchrun --nproc_per_node TP*DP ds_train.py JOBS.json

JOBS.json is a list of {"spec": {...}, "out": DIR}, every spec of the same TP and DP (see
ds_checkpoints.Spec for the fields); one launch runs them in order, so the seconds of importing
torch, transformers and DeepSpeed are paid once. For each, every rank builds the same model from
the same seed; DeepSpeed shards it over TP ranks with AutoTP ("tensor_parallel": {"autotp_size":
TP}) and its ZeRO stage partitions the optimizer over DP ranks. After `steps` optimizer steps
the engine saves to DIR/ckpt (with config.json beside the tag dirs), and the ranks write what a
test compares against:

- DIR/ref/module-tp{R}.safetensors: TP rank R's module weights as the engine holds them
  (gathered over DP under ZeRO 3), written by the rank with DP index 0;
- DIR/ref/full.safetensors: every module weight whole (TP and DP gathered), by rank 0;
- DIR/ref/facts-{RANK}.json: the spec, the loss of every step, the loss each DP rank sees at
  the next step (forward only, on that step's batch), the tag, or "error" with DeepSpeed's
  message when it refused. A failed job ends the launch; the jobs after it are not run.

A job with "resume": {"from": SAVE_DIR, "universal": bool or "given", "name": NAME} instead
builds a fresh engine, loads SAVE_DIR (with true, what ds_to_universal makes of it, under
DIR/universal; with "given", SAVE_DIR is a universal checkpoint already, as `reshard convert
--to universal` writes it) and records the next step's loss per DP rank in
DIR/ref/resume-NAME-{RANK}.json.

The batch of step s on DP rank d is drawn from seed + 1000 * s + d, so the next step's loss can
be computed again from any resumed engine.
"""

import datetime
import json
import pathlib
import re
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist
from worker_exit import leave

BATCH = 2  # sequences per DP rank and step
SEQ = 8  # tokens per sequence
LR = 1e-2

FAMILIES = {
    "llama": dict(model_type="llama"),
    "qwen2": dict(model_type="qwen2"),  # q/k/v projections carry biases
    "mistral": dict(model_type="mistral", sliding_window=None),
    # Llama whose q, k and v projections AutoTP cuts as two sub-parameters each (a shaped
    # layer spec, as for a fused QKV): a rank holds one head of each half, the same heads of
    # q, k and v, so the model computes what it computes whole. AutoTP records these as
    # parameter_with_sub_params, with no affine map.
    "llama_subparams": dict(model_type="llama"),
    # Mixture of experts: 4 experts of intermediate 128, 2 per token. With "ep" > 1 AutoEP
    # ("expert_parallel": {"autoep_size": EP}) replaces each layer's mlp by its own layer
    # (router.gate, experts.w1/w2/w3 [E/EP, ...]) and saves every expert in a file of its own
    # (layer_{L}_expert_{e}_mp_rank_00_model_states.pt).
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
}


def allow_autoep_with_this_transformers():
    """DeepSpeed 0.19.8's AutoEP calls dict.get(key, default) on transformers' registry of
    output recorders, whose get (transformers 5.24) takes one argument: an AutoEP engine cannot
    even be built. This gives that get its dict form back for string keys, which is all
    AutoEP asks of it."""
    from transformers.utils import output_capturing

    registry = output_capturing._CanRecordRegistry
    if getattr(registry, "_dict_get_restored", False):
        return
    model_get = registry.get

    def get(self, key, *default):
        return dict.get(self, key, *default) if isinstance(key, str) else model_get(self, key)

    registry.get = get
    registry._dict_get_restored = True


def build_model(spec):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        **FAMILIES[spec["family"]], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, vocab_size=spec["vocab"],
        max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    if spec.get("ep", 1) > 1:
        allow_autoep_with_this_transformers()
    torch.manual_seed(spec["seed"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(spec["seed"])
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.05 + (param.dim() == 1))
    if spec.get("buffer"):  # persistent: in the state dict, and in buffer_names
        model.model.register_buffer("running_mean", torch.randn(64, generator=gen))
    if spec.get("frozen"):
        for name, param in model.named_parameters():
            if re.search(spec["frozen"], name):
                param.requires_grad_(False)
    return model


def trainable(model):
    """The parameters the optimizer holds: the frozen ones are left out."""
    return [p for p in model.parameters() if p.requires_grad]


def batch(spec, step, dp_rank):
    gen = torch.Generator().manual_seed(spec["seed"] + 1000 * step + dp_rank)
    ids = torch.randint(3, spec["vocab"], (BATCH, SEQ), generator=gen)
    return ids


def ds_config(spec):
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01,
                                                  "torch_adam": True}},
        "zero_optimization": {"stage": spec["stage"]},
        "tensor_parallel": {"autotp_size": spec["tp"]},
        "wall_clock_breakdown": False,
    }
    if spec["family"] == "llama_subparams":  # the llama preset, q/k/v overridden
        cfg["tensor_parallel"]["preset_model"] = "llama"
        cfg["tensor_parallel"]["partition_config"] = {"layer_specs": [
            {"patterns": [r".*\.self_attn\.[qkv]_proj\.weight$"], "partition_type": "column",
             "shape": [2, -1], "partition_dim": 0}]}
    if spec.get("ep", 1) > 1:
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": spec["ep"],
                                  "use_grouped_mm": False}
    if spec["dtype"] == "bfloat16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def loss_of(engine, spec, step, dp_rank):
    ids = batch(spec, step, dp_rank)
    return engine(input_ids=ids, labels=ids, use_cache=False).loss


def tp_local_state(engine, zero3):
    """This rank's module weights (its TP shard), whole over DP."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=zero3):
        return {n: p.detach().to("cpu").clone().contiguous()
                for n, p in engine.module.named_parameters()}


def init_distributed():
    import deepspeed

    # Collectives through gloo alone: DeepSpeed's shared-memory reduction would be compiled on
    # first use (seconds to minutes on a fresh machine) and sums in another order.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=120))


def train(spec, out):
    import deepspeed
    from safetensors.torch import save_file

    rank = dist.get_rank()
    model = build_model(spec)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable(model),
                                           config=ds_config(spec))
    tp_rank = engine.mpu.get_tensor_model_parallel_rank() if spec["tp"] > 1 else 0
    dp_rank = engine.mpu.get_data_parallel_rank() if spec["tp"] > 1 else rank
    facts = {"losses": [], "tp_rank": tp_rank, "dp_rank": dp_rank}
    for step in range(spec["steps"]):
        loss = loss_of(engine, spec, step, dp_rank)
        engine.backward(loss)
        engine.step()
        facts["losses"].append(loss.item())
    ckpt = out / "ckpt"
    engine.save_checkpoint(str(ckpt))
    if rank == 0:
        engine.module.config.save_pretrained(str(ckpt))
    dist.barrier()
    facts["tag"] = (ckpt / "latest").read_text().strip()
    with torch.no_grad():
        next_loss = loss_of(engine, spec, spec["steps"], dp_rank).item()
    losses = [None] * dist.get_world_size()
    dist.all_gather_object(losses, {"dp": dp_rank, "loss": next_loss})
    facts["next_loss"] = {str(x["dp"]): x["loss"] for x in losses}

    if spec.get("ep", 1) > 1:
        save_hf_reference(engine, spec, out / "ref" / "hf", dp_rank, next_loss)
        engine.destroy()
        return facts

    zero3 = spec["stage"] == 3
    local = tp_local_state(engine, zero3)
    ref = out / "ref"
    if dp_rank == 0:
        save_file(local, str(ref / f"module-tp{tp_rank}.safetensors"))
    full = engine._consolidated_16bit_state_dict() if (zero3 or spec["tp"] > 1) else local
    if rank == 0:
        params = dict(engine.module.named_parameters()).keys()
        save_file({n: t.contiguous() for n, t in full.items() if n in params},
                  str(ref / "full.safetensors"))
    engine.destroy()
    return facts


def save_hf_reference(engine, spec, where, dp_rank, next_loss):
    """The trained AutoEP model as transformers holds it, saved by save_pretrained (rank 0,
    into `where`): the dense weights under their own names (AutoEP's router.gate is the
    layer's gate), each layer's experts gathered from every EP rank (rank k holds experts
    [k E/EP, (k+1) E/EP)) and fused as transformers fuses them (gate_up_proj = w1 then w3 on
    dim 1, down_proj = w2). The rebuilt model must compute the engine's loss: that checks the
    names and the fusing here, not only the files."""
    from safetensors.torch import save_file

    state = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    gathered = [None] * dist.get_world_size()
    local = {n: t for n, t in state.items() if ".experts.w" in n}
    dist.all_gather_object(gathered, {"rank": dist.get_rank(), "experts": local})
    ep = spec["ep"]
    # The first EP group (global ranks 0..EP-1 hold EP ranks 0..EP-1 when DP runs over them).
    by_rank = {g["rank"]: g["experts"] for g in gathered}
    model = build_model(spec)
    hf = {}
    for name in model.state_dict():
        if ".experts." in name:
            continue
        hf[name] = state[name.replace(".mlp.gate.weight", ".mlp.router.gate.weight")]
    for name in [n for n in state if n.endswith(".experts.w1")]:
        prefix = name[: -len(".w1")]
        full = {w: torch.cat([by_rank[k][f"{prefix}.{w}"] for k in range(ep)])
                for w in ("w1", "w2", "w3")}
        hf[f"{prefix}.gate_up_proj"] = torch.cat([full["w1"], full["w3"]], dim=1)
        hf[f"{prefix}.down_proj"] = full["w2"]
    model.load_state_dict(hf, strict=True)
    with torch.no_grad():
        ids = batch(spec, spec["steps"], dp_rank)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss.item()
    assert abs(loss - next_loss) <= 1e-4 * max(1.0, abs(next_loss)), (loss, next_loss)
    if dist.get_rank() == 0:
        model.save_pretrained(str(where))
        # The engine's own view too: its parameters by their DeepSpeed names, whole.
        engine_full = {n: t for n, t in state.items() if ".experts.w" not in n}
        for name in [n for n in state if ".experts.w" in n]:
            engine_full[name] = torch.cat([by_rank[k][name] for k in range(ep)])
        save_file({n: t.contiguous() for n, t in engine_full.items()},
                  str(where.parent / "full.safetensors"))
    dist.barrier()


def convert_to_universal(source, load_dir):
    """Rank 0 converts the checkpoint saved under `source` (its `latest` tag) with DeepSpeed's
    ds_to_universal into LOAD_DIR/TAG_universal; every rank waits for it."""
    if dist.get_rank() == 0:
        from deepspeed.checkpoint import ds_to_universal as converter

        tag = (pathlib.Path(source) / "latest").read_text().strip()
        saved_argv = sys.argv
        sys.argv = ["ds_to_universal", "--input_folder", str(pathlib.Path(source) / tag),
                    "--output_folder", str(load_dir / f"{tag}_universal"),
                    "--num_extract_workers", "1", "--num_merge_workers", "1"]
        try:
            converter.main(converter.parse_arguments())
        finally:
            sys.argv = saved_argv
    dist.barrier()


def resume(spec, out, source, universal):
    """Load the checkpoint saved under `source` into a freshly built engine of `spec`'s
    topology and return the loss of the next step on each DP rank (forward only). With
    `universal` true, rank 0 first converts it with ds_to_universal to OUT/universal and the
    engine loads that with "load_universal"; with "given", it loads `source` so."""
    import deepspeed

    config = ds_config(spec)
    load_dir = pathlib.Path(source)
    if universal == "given":
        config["checkpoint"] = {"load_universal": True}
    elif universal:
        load_dir = out / "universal"
        convert_to_universal(source, load_dir)
        config["checkpoint"] = {"load_universal": True}
    model = build_model(spec)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable(model),
                                           config=config)
    dp_rank = engine.mpu.get_data_parallel_rank() if spec["tp"] > 1 else dist.get_rank()
    engine.load_checkpoint(str(load_dir))
    with torch.no_grad():
        loss = loss_of(engine, spec, spec["steps"], dp_rank).item()
    losses = [None] * dist.get_world_size()
    dist.all_gather_object(losses, {"dp": dp_rank, "loss": loss})
    assert engine.global_steps == spec["steps"], engine.global_steps
    engine.destroy()
    return {"next_loss": {str(x["dp"]): x["loss"] for x in losses}}


def run_job(job, rank, train=train, resume=resume):
    """Run one job: train and save a spec, or (with "resume": {"from", "universal", "name"})
    resume from a saved one. The facts (or DeepSpeed's error) go to OUT/ref/facts-RANK.json,
    or OUT/ref/resume-NAME-RANK.json. Returns whether it worked. ``train`` and ``resume``:
    this module's, or another trainer's (ds_pipe_train.py)."""
    start = time.monotonic()
    out = pathlib.Path(job["out"])
    (out / "ref").mkdir(parents=True, exist_ok=True)
    facts = {"spec": job["spec"]}
    how = job.get("resume")
    try:
        if how:
            facts.update(resume(job["spec"], out, how["from"], how["universal"]))
        else:
            facts.update(train(job["spec"], out))
    except Exception as e:  # recorded: the fixture reports what DeepSpeed refused
        facts["error"] = f"{type(e).__name__}: {e}"
        facts["traceback"] = traceback.format_exc(limit=8)
    facts["seconds"] = time.monotonic() - start
    name = f"resume-{how['name']}-{rank}.json" if how else f"facts-{rank}.json"
    (out / "ref" / name).write_text(json.dumps(facts, indent=1))
    return "error" not in facts


def main(train=train, resume=resume):
    """The jobs of the JSON file argv[1], in order, in this process (its rank of torchrun's
    world), by ``train`` and ``resume``."""
    warnings.simplefilter("ignore")
    jobs = json.loads(pathlib.Path(sys.argv[1]).read_text())
    init_distributed()
    rank = dist.get_rank()
    for job in jobs:
        # After a failure the ranks may disagree on where they are: leave the rest to a new launch,
        # without waiting for the others.
        if not run_job(job, rank, train, resume):
            leave(wait=False)
    leave()


if __name__ == "__main__":
    main()
