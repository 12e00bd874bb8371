"""An executable spec of docs/moe.md: what each rank holds when transformers loads a
mixture-of-experts checkpoint at TP 2 and at EP 2, predicted from the checkpoint with plain torch
and compared bit for bit with what transformers itself put on the ranks (moe_truth.py).

The prediction has two steps, as docs/moe.md's tables do: the checkpoint's tensors become the
tensors transformers holds in memory (per-expert tensors stacked, gate then up; Mixtral's
`block_sparse_moe` renamed `mlp`), then each of those is cut by the rule of its family and mode
(first matching rule wins; no rule: every rank holds it whole).
"""

import re

import pytest
import torch
from safetensors.torch import load_file

from moe_truth import CASES, WORLD

# Which stacking transformers applies at load (conversion_mapping.py), by model type.
PER_EXPERT = {  # model type -> (experts module, gate name, up name, down name)
    "mixtral": ("mlp.experts", "w1", "w3", "w2"),
    "qwen2_moe": ("mlp.experts", "gate_proj", "up_proj", "down_proj"),
    "qwen3_moe": ("mlp.experts", "gate_proj", "up_proj", "down_proj"),
    "deepseek_v3": ("mlp.experts", "gate_proj", "up_proj", "down_proj"),
    "glm4_moe": ("mlp.experts", "gate_proj", "up_proj", "down_proj"),
}
STORED_FUSED = {"gpt_oss", "llama4_text"}  # the checkpoint holds [E, H, 2I] as transformers does
# Held in float32 whatever the checkpoint's dtype (_keep_in_fp32_modules_strict): the router.
KEEP_FP32 = {"deepseek_v3": r"mlp\.gate\.(weight|e_score_correction_bias)$",
             "glm4_moe": r"mlp\.gate\.(weight|e_score_correction_bias)$"}

# How a tensor is cut across the ranks.
#   whole        every rank holds all of it
#   dim0 / dim1 / last   torch.chunk over the ranks on that dimension (ceil chunks)
#   gate_up_rows [E, 2I, H]: gate rows [0, I) and up rows [I, 2I) each chunked on dim 1, the
#                rank's gate piece then its up piece (transformers' _StridedShard(dim=1, sf=2))
#   gate_up_last [E, H, 2I]: the same on the last dim (Llama-4's packed_rowwise)
#   experts      torch.chunk on dim 0: rank k holds experts [k E/p, (k+1) E/p)
ATTENTION_TP = [
    (r"self_attn\.[qkv]_proj\.(weight|bias)$", "dim0"),
    (r"self_attn\.o_proj\.weight$", "last"),
]
DENSE_MLP_TP = [  # a dense layer's MLP, and DeepSeek-V3 / GLM-4-MoE's shared experts
    (r"mlp\.(shared_experts\.)?(gate|up)_proj\.weight$", "dim0"),
    (r"mlp\.(shared_experts\.)?down_proj\.weight$", "last"),
]
VOCAB_TP = [(r"^model\.embed_tokens\.weight$", "dim0"), (r"^lm_head\.weight$", "dim0")]
EXPERTS_TP = [(r"experts\.gate_up_proj$", "gate_up_rows"), (r"experts\.down_proj$", "last")]
EXPERTS_EP = [(r"experts\.(gate_up_proj|down_proj)(_bias)?$", "experts")]

TP_RULES = {
    "mixtral": ATTENTION_TP + EXPERTS_TP + VOCAB_TP,
    # the shared expert (singular) has no plan entry: replicated
    "qwen2_moe": ATTENTION_TP + EXPERTS_TP + DENSE_MLP_TP + VOCAB_TP,
    "qwen3_moe": ATTENTION_TP + EXPERTS_TP + DENSE_MLP_TP + VOCAB_TP,
    # multi-head latent attention has no plan entry: replicated
    "deepseek_v3": EXPERTS_TP + DENSE_MLP_TP + VOCAB_TP,
    "glm4_moe": ATTENTION_TP + EXPERTS_TP + DENSE_MLP_TP + VOCAB_TP,
    # only the vocabulary is split; attention, experts, biases and router replicated
    "gpt_oss": VOCAB_TP,
    "llama4_text": ATTENTION_TP + [
        (r"feed_forward\.shared_expert\.(gate|up)_proj\.weight$", "dim0"),
        (r"feed_forward\.shared_expert\.down_proj\.weight$", "last"),
        (r"feed_forward\.experts\.gate_up_proj$", "gate_up_last"),
        (r"feed_forward\.experts\.down_proj$", "dim1"),
    ] + VOCAB_TP,
}


def ep_rules(model_type):
    """EP 2 = DistributedConfig(tp_plan="auto", ep_size=2): the expert tensors are split by
    expert, the EP rules replacing the TP rules on the experts; the rest keeps the TP plan."""
    tp = [(pattern, how) for pattern, how in TP_RULES[model_type] if "experts\\." not in pattern
          or "shared_expert" in pattern]
    return EXPERTS_EP + tp


def rules(model_type, mode):
    return TP_RULES[model_type] if mode == "tp2" else ep_rules(model_type)


def memory_tensors(checkpoint, model_type):
    """The checkpoint's tensors under the names and shapes transformers holds after loading."""
    out = {}
    experts = {}  # (prefix, expert, part) -> tensor
    for name, tensor in checkpoint.items():
        if model_type == "mixtral":
            name = name.replace(".block_sparse_moe.", ".mlp.")
        m = None
        if model_type in PER_EXPERT:
            module, *parts = PER_EXPERT[model_type]
            m = re.fullmatch(rf"(.*\.{re.escape(module)})\.(\d+)\.({'|'.join(parts)})\.weight",
                             name)
        if m:
            experts[m[1], int(m[2]), m[3]] = tensor
        elif model_type in KEEP_FP32 and re.search(KEEP_FP32[model_type], name):
            out[name] = tensor.float()
        else:
            out[name] = tensor
    if experts:
        _, gate, up, down = PER_EXPERT[model_type]
        for prefix in sorted({p for p, _, _ in experts}):
            count = 1 + max(e for p, e, _ in experts if p == prefix)
            out[f"{prefix}.gate_up_proj"] = torch.stack(
                [torch.cat([experts[prefix, e, gate], experts[prefix, e, up]]) for e in
                 range(count)])
            out[f"{prefix}.down_proj"] = torch.stack(
                [experts[prefix, e, down] for e in range(count)])
    return out


def cut(tensor, how, rank, world=WORLD):
    if how == "whole":
        return tensor
    if how in ("dim0", "dim1", "last", "experts"):
        dim = {"dim0": 0, "dim1": 1, "last": -1, "experts": 0}[how]
        return tensor.chunk(world, dim)[rank]
    dim = 1 if how == "gate_up_rows" else -1
    gate, up = tensor.chunk(2, dim)
    return torch.cat([gate.chunk(world, dim)[rank], up.chunk(world, dim)[rank]], dim)


def expected_rank_tensors(checkpoint, model_type, mode, rank):
    out = {}
    for name, tensor in memory_tensors(checkpoint, model_type).items():
        how = next((h for pattern, h in rules(model_type, mode) if re.search(pattern, name)),
                   "whole")
        out[name] = cut(tensor, how, rank).contiguous()
    return out


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def checkpoint_of(moe_truth, name):
    out = {}
    for file in sorted(moe_truth.checkpoint_dir(name).glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


WORKING = sorted((name, mode) for name, case in CASES.items()
                 for mode, works in case.works.items() if works and mode in ("tp2", "ep2"))


@pytest.mark.parametrize("name,mode", [(n, m) for n, m in WORKING
                                       if CASES[n].model_type in TP_RULES])
def test_every_rank_holds_what_docs_moe_md_says(name, mode, moe_truth):
    assert moe_truth.works(name, mode), moe_truth.statuses(name, mode)
    model_type = CASES[name].model_type
    checkpoint = checkpoint_of(moe_truth, name)
    for rank in range(WORLD):
        expected = expected_rank_tensors(checkpoint, model_type, mode, rank)
        actual = moe_truth.tensors(name, mode, rank)
        assert sorted(expected) == sorted(actual), (rank, set(expected) ^ set(actual))
        wrong = [f"{n}: expected {tuple(expected[n].shape)}, transformers holds "
                 f"{tuple(actual[n].shape)}" for n in sorted(expected)
                 if not same_bits(expected[n], actual[n])]
        assert not wrong, f"rank {rank}:\n" + "\n".join(wrong)


@pytest.mark.parametrize("name,mode", sorted((n, m) for n, c in CASES.items()
                                             for m, works in c.works.items() if not works))
def test_transformers_refuses_what_the_case_table_says(name, mode, moe_truth):
    statuses = moe_truth.statuses(name, mode)
    assert not moe_truth.works(name, mode), statuses
    assert all(s["error"] for s in statuses), statuses


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items()
                                      if c.works.get("ep2") and c.model_type in PER_EXPERT))
def test_ep_rank_k_holds_experts_k_e_over_p_gate_rows_then_up_rows(name, moe_truth):
    # The sentence of docs/moe.md, checked directly on the per-expert checkpoint.
    model_type = CASES[name].model_type
    checkpoint = checkpoint_of(moe_truth, name)
    module, gate, up, down = PER_EXPERT[model_type]
    layer = max(int(m[1]) for n in checkpoint
                if (m := re.search(rf"layers\.(\d+)\..*experts\.\d+\.{gate}\.", n)))
    stored = "block_sparse_moe.experts" if model_type == "mixtral" else module
    prefix = f"model.layers.{layer}.{stored}"
    count = len({n for n in checkpoint if n.startswith(prefix) and n.endswith(f".{gate}.weight")})
    for k in range(WORLD):
        held = moe_truth.tensors(name, "ep2", k)[f"model.layers.{layer}.{module}.gate_up_proj"]
        block = range(k * count // WORLD, (k + 1) * count // WORLD)
        want = torch.stack([torch.cat([checkpoint[f"{prefix}.{e}.{gate}.weight"],
                                       checkpoint[f"{prefix}.{e}.{up}.weight"]])
                            for e in block])
        assert same_bits(want, held), (name, k)


# The same prediction for every case, MoE families beyond the seven above included, from what
# transformers declares rather than from the tables: the checkpoint conversions of
# conversion_mapping.py (renamings, and per-expert tensors stacked with MergeModulelist(dim=0),
# gate and up joined with Concatenate(dim=1)) and the model's resolved plans (model.tp_plan /
# model.ep_plan, matched as transformers matches them: the parameter, or its module), each style
# cutting as docs/moe.md's style table says.


def declared_conversions(model_type):
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    transforms = (get_checkpoint_conversion_mapping(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
                  or get_checkpoint_conversion_mapping(model_type) or [])
    renames, stacks = [], []
    for t in transforms:
        if type(t) is WeightRenaming:
            renames += zip(t.source_patterns, t.target_patterns)
        elif isinstance(t, WeightConverter):
            ops = [(type(o).__name__, getattr(o, "dim", None)) for o in t.operations]
            assert ops in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]), (
                f"{model_type}: a conversion the spec does not model: {t}")
            stacks.append((t.source_patterns, t.target_patterns[0]))
    return renames, stacks


def declared_memory_tensors(checkpoint, model_type):
    renames, stacks = declared_conversions(model_type)
    out, parts = {}, {}  # parts: target -> {expert: [tensor per source]}
    for name, tensor in checkpoint.items():
        for pattern, replacement in renames:
            name = re.sub(pattern, replacement, name)
        for sources, target in stacks:
            hits = [(i, m) for i, s in enumerate(sources)
                    if (m := re.search(s.replace("*", r"(\d+)"), name))]
            if hits:
                i, m = hits[0]
                slots = parts.setdefault(name[:m.start()] + target, {})
                slots.setdefault(int(m[1]), [None] * len(sources))[i] = tensor
                break
        else:
            out[name] = tensor
    for target, experts in parts.items():
        out[target.replace("..", ".")] = torch.stack(
            [torch.cat(experts[e]) for e in range(len(experts))])
    return out


def resolved_plans(model_dir, mode):
    """The model's TP and EP plans as transformers resolves them for `mode`: EP rules replace
    the TP rules on their modules and the modules' children."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    tp, ep = dict(model.tp_plan), dict(model.ep_plan) if mode == "ep2" else {}
    tp = {k: v for k, v in tp.items() if not any(k == e or k.startswith(e + ".") for e in ep)}
    strict = getattr(type(model), "_keep_in_fp32_modules_strict", None) or []
    return {**tp, **ep}, strict


def style_of(name, plan):
    generic = re.sub(r"\.\d+(\.|$)", r".*\1", name)
    return plan.get(generic) or plan.get(generic.rsplit(".", 1)[0])


def cut_by_style(tensor, style, name, rank, world=WORLD):
    nd = tensor.dim()
    if style in ("colwise", "colwise_gather_output", "colwise_rep"):
        return tensor.chunk(world, nd - 2 if nd > 1 else 0)[rank]
    if style in ("rowwise", "rowwise_split_input", "rowwise_rep"):
        return tensor if name.endswith(".bias") else tensor.chunk(world, -1)[rank]
    if style in ("embedding_rowwise", "grouped_gemm"):
        return tensor.chunk(world, 0)[rank]
    if style == "embedding_colwise":
        return tensor.chunk(world, 1)[rank]
    if style == "packed_colwise":
        return tensor.chunk(world, -1)[rank] if nd == 1 else cut(tensor, "gate_up_rows", rank)
    if style == "packed_rowwise":
        return tensor if nd == 1 else cut(tensor, "gate_up_last", rank)
    return tensor


@pytest.mark.parametrize("name,mode", WORKING)
def test_every_rank_holds_what_the_declared_plan_and_conversions_say(name, mode, moe_truth):
    assert moe_truth.works(name, mode), moe_truth.statuses(name, mode)
    model_type = CASES[name].model_type
    memory = declared_memory_tensors(checkpoint_of(moe_truth, name), model_type)
    plan, strict_fp32 = resolved_plans(moe_truth.checkpoint_dir(name), mode)
    for rank in range(WORLD):
        actual = moe_truth.tensors(name, mode, rank)
        assert sorted(memory) == sorted(actual), (rank, set(memory) ^ set(actual))
        wrong = []
        for n, full in memory.items():
            if any(m in n for m in strict_fp32):
                full = full.float()
            want = cut_by_style(full, style_of(n, plan), n, rank).contiguous()
            if not same_bits(want, actual[n]):
                wrong.append(f"{n} ({style_of(n, plan)}): expected {tuple(want.shape)}, "
                             f"transformers holds {tuple(actual[n].shape)}")
        assert not wrong, f"rank {rank}:\n" + "\n".join(wrong)


@pytest.mark.parametrize("mode", sorted(m for m, works in CASES["mixtral"].works.items()
                                        if works and m.startswith("ep2_")))
def test_every_way_of_asking_for_ep_gives_the_same_shards(mode, moe_truth):
    assert moe_truth.works("mixtral", mode), moe_truth.statuses("mixtral", mode)
    for rank in range(WORLD):
        ep2, other = (moe_truth.tensors("mixtral", m, rank) for m in ("ep2", mode))
        assert sorted(ep2) == sorted(other)
        assert all(same_bits(ep2[n], other[n]) for n in ep2), mode
