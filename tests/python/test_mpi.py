"""scatter, convert, gather and convert --to universal under `mpirun -n K`: the output is
byte-identical to one process's, every process writes about 1/K of the bytes and reads only what its files need,
process 0 shows the whole job's progress, and a failure in any process (a truncated input, a
full disk in one process, a killed process, a hung one) leaves no output and no temporary.

Skipped when mpirun is not installed; fails when it is but the CLI was built without MPI (its runner, libreshard_mpi.so beside it)."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import time

import pytest

from ds_checkpoints import Spec
from test_crash_consistency import (bytes_under, same_tree, temporaries, tree_digest,
                                    write_layered_model)

MPIRUN = shutil.which("mpirun")
pytestmark = pytest.mark.skipif(MPIRUN is None, reason="Open MPI's mpirun is not installed")
LAYERS = 8


def mpirun(n, reshard_bin, *args, wrap=None, **kw):
    command = [reshard_bin, *map(str, args)]
    if wrap:
        command = ["sh", "-c", wrap + ' exec "$@"', "sh", *command]
    return [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-n", str(n), *command]


def mpmd(reshard_bin, *contexts):
    """mpirun with several app contexts: [(n, args), ...], each `n` processes of reshard."""
    argv = [MPIRUN, "--allow-run-as-root", "--oversubscribe"]
    for i, (n, args) in enumerate(contexts):
        argv += ([":"] if i else []) + ["-n", str(n), reshard_bin, *map(str, args)]
    return argv


def run(argv, **kw):
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, **kw)


def make_full(d, rows):
    """A full checkpoint of LAYERS layers (bf16 weights of rows x 256 split by rows and
    columns, replicated fp32 biases of 256) and its layouts."""
    write_layered_model(d, LAYERS, 256, rows, seed=11, bias={"family": "replicated"})


def commands(d):
    return {
        "scatter": lambda out: ["scatter", d / "full", "--layouts", d / "layouts.json", "--tp", 4,
                                "--max-shard-size", "300kB", "-o", out],
        "convert": lambda out: ["convert", d / "ref-scatter", "--tp", 3, "--max-shard-size", "200kB",
                                "-o", out],
        "gather": lambda out: ["gather", d / "ref-convert", "--max-shard-size", "400kB", "-o", out],
    }


@pytest.fixture(scope="module")
def small(tmp_path_factory, reshard_bin):
    """A ~2 MB checkpoint and one-process reference outputs of each command."""
    # The MPI runner: a plugin beside the CLI, the one binary linked against MPI.
    plugin = pathlib.Path(reshard_bin).resolve().parent / "libreshard_mpi.so"
    assert plugin.exists(), "mpirun is installed but reshard was built without MPI"
    assert "libmpi" in run(["ldd", str(plugin)]).stdout
    assert "libmpi" not in run(["ldd", reshard_bin]).stdout, "the CLI itself needs no MPI"
    d = tmp_path_factory.mktemp("mpi")
    make_full(d, 512)
    for name, args in commands(d).items():  # each reads the previous one's output
        r = run([reshard_bin, *map(str, args(d / f"ref-{name}")), "--json"])
        assert r.returncode == 0, r.stderr
        (d / f"ref-{name}.json").write_text(r.stdout)
    return d


@pytest.mark.parametrize("command", ["scatter", "convert", "gather"])
def test_k_processes_write_what_one_does_each_reading_only_its_share(reshard_bin, small, command):
    one = json.loads((small / f"ref-{command}.json").read_text())["processes"]
    assert len(one) == 1
    for n in (1, 2, 3, 4):
        out = small / f"{command}-{n}"
        r = run(mpirun(n, reshard_bin, *commands(small)[command](out), "--json"))
        assert r.returncode == 0, r.stderr
        assert same_tree(out, small / f"ref-{command}"), (command, n)
        processes = json.loads(r.stdout)["processes"]
        assert [p["rank"] for p in processes] == list(range(n))
        files = [f for p in processes for f in p["files"]]
        assert sorted(files) == sorted(one[0]["files"]), "every file written once"
        written = [p["bytes_written"] for p in processes]
        assert sum(written) == one[0]["bytes_written"]
        largest = max(os.path.getsize(out / f) for f in files)
        assert max(written) <= one[0]["bytes_written"] / n + largest, written  # balanced
        # Reading: nothing twice across processes, and no process more than it writes (plans
        # move each target element from one source element; no padding here).
        assert sum(p["bytes_read"] for p in processes) == one[0]["bytes_read"]
        assert sum(p["bytes_verified"] for p in processes) == one[0]["bytes_verified"]
        for p in processes:
            assert p["bytes_read"] <= p["bytes_written"], p


def test_k_processes_write_the_universal_checkpoint_one_does(reshard_bin, ds_checkpoint,
                                                            tmp_path):
    """convert --to universal: each process writes its share of the files (by bytes) into one
    output, which equals a single process's file for file and byte for byte; a process that
    cannot open the checkpoint fails them all and leaves nothing."""
    ckpt = ds_checkpoint(Spec("llama", tp=2, dp=2, stage=1))
    convert = ["convert", ckpt.save_dir, "--to", "universal", "--json"]
    r = run([reshard_bin, *map(str, convert), "-o", str(tmp_path / "one")])
    assert r.returncode == 0, r.stderr
    one = json.loads(r.stdout)["processes"][0]
    reference = tree_digest(tmp_path / "one")
    for n in (2, 3):
        out = tmp_path / f"mpi-{n}"
        r = run(mpirun(n, reshard_bin, *convert, "-o", out))
        assert r.returncode == 0, r.stderr
        assert tree_digest(out) == reference, n
        processes = json.loads(r.stdout)["processes"]
        assert [p["rank"] for p in processes] == list(range(n))
        files = [f for p in processes for f in p["files"]]
        assert sorted(files) == sorted(one["files"]), "every file written once"
        written = [p["bytes_written"] for p in processes]
        assert sum(written) == one["bytes_written"] and min(written) > 0, written
        largest = max(f.stat().st_size for f in out.rglob("*.pt"))
        assert max(written) <= one["bytes_written"] / n + largest, written  # balanced
    # A full disk in one process fails every process and leaves nothing.
    out = tmp_path / "one-full-disk"
    limit = 'if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then ulimit -f 16; fi;'  # 8-16 KiB files
    r = run(mpirun(2, reshard_bin, *convert, "-o", out, wrap=limit))
    assert r.returncode != 0, r.stderr
    assert not os.path.exists(out) and temporaries(out) == []


def test_process_0_shows_the_whole_jobs_progress(reshard_bin, small):
    out = small / "progress"
    r = run(mpirun(3, reshard_bin, *commands(small)["convert"](out), "--progress", "--json"))
    assert r.returncode == 0, r.stderr
    processes = json.loads(r.stdout)["processes"]
    assert all(p["bytes_written"] < sum(q["bytes_written"] for q in processes) for p in processes)
    frames = [f for f in r.stderr.replace("\r", "\n").splitlines() if f.startswith("convert [")]
    assert frames and frames[0].count("0.0 B /") == 1, "one bar, from process 0 alone"
    done, total = frames[-1].split("] ")[1].split("  ")[0].split(" / ")
    assert done == total, frames[-1]  # process 0 counted every process's bytes


def test_a_truncated_rank_file_fails_every_process_and_leaves_nothing(reshard_bin, small):
    bad = small / "truncated"
    shutil.copytree(small / "ref-scatter", bad)
    victim = bad / "model-rank-2-part-0.safetensors"
    os.truncate(victim, os.path.getsize(victim) - 100)
    out = small / "from-truncated"
    r = run(mpirun(3, reshard_bin, "convert", bad, "--tp", 2, "-o", out))
    assert r.returncode == 2 and "truncated" in r.stderr, r.stderr
    assert r.stderr.count("file is truncated") == 1, "process 0 reports the job's error once"
    assert not os.path.exists(out) and temporaries(out) == []


def test_a_full_disk_in_one_process_fails_every_process_and_leaves_nothing(reshard_bin, small):
    out = small / "one-full-disk"
    limit = 'if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then ulimit -f 64; fi;'  # 64 KiB files
    r = run(mpirun(3, reshard_bin, *commands(small)["scatter"](out), wrap=limit))
    assert r.returncode != 0, r.stderr
    assert not os.path.exists(out) and temporaries(out) == []


@pytest.fixture(scope="module")
def large(tmp_path_factory, reshard_bin):
    """A ~130 MB sharded checkpoint, so that a run lasts long enough to be caught mid-way."""
    d = tmp_path_factory.mktemp("mpi-large")
    make_full(d, 16384)
    r = run([reshard_bin, "scatter", str(d / "full"), "--layouts", str(d / "layouts.json"),
             "--tp", "4", "-o", str(d / "sharded")])
    assert r.returncode == 0, r.stderr
    shutil.rmtree(d / "full")
    r = run([reshard_bin, "convert", str(d / "sharded"), "--tp", "2", "-o", str(d / "reference")])
    assert r.returncode == 0, r.stderr
    return d


def rank_pid(launcher, rank):
    """The pid of process `rank` of the job `launcher` (mpirun) started, or None."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if parent == launcher.pid and f"OMPI_COMM_WORLD_RANK={rank}".encode() in env:
            return int(entry)
    return None


def signal_mid_way(launcher, out, rank, sig, fraction):
    """Sends `sig` to process `rank` once the temporary output holds `fraction` of the output's
    bytes; returns whether the job was still running then."""
    total = 130e6
    pid = None
    while launcher.poll() is None:
        pid = pid or rank_pid(launcher, rank)
        temps = temporaries(out)
        if pid and temps and sum(bytes_under(t) for t in temps) >= fraction * total:
            os.kill(pid, sig)
            return True
        time.sleep(0.001)  # polling interval; the condition above is what synchronises
    return False


def committing(out):
    """Whether a temporary output holds the manifest (or its temporary): every file was
    written and process 0 alone was committing, so the run was not caught mid-way."""
    return any(name.lstrip(".").startswith("reshard.json")
               for t in temporaries(out) for name in os.listdir(t))


def catch_mid_way(reshard_bin, large, out, rank, sig, *extra):
    """Runs convert on 3 processes and sends `sig` to process `rank` mid-way (before process 0
    alone commits), retrying earlier when a run ends first; returns mpirun's stderr."""
    for fraction in (0.3, 0.1, 0.0):  # a fast run may end before a later point is seen
        launcher = subprocess.Popen(mpirun(3, reshard_bin, "convert", large / "sharded", "--tp", 2,
                                           "-o", out, *extra),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        caught = signal_mid_way(launcher, out, rank, sig, fraction)
        _, stderr = launcher.communicate(timeout=120)
        if caught and launcher.returncode != 0 and not committing(out):
            return stderr
        shutil.rmtree(out, ignore_errors=True)
        for t in temporaries(out):
            shutil.rmtree(t)
    pytest.fail("no run was caught mid-way")


@pytest.mark.parametrize("rank", [0, 2])
def test_a_killed_process_ends_the_job_and_leaves_nothing(reshard_bin, large, rank):
    out = large / f"killed-{rank}"
    catch_mid_way(reshard_bin, large, out, rank, signal.SIGKILL)
    assert temporaries(out) == []
    assert not os.path.exists(out) or same_tree(out, large / "reference")


def test_a_hung_process_times_the_others_out_and_leaves_nothing(reshard_bin, large):
    out = large / "hung"
    stderr = catch_mid_way(reshard_bin, large, out, 1, signal.SIGSTOP, "--peer-timeout", 2)
    assert b"did not answer within 2 s" in stderr, stderr
    assert not os.path.exists(out) and temporaries(out) == []


def different_runs(small, other):
    """(what the job's last process is given differently, the first contexts' args, the last
    context's args, a word the error must show): each an mpirun whose processes disagree."""
    base = ["convert", small / "ref-scatter", "--tp", 3]
    return {
        "another input": (base, ["convert", other, "--tp", 3], str(other)),
        "another option": (base, ["convert", small / "ref-scatter", "--tp", 2], "--tp"),
        "another command": (["gather", small / "ref-convert"], ["convert", small / "ref-convert",
                                                                 "--tp", 1], "convert"),
        "another output option": (base, base + ["--max-shard-size", "100kB"], "--max-shard-size"),
    }


@pytest.mark.parametrize("case", ["another input", "another option", "another command",
                                  "another output option"])
def test_processes_given_different_runs_fail_together_before_any_work(reshard_bin, small,
                                                                       tmp_path, case):
    other = tmp_path / "copy"  # the same files under another path
    shutil.copytree(small / "ref-scatter", other)
    first, last, shown = different_runs(small, other)[case]
    out = tmp_path / "out"
    r = run(mpmd(reshard_bin, (2, [*first, "-o", out]), (1, [*last, "-o", out])))
    assert r.returncode == 2, r.stderr
    assert "not given the same command and inputs" in r.stderr and "process 2" in r.stderr, r.stderr
    assert shown in r.stderr, r.stderr
    assert not os.path.exists(out) and temporaries(out) == []


def test_processes_given_different_deepspeed_checkpoints_fail_together(reshard_bin, ds_checkpoint,
                                                                        tmp_path):
    """The universal conversion of two checkpoints into one output: refused, nothing written."""
    ckpt = ds_checkpoint(Spec("llama", tp=2, dp=2, stage=1))
    other = tmp_path / "other"
    shutil.copytree(ckpt.save_dir, other)
    out = tmp_path / "out"
    r = run(mpmd(reshard_bin, (2, ["convert", ckpt.save_dir, "--to", "universal", "-o", out]),
                 (1, ["convert", other, "--to", "universal", "-o", out])))
    assert r.returncode == 2, r.stderr
    assert f"the input is \"{other}\" on process 2" in r.stderr, r.stderr
    assert not os.path.exists(out) and temporaries(out) == []


def test_processes_whose_input_files_differ_fail_together(reshard_bin, small, tmp_path):
    """One path, other files (as nodes that each hold their own copy): every process reads
    /proc/self/cwd/ckpt from a directory of its own, and one copy's file has another
    modification time."""
    for d in ("a", "b"):
        shutil.copytree(small / "ref-scatter", tmp_path / d / "ckpt")
    os.utime(tmp_path / "b" / "ckpt" / "model-rank-1-part-0.safetensors", (1, 1))
    out = tmp_path / "out"
    cd = f'if [ "$OMPI_COMM_WORLD_RANK" = 2 ]; then cd {tmp_path / "b"}; else cd {tmp_path / "a"}; fi;'
    r = run(mpirun(3, reshard_bin, "convert", "/proc/self/cwd/ckpt", "--tp", 3, "-o", out,
                   wrap=cd))
    assert r.returncode == 2, r.stderr
    assert "the input file model-rank-1-part-0.safetensors is" in r.stderr, r.stderr
    assert "on process 2" in r.stderr, r.stderr
    assert not os.path.exists(out) and temporaries(out) == []
