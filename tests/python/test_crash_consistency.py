"""Crash consistency: scatter, convert and gather interrupted at many points of their progress
(SIGINT, SIGTERM, SIGHUP, SIGXFSZ, and SIGKILL). After every interruption the output is absent
or complete (byte-identical to an uninterrupted run), the input is byte-identical, and no
temporary is left after a signal the process can handle; after a SIGKILL the next run into the
same output removes the dead run's temporary.

The moment of each signal comes from the process's own progress: the test watches the
temporary output directory appear and grow, and signals once it holds a given fraction of the
output's bytes."""

import filecmp
import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

LAYERS = 12
FRACTIONS = [0.0, 0.15, 0.3, 0.5, 0.7, 0.85]
SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGXFSZ]


def no_core_dumps():
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def tree_digest(path):
    """{relative path: sha256} of every file under `path`."""
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = hashlib.file_digest(fh, "sha256").hexdigest()
    return out


def same_tree(a, b):
    names = sorted(os.listdir(a))
    if names != sorted(os.listdir(b)):
        return False
    # A DCP output's .metadata names its own path (StorageMeta.checkpoint_id): compared as
    # DCP's records, the rest byte for byte.
    if ".metadata" in names:
        import pickle
        ma, mb = (pickle.loads((p / ".metadata").read_bytes()) for p in (a, b))
        if (ma.state_dict_metadata != mb.state_dict_metadata
                or ma.storage_data != mb.storage_data):
            return False
        names.remove(".metadata")
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    return not mismatch and not errors


def temporaries(out):
    parent, name = os.path.split(str(out))
    return [os.path.join(parent, e) for e in os.listdir(parent) if e.startswith(f".{name}.")]


def bytes_under(path):
    total = 0
    try:
        for e in os.scandir(path):
            try:
                total += e.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                pass
    except FileNotFoundError:
        pass
    return total


def write_layered_model(d, layers, rows, cols, seed, bias):
    """d/full: a full checkpoint of `layers` layers, each a bf16 weight of rows x cols split by
    rows, one of cols x rows split by columns and an fp32 bias of `rows` laid out as `bias`;
    d/layouts.json: those layouts."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(layers):
        for name, shape in ((f"l{layer}.w", (rows, cols)), (f"l{layer}.o", (cols, rows))):
            raw = bytearray(rng.bytes(2 * shape[0] * shape[1]))
            tensors[name] = torch.frombuffer(raw, dtype=torch.int16).view(torch.bfloat16).reshape(shape)
        tensors[f"l{layer}.b"] = torch.from_numpy(rng.standard_normal(rows, dtype=np.float32))
    (d / "full").mkdir()
    save_file(tensors, str(d / "full" / "model.safetensors"), metadata={"format": "pt"})
    layouts = {"version": 1, "*": {"family": "split", "dim": 0}}
    for layer in range(layers):
        layouts[f"l{layer}.o"] = {"family": "split", "dim": 1}
        layouts[f"l{layer}.b"] = bias
    (d / "layouts.json").write_text(json.dumps(layouts))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, reshard_bin):
    """A ~190 MB full checkpoint, its layouts, and uninterrupted reference outputs."""
    d = tmp_path_factory.mktemp("crash")
    write_layered_model(d, LAYERS, 1024, 4096, seed=7, bias={"family": "replicated", "pre_divided": True})
    commands = {
        "scatter": lambda out: ["scatter", d / "full", "--layouts", d / "layouts.json", "--tp", 4, "-o", out],
        "convert": lambda out: ["convert", d / "ref-scatter", "--tp", 2, "-o", out],
        "gather": lambda out: ["gather", d / "ref-convert", "-o", out],
        "to-dcp": lambda out: ["convert", d / "ref-scatter", "--to", "dcp", "--world", 3, "-o", out],
        "gather-dcp": lambda out: ["gather", d / "ref-to-dcp", "-o", out],
    }
    # each reads the previous one's output
    for name in ("scatter", "convert", "gather", "to-dcp", "gather-dcp"):
        r = subprocess.run([reshard_bin, *map(str, commands[name](d / f"ref-{name}"))], capture_output=True)
        assert r.returncode == 0, r.stderr
    inputs = {"scatter": d / "full", "convert": d / "ref-scatter", "gather": d / "ref-convert",
              "to-dcp": d / "ref-scatter", "gather-dcp": d / "ref-to-dcp"}
    return d, commands, inputs


def below_the_test(ignored=()):
    """A run to be interrupted: no core dump, at a lower priority than the test process that
    watches its output, and every signal the tests send at its default action but `ignored`.
    reshard keeps a signal ignored when it starts ignored (`nohup`), so a test run under nohup
    would otherwise see every SIGHUP run to its end and nothing caught mid-way."""
    no_core_dumps()
    os.nice(10)
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)


def start(reshard_bin, args, ignored=()):
    return subprocess.Popen([reshard_bin, *map(str, args)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, preexec_fn=lambda: below_the_test(ignored))


def signal_at(proc, out, fraction, total, sig):
    """Sends `sig` once the temporary output holds `fraction` of `total` bytes (or the process
    has ended); returns whether a temporary existed when the signal was sent."""
    seen = False
    while proc.poll() is None:
        temps = temporaries(out)
        seen = bool(temps)
        if temps and sum(bytes_under(t) for t in temps) >= fraction * total:
            break
        time.sleep(0.001)  # polling interval; the condition above is what synchronises
    proc.send_signal(sig)
    return seen and proc.poll() is None


@pytest.mark.parametrize("command", ["scatter", "convert", "gather", "to-dcp", "gather-dcp"])
def test_interrupted_runs_leave_the_output_absent_or_complete(reshard_bin, ckpt, command):
    d, commands, inputs = ckpt
    reference = d / f"ref-{command}"
    total = sum(os.path.getsize(reference / f) for f in os.listdir(reference))
    input_before = tree_digest(inputs[command])
    interrupted = 0
    for i, fraction in enumerate(FRACTIONS):
        sig = SIGNALS[i % len(SIGNALS)]
        out = d / f"{command}-{i}"
        proc = start(reshard_bin, commands[command](out))
        mid_run = signal_at(proc, out, fraction, total, sig)
        _, stderr = proc.communicate(timeout=120)
        where = f"{command} at {fraction:.0%} of its output, {signal.Signals(sig).name}: {stderr!r}"
        assert proc.returncode in (0, -sig), where
        if os.path.exists(out):
            assert same_tree(out, reference), where
        else:
            interrupted += mid_run
        assert temporaries(out) == [], where
    assert interrupted >= 1, f"no {command} run was caught mid-way"
    assert tree_digest(inputs[command]) == input_before


@pytest.mark.parametrize("command", ["scatter", "convert", "gather", "to-dcp", "gather-dcp"])
def test_the_run_after_a_sigkill_removes_its_temporary(reshard_bin, ckpt, command):
    d, commands, inputs = ckpt
    reference = d / f"ref-{command}"
    total = sum(os.path.getsize(reference / f) for f in os.listdir(reference))
    out = d / f"{command}-killed"
    # Kill later first, then earlier: on a fast machine a run may finish before 40 % is seen,
    # but one killed as soon as its temporary appears is always caught mid-way.
    for fraction in (0.4, 0.1, 0.0):
        shutil.rmtree(out, ignore_errors=True)
        proc = start(reshard_bin, commands[command](out))
        mid_run = signal_at(proc, out, fraction, total, signal.SIGKILL)
        proc.communicate(timeout=120)
        if mid_run and proc.returncode == -signal.SIGKILL:
            break
    else:
        pytest.fail(f"no {command} run was caught mid-way by SIGKILL")
    assert not os.path.exists(out) and len(temporaries(out)) == 1  # what SIGKILL leaves
    r = subprocess.run([reshard_bin, *map(str, commands[command](out))], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert temporaries(out) == []
    assert same_tree(out, reference)


def test_a_signal_ignored_at_start_stays_ignored(reshard_bin, ckpt):
    """Under nohup (SIGHUP ignored when reshard starts) a SIGHUP mid-run changes nothing: the
    run ends by itself, with the whole output."""
    d, commands, _ = ckpt
    reference = d / "ref-convert"
    for i in range(12):  # a SIGHUP after the run ended would prove nothing
        out = d / f"convert-nohup-{i}"
        proc = start(reshard_bin, commands["convert"](out), ignored=(signal.SIGHUP,))
        mid_run = signal_at(proc, out, 0.0, 1, signal.SIGHUP)
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        assert same_tree(out, reference) and temporaries(out) == []
        if mid_run:
            break
    else:
        pytest.fail("no run was sent its SIGHUP mid-way")


def test_a_file_size_limit_fails_cleanly_with_exit_3(reshard_bin, ckpt):
    d, commands, _ = ckpt
    out = d / "limited"

    def small_files():  # SIGXFSZ keeps its default action, as under `ulimit -f`
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    for command in ("scatter", "convert", "gather"):
        r = subprocess.run([reshard_bin, *map(str, commands[command](out))], capture_output=True,
                           text=True, preexec_fn=small_files)
        assert r.returncode == 3 and "too large" in r.stderr, (command, r.returncode, r.stderr)
        assert not os.path.exists(out) and temporaries(out) == []
