"""Toy models for the vLLM tests and benchmarks: small transformers checkpoints written to a
directory, with weights drawn from a seed (A, B, ... are the same model with other weights)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import traceback
from typing import Any, Callable, Optional

import torch

# Biases on the attention and MLP projections: vLLM keeps a bias live through a reload
# (it is not put on the meta device as the weights are), and a row-parallel layer's bias is
# whole on every worker.
LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64,
             intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, vocab_size=250, max_position_embeddings=256,
             rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="float32",
             attention_bias=True, mlp_bias=True, bos_token_id=1, eos_token_id=2)


# Qwen3-MoE: four experts, two per token; the intermediate size of an expert at TP 2 (16) is
# not a multiple of the CPU MoE kernel's alignment, so vLLM pads it when it repacks.
QWEN3_MOE = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=64,
                 intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
                 num_experts_per_tok=2, norm_topk_prob=True, vocab_size=250,
                 max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
                 torch_dtype="float32", bos_token_id=1, eos_token_id=2)


def llama_config(**overrides: Any) -> dict[str, Any]:
    return {**LLAMA, **overrides}


def qwen3_moe_config(**overrides: Any) -> dict[str, Any]:
    return {**QWEN3_MOE, **overrides}


def _model(config: dict[str, Any]) -> Any:
    import transformers
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in config.items()
                                               if k not in ("architectures", "torch_dtype")})
    cfg.architectures = config["architectures"]
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def _draw(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Every tensor re-drawn from ``seed``, larger than transformers' init, so that different
    seeds give different greedy tokens."""
    out = {}
    g = torch.Generator().manual_seed(seed)
    for name, t in state.items():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            out[name] = 1 + 0.1 * torch.randn(t.shape, generator=g)
        else:
            out[name] = 0.08 * torch.randn(t.shape, generator=g)
    return out


def weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """The model's tensors under transformers' names, drawn from ``seed``."""
    torch.manual_seed(seed)
    return _draw(_model(config).state_dict(), seed)


def write(model_dir: str, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save_file
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(model_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": config["bos_token_id"],
                   "eos_token_id": config["eos_token_id"]}, f)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
    return model_dir


def write_pretrained(model_dir: str, config: dict[str, Any], seed: int) -> str:
    """The model with weights drawn from ``seed``, saved by transformers' ``save_pretrained``
    (which writes a checkpoint's own names, such as an MoE model's per-expert tensors)."""
    torch.manual_seed(seed)
    model = _model(config)
    model.load_state_dict(_draw(model.state_dict(), seed))
    model.save_pretrained(model_dir)
    return model_dir


def greedy_of_dir(model_dir: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, ``n`` tokens, of a saved model."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return _generate(model, prompts, n)


def _generate(model: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy decoding by hand: the argmax every step, end-of-sequence tokens included (as
    vLLM's ``ignore_eos`` gives; transformers' ``min_new_tokens`` would mask them instead)."""
    model.eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            for _ in range(n):
                ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], 1)
            out.append(ids[0, len(p):].tolist())
    return out


def greedy(config: dict[str, Any], tensors: dict[str, torch.Tensor],
           prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, ``n`` tokens."""
    model = _model(config)
    model.load_state_dict(tensors)
    return _generate(model, prompts, n)


def llama_a_and_b(root: str, tps: tuple[int, ...], prompts: list[list[int]],
                  n: int) -> dict[str, Any]:
    """The toy Llama with weights A (seed 1) and B (seed 2), each scattered by reshard at every
    degree of ``tps`` (keys "A", "B" for TP 2, "A1", "B1" for TP 1, ...), and transformers'
    greedy tokens for each."""
    import reshard
    config = llama_config()
    tensors_of = {"A": weights(config, 1), "B": weights(config, 2)}
    sharded = {}
    for key, tensors in tensors_of.items():
        full = write(os.path.join(root, key), config, tensors)
        for tp in tps:
            out = os.path.join(root, f"{key}-tp{tp}")
            reshard.checkpoint.scatter(full, out, config=os.path.join(full, "config.json"), tp=tp)
            sharded[key if tp == 2 else f"{key}{tp}"] = out
    expected = {k: greedy(config, t, prompts, n) for k, t in tensors_of.items()}
    assert expected["A"] != expected["B"]  # the pushes can be told apart
    return {"root": root, "model": os.path.join(root, "A"), "sharded": sharded,
            "expected": expected}


def fail_processing_once(worker: Any, rank: int, module: str) -> bool:
    """(``LLM.collective_rpc``) On the engine's worker of tensor-parallel rank ``rank``, the
    next post-load processing of the layer ``module`` raises. Whether this worker is it."""
    import torch.distributed as dist
    if (dist.get_rank() if dist.is_initialized() else 0) != rank:
        return False
    method = worker.get_model().get_submodule(module).quant_method

    def fail(layer: Any) -> None:
        del method.process_weights_after_loading  # once
        raise RuntimeError("post-load processing fails on purpose")
    method.process_weights_after_loading = fail
    return True


def corrupt_before_verify_once(worker: Any, rank: int, name: str) -> bool:
    """(``LLM.collective_rpc``) On the engine's worker of tensor-parallel rank ``rank``, the next
    verify of a push that received ``name`` finds its element 0 with one bit flipped (as if the
    tensor had been altered behind the sync's back). Whether this worker is it."""
    import torch
    import torch.distributed as dist
    from reshard.distributed import Redistributor
    if (dist.get_rank() if dist.is_initialized() else 0) != rank:
        return False
    original = Redistributor.verify

    def verify(self: Any, out: Any = None, shards: Any = None, **kw: Any) -> Any:
        if out and name in out:
            Redistributor.verify = original  # type: ignore[method-assign]  # once
            out[name].view(-1)[:1].view(torch.uint8)[0] ^= 1
        return original(self, out, shards, **kw)
    Redistributor.verify = verify  # type: ignore[method-assign]
    return True


def corrupt_served(worker: Any, rank: int, name: str) -> bool:
    """(``LLM.collective_rpc``) On the engine's worker of tensor-parallel rank ``rank``, element
    0 of the parameter ``name`` it serves gets one bit flipped, behind the sync's back. Whether
    this worker is it."""
    import torch
    import torch.distributed as dist
    if (dist.get_rank() if dist.is_initialized() else 0) != rank:
        return False
    module, _, attr = name.rpartition(".")
    t = getattr(worker.get_model().get_submodule(module), attr)
    with torch.no_grad():
        t.data.view(-1)[:1].view(torch.uint8)[0] ^= 1
    return True


def die_at_first_exchange(worker: Any) -> bool:
    """(``LLM.collective_rpc``) The engine's worker 0 dies by SIGKILL at its next exchange of
    bytes with the sync's group (an engine lost in the middle of a push). Whether this worker
    is it."""
    import torch.distributed as dist
    from reshard.vllm._group import StoreGroup
    if (dist.get_rank() if dist.is_initialized() else 0) != 0:
        return False

    def die(self: Any, sends: Any, receives: Any) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)
    StoreGroup.exchange = die  # type: ignore[method-assign]
    return True


def run_processes(script: str, spec: str, n: int, env: dict[str, str], logs: list[Any],
                  timeout_s: float, python: str = sys.executable) -> list[Optional[int]]:
    """``python SCRIPT SPEC RANK`` for ranks 0 .. n-1, each in a session of its own, output to
    ``logs``; waited for up to ``timeout_s``, then they and whatever they started (an
    engine's processes) are killed. Their exit codes (None: killed at the timeout)."""
    procs = [subprocess.Popen([python, script, spec, str(r)], env=env,
                              stdout=open(logs[r], "w"), stderr=subprocess.STDOUT,
                              start_new_session=True) for r in range(n)]
    codes: list[Optional[int]] = []
    try:
        for p in procs:
            p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            codes.append(p.poll())
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    return codes


def trainer_main(run: Callable[[dict[str, Any], int], None]) -> None:
    """A trainer script's entry point: ``run(spec, rank)`` with SIGUSR1 dumping every thread's
    stack (a stuck test's), exiting 1 on any exception and skipping interpreter teardown (the
    engine's threads and the process group)."""
    import faulthandler
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        with open(sys.argv[1]) as f:
            run(json.load(f), int(sys.argv[2]))
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


def plugin_path(tmp_path: Any) -> list[str]:
    """Where vLLM's processes find the reshard backend's entry point: the installed package's
    own (CI), else, for the package of a CMake build (RESHARD_BUILD_DIR), a distribution that
    holds only that entry point."""
    import importlib.metadata
    group = importlib.metadata.entry_points(group="vllm.general_plugins")
    if any(e.value.startswith("reshard.") for e in group):
        return []
    info = tmp_path / "plugin" / "reshard_build-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: reshard-build\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nreshard = reshard.vllm.plugin:register\n")
    return [str(tmp_path / "plugin")]


def fail_adapter_staging_once(worker: Any, rank: int) -> bool:
    """(``LLM.collective_rpc``) On the engine's worker of tensor-parallel rank ``rank``, the next
    adapter push fails as the worker stages the adapter (after every byte has arrived). Whether
    this worker is it."""
    import torch.distributed as dist
    from reshard.vllm import _lora
    if (dist.get_rank() if dist.is_initialized() else 0) != rank:
        return False
    original = _lora.stage

    def stage(*args: Any, **kwargs: Any) -> Any:
        _lora.stage = original  # once
        raise RuntimeError("staging fails on purpose")
    _lora.stage = stage
    return True


def adapter_ids(worker: Any) -> list[int]:
    """(``LLM.collective_rpc``) The ids of the LoRA adapters the worker holds."""
    return sorted(worker.model_runner.lora_manager.list_adapters())


def adamw_bf16_steps(model_dir: str, config: dict[str, Any], steps: int, lr: float,
                     seed: int) -> Any:
    """Trains the saved model ``steps`` AdamW steps (fp32 master weights, weight decay 0.01,
    next-token loss on random tokens drawn from ``seed``; alike in every process that asks),
    yielding after each step its weights as bf16 (what a bf16 trainer pushes) and the fraction
    of the bf16 elements that changed in that step (1.0 for the first: every element of the
    weights the model had before, as bf16, is compared with what it holds after)."""
    from safetensors.torch import load_file
    model = _model(config)
    model.load_state_dict(load_file(os.path.join(model_dir, "model.safetensors")))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    before = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    for _ in range(steps):
        ids = torch.randint(3, config["vocab_size"], (4, 16), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        now = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
        changed = sum(int((now[n].view(torch.int16) != before[n].view(torch.int16)).sum())
                      for n in now) / sum(t.numel() for t in now.values())
        before = now
        yield now, changed


def served_digest(worker: Any) -> dict[str, str]:
    """(``LLM.collective_rpc``) A digest (SHA-256 of the bytes) of every parameter and buffer
    the worker serves, by name: equal between two workers' states exactly when they hold the
    same bits. A vocabulary-parallel layer's padding rows (past the vocabulary its shard holds:
    never read, and left as the fresh tensor had them) are left out."""
    import hashlib
    out = {}
    for module_name, module in worker.get_model().named_modules():
        indices = getattr(module, "shard_indices", None)
        for name, t in [*module.named_parameters(recurse=False),
                        *module.named_buffers(recurse=False)]:
            if indices is not None and t.dim() > 0 and \
                    t.shape[0] == indices.num_org_elements_padded:
                t = t[:indices.num_org_elements]
            data = t.detach().contiguous().view(-1).view(torch.uint8)
            key = f"{module_name}.{name}" if module_name else name
            out[key] = hashlib.sha256(data.cpu().numpy().tobytes()).hexdigest()
    return out


def alter_delta_copy(worker: Any, rank: int) -> bool:
    """(``LLM.collective_rpc``) On the engine's worker of tensor-parallel rank ``rank``, one bit
    flipped in each of the first 64 words of the first chunk it keeps from the last delta push
    (the copy the next delta is applied to: the worker's state altered behind the sync's back;
    64 words, so that the next delta's changes cannot cover them all). Whether this worker is
    it and held such a chunk."""
    import torch.distributed as dist
    if (dist.get_rank() if dist.is_initialized() else 0) != rank:
        return False
    engine = worker.weight_transfer_engine
    for stage in engine._stages:
        kept = getattr(stage.redistributor, "_delta_base", None) or {}
        for key in sorted(k for k in kept if k[0] == "recv"):
            kept[key][1:128:2] ^= 1
            return True
    return False


def adamw_pushes(spec: dict[str, Any], step: dict[str, Any], llm: Any, sync: Any,
                 maps: dict[str, Any], rank: int, generate: Callable[[], Any],
                 then: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """A trainer process's part of ``step["steps"]`` AdamW steps of the toy Llama from weights
    ``spec["full"]["A"]`` (``adamw_bf16_steps``, learning rate ``step["lr"]``), each step's bf16
    weights cut to this process's shards by ``maps`` and pushed with ``delta=True,
    verify=True``; before the push of step ``step["alter_at"]`` (if given) the delta copy of
    worker ``step["alter_worker"]`` of process ``step["alter_process"]``'s engine is altered
    (``alter_delta_copy``). After every push, on a process owning an engine (``llm``), the
    digest of every worker's served state; after the last, its greedy tokens and transformers'
    for the weights it should serve. Then each step's weights (only the last step's with
    ``step["compare_every"]`` false) are pushed again whole (``delta=False``) and the digests
    compared with the delta push's: per step, the names of the tensors that differ on some
    worker. Returns ``{"changed", "sent", "errors", "step_tokens", "expected", "differ"}``, a
    list each (``changed``, ``sent`` and ``errors`` one entry a step; ``step_tokens`` and
    ``expected`` the last step's, ``differ`` one entry a step compared; the last three empty
    without an engine);
    afterwards the engines serve the shards ``then`` if given (pushed whole)."""
    import torch.distributed as dist

    import reshard
    config = llama_config()
    out: dict[str, list[Any]] = {k: [] for k in ("changed", "sent", "errors", "step_tokens",
                                                  "expected", "differ")}
    served, digests = [], []  # per step: the weights the engines should serve, their digests
    trained = adamw_bf16_steps(spec["full"]["A"], config, step["steps"], step["lr"],
                               step.get("seed", 0))
    for k, (weights, changed) in enumerate(trained):
        # The engines run float32: the bf16 weights travel widened, exactly (a changed bf16
        # element is one changed 16-bit word, as it would be in bf16).
        shards = {n: reshard.extract(maps[n], w.float(), rank) for n, w in weights.items()}
        if k == step.get("alter_at"):
            if rank == step["alter_process"]:
                hit = llm.collective_rpc(alter_delta_copy, args=(step["alter_worker"],))
                assert sum(hit) == 1, hit
            dist.barrier()
        out["changed"].append(changed)
        try:
            stats = sync.push(shards, delta=True, verify=True)
            out["sent"].append(stats.bytes_sent_here)
            out["errors"].append(None)
            served.append(shards)
        except Exception as e:  # WeightSyncError: recorded for the test to judge
            out["sent"].append(None)
            out["errors"].append(str(e))
            served.append(served[-1] if served else None)
        if llm is not None:
            digests.append(llm.collective_rpc(served_digest))
            if k == step["steps"] - 1 and served[-1] is shards:
                out["step_tokens"].append(generate())
                full = {n: w.float() for n, w in weights.items()}
                out["expected"].append(greedy(config, full, spec["prompts"],
                                              spec["new_tokens"]))
    compared = served if step.get("compare_every", True) else served[-1:]
    for k, shards in enumerate(compared, len(served) - len(compared)):
        if shards is None:  # what a full push of the same weights leaves
            continue
        sync.push(shards)
        if llm is not None:
            full = llm.collective_rpc(served_digest)
            out["differ"].append(sorted({n for d, f in zip(digests[k], full) for n in f
                                         if d.get(n) != f[n]}))
    if then is not None:
        sync.push(then)
    return out


# LoRA adapters in PEFT's format for the toy Llama: rank 8 on every projection of attention and
# MLP, A and B drawn from a seed (larger than PEFT's init, which leaves B zero), so that two
# adapters, and an adapter and the base model, give different greedy tokens.
LORA_R, LORA_ALPHA = 8, 16
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_CONFIG = {"peft_type": "LORA", "r": LORA_R, "lora_alpha": LORA_ALPHA,
               "target_modules": LORA_TARGETS, "bias": "none", "use_rslora": False,
               "use_dora": False, "fan_in_fan_out": False, "task_type": "CAUSAL_LM",
               "modules_to_save": None}


def lora_adapter(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """A PEFT adapter's tensors (its saved names) with A and B drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    h, i = config["hidden_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    out = {}
    for layer in range(config["num_hidden_layers"]):
        for module in LORA_TARGETS:
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            stem = f"base_model.model.model.layers.{layer}.{part}.{module}"
            fan_in, fan_out = dims[module]
            out[f"{stem}.lora_A.weight"] = 0.2 * torch.randn(LORA_R, fan_in, generator=g)
            out[f"{stem}.lora_B.weight"] = 0.2 * torch.randn(fan_out, LORA_R, generator=g)
    return out


def main_python() -> str:
    """The Python that computes PEFT's reference tokens: RESHARD_MAIN_PYTHON, else the main
    venv's (PEFT and transformers, no vLLM), else, where there is none (a GPU machine), this
    one if it has PEFT."""
    import importlib.util
    here = os.path.dirname(os.path.abspath(__file__))
    python = os.path.join(os.path.dirname(os.path.dirname(here)), ".venv", "bin", "python")
    if "RESHARD_MAIN_PYTHON" in os.environ:
        python = os.environ["RESHARD_MAIN_PYTHON"]
    elif not os.path.exists(python) and importlib.util.find_spec("peft") is not None:
        return sys.executable
    assert os.path.exists(python), (
        f"{python} is missing: scripts/dev test installs PEFT there, or point "
        "RESHARD_MAIN_PYTHON at a Python that has PEFT and transformers")
    return python


def peft_adapters(root: str, base: str, config: dict[str, Any], seeds: dict[str, int],
                  prompts: list[list[int]], n: int) -> dict[str, Any]:
    """The adapters drawn from ``seeds`` ({key: seed}) for the model saved in ``base``, each
    written as a PEFT directory under ``root``, and PEFT's greedy tokens of the model with
    each (peft_reference.py in the main venv; "base": without an adapter). Returns
    ``{"adapters": {key: tensors}, "dirs": {key: dir}, "expected": {key: tokens}}``."""
    from safetensors.torch import save_file
    adapters, dirs = {}, {}
    for key, seed in seeds.items():
        adapters[key] = lora_adapter(config, seed)
        d = os.path.join(root, f"adapter-{key}")
        os.makedirs(d)
        save_file(adapters[key], os.path.join(d, "adapter_model.safetensors"))
        with open(os.path.join(d, "adapter_config.json"), "w") as f:
            json.dump({**LORA_CONFIG, "base_model_name_or_path": base}, f)
        dirs[key] = d
    spec, out = os.path.join(root, "reference.json"), os.path.join(root, "tokens.json")
    with open(spec, "w") as f:
        json.dump({"base": base, "adapters": dirs, "prompts": prompts, "new_tokens": n,
                   "out": out}, f)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([main_python(), os.path.join(here, "peft_reference.py"), spec],
                          env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(out) as f:
        expected = json.load(f)
    # The adapters, and the base model, can be told apart by their tokens.
    assert len({json.dumps(expected[k]) for k in ("base", *seeds)}) == len(seeds) + 1
    return {"adapters": adapters, "dirs": dirs, "expected": expected}
