"""What the checkpoint commands may touch: inputs are opened read-only and never block,
unreadable inputs are usage errors, and an existing output is replaced (with --force) only when
it is one that reshard wrote; inputs and foreign files are never removed."""

import hashlib
import json
import os
import pathlib
import shutil
import stat
import subprocess
import tempfile

import pytest
import torch
from safetensors.torch import save_file

from ds_checkpoints import Spec
from test_checkpoints import LAYOUTS, full, model, run, scatter, siblings, tree_hash  # noqa: F401 (full: a fixture)


def scatter_args(tmp_path, full, out, *extra):
    return ["scatter", full, "--layouts", tmp_path / "layouts.json", "--tp", 2, "-o", out, *extra]


def run_briefly(reshard_bin, *args):
    """Runs the CLI, failing the test (not hanging it) if it blocks."""
    return subprocess.run([reshard_bin, *map(str, args)], capture_output=True, text=True, timeout=30)


def test_a_fifo_input_is_refused_without_blocking(reshard_bin, tmp_path):
    d = tmp_path / "fifo"
    d.mkdir()
    os.mkfifo(d / "model.safetensors")
    (tmp_path / "layouts.json").write_text(json.dumps(LAYOUTS))
    r = run_briefly(reshard_bin, *scatter_args(tmp_path, d, tmp_path / "out"))
    assert r.returncode == 2 and "FIFO" in r.stderr, r.stderr
    os.mkfifo(tmp_path / "fifo.json")
    r = run_briefly(reshard_bin, "verify", tmp_path / "fifo.json")
    assert r.returncode == 2 and "FIFO" in r.stderr, r.stderr
    assert siblings(tmp_path / "out") == []


def as_nobody():
    if os.geteuid() == 0:
        os.setgid(65534)
        os.setuid(65534)


def test_unreadable_inputs_are_usage_errors(reshard_bin, tmp_path, full):
    sharded = scatter(reshard_bin, tmp_path, full, 2)
    # A manifest that is a symlink loop.
    loop = tmp_path / "loop"
    loop.mkdir()
    os.symlink("reshard.json", loop / "reshard.json")
    r = run(reshard_bin, "gather", loop, "-o", tmp_path / "out")
    assert r.returncode == 2 and "reshard.json" in r.stderr, r.stderr
    # A rank's file that is a directory.
    os.remove(sharded / "model-rank-1-part-0.safetensors")
    (sharded / "model-rank-1-part-0.safetensors").mkdir()
    r = run(reshard_bin, "convert", sharded, "--tp", 4, "-o", tmp_path / "out")
    assert r.returncode == 2 and "directory" in r.stderr, r.stderr
    # A layouts file nobody may read (as root, the command runs as an unprivileged user). The
    # file and a copy of the binary sit in a directory everyone may enter, so that only the
    # file's own permissions refuse it (a checkout or pytest's base directory may be 0700).
    locked = pathlib.Path(tempfile.mkdtemp(prefix="reshard-locked-"))
    try:
        os.chmod(locked, 0o755)
        binary = shutil.copy(reshard_bin, locked / "reshard")
        (locked / "layouts.json").write_text(json.dumps(LAYOUTS))
        os.chmod(locked / "layouts.json", 0)
        r = run(binary, "layout", locked / "layouts.json", "--shape", "4,4", "--world", 2,
                preexec_fn=as_nobody)
        assert r.returncode == 2 and "Permission denied" in r.stderr, r.stderr
        assert "layouts.json" in r.stderr, r.stderr
    finally:
        shutil.rmtree(locked)
    assert siblings(tmp_path / "out") == []


def test_an_invalid_map_inside_a_manifest_fails_the_check(reshard_bin, tmp_path, full):
    sharded = scatter(reshard_bin, tmp_path, full, 2)
    manifest = json.loads((sharded / "reshard.json").read_text())
    # Well-formed JSON, a map that breaks an invariant: rank 1's piece writes past its shard.
    manifest["params"]["norm.weight"]["map"]["ranks"]["1"]["pieces"][0]["dest"][0] = 8
    (sharded / "reshard.json").write_text(json.dumps(manifest))
    for args in (["gather", sharded, "-o", tmp_path / "out"],
                 ["convert", sharded, "--tp", 4, "-o", tmp_path / "out"]):
        r = run(reshard_bin, *args)
        assert r.returncode == 1 and "norm.weight" in r.stderr, (args, r.stderr)
    assert siblings(tmp_path / "out") == []


def test_force_never_removes_an_input(reshard_bin, tmp_path, full):
    parent = tmp_path / "P"
    parent.mkdir()
    (parent / "notes.txt").write_text("mine")
    sharded = parent / "tp4"
    assert run(reshard_bin, *scatter_args(tmp_path, full, sharded)).returncode == 0
    before = tree_hash(tmp_path)
    link = tmp_path / "link"
    os.symlink(sharded, link)
    cases = [
        (["gather", sharded, "-o", parent, "--force"], "contains the input"),
        (["convert", sharded, "--tp", 2, "-o", sharded, "--force"], "is the input"),
        (["convert", link, "--tp", 2, "-o", sharded, "--force"], "is the input"),  # via a symlink
        (["convert", sharded, "--tp", 2, "-o", link, "--force"], "symbolic link"),
        (scatter_args(tmp_path, full, full, "--force"), "is the input"),
        (["gather", sharded, "-o", sharded / "full"], "lies inside the input"),
    ]
    for args, fragment in cases:
        r = run(reshard_bin, *args)
        assert r.returncode == 2 and fragment in r.stderr, (args, r.stderr)
        assert "choose an output" in r.stderr or "real directory" in r.stderr, r.stderr
        assert tree_hash(tmp_path) == before, args
    assert sorted(os.listdir(parent)) == ["notes.txt", "tp4"]


def test_force_replaces_only_an_output_reshard_wrote_or_an_empty_directory(reshard_bin, tmp_path, full):
    sharded = scatter(reshard_bin, tmp_path, full, 2)
    out = tmp_path / "out"
    # A previous sharded output and a previous full output of reshard are replaced.
    assert run(reshard_bin, "convert", sharded, "--tp", 4, "-o", out).returncode == 0
    r = run(reshard_bin, "gather", sharded, "-o", out, "--force")
    assert r.returncode == 0, r.stderr
    r = run(reshard_bin, "gather", sharded, "-o", out, "--force", "--max-shard-size", "200")
    assert r.returncode == 0, r.stderr
    r = run(reshard_bin, "convert", sharded, "--tp", 4, "-o", out, "--force")
    assert r.returncode == 0, r.stderr
    # An empty directory is replaced.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run(reshard_bin, "gather", sharded, "-o", empty, "--force").returncode == 0
    # Anything holding a file reshard did not write is not.
    (out / "notes.txt").write_text("mine")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    save_file({"w": torch.zeros(2)}, str(foreign / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "file").write_text("x")
    before = tree_hash(tmp_path)
    for target, fragment in ((out, "notes.txt"), (foreign, "producer"), (tmp_path / "file", "not a directory")):
        r = run(reshard_bin, "gather", sharded, "-o", target, "--force")
        assert r.returncode == 2 and fragment in r.stderr and "--force" not in r.stderr, r.stderr
        assert tree_hash(tmp_path) == before
        assert [s for s in siblings(target) if s.startswith(".")] == []
    # Without --force the refusal says how to replace.
    r = run(reshard_bin, "gather", sharded, "-o", empty)
    assert r.returncode == 2 and "--force" in r.stderr


@pytest.mark.parametrize("storage", ["zarr3", "zarr2", "plain"])
def test_force_replaces_an_orbax_checkpoint_only_when_reshard_wrote_it(reshard_bin, tmp_path, full,
                                                                       storage):
    """convert --to orbax marks _CHECKPOINT_METADATA's custom_metadata; an Orbax checkpoint
    without the mark (as Orbax itself saves one), or with a file reshard never writes, stays."""
    sharded = scatter(reshard_bin, tmp_path, full, 2)
    out = tmp_path / "orbax"
    args = ("convert", sharded, "--to", "orbax", "--mesh", "x=2", "--orbax-storage", storage,
            "-o", out)
    assert run(reshard_bin, *args).returncode == 0
    r = run(reshard_bin, *args)
    assert r.returncode == 2 and "--force" in r.stderr, r.stderr
    r = run(reshard_bin, *args, "--force")
    assert r.returncode == 0, r.stderr
    meta_path = out / "_CHECKPOINT_METADATA"
    meta = json.loads(meta_path.read_text())
    assert meta["custom_metadata"] == {"producer": "reshard"}
    strays = [out / "notes.txt"]
    if storage != "plain":
        strays += [out / "ocdbt.process_0" / "notes.txt"]
    for stray in strays:
        stray.write_text("mine")
        before = tree_hash(tmp_path)
        r = run(reshard_bin, *args, "--force")
        assert r.returncode == 2 and "notes.txt" in r.stderr, r.stderr
        assert tree_hash(tmp_path) == before
        stray.unlink()
    meta["custom_metadata"] = {}
    meta_path.write_text(json.dumps(meta))
    before = tree_hash(tmp_path)
    for command in (args, ("gather", sharded, "-o", out)):
        r = run(reshard_bin, *command, "--force")
        assert r.returncode == 2 and "_CHECKPOINT_METADATA" in r.stderr, r.stderr
        assert tree_hash(tmp_path) == before
    # Marked again, another command's output may replace it.
    meta["custom_metadata"] = {"producer": "reshard"}
    meta_path.write_text(json.dumps(meta))
    r = run(reshard_bin, "gather", sharded, "-o", out, "--force")
    assert r.returncode == 0, r.stderr
    assert (out / "model.safetensors").is_file() and not meta_path.exists()


def test_force_replaces_outputs_that_carry_the_models_side_files(reshard_bin, tmp_path):
    """scatter --config and the dequantizing commands write config.json (and copy the
    tokenizer's files) beside the tensors: that output is still reshard's to replace."""
    import quant_models

    src = tmp_path / "fp8"
    quant_models.qwen3_fp8(src, kv_heads=4)
    (src / "tokenizer_config.json").write_text("{}")
    commands = (
        ("scatter", src, "--config", src / "config.json", "--tp", 2),
        ("scatter", src, "--config", src / "config.json", "--tp", 2, "--dequantize"),
        ("gather", src, "--dequantize"),
    )
    for i, command in enumerate(commands):
        out = tmp_path / f"out{i}"
        r = run(reshard_bin, *command, "-o", out)
        assert r.returncode == 0, r.stderr
        assert (out / "config.json").is_file()
        r = run(reshard_bin, *command, "-o", out, "--force")
        assert r.returncode == 0, r.stderr
        # A file the commands never write is still in the way.
        (out / "notes.txt").write_text("mine")
        before = tree_hash(tmp_path)
        r = run(reshard_bin, *command, "-o", out, "--force")
        assert r.returncode == 2 and "notes.txt" in r.stderr, r.stderr
        assert tree_hash(tmp_path) == before


def test_unusable_output_paths_are_refused_before_any_work(reshard_bin, tmp_path, full):
    sharded = scatter(reshard_bin, tmp_path, full, 2)
    work = tmp_path / "work"
    work.mkdir()
    before = tree_hash(tmp_path)
    r = run(reshard_bin, "gather", sharded, "-o", ".", "--force", cwd=work)
    assert r.returncode == 2 and "current directory" in r.stderr, r.stderr
    r = run(reshard_bin, "gather", sharded, "-o", tmp_path, "--force", cwd=work)
    assert r.returncode == 2 and "current directory" in r.stderr, r.stderr
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    r = run(reshard_bin, "gather", sharded, "-o", tmp_path / "dangling")
    assert r.returncode == 2 and "symbolic link" in r.stderr, r.stderr
    os.remove(tmp_path / "dangling")
    assert tree_hash(tmp_path) == before
    assert os.listdir(work) == []


def test_flag_hints_come_from_the_cli(reshard_bin, tmp_path, full):
    sharded = scatter(reshard_bin, tmp_path, full, 2)
    manifest = json.loads((sharded / "reshard.json").read_text())
    for p in manifest["params"].values():
        p.pop("layout", None)
    (sharded / "reshard.json").write_text(json.dumps(manifest))
    r = run(reshard_bin, "convert", sharded, "--tp", 4, "-o", tmp_path / "out")
    assert r.returncode == 1 and "without target maps; give them with --target-maps" in r.stderr, r.stderr


@pytest.mark.parametrize("args", [["demo", "--seed", "-1"], ["demo", "--seed", "99999999999999999999"],
                                  ["demo", "--layers", "99999999999999999999"],
                                  ["convert", "x", "--tp", "99999999999999999999", "-o", "y"],
                                  ["scatter", "x", "--layouts", "l.json", "--tp", "-3", "-o", "y"]])
def test_out_of_range_numbers_are_usage_errors(reshard_bin, tmp_path, args):
    r = run(reshard_bin, *args, cwd=tmp_path)
    assert r.returncode == 2 and "is not an integer from" in r.stderr or "not in range" in r.stderr, r.stderr
    assert r.returncode == 2 and os.listdir(tmp_path) == []


# --- The output-target table: every command that writes, against everything that may lie in
# the output's place, with and without --force. An output that is one file replaces only a
# regular file (with --force); a directory output only an empty directory or an output of
# reshard. Links, devices and FIFOs are never replaced; inputs are never written, nor is
# anything inside one.

DS_SPEC = Spec("llama", tp=2, dp=2, stage=1)  # one of the CI matrix, trained once per session


def snapshot(root):
    """Everything under `root` as {relative path: what it is}, without following a symbolic
    link or opening anything but regular files (a FIFO would block, a device would read)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    out[rel] = ("file", hashlib.sha256(f.read()).hexdigest())
            elif stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir",)
            else:
                out[rel] = ("special", stat.S_IFMT(st.st_mode), st.st_rdev)
    return out


def split_descriptor(work):
    path = work / "split.json"
    path.write_text(json.dumps({"family": "split", "dim": 0}))
    return path


def map_documents(reshard_bin, work):
    """Two map documents of one parameter, at 2 and at 4 ranks."""
    docs = []
    for world in (2, 4):
        r = run(reshard_bin, "layout", split_descriptor(work), "--shape", "8,4", "--world", world)
        assert r.returncode == 0, r.stderr
        path = work / f"maps{world}.json"
        path.write_text(json.dumps({"version": 1, "w": json.loads(r.stdout)}))
        docs.append(path)
    return docs


def index_maps(work):
    path = work / "obs.json"
    path.write_text(json.dumps({"logical_shape": [4, 6], "ranks": [
        {"rank": r, "shard_shape": [4, 3],
         "index_map": [row * 6 + 3 * r + c for row in range(4) for c in range(3)]}
        for r in range(2)]}))
    return path


def degree_inputs(work):
    config = {"model_type": "llama", "hidden_size": 16, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 4, "intermediate_size": 8,
              "vocab_size": 32, "tie_word_embeddings": False}
    (work / "config.json").write_text(json.dumps(config))
    weights = work / "weights"
    weights.mkdir()
    save_file({"model.norm.weight": torch.zeros(16), "lm_head.weight": torch.zeros(32, 16)},
              str(weights / "model.safetensors"))
    return weights


class Writer:
    """A command that writes: `setup(ctx)` makes its input under ctx.work and returns
    (input path or None, {name: extra value}); `args(inp, out, extra)` its command line."""

    def __init__(self, name, kind, setup, args, suffix=""):
        self.name, self.kind, self.setup, self.args, self.suffix = name, kind, setup, args, suffix


def _full(ctx):
    d = ctx.work / "full"
    d.mkdir()
    save_file(model(), str(d / "model.safetensors"), metadata={"format": "pt"})
    (ctx.work / "layouts.json").write_text(json.dumps(LAYOUTS))
    return d, {"layouts": ctx.work / "layouts.json"}


def _sharded(ctx):
    full_dir, extra = _full(ctx)
    sharded = ctx.work / "sharded"
    r = run(ctx.bin, "scatter", full_dir, "--layouts", extra["layouts"], "--tp", 2, "-o", sharded)
    assert r.returncode == 0, r.stderr
    shutil.rmtree(full_dir)
    return sharded, {}


def _deepspeed(ctx):
    save = ctx.work / "ck"
    shutil.copytree(ctx.ds(DS_SPEC).save_dir, save, symlinks=True)
    return save, {}


def _pt(ctx):
    path = ctx.work / "in.pt"
    torch.save({"w": torch.arange(6.0).reshape(2, 3), "step": 3}, path)
    return path, {}


def _safetensors(ctx):
    path = ctx.work / "in.safetensors"
    save_file({"w": torch.arange(6.0)}, str(path), metadata={"format": "pt"})
    return path, {}


def _descriptor(ctx):
    return split_descriptor(ctx.work), {}


def _maps(ctx):
    src, dst = map_documents(ctx.bin, ctx.work)
    return src, {"to": dst}


def _index_maps(ctx):
    return index_maps(ctx.work), {}


def _weights(ctx):
    return degree_inputs(ctx.work), {}


WRITERS = [
    Writer("scatter", "dir", _full,
           lambda i, o, x: ["scatter", i, "--layouts", x["layouts"], "--tp", 2, "-o", o]),
    Writer("gather", "dir", _sharded, lambda i, o, x: ["gather", i, "-o", o]),
    Writer("convert", "dir", _sharded, lambda i, o, x: ["convert", i, "--tp", 4, "-o", o]),
    Writer("gather-deepspeed", "dir", _deepspeed, lambda i, o, x: ["gather", i, "-o", o]),
    Writer("convert-deepspeed", "dir", _deepspeed,
           lambda i, o, x: ["convert", i, "--tp", 1, "-o", o]),
    Writer("convert-universal", "dir", _deepspeed,
           lambda i, o, x: ["convert", i, "--to", "universal", "-o", o]),
    Writer("demo", "demo", lambda ctx: (None, {}),
           lambda i, o, x: ["demo", o, "--layers", 1]),
    Writer("export-safetensors", "file", _pt, lambda i, o, x: ["export", i, "-o", o],
           ".safetensors"),
    Writer("export-pt", "file", _pt, lambda i, o, x: ["export", i, "-o", o], ".pt"),
    Writer("export-from-safetensors", "file", _safetensors,
           lambda i, o, x: ["export", i, "-o", o], ".pt"),
    Writer("layout", "file", _descriptor,
           lambda i, o, x: ["layout", i, "--shape", "8,4", "--world", 2, "-o", o], ".json"),
    Writer("infer", "file", _index_maps, lambda i, o, x: ["infer", i, "-o", o], ".json"),
    Writer("compose", "file", _maps,
           lambda i, o, x: ["compose", "--from", i, "--to", x["to"], "-o", o], ".json"),
    Writer("degree-emit-maps", "file", _weights,
           lambda i, o, x: ["degree", i.parent / "config.json", "--tp", 2, "--emit-maps", o,
                            "--weights", i], ".json"),
]

TARGETS = ["absent", "file", "dir", "input", "inside", "parent", "device", "fifo", "symlink",
           "dangling"]


def make_target(kind, work, inp, writer):
    """Puts `kind` where the output goes and returns the output path."""
    out = work / ("out" + writer.suffix)
    if kind == "file":
        out.write_bytes(b"keep")
    elif kind == "dir":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    elif kind == "input":
        out = inp
    elif kind == "inside":
        out = inp / ("out" + writer.suffix)
    elif kind == "parent":
        out = inp.parent
    elif kind == "device":
        os.mknod(out, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # what /dev/null is, in tmp
    elif kind == "fifo":
        os.mkfifo(out)
    elif kind == "symlink":  # to what the command could replace if it were the output itself
        elsewhere = work / ("elsewhere" + writer.suffix)
        if writer.kind == "file":
            elsewhere.write_bytes(b"keep")
        else:
            elsewhere.mkdir()
        os.symlink(elsewhere, out)
    elif kind == "dangling":
        os.symlink(work / "nowhere", out)
    return out


def expected_exit(writer, kind, force):
    if kind == "absent":
        return 0
    if kind == "file" and writer.kind == "file":
        return 0 if force else 2
    if kind == "dir" and writer.kind == "demo":  # DIR may hold other things with --force
        return 0 if force else 2
    return 2


class Context:
    def __init__(self, reshard_bin, work, ds):
        self.bin, self.work, self.ds = reshard_bin, work, ds


def target_cases():
    return [pytest.param(w, kind, id=f"{w.name}-{kind}") for w in WRITERS for kind in TARGETS
            if not (w.kind == "demo" and kind in ("input", "inside", "parent"))]  # demo reads nothing


@pytest.mark.parametrize("writer,kind", target_cases())
def test_output_target_table(reshard_bin, tmp_path, ds_checkpoint, writer, kind):
    for force in (False, True):
        work = tmp_path / ("forced" if force else "plain")
        work.mkdir()
        inp, extra = writer.setup(Context(reshard_bin, work, ds_checkpoint))
        out = make_target(kind, work, inp, writer)
        before = snapshot(tmp_path)
        input_before = snapshot(inp) if inp is not None and inp.is_dir() else None
        input_bytes = inp.read_bytes() if inp is not None and inp.is_file() else None
        r = run_briefly(reshard_bin, *writer.args(inp, out, extra), *(["--force"] if force else []))
        want = expected_exit(writer, kind, force)
        assert r.returncode == want, (writer.name, kind, force, r.returncode, r.stderr)
        # The input is untouched whatever happened.
        if input_before is not None:
            assert snapshot(inp) == input_before, (writer.name, kind, force)
        if input_bytes is not None:
            assert inp.read_bytes() == input_bytes, (writer.name, kind, force)
        # No temporary is left anywhere.
        leftovers = [p for p in snapshot(tmp_path) if ".tmp-" in os.path.basename(p)]
        assert leftovers == [], (writer.name, kind, force, leftovers)
        if want != 0:
            assert "Traceback" not in r.stderr and r.stderr.startswith("reshard"), r.stderr
            assert snapshot(tmp_path) == before, (writer.name, kind, force, r.stderr)
            continue
        # Written: what was asked, and nothing of the user's was lost.
        if writer.kind == "file":
            assert out.is_file() and not out.is_symlink() and out.read_bytes() != b"keep"
        else:
            assert out.is_dir() and not out.is_symlink()
        if kind == "dir":
            assert (out / "notes.txt").read_text() == "mine"
        gone = {p: v for p, v in before.items()
                if p not in snapshot(tmp_path) and p != os.path.relpath(out, tmp_path)}
        assert gone == {}, (writer.name, kind, force)


@pytest.mark.parametrize("name,written", [("out.safetensors", None), ("out.pt", "torch"),
                                          ("out.bin", "torch")])
def test_export_of_a_safetensors_file_refuses_a_name_that_misdescribes_it(reshard_bin, tmp_path,
                                                                          name, written):
    src = tmp_path / "ok.safetensors"
    save_file({"w": torch.arange(4.0)}, str(src), metadata={"format": "pt"})
    before = snapshot(tmp_path)
    r = run(reshard_bin, "export", src, "-o", tmp_path / name)
    if written is None:
        assert r.returncode == 2 and ".pt" in r.stderr and name in r.stderr, r.stderr
        assert snapshot(tmp_path) == before
        return
    assert r.returncode == 0, r.stderr
    assert torch.equal(torch.load(tmp_path / name, weights_only=True)["w"], torch.arange(4.0))
