"""reshard against transformers' own tensor parallelism.

Toy models (2 layers, hidden 64, seeded random weights) of the architectures the plan registry
covers are saved with `save_pretrained`. One `torchrun --nproc_per_node 2` launch (gloo, CPU,
loopback) loads every one with `from_pretrained(dir, tp_plan="auto")` and dumps each rank's
local tensors (tp_load_worker.py). Then:

- `reshard scatter DIR --config DIR/config.json --tp 2` must put on every rank exactly those
  tensors, bit for bit, under the same names (the names transformers gives them when it loads,
  such as Mixtral's `block_sparse_moe` -> `mlp`; per-expert MoE tensors stacked into
  `experts.gate_up_proj` / `down_proj`), or refuse with exit 1 naming a conversion transformers
  applies to that checkpoint at load which reshard does not express (fused projections split).
  test_moe_reshard.py checks MoE models at EP 2 too.
- `reshard degree CONFIG --tp 2` must say "works" (exit 0) exactly when transformers loads the
  model and runs a forward pass at TP 2, and refuse (exit 1) when it does not.
"""

import dataclasses
import json
import re
import subprocess

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tp_load_worker import launch

TP = 2
SEED = 20260601

# Every toy model starts from this (the keys its config class has); token ids stay inside the
# vocabulary. The expert keys are the names the MoE config classes use.
TOY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=128,
           pad_token_id=0, bos_token_id=1, eos_token_id=2, num_experts=4, num_local_experts=4,
           n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=32)


@dataclasses.dataclass(frozen=True)
class Case:
    model_type: str
    overrides: dict = dataclasses.field(default_factory=dict)
    works: bool = True  # transformers loads it and runs a forward pass at TP 2
    dtype: str = "float32"  # the checkpoint's dtype
    max_shard_size: str | None = None  # save in several files with an index


# Every model type of the registry with a causal-LM class that transformers instantiates at toy
# size and serves at TP 2. Left out: those that fail at toy size even on one rank (axk1, axk2,
# codegen, gptj, deepseek_v2, deepseek_v3, glm4_moe_lite, longcat_flash, minicpm3, sarvam_mla,
# youtu: head and rotary sizes the toy config breaks), and doge, sarvam_moe and inkling_text,
# which run on one rank but fail inside transformers at TP 2 whatever the head counts.
ARCHITECTURES = {name: Case(name) for name in (
    "afmoe", "apertus", "apertus1p5_text", "arcee", "aria_text", "bailing_hybrid", "bamba",
    "beam", "cohere", "cohere2", "cohere2_moe", "cwm", "deepseek_v4", "diffllama", "dory",
    "ernie4_5", "ernie4_5_moe", "exaone", "exaone4", "exaone_moe", "falcon_h1", "flex_olmo",
    "flint", "gemma", "gemma2", "gemma3_text", "gemma4_unified_text", "glm", "glm4", "glm4_moe",
    "gpt_neox", "gpt_oss", "granite", "granite_swa", "granitemoe", "granitemoe_swa",
    "granitemoehybrid", "granitemoeshared", "helium", "hrm_text", "hunyuan_v1_dense",
    "hunyuan_v1_moe", "hy_v3", "hyperclovax", "internlm3", "iquestcoder", "jais2", "jamba",
    "kimi_linear", "kolibri1", "laguna", "lara_mini", "lfm2", "lfm3", "llama", "llama4_text",
    "mellum", "mimo_v2_flash", "minimax", "minimax_m2", "minimax_m3_vl_text", "ministral",
    "ministral3", "mistral", "mixtral", "nanochat", "nemotron", "nemotron_h", "olmo", "olmo2",
    "olmo3", "olmo_hybrid", "olmoe", "phi", "phi3", "phimoe", "qwen2", "qwen2_moe", "qwen3",
    "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next", "qwen4_exp_text",
    "seed_oss", "smollm3", "solar_open", "starcoder2", "vaultgemma")}

# Degrees at the edge: heads must divide the degree; the vocabulary and the intermediate size
# need not (transformers gives the last rank a shorter slice).
DEGREE_CASES = {
    "llama_3_heads": Case("llama", dict(hidden_size=48, num_attention_heads=3,
                                        num_key_value_heads=3), works=False),
    "llama_1_kv_head": Case("llama", dict(num_key_value_heads=1), works=False),
    "llama_vocab_251": Case("llama", dict(vocab_size=251)),
    "llama_intermediate_129": Case("llama", dict(intermediate_size=129)),
}

# Checkpoint forms: bf16 in seven files with an index (transformers keeps the dtype, "auto").
CHECKPOINT_CASES = {
    "llama_bf16_sharded": Case("llama", dtype="bfloat16", max_shard_size="40KB"),
}

CASES = {**ARCHITECTURES, **DEGREE_CASES, **CHECKPOINT_CASES}
WORKING = sorted(name for name, case in CASES.items() if case.works)


def build_toy_model(case, seed, out_dir):
    """Save a toy model of `case` with seeded random weights (every parameter, norms too). Of
    the TOY keys, the config gets those its class knows, so config.json reads like a real one."""
    from transformers import AutoConfig, AutoModelForCausalLM

    known = AutoConfig.for_model(case.model_type)
    keys = known.to_dict().keys() | known.attribute_map.keys()
    toy = {k: v for k, v in TOY.items() if k in keys}
    config = AutoConfig.for_model(case.model_type, **{**toy, **case.overrides})
    model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    model.to(getattr(torch, case.dtype)).save_pretrained(
        out_dir, **({"max_shard_size": case.max_shard_size} if case.max_shard_size else {}))


class TransformersRun:
    """What transformers put on each rank, per case (the worker's output)."""

    def __init__(self, models, dumps):
        self.models = models
        self.dumps = dumps

    def model_dir(self, name):
        return self.models / name

    def statuses(self, name):
        return [json.loads((self.dumps / name / f"rank-{r}.json").read_text()) for r in range(TP)]

    def works(self, name):
        return all(s["loaded"] and s["forward"] for s in self.statuses(name))

    def tensors(self, name, rank):
        return load_file(str(self.dumps / name / f"rank-{rank}.safetensors"))


@pytest.fixture(scope="module")
def transformers_tp(tmp_path_factory):
    root = tmp_path_factory.mktemp("transformers_tp")
    models = root / "models"
    for i, (name, case) in enumerate(sorted(CASES.items())):
        build_toy_model(case, SEED + i, models / name)
    dumps = launch([{"name": n, "dir": str(models / n)} for n in sorted(CASES)], root, TP)
    return TransformersRun(models, dumps)


def load_conversions(config):
    """What transformers does to this model's checkpoint names at load: the plain key renames,
    as (pattern, replacement) pairs, and the converters (which fuse, split or stack tensors),
    as (source globs, target names) pairs. Like transformers, a mapping registered for the model
    class wins over the model type's."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    transforms = None
    for key in (*config.get("architectures", ()), config["model_type"]):
        transforms = transforms or get_checkpoint_conversion_mapping(key)
    transforms = transforms or []
    renames = [(src, dst) for t in transforms if type(t) is WeightRenaming
               for src, dst in zip(t.source_patterns, t.target_patterns)]
    converters = [(t.source_patterns, t.target_patterns) for t in transforms
                  if isinstance(t, WeightConverter)]
    return renames, converters


def converted_targets(names, converters):
    """The targets of the converters that consume any of the checkpoint tensors `names` (a
    source glob's `*` stands for any text, as in transformers)."""
    return sorted({target.strip(".") for sources, targets in converters
                   if any(re.search(src.replace("*", ".*"), n) for src in sources for n in names)
                   for target in targets})


def reshard_rank_tensors(sharded_dir, rank, renames=()):
    """Rank `rank`'s tensors in a reshard sharded directory, under the names transformers gives
    them."""
    manifest = json.loads((sharded_dir / "reshard.json").read_text())
    out = {}
    for file in manifest["files"][str(rank)]:
        for name, tensor in load_file(str(sharded_dir / file)).items():
            for pattern, replacement in renames:
                name = re.sub(pattern, replacement, name)
            out[name] = tensor
    return out


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def rank_differences(expected, actual):
    """Every way `actual` (reshard's tensors of one rank) differs from `expected`
    (transformers' tensors of that rank), one line each; empty when they agree bit for bit."""
    lines = [f"{n}: transformers holds {tuple(expected[n].shape)} {expected[n].dtype}, "
             f"reshard nothing" for n in sorted(expected.keys() - actual.keys())]
    lines += [f"{n}: reshard holds {tuple(actual[n].shape)}, transformers nothing"
              for n in sorted(actual.keys() - expected.keys())]
    for n in sorted(expected.keys() & actual.keys()):
        e, a = expected[n], actual[n]
        if e.dtype != a.dtype or e.shape != a.shape:
            lines.append(f"{n}: transformers holds {tuple(e.shape)} {e.dtype}, "
                         f"reshard {tuple(a.shape)} {a.dtype}")
        elif not same_bits(e, a):
            flat_e, flat_a = e.reshape(-1), a.reshape(-1)
            first = int((flat_e.view(torch.uint8) != flat_a.view(torch.uint8)).nonzero()[0])
            first //= e.element_size()
            lines.append(f"{n}: element {first} differs: transformers {flat_e[first].item()}, "
                         f"reshard {flat_a[first].item()}")
    return lines


def reshard(reshard_bin, *args):
    return subprocess.run([reshard_bin, *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def scatter_problems(name, transformers_tp, reshard_bin, out):
    """How `reshard scatter --config` of case `name` at TP 2 into `out` strays from what
    transformers put on the ranks, one line each; empty when every rank holds transformers'
    tensors bit for bit, or when reshard refuses (exit 1, nothing written) naming a conversion
    transformers applies to this checkpoint at load that reshard does not express (per-expert
    MoE tensors stacked into experts.gate_up_proj / down_proj it does express, as buffers)."""
    model_dir = transformers_tp.model_dir(name)
    _, converters = load_conversions(json.loads((model_dir / "config.json").read_text()))
    names = []
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            names += f.keys()
    converted = converted_targets(names, converters)
    r = reshard(reshard_bin, "scatter", model_dir, "--config", model_dir / "config.json",
                "--tp", TP, "-o", out)
    if r.returncode != 0:
        # Per-expert tensors stacked at load are laid out (buffers); only other conversions
        # (fused projections split at load) are refused.
        refusal_allowed = (r.returncode == 1 and not out.exists() and
                           "converts it when it loads" in r.stderr and
                           any(target in r.stderr for target in converted))
        return [] if refusal_allowed else [
            f"scatter exit {r.returncode} (transformers converts at load: {converted or 'nothing'})"
            f": {r.stderr.strip()}"]
    return [f"rank {rank}: {line}" for rank in range(TP)
            for line in rank_differences(transformers_tp.tensors(name, rank),
                                         reshard_rank_tensors(out, rank))]


def degree_problem(name, transformers_tp, reshard_bin):
    """Why `reshard degree` of case `name` at TP 2 disagrees with whether transformers loads and
    runs it, or None when they agree."""
    statuses = transformers_tp.statuses(name)
    works = transformers_tp.works(name)
    r = reshard(reshard_bin, "degree", transformers_tp.model_dir(name) / "config.json",
                "--tp", TP)
    if r.returncode == (0 if works else 1):
        return None
    return (f"transformers {'serves' if works else 'fails'} at tp {TP} "
            f"({[s['error'] for s in statuses]}); reshard degree exit {r.returncode}: {r.stderr}")


@pytest.mark.parametrize("name", WORKING)
def test_scatter_matches_transformers_or_refuses_its_load_conversion(name, transformers_tp,
                                                                     reshard_bin, tmp_path):
    assert transformers_tp.works(name), transformers_tp.statuses(name)
    problems = scatter_problems(name, transformers_tp, reshard_bin, tmp_path / "sharded")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", sorted(CASES))
def test_degree_verdict_matches_what_transformers_does(name, transformers_tp, reshard_bin):
    statuses = transformers_tp.statuses(name)
    # The case table says what transformers does; a new release that changes it shows here.
    assert transformers_tp.works(name) == CASES[name].works, statuses
    if not CASES[name].works:
        assert all(s["loaded"] for s in statuses), statuses  # it fails in the forward pass
    problem = degree_problem(name, transformers_tp, reshard_bin)
    assert problem is None, problem


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if not c.works))
def test_scatter_refuses_a_degree_transformers_cannot_run(name, transformers_tp, reshard_bin,
                                                         tmp_path):
    model_dir = transformers_tp.model_dir(name)
    r = reshard(reshard_bin, "scatter", model_dir, "--config", model_dir / "config.json",
                "--tp", TP, "-o", tmp_path / "sharded")
    assert r.returncode == 1, r.stderr
    assert not (tmp_path / "sharded").exists()


def test_rank_differences_names_each_kind_of_difference():
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = a.clone()
    b[1, 2] = 7.0
    assert rank_differences({"w": a}, {"w": a.clone()}) == []
    assert rank_differences({"w": a}, {"w": b}) == ["w: element 5 differs: transformers 5.0, "
                                                    "reshard 7.0"]
    assert rank_differences({"w": a}, {"w": a[:1]}) == [
        "w: transformers holds (2, 3) torch.float32, reshard (1, 3) torch.float32"]
    assert rank_differences({"w": a}, {}) == ["w: transformers holds (2, 3) torch.float32, "
                                              "reshard nothing"]
    assert rank_differences({}, {"w": a}) == ["w: reshard holds (2, 3), transformers nothing"]
    # -0.0 == 0.0 numerically, but not bit for bit.
    assert rank_differences({"z": torch.zeros(2)}, {"z": -torch.zeros(2)}) != []


def test_converted_targets_follow_transformers_conversion_mapping():
    mixtral = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}
    renames, converters = load_conversions(mixtral)
    assert (".block_sparse_moe.", ".mlp.") in renames
    names = ["model.layers.0.block_sparse_moe.experts.3.w1.weight", "model.norm.weight"]
    assert converted_targets(names, converters) == ["experts.gate_up_proj"]
    assert converted_targets(["model.norm.weight"], converters) == []
    # A mapping registered for the class wins over the model type's.
    neox_renames, _ = load_conversions({"model_type": "gpt_neox",
                                        "architectures": ["GPTNeoXForCausalLM"]})
    assert neox_renames == [(r"^embed_out\.", "lm_head.")]
    assert load_conversions({"model_type": "llama"}) == ([], [])
