"""Fixtures of the vLLM tests (run with the vLLM venv's python, see docs/vllm.md): toy models
written by transformers, engines with a small KV cache, the reshard CLI.

The reshard package comes from RESHARD_BUILD_DIR/python when that is set (a CMake build), else
from the environment (CI installs it into the vLLM venv)."""

import contextlib
import os
import pathlib
import subprocess
import sys

import pytest

if os.environ.get("RESHARD_BUILD_DIR"):
    sys.path.insert(0, str(pathlib.Path(os.environ["RESHARD_BUILD_DIR"]).resolve() / "python"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

# vLLM on CPU: worker threads not pinned (TP 2 on a small machine), the engine core in the test
# process (one process start fewer), and the layout cache kept out of the home directory.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

PROMPTS = [[1, 5, 9, 33, 77], [2, 200, 3], [7, 7, 7, 7, 7, 7, 7, 7, 7, 249]]
NEW_TOKENS = 8


def _write_llama(out):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    # Vocabulary 250 (not a multiple of 64: vLLM pads it), one key/value head (replicated at
    # TP 2), head_dim 32 (the CPU attention's minimum).
    config = LlamaConfig(vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         max_position_embeddings=256, tie_word_embeddings=False)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out)
    return out


def _write_qwen3_moe(out):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(1)
    config = Qwen3MoeConfig(vocab_size=250, hidden_size=64, intermediate_size=96,
                            moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=32, num_experts=4,
                            num_experts_per_tok=2, max_position_embeddings=256,
                            tie_word_embeddings=False, norm_topk_prob=True)
    Qwen3MoeForCausalLM(config).to(torch.float32).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def toy_llama(tmp_path_factory):
    return _write_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def toy_moe(tmp_path_factory):
    return _write_qwen3_moe(tmp_path_factory.mktemp("qwen3_moe"))


@pytest.fixture(scope="session", autouse=True)
def layout_cache(tmp_path_factory):
    """Layouts are cached in a directory of the session's own."""
    path = tmp_path_factory.mktemp("layout-cache")
    old = os.environ.get("RESHARD_CACHE_DIR")
    os.environ["RESHARD_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("RESHARD_CACHE_DIR", None)
    else:
        os.environ["RESHARD_CACHE_DIR"] = old


def hf_tensors(model_dir):
    from safetensors.torch import load_file
    return load_file(str(pathlib.Path(model_dir) / "model.safetensors"))


def transformers_tokens(model_dir):
    """Greedy continuations of PROMPTS by transformers (the reference)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    out = []
    for p in PROMPTS:
        ids = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False)
        out.append(ids[0, len(p):].tolist())
    return out


@contextlib.contextmanager
def engine(model_dir, tp, **kwargs):
    """A vLLM engine on the CPU with a small KV cache; shut down on exit."""
    from vllm import LLM
    llm = LLM(model=str(model_dir), tensor_parallel_size=tp, enforce_eager=True,
              dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=32 << 20,
              max_model_len=128, max_num_seqs=4, **kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm


def greedy(llm):
    from vllm import SamplingParams
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def run_reshard(*args):
    """The reshard CLI (`python -m reshard`, the package's own binary)."""
    return subprocess.run([sys.executable, "-m", "reshard", *map(str, args)], check=True,
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
