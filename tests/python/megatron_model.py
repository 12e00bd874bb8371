"""Megatron-Core GPT models on the CPU (local spec: no Transformer Engine, no apex), saved with
Megatron's own dist-ckpt (`torch_dist`).

    torchrun --nproc_per_node 4 megatron_model.py save OUT_DIR SPEC_JSON
        builds the model at the spec's TP x PP (x EP for the MoE layers), gloo, and saves it
        with megatron.core.dist_checkpointing.save (sharded strategy torch_dist).
    torchrun --nproc_per_node 4 megatron_model.py live OUT_DIR SPEC_JSON CONFIG_JSON
        builds the same model and writes, per rank, OUT_DIR/live{rank}.pt: the Hugging Face
        tensors' maps over the model's tensors that reshard.torch.megatron_maps reads from its
        sharded_state_dict() (a map document), the rank's tensors (megatron_shards), and the
        LayoutErrors of a config that does not describe the model and of a key the name table
        does not know. reshard must be importable (PYTHONPATH: the build's python directory).
    torchrun --nproc_per_node 4 megatron_model.py train OUT_DIR SPEC_JSON
        builds the model with Megatron's DistributedOptimizer (Adam), takes SPEC["steps"] steps
        and saves model and optimizer (sharding type SPEC["optim_sharding"]).
    python megatron_model.py optim CKPT_DIR SPEC_JSON OUT_PT
        loads what `train` saved at TP 1 (MoE: under torchrun, at EP = the world size) and
        writes every parameter's fp32 main weight and Adam moments as Megatron holds them.
    python megatron_model.py logits CKPT_DIR SPEC_JSON TOKENS_JSON OUT_PT
        loads the checkpoint into the same model at TP 1 x PP 1 (Megatron reshards on load) and
        writes its logits for the tokens.
    torchrun --nproc_per_node 2 megatron_model.py lora_save OUT_DIR SPEC_JSON TOKENS_JSON
        builds the model at TP SPEC["tp"] with LoRA adapters (SPEC["lora"]) laid out as
        Megatron-Bridge's, saves the weights and the adapters apart (lora_save below) and writes
        each rank's adapter tensors and logits.

Runs in .venv-megatron (megatron-core and its own torch; scripts/dev setup_megatron_venv), not
in the test venv. SPEC_JSON: {"layers", "hidden", "heads", "groups", "ffn", "vocab", "experts",
"moe_ffn", "moe_layers": [layer numbers, 1-based], "tp", "pp", "ep", "qk_norm", "qkv_bias",
"bias" (every linear layer's), "kv_channels", "lora": {"dim", "alpha"},
"tie", "seed"}.
"""

import contextlib
import json
import os
import sys

import torch
import torch.nn.functional as F
from worker_exit import leave


def _config(spec, tp, pp, ep):
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = spec.get("experts", 0)
    layers = spec["layers"]
    kwargs = {}
    if moe:
        # Every layer MoE: homogeneous layers, which dist-ckpt stacks ([L, E, ...]); a list
        # mixes dense and MoE layers, saved one key per layer.
        freq = 1 if len(spec["moe_layers"]) == layers else [
            1 if (i + 1) in spec["moe_layers"] else 0 for i in range(layers)]
        kwargs.update(
            num_moe_experts=moe,
            moe_layer_freq=freq,
            moe_ffn_hidden_size=spec["moe_ffn"],
            moe_router_topk=2,
            moe_token_dispatcher_type="allgather",
            moe_grouped_gemm=False,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=1,
            moe_aux_loss_coeff=0.0,
        )
    return TransformerConfig(
        num_layers=layers,
        hidden_size=spec["hidden"],
        num_attention_heads=spec["heads"],
        num_query_groups=spec["groups"],
        ffn_hidden_size=spec["ffn"],
        kv_channels=spec.get("kv_channels", spec["hidden"] // spec["heads"]),
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        add_bias_linear=spec.get("bias", False),
        add_qkv_bias=spec.get("qkv_bias", False),
        qk_layernorm=spec.get("qk_norm", False),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        use_cpu_initialization=True,
        perform_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        init_method_std=0.2,
        **kwargs,
    )


def _model(spec, config):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )

    if spec.get("experts") and len(spec["moe_layers"]) < spec["layers"]:
        # Dense and MoE layers mixed: a block spec, one layer spec per layer.
        layer_spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization="RMSNorm"
        )
    else:
        layer_spec = get_gpt_layer_local_spec(
            num_experts=spec.get("experts") or None,
            moe_grouped_gemm=False,
            qk_layernorm=spec.get("qk_norm", False),
            normalization="RMSNorm",
        )
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=spec["vocab"],
        max_sequence_length=64,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=spec.get("tie", False),
        position_embedding_type="rope",
        rotary_base=10000,
    )


def _init(tp, pp, ep):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
    )
    # The CUDA RNG tracker is all Megatron's CPU initialisation needs from it; seed it on the CPU.
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    # Megatron's torch_dist writer waits for its device-to-host copies with
    # torch.cuda.synchronize() and agrees on failures through a tensor on
    # torch.cuda.current_device(), which a CPU build of torch refuses: with no device there is
    # nothing to wait for, and the CPU holds the flag (gloo reduces it).
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *args, **kwargs: None
        torch.cuda.current_device = lambda: "cpu"
        # Dropout is off; the forward still enters the CUDA RNG tracker's fork, which has no
        # CUDA state to switch to.
        tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    import numpy

    if not hasattr(numpy, "product"):
        # megatron-core before 0.14 (which still saves flattened ranges) checks them with
        # numpy.product, which numpy 2 renamed numpy.prod.
        numpy.product = numpy.prod
    # megatron-core 0.16.1 names te_general_gemm in its router even when Transformer Engine is
    # absent (it is then never bound); None selects its torch.mm path.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _draw_biases(model):
    """Megatron starts biases at zero, which would hide a bias read from the wrong place: draw
    them, each from its name (and tensor-parallel rank where it is split), so that the ranks
    holding a replicated bias hold the same values."""
    import zlib

    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                split = getattr(p, "tensor_model_parallel", False)
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 7919 * tp_rank * split)
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def save(out_dir, spec):
    from megatron.core import dist_checkpointing

    tp, pp, ep = spec["tp"], spec["pp"], spec.get("ep", 1)
    _init(tp, pp, ep)
    # The same values whatever the layout: every rank draws from the seed, Megatron's CPU
    # initialisation builds the full master weight and keeps its own part.
    torch.manual_seed(spec["seed"])
    model = _model(spec, _config(spec, tp, pp, ep))
    _draw_biases(model)
    sharded = model.sharded_state_dict()
    os.makedirs(out_dir, exist_ok=True)
    dist_checkpointing.save(sharded, out_dir, sharded_strategy=("torch_dist", 1))
    leave()


class _CudaTypeNames:
    """Megatron's DistributedOptimizer sorts the parameters it wraps by their type() name and
    knows only CUDA's ("torch.cuda.FloatTensor"); on the CPU the same fp32 parameter is a
    "torch.FloatTensor". While the optimizer is built, type() answers with the CUDA name."""

    def __enter__(self):
        self.orig = torch.Tensor.type

        def cuda_name(t, *args, **kwargs):
            name = self.orig(t, *args, **kwargs)
            if not args and not kwargs and name.startswith("torch.") and ".cuda." not in name:
                return "torch.cuda." + name[len("torch."):]
            return name

        torch.Tensor.type = cuda_name
        return self

    def __exit__(self, *exc):
        torch.Tensor.type = self.orig


def _cuda_to_cpu():
    """Megatron's optimizers allocate their flags and scales with device="cuda" and move
    state with .cuda(); a CPU build of torch has no such device, and the CPU is where
    everything here lives."""
    if torch.cuda.is_available():
        return

    def on_cpu(fn):
        def call(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return fn(*args, **kwargs)

        return call

    for name in ("tensor", "zeros", "ones", "empty", "full"):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    torch.Tensor.cuda = lambda t, *args, **kwargs: t


def _dist_optimizer(spec, model):
    """Megatron's distributed optimizer (Adam) over `model` wrapped in its DDP, which keeps the
    gradients in flat buffers that each DP rank's optimizer owns a range of."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    _cuda_to_cpu()
    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=False,
                                      overlap_param_gather=False,
                                      bucket_size=spec.get("bucket")),
        model,
    )
    config = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, adam_beta1=0.9,
                             adam_beta2=0.95, adam_eps=1e-8, clip_grad=0.0, bf16=False,
                             fp16=False, params_dtype=torch.float32,
                             use_distributed_optimizer=True)
    with _CudaTypeNames():
        optimizer = get_megatron_optimizer(config, [ddp])
    return ddp, optimizer


def _sharding_metadata(spec):
    return {"distrib_optim_sharding_type": spec.get("optim_sharding", "fully_reshardable")}


def train_save(out_dir, spec):
    """Builds the model with Megatron's distributed optimizer, takes `spec["steps"]` Adam steps
    on gradients each rank draws from the seed for its own parameters (no forward or backward,
    so no pipeline schedule), and saves the model and the optimizer with dist-ckpt in the
    spec's "optim_sharding" format (default fully_reshardable)."""
    from megatron.core import dist_checkpointing

    tp, pp, ep = spec["tp"], spec["pp"], spec.get("ep", 1)
    _init(tp, pp, ep)
    torch.manual_seed(spec["seed"])
    model = _model(spec, _config(spec, tp, pp, ep))
    ddp, optimizer = _dist_optimizer(spec, model)
    for step in range(spec.get("steps", 2)):
        gen = torch.Generator().manual_seed(spec["seed"] * 1000 + step)
        for p in ddp.module.parameters():
            p.main_grad.copy_(torch.randn(p.shape, generator=gen))
        ok, _, _ = optimizer.step()
        assert ok
    model_sd = ddp.module.sharded_state_dict()
    optim_sd = optimizer.sharded_state_dict(model_sd, metadata=_sharding_metadata(spec))

    os.makedirs(out_dir, exist_ok=True)
    dist_checkpointing.save({"model": model_sd, "optimizer": optim_sd}, out_dir,
                            sharded_strategy=("torch_dist", 1))
    leave()


def _prepare_for_load(inner):
    """A DistributedOptimizer made ready to load its state as Megatron's loader expects."""
    # The moments exist once a step was taken: Megatron's own dummy step creates them, to be
    # overwritten by the load (megatron-core before 0.14 has no such step: the same, here).
    if hasattr(inner, "_init_optimizer_states_with_dummy_values"):
        inner._init_optimizer_states_with_dummy_values()
    else:
        for group in inner.optimizer.param_groups:
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        inner.optimizer.step()
        inner.optimizer.zero_grad()
    # torch's Adam (no Transformer Engine or apex here) keeps a per-parameter "step" that the
    # fully_reshardable state does not carry (Megatron keeps the step in param_groups) and that
    # Megatron's setter copies too: it is given the one the state holds already.
    set_states = inner._set_main_param_and_optimizer_states

    def with_step(model_param, tensors):
        g, o = inner.model_param_group_index_map[model_param]
        held = inner.optimizer.state[inner.optimizer.param_groups[g]["params"][o]]
        if "step" in held and "step" not in tensors:
            tensors = dict(tensors, step=held["step"])
        return set_states(model_param, tensors)

    inner._set_main_param_and_optimizer_states = with_step


def optim_state(ckpt_dir, spec, out_path):
    """Loads a checkpoint saved by `train` (model and distributed optimizer) into the same model
    and optimizer built at TP 1 x PP 1 (Megatron reshards on load): in one process, or for an
    MoE model under torchrun at EP = the world size, and writes {"param": ..., "exp_avg": ...,
    "exp_avg_sq": ...}, each {parameter name: tensor at the parameter's shape} with the names
    of the model's state_dict() (experts by their global number), every rank's DP range of it
    put together."""
    from megatron.core import dist_checkpointing

    from megatron.core import parallel_state

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    # MoE models load at EP = the world size (under torchrun): Megatron names the optimizer's
    # keys by its place in the chain of optimizers, which a single process builds otherwise.
    ep = int(os.environ["WORLD_SIZE"])
    _init(1, 1, ep)
    torch.manual_seed(spec["seed"] + 1)
    model = _model(spec, _config(spec, 1, 1, ep))
    ddp, optimizer = _dist_optimizer(spec, model)
    # The experts' parameters have an optimizer of their own in the chain.
    chain = getattr(optimizer, "chained_optimizers", [optimizer])
    for inner in chain:
        _prepare_for_load(inner)
    model_sd = ddp.module.sharded_state_dict()
    optim_sd = optimizer.sharded_state_dict(model_sd, is_loading=True,
                                            metadata=_sharding_metadata(spec))
    state = dist_checkpointing.load({"model": model_sd, "optimizer": optim_sd}, ckpt_dir)
    ddp.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    local = spec.get("experts", 0) // ep
    first = parallel_state.get_expert_model_parallel_rank() * local
    # Each rank's optimizer holds its DP range of each parameter's flat state; all of them
    # together, the whole.
    mine = []
    for name, p in ddp.module.named_parameters():
        if ".local_experts." in name:  # this rank's experts, by their global number
            head, tail = name.split(".local_experts.")
            e, rest = tail.split(".", 1)
            name = f"{head}.local_experts.{first + int(e)}.{rest}"
        for o in chain:
            if p in o.model_param_group_index_map:
                r = o._get_model_param_range_map(p)["param"]
                tensors = o._get_main_param_and_optimizer_states(p)
                mine.append((name, tuple(p.shape), r.start, r.end,
                             {k: tensors[k].detach().clone() for k in ("param", "exp_avg",
                                                                       "exp_avg_sq")}))
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    out = {"param": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, shape, start, end, tensors in (e for rank in every for e in rank):
        for k, t in tensors.items():
            full = out[k].setdefault(name, torch.full(shape, float("nan")))
            full.view(-1)[start:end] = t
    if torch.distributed.get_rank() == 0:
        torch.save(out, out_path)
    leave()


def live(out_dir, spec, config_path):
    import reshard
    import reshard.torch as rt
    from megatron.core.dist_checkpointing import ShardedTensor

    tp, pp, ep = spec["tp"], spec["pp"], spec.get("ep", 1)
    _init(tp, pp, ep)
    rank = torch.distributed.get_rank()
    torch.manual_seed(spec["seed"])
    model = _model(spec, _config(spec, tp, pp, ep))
    config = json.loads(open(config_path).read())
    buffers = rt.megatron_maps(model, config)
    refusals = {}
    try:
        rt.megatron_maps(model, dict(config, intermediate_size=config["intermediate_size"] + 2))
    except reshard.LayoutError as e:
        refusals["config"] = str(e)
    unknown = model.sharded_state_dict()
    unknown["decoder.extra.weight"] = ShardedTensor.from_rank_offsets(
        "decoder.extra.weight", torch.zeros(4), replica_id=rank)
    try:
        rt.megatron_maps(unknown, config)
    except reshard.LayoutError as e:
        refusals["name"] = str(e)
    os.makedirs(out_dir, exist_ok=True)
    torch.save({"maps": buffers.to_json(), "refusals": refusals,
                "shards": {k: v.clone() for k, v in rt.megatron_shards(model).items()}},
               os.path.join(out_dir, f"live{rank}.pt"))
    leave()


def logits(ckpt_dir, spec, tokens, out_path):
    from megatron.core import dist_checkpointing

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    _init(1, 1, 1)
    torch.manual_seed(spec["seed"] + 1)
    model = _model(spec, _config(spec, 1, 1, 1))
    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)
    model.load_state_dict(state)
    model.eval()
    ids = torch.tensor([tokens], dtype=torch.long)
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    # True where attention is masked (Megatron's default mask is built on a CUDA device).
    mask = torch.triu(torch.ones(ids.shape[1], ids.shape[1]), diagonal=1).bool()[None, None]
    with torch.no_grad():
        out = model(ids, pos, attention_mask=mask)
    torch.save({"logits": out.float().contiguous(), "state": {k: v.contiguous() for k, v in
                model.state_dict().items() if isinstance(v, torch.Tensor)}}, out_path)
    leave()


def _with_lora(model, spec):
    """Puts a LoRA adapter (SPEC["lora"]: {"dim", "alpha"}) on every linear layer of the
    decoder, laid out and saved as Megatron-Bridge's LoRALinear / ParallelLinearAdapter lay them
    out (megatron-bridge 0.6.2, megatron/bridge/peft/utils.py): under a column-parallel layer
    (linear_qkv, linear_fc1) linear_in is a ColumnParallelLinear of `dim` outputs gathered
    (A split along r) and linear_out a ColumnParallelLinear left split (B split along its rows);
    under a row-parallel one (linear_proj, linear_fc2) linear_in is a RowParallelLinear taking
    the layer's split input (A split along its columns) and linear_out a ColumnParallelLinear
    gathered (B split along its rows); the adapter's keys are the layer's own plus "adapter.",
    a SwiGLU linear_fc1's linear_out saved through Megatron's SwiGLU factory (gate rows, then
    up rows), and its output, times alpha / dim, is added to the layer's. Megatron-Bridge itself
    needs Transformer Engine and a newer Megatron-Core than runs here; these are Megatron-Core's
    own layers, as the adapter builds them. Both matrices are drawn (Megatron-Bridge starts B at
    zero), so that every element read from the wrong place shows."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    dim, alpha = spec["lora"]["dim"], spec["lora"]["alpha"]

    def init(w):
        return torch.nn.init.normal_(w, std=0.2)

    def wrap(layer, row, swiglu):
        config = layer.config
        adapter = torch.nn.Module()
        if row:
            adapter.linear_in = RowParallelLinear(
                layer.input_size, dim, config=config, init_method=init, bias=False,
                input_is_parallel=True, skip_bias_add=True)
        else:
            adapter.linear_in = ColumnParallelLinear(
                layer.input_size, dim, config=config, init_method=init, bias=False,
                gather_output=True)
        adapter.linear_out = ColumnParallelLinear(
            dim, layer.output_size, config=config, init_method=init, bias=False,
            gather_output=row)
        own_sharded = type(layer).sharded_state_dict
        own_forward = layer.forward
        layer.adapter = adapter

        def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
            del layer._modules["adapter"]
            try:
                out = own_sharded(layer, prefix, sharded_offsets, metadata)
            finally:
                layer._modules["adapter"] = adapter
            out.update(adapter.linear_in.sharded_state_dict(
                f"{prefix}adapter.linear_in.", sharded_offsets, metadata))
            b = adapter.linear_out.sharded_state_dict(
                f"{prefix}adapter.linear_out.", sharded_offsets, metadata)
            if swiglu:
                key = f"{prefix}adapter.linear_out.weight"
                b[key] = apply_swiglu_sharded_factory(b[key], sharded_offsets)
            out.update(b)
            return out

        def forward(x, *args, **kwargs):
            out, bias = own_forward(x, *args, **kwargs)
            a, _ = adapter.linear_in(x)
            b, _ = adapter.linear_out(a)
            return out + b * (alpha / dim), bias

        layer.sharded_state_dict = sharded_state_dict
        layer.forward = forward

    for layer in model.decoder.layers:
        wrap(layer.self_attention.linear_qkv, False, False)
        wrap(layer.self_attention.linear_proj, True, False)
        wrap(layer.mlp.linear_fc1, False, True)
        wrap(layer.mlp.linear_fc2, True, False)
    return model


def _split_adapters(sharded):
    """The model's sharded state dict apart from its adapters', and the adapters' alone as
    Megatron-Bridge's PEFT save keeps them (no _extra_state)."""
    base, adapters = {}, {}
    for k, v in sharded.items():
        if ".adapter." not in k:
            base[k] = v
        elif not k.endswith("_extra_state"):
            adapters[k] = v
    return base, adapters


def lora_save(out_dir, spec, tokens):
    """The model at the spec's TP with adapters: its weights into OUT_DIR/base, the adapters
    alone into OUT_DIR/adapter (as Megatron-Bridge's PEFT save keeps them), and into
    OUT_DIR/dora the adapters with a DoRA magnitude beside linear_qkv's (Megatron-Bridge's
    ParallelLinearDoRAAdapter: "adapter.weight_magnitude", split as the layer's output). Each
    rank writes OUT_DIR/rank{r}.pt: its own adapter tensors and the model's logits for the
    tokens (its part of the vocabulary)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    tp = spec["tp"]
    _init(tp, 1, 1)
    torch.manual_seed(spec["seed"])
    model = _with_lora(_model(spec, _config(spec, tp, 1, 1)), spec)
    base, adapters = _split_adapters(model.sharded_state_dict())
    dirs = [os.path.join(out_dir, d) for d in ("base", "adapter", "dora")]
    for d in dirs:
        os.makedirs(d, exist_ok=True)
    dist_checkpointing.save(base, dirs[0], sharded_strategy=("torch_dist", 1))
    dist_checkpointing.save(adapters, dirs[1], sharded_strategy=("torch_dist", 1))
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    rank = torch.distributed.get_rank()
    key = "decoder.layers.0.self_attention.linear_qkv.adapter.weight_magnitude"
    adapters[key] = ShardedTensor.from_rank_offsets(
        key, torch.ones(qkv.weight.shape[0]), (0, rank, tp), replica_id=0)
    dist_checkpointing.save(adapters, dirs[2], sharded_strategy=("torch_dist", 1))
    model.eval()
    ids = torch.tensor([tokens], dtype=torch.long)
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    # True where attention is masked (Megatron's default mask is built on a CUDA device).
    mask = torch.triu(torch.ones(ids.shape[1], ids.shape[1]), diagonal=1).bool()[None, None]
    with torch.no_grad():
        logits = model(ids, pos, attention_mask=mask)
    torch.save({"logits": logits.float().contiguous(), "adapters": {
        k: v.contiguous() for k, v in model.state_dict().items()
        if ".adapter." in k and isinstance(v, torch.Tensor)}},
        os.path.join(out_dir, f"rank{rank}.pt"))
    leave()


if __name__ == "__main__":
    cmd = sys.argv[1]
    spec = json.loads(open(sys.argv[3]).read())
    if cmd == "save":
        save(sys.argv[2], spec)
    elif cmd == "train":
        train_save(sys.argv[2], spec)
    elif cmd == "optim":
        optim_state(sys.argv[2], spec, sys.argv[4])
    elif cmd == "live":
        live(sys.argv[2], spec, sys.argv[4])
    elif cmd == "lora_save":
        lora_save(sys.argv[2], spec, json.loads(open(sys.argv[4]).read()))
    elif cmd == "logits":
        logits(sys.argv[2], spec, json.loads(open(sys.argv[4]).read()), sys.argv[5])
    else:
        raise SystemExit(f"unknown command {cmd}")
