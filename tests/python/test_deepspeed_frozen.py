"""Frozen parameters and persistent buffers of DeepSpeed checkpoints, trained on the CPU in the
test (ds_train.py, ds_pipe_train.py): kept by every command, never dropped.

Below ZeRO 2 (and in a pipeline checkpoint) DeepSpeed records a frozen parameter nowhere but in
the module (`frozen_param_shapes` is None): no param group holds it, so it has no master
weight and no moment. A persistent buffer is in the module too (buffer_names lists it).

- gather writes every tensor of the module, bit-equal to what the checkpoint holds; gather
  --fp32 the fp32 masters where they exist (DeepSpeed's zero_to_fp32 values) and the frozen
  parameters and buffers as stored.
- convert --tp keeps them (the module weights alone); --to dcp writes them as model tensors.
- convert --to universal writes a frozen parameter's fp32.pt alone; a buffer, which the
  universal checkpoint has no place for, is refused unless dropped by name.
- A PipelineModule's layer files keep them through gather and convert --pp, and DeepSpeed's
  own strict load_checkpoint resumes from the --pp output with the run's next-step loss.
"""

import json
import shutil
import subprocess
import warnings

import pytest
import torch
from safetensors.torch import load_file

import reshard
import reshard.checkpoint
from ds_checkpoints import Spec
from ds_pipe_checkpoints import PipeSpec, make_pipe_checkpoints, resume_pipe_launch

EMBED = "model.embed_tokens.weight"
BUFFER = "model.running_mean"
ZERO1 = Spec("llama", tp=1, dp=2, stage=1, frozen="embed_tokens", buffer=True)
ZERO1_BF16 = Spec("llama", tp=1, dp=2, stage=1, dtype="bfloat16", frozen="embed_tokens")
ZERO2 = Spec("llama", tp=1, dp=2, stage=2, frozen="embed_tokens", buffer=True)
TP2 = Spec("llama", tp=2, dp=1, stage=1, frozen="embed_tokens", buffer=True)
SPECS = [ZERO1, ZERO1_BF16, ZERO2, TP2]
IDS = [s.name for s in SPECS]
PIPE = PipeSpec(pp=2, dp=1, frozen=r"^2\.norm\.", buffers=True)
PIPE_BUFFERS = ["1.running", "2.running", "3.running"]


def run(*args):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=300)


def bits(t):
    return t.contiguous().view(torch.uint8) if t.dtype != torch.bool else t


def same(got, want, name):
    assert got.dtype == want.dtype and got.shape == want.shape, name
    assert torch.equal(bits(got), bits(want)), name


@pytest.fixture(scope="module")
def checkpoints(ds_checkpoint):
    ds_checkpoint.prepare(SPECS)
    return ds_checkpoint


def module_of(ckpt):
    """Every tensor of the saved module, whole (TP 2: the embedding is cut by rows there, the
    rest compared as TP rank 0 holds it), as DeepSpeed saved it."""
    states = torch.load(ckpt.tag_dir / "mp_rank_00_model_states.pt", weights_only=False)
    return states["module"]


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_gather_keeps_frozen_parameters_and_buffers(checkpoints, spec, tmp_path, reshard_bin):
    ckpt = checkpoints(spec)
    states = torch.load(ckpt.tag_dir / "mp_rank_00_model_states.pt", weights_only=False)
    assert states["frozen_param_shapes"] is None or spec.stage == 2
    assert all(EMBED not in group for group in states["param_shapes"])  # no group holds it
    r = run(reshard_bin, "gather", ckpt.save_dir, "-o", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    want = ckpt.module(0) if spec.tp == 1 else None
    full = load_file(str(ckpt.root / "ref" / "full.safetensors"))
    assert EMBED in got and torch.equal(got[EMBED], full[EMBED])
    if spec.buffer:
        assert states["buffer_names"] == ["model.running_mean"]
        same(got[BUFFER], states["module"][BUFFER], BUFFER)
    if want is not None:  # TP 1: the module is the model
        assert sorted(got) == sorted(states["module"])
        for name, tensor in states["module"].items():
            same(got[name], tensor, name)
    else:
        assert sorted(got) == sorted([*full, *([BUFFER] if spec.buffer else [])])
        for name, tensor in full.items():
            same(got[name], tensor, name)


@pytest.mark.parametrize("spec", [ZERO1, ZERO2], ids=lambda s: s.name)
def test_gather_fp32_gives_masters_and_frozen_weights_as_stored(checkpoints, spec, tmp_path,
                                                                reshard_bin):
    """The masters equal DeepSpeed's own consolidation; what it has no master of (the frozen
    embedding, the buffer), as the module holds it (zero_to_fp32 does so at ZeRO 2 and leaves
    them out at ZeRO 1)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ckpt = checkpoints(spec)
    r = run(reshard_bin, "gather", ckpt.save_dir, "--fp32", "-o", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    module = module_of(ckpt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = get_fp32_state_dict_from_zero_checkpoint(str(ckpt.save_dir))
    assert (EMBED in ref) == (spec.stage == 2)
    assert sorted(got) == sorted(module)
    for name in module:
        same(got[name], ref[name] if name in ref else module[name], name)


@pytest.mark.parametrize("spec", [ZERO1, TP2], ids=lambda s: s.name)
def test_convert_keeps_them_without_optimizer_state(checkpoints, spec, tmp_path, reshard_bin):
    ckpt = checkpoints(spec)
    r = run(reshard_bin, "convert", ckpt.save_dir, "--tp", 2 if spec.tp == 1 else 1, "-o",
            tmp_path / "tp")
    assert r.returncode == 0, r.stderr
    names = set(json.loads((tmp_path / "tp" / "reshard.json").read_text())["params"])
    assert {EMBED, BUFFER} <= names
    assert not {f"{EMBED}.fp32", f"{EMBED}.exp_avg", f"{BUFFER}.fp32"} & names
    assert "model.norm.weight.exp_avg_sq" in names
    r = run(reshard_bin, "gather", tmp_path / "tp", "-o", tmp_path / "again")
    assert r.returncode == 0, r.stderr
    r = run(reshard_bin, "gather", ckpt.save_dir, "-o", tmp_path / "direct")
    assert r.returncode == 0, r.stderr
    states = (".fp32", ".exp_avg", ".exp_avg_sq")  # a sharded checkpoint's gather has them too
    again = {n: t for n, t in load_file(str(tmp_path / "again" / "model.safetensors")).items()
             if not n.endswith(states)}
    direct = load_file(str(tmp_path / "direct" / "model.safetensors"))
    assert sorted(again) == sorted(direct)
    for name, tensor in direct.items():
        same(again[name], tensor, name)


def test_dcp_output_holds_them_as_model_tensors(checkpoints, tmp_path, reshard_bin):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = checkpoints(ZERO1)
    r = run(reshard_bin, "convert", ckpt.save_dir, "--to", "dcp", "--world", 2, "-o",
            tmp_path / "dcp")
    assert r.returncode == 0, r.stderr
    dcp_to_torch_save(str(tmp_path / "dcp"), str(tmp_path / "whole.pt"))
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    module = module_of(ckpt)
    for name in (EMBED, BUFFER):
        model = whole["model"] if "model" in whole else whole
        key = name if name in model else f"model.{name}"
        same(model[key], module[name], name)
    keys = repr(whole.get("optim", {}))
    assert EMBED not in keys and BUFFER not in keys


def test_universal_keeps_a_frozen_parameter_and_refuses_a_buffer_unless_dropped(
        checkpoints, tmp_path, reshard_bin):
    ckpt = checkpoints(ZERO1)
    r = run(reshard_bin, "convert", ckpt.save_dir, "--to", "universal", "-o", tmp_path / "no")
    assert r.returncode == 1, r.stderr
    assert BUFFER in r.stderr and "module buffer" in r.stderr, r.stderr
    assert not (tmp_path / "no").exists()
    r = run(reshard_bin, "convert", ckpt.save_dir, "--to", "universal", "--drop", "model.nothing",
            "--drop", BUFFER, "-o", tmp_path / "bad")
    assert r.returncode == 2 and "model.nothing" in r.stderr, r.stderr
    for held in (EMBED, "model.norm.weight"):  # parameters the folder holds: never dropped
        r = run(reshard_bin, "convert", ckpt.save_dir, "--to", "universal", "--drop", BUFFER,
                "--drop", held, "-o", tmp_path / "param")
        assert r.returncode == 1 and "which the universal checkpoint holds" in r.stderr, r.stderr
        assert not (tmp_path / "param").exists()
    out = tmp_path / "uc"
    r = run(reshard_bin, "convert", ckpt.save_dir, "--to", "universal", "--drop", BUFFER, "-o", out)
    assert r.returncode == 0, r.stderr
    zero = out / f"{ckpt.tag}_universal" / "zero"
    assert sorted(p.name for p in (zero / EMBED).iterdir()) == ["fp32.pt"]
    assert not (zero / BUFFER).exists()
    assert sorted(p.name for p in (zero / "model.norm.weight").iterdir()) == [
        "exp_avg.pt", "exp_avg_sq.pt", "fp32.pt", "step.pt"]
    fp32 = torch.load(zero / EMBED / "fp32.pt", weights_only=False)["param"]
    same(fp32, module_of(ckpt)[EMBED].float(), EMBED)
    # The Python package drops alike.
    reshard.checkpoint.convert(ckpt.save_dir, tmp_path / "py", to="universal", drop=[BUFFER])
    assert (tmp_path / "py" / f"{ckpt.tag}_universal" / "zero" / EMBED / "fp32.pt").exists()
    with pytest.raises(ValueError, match="drop= applies to"):
        reshard.checkpoint.convert(ckpt.save_dir, tmp_path / "py2", tp=2, drop=[BUFFER])


def test_inspect_names_what_has_no_optimizer_state(checkpoints, reshard_bin):
    ckpt = checkpoints(ZERO1)
    r = run(reshard_bin, "inspect", ckpt.save_dir)
    assert r.returncode == 0, r.stderr
    assert f"{EMBED}  [250, 64]" in r.stdout and "(frozen, F32)" in r.stdout, r.stdout
    assert "(buffer, F32)" in r.stdout, r.stdout
    assert "parameters (1 frozen) and 1 buffer\n" in r.stdout, r.stdout
    summary = reshard.checkpoint.inspect(ckpt.save_dir)["deepspeed"]
    kinds = {p["name"]: p["kind"] for p in summary["params"]}
    assert kinds[EMBED] == "frozen" and kinds[BUFFER] == "buffer"
    assert kinds["model.norm.weight"] == "trained"


# ---- PipelineModule ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    return make_pipe_checkpoints([PIPE], tmp_path_factory.mktemp("pipe_frozen"))[PIPE]


def test_pipeline_gather_keeps_layer_buffers_and_frozen_parameters(pipe, tmp_path, reshard_bin):
    layer = torch.load(pipe.tag_dir / "layer_02-model_states.pt", weights_only=True)
    assert {"norm.weight", "running"} <= set(layer)
    stage0 = torch.load(pipe.tag_dir / "mp_rank_00_model_states.pt", weights_only=False)
    assert "2.norm.weight" not in stage0["param_shapes"][0]  # no param group holds it
    r = run(reshard_bin, "gather", pipe.save_dir, "-o", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    want = pipe.full()
    assert sorted(got) == sorted(want) and set(PIPE_BUFFERS) <= set(want)
    for name, tensor in want.items():
        same(got[name], tensor, name)
    assert not torch.equal(want["1.running"], torch.zeros_like(want["1.running"]))


def test_deepspeed_resumes_from_the_pp_output_with_them(pipe, tmp_path, reshard_bin):
    """DeepSpeed's strict load_checkpoint of the --pp 1 output (every layer file's tensors,
    buffers and frozen parameters included): the training run's next-step loss, bit for bit."""
    out = tmp_path / "pp1"
    r = run(reshard_bin, "convert", pipe.save_dir, "--pp", 1, "-o", out)
    assert r.returncode == 0, r.stderr
    tag = out / pipe.tag
    layer = torch.load(tag / "layer_02-model_states.pt", weights_only=True)
    want = pipe.full()
    same(layer["running"], want["2.running"], "2.running")
    same(layer["norm.weight"], want["2.norm.weight"], "2.norm.weight")
    states = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)
    assert sorted(states["buffer_names"]) == PIPE_BUFFERS
    assert "2.norm.weight" not in states["param_shapes"][0]
    at_pp1 = PipeSpec(pp=1, dp=1, frozen=PIPE.frozen, buffers=True)
    losses = resume_pipe_launch(1, [(at_pp1, out, "pp1")], tmp_path / "resume", universal=False)
    assert losses["pp1"] == {0: pipe.next_loss[0]}


def test_pipeline_universal_drops_buffers_only_by_name(pipe, tmp_path, reshard_bin):
    r = run(reshard_bin, "convert", pipe.save_dir, "--to", "universal", "-o", tmp_path / "no")
    assert r.returncode == 1 and "1.running" in r.stderr, r.stderr
    drops = [arg for name in PIPE_BUFFERS for arg in ("--drop", name)]
    out = tmp_path / "uc"
    r = run(reshard_bin, "convert", pipe.save_dir, "--to", "universal", *drops, "-o", out)
    assert r.returncode == 0, r.stderr
    zero = out / f"{pipe.tag}_universal" / "zero"
    assert sorted(p.name for p in (zero / "2.norm.weight").iterdir()) == ["fp32.pt"]
    assert (zero / "2.up.weight" / "exp_avg.pt").exists()
    shutil.rmtree(out)
