"""convert --to dcp: PyTorch Distributed Checkpoints written by reshard, read back by torch's own
torch.distributed.checkpoint (load at world 1 in this process and at world 3 under torchrun,
format_utils.dcp_to_torch_save), bit for bit equal to the source."""

import json
import os
import pickle
import resource
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import reshard
from conftest import BUILD
from dcp_load_worker import bits, nest
from ds_checkpoints import HERE, Spec, free_loopback_port

# Source layouts of every kind the maps express: a padded vocabulary, a split along dim 1, a
# pre-divided (scaled) bias, replicated tensors; the optimizer's moments take their
# parameter's.
LAYOUTS = {
    "version": 1,
    "embed.weight": {"family": "padded_vocab", "dim": 0},
    "mlp.down.weight": {"family": "split", "dim": 1},
    "mlp.down.bias": {"family": "replicated", "pre_divided": True},
    "*": {"family": "replicated"},
}


def model():
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {
        "embed.weight": r(50, 16).bfloat16(),       # 50 rows at 4 ranks: 13, 13, 13, 11
        "mlp.down.weight": r(16, 48).bfloat16(),
        "mlp.down.weight.exp_avg": r(16, 48),
        "mlp.down.weight.exp_avg_sq": r(16, 48).abs(),
        "mlp.down.bias": r(16),
        "norm.weight": r(16).bfloat16(),
        "tiny": r(2, 16),                            # dim 0 below the world size
        "five": r(5),                                # 5 rows at 4 ranks: 2, 2, 1, none
        "scalar": torch.tensor(3.25),                # 0-d
        "empty": torch.zeros(0, 16),                 # no elements
    }


def dcp_key(name, names=tuple(model())):  # noqa: B008 (the names, computed once)
    """The DCP key of tensor `name` among `names`: "<param>.<state>" of another tensor "<param>"
    is that tensor's optimizer state."""
    base = name
    while "." in base:
        base = base.rsplit(".", 1)[0]
        if base in names:
            return f"optim.state.{base}.{name[len(base) + 1:]}"
    return name


def same_dcp_output(out, written, planner_data=False):
    """`out` holds the same four data files as `written`, byte for byte, and the same
    metadata records (and planner data, when asked)."""
    for r in range(4):
        name = f"__{r}_0.distcp"
        assert (out / name).read_bytes() == (written / name).read_bytes()
    a = pickle.loads((out / ".metadata").read_bytes())
    b = pickle.loads((written / ".metadata").read_bytes())
    assert a.state_dict_metadata == b.state_dict_metadata and a.storage_data == b.storage_data
    if planner_data:
        assert a.planner_data == b.planner_data


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def run(reshard_bin, *args):
    return subprocess.run([reshard_bin, *map(str, args)], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, reshard_bin):
    """The model scattered to 2 ranks, and the model itself."""
    d = tmp_path_factory.mktemp("dcp_source")
    (d / "full").mkdir()
    save_file(model(), str(d / "full" / "model.safetensors"), metadata={"format": "pt"})
    (d / "layouts.json").write_text(json.dumps(LAYOUTS))
    r = run(reshard_bin, "scatter", d / "full", "--layouts", d / "layouts.json", "--tp", 2,
            "-o", d / "tp2")
    assert r.returncode == 0, r.stderr
    return d / "tp2", model()


@pytest.fixture(scope="module")
def written(sharded, tmp_path_factory, reshard_bin):
    src, _ = sharded
    out = tmp_path_factory.mktemp("dcp_out") / "dcp"
    r = run(reshard_bin, "convert", src, "--to", "dcp", "--world", 4, "-o", out)
    assert r.returncode == 0, r.stderr
    return out


def load_at_world_1(ckpt, source):
    """dcp.load in this process (no process group) into plain tensors laid out as a model's
    state dict plus an optimizer's nested state; returns them by DCP key."""
    flat = {dcp_key(n, source): torch.zeros_like(t) for n, t in source.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(nest(flat), checkpoint_id=str(ckpt))
    return flat


def test_files_and_chunks_are_fsdp2s_dim0_chunks(written, sharded):
    _, source = sharded
    assert sorted(os.listdir(written)) == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
    md = pickle.loads((written / ".metadata").read_bytes())
    assert md.version == "1.0.0"
    assert isinstance(md.storage_meta.checkpoint_id, str)
    assert sorted(md.state_dict_metadata) == sorted(dcp_key(n) for n in source)
    for name, t in source.items():
        entry = md.state_dict_metadata[dcp_key(name)]
        assert entry.size == t.shape and entry.properties.dtype == t.dtype
        if t.numel() == 0 or t.dim() == 0:  # whole, on rank 0
            assert [(c.offsets, c.sizes) for c in entry.chunks] == [((0,) * t.dim(), t.shape)]
            continue
        want = [c.shape[0] for c in torch.chunk(t, 4, dim=0)]  # torch.chunk: ceil-sized
        assert [c.sizes[0] for c in entry.chunks] == want, name
        assert [c.offsets[0] for c in entry.chunks] == [sum(want[:i]) for i in range(len(want))]
    # Each chunk lies in the file of its rank, in order.
    files = {k.fqn: [] for k in md.storage_data}
    for index, info in md.storage_data.items():
        files[index.fqn].append(info.relative_path)
    assert files["five"] == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    assert files["scalar"] == files["empty"] == ["__0_0.distcp"]


def test_torch_loads_it_at_world_1_bit_for_bit(written, sharded):
    _, source = sharded
    got = load_at_world_1(written, source)
    for name, t in source.items():
        assert same(got[dcp_key(name)], t), name


def test_dcp_to_torch_save_reads_it_whole(written, sharded, tmp_path):
    _, source = sharded
    dcp_to_torch_save(str(written), str(tmp_path / "all.pt"))
    got = torch.load(tmp_path / "all.pt", weights_only=True)
    assert sorted(got) == sorted({dcp_key(n).split(".")[0] if dcp_key(n) != n else n
                                  for n in source})
    for name, t in source.items():
        key = dcp_key(name)
        if key.startswith("optim.state."):
            param, state = key[len("optim.state."):].rsplit(".", 1)
            assert same(got["optim"]["state"][param][state], t), name
        else:
            assert same(got[key], t), name


def test_torch_loads_it_at_world_3_as_dtensors_and_plain_tensors(written, sharded, tmp_path):
    _, source = sharded
    expected = tmp_path / "expected.safetensors"
    save_file({dcp_key(n): t for n, t in source.items()}, str(expected),
              metadata={"plain": "norm.weight,optim.state.mlp.down.weight.exp_avg"})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BUILD / "python"), str(HERE)]),
               OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore")
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3",
         "--master_addr", "127.0.0.1", "--master_port", str(free_loopback_port()),
         str(HERE / "dcp_load_worker.py"), str(written), str(expected), str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in range(3):
        result = json.loads((tmp_path / "out" / f"rank-{rank}.json").read_text())
        assert result["checked"] == sorted(dcp_key(n) for n in source)
        assert result["mismatch"] == [], rank


def test_any_world_size_writes_what_torch_reads(sharded, reshard_bin, tmp_path):
    src, source = sharded
    for world in (1, 3, 7):
        out = tmp_path / f"w{world}"
        r = run(reshard_bin, "convert", src, "--to", "dcp", "--world", world, "-o", out)
        assert r.returncode == 0, r.stderr
        assert len([f for f in os.listdir(out) if f.endswith(".distcp")]) == world
        got = load_at_world_1(out, source)
        for name, t in source.items():
            assert same(got[dcp_key(name)], t), (world, name)


def test_memory_follows_the_chunks_written_not_the_world_size(sharded, reshard_bin, tmp_path):
    # At 32768 ranks the model's 10 small tensors are 139 chunks (most ranks hold no rows of
    # any): each tensor's plan is made over its chunks, not over every rank, so the run fits in
    # 512 MiB of address space (planned over the ranks it took ~2.4 KB per tensor and rank,
    # 32768 ranks out of memory at 4 GB). Every file is still written, and torch reads it.
    src, source = sharded
    out = tmp_path / "w32768"
    limit = 512 << 20
    r = subprocess.run([reshard_bin, "convert", str(src), "--to", "dcp", "--world", "32768",
                        "-o", str(out)], capture_output=True, text=True, timeout=300,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    assert r.returncode == 0, r.stderr
    assert len([f for f in os.listdir(out) if f.endswith(".distcp")]) == 32768
    got = load_at_world_1(out, source)
    for name, t in source.items():
        assert same(got[dcp_key(name)], t), name


def test_a_hugging_face_dir_converts_as_well(sharded, reshard_bin, tmp_path):
    src, source = sharded
    out = tmp_path / "from_hf"
    r = run(reshard_bin, "convert", src.parent / "full", "--to", "dcp", "--world", 3, "-o", out)
    assert r.returncode == 0, r.stderr
    got = load_at_world_1(out, source)
    for name, t in source.items():
        assert same(got[dcp_key(name)], t), name


def test_python_api_writes_what_the_cli_writes(written, sharded, tmp_path):
    src, source = sharded
    out = tmp_path / "api"
    reshard.checkpoint.convert(src, out, to="dcp", world=4)
    same_dcp_output(out, written)
    with pytest.raises(ValueError, match="world"):
        reshard.checkpoint.convert(src, tmp_path / "x", to="dcp")
    with pytest.raises(ValueError, match="tp"):
        reshard.checkpoint.convert(src, tmp_path / "x", to="dcp", world=2, tp=2)
    assert not (tmp_path / "x").exists()


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed")
def test_k_processes_write_what_one_does(written, sharded, tmp_path):
    src, _ = sharded
    out = tmp_path / "mpi"
    r = subprocess.run([shutil.which("mpirun"), "--allow-run-as-root", "--oversubscribe", "-n",
                        "3", str(BUILD / "tools" / "reshard" / "reshard"), "convert", str(src),
                        "--to", "dcp", "--world", "4", "-o", str(out), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert sorted(f for p in report["processes"] for f in p["files"]) == \
        [f"__{r}_0.distcp" for r in range(4)]
    assert all(p["files"] for p in report["processes"])  # each process wrote its share
    same_dcp_output(out, written, planner_data=True)


def test_an_existing_output_is_replaced_only_with_force_and_only_if_reshard_wrote_it(
        sharded, reshard_bin, tmp_path):
    src, _ = sharded
    out = tmp_path / "dcp"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    args = ["convert", src, "--to", "dcp", "--world", 2, "-o", out]
    r = run(reshard_bin, *args)
    assert r.returncode != 0 and "exists" in r.stderr
    r = run(reshard_bin, *args, "--force")
    assert r.returncode != 0 and "notes.txt" in r.stderr
    assert (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    assert run(reshard_bin, *args, "--force").returncode == 0
    r = run(reshard_bin, *args)
    assert r.returncode != 0 and "exists" in r.stderr
    # A DCP output of reshard's is replaced with --force, at another world size too.
    args[5] = 3
    r = run(reshard_bin, *args, "--force")
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(out)) == [".metadata"] + [f"__{r}_0.distcp" for r in range(3)]
    # Nothing is left beside it.
    assert sorted(os.listdir(tmp_path)) == ["dcp"]


def test_force_never_replaces_a_dcp_dir_reshard_did_not_write(sharded, written, reshard_bin,
                                                              tmp_path):
    src, _ = sharded
    prefix = (written / ".metadata").read_bytes()[:48]
    # A checkpoint torch wrote, its .metadata re-pickled at protocol 2 (torch still loads it):
    # it begins as reshard's do.
    theirs = tmp_path / "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(8.0)}, checkpoint_id=str(theirs), no_dist=True)
    md = pickle.loads((theirs / ".metadata").read_bytes())
    (theirs / ".metadata").write_bytes(pickle.dumps(md, protocol=2))
    assert (theirs / ".metadata").read_bytes().startswith(prefix)
    back = {"w": torch.zeros(8)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(back, checkpoint_id=str(theirs), no_dist=True)
    assert torch.equal(back["w"], torch.arange(8.0))
    # A folder of a user's files, the first beginning with those bytes.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / ".metadata").write_bytes(prefix + b"my notes")
    (mine / "__0_0.distcp").write_bytes(b"my data")
    for target in (theirs, mine):
        before = {p.name: p.read_bytes() for p in target.iterdir()}
        r = run(reshard_bin, "convert", src, "--to", "dcp", "--world", 1, "-o", target, "--force")
        assert r.returncode == 2, (target, r.stderr)
        assert "not an output of reshard" in r.stderr and ".metadata" in r.stderr, r.stderr
        assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    # What reshard writes carries its mark (StorageMeta.save_id), torch's a uuid.
    assert pickle.loads((written / ".metadata").read_bytes()).storage_meta.save_id == \
        "reshard/dcp-writer"
    assert md.storage_meta.save_id != "reshard/dcp-writer"


def test_a_models_tensors_stay_model_keys(reshard_bin, tmp_path):
    # "a.b" beside "a" (a module "a" with a parameter "b" and a parameter of its own), and
    # "a.step": what dcp.load(model.state_dict()) looks for; only exp_avg, exp_avg_sq and fp32
    # name optimizer state.
    tensors = {"a": torch.arange(4.0), "a.b": torch.arange(3.0), "a.b.c": torch.ones(2),
               "a.step": torch.full((2,), 2.0)}
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file(tensors, str(hf / "model.safetensors"))
    out = tmp_path / "dcp"
    r = run(reshard_bin, "convert", hf, "--to", "dcp", "--world", 2, "-o", out)
    assert r.returncode == 0, r.stderr
    md = pickle.loads((out / ".metadata").read_bytes())
    assert sorted(md.state_dict_metadata) == sorted(tensors)
    back = {n: torch.zeros_like(t) for n, t in tensors.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(back, checkpoint_id=str(out), no_dist=True)
    assert all(torch.equal(back[n], t) for n, t in tensors.items())


def test_conflicting_options_are_refused(sharded, reshard_bin, tmp_path):
    src, _ = sharded
    for extra, message in ((["--tp", 2], "--tp"), ([], "--world"),
                           (["--world", 2, "--max-shard-size", "1MB"], "--max-shard-size"),
                           (["--world", 2, "--weights-only"], "optimizer state out")):
        r = run(reshard_bin, "convert", src, "--to", "dcp", *extra, "-o", tmp_path / "o")
        assert r.returncode == 2, (extra, r.stderr)
        assert message in r.stderr, (extra, r.stderr)
    r = run(reshard_bin, "convert", src, "--tp", 2, "--world", 2, "-o", tmp_path / "o")
    assert r.returncode == 2 and "--world" in r.stderr
    assert not (tmp_path / "o").exists()


SPEC = Spec("llama", tp=2, dp=2, stage=1)  # trained once per session for several modules


def test_a_deepspeed_checkpoint_converts_with_its_optimizer_state(ds_checkpoint, reshard_bin,
                                                                  tmp_path):
    ckpt = ds_checkpoint(SPEC)
    out = tmp_path / "dcp"
    r = run(reshard_bin, "convert", ckpt.save_dir, "--to", "dcp", "--world", 3, "-o", out)
    assert r.returncode == 0, r.stderr
    # The optimizer state as reshard's own convert writes it (whole, at TP 1).
    r = run(reshard_bin, "convert", ckpt.save_dir, "--tp", 1, "-o", tmp_path / "tp1")
    assert r.returncode == 0, r.stderr
    tp1 = load_file(str(tmp_path / "tp1" / "model-rank-0-part-0.safetensors"))
    full = ckpt.full()
    assert set(full) < set(tp1)
    got = load_at_world_1(out, tp1)
    assert sorted(got) == sorted(
        list(full) + [f"optim.state.{n}.{s}" for n in full for s in ("fp32", "exp_avg", "exp_avg_sq")])
    for name, t in tp1.items():
        assert same(got[dcp_key(name, tp1)], t), name
    for name, t in full.items():  # the module's weights as the engine held them
        assert same(got[name], t), name
    # --weights-only: the module's weights alone.
    r = run(reshard_bin, "convert", ckpt.save_dir, "--to", "dcp", "--world", 2,
            "--weights-only", "-o", tmp_path / "weights")
    assert r.returncode == 0, r.stderr
    md = pickle.loads((tmp_path / "weights" / ".metadata").read_bytes())
    assert sorted(md.state_dict_metadata) == sorted(full)
