"""Unchanged bytes through the file system, and the CLI's MPI runner found at run time.

- `scatter` has the file system copy what a rank's file holds unchanged from the input (whole
  tensors, row blocks, whole experts: copy_file_range) and copies the rest through memory;
  RESHARD_COPY_FILE_RANGE=0 copies everything through memory. Both write the same bytes.
- The MPI runner is a plugin beside the CLI, loaded only when an MPI launcher started it: a CLI
  without one beside it runs alone; one whose plugin cannot be loaded says so, exit 3."""

import json
import os
import shutil
import subprocess

import pytest
from test_crash_consistency import write_layered_model


def run(argv, env=None, without=()):
    """Runs argv with `env` added to this process's environment and `without` removed."""
    full = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in without}
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=120,
                          env=full, check=False)


def files_of(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.mark.parametrize("bias", [{"family": "replicated"},
                                  {"family": "replicated", "pre_divided": True}])
def test_scatter_through_the_file_system_writes_what_memory_copies_write(tmp_path, reshard_bin,
                                                                         bias):
    # Per layer: w [256, 2048] bf16 split by rows (one block per rank: copied), o [2048, 256]
    # split by columns (strided: through memory), the fp32 bias b [256] (replicated: copied;
    # pre-divided: scaled, through memory).
    write_layered_model(tmp_path, 3, 256, 2048, seed=5, bias=bias)
    outs, copied = {}, {}
    for mode, env in (("file system", None), ("memory", {"RESHARD_COPY_FILE_RANGE": "0"})):
        out = tmp_path / mode.replace(" ", "_")
        r = run([reshard_bin, "scatter", tmp_path / "full", "--layouts", tmp_path / "layouts.json",
                 "--tp", 2, "--no-sync", "--json", "-o", out], env=env)
        assert r.returncode == 0, r.stderr
        copied[mode] = sum(p["bytes_copied"] for p in json.loads(r.stdout)["processes"])
        outs[mode] = files_of(out)
    assert outs["file system"] == outs["memory"]
    w_bytes, b_bytes = 3 * 256 * 2048 * 2, 3 * 256 * 4 * 2  # every rank holds the whole bias
    assert copied == {"file system": w_bytes + (b_bytes if "pre_divided" not in bias else 0),
                      "memory": 0}


@pytest.fixture
def lone_cli(tmp_path, reshard_bin):
    """A link to the CLI in a folder of its own: no MPI runner beside it."""
    d = tmp_path / "bin"
    d.mkdir()
    try:
        os.link(os.path.realpath(reshard_bin), d / "reshard")
    except OSError:  # another file system
        shutil.copy2(os.path.realpath(reshard_bin), d / "reshard")
    return d


def test_the_mpi_runner_is_loaded_only_from_beside_the_cli(tmp_path, lone_cli):
    write_layered_model(tmp_path, 1, 8, 16, seed=1, bias={"family": "replicated"})
    scatter = [lone_cli / "reshard", "scatter", tmp_path / "full", "--layouts",
               tmp_path / "layouts.json", "--tp", 2, "-o"]
    launched = {"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"}
    # No plugin (a build without MPI): the process runs alone, whatever launched it.
    r = run(scatter + [tmp_path / "alone"], env=launched)
    assert r.returncode == 0, r.stderr
    # A plugin that cannot be loaded: refused before anything is written, naming it.
    (lone_cli / "libreshard_mpi.so").write_bytes(b"not a shared object")
    r = run(scatter + [tmp_path / "broken"], env=launched)
    assert r.returncode == 3, r.stderr
    assert "started by an MPI launcher, but the MPI runner" in r.stderr, r.stderr
    assert str(lone_cli / "libreshard_mpi.so") in r.stderr
    assert not (tmp_path / "broken").exists()
    # Not launched by MPI, the plugin is never looked at.
    r = run(scatter + [tmp_path / "unlaunched"], without=("OMPI_COMM_WORLD_SIZE", "PMIX_RANK"))
    assert r.returncode == 0, r.stderr
