"""What the checkpoint commands may touch: inputs are opened read-only and never block,
unreadable inputs are usage errors, and an existing output is replaced (with --force) only when
it is one that reshard wrote; inputs and foreign files are never removed."""

import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import save_file

from test_checkpoints import LAYOUTS, full, run, scatter, siblings, tree_hash  # noqa: F401 (full: a fixture)


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
    # A layouts file nobody may read (as root, the command runs as an unprivileged user).
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o755)
    os.chmod(tmp_path, 0o755)
    (locked / "layouts.json").write_text(json.dumps(LAYOUTS))
    os.chmod(locked / "layouts.json", 0)
    r = run(reshard_bin, "layout", locked / "layouts.json", "--shape", "4,4", "--world", 2,
            preexec_fn=as_nobody)
    assert r.returncode == 2 and "Permission denied" in r.stderr, r.stderr
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
