"""Orbax checkpoints -> Hugging Face, reshard sharded and DCP, on checkpoints Orbax itself saves.

orbax-checkpoint (in .venv-jax, see orbax_worker.py) saves pytrees of every dtype reshard reads
on (2, 4) and (8,) meshes of 8 CPU devices, with sharded, multi-axis, replicated and
sub-chunked (chunk_byte_size) arrays, in the three storage variants (OCDBT + zarr v2, OCDBT +
zarr v3, per-array zarr with zstd and uncompressed chunks), once from two jax.distributed
processes (a database per process, merged), and restores each itself: what
reshard gathers is bit-equal to Orbax's own restore, also through a convert at another world
size and through a PyTorch Distributed Checkpoint (read back by torch's own dcp_to_torch_save).
"""

import json
import os
import pathlib
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
CASES = ["ocdbt_zarr2", "ocdbt_zarr3", "zarr2", "zarr3", "root", "two_processes"]


def run(reshard_bin, *args):
    return subprocess.run([reshard_bin, *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def jax_python():
    python = os.environ.get("RESHARD_JAX_PYTHON", str(REPO / ".venv-jax" / "bin" / "python"))
    assert pathlib.Path(python).exists(), (
        f"{python} is missing: scripts/dev test installs JAX and Orbax there (setup_jax_venv), "
        "or point RESHARD_JAX_PYTHON at a Python that has them")
    return python


@pytest.fixture(scope="session")
def orbax_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("orbax")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    r = subprocess.run([jax_python(), str(HERE / "orbax_worker.py"), str(out)], capture_output=True,
                       text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return out


def truth(orbax_dir, case):
    """Orbax's restore: {name: (safetensors dtype, shape, bytes)}."""
    d = orbax_dir / f"{case}.truth"
    index = json.loads((d / "truth.json").read_text())
    return {name: (dtype, shape, (d / f"{name}.bin").read_bytes())
            for name, (dtype, shape) in index.items()}


def raw(t):
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.dim() else \
        t.reshape(1).view(torch.uint8).numpy().tobytes()


def st_dtype(t):
    return {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
            torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL", torch.int32: "I32",
            torch.float8_e4m3fn: "F8_E4M3"}[t.dtype]


def gathered(out):
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def assert_equal_to_truth(tensors, want):
    assert sorted(tensors) == sorted(want)
    for name, (dtype, shape, data) in want.items():
        t = tensors[name]
        assert st_dtype(t) == dtype, name
        assert list(t.shape) == shape, name
        assert raw(t) == data, name


def item_of(orbax_dir, case):
    return orbax_dir / case


@pytest.mark.parametrize("case", CASES)
def test_gather_is_bit_equal_to_orbax_restore(reshard_bin, orbax_dir, tmp_path, case):
    r = run(reshard_bin, "gather", item_of(orbax_dir, case), "-o", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    assert_equal_to_truth(gathered(tmp_path / "hf"), truth(orbax_dir, case))


def test_inspect_shows_mesh_specs_and_chunking(reshard_bin, orbax_dir):
    r = run(reshard_bin, "inspect", "--json", orbax_dir / "ocdbt_zarr2")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)["orbax"]
    assert doc["storage"] == "ocdbt+zarr2"
    assert doc["devices"] == list(range(8))
    arrays = {a["name"]: a for a in doc["arrays"]}
    emb = arrays["params.embed.embedding"]
    assert emb["shape"] == [16, 12] and emb["dtype"] == "F32"
    assert emb["sharding"]["mesh_shape"] == [2, 4]
    assert emb["sharding"]["axis_names"] == ["fsdp", "tensor"]
    assert emb["sharding"]["partition_spec"] == [["fsdp"], ["tensor"]]
    assert emb["write_shape"] == [8, 3]
    kernel = arrays["params.decoder.layers.0.kernel"]
    assert kernel["sharding"]["partition_spec"] == [[], ["fsdp", "tensor"]]
    assert arrays["params.decoder.layers.1.kernel"]["chunk_shape"] == [1, 3]
    assert arrays["step"]["shape"] == []
    text = run(reshard_bin, "inspect", orbax_dir / "ocdbt_zarr3")
    assert text.returncode == 0, text.stderr
    assert "ocdbt+zarr3" in text.stdout and "mesh data=8" in text.stdout
    assert "P('data', None)" in text.stdout


@pytest.mark.parametrize("case", ["ocdbt_zarr2", "zarr3"])
def test_convert_to_another_world_then_gather(reshard_bin, orbax_dir, tmp_path, case):
    r = run(reshard_bin, "convert", item_of(orbax_dir, case), "--tp", 3, "-o", tmp_path / "tp3")
    assert r.returncode == 0, r.stderr
    manifest = json.loads((tmp_path / "tp3" / "reshard.json").read_text())
    assert manifest["world_size"] == 3
    r = run(reshard_bin, "gather", tmp_path / "tp3", "-o", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    assert_equal_to_truth(gathered(tmp_path / "hf"), truth(orbax_dir, case))


def test_convert_to_dcp_reads_back_in_torch(reshard_bin, orbax_dir, tmp_path):
    r = run(reshard_bin, "convert", orbax_dir / "ocdbt_zarr3", "--to", "dcp", "--world", 2, "-o",
            tmp_path / "dcp")
    assert r.returncode == 0, r.stderr
    dcp_to_torch_save(str(tmp_path / "dcp"), str(tmp_path / "state.pt"))
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    assert_equal_to_truth(state, truth(orbax_dir, "ocdbt_zarr3"))


def test_optimizer_state_comes_along_in_convert_not_in_gather(reshard_bin, orbax_dir, tmp_path):
    want = truth(orbax_dir, "optimizer")
    r = run(reshard_bin, "gather", orbax_dir / "optimizer", "-o", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    weights = {k: v for k, v in want.items() if not k.startswith("opt_state.")}
    assert len(weights) < len(want)
    assert_equal_to_truth(gathered(tmp_path / "hf"), weights)
    r = run(reshard_bin, "gather", orbax_dir / "optimizer", "--optimizer-state", "-o",
            tmp_path / "hf-all")
    assert r.returncode == 0, r.stderr
    assert_equal_to_truth(gathered(tmp_path / "hf-all"), want)
    r = run(reshard_bin, "convert", orbax_dir / "optimizer", "--tp", 2, "-o", tmp_path / "tp2")
    assert r.returncode == 0, r.stderr
    r = run(reshard_bin, "gather", tmp_path / "tp2", "-o", tmp_path / "all")
    assert r.returncode == 0, r.stderr
    assert_equal_to_truth(gathered(tmp_path / "all"), want)


@pytest.mark.parametrize("case", ["ocdbt_zarr2", "two_processes"])
def test_per_process_databases_without_the_merged_manifest(reshard_bin, orbax_dir, tmp_path,
                                                           case):
    item = tmp_path / "item"
    shutil.copytree(orbax_dir / case, item)
    (item / "manifest.ocdbt").unlink()
    shutil.rmtree(item / "d")
    r = run(reshard_bin, "inspect", "--json", item)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["orbax"]["storage"] == "ocdbt (per process)+zarr2"
    r = run(reshard_bin, "gather", item, "-o", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    assert_equal_to_truth(gathered(tmp_path / "hf"), truth(orbax_dir, case))


def corrupt(item, how):
    if how == "manifest_byte":
        p = item / "manifest.ocdbt"
        b = bytearray(p.read_bytes())
        b[len(b) // 2] ^= 0x40
        p.write_bytes(bytes(b))
    elif how == "manifest_truncated":
        p = item / "manifest.ocdbt"
        p.write_bytes(p.read_bytes()[:20])
    elif how == "node_file_truncated":
        for f in (item / "d").iterdir():
            f.write_bytes(f.read_bytes()[:10])
    elif how == "process_data_truncated":
        # the per-process databases alone, their data files cut in half
        (item / "manifest.ocdbt").unlink()
        shutil.rmtree(item / "d")
        for f in (item / "ocdbt.process_0" / "d").iterdir():
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif how == "metadata_not_json":
        (item / "_METADATA").write_text("{\"tree_metadata\": ")
    elif how == "sharding_bad_axis":
        p = item / "_sharding"
        text = p.read_text()
        bad = text.replace('partition_spec\\": [\\"fsdp\\"', 'partition_spec\\": [\\"nope\\"')
        assert bad != text
        p.write_text(bad)


@pytest.mark.parametrize("how", ["manifest_byte", "manifest_truncated", "node_file_truncated",
                                 "process_data_truncated", "metadata_not_json", "sharding_bad_axis"])
def test_corrupt_checkpoints_exit_2_and_write_nothing(reshard_bin, orbax_dir, tmp_path, how):
    item = tmp_path / "item"
    shutil.copytree(orbax_dir / "ocdbt_zarr2", item)
    corrupt(item, how)
    r = run(reshard_bin, "gather", item, "-o", tmp_path / "hf")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "item" in r.stderr
    assert not (tmp_path / "hf").exists()


def test_a_codec_reshard_does_not_read_is_refused_with_exit_1(reshard_bin, orbax_dir, tmp_path):
    item = tmp_path / "item"
    shutil.copytree(orbax_dir / "zarr2", item)
    zarray = item / "params.decoder.q" / ".zarray"
    meta = json.loads(zarray.read_text())
    meta["compressor"] = {"id": "blosc", "cname": "lz4"}
    zarray.write_text(json.dumps(meta))
    r = run(reshard_bin, "gather", item, "-o", tmp_path / "hf")
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "params.decoder.q/.zarray" in r.stderr and "blosc" in r.stderr
    assert not (tmp_path / "hf").exists()


def orbax_restore(*pairs):
    """Orbax's own restore of each (item, out) on the 8 CPU devices, leaf by leaf (as truth()),
    all in one process; with each, tensorstore's listing of the item's OCDBT databases, if any
    (orbax_worker.list_ocdbt: `out/ocdbt.json`)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    r = subprocess.run([jax_python(), str(HERE / "orbax_worker.py"), "restore",
                        *[str(p) for pair in pairs for p in pair]],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    restored = []
    for _, out in pairs:
        index = json.loads((out / "truth.json").read_text())
        restored.append({name: (dtype, shape, (out / f"{name}.bin").read_bytes())
                         for name, (dtype, shape) in index.items()})
    return restored


def test_convert_to_orbax_is_restored_by_orbax(reshard_bin, orbax_dir, tmp_path):
    """Orbax on a (2, 4) mesh -> reshard -> Orbax on an (8,) mesh with partition specs, and a
    Hugging Face checkpoint -> Orbax replicated: Orbax restores both bit-equal to the source."""
    specs = tmp_path / "specs.json"
    specs.write_text(json.dumps({"params.embed.*": ["data", None],
                                 "params.decoder.layers.0.kernel": [None, "data"],
                                 "*.mlp": [["data"], None], "*": None}))
    r = run(reshard_bin, "convert", orbax_dir / "ocdbt_zarr2", "--to", "orbax", "--mesh",
            "data=8", "--partition-specs", specs, "--orbax-storage", "plain", "-o",
            tmp_path / "out")
    assert r.returncode == 0, r.stderr
    doc = json.loads(run(reshard_bin, "inspect", "--json", tmp_path / "out").stdout)["orbax"]
    assert doc["storage"] == "zarr2"
    arrays = {a["name"]: a for a in doc["arrays"]}
    assert arrays["params.embed.embedding"]["sharding"]["partition_spec"] == [["data"], []]
    assert arrays["params.decoder.mlp"]["write_shape"] == [32, 64]
    assert arrays["step"]["sharding"]["mesh_shape"] == [8]
    # and from Hugging Face safetensors, replicated on a (2, 4) mesh
    r = run(reshard_bin, "gather", orbax_dir / "zarr3", "-o", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    r = run(reshard_bin, "convert", tmp_path / "hf", "--to", "orbax", "--mesh",
            "fsdp=2,tensor=4", "-o", tmp_path / "from_hf")
    assert r.returncode == 0, r.stderr
    restored = orbax_restore((tmp_path / "out", tmp_path / "restored"),
                             (tmp_path / "from_hf", tmp_path / "restored_hf"))
    assert restored == [truth(orbax_dir, "ocdbt_zarr2"), truth(orbax_dir, "zarr3")]


# Split over one axis, both, a pair of axes, or replicated (f32, bf16, int8; the rest and the
# int32 step replicated); the mlp's boxes (128 x 16 f32, 8 KiB) land out of line in the
# OCDBT data file.
SPECS24 = {"params.decoder.mlp": ["fsdp", "tensor"], "params.embed.embedding": ["tensor", "fsdp"],
           "params.decoder.layers.0.kernel": [None, "tensor"],
           "params.decoder.q": [None, ["fsdp", "tensor"]], "*": None}


def test_each_ocdbt_storage_is_restored_by_orbax_and_read_by_tensorstore(reshard_bin, orbax_dir,
                                                                          tmp_path):
    """Orbax checkpoint -> OCDBT + zarr v3 (the default) and Hugging Face safetensors -> OCDBT +
    zarr v2, on a (2, 4) mesh: Orbax restores each bit-equal to the source, tensorstore's ocdbt
    driver lists the same keys in the merged database and in process 0's, and reshard gathers
    its own output back equal."""
    specs = tmp_path / "specs.json"
    specs.write_text(json.dumps(SPECS24))
    want = truth(orbax_dir, "ocdbt_zarr3")
    assert run(reshard_bin, "gather", orbax_dir / "ocdbt_zarr3", "-o",
               tmp_path / "hf").returncode == 0
    cases = {"zarr3": (orbax_dir / "ocdbt_zarr3", []),
             "zarr2": (tmp_path / "hf", ["--orbax-storage", "zarr2"])}
    for storage, (source, args) in cases.items():
        r = run(reshard_bin, "convert", source, "--to", "orbax", "--mesh", "fsdp=2,tensor=4",
                "--partition-specs", specs, *args, "-o", tmp_path / storage)
        assert r.returncode == 0, r.stderr
        meta = json.loads((tmp_path / storage / "_METADATA").read_text())
        assert (meta["use_ocdbt"], meta["use_zarr3"]) == (True, storage == "zarr3")
        doc = json.loads(run(reshard_bin, "inspect", "--json", tmp_path / storage).stdout)
        assert doc["orbax"]["storage"] == f"ocdbt+{storage}"
        r = run(reshard_bin, "gather", tmp_path / storage, "-o", tmp_path / f"{storage}.hf")
        assert r.returncode == 0, r.stderr
        assert_equal_to_truth(gathered(tmp_path / f"{storage}.hf"), want)
    restored = orbax_restore(*[(tmp_path / s, tmp_path / f"{s}.restored") for s in cases])
    assert restored == [want, want]
    for storage in cases:
        listed = json.loads((tmp_path / f"{storage}.restored" / "ocdbt.json").read_text())
        assert sorted(listed) == ["", "ocdbt.process_0"]
        assert listed[""] == listed["ocdbt.process_0"]
        keys = listed[""]
        last = "c/1/3" if storage == "zarr3" else "1.3"
        assert keys[f"params.decoder.mlp/{last}"] > 1024  # out of line
        assert ("params.decoder.mlp/zarr.json" in keys) == (storage == "zarr3")
        assert len([k for k in keys if k.startswith("params.decoder.mlp/")]) == 1 + 8
        assert len([k for k in keys if k.startswith("step/")]) == 2


@pytest.mark.parametrize("mesh,specs,extra,code,message", [
    ("data=3", {"params.embed.embedding": ["data"]}, [], 1, "does not split into 3 equal parts"),
    ("data=8", {"*": ["nope"]}, [], 2, "\"nope\" is not an axis of the mesh"),
    ("data", None, [], 2, "axis=size pairs"),
    ("data=8", None, ["--orbax-storage", "zarr4"], 2, "zarr4 not in"),
])
def test_convert_to_orbax_refusals(reshard_bin, orbax_dir, tmp_path, mesh, specs, extra, code,
                                   message):
    args = ["convert", orbax_dir / "ocdbt_zarr2", "--to", "orbax", "--mesh", mesh, *extra]
    if specs is not None:
        (tmp_path / "specs.json").write_text(json.dumps(specs))
        args += ["--partition-specs", tmp_path / "specs.json"]
    r = run(reshard_bin, *args, "-o", tmp_path / "out")
    assert r.returncode == code, (r.returncode, r.stderr)
    assert message in r.stderr
    assert not (tmp_path / "out").exists()


def test_python_convert_to_orbax_takes_the_mesh_specs_and_storage(reshard_bin, orbax_dir,
                                                                   tmp_path):
    """reshard.convert(to="orbax") writes what the CLI writes (the mesh and specs as mappings,
    the storage by name), read back equal to the source; an unknown storage is a ValueError
    that writes nothing."""
    import reshard.checkpoint
    reshard.checkpoint.convert(orbax_dir / "ocdbt_zarr3", tmp_path / "out", to="orbax",
                               mesh={"fsdp": 2, "tensor": 4}, partition_specs=SPECS24,
                               orbax_storage="zarr2")
    meta = json.loads((tmp_path / "out" / "_METADATA").read_text())
    assert (meta["use_ocdbt"], meta["use_zarr3"]) == (True, False)
    doc = json.loads(run(reshard_bin, "inspect", "--json", tmp_path / "out").stdout)["orbax"]
    arrays = {a["name"]: a for a in doc["arrays"]}
    assert arrays["params.decoder.mlp"]["write_shape"] == [128, 16]
    assert run(reshard_bin, "gather", tmp_path / "out", "-o", tmp_path / "hf").returncode == 0
    assert_equal_to_truth(gathered(tmp_path / "hf"), truth(orbax_dir, "ocdbt_zarr3"))
    with pytest.raises(ValueError, match="orbax_storage='zarr4'"):
        reshard.checkpoint.convert(orbax_dir / "ocdbt_zarr3", tmp_path / "bad", to="orbax",
                                   mesh="data=8", orbax_storage="zarr4")
    assert not (tmp_path / "bad").exists()


# optax's AdamW state saved by Orbax (orbax_worker.optax_tree): what the optimizer's tree adds
# before a parameter's path under "params." in the moments' paths.
OPTAX = {"optax": "", "optax8": "params."}
TORCH_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                "I32": torch.int32}


def as_tensor(entry):
    dtype, shape, data = entry
    return torch.frombuffer(bytearray(data), dtype=TORCH_DTYPES[dtype]).reshape(shape)


def adam_states(want, case):
    """{param: {"fp32": its value, "exp_avg": mu, "exp_avg_sq": nu}} from Orbax's restore, and
    the count."""
    out = {}
    for p in (n for n in want if n.startswith("params.")):
        rest = OPTAX[case] + p[len("params."):]
        out[p] = {"fp32": as_tensor(want[p]),
                  "exp_avg": as_tensor(want["opt_state.0.mu." + rest]),
                  "exp_avg_sq": as_tensor(want["opt_state.0.nu." + rest])}
    return out, as_tensor(want["opt_state.0.count"])


@pytest.mark.parametrize("case", sorted(OPTAX))
def test_optax_moments_to_universal(reshard_bin, orbax_dir, tmp_path, case):
    """Adam's mu and nu become each parameter's exp_avg.pt and exp_avg_sq.pt, widened to fp32
    as torch.load reads them, the count its step.pt; the top-level step has no file and is
    refused until dropped."""
    out = tmp_path / "universal"
    r = run(reshard_bin, "convert", orbax_dir / case, "--to", "universal", "-o", out)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert '"step"' in r.stderr and 'dropping "step" by name' in r.stderr, r.stderr
    assert not out.exists()
    r = run(reshard_bin, "convert", orbax_dir / case, "--to", "universal", "--drop", "step",
            "-o", out)
    assert r.returncode == 0, r.stderr
    states, count = adam_states(truth(orbax_dir, case), case)
    assert len(states) == 5 and int(count) == 2
    zero = out / (out / "latest_universal").read_text() / "zero"
    for p, want in states.items():
        for state, value in want.items():
            t = torch.load(zero / p / f"{state}.pt", weights_only=True)["param"]
            assert t.dtype == torch.float32, (p, state)
            assert torch.equal(t, value.float()), (p, state)
        step = torch.load(zero / p / "step.pt", weights_only=True)
        assert step.dtype == torch.float32 and step.dim() == 0 and step.item() == 2.0
    groups = torch.load(zero / "optimizer_state.pt", weights_only=True)["param_groups"]
    assert sorted(groups[0]["params"]) == sorted(states)
    # reshard reads its output back: the fp32 weights
    r = run(reshard_bin, "gather", out, "-o", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    back = gathered(tmp_path / "hf")
    assert sorted(back) == sorted(states)
    assert all(torch.equal(back[p], states[p]["fp32"].float()) for p in states)


def test_optax_moments_to_dcp_as_the_optimizers_state(reshard_bin, orbax_dir, tmp_path):
    """Through DCP at 3 ranks (chunk by chunk from the zarr chunks): mu and nu at
    optim.state.<param>.exp_avg / exp_avg_sq, in their own dtype, as torch reads them back."""
    r = run(reshard_bin, "convert", orbax_dir / "optax", "--to", "dcp", "--world", 3, "-o",
            tmp_path / "dcp")
    assert r.returncode == 0, r.stderr
    dcp_to_torch_save(str(tmp_path / "dcp"), str(tmp_path / "state.pt"))
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    want = truth(orbax_dir, "optax")
    states, count = adam_states(want, "optax")
    for p, s in states.items():
        assert torch.equal(state[p], s["fp32"]), p
        for moment in ("exp_avg", "exp_avg_sq"):
            got = state["optim"]["state"][p][moment]
            assert got.dtype == s[moment].dtype and torch.equal(got, s[moment]), (p, moment)
    assert torch.equal(state["opt_state.0.count"], count)
    assert sorted(state["optim"]["state"]) == sorted(states)
    r = run(reshard_bin, "inspect", orbax_dir / "optax")
    assert "(optimizer state: exp_avg_sq of params.layers.0.kernel)" in r.stdout, r.stdout
    r = run(reshard_bin, "gather", orbax_dir / "optax8", "--optimizer-state", "-o", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    assert "params.layers.1.bias.exp_avg" in gathered(tmp_path / "hf")
