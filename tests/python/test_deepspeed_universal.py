"""reshard convert --to universal on real DeepSpeed training checkpoints (ds_checkpoints.py).

The checkpoints are the CI matrix of test_deepspeed_checkpoints.py (trained once per session).

- Where ds_to_universal converts (ZeRO 1-3 with AutoTP, ZeRO 3 at TP 1): our output holds the
  same files, and torch.load gives the same objects from each, key for key, tensor for tensor
  (dtype, shape, requires_grad, bits), records (loss scaler, ZeRO stage) attribute for
  attribute; latest_universal names the folder as DeepSpeed's does.
- Where it refuses (ZeRO 0, TP 1 below ZeRO 3): our fp32 states rounded to the module's dtype
  are the module's full weights, and the layout is the one DeepSpeed loads.
- DeepSpeed resumes from ours with "load_universal": at another TP x DP exactly as from its own
  output (the next step's loss on every DP rank), and from the checkpoints it refuses at the
  same TP x DP with the loss the training run recorded (ZeRO 0 resumes under ZeRO 1: DeepSpeed's
  ZeRO 0 optimizers load no universal checkpoint). Two torchrun launches run them all.
- Sub-parameters without an affine map (parameter_with_sub_params, as DeepSpeed wrote them
  before it published maps, and before version 0.4 with counts for sizes): the same objects as
  ds_to_universal's, SubparamShape records included.
- `--no-sync` writes the same bytes; a conversion interrupted by a signal leaves the output
  absent and no temporary (after SIGKILL: one, which the next run removes).
"""

import dataclasses
import os
import shutil
import signal
import subprocess
import types

import pytest
import torch

from ds_checkpoints import ds_to_universal, resume_launch, universal_accepts
from test_crash_consistency import SIGNALS, signal_at, start, temporaries, tree_digest
from test_deepspeed_checkpoints import CI_SPECS, model_states, optim_states

SPECS = CI_SPECS
ACCEPTED = [s for s in SPECS if universal_accepts(s)]
REFUSED = [s for s in SPECS if not universal_accepts(s)]


def run(*args):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def converted(ds_checkpoint, tmp_path_factory, reshard_bin):
    """{spec: (our save dir, DeepSpeed's save dir or None)}: each holds latest_universal and
    the universal folder it names."""
    ds_checkpoint.prepare(SPECS)
    base = tmp_path_factory.mktemp("universal")
    out = {}
    for spec in SPECS:
        ckpt = ds_checkpoint(spec)
        ours = base / f"{spec.name}-reshard"
        r = run(reshard_bin, "convert", ckpt.save_dir, "--to", "universal", "-o", ours)
        assert r.returncode == 0, r.stderr
        theirs = ds_to_universal(ckpt, base / f"{spec.name}-deepspeed").parent \
            if universal_accepts(spec) else None
        out[spec] = (ours, theirs)
    return out


def same(a, b, path):
    """torch.load results equal: the same types, dict keys in order, tensors bit for bit with
    their dtype, shape and requires_grad, records attribute for attribute."""
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.requires_grad) == (b.dtype, b.shape, b.requires_grad), path
        assert torch.equal(a.detach().reshape(-1).view(torch.uint8),
                           b.detach().reshape(-1).view(torch.uint8)), path
    elif isinstance(a, dict):
        assert list(a) == list(b), (path, list(a), list(b))
        for k in a:
            same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}.{i}")
    elif hasattr(a, "__dict__"):
        same(vars(a), vars(b), path)
    else:
        assert a == b, (path, a, b)


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def saved_step(ckpt):
    """The torch optimizer's step as the checkpoint holds it (the same for every parameter;
    ZeRO 0 under bf16 counts 3 after two engine steps)."""
    if ckpt.spec.stage == 0:
        optimizer = model_states(ckpt, 0)["optimizer"]
        return optimizer.get("optimizer_state_dict", optimizer)["state"][0]["step"]
    return optim_states(ckpt, 0, 0)["base_optimizer_state"]["state"][0]["step"]


def files(root):
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("spec", ACCEPTED, ids=lambda s: s.name)
def test_universal_output_equals_ds_to_universal_file_by_file(converted, spec):
    ours, theirs = converted[spec]
    assert files(ours) == files(theirs)
    assert (ours / "latest_universal").read_text() == (theirs / "latest_universal").read_text()
    for f in files(ours):
        if f.name.endswith("_model_states.pt"):  # copied
            assert (ours / f).read_bytes() == (theirs / f).read_bytes(), f
        elif f.suffix == ".pt":
            same(torch.load(ours / f, weights_only=False),
                 torch.load(theirs / f, weights_only=False), str(f))


@pytest.mark.parametrize("spec", REFUSED, ids=lambda s: s.name)
def test_universal_output_of_what_ds_to_universal_refuses_holds_the_module(ds_checkpoint,
                                                                           converted, spec):
    ckpt = ds_checkpoint(spec)
    ours, _ = converted[spec]
    folder = ours / (ours / "latest_universal").read_text()
    assert folder.name == f"{ckpt.tag}_universal"
    full = ckpt.full()
    assert sorted(p.name for p in (folder / "zero").iterdir()) == sorted([*full,
                                                                          "optimizer_state.pt"])
    for name, weight in full.items():
        states = {p.stem: torch.load(p, weights_only=True)
                  for p in (folder / "zero" / name).iterdir()}
        assert sorted(states) == ["exp_avg", "exp_avg_sq", "fp32", "step"], name
        fp32 = states["fp32"]
        # With AutoTP the affine map gives the layout, and only the vocabulary is marked; TP 1
        # gets what ds_to_universal --inject_missing_state writes: TP shards "concatenated" on 0.
        want = {"cat_dim": 0} if spec.tp == 1 else \
            {"vocab_tensor": True} if name == "lm_head.weight" else {}
        assert list(fp32) == [*want, "param"], name
        assert all(fp32[k] == v for k, v in want.items()), name
        assert fp32["param"].dtype == torch.float32 and fp32["param"].requires_grad
        assert torch.equal(fp32["param"].detach().to(weight.dtype), weight), name
        for moment in ("exp_avg", "exp_avg_sq"):
            assert states[moment]["param"].shape == weight.shape, (name, moment)
        assert same_bits(states["step"], saved_step(ckpt)), name
    optimizer = torch.load(folder / "zero" / "optimizer_state.pt", weights_only=False)
    assert optimizer["param_groups"][0]["lr"] > 0
    model_states = sorted(p.name for p in folder.glob("*_model_states.pt"))
    assert model_states == sorted(p.name for p in ckpt.tag_dir.glob("*_model_states.pt"))


# Where each checkpoint resumes: the TP x DP of another launch (DeepSpeed cannot load the flat
# ZeRO 3 files of a TP 1 run at TP 2: it resumes at its own topology, as the refused ones do).
def resume_topology(spec):
    if not universal_accepts(spec) or (spec.tp == 1 and spec.stage == 3):
        return (spec.tp, spec.dp)
    return (1, 3) if (spec.tp, spec.dp) == (2, 2) else (2, 2)


@pytest.fixture(scope="module")
def resumed(converted, tmp_path_factory):
    """{(spec, "reshard" | "deepspeed"): {dp_rank: next loss}} of DeepSpeed resumed from our
    output and from its own at resume_topology(spec): one launch per topology."""
    base = tmp_path_factory.mktemp("resumed")
    by_topology = {}
    for spec in SPECS:
        ours, theirs = converted[spec]
        stage = max(spec.stage, 1)  # ZeRO 0's optimizers cannot load a universal checkpoint
        jobs = by_topology.setdefault(resume_topology(spec), [])
        at = dataclasses.replace(spec, stage=stage)
        jobs.append((at, ours, f"{spec.name}-reshard"))
        if theirs is not None and resume_topology(spec) != (spec.tp, spec.dp):
            jobs.append((at, theirs, f"{spec.name}-deepspeed"))
    out = {}
    for (tp, dp), jobs in by_topology.items():
        losses = resume_launch(tp, dp, jobs, base / f"tp{tp}-dp{dp}")
        for spec in SPECS:
            for how in ("reshard", "deepspeed"):
                if f"{spec.name}-{how}" in losses:
                    out[(spec, how)] = losses[f"{spec.name}-{how}"]
    return out


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_deepspeed_resumes_from_the_universal_output(ds_checkpoint, resumed, spec):
    ours = resumed[(spec, "reshard")]
    if resume_topology(spec) == (spec.tp, spec.dp):
        assert ours == ds_checkpoint(spec).next_loss
    else:
        assert sorted(ours) == list(range(resume_topology(spec)[1]))
        assert ours == resumed[(spec, "deepspeed")]


def test_convert_to_universal_refuses_other_inputs_and_flags(tmp_path, reshard_bin,
                                                             ds_checkpoint):
    ckpt = ds_checkpoint(SPECS[0])
    out = tmp_path / "out"
    for extra in (["--tp", "2"], ["--weights-only"], ["--max-shard-size", "1MB"]):
        r = run(reshard_bin, "convert", ckpt.save_dir, "--to", "universal", *extra, "-o", out)
        assert r.returncode == 2 and ("--to universal" in r.stderr or "excludes" in r.stderr), \
            (extra, r.stderr)
    not_ds = tmp_path / "empty"
    not_ds.mkdir()
    r = run(reshard_bin, "convert", not_ds, "--to", "universal", "-o", out)
    assert r.returncode == 2 and "not one" in r.stderr, r.stderr
    r = run(reshard_bin, "convert", ckpt.save_dir, "--to", "gguf", "-o", out)
    assert r.returncode == 2, r.stderr
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_force_replaces_a_universal_checkpoint_and_nothing_else(tmp_path, reshard_bin,
                                                                ds_checkpoint):
    ckpt = ds_checkpoint(SPECS[0])
    out = tmp_path / "uc"
    convert = [reshard_bin, "convert", ckpt.save_dir, "--to", "universal", "-o", out]
    assert run(*convert).returncode == 0
    r = run(*convert)
    assert r.returncode == 2 and "--force" in r.stderr, r.stderr
    stamp = out / "latest_universal"
    before = stamp.stat().st_ino
    r = run(*convert, "--force")
    assert r.returncode == 0, r.stderr
    assert stamp.stat().st_ino != before
    stray = out / stamp.read_text() / "zero" / "lm_head.weight" / "notes.txt"
    stray.write_text("mine")
    r = run(*convert, "--force")
    assert r.returncode == 2 and "notes.txt" in r.stderr, r.stderr
    assert stray.read_text() == "mine"


def test_no_sync_writes_the_same_universal_checkpoint(converted, tmp_path, reshard_bin,
                                                      ds_checkpoint):
    spec = SPECS[0]
    out = tmp_path / "uc"
    r = run(reshard_bin, "convert", ds_checkpoint(spec).save_dir, "--to", "universal",
            "--no-sync", "-o", out)
    assert r.returncode == 0, r.stderr
    assert tree_digest(out) == tree_digest(converted[spec][0])


@pytest.mark.parametrize("sig", [*SIGNALS, signal.SIGKILL], ids=lambda s: signal.Signals(s).name)
def test_an_interrupted_universal_conversion_leaves_nothing_or_everything(
        converted, tmp_path, reshard_bin, ds_checkpoint, sig):
    """Signalled as soon as its temporary output appears: afterwards the output is absent (or,
    had it finished first, complete) and the input untouched; a signal the process can handle
    leaves no temporary, and the run after a SIGKILL removes the one it leaves."""
    spec = SPECS[0]
    ckpt = ds_checkpoint(spec)
    reference = tree_digest(converted[spec][0])
    input_before = tree_digest(ckpt.save_dir)
    out = tmp_path / "uc"
    args = ["convert", ckpt.save_dir, "--to", "universal", "-o", out]
    for _ in range(12):  # a run that ends before the signal proves nothing: try again
        shutil.rmtree(out, ignore_errors=True)
        proc = start(reshard_bin, args)
        mid_run = signal_at(proc, out, 0.0, 1, sig)
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode in (0, -sig), stderr
        if os.path.exists(out):
            assert tree_digest(out) == reference
        if mid_run and proc.returncode == -sig:
            break
    else:
        pytest.fail(f"no run was caught mid-way by {signal.Signals(sig).name}")
    assert not os.path.exists(out)
    assert tree_digest(ckpt.save_dir) == input_before
    if sig != signal.SIGKILL:
        assert temporaries(out) == []
        return
    assert len(temporaries(out)) == 1
    r = run(reshard_bin, *args)
    assert r.returncode == 0, r.stderr
    assert temporaries(out) == [] and tree_digest(out) == reference


def as_older_deepspeed_wrote_it(ckpt, dest, legacy):
    """A copy of `ckpt` whose model states carry no affine map, as DeepSpeed wrote them before
    it published one: the pattern lists alone, parameter_with_sub_params among them. With
    `legacy`, as before universal-checkpoint version 0.4: a count of equal sub-parameters at
    partition_dim instead of their sizes, and no sub_param_shard_widths."""
    shutil.copytree(ckpt.save_dir, dest)
    for f in sorted((dest / ckpt.tag).glob("*model_states.pt")):
        states = torch.load(f, weights_only=False)
        uc = states["universal_checkpoint_info"]
        del uc["affine_map"]
        if legacy:
            uc["universal_checkpoint_version"] = 0.3
            del uc["sub_param_shard_widths"]
            for entry in uc["parameter_with_sub_params"]:
                shape = list(entry["shape"])
                shape[entry["partition_dim"]] = len(shape[entry["partition_dim"]])
                entry["shape"] = shape
        torch.save(states, f)
    return dest


@pytest.mark.parametrize("legacy", [False, True], ids=["v0.4", "before-v0.4"])
def test_sub_parameters_without_an_affine_map_as_ds_to_universal_writes_them(
        tmp_path, reshard_bin, ds_checkpoint, legacy):
    """parameter_with_sub_params: ds_to_universal merges each sub-parameter's pieces and
    records a SubparamShape beside the tensor; ours loads to the same objects, file by file,
    and its tensors are those of the affine-map checkpoint it came from."""
    spec = next(s for s in SPECS if s.family == "llama_subparams")
    ckpt = ds_checkpoint(spec)
    save = as_older_deepspeed_wrote_it(ckpt, tmp_path / "ckpt", legacy)
    ours = tmp_path / "ours"
    r = run(reshard_bin, "convert", save, "--to", "universal", "-o", ours)
    assert r.returncode == 0, r.stderr
    theirs = ds_to_universal(types.SimpleNamespace(tag=ckpt.tag, tag_dir=save / ckpt.tag,
                                                   spec=spec), tmp_path / "theirs")
    folder = ours / (ours / "latest_universal").read_text()
    assert files(folder) == files(theirs)
    recorded = 0
    for f in files(folder):
        if f.suffix != ".pt" or f.name.endswith("_model_states.pt"):
            continue
        a = torch.load(folder / f, weights_only=False)
        same(a, torch.load(theirs / f, weights_only=False), str(f))
        if isinstance(a, dict) and "sub_param_shape" in a:
            recorded += 1
            # Sizes of the two halves of 64 rows; the legacy count (2) becomes them, in a tuple.
            shape = a["sub_param_shape"].shape
            assert shape == (((32, 32), -1) if legacy else [(32, 32), -1]), shape
    assert recorded == 6 * 3  # q, k, v of 2 layers; fp32 and both moments
    # The same tensors as from the checkpoint with its affine map.
    r = run(reshard_bin, "convert", ckpt.save_dir, "--to", "universal", "-o", tmp_path / "affine")
    assert r.returncode == 0, r.stderr
    for f in files(folder):
        if f.name in ("fp32.pt", "exp_avg.pt", "exp_avg_sq.pt"):
            assert same_bits(torch.load(folder / f, weights_only=False)["param"],
                             torch.load(tmp_path / "affine" / folder.name / f,
                                        weights_only=True)["param"]), f
