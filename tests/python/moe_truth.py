"""What transformers puts on each rank when it loads a mixture-of-experts model at TP 2 and EP 2.

Toy checkpoints (2 layers, hidden 64, 4 experts, seeded random weights) of the MoE families
docs/moe.md describes are saved with `save_pretrained`; one `torchrun --nproc_per_node 2`
launch (gloo, CPU, loopback) loads every one in every mode with `from_pretrained(dir,
distributed_config=DistributedConfig(...))` and dumps each rank's local tensors
(tp_load_worker.py). The session fixture `moe_truth` gives, per (case, mode), the saved full
checkpoint and the per-rank dumps:

    def test_x(moe_truth):
        run = moe_truth
        run.checkpoint_dir("mixtral")             # save_pretrained's output
        run.works("mixtral", "ep2")               # loaded and ran a forward pass on every rank
        run.tensors("mixtral", "ep2", rank=1)     # {name: tensor} as transformers holds them
        run.statuses("mixtral", "ep2")            # per rank: loaded, forward, error, placements

Run alone (`python moe_truth.py OUT_DIR`) it builds and loads everything into OUT_DIR and prints
each case's verdicts, which is how the facts in docs/moe.md were read.
"""

import dataclasses
import json
import pathlib
import sys

import pytest

WORLD = 2
SEED = 20260620

# The distributed configs transformers 5.24 is asked for, by mode (WORLD processes each).
MODES = {
    # tensor parallelism over both ranks: the model's base_model_tp_plan
    "tp2": {"tp_plan": "auto"},
    # expert parallelism over both ranks; the dense modules keep the TP plan
    "ep2": {"tp_plan": "auto", "ep_size": 2},
    # the same layout asked for by sizes, and by the deprecated flag next to tp_plan "auto"
    "ep2_sizes": {"tp_size": 2, "ep_size": 2},
    "ep2_flag_auto": {"tp_plan": "auto", "enable_expert_parallel": True},
    # the deprecated flag: ep_size = tp_size and tp_plan = {}, which tp_size 2 refuses
    "ep2_legacy": {"tp_size": 2, "enable_expert_parallel": True},
    # ep_size alone: tp_size stays 1, and ep_size must divide fsdp_size * tp_size
    "ep2_alone": {"ep_size": 2},
}

# Every toy model starts from this; the keys a config class does not know are left out.
TOY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=128,
           pad_token_id=0, bos_token_id=1, eos_token_id=2, num_experts=4, num_local_experts=4,
           n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=32)

# DeepSeek-V3 and GLM-4-MoE: one dense layer then one MoE layer (first_k_dense_replace), one
# expert group, one shared expert; DeepSeek-V3's multi-head latent attention at toy ranks.
_GROUPS = dict(first_k_dense_replace=1, n_group=1, topk_group=1, n_shared_experts=1)
_MLA = dict(q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16)


@dataclasses.dataclass(frozen=True)
class Case:
    model_type: str
    overrides: dict = dataclasses.field(default_factory=dict)
    # mode -> whether transformers loads it and runs a forward pass (what the test expects);
    # the modes a case is loaded in
    works: dict = dataclasses.field(default_factory=lambda: {"tp2": True, "ep2": True})
    dtype: str = "float32"  # the checkpoint's (transformers loads with dtype="auto")


MODELS = {
    "mixtral": Case("mixtral", works={"tp2": True, "ep2": True, "ep2_sizes": True,
                                      "ep2_flag_auto": True, "ep2_legacy": False,
                                      "ep2_alone": False}),
    "qwen2_moe": Case("qwen2_moe"),
    "qwen3_moe": Case("qwen3_moe"),
    "deepseek_v3": Case("deepseek_v3", {**_GROUPS, **_MLA}),
    "glm4_moe": Case("glm4_moe", _GROUPS),
    "gpt_oss": Case("gpt_oss"),
    # no base_model_ep_plan: EP is refused
    "llama4_text": Case("llama4_text", works={"tp2": True, "ep2": False}),
}

# More families, each with a layout the seven above do not show (docs/moe.md, "Other
# families"); test_moe_truth.py checks them against the plans and conversions transformers
# declares.
MORE_MODELS = {name: Case(name) for name in (
    "afmoe", "aria_text", "ernie4_5_moe", "exaone_moe", "granitemoe", "granitemoeshared",
    "hy_v3", "jamba", "minimax", "minimax_m3_vl_text", "nemotron_h", "olmoe", "phimoe",
    "qwen3_5_moe_text", "qwen3_next")}


def experts(n):
    """An expert count under every name the MoE config classes use (their attribute maps
    alias some of them, and the last one given wins)."""
    return dict(num_experts=n, num_local_experts=n, n_routed_experts=n)


# Expert counts and widths at the edge of what the degree allows.
EDGE_CASES = {
    # "Cannot evenly shard 3 experts across 2 expert-parallel ranks."
    "qwen3_moe_3_experts": Case("qwen3_moe", experts(3), works={"tp2": True, "ep2": False}),
    "mixtral_3_experts": Case("mixtral", experts(3), works={"tp2": True, "ep2": False}),
    "gpt_oss_3_experts": Case("gpt_oss", experts(3), works={"tp2": True, "ep2": False}),
    "qwen3_moe_6_experts": Case("qwen3_moe", experts(6)),
    # bf16 checkpoints: the routers of DeepSeek-V3 / GLM-4-MoE and gpt-oss's norms are held in
    # float32 (_keep_in_fp32_modules)
    "deepseek_v3_bf16": Case("deepseek_v3", {**_GROUPS, **_MLA}, dtype="bfloat16"),
    "gpt_oss_bf16": Case("gpt_oss", dtype="bfloat16"),
    # 18 float32 columns per rank: grouped_mm's "strides should be multiple of 16 bytes"
    # (both ranks fail alike, so neither waits on the other); whole experts at EP 2 run
    "qwen3_moe_intermediate_36": Case("qwen3_moe", dict(moe_intermediate_size=36),
                                      works={"tp2": False, "ep2": True}),
}

CASES = {**MODELS, **MORE_MODELS, **EDGE_CASES}


def build_toy_model(case, seed, out_dir):
    """Save a toy model of `case` with seeded random weights (every parameter, norms too)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    known = AutoConfig.for_model(case.model_type)
    keys = known.to_dict().keys() | known.attribute_map.keys()
    toy = {k: v for k, v in TOY.items() if k in keys}
    config = AutoConfig.for_model(case.model_type, **{**toy, **case.overrides})
    assert all(getattr(config, k) == v for k, v in case.overrides.items() if k in keys), case
    model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a persistent buffer a checkpoint holds
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.05)
    model.to(getattr(torch, case.dtype)).save_pretrained(out_dir)


class MoeTruth:
    """What transformers put on each rank, per (case, mode)."""

    def __init__(self, models, dumps):
        self.models = models
        self.dumps = dumps

    def checkpoint_dir(self, name):
        return self.models / name

    def config(self, name):
        return json.loads((self.models / name / "config.json").read_text())

    def dump_dir(self, name, mode):
        return self.dumps / f"{name}.{mode}"

    def statuses(self, name, mode):
        return [json.loads((self.dump_dir(name, mode) / f"rank-{r}.json").read_text())
                for r in range(WORLD)]

    def works(self, name, mode):
        return all(s["loaded"] and s["forward"] for s in self.statuses(name, mode))

    def tensors(self, name, mode, rank):
        from safetensors.torch import load_file  # imported here: conftest imports this module

        return load_file(str(self.dump_dir(name, mode) / f"rank-{rank}.safetensors"))


def run_transformers(root):
    """Build every case under root/models and load each in every mode in one launch."""
    models, dumps = root / "models", root / "dumps"
    for i, (name, case) in enumerate(sorted(CASES.items())):
        build_toy_model(case, SEED + i, models / name)
    cases = [{"name": f"{name}.{mode}", "dir": str(models / name),
              "distributed_config": MODES[mode]}
             for name, case in sorted(CASES.items()) for mode in case.works]
    from tp_load_worker import launch  # imported here: conftest imports this module

    launch(cases, root, WORLD)
    return MoeTruth(models, dumps)


@pytest.fixture(scope="session")
def moe_truth(tmp_path_factory):
    """Made once per run: pytest-xdist workers share it (the first to ask makes it)."""
    import filelock  # imported here: conftest imports this module

    from ds_checkpoints import shared_tmp_dir

    root = shared_tmp_dir(tmp_path_factory, "moe_truth")
    root.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(root) + ".lock"):
        if (root / "done").exists():
            return MoeTruth(root / "models", root / "dumps")
        truth = run_transformers(root)
        (root / "done").write_text("")
        return truth


def main():
    root = pathlib.Path(sys.argv[1])
    run = run_transformers(root)
    for name, case in sorted(CASES.items()):
        for mode in case.works:
            statuses = run.statuses(name, mode)
            print(f"{name} {mode}: works={run.works(name, mode)} "
                  f"errors={[s['error'] for s in statuses]}")
            if statuses[0].get("placements"):
                for tensor, placement in statuses[0]["placements"].items():
                    if ".layers.0." in tensor or ".layers." not in tensor or (
                            ".layers.1." in tensor and "mlp" in tensor):
                        print(f"    {tensor}: {placement}")


if __name__ == "__main__":
    main()
