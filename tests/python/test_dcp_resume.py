"""Resume where the trainer left off: a checkpoint saved as TorchTitan's checkpointer saves one
(FSDP2, `dcp.save` of {"model", "optim"} from `get_state_dict` beside the scheduler's, the data
loader's and the training step's non-tensor state), re-sharded by `convert --to dcp`, is loaded
whole by a fresh trainer at another world size (dcp.load of the same structure, then
set_state_dict), whose next step equals the source run's next step exactly: the same loss and
the same updated parameters, bit for bit (dcp_resume_worker.py). FSDP2 over tensor parallelism
resumes as from the source itself. Through a universal checkpoint (DCP -> universal -> DCP at 2
and 3 ranks) the model and the optimizer resume with the source's next step too."""

import json
import os
import pickle
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from conftest import BUILD
from ds_checkpoints import HERE, free_loopback_port

WORKER = HERE / "dcp_resume_worker.py"


def torchrun(world, *args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BUILD / "python"), str(HERE)]),
               OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore")
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
         "--master_addr", "127.0.0.1", "--master_port", str(free_loopback_port()),
         str(WORKER), *map(str, args)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-4000:]


def run(reshard_bin, *args):
    return subprocess.run([reshard_bin, *map(str, args)], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, reshard_bin):
    """The source run at world 2: its checkpoint, its next step (reference.pt), and its own
    resume from reshard's re-sharding at the same world (resumed-2.pt)."""
    out = tmp_path_factory.mktemp("resume")
    torchrun(2, "train", out, reshard_bin)
    return out


def converted(reshard_bin, trained, world, *flags):
    out = trained / f"world{world}{''.join(flags)}"
    if not out.exists():
        r = run(reshard_bin, "convert", trained / "ckpt", "--to", "dcp", "--world", world,
                *flags, "-o", out)
        assert r.returncode == 0, r.stderr
    return out


def assert_same_next_step(result, reference):
    assert torch.equal(result["loss"], reference["loss"]), (result["loss"], reference["loss"])
    assert sorted(result["params"]) == sorted(reference["params"])
    for name, p in reference["params"].items():
        assert torch.equal(result["params"][name], p), name
    assert result["restored"] == reference["restored"]


def reference(trained):
    return torch.load(trained / "reference.pt", weights_only=False)


def test_resumes_at_world_3_with_the_sources_next_step(trained, reshard_bin):
    ckpt = converted(reshard_bin, trained, 3)
    torchrun(3, "resume", trained, ckpt)
    assert_same_next_step(torch.load(trained / f"{ckpt.name}.pt", weights_only=False),
                          reference(trained))


def test_resumes_at_the_same_world(trained):
    assert (trained / "resumed-2.pt").exists(), (trained / "convert.txt").read_text()
    assert_same_next_step(torch.load(trained / "resumed-2.pt", weights_only=False),
                          reference(trained))


def test_resumes_at_world_1_in_one_process(trained, reshard_bin):
    import dcp_resume_worker

    ckpt = converted(reshard_bin, trained, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        result = dcp_resume_worker.resume(ckpt)
    assert_same_next_step(result, reference(trained))


def metadata(ckpt):
    with open(ckpt / ".metadata", "rb") as f:
        return pickle.load(f)


def item_bytes(ckpt, md, key):
    [info] = [v for k, v in md.storage_data.items() if k.fqn == key]
    with open(ckpt / info.relative_path, "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_keys_paths_and_non_tensor_items_are_the_sources(trained, reshard_bin, world, tmp_path):
    src, out = trained / "ckpt", converted(reshard_bin, trained, world)
    want, got = metadata(src), metadata(out)
    # Every key, of the same kind, with the path torch recorded (ints where a list was
    # traversed: ("optim", "param_groups", 0, "lr")).
    assert got.planner_data == want.planner_data
    assert ("optim", "param_groups", 0, "lr") in want.planner_data.values()
    assert {k: type(v) for k, v in got.state_dict_metadata.items()} == \
        {k: type(v) for k, v in want.state_dict_metadata.items()}
    objects = [k for k, v in want.state_dict_metadata.items()
               if isinstance(v, BytesStorageMetadata)]
    assert {"optim.param_groups.0.lr", "dataloader.position", "train_state.step",
            "lr_scheduler.last_epoch"} <= set(objects)
    for key in objects:
        assert item_bytes(out, got, key) == item_bytes(src, want, key), key
    for key, v in got.state_dict_metadata.items():
        if isinstance(v, TensorStorageMetadata):
            assert v.size == want.state_dict_metadata[key].size, key
            assert v.properties.dtype == want.state_dict_metadata[key].properties.dtype, key
    # torch's own reading of the whole structure (from planner_data) is the source's.
    dcp_to_torch_save(str(src), str(tmp_path / "src.pt"))
    dcp_to_torch_save(str(out), str(tmp_path / "out.pt"))
    assert_same_tree(torch.load(tmp_path / "out.pt", weights_only=False),
                     torch.load(tmp_path / "src.pt", weights_only=False))


def assert_same_tree(got, want, where="state dict"):
    assert type(got) is type(want), where
    if isinstance(want, dict):
        assert list(got) == list(want) or sorted(map(str, got)) == sorted(map(str, want)), where
        for k in want:
            assert_same_tree(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_tree(g, w, f"{where}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want), where
    else:
        assert got == want, where


def test_weights_only_leaves_the_optimizers_items_out_and_keeps_the_rest(trained, reshard_bin):
    out = converted(reshard_bin, trained, 3, "--weights-only")
    keys = set(metadata(out).state_dict_metadata)
    assert not [k for k in keys if k.startswith("optim.")]
    assert {"model.tok_embeddings.weight", "dataloader.position", "train_state.step"} <= keys


@pytest.mark.parametrize("source", ["ckpt", "world3"])
def test_universal_checkpoint_holds_each_parameters_full_state(trained, reshard_bin, tmp_path,
                                                               source):
    """convert --to universal of the FSDP2 checkpoint (and of its re-sharding at 3 ranks):
    per parameter fp32.pt, exp_avg.pt, exp_avg_sq.pt ({"param": full tensor}) and step.pt,
    and optimizer_state.pt's param_groups, all equal to torch's own reading of the source."""
    src = trained / "ckpt" if source == "ckpt" else converted(reshard_bin, trained, 3)
    r = run(reshard_bin, "convert", src, "--to", "universal", "-o", tmp_path / "uc")
    assert r.returncode == 0, r.stderr
    folder = f"{src.name}_universal"
    assert (tmp_path / "uc" / "latest_universal").read_text() == folder
    dcp_to_torch_save(str(trained / "ckpt"), str(tmp_path / "src.pt"))
    want = torch.load(tmp_path / "src.pt", weights_only=False)
    zero = tmp_path / "uc" / folder / "zero"
    names = sorted(want["optim"]["state"])
    assert sorted(p.name for p in zero.iterdir() if p.is_dir()) == names
    for name in names:
        files = {f.stem: torch.load(f, weights_only=False) for f in (zero / name).iterdir()}
        assert sorted(files) == ["exp_avg", "exp_avg_sq", "fp32", "step"], name
        fp32 = files["fp32"]["param"]
        assert list(files["fp32"]) == ["param"] and fp32.requires_grad, name
        assert fp32.dtype == torch.float32 and torch.equal(fp32, want["model"][name]), name
        for state in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(files[state]["param"], want["optim"]["state"][name][state]), name
        assert torch.equal(files["step"], want["optim"]["state"][name]["step"]), name
    optimizer = torch.load(zero / "optimizer_state.pt", weights_only=False)
    assert optimizer == {"param_groups": want["optim"]["param_groups"]}


def test_python_api_writes_what_the_cli_writes(trained, reshard_bin, tmp_path):
    import reshard

    reshard.checkpoint.convert(trained / "ckpt", tmp_path / "py3", to="dcp", world=3)
    reshard.checkpoint.convert(trained / "ckpt", tmp_path / "pyuc", to="universal")
    cli = converted(reshard_bin, trained, 3)
    assert metadata(tmp_path / "py3").planner_data == metadata(cli).planner_data
    for f in cli.iterdir():
        if f.name != ".metadata":
            assert (tmp_path / "py3" / f.name).read_bytes() == f.read_bytes(), f.name
    zero = tmp_path / "pyuc" / "ckpt_universal" / "zero"
    assert (zero / "tok_embeddings.weight" / "fp32.pt").exists()
    assert (zero / "optimizer_state.pt").exists()


@pytest.mark.parametrize("to", [["dcp", "--world", "3"], ["universal"]])
def test_k_processes_write_what_one_does(trained, reshard_bin, tmp_path, to):
    """Under mpirun each process writes its share of the files (rank 0's, with the bytes items,
    by one of them) and process 0 the metadata: the same checkpoint as one process writes."""
    one, many = tmp_path / "one", tmp_path / "many"
    assert run(reshard_bin, "convert", trained / "ckpt", "--to", *to, "-o", one).returncode == 0
    r = subprocess.run([shutil.which("mpirun"), "--allow-run-as-root", "--oversubscribe", "-n",
                        "2", reshard_bin, "convert", str(trained / "ckpt"), "--to", *to, "-o",
                        str(many), "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert all(p["files"] for p in json.loads(r.stdout)["processes"])  # each wrote its share
    files = sorted(p.relative_to(one) for p in one.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(many) for p in many.rglob("*") if p.is_file())
    for f in files:
        if f.name == ".metadata":  # it names its own path (storage_meta.checkpoint_id)
            a, b = metadata(one), metadata(many)
            assert (a.planner_data, a.storage_data, a.state_dict_metadata) == \
                (b.planner_data, b.storage_data, b.state_dict_metadata)
        else:
            assert (one / f).read_bytes() == (many / f).read_bytes(), f


@pytest.fixture(scope="module")
def trained_tp(tmp_path_factory):
    """FSDP2 over TP on a (dp 2, tp 2) mesh at 4 ranks: its checkpoint (2-D boxes)."""
    out = tmp_path_factory.mktemp("resume_tp")
    torchrun(4, "train-tp", out)
    return out


def test_fsdp2_over_tp_resumes_at_world_3_as_from_the_source_itself(trained_tp, reshard_bin):
    """A step without TP sums a row-wise layer's products in another order than the TP run, so
    the reference is torch's own re-sharding on load: the trainer at 3 ranks resumed from the
    source itself. From reshard's re-sharding it takes the same step, bit for bit."""
    ckpt = converted(reshard_bin, trained_tp, 3)
    assert metadata(ckpt).planner_data == metadata(trained_tp / "ckpt").planner_data
    torchrun(3, "resume", trained_tp, trained_tp / "ckpt", ckpt)
    source = torch.load(trained_tp / "ckpt.pt", weights_only=False)
    assert source["restored"]["step"] == 3  # the source loaded whole too
    assert_same_next_step(torch.load(trained_tp / f"{ckpt.name}.pt", weights_only=False), source)


def test_universal_checkpoint_converted_to_dcp_resumes_as_the_source_run(trained, reshard_bin,
                                                                          tmp_path):
    """DCP -> universal -> DCP at 2 and 3 ranks: the structure get_state_dict gives the FSDP2
    model and AdamW ("model.<fqn>" the fp32 masters, "optim.state.<fqn>.{step,exp_avg,
    exp_avg_sq}", "optim.param_groups.<g>.<key>" with "params" the fqns), from the universal
    checkpoint's files (step.pt, zero/optimizer_state.pt). A fresh trainer loads the whole
    {"model", "optim"} structure (dcp.load, set_state_dict) and takes the source run's next
    step bit for bit: its loss, and the parameters AdamW updates with the loaded step (bias
    correction), learning rate and weight decay. Exact, not within a tolerance: every step of
    this trainer is the single-process one at any world size (dcp_resume_worker.py), and the
    universal files hold the source's tensors unchanged (fp32 in, fp32 out)."""
    uc = tmp_path / "uc"
    r = run(reshard_bin, "convert", trained / "ckpt", "--to", "universal", "-o", uc)
    assert r.returncode == 0, r.stderr
    source = metadata(trained / "ckpt")
    kept = {k for k in source.state_dict_metadata if k.split(".")[0] in ("model", "optim")}
    ckpts = []
    for world in (2, 3):
        out = tmp_path / f"uc-world{world}"
        r = run(reshard_bin, "convert", uc, "--to", "dcp", "--world", world, "-o", out)
        assert r.returncode == 0, r.stderr
        md = metadata(out)
        assert set(md.state_dict_metadata) == kept  # the keys get_state_dict saved, no others
        for key in kept:
            assert md.planner_data[key] == source.planner_data[key], key
            assert type(md.state_dict_metadata[key]) is type(source.state_dict_metadata[key])
        ckpts.append(out)
    want = reference(trained)
    want["restored"] = {"param_groups": want["restored"]["param_groups"]}
    for world, ckpt in zip((2, 3), ckpts):
        torchrun(world, "resume-optim", tmp_path, ckpt)
        got = torch.load(tmp_path / f"{ckpt.name}.pt", weights_only=False)
        assert_same_next_step(got, want)
