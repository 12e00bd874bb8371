"""reshard gather / convert / inspect on real DeepSpeed training checkpoints (ds_checkpoints.py).

The checkpoints are the CI matrix of test_deepspeed_checkpoints.py (the session fixture trains
each spec once, whichever module asks first): TP 2 x DP 2 at ZeRO 0-3, TP 4 x DP 1 with an
uneven vocabulary, TP 1 x DP 3 with ZeRO's padding; fp32 and bf16.

- gather: the Hugging Face safetensors equal the model's full weights as the training run held
  them, bit for bit and dtype for dtype; config.json is copied.
- gather --fp32: equal to DeepSpeed's own consolidation (deepspeed.utils.zero_to_fp32) where it
  has one (TP 1), and rounded to the module's dtype equal to the module's weights everywhere.
- convert --tp M, then gather: the same weights; the optimizer states equal what DeepSpeed's
  ds_to_universal merges. A TP-1 checkpoint (no layouts recorded) takes its maps from the
  save dir's config.json (the model's transformers plan), or from --target-maps.
- bad inputs: each a clear error naming the file, exit 2, nothing written (gather, convert --tp,
  convert --to universal, inspect).
"""

import json
import re
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from ds_checkpoints import Spec, ds_to_universal
from test_deepspeed_checkpoints import CI_SPECS

# The same checkpoints as test_deepspeed_checkpoints.py (trained once per session).
SPECS = CI_SPECS
IDS = [s.name for s in SPECS]


@pytest.fixture(scope="module")
def checkpoints(ds_checkpoint):
    ds_checkpoint.prepare(SPECS)
    return ds_checkpoint


def run(*args):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=300)


def bits(t):
    return t.contiguous().view(torch.uint8) if t.dtype != torch.bool else t


def assert_same(got, want):
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(bits(got[name]), bits(t)), name


def gather(reshard_bin, src, out, *flags):
    r = run(reshard_bin, "gather", src, "-o", out, *flags)
    assert r.returncode == 0, r.stderr
    return load_file(str(out / "model.safetensors"))


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_gather_gives_the_models_full_weights(checkpoints, spec, tmp_path, reshard_bin):
    ckpt = checkpoints(spec)
    got = gather(reshard_bin, ckpt.save_dir, tmp_path / "hf")
    assert_same(got, ckpt.full())
    assert (tmp_path / "hf" / "config.json").read_bytes() == (
        ckpt.save_dir / "config.json").read_bytes()
    # The tag dir reads the same (its config.json is the save dir's, one level up).
    assert_same(gather(reshard_bin, ckpt.tag_dir, tmp_path / "from_tag"), ckpt.full())


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_fp32_master_weights(checkpoints, spec, tmp_path, reshard_bin):
    ckpt = checkpoints(spec)
    master = gather(reshard_bin, ckpt.save_dir, tmp_path / "fp32", "--fp32")
    assert all(t.dtype == torch.float32 for t in master.values())
    dtype = getattr(torch, spec.dtype)
    # DeepSpeed's module weights are its master weights rounded to the module's dtype.
    assert_same({n: t.to(dtype) for n, t in master.items()}, ckpt.full())
    if spec.tp == 1:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        ref = get_fp32_state_dict_from_zero_checkpoint(str(ckpt.save_dir))
        assert_same(master, dict(ref))


CONVERT = [s for s in SPECS if s.tp > 1]


@pytest.mark.parametrize("spec", CONVERT, ids=[s.name for s in CONVERT])
def test_convert_then_gather_equals_gather(checkpoints, spec, tmp_path, reshard_bin):
    ckpt = checkpoints(spec)
    want = ckpt.full()
    master = gather(reshard_bin, ckpt.save_dir, tmp_path / "fp32", "--fp32")
    # llama_subparams's q/k/v follow no layout rule, so their targets come from config.json's
    # plan, which cannot split 4 heads 3 ways (convert says so; test_degree covers it).
    for tp in ((1, 4) if spec.family == "llama_subparams" else (1, 3)):
        out = tmp_path / f"tp{tp}"
        r = run(reshard_bin, "convert", ckpt.save_dir, "--tp", tp, "-o", out)
        assert r.returncode == 0, r.stderr
        manifest = json.loads((out / "reshard.json").read_text())
        assert manifest["world_size"] == tp
        powers = {n: p.get("scale_power", 1) for n, p in manifest["params"].items()}
        assert powers["lm_head.weight.exp_avg"] == -1
        assert powers["lm_head.weight.exp_avg_sq"] == -2
        got = gather(reshard_bin, out, tmp_path / f"tp{tp}-hf")
        assert_same({n: got[n] for n in want}, want)
        assert_same({n: got[n + ".fp32"] for n in want}, master)
    r = run(reshard_bin, "convert", ckpt.save_dir, "--tp", 2, "--weights-only", "-o",
            tmp_path / "weights")
    assert r.returncode == 0, r.stderr
    assert sorted(json.loads((tmp_path / "weights" / "reshard.json").read_text())["params"]) == \
        sorted(want)


WHOLE = [s for s in SPECS if s.tp == 1]


@pytest.mark.parametrize("spec", WHOLE, ids=[s.name for s in WHOLE])
def test_convert_of_a_tp1_checkpoint_takes_its_maps_from_config_json(checkpoints, spec, tmp_path,
                                                                     reshard_bin):
    ckpt = checkpoints(spec)
    want = ckpt.full()
    out = tmp_path / "tp2"
    r = run(reshard_bin, "convert", ckpt.save_dir, "--tp", 2, "-o", out)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((out / "reshard.json").read_text())
    assert manifest["params"]["lm_head.weight"]["map"]["ranks"]["1"]["shard_shape"][0] == \
        spec.vocab // 2  # split as transformers' plan splits it: 126, 125 rows
    got = gather(reshard_bin, out, tmp_path / "hf")
    assert_same({n: got[n] for n in want}, want)
    # Without config.json nothing says how to split it.
    save = tmp_path / "ckpt"
    shutil.copytree(ckpt.save_dir, save)
    (save / "config.json").unlink()
    r = run(reshard_bin, "convert", save, "--tp", 2, "-o", tmp_path / "none")
    assert r.returncode == 1 and "--target-maps" in r.stderr and "config.json" in r.stderr, \
        r.stderr
    assert not (tmp_path / "none").exists()


LLAMA_Z1 = Spec("llama", tp=2, dp=2, stage=1)  # fp32
QWEN_TP4_Z3 = Spec("qwen2", tp=4, dp=1, stage=3, dtype="bfloat16")


def test_optimizer_states_equal_deepspeeds_universal_merge(checkpoints, tmp_path, reshard_bin):
    ckpt = checkpoints(LLAMA_Z1)
    universal = ds_to_universal(ckpt, tmp_path / "uc")
    r = run(reshard_bin, "convert", ckpt.save_dir, "--tp", 1, "-o", tmp_path / "tp1")
    assert r.returncode == 0, r.stderr
    ours = load_file(str(tmp_path / "tp1" / "model-rank-0-part-0.safetensors"))
    names = list(ckpt.full())
    for name in names:
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            ref = torch.load(universal / "zero" / name / f"{state}.pt", weights_only=False)
            assert torch.equal(bits(ours[f"{name}.{state}"]), bits(ref["param"])), (name, state)


def test_inspect_summarises_stage_topology_dtype_and_layouts(checkpoints, reshard_bin):
    ckpt = checkpoints(QWEN_TP4_Z3)
    r = run(reshard_bin, "inspect", ckpt.save_dir, "--json")
    assert r.returncode == 0, r.stderr
    ds = json.loads(r.stdout)["deepspeed"]
    assert (ds["zero_stage"], ds["tp"], ds["dp"], ds["dtype"]) == (3, 4, 1, "BF16")
    params = {p["name"]: p for p in ds["params"]}
    assert params["lm_head.weight"]["tp_shard_shapes"] == [[63, 64], [63, 64], [62, 64],
                                                           [62, 64]]
    assert params["lm_head.weight"]["layout"] == {"family": "split", "dim": 0,
                                                  "remainder": "front"}
    assert params["model.norm.weight"]["layout"] == {"family": "replicated"}
    assert {p["layout_source"] for p in ds["params"]} == {"affine map"}
    run_ = json.loads(r.stdout)["parallelism"]
    assert {a["name"]: a["size"] for a in run_["axes"]} == {"tp": 4, "dp": 1, "pp": 1}
    assert (run_["optimizer"], run_["experts"]) == ("zero3", None)
    assert run_["files"].startswith("zero_pp_rank_{dp}_mp_rank_{tp:02d}_model_states.pt")
    text = run(reshard_bin, "inspect", ckpt.save_dir)
    assert "ZeRO 3, TP 4 x DP 1, BF16 module weights" in text.stdout
    assert "parallelism: pp 1 × dp 1 × tp 4 (DeepSpeed data/model grid), ZeRO 3\n" in text.stdout


# --- bad inputs: each names the file, exits 2 and writes nothing -----------------------------

QWEN_Z2 = Spec("qwen2", tp=2, dp=2, stage=2, dtype="bfloat16")  # LLAMA_Z1's topology; biases
MISTRAL_Z3 = Spec("mistral", tp=2, dp=2, stage=3)
LLAMA_Z3_TP1 = Spec("llama", tp=1, dp=3, stage=3, dtype="bfloat16", vocab=251)


def bad_missing_rank_file(checkpoints, tag):
    victim = tag / "zero_pp_rank_1_mp_rank_01_optim_states.pt"
    victim.unlink()
    return victim.name


def bad_dp_file_from_another_run(checkpoints, tag):
    # qwen2's DP rank 1 partition maps its biases too.
    other = checkpoints(QWEN_Z2).tag_dir
    victim = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copy(next(other.glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt")), victim)
    return "param_slice_mappings"


def bad_zero3_dp_file_with_other_shapes(checkpoints, tag):
    other = checkpoints(LLAMA_Z3_TP1).tag_dir  # TP 1: whole shapes
    victim = tag / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    shutil.copy(other / victim.name, victim)
    return victim.name


def bad_truncated_storage(checkpoints, tag):
    victim = tag / "mp_rank_01_model_states.pt"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) * 2 // 3])
    return victim.name


def bad_latest_names_no_tag(checkpoints, tag):
    (tag.parent / "latest").write_text("global_step999")
    return "latest"


BAD = [(LLAMA_Z1, bad_missing_rank_file), (LLAMA_Z1, bad_dp_file_from_another_run),
       (MISTRAL_Z3, bad_zero3_dp_file_with_other_shapes), (LLAMA_Z1, bad_truncated_storage),
       (LLAMA_Z1, bad_latest_names_no_tag)]


@pytest.mark.parametrize("victim,spoil", BAD, ids=[f.__name__[4:] for _, f in BAD])
def test_bad_checkpoints_are_refused_naming_the_file(checkpoints, victim, spoil, tmp_path,
                                                     reshard_bin):
    ckpt = checkpoints(victim)
    save = tmp_path / "ckpt"
    shutil.copytree(ckpt.save_dir, save)
    named = spoil(checkpoints, save / ckpt.tag)
    for command in (["gather"], ["convert", "--tp", "1"], ["gather", "--fp32"],
                    ["convert", "--to", "universal"], ["inspect"]):
        out = tmp_path / "out"
        r = run(reshard_bin, command[0], save, *(["-o", out] if command[0] != "inspect" else []),
                *command[1:])
        assert r.returncode == 2, (command, r.stderr)
        assert named in r.stderr, r.stderr
        assert not out.exists() and not list(tmp_path.glob(".out*")), command


def with_module_entry(ckpt, save, name, value_of):
    """A copy of `ckpt` at `save` whose every TP rank's `module` has one more entry."""
    shutil.copytree(ckpt.save_dir, save)
    for victim in sorted((save / ckpt.tag).glob("mp_rank_*_model_states.pt")):
        states = torch.load(victim, weights_only=False)
        assert not states["frozen_param_shapes"]  # None below ZeRO 2, empty at 2
        states["module"][name] = value_of(states["module"])
        torch.save(states, victim)
    return save


def test_a_module_tensor_no_group_holds_is_kept_as_a_frozen_parameter(ds_checkpoint, tmp_path,
                                                                       reshard_bin):
    """Below ZeRO 2 DeepSpeed saves a frozen parameter (requires_grad False) in `module` only:
    param_shapes, the optimizer and frozen_param_shapes (None) do not name it. Every command
    keeps it, from the module (test_deepspeed_frozen.py trains real ones). At TP 1: at TP 2
    universal_checkpoint_info's pattern lists would lay it out as they lay out any name."""
    ckpt = ds_checkpoint(Spec("llama", tp=1, dp=3, stage=2, vocab=251))
    save = with_module_entry(ckpt, tmp_path / "ckpt", "model.frozen_proj.weight",
                             lambda module: torch.ones(8, 8))
    got = gather(reshard_bin, save, tmp_path / "out")
    assert torch.equal(got["model.frozen_proj.weight"], torch.ones(8, 8))
    r = run(reshard_bin, "inspect", save)
    assert r.returncode == 0 and "model.frozen_proj.weight  [8, 8]" in r.stdout, r.stdout


def test_a_frozen_parameter_at_zero_0_is_refused_not_dropped(ds_checkpoint, tmp_path,
                                                            reshard_bin):
    """ZeRO 0 keeps no param_shapes: its parameters are the module's tensors, counted against
    the optimizer's param_groups, so one no group holds is told by the count alone and refused
    (exit 2, nothing written) rather than read as trained."""
    ckpt = ds_checkpoint(Spec("llama", tp=2, dp=2, stage=0, dtype="bfloat16"))
    save = with_module_entry(ckpt, tmp_path / "ckpt", "model.frozen_proj.weight",
                             lambda module: torch.ones(8, 8))
    for command in (["gather"], ["gather", "--fp32"], ["convert", "--tp", "1"],
                    ["convert", "--to", "universal"], ["convert", "--to", "dcp", "--world", "2"],
                    ["inspect"]):
        out = tmp_path / "out"
        r = run(reshard_bin, command[0], save, *(["-o", out] if command[0] != "inspect" else []),
                *command[1:])
        assert r.returncode == 2, (command, r.stderr)
        assert "param_groups list" in r.stderr and "frozen parameter" in r.stderr, r.stderr
        assert not out.exists() and not list(tmp_path.glob(".out*")), command


def test_a_second_name_of_a_parameter_in_the_module_is_no_frozen_parameter(
        ds_checkpoint, tmp_path, reshard_bin):
    """state_dict names a shared (tied) parameter under each of its names, param_shapes once:
    the second name shares the first's storage, and is read as the tie it is, not refused as a
    frozen parameter."""
    ckpt = ds_checkpoint(LLAMA_Z1)
    save = with_module_entry(ckpt, tmp_path / "ckpt", "tied_head.weight",
                             lambda module: module["model.embed_tokens.weight"])
    got = gather(reshard_bin, save, tmp_path / "out")
    assert_same(got, gather(reshard_bin, ckpt.save_dir, tmp_path / "want"))


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed")
def test_mpirun_shares_out_deepspeed_conversions_byte_identically(checkpoints, tmp_path,
                                                                  reshard_bin):
    ckpt = checkpoints(LLAMA_Z1)
    launch = [shutil.which("mpirun"), "--allow-run-as-root", "--oversubscribe", "-n", "2"]
    jobs = {"convert": ["convert", ckpt.save_dir, "--tp", 3, "--max-shard-size", "100kB"],
            "gather": ["gather", ckpt.save_dir, "--max-shard-size", "100kB"]}
    for name, args in jobs.items():
        one = run(reshard_bin, *args, "-o", tmp_path / f"{name}-1")
        assert one.returncode == 0, one.stderr
        two = run(*launch, reshard_bin, *args, "-o", tmp_path / f"{name}-2")
        assert two.returncode == 0, two.stderr
        files = sorted(p.name for p in (tmp_path / f"{name}-1").iterdir())
        assert len(files) > 2 and files == sorted(p.name for p in (tmp_path / f"{name}-2").iterdir())
        for f in files:
            assert (tmp_path / f"{name}-1" / f).read_bytes() == \
                (tmp_path / f"{name}-2" / f).read_bytes(), f"{name}: {f}"
        shares = re.findall(r"process (\d+): wrote (\d+) files", two.stdout + two.stderr)
        assert sorted(p for p, _ in shares) == ["0", "1"] and all(int(n) > 0 for _, n in shares)
