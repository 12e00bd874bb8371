"""Train a toy DeepSpeed PipelineModule for a few steps and save its checkpoint.

Run under torchrun, one process per rank (gloo on the CPU, DS_ACCELERATOR=cpu):

    torchrun --nproc_per_node PP*TP*DP ds_pipe_train.py JOBS.json

JOBS.json is a list of {"spec": {...}, "out": DIR} (see ds_checkpoints.PipeSpec for the
fields), every spec of the same PP x DP; they run in order in one launch. The model is a
PipelineModule of LAYERS layer specs: an embedding tied to the output projection
(TiedLayerSpec "embed", at layer 0 and at the last layer, as GPT pipelines tie them), BLOCKS
residual MLP blocks (LayerNorm, Linear H -> 2H, GELU, Linear 2H -> H) and a final LayerNorm.
Every parameter is drawn from a generator seeded by the spec's seed and the layer index, so
every rank and every PP degree builds the same model. With "tp" > 1 the topology is
PipeModelDataParallelTopology and each block is cut over the TP ranks as Megatron cuts an MLP
(TpBlock: the same weights, cut), the rest held whole. DeepSpeed partitions the layers over
`pp` stages by the spec's partition method ("parameters": balanced by parameter count;
"uniform": by layer count; "type:Block": by blocks) and each stage's
ZeRO optimizer over its `dp` ranks. After `steps` steps (train_batch, MICRO micro-batches per
DP rank) the engine saves to DIR/ckpt, and the ranks record what a test compares against:

- DIR/ref/full.safetensors: every parameter whole, by the engine's names (the layer index,
  then the layer's own name; "tied_modules.embed.weight" for the tied embedding), from the
  DP rank 0 of each stage and TP rank, gathered to rank 0 (TP shards concatenated);
- DIR/ref/facts-{RANK}.json: the spec, the loss of every step, the loss of the next step
  (eval_batch on DP rank 0's micro-batches of that step, on every DP rank), the tag, or
  "error" with DeepSpeed's message.

A job with "resume": {"from": DIR, "universal": "given", true or false, "name": NAME} builds a
fresh engine, loads DIR with "load_universal" (true: what ds_to_universal makes of the save dir
DIR, under OUT/universal; false: DIR as a save dir of its own, layer files and ZeRO partitions,
without "load_universal") and records the next step's loss per DP rank in
OUT/ref/resume-NAME-{RANK}.json.

The micro-batch m of step s on DP rank d is drawn from seed + 1000 * s + 10 * d + m.
"""

import pathlib
import re
import sys

import torch
import torch.distributed as dist
from torch import nn

HIDDEN = 16
SEQ = 4
MICRO = 2  # micro-batches per step (gradient accumulation)
MICRO_BATCH = 2  # sequences per micro-batch
LR = 1e-2


def _init(module, seed, layer):
    gen = torch.Generator().manual_seed(seed * 100 + layer)
    with torch.no_grad():
        for _, param in sorted(module.named_parameters()):
            param.copy_(torch.randn(param.shape, generator=gen) * 0.1 + (param.dim() == 1))


class Embed(nn.Module):
    def __init__(self, vocab, seed, layer):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, HIDDEN))
        _init(self, seed, layer)

    def forward(self, ids):
        return nn.functional.embedding(ids, self.weight)


def project(embed, hidden):
    """The tied output projection: hidden states times the embedding, transposed."""
    return hidden @ embed.weight.t()


# Whether each Block keeps a persistent buffer (spec "buffers"): set by build_model.
BLOCK_BUFFER = {"on": False}


class Block(nn.Module):
    def __init__(self, seed, layer):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN)
        _init(self, seed, layer)
        if BLOCK_BUFFER["on"]:  # a running mean of the block's input, as BatchNorm keeps one
            self.register_buffer("running", torch.zeros(HIDDEN))

    def forward(self, x):
        if BLOCK_BUFFER["on"] and self.training:
            with torch.no_grad():
                self.running.mul_(0.5).add_(x.detach().float().mean(dim=(0, 1)).to(
                    self.running.dtype) * 0.5)
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


# Tensor parallelism (spec "tp" > 1), Megatron's way: set by build_model.
TP = {"rank": 0, "size": 1, "group": None}


class _ToTp(torch.autograd.Function):
    """Identity forward; the gradient summed over the TP ranks."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=TP["group"])
        return grad


class _FromTp(torch.autograd.Function):
    """The partial sums of the TP ranks added up; identity backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x, group=TP["group"])
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class TpBlock(nn.Module):
    """Block cut over the TP ranks: `up` by rows (column parallel: weight and bias), `down` by
    columns (row parallel; its bias whole, added once after the sum), the norm whole. Its
    weights are the TP 1 Block's, cut."""

    def __init__(self, seed, layer):
        super().__init__()
        full = Block(seed, layer)
        rank, size = TP["rank"], TP["size"]
        rows = 2 * HIDDEN // size
        self.norm = full.norm
        self.up = nn.Linear(HIDDEN, rows)
        self.down = nn.Linear(rows, HIDDEN)
        with torch.no_grad():
            self.up.weight.copy_(full.up.weight[rank * rows:(rank + 1) * rows])
            self.up.bias.copy_(full.up.bias[rank * rows:(rank + 1) * rows])
            self.down.weight.copy_(full.down.weight[:, rank * rows:(rank + 1) * rows])
            self.down.bias.copy_(full.down.bias)

    def forward(self, x):
        h = nn.functional.gelu(self.up(_ToTp.apply(self.norm(x))))
        partial = nn.functional.linear(h, self.down.weight)
        return x + _FromTp.apply(partial) + self.down.bias


class FinalNorm(nn.LayerNorm):
    def __init__(self, seed, layer):
        super().__init__(HIDDEN)
        _init(self, seed, layer)


def loss_fn(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                       labels.reshape(-1))


def build_model(spec):
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    global HIDDEN
    HIDDEN = spec.get("hidden", 16)  # larger for the benchmark (bench/universal_bench.py --pp)
    BLOCK_BUFFER["on"] = bool(spec.get("buffers"))
    seed, blocks, tp = spec["seed"], spec["blocks"], spec.get("tp", 1)
    topology = None
    if tp > 1:  # the layer files then name their TP rank: layer_XX-model_YY-model_states.pt
        topology = PipeModelDataParallelTopology(num_pp=spec["pp"], num_mp=tp,
                                                 num_dp=spec["dp"])
        TP.update(rank=topology.get_coord(dist.get_rank()).model, size=tp)
    block = TpBlock if tp > 1 else Block
    layers = [TiedLayerSpec("embed", Embed, spec["vocab"], seed, 0)]
    layers += [LayerSpec(block, seed, 1 + i) for i in range(blocks)]
    layers += [LayerSpec(FinalNorm, seed, 1 + blocks),
               TiedLayerSpec("embed", Embed, spec["vocab"], seed, 0, forward_fn=project)]
    module = PipelineModule(layers=layers, num_stages=None if topology else spec["pp"],
                            topology=topology, loss_fn=loss_fn,
                            partition_method=spec.get("partition", "parameters"))
    if tp > 1:
        TP["group"] = module._grid.get_slice_parallel_group()
    if spec.get("frozen"):  # the pipeline engine's names: "<layer index>.<name>"
        for name, param in module.named_parameters():
            if re.search(spec["frozen"], name):
                param.requires_grad_(False)
    return module


def micro_batches(spec, step, dp_rank):
    out = []
    for m in range(MICRO):
        gen = torch.Generator().manual_seed(spec["seed"] + 1000 * step + 10 * dp_rank + m)
        ids = torch.randint(0, spec["vocab"], (MICRO_BATCH, SEQ + 1), generator=gen)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def ds_config(spec):
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": MICRO,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01,
                                                  "torch_adam": True}},
        "zero_optimization": {"stage": spec["stage"]},
        "wall_clock_breakdown": False,
    }
    if spec["dtype"] == "bfloat16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def universal_info(spec):
    """What ds_to_universal needs to know of the model (its "universal_checkpoint_info"): the
    tied embedding is held by the first and the last stage (only one copy is kept); with TP,
    which parameters every TP rank holds whole and which are cut by columns (row parallel),
    the rest being cut by rows."""
    info = {"universal_checkpoint_version": 0.2,
            "pipeline_replicated_parameter_patterns": [r"tied_modules\.embed\.weight"]}
    if spec.get("tp", 1) > 1:
        info["tp_replicated_parameter_patterns"] = [
            r"tied_modules\.", r"\d+\.norm\.", r"\d+\.down\.bias", r"\d+\.(weight|bias)$"]
        info["parameter_with_row_parallelism_patterns"] = [r"\d+\.down\.weight"]
    return info


def make_engine(spec, config):
    import deepspeed

    model = build_model(spec)
    model.universal_checkpoint_info = universal_info(spec)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable,
                                           config=config)
    return engine


def next_losses(engine, spec, step):
    """The loss of step `step` (forward only) on each DP rank. eval_batch averages over the DP
    ranks, so every rank is given the same micro-batches (DP rank 0's): the average of equal
    losses over 1, 2 or 4 ranks is that loss, bit for bit, whatever the DP degree."""
    dp_rank = engine.grid.data_parallel_id
    with torch.no_grad():
        loss = engine.eval_batch(iter(micro_batches(spec, step, 0))).item()
    losses = [None] * dist.get_world_size()
    dist.all_gather_object(losses, {"dp": dp_rank, "loss": loss})
    return {str(x["dp"]): x["loss"] for x in losses}


def train(spec, out):
    from safetensors.torch import save_file

    engine = make_engine(spec, ds_config(spec))
    dp_rank = engine.grid.data_parallel_id
    facts = {"losses": [], "stage": engine.stage_id, "dp_rank": dp_rank,
             "parts": [int(p) for p in engine.module.parts]}
    for step in range(spec["steps"]):
        loss = engine.train_batch(iter(micro_batches(spec, step, dp_rank)))
        facts["losses"].append(loss.item())
    ckpt = out / "ckpt"
    engine.save_checkpoint(str(ckpt))
    dist.barrier()
    facts["tag"] = (ckpt / "latest").read_text().strip()
    if not spec.get("reference", True):  # the benchmark's checkpoint: only the files
        engine.destroy()
        return facts
    facts["next_loss"] = next_losses(engine, spec, spec["steps"])
    local = {n: p.detach().clone().contiguous() for n, p in engine.module.named_parameters()}
    local.update({n: b.detach().clone().contiguous() for n, b in engine.module.named_buffers()})
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (TP["rank"], local if dp_rank == 0 else {}))
    if dist.get_rank() == 0:
        shards = {}  # name -> {TP rank: tensor}
        for tp_rank, part in gathered:
            for name, tensor in part.items():
                held = shards.setdefault(name, {})
                if tp_rank in held:  # the tied embedding, on the first and the last stage
                    assert torch.equal(held[tp_rank], tensor), name
                held[tp_rank] = tensor
        full = {}
        for name, held in shards.items():
            dim = 1 if name.endswith("down.weight") else 0 if ".up." in name else None
            ranks = [held[r] for r in sorted(held)]
            if dim is None:  # held whole by every TP rank, alike
                assert all(torch.equal(ranks[0], t) for t in ranks), name
                full[name] = ranks[0]
            else:
                full[name] = torch.cat(ranks, dim=dim).contiguous()
        (out / "ref").mkdir(parents=True, exist_ok=True)
        save_file(full, str(out / "ref" / "full.safetensors"))
    dist.barrier()
    engine.destroy()
    return facts


def resume(spec, out, source, universal):
    config = ds_config(spec)
    if universal is not False:
        config["checkpoint"] = {"load_universal": True}
    load_dir = pathlib.Path(source)
    if universal is True:
        load_dir = out / "universal"
        from ds_train import convert_to_universal

        convert_to_universal(source, load_dir)
    engine = make_engine(spec, config)
    engine.load_checkpoint(str(load_dir))
    assert engine.global_steps == spec["steps"], engine.global_steps
    facts = {"next_loss": next_losses(engine, spec, spec["steps"])}
    engine.destroy()
    return facts


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import ds_train

    ds_train.main(train, resume)
