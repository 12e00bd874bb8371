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
    python megatron_model.py logits CKPT_DIR SPEC_JSON TOKENS_JSON OUT_PT
        loads the checkpoint into the same model at TP 1 x PP 1 (Megatron reshards on load) and
        writes its logits for the tokens.

Runs in .venv-megatron (megatron-core and its own torch; scripts/dev setup_megatron_venv), not
in the test venv. SPEC_JSON: {"layers", "hidden", "heads", "groups", "ffn", "vocab", "experts",
"moe_ffn", "moe_layers": [layer numbers, 1-based], "tp", "pp", "ep", "qk_norm", "qkv_bias",
"bias" (every linear layer's), "kv_channels",
"tie", "seed"}.
"""

import contextlib
import json
import os
import sys

import torch
import torch.nn.functional as F


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
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


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
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


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
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    cmd = sys.argv[1]
    spec = json.loads(open(sys.argv[3]).read())
    if cmd == "save":
        save(sys.argv[2], spec)
    elif cmd == "live":
        live(sys.argv[2], spec, sys.argv[4])
    elif cmd == "logits":
        logits(sys.argv[2], spec, json.loads(open(sys.argv[4]).read()), sys.argv[5])
    else:
        raise SystemExit(f"unknown command {cmd}")
