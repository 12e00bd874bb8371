"""reshard against transformers' own tensor and expert parallelism on mixture-of-experts models.

The toy MoE checkpoints of moe_truth.py (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, GLM-4-MoE,
gpt-oss, Llama-4 and edge cases) are loaded by transformers under torchrun at TP 2 and EP 2, and
each rank's tensors dumped (the `moe_truth` session fixture). Then:

- `reshard scatter DIR --config config.json --tp 2 --distributed-config DC` puts on every rank
  exactly those tensors, bit for bit, under transformers' in-memory names (the per-expert
  checkpoint tensors stacked into `experts.gate_up_proj` / `down_proj` buffers), or refuses
  with exit 1 exactly when transformers fails;
- `gather` gives the per-expert checkpoint back, every tensor byte for byte;
- `convert --tp 2 --distributed-config DC` moves TP 2 -> EP 2 and EP 2 -> TP 2 directly, buffer
  to buffer, and equals transformers' shards at the target.
"""

import json
import os
import subprocess

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from moe_truth import CASES, MODES

TP2 = json.dumps(MODES["tp2"])
EP2 = json.dumps(MODES["ep2"])
MODE_DC = {"tp2": TP2, "ep2": EP2}

# (case, mode) pairs transformers was asked to load in both layouts we compare.
PAIRS = [(name, mode) for name, case in sorted(CASES.items()) for mode in ("tp2", "ep2")
         if mode in case.works]

# bf16 checkpoints whose routers transformers upcasts to float32 at load
# (_keep_in_fp32_modules_strict): reshard keeps the checkpoint's dtype, so these ranks hold the
# same values in bf16. Every other tensor is compared bit for bit.
UPCAST = {"deepseek_v3_bf16": ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")}


def run(*args):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True)


def rank_tensors(out, rank):
    return load_file(str(out / f"model-rank-{rank}-part-0.safetensors"))


def assert_ranks_equal(out, truth, case, mode):
    for rank in range(2):
        ours = rank_tensors(out, rank)
        theirs = truth.tensors(case, mode, rank)
        assert sorted(ours) == sorted(theirs), (case, mode, rank)
        for name, want in theirs.items():
            got = ours[name]
            if name.endswith(UPCAST.get(case, ())) and want.dtype == torch.float32:
                assert got.dtype == torch.bfloat16 and torch.equal(got.float(), want), name
                continue
            assert got.dtype == want.dtype and got.shape == want.shape, (case, mode, rank, name)
            assert torch.equal(got, want), (case, mode, rank, name)


@pytest.fixture(scope="module")
def scattered(moe_truth, reshard_bin, tmp_path_factory):
    """Every (case, mode) scattered by reshard: {(case, mode): (returncode, out dir, stderr)}."""
    root = tmp_path_factory.mktemp("moe_scatter")
    out = {}
    for case, mode in PAIRS:
        ckpt = moe_truth.checkpoint_dir(case)
        target = root / f"{case}.{mode}"
        r = run(reshard_bin, "scatter", ckpt, "--config", ckpt / "config.json", "--tp", 2,
                "--distributed-config", MODE_DC[mode], "-o", target)
        out[(case, mode)] = (r.returncode, target, r.stderr)
    return out


@pytest.mark.parametrize("case,mode", PAIRS)
def test_scatter_puts_on_each_rank_what_transformers_holds(moe_truth, scattered, case, mode):
    rc, out, stderr = scattered[(case, mode)]
    if not moe_truth.works(case, mode):
        assert rc == 1, f"transformers fails {case} at {mode} but reshard scattered it"
        assert not out.exists()
        return
    assert rc == 0, stderr
    assert_ranks_equal(out, moe_truth, case, mode)


@pytest.mark.parametrize("case,mode", [p for p in PAIRS if CASES[p[0]].works.get(p[1])])
def test_scatter_writes_the_same_bytes_through_memory(moe_truth, scattered, reshard_bin, tmp_path,
                                                     case, mode):
    # The scatter above had the file system copy the whole experts (EP) and row halves (TP);
    # RESHARD_COPY_FILE_RANGE=0 sends every byte through memory: the same files.
    rc, out, stderr = scattered[(case, mode)]
    assert rc == 0, stderr
    ckpt = moe_truth.checkpoint_dir(case)
    again = tmp_path / "through_memory"
    r = subprocess.run([str(a) for a in (reshard_bin, "scatter", ckpt, "--config",
                                         ckpt / "config.json", "--tp", 2, "--distributed-config",
                                         MODE_DC[mode], "--json", "-o", again)],
                       capture_output=True, text=True, check=False,
                       env={**os.environ, "RESHARD_COPY_FILE_RANGE": "0"})
    assert r.returncode == 0, r.stderr
    assert all(p["bytes_copied"] == 0 for p in json.loads(r.stdout)["processes"])
    assert sorted(p.name for p in again.iterdir()) == sorted(p.name for p in out.iterdir())
    for p in out.iterdir():
        assert p.read_bytes() == (again / p.name).read_bytes(), (case, mode, p.name)


@pytest.mark.parametrize("case,mode", [p for p in PAIRS if CASES[p[0]].works.get(p[1])])
def test_gather_gives_the_per_expert_checkpoint_back(moe_truth, scattered, reshard_bin, tmp_path,
                                                     case, mode):
    rc, out, stderr = scattered[(case, mode)]
    assert rc == 0, stderr
    r = run(reshard_bin, "gather", out, "-o", tmp_path / "full")
    assert r.returncode == 0, r.stderr
    original = moe_truth.checkpoint_dir(case) / "model.safetensors"
    gathered = tmp_path / "full" / "model.safetensors"
    with safe_open(str(original), "pt") as a, safe_open(str(gathered), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for name in a.keys():
            x, y = a.get_tensor(name), b.get_tensor(name)
            assert x.dtype == y.dtype and x.shape == y.shape
            assert x.contiguous().view(torch.uint8).equal(y.contiguous().view(torch.uint8)), name


CONVERTIBLE = [name for name, case in sorted(CASES.items())
               if case.works.get("tp2") and case.works.get("ep2")]


@pytest.mark.parametrize("case", CONVERTIBLE)
@pytest.mark.parametrize("source,target", [("tp2", "ep2"), ("ep2", "tp2")])
def test_convert_moves_between_tp_and_ep_directly(moe_truth, scattered, reshard_bin, tmp_path,
                                                  case, source, target):
    rc, out, stderr = scattered[(case, source)]
    assert rc == 0, stderr
    converted = tmp_path / "converted"
    r = run(reshard_bin, "convert", out, "--tp", 2, "--distributed-config", MODE_DC[target],
            "-o", converted)
    assert r.returncode == 0, r.stderr
    assert_ranks_equal(converted, moe_truth, case, target)


def test_convert_refuses_what_transformers_refuses(moe_truth, scattered, reshard_bin, tmp_path):
    rc, out, stderr = scattered[("qwen3_moe_3_experts", "tp2")]
    assert rc == 0, stderr
    r = run(reshard_bin, "convert", out, "--tp", 2, "--distributed-config", EP2, "-o",
            tmp_path / "x")
    assert r.returncode == 1 and "3 experts" in r.stderr, r.stderr
    assert not (tmp_path / "x").exists()
    # --distributed-config and --target-maps are two ways to say the target: one at a time.
    r = run(reshard_bin, "convert", out, "--tp", 2, "--distributed-config", EP2,
            "--target-maps", tmp_path / "none.json", "-o", tmp_path / "y")
    assert r.returncode == 2


def test_optimizer_states_stack_and_move_with_their_parameters(moe_truth, reshard_bin, tmp_path):
    """Adam's moments ("<param>.exp_avg", ".exp_avg_sq") of per-expert tensors stack into
    buffers of the same suffix, laid out as their parameters, through scatter, TP -> EP convert
    and gather."""
    from safetensors.torch import save_file
    source = moe_truth.checkpoint_dir("mixtral")
    weights = load_file(str(source / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    states = dict(weights)
    for name, t in weights.items():
        for suffix in (".exp_avg", ".exp_avg_sq"):
            states[name + suffix] = torch.randn(t.shape, generator=g).to(t.dtype)
    full = tmp_path / "full"
    full.mkdir()
    save_file(states, str(full / "model.safetensors"))
    (full / "config.json").write_text((source / "config.json").read_text())
    tp = tmp_path / "tp2"
    r = run(reshard_bin, "scatter", full, "--config", full / "config.json", "--tp", 2, "-o", tp)
    assert r.returncode == 0, r.stderr
    ep = tmp_path / "ep2"
    r = run(reshard_bin, "convert", tp, "--tp", 2, "--distributed-config", EP2, "-o", ep)
    assert r.returncode == 0, r.stderr
    stacked = "model.layers.0.mlp.experts.gate_up_proj"
    for rank in range(2):
        held = rank_tensors(ep, rank)
        # The weights are what transformers holds at EP 2; each moment stacks the same way.
        assert torch.equal(held[stacked], moe_truth.tensors("mixtral", "ep2", rank)[stacked])
        for suffix in (".exp_avg", ".exp_avg_sq"):
            want = torch.stack([torch.cat([
                states[f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight{suffix}"],
                states[f"model.layers.0.block_sparse_moe.experts.{e}.w3.weight{suffix}"]])
                for e in (2 * rank, 2 * rank + 1)])
            assert torch.equal(held[stacked + suffix], want), (rank, suffix)
    manifest = json.loads((ep / "reshard.json").read_text())
    assert manifest["params"]["model.layers.0.block_sparse_moe.experts.1.w1.weight.exp_avg_sq"][
        "scale_power"] == -2
    back = tmp_path / "back"
    r = run(reshard_bin, "gather", ep, "-o", back)
    assert r.returncode == 0, r.stderr
    gathered = load_file(str(back / "model.safetensors"))
    assert sorted(gathered) == sorted(states)
    assert all(torch.equal(gathered[n], states[n]) for n in states)
