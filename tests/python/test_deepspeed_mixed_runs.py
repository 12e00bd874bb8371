"""A DeepSpeed checkpoint's files belong together: a file from another run or another step is
refused by gather, gather --fp32, convert --tp and convert --to universal, naming the file, with
exit 2 and nothing written.

Two runs of each TP 2 x DP 2 checkpoint of the CI matrix (ZeRO 0-3) differ only in their seed,
so everything DeepSpeed records beside the tensors (ds_config, ds_version, global_steps, the
partition counts, the optimizer's steps) is the same in both: the values tie them. Where the
module's weights and the fp32 master weights are kept apart (ZeRO 1/2; ZeRO 0 with bf16), each
module weight is its master rounded to the module's dtype; a parameter every TP rank holds whole
is the same on every TP rank, in every state. A file copied from the other run breaks one of
those. The metadata is checked too: a file rewritten to record another step or another config
is refused the same way.
"""

import dataclasses
import filecmp
import shutil
import subprocess

import pytest

from ds_checkpoints import Spec

OTHER_SEED = 7
Z0 = Spec("llama", tp=2, dp=2, stage=0, dtype="bfloat16")
Z1 = Spec("llama", tp=2, dp=2, stage=1)  # fp32: the module's weights are the masters
Z2 = Spec("qwen2", tp=2, dp=2, stage=2, dtype="bfloat16")
Z3 = Spec("mistral", tp=2, dp=2, stage=3)
SPECS = [Z0, Z1, Z2, Z3]

COMMANDS = {
    "gather": ["gather"],
    "gather --fp32": ["gather", "--fp32"],
    "convert --tp 1": ["convert", "--tp", "1"],
    "convert --to universal": ["convert", "--to", "universal"],
}

# (spec, the files copied from the other run, the file the message must name)
MIXED = {
    "z1: both TP ranks' DP rank 1 optimizer files": (
        Z1, ["zero_pp_rank_1_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_01_optim_states.pt"],
        "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    "z1: one DP optimizer file": (
        Z1, ["zero_pp_rank_0_mp_rank_01_optim_states.pt"], "zero_pp_rank_0_mp_rank_01_optim_states.pt"),
    "z1: a model-states file": (
        Z1, ["mp_rank_01_model_states.pt"], "mp_rank_01_model_states.pt"),
    "z2 bf16: a DP optimizer file": (
        Z2, ["bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt"],
        "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt"),
    "z2 bf16: a model-states file": (
        Z2, ["mp_rank_00_model_states.pt"], "mp_rank_00_model_states.pt"),
    "z3: a DP optimizer file": (
        Z3, ["zero_pp_rank_1_mp_rank_01_optim_states.pt"], "zero_pp_rank_1_mp_rank_01_optim_states.pt"),
    "z0 bf16: a model-states file": (
        Z0, ["mp_rank_01_model_states.pt"], "mp_rank_01_model_states.pt"),
}


@pytest.fixture(scope="module")
def runs(ds_checkpoint):
    """{spec: (this run, the other run)}: one launch trains the four other-seed runs."""
    others = {s: dataclasses.replace(s, seed=OTHER_SEED) for s in SPECS}
    ds_checkpoint.prepare(SPECS + list(others.values()))
    return {s: (ds_checkpoint(s), ds_checkpoint(others[s])) for s in SPECS}


def run(*args):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=300)


def mixed_copy(tmp_path, ckpt, replace):
    """A copy of `ckpt`'s save dir with `replace` {file name: path to put there}."""
    save = tmp_path / "in"
    shutil.copytree(ckpt.save_dir, save)
    for name, source in replace.items():
        shutil.copyfile(source, save / ckpt.tag / name)
    return save


def assert_refused(reshard_bin, tmp_path, save, tag, blamed):
    for label, command in COMMANDS.items():
        out = tmp_path / "out" / label.replace(" ", "_")
        out.parent.mkdir(exist_ok=True)
        r = run(reshard_bin, *command, save, "-o", out)
        assert r.returncode == 2, (label, r.returncode, r.stderr)
        assert str(save / tag / blamed) in r.stderr, (label, r.stderr)
        assert "another run" in r.stderr, (label, r.stderr)
        assert list(out.parent.iterdir()) == [], (label, "nothing is written")


@pytest.mark.parametrize("case", list(MIXED))
def test_a_file_from_another_run_is_refused_naming_it(reshard_bin, runs, tmp_path, case):
    spec, files, blamed = MIXED[case]
    own, other = runs[spec]
    for name in files:  # the runs differ in these files (the seed shows in the values)
        assert not filecmp.cmp(own.tag_dir / name, other.tag_dir / name, shallow=False), name
    save = mixed_copy(tmp_path, own, {name: other.tag_dir / name for name in files})
    assert_refused(reshard_bin, tmp_path, save, own.tag, blamed)


def test_each_unmixed_run_is_read(reshard_bin, runs, tmp_path):
    """The checks refuse nothing of a checkpoint whose files are all its own."""
    for spec, pair in runs.items():
        for ckpt in pair:
            out = tmp_path / f"{spec.name}-{ckpt.spec.seed}"
            r = run(reshard_bin, "convert", ckpt.save_dir, "--to", "universal", "-o", out)
            assert r.returncode == 0, (spec.name, r.stderr)


def test_zero3_dp_model_states_hold_nothing_of_their_run(runs):
    """ZeRO 3's per-DP-rank model-states files hold empty module tensors and metadata only: two
    runs that differ in their seed write them byte for byte alike, so there is no foreign one to
    refuse (the values live in the optimizer files, covered above)."""
    own, other = runs[Z3]
    names = sorted(p.name for p in own.tag_dir.glob("zero_pp_rank_*_model_states.pt"))
    assert len(names) == 4
    for name in names:
        assert filecmp.cmp(own.tag_dir / name, other.tag_dir / name, shallow=False), name


def resaved(src, dst, change):
    """`src` loaded with torch.load, changed by change(obj), saved to `dst` by torch.save."""
    import torch

    obj = torch.load(src, map_location="cpu", weights_only=False)
    change(obj)
    torch.save(obj, dst)


def bump_step(obj):
    for state in obj["optimizer_state_dict"]["base_optimizer_state"]["state"].values():
        state["step"] += 1


METADATA = {
    "a model-states file saved at another step": (
        "mp_rank_01_model_states.pt", lambda o: o.update(global_steps=o["global_steps"] + 1)),
    "a model-states file with another ds_config": (
        "mp_rank_01_model_states.pt",
        lambda o: o["ds_config"].update(steps_per_print=7)),
    "an optimizer file whose optimizer took another step": (
        "zero_pp_rank_1_mp_rank_00_optim_states.pt", bump_step),
    "an optimizer file with another ds_config": (
        "zero_pp_rank_1_mp_rank_01_optim_states.pt",
        lambda o: o["ds_config"].update(steps_per_print=7)),
}


@pytest.mark.parametrize("case", list(METADATA))
def test_a_file_that_records_another_step_or_config_is_refused(reshard_bin, runs, tmp_path, case):
    name, change = METADATA[case]
    own, _ = runs[Z1]
    resaved(own.tag_dir / name, tmp_path / name, change)
    save = mixed_copy(tmp_path, own, {name: tmp_path / name})
    assert_refused(reshard_bin, tmp_path, save, own.tag, name)
