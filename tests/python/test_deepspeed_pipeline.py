"""DeepSpeed PipelineModule checkpoints (layer files beside per-stage model states and ZeRO
partitions), trained on the CPU in the test (ds_pipe_train.py, ds_pipe_checkpoints.py).

- The files are as docs/deepspeed_checkpoints.md describes them.
- `reshard gather` gives every parameter as the engine held it, by the engine's names.
- `reshard convert --to universal` equals ds_to_universal's output file for file (PP 2 x DP 2
  in fp32, PP 2 x DP 1 in bf16, PP 2 x TP 2 with Megatron-style blocks; ZeRO 1), and
  DeepSpeed resumes from ours at another PP x TP x DP with the next step's loss of the
  training run, bit for bit (within 4 float32 ulps where the TP degree changes).
- `reshard convert --pp P [--tp M] [--dp D] [--pp-stages ...]` writes a DeepSpeed pipeline
  checkpoint laid out as DeepSpeed saves one at that topology (checked against DeepSpeed's own
  save of the same model at PP 1 x DP 2), holding every weight and optimizer state of the
  source, and DeepSpeed's load_checkpoint resumes from it at that PP x TP x DP (uneven stages
  included) with the next step's loss of the training run, bit for bit (within 4 float32 ulps
  where the TP degree changes).
- Bad input (a missing stage or layer file, a stage of another run or PP degree, a layer
  file of the wrong shape; stage lists that do not fit the layers) exits 1 or 2 naming the
  file or the list, and writes nothing.
"""

import dataclasses
import math
import re
import shutil
import subprocess

import pytest
import torch

from ds_checkpoints import ds_to_universal
from ds_pipe_checkpoints import PipeSpec, make_pipe_checkpoints, resume_pipe_launch
from test_deepspeed_universal import files, same

FP32 = PipeSpec(pp=2, dp=2)
BF16 = PipeSpec(pp=2, dp=1, dtype="bfloat16")
TP2 = PipeSpec(pp=2, tp=2, dp=1)  # layer_XX-model_YY files; blocks cut as Megatron cuts them
OTHER_RUN = PipeSpec(pp=2, dp=2, seed=7)  # the same model and topology, other weights
OTHER_PP = PipeSpec(pp=4, dp=1)  # uneven stages: 2, 1, 1 and 2 layers
ZERO0 = PipeSpec(pp=2, dp=1, stage=0)
PP1 = PipeSpec(pp=1, dp=2)  # FP32's model and run at PP 1: what DeepSpeed saves there
CONVERTED = [FP32, BF16, TP2, OTHER_PP]
# ds_to_universal assumes Megatron's layout of layers (embedding, transformer layers spread
# evenly over the stages, final norm): with 3 blocks over 4 stages it divides by zero.
DS_REFUSES = [OTHER_PP]


def run(*args):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    return make_pipe_checkpoints([FP32, OTHER_RUN, OTHER_PP, TP2, BF16, ZERO0, PP1],
                                 tmp_path_factory.mktemp("pipe_checkpoints"))


@pytest.fixture(scope="module")
def converted(pipes, tmp_path_factory, reshard_bin):
    """{spec: (our save dir, DeepSpeed's)}, each with latest_universal and its folder."""
    base = tmp_path_factory.mktemp("pipe_universal")
    out = {}
    for spec in CONVERTED:
        ckpt = pipes[spec]
        ours = base / f"{spec.name}-reshard"
        r = run(reshard_bin, "convert", ckpt.save_dir, "--to", "universal", "-o", ours)
        assert r.returncode == 0, r.stderr
        theirs = None
        try:
            theirs = ds_to_universal(ckpt, base / f"{spec.name}-deepspeed").parent
        except ZeroDivisionError:
            assert spec in DS_REFUSES
        out[spec] = (ours, theirs)
    return out


def test_pipeline_files_are_as_documented(pipes):
    ckpt = pipes[FP32]
    names = sorted(p.name for p in ckpt.tag_dir.iterdir())
    # Layers 0-4 have a state_dict of their own; layer 5 (the tied embedding again, with a
    # forward_fn) is saved by layer 0. Stage 0 holds layers 0-2, stage 1 layers 3-5.
    assert names == [*(f"layer_{i:02d}-model_states.pt" for i in range(5)),
                     "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
                     *(f"zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt"
                       for d in range(2) for s in range(2))]
    assert ckpt.facts["parts"] == [0, 3, 6]
    stages = [torch.load(ckpt.tag_dir / f"mp_rank_{s:02d}_model_states.pt", weights_only=False)
              for s in range(2)]
    for states in stages:
        assert states["module"] is None
        assert states["mp_world_size"] == 2 and states["dp_world_size"] == 2
        assert states["checkpoint_parallel_dimensions"] == {"pp_degree": 2, "tp_degree": 1}
    shapes = [list(st["param_shapes"][0]) for st in stages]
    assert shapes[0][0] == shapes[1][0] == "tied_modules.embed.weight"
    assert {n.split(".")[0] for n in shapes[0][1:]} == {"1", "2"}
    assert {n.split(".")[0] for n in shapes[1][1:]} == {"3", "4"}
    layer = torch.load(ckpt.tag_dir / "layer_01-model_states.pt", weights_only=True)
    assert list(layer) == ["norm.weight", "norm.bias", "up.weight", "up.bias", "down.weight",
                           "down.bias"]
    full = ckpt.full()
    for name, tensor in layer.items():
        assert torch.equal(tensor, full[f"1.{name}"])
    embed = torch.load(ckpt.tag_dir / "layer_00-model_states.pt", weights_only=True)
    assert list(embed) == ["weight"] and torch.equal(embed["weight"],
                                                     full["tied_modules.embed.weight"])
    for s in range(2):  # each stage's optimizer partitions its own parameters over its DP ranks
        for d in range(2):
            optim = torch.load(ckpt.tag_dir / f"zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt",
                               weights_only=False)["optimizer_state_dict"]
            mapped = set(optim["param_slice_mappings"][0])
            assert mapped <= set(shapes[s]), (s, d)


@pytest.mark.parametrize("spec", [FP32, BF16, TP2, OTHER_PP], ids=lambda s: s.name)
def test_gather_gives_every_parameter_as_the_engine_held_it(pipes, tmp_path, reshard_bin, spec):
    from safetensors.torch import load_file

    ckpt = pipes[spec]
    r = run(reshard_bin, "gather", ckpt.save_dir, "-o", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    want = ckpt.full()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@pytest.mark.parametrize("spec", CONVERTED, ids=lambda s: s.name)
def test_universal_output_equals_ds_to_universal_file_by_file(converted, spec):
    ours, theirs = converted[spec]
    if spec in DS_REFUSES:  # DeepSpeed resumes from ours all the same (below)
        assert theirs is None
        return
    assert files(ours) == files(theirs)
    assert (ours / "latest_universal").read_text() == (theirs / "latest_universal").read_text()
    for f in files(ours):
        if f.name.endswith("_model_states.pt"):  # copied
            assert (ours / f).read_bytes() == (theirs / f).read_bytes(), f
        elif f.suffix == ".pt":
            same(torch.load(ours / f, weights_only=False),
                 torch.load(theirs / f, weights_only=False), str(f))


@pytest.mark.parametrize("spec,tp", [(TP2, 1), (FP32, 2)], ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_convert_to_another_tp_degree_keeps_every_weight_and_moment(pipes, converted, tmp_path,
                                                                    reshard_bin, spec, tp):
    """convert --tp: a reshard sharded checkpoint of the stages' parameters at TP `tp` (the
    layouts from universal_checkpoint_info's pattern lists); gathered back, the module's
    weights are the training run's and the fp32 masters and moments ds_to_universal's."""
    from safetensors.torch import load_file

    r = run(reshard_bin, "convert", pipes[spec].save_dir, "--tp", tp, "-o", tmp_path / "tp")
    assert r.returncode == 0, r.stderr
    r = run(reshard_bin, "gather", tmp_path / "tp", "-o", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    theirs = converted[spec][1]
    zero = theirs / (theirs / "latest_universal").read_text() / "zero"
    for name, weight in pipes[spec].full().items():
        assert torch.equal(got[name], weight), name
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            want = torch.load(zero / name / f"{state}.pt", weights_only=False)["param"]
            assert torch.equal(got[f"{name}.{state}"], want), (name, state)


def test_the_python_package_takes_them_as_the_cli_does(pipes, converted, tmp_path):
    import reshard.checkpoint
    from safetensors.torch import load_file

    from test_crash_consistency import tree_digest

    ckpt = pipes[TP2]
    reshard.checkpoint.convert(ckpt.save_dir, tmp_path / "uc", to="universal")
    assert tree_digest(tmp_path / "uc") == tree_digest(converted[TP2][0])
    reshard.checkpoint.gather(ckpt.save_dir, tmp_path / "hf")
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert all(torch.equal(got[n], t) for n, t in ckpt.full().items())
    info = reshard.checkpoint.inspect(ckpt.save_dir)
    assert info["deepspeed"]["pp"] == 2
    assert info["parallelism"]["text"].startswith("pp 2 × dp ")


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed")
def test_mpirun_shares_out_a_pipeline_conversion_byte_identically(pipes, converted, tmp_path,
                                                                  reshard_bin):
    from test_crash_consistency import tree_digest

    launch = [shutil.which("mpirun"), "--allow-run-as-root", "--oversubscribe", "-n", "2"]
    r = run(*launch, reshard_bin, "convert", pipes[TP2].save_dir, "--to", "universal", "-o",
            tmp_path / "uc")
    assert r.returncode == 0, r.stderr
    assert tree_digest(tmp_path / "uc") == tree_digest(converted[TP2][0])
    shares = re.findall(r"process (\d+): wrote (\d+) files", r.stdout + r.stderr)
    assert sorted(p for p, _ in shares) == ["0", "1"] and all(int(n) > 0 for _, n in shares)
    # The pipeline output too: each process writes its share of the files.
    r = run(*launch, reshard_bin, "convert", pipes[TP2].save_dir, "--pp", 1, "--tp", 1, "-o",
            tmp_path / "pp1")
    assert r.returncode == 0, r.stderr
    r2 = run(reshard_bin, "convert", pipes[TP2].save_dir, "--pp", 1, "--tp", 1, "-o",
             tmp_path / "pp1-one")
    assert r2.returncode == 0, r2.stderr
    assert tree_digest(tmp_path / "pp1") == tree_digest(tmp_path / "pp1-one")
    shares = re.findall(r"process (\d+): wrote (\d+) files", r.stdout + r.stderr)
    assert sorted(p for p, _ in shares) == ["0", "1"] and all(int(n) > 0 for _, n in shares)


def test_without_universal_checkpoint_info_as_inject_missing_state_converts_it(
        pipes, tmp_path, reshard_bin):
    """A PipelineModule that sets no universal_checkpoint_info (the common case): ds_to_universal
    refuses it unless told --inject_missing_state; ours is what that option makes of it."""
    import contextlib
    import io
    import sys

    from deepspeed.checkpoint import ds_to_universal as converter

    ckpt = pipes[FP32]
    save, tag = copy_of(ckpt, tmp_path / "ckpt")
    for f in tag.glob("mp_rank_*_model_states.pt"):
        states = torch.load(f, weights_only=False)
        del states["universal_checkpoint_info"]
        torch.save(states, f)
    ours = tmp_path / "ours"
    r = run(reshard_bin, "convert", save, "--to", "universal", "-o", ours)
    assert r.returncode == 0, r.stderr
    theirs = tmp_path / "theirs" / f"{ckpt.tag}_universal"
    saved_argv = sys.argv
    sys.argv = ["ds_to_universal", "--input_folder", str(tag), "--output_folder", str(theirs),
                "--num_extract_workers", "1", "--num_merge_workers", "1",
                "--inject_missing_state"]
    try:
        with contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            converter.main(converter.parse_arguments())
    finally:
        sys.argv = saved_argv
    folder = ours / (ours / "latest_universal").read_text()
    assert files(folder) == files(theirs)
    for f in files(folder):
        if f.name.endswith("_model_states.pt"):
            assert (folder / f).read_bytes() == (theirs / f).read_bytes(), f
        elif f.suffix == ".pt":
            same(torch.load(folder / f, weights_only=False),
                 torch.load(theirs / f, weights_only=False), str(f))


def test_inspect_reports_the_stages(pipes, reshard_bin):
    import json

    r = run(reshard_bin, "inspect", pipes[TP2].save_dir, "--json")
    assert r.returncode == 0, r.stderr
    ds = json.loads(r.stdout)["deepspeed"]
    assert (ds["pp"], ds["tp"], ds["dp"], ds["zero_stage"]) == (2, 2, 1, 1)
    names = [p["name"] for p in ds["params"]]
    assert names[0] == "tied_modules.embed.weight" and names.count(names[0]) == 1
    assert "3.down.weight" in names and "4.weight" in names
    # The run: DeepSpeed's grid (model fastest, then data, then pipe), slice s = stage * TP + t.
    run_ = json.loads(r.stdout)["parallelism"]
    assert run_["axes"] == [{"name": "tp", "size": 2}, {"name": "dp", "size": 1},
                            {"name": "pp", "size": 2}]
    assert (run_["world"], run_["optimizer"], run_["unknown"]) == (4, "zero1", [])
    assert "mp_rank_{pp*TP+tp:02d}_model_states.pt" in run_["files"]
    r = run(reshard_bin, "inspect", pipes[TP2].save_dir)
    assert "ZeRO 1, PP 2 x TP 2 x DP 1" in r.stdout, r.stdout
    assert "parallelism: pp 2 × dp 1 × tp 2 (DeepSpeed pipe/data/model grid), ZeRO 1\n" in r.stdout


# Where each converted checkpoint resumes: another PP x TP x DP.
RESUME_AT = {FP32: [(1, 1, 2), (2, 1, 1)], BF16: [(1, 1, 2)], TP2: [(1, 2, 2), (2, 1, 1)],
             OTHER_PP: [(2, 1, 1)]}
RESUMES = [(spec, *at) for spec, topologies in RESUME_AT.items() for at in topologies]


@pytest.fixture(scope="module")
def resumed(converted, tmp_path_factory):
    """{(spec, pp, tp, dp): {dp_rank: next loss}} of DeepSpeed resumed from our output: one
    launch per world size."""
    base = tmp_path_factory.mktemp("pipe_resumed")
    by_world = {}
    for spec, pp, tp, dp in RESUMES:
        by_world.setdefault(pp * tp * dp, []).append(
            (dataclasses.replace(spec, pp=pp, tp=tp, dp=dp), converted[spec][0],
             f"{spec.name}-at-pp{pp}-tp{tp}-dp{dp}"))
    losses = {}
    for world, jobs in by_world.items():
        losses.update(resume_pipe_launch(world, jobs, base / f"world{world}"))
    return {(spec, pp, tp, dp): losses[f"{spec.name}-at-pp{pp}-tp{tp}-dp{dp}"]
            for spec, pp, tp, dp in RESUMES}


def assert_next_loss(losses, want, run_tp, tp, dp):
    """Each DP rank's next-step loss is the training run's: bit for bit at the run's TP degree.
    At another one a row-parallel block's product is summed over another number of ranks, which
    rounds differently on some CPUs (one float32 ulp on an AVX-512 machine, none on an AVX2
    one): there it is within 4 ulps."""
    assert sorted(losses) == list(range(dp)), losses
    for d, loss in losses.items():
        if tp == run_tp:
            assert loss == want, (d, loss, want)
        else:
            ulp = 2.0 ** (math.floor(math.log2(abs(want))) - 23)
            assert abs(loss - want) <= 4 * ulp, (d, loss, want)


@pytest.mark.parametrize("spec,pp,tp,dp", RESUMES,
                         ids=lambda v: v.name if isinstance(v, PipeSpec) else str(v))
def test_deepspeed_resumes_from_the_universal_output_at_another_topology(pipes, resumed, spec,
                                                                         pp, tp, dp):
    """The next step's loss of the training run, bit for bit at the run's TP degree."""
    assert_next_loss(resumed[(spec, pp, tp, dp)], pipes[spec].next_loss[0], spec.tp, tp, dp)


def refused(reshard_bin, save_dir, out, blamed, *names):
    """Every command refuses `save_dir` naming the file `blamed` first and each of `names`, and
    writes nothing."""
    for cmd in (["gather", save_dir, "-o", out], ["convert", save_dir, "--to", "universal", "-o",
                                                  out]):
        r = run(reshard_bin, *cmd)
        assert r.returncode in (1, 2), (cmd, r.stderr)
        assert r.stderr.split('"')[1].endswith(blamed), (cmd, r.stderr)
        for name in names:
            assert name in r.stderr, (cmd, r.stderr)
        assert not out.exists() and not list(out.parent.glob(f".{out.name}*"))


def copy_of(ckpt, dest):
    shutil.copytree(ckpt.save_dir, dest)
    return dest, dest / ckpt.tag


def test_a_missing_stage_or_layer_file_is_named(pipes, tmp_path, reshard_bin):
    ckpt = pipes[FP32]
    for missing in ("mp_rank_01_model_states.pt", "zero_pp_rank_1_mp_rank_01_optim_states.pt",
                    "layer_03-model_states.pt", "layer_00-model_states.pt"):
        save, tag = copy_of(ckpt, tmp_path / missing)
        (tag / missing).unlink()
        if missing.startswith("layer_00"):  # the tied embedding's owner
            refused(reshard_bin, save, tmp_path / f"out-{missing}", ckpt.tag,
                    'no layer file holds tied module "embed"')
        else:
            refused(reshard_bin, save, tmp_path / f"out-{missing}", missing, "is missing")


def test_stage_files_of_another_run_or_pp_degree_are_named(pipes, tmp_path, reshard_bin):
    ckpt = pipes[FP32]
    # A whole stage (its model states, optimizer partitions and layer files) of another run:
    # the tied embedding's copies disagree across the stages.
    save, tag = copy_of(ckpt, tmp_path / "run")
    other = pipes[OTHER_RUN].tag_dir
    for f in [*other.glob("*mp_rank_01_*"), *(other / f"layer_{i:02d}-model_states.pt"
                                              for i in (3, 4))]:
        shutil.copy(f, tag / f.name)
    refused(reshard_bin, save, tmp_path / "out-run", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "zero_pp_rank_0_mp_rank_01_optim_states.pt", "tied across pipeline stages 0 and 1")
    # One layer file of another run: not what the optimizer's masters say.
    save, tag = copy_of(ckpt, tmp_path / "layer")
    shutil.copy(other / "layer_02-model_states.pt", tag)
    refused(reshard_bin, save, tmp_path / "out-layer", "layer_02-model_states.pt",
            "not the fp32 master weights")
    # A stage of a PP 4 run.
    save, tag = copy_of(ckpt, tmp_path / "pp")
    shutil.copy(pipes[OTHER_PP].tag_dir / "mp_rank_01_model_states.pt", tag)
    refused(reshard_bin, save, tmp_path / "out-pp", "mp_rank_01_model_states.pt",
            "mp_world_size is 2 there but 4 here")


def test_a_zero_0_pipeline_checkpoint_is_refused_with_the_reason(pipes, tmp_path, reshard_bin):
    """ZeRO 0 saves no param_shapes: nothing names a stage's parameters."""
    ckpt = pipes[ZERO0]
    states = torch.load(ckpt.tag_dir / "mp_rank_00_model_states.pt", weights_only=False)
    assert states["param_shapes"] is None and states["module"] is None
    refused(reshard_bin, ckpt.save_dir, tmp_path / "out", "mp_rank_00_model_states.pt",
            "no param_shapes (ZeRO 0)")


def test_a_layer_file_whose_shape_disagrees_is_named(pipes, tmp_path, reshard_bin):
    save, tag = copy_of(pipes[FP32], tmp_path / "shape")
    layer = torch.load(tag / "layer_03-model_states.pt", weights_only=True)
    layer["up.weight"] = layer["up.weight"][:-1].clone()
    torch.save(layer, tag / "layer_03-model_states.pt")
    refused(reshard_bin, save, tmp_path / "out", "layer_03-model_states.pt", "up.weight")


def refused_by_every_command(reshard_bin, save_dir, out, blamed, *names):
    """`refused`, and convert --pp 1 and --tp 2 too."""
    refused(reshard_bin, save_dir, out, blamed, *names)
    for args in (["--pp", 1], ["--tp", 2]):
        r = run(reshard_bin, "convert", save_dir, *args, "-o", out)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.split('"')[1].endswith(blamed), (args, r.stderr)
        for name in names:
            assert name in r.stderr, (args, r.stderr)
        assert not out.exists() and not list(out.parent.glob(f".{out.name}*")), args


def test_a_layer_buffer_or_frozen_parameter_is_kept_but_a_tied_modules_is_refused(
        pipes, tmp_path, reshard_bin):
    """A layer file's tensors that no stage lists as a parameter (a persistent buffer, which
    buffer_names lists; a frozen parameter, which no param group holds and which DeepSpeed's
    pipeline engine does not record in frozen_param_shapes) are read from the layer file
    (test_deepspeed_frozen.py trains real ones). In a tied module's file they are refused,
    naming the file and the tensor, rather than dropped."""
    ckpt = pipes[FP32]
    # Layer 2 (a block) is on stage 0.
    save, tag = copy_of(ckpt, tmp_path / "buffer")
    layer = torch.load(tag / "layer_02-model_states.pt", weights_only=True)
    layer["running"] = torch.arange(4.0)
    layer["extra_norm.weight"] = torch.ones(16)
    torch.save(layer, tag / "layer_02-model_states.pt")
    states = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)
    states["buffer_names"] = [*(states.get("buffer_names") or []), "2.running"]
    torch.save(states, tag / "mp_rank_00_model_states.pt")
    r = run(reshard_bin, "gather", save, "-o", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert torch.equal(got["2.running"], torch.arange(4.0))
    assert torch.equal(got["2.extra_norm.weight"], torch.ones(16))
    r = run(reshard_bin, "inspect", save)
    assert "2.running" in r.stdout and "(buffer, F32)" in r.stdout, r.stdout
    assert "2.extra_norm.weight" in r.stdout and "(frozen, F32)" in r.stdout, r.stdout
    save, tag = copy_of(ckpt, tmp_path / "tied")
    embed = torch.load(tag / "layer_00-model_states.pt", weights_only=True)
    embed["scale"] = torch.ones(1)
    torch.save(embed, tag / "layer_00-model_states.pt")
    refused_by_every_command(reshard_bin, save, tmp_path / "out-tied",
                             "layer_00-model_states.pt", '"scale"', "a tied module's")


def test_stray_layer_files_are_refused(pipes, tmp_path, reshard_bin):
    """DeepSpeed's loader globs a layer's files, so a file the checkpoint's stages do not
    account for is refused, naming it: a second copy of the tied embedding's file, a layer
    no stage lists holding tensors, a TP rank past the checkpoint's, and a file named without
    a TP rank beside files that name one."""
    ckpt = pipes[FP32]
    save, tag = copy_of(ckpt, tmp_path / "tied")
    shutil.copy(tag / "layer_00-model_states.pt", tag / "layer_05-model_states.pt")
    refused(reshard_bin, save, tmp_path / "out-tied", "layer_00-model_states.pt",
            "layer_05-model_states.pt", 'could both hold tied module "embed"')
    save, tag = copy_of(ckpt, tmp_path / "layer")
    shutil.copy(tag / "layer_02-model_states.pt", tag / "layer_09-model_states.pt")
    refused(reshard_bin, save, tmp_path / "out-layer", "layer_09-model_states.pt",
            "none a stage lists parameters of")
    tp2 = pipes[TP2]
    for name, stray in (("rank", "layer_02-model_02-model_states.pt"),
                        ("plain", "layer_02-model_states.pt")):
        save, tag = copy_of(tp2, tmp_path / name)
        shutil.copy(tag / "layer_02-model_01-model_states.pt", tag / stray)
        refused(reshard_bin, save, tmp_path / f"out-{name}", stray, "no layer file of a checkpoint")


def test_partitioning_the_files_do_not_have_is_refused(pipes, tmp_path, reshard_bin):
    """partition_count and group_paddings are what DeepSpeed's loader cuts the partitions by:
    values every optimizer file records alike but that disagree with the files (DP 2, each
    rank's partition) are refused, naming the key."""
    ckpt = pipes[FP32]
    for key, value, message in (("partition_count", 2**31, "partition_count[0] is 2147483648"),
                                ("group_paddings", 2**40, "group_paddings[0] is 1099511627776")):
        save, tag = copy_of(ckpt, tmp_path / key)
        for f in sorted(tag.glob("zero_pp_rank_*_optim_states.pt")):
            states = torch.load(f, weights_only=False)
            states["optimizer_state_dict"][key] = [value]
            torch.save(states, f)
        refused(reshard_bin, save, tmp_path / f"out-{key}",
                "zero_pp_rank_0_mp_rank_00_optim_states.pt", message)


# ---- convert --pp: a DeepSpeed pipeline checkpoint at another PP x TP x DP ------------------

# (source, pp, tp, dp, --pp-stages, the partition_method that gives those stages on resume)
PIPE_OUTPUTS = [
    (FP32, 1, 1, 2, None, "uniform"),
    (FP32, 2, 1, 1, None, "uniform"),  # DP 2 -> 1 at the same stages
    (FP32, 1, 1, 3, None, "uniform"),  # 4144 elements: padded to 4146, partitions of 1382
    (FP32, 4, 1, 1, (2, 1, 1, 2), "parameters"),  # uneven stages
    (TP2, 1, 1, 1, None, "uniform"),
    (TP2, 1, 2, 1, None, "uniform"),  # PP 2 -> 1 at TP 2: layer_XX-model_YY files
    (TP2, 3, 1, 1, (2, 1, 3), "type:Block"),  # uneven stages, TP 2 -> 1
    (BF16, 1, 1, 1, None, "uniform"),
    (PP1, 2, 1, 1, None, "uniform"),  # PP 1 -> 2: the tied embedding on both stages
]


def pipe_output_name(spec, pp, tp, dp, stages):
    split = "" if stages is None else "-" + "x".join(map(str, stages))
    return f"{spec.name}-to-pp{pp}-tp{tp}-dp{dp}{split}"


@pytest.fixture(scope="module")
def pipe_outputs(pipes, tmp_path_factory, reshard_bin):
    """{(spec, pp, tp, dp, stages): reshard's pipeline checkpoint of spec at those degrees}."""
    base = tmp_path_factory.mktemp("pipe_outputs")
    out = {}
    for spec, pp, tp, dp, stages, _ in PIPE_OUTPUTS:
        dest = base / pipe_output_name(spec, pp, tp, dp, stages)
        cmd = ["convert", pipes[spec].save_dir, "--pp", pp, "--tp", tp, "--dp", dp, "-o", dest]
        if stages is not None:
            cmd += ["--pp-stages", ",".join(map(str, stages))]
        r = run(reshard_bin, *cmd)
        assert r.returncode == 0, r.stderr
        out[(spec, pp, tp, dp, stages)] = dest
    return out


def same_layout(a, b, path):
    """torch.load results alike but for the tensors' values: the same types, dict keys in
    order, tensors of the same dtype and shape, every other value equal."""
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.requires_grad) == (b.dtype, b.shape, b.requires_grad), path
    elif isinstance(a, dict):
        assert list(a) == list(b), (path, list(a), list(b))
        for k in a:
            same_layout(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same_layout(x, y, f"{path}.{i}")
    elif hasattr(a, "__dict__"):
        same_layout(vars(a), vars(b), path)
    else:
        assert a == b, (path, a, b)


def test_pipeline_output_is_laid_out_as_deepspeed_saves_it(pipes, pipe_outputs):
    """PP 2 x DP 2 -> PP 1 x DP 2: the files DeepSpeed itself saves when it trains the same
    model at PP 1 x DP 2, key for key (the values differ in the last bits: the two runs sum
    the tied embedding's gradients in another order)."""
    ours = pipe_outputs[(FP32, 1, 1, 2, None)]
    theirs = pipes[PP1].save_dir
    assert (ours / "latest").read_text() == (theirs / "latest").read_text()
    tag = pipes[PP1].tag
    assert [f.name for f in files(ours / tag)] == [f.name for f in files(theirs / tag)]
    for f in files(theirs / tag):
        same_layout(torch.load(ours / tag / f, weights_only=False),
                    torch.load(theirs / tag / f, weights_only=False), str(f))


@pytest.mark.parametrize("spec,pp,tp,dp,stages", [o[:5] for o in PIPE_OUTPUTS],
                         ids=lambda v: v.name if isinstance(v, PipeSpec) else str(v))
def test_pipeline_output_holds_every_weight_and_optimizer_state(pipes, converted, pipe_outputs,
                                                                tmp_path, reshard_bin, spec, pp,
                                                                tp, dp, stages):
    """Read back by reshard: the module's weights are the training run's, and its universal
    checkpoint's per-parameter files (fp32 masters, moments, step) are the source's, bit for
    bit."""
    from safetensors.torch import load_file

    out = pipe_outputs[(spec, pp, tp, dp, stages)]
    r = run(reshard_bin, "gather", out, "-o", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    want = pipes[spec].full()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    source = tmp_path / "source-uc"
    if spec in converted:
        source = converted[spec][0]
    else:
        r = run(reshard_bin, "convert", pipes[spec].save_dir, "--to", "universal", "-o", source)
        assert r.returncode == 0, r.stderr
    r = run(reshard_bin, "convert", out, "--to", "universal", "-o", tmp_path / "uc")
    assert r.returncode == 0, r.stderr
    zero = [root / (root / "latest_universal").read_text() / "zero"
            for root in (tmp_path / "uc", source)]
    assert files(zero[0]) == files(zero[1])
    for f in files(zero[0]):
        if f.parent.name:  # a parameter's folder (optimizer_state.pt records the partitions)
            same(torch.load(zero[0] / f, weights_only=False),
                 torch.load(zero[1] / f, weights_only=False), str(f))


@pytest.fixture(scope="module")
def resumed_from_pipeline(pipe_outputs, tmp_path_factory):
    """{output key: {dp_rank: next loss}} of DeepSpeed's load_checkpoint (no universal
    checkpoint) on reshard's pipeline outputs: one launch per world size."""
    base = tmp_path_factory.mktemp("pipe_output_resumed")
    by_world = {}
    for spec, pp, tp, dp, stages, partition in PIPE_OUTPUTS:
        key = (spec, pp, tp, dp, stages)
        by_world.setdefault(pp * tp * dp, []).append(
            (dataclasses.replace(spec, pp=pp, tp=tp, dp=dp, partition=partition),
             pipe_outputs[key], pipe_output_name(*key)))
    losses = {}
    for world, jobs in by_world.items():
        losses.update(resume_pipe_launch(world, jobs, base / f"world{world}", universal=False))
    return {o[:5]: losses[pipe_output_name(*o[:5])] for o in PIPE_OUTPUTS}


@pytest.mark.parametrize("spec,pp,tp,dp,stages", [o[:5] for o in PIPE_OUTPUTS],
                         ids=lambda v: v.name if isinstance(v, PipeSpec) else str(v))
def test_deepspeed_resumes_from_the_pipeline_output(pipes, resumed_from_pipeline, spec, pp, tp,
                                                    dp, stages):
    """DeepSpeed's own loader (layer files, the stage's ZeRO partitions) at the new PP x TP x
    DP, with the partition_method that gives the stages: the training run's next-step loss,
    bit for bit at the run's TP degree, on every DP rank."""
    assert_next_loss(resumed_from_pipeline[(spec, pp, tp, dp, stages)], pipes[spec].next_loss[0],
                     spec.tp, tp, dp)


def test_pipeline_degrees_that_do_not_fit_are_refused(pipes, tmp_path, reshard_bin):
    """The toy model has 6 layers (5 layer files and the tied output projection): a stage list
    must sum to 6, one per stage; --pp takes a DeepSpeed PipelineModule checkpoint only."""
    save = pipes[FP32].save_dir
    out = tmp_path / "out"
    cases = [
        (["--pp", 7], "7 pipeline stages for a model of 6 layers"),
        (["--pp", 2, "--pp-stages", "3,2"], "the stage list sums to 5 layers, but the model has 6"),
        (["--pp", 2, "--pp-stages", "3,2,1"], "the stage list gives 3 stages, not 2"),
        (["--pp", 2, "--pp-stages", "6,0"], "--pp-stages"),
        (["--pp", 2, "--to", "universal"], "--pp"),
        (["--pp-stages", "3,3", "--tp", 1], "--pp-stages and --dp apply to --pp"),
        (["--pp", 2, "--pp-stages", "3,3,"], 'is not a layer count from 1 to 1048576'),
        (["--pp", 2, "--pp-stages", ",3,3"], 'is not a layer count from 1 to 1048576'),
        (["--pp", 1, "--dequantize"], "no --dequantize"),
        (["--pp", 1, "--dp", 65537], "--dp"),
    ]
    for args, message in cases:
        r = run(reshard_bin, "convert", save, *args, "-o", out)
        assert r.returncode == 2, (args, r.stderr)
        assert message in r.stderr, (args, r.stderr)
        assert not out.exists() and not list(out.parent.glob(f".{out.name}*")), args
    r = run(reshard_bin, "gather", save, "-o", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    r = run(reshard_bin, "convert", tmp_path / "hf", "--pp", 2, "-o", out)
    assert r.returncode == 2 and "is not a DeepSpeed checkpoint" in r.stderr, r.stderr
    assert not out.exists()
    r = run(reshard_bin, "convert", pipes[ZERO0].save_dir, "--pp", 1, "-o", out)
    assert r.returncode == 2 and "no param_shapes (ZeRO 0)" in r.stderr, r.stderr
    assert not out.exists()


def test_replicas_that_disagree_stop_a_new_tp_degree(pipes, tmp_path, reshard_bin):
    """At a new TP degree each shard is moved from only the source shards it overlaps, so a
    replica no move reads must still be compared: TP rank 1's first moment of one norm weight
    (whole on every TP rank) changed in its optimizer partition stops `--pp 1 --tp 1`, with
    or without `--no-verify-replicas` (files of another run or step), naming the parameter and
    both ranks, with nothing written."""
    save, tag = copy_of(pipes[TP2], tmp_path / "replicas")
    path = tag / "zero_pp_rank_0_mp_rank_01_optim_states.pt"  # stage 0, TP rank 1
    optim = torch.load(path, weights_only=False)
    sd = optim["optimizer_state_dict"]
    mappings = sd["param_slice_mappings"][0]
    name = next(n for n in mappings if n.endswith("norm.weight"))
    sd["base_optimizer_state"]["state"][0]["exp_avg"][mappings[name].start + 1] += 1.0
    torch.save(optim, path)
    out = tmp_path / "out"
    for flags in ([], ["--no-verify-replicas"]):
        r = run(reshard_bin, "convert", save, "--pp", 1, "--tp", 1, *flags, "-o", out)
        assert r.returncode in (1, 2), r.stderr
        assert f'parameter "{name}"' in r.stderr and "element 1 of its exp_avg" in r.stderr, \
            r.stderr
        assert "on TP rank 1 but" in r.stderr, r.stderr
        assert not out.exists() and not list(out.parent.glob(f".{out.name}*"))


def test_the_python_package_writes_the_pipeline_output_as_the_cli_does(pipes, pipe_outputs,
                                                                       tmp_path):
    import reshard.checkpoint

    from test_crash_consistency import tree_digest

    reshard.checkpoint.convert(pipes[FP32].save_dir, tmp_path / "pp4", pp=4, pp_stages=[2, 1, 1, 2])
    assert tree_digest(tmp_path / "pp4") == tree_digest(pipe_outputs[(FP32, 4, 1, 1, (2, 1, 1, 2))])
    with pytest.raises(reshard.CheckpointError, match="the stage list sums to 5 layers"):
        reshard.checkpoint.convert(pipes[FP32].save_dir, tmp_path / "bad", pp=2, pp_stages=[3, 2])
    with pytest.raises(ValueError, match="dp= and pp_stages= apply to pp="):
        reshard.checkpoint.convert(pipes[FP32].save_dir, tmp_path / "bad", dp=2)
    assert not (tmp_path / "bad").exists()


def test_force_replaces_a_pipeline_output_but_not_a_save_dir(pipes, pipe_outputs, tmp_path,
                                                             reshard_bin):
    from test_crash_consistency import tree_digest

    out = tmp_path / "out"
    shutil.copytree(pipe_outputs[(FP32, 2, 1, 1, None)], out)
    r = run(reshard_bin, "convert", pipes[FP32].save_dir, "--pp", 1, "--dp", 2, "-o", out,
            "--force")
    assert r.returncode == 0, r.stderr
    assert tree_digest(out) == tree_digest(pipe_outputs[(FP32, 1, 1, 2, None)])
    save, _ = copy_of(pipes[FP32], tmp_path / "save")  # DeepSpeed's: zero_to_fp32.py beside
    before = tree_digest(save)
    r = run(reshard_bin, "convert", pipes[FP32].save_dir, "--pp", 1, "-o", save, "--force")
    assert r.returncode == 2 and "zero_to_fp32.py" in r.stderr, r.stderr
    assert tree_digest(save) == before
