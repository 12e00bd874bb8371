"""No input makes the CLI die of a signal or an escaped exception: every command, run on every
entry of the corrupt-input tables (torch files, safetensors files, sharded and DeepSpeed
checkpoints, directories that cannot be walked), ends with exit status 1, 2 or 3, a message on
stderr, and no temporary left behind."""

import concurrent.futures
import json
import os
import shutil
import struct
import subprocess

import pytest
from safetensors.torch import save_file

import reshard
import reshard.checkpoint

from test_checkpoints import LAYOUTS, model
from test_checkpoints import corrupt_cases as sharded_corrupt_cases
from test_deepspeed_read import (LLAMA_Z1, bad_latest_names_no_tag, bad_missing_rank_file,
                                 bad_truncated_storage)
from test_safetensors_interop import CORRUPT as SAFETENSORS_CORRUPT
from test_torch_files import HOSTILE, make_pt
from test_torch_files import corrupt_cases as torch_corrupt_cases


def pickle_int(x):
    """A pickle opcode pushing int x: BININT when it fits, else LONG1."""
    if 0 <= x < 2**31:
        return b"J" + struct.pack("<i", x)
    n = (x.bit_length() + 8) // 8
    return b"\x8a" + bytes([n]) + x.to_bytes(n, "little", signed=True)


def expanded_pickle(numel, size, stride):
    """One F32 tensor over storage "0" of `numel` elements, viewed as `size` / `stride`."""
    def tup(xs):
        return b"(" + b"".join(pickle_int(x) for x in xs) + b"t"
    return (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage"
            b"ctorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpu" + pickle_int(numel) +
            b"tQK\x00" + tup(size) + tup(stride) + b"\x89ccollections\nOrderedDict\n)RtR.")


EXPANDED = "torch/expanded 2^40 x stride 0"
# A well-formed file (torch.save writes expanded views so) whose tensor, made contiguous, would
# take 4 TiB: reading its structure and writing it back as it is may succeed; making it
# contiguous (safetensors, DeepSpeed's parameters) may not, but must fail cleanly.
MAY_SUCCEED = {EXPANDED: {"inspect {in}", "inspect --json {in}", "export {in} -o {out}.pt"}}


def file_entries(tmp_path):
    """{id: bytes} of every corrupt file: torch's table, the hostile pickles, an expanded
    (stride-0) view far larger than memory, and the safetensors table."""
    entries = {f"torch/{k}": v[0] for k, v in torch_corrupt_cases(tmp_path).items()}
    entries.update({f"hostile/{k}": make_pt(v) for k, v in HOSTILE.items()})
    entries[EXPANDED] = make_pt(
        expanded_pickle(1, (2**40,), (0,)), {"0": struct.pack("<f", 1.0)})
    entries.update({f"safetensors/{k}": v[0] for k, v in SAFETENSORS_CORRUPT.items()})
    return entries


def walk_failures():
    """Directories whose walking fails: each makes a directory under `d`."""
    def latest_loop(d):
        os.symlink("latest", d / "latest")

    def latest_names_too_long(d):
        (d / "latest").write_text("t" * 300)

    def tag_dir_loop(d):
        (d / "latest").write_text("global_step1")
        os.symlink("global_step1", d / "global_step1")

    def pt_file_loop(d):
        os.symlink("loop.pt", d / "loop.pt")

    return [latest_loop, latest_names_too_long, tag_dir_loop, pt_file_loop]


FILE_COMMANDS = [
    ["inspect", "{in}"], ["inspect", "--json", "{in}"],
    ["export", "{in}", "-o", "{out}.safetensors"], ["export", "{in}", "-o", "{out}.pt"],
    ["verify", "{in}"], ["show", "{in}"], ["infer", "{in}"],
    ["layout", "{in}", "--shape", "4,4", "--world", "2"],
    ["layout", "--from-deepspeed", "{in}", "--world", "2"],
    ["compose", "--from", "{in}", "--to", "{in}"], ["degree", "{in}"],
]
DIR_COMMANDS = [
    ["inspect", "{in}"], ["inspect", "--json", "{in}"], ["show", "{in}"],
    ["gather", "{in}", "-o", "{out}"], ["gather", "{in}", "--fp32", "-o", "{out}"],
    ["convert", "{in}", "--tp", "1", "-o", "{out}"],
    ["convert", "{in}", "--to", "universal", "-o", "{out}"],
    ["scatter", "{in}", "--layouts", "{layouts}", "--tp", "2", "-o", "{out}"],
]


def run_all(reshard_bin, work, commands, inp):
    """Runs every command on `inp` (several at once), each with its own output path; returns
    [(command, CompletedProcess)]."""
    layouts = work / "layouts.json"
    layouts.write_text(json.dumps(LAYOUTS))

    def one(i, command):
        args = [a.format(**{"in": inp, "out": work / f"out{i}", "layouts": layouts}) for a in command]
        return command, subprocess.run([reshard_bin, *args], capture_output=True, text=True,
                                       timeout=120, stdin=subprocess.DEVNULL)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda ic: one(*ic), enumerate(commands)))


def assert_clean_failures(results, work, where, may_succeed=()):
    for command, r in results:
        assert r.returncode >= 0, (where, command, f"killed by signal {-r.returncode}", r.stderr)
        assert "terminate called" not in r.stderr, (where, command, r.stderr)
        if r.returncode == 0 and " ".join(command) in may_succeed:
            continue
        assert 1 <= r.returncode <= 3, (where, command, r.returncode, r.stdout[-300:], r.stderr)
        assert r.stderr.strip(), (where, command)
    left = [p for p in os.listdir(work)
            if (p.startswith("out") and not may_succeed) or ".tmp-" in p]
    assert left == [], (where, left)


def _file_ids():
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        return sorted(file_entries(d))


@pytest.mark.parametrize("entry", _file_ids())
def test_no_corrupt_file_kills_any_command(reshard_bin, tmp_path, entry):
    data = file_entries(tmp_path)[entry]
    work = tmp_path / "work"
    work.mkdir()
    # The file alone (named as its kind is), and the file in a directory where a checkpoint
    # would hold it: a DeepSpeed tag dir's model states, a Hugging Face model.safetensors.
    torch_like = not entry.startswith("safetensors/")
    path = work / ("bad.pt" if torch_like else "bad.safetensors")
    path.write_bytes(data)
    results = run_all(reshard_bin, work, FILE_COMMANDS, path)
    assert_clean_failures(results, work, entry, MAY_SUCCEED.get(entry, ()))
    d = work / "ckpt"
    d.mkdir()
    (d / ("mp_rank_00_model_states.pt" if torch_like else "model.safetensors")).write_bytes(data)
    results = run_all(reshard_bin, work, DIR_COMMANDS, d)
    assert_clean_failures(results, work, entry + " (in a directory)", MAY_SUCCEED.get(entry, ()))


@pytest.mark.parametrize("make", walk_failures(), ids=lambda f: f.__name__)
def test_no_unwalkable_directory_kills_any_command(reshard_bin, tmp_path, make):
    work = tmp_path / "work"
    work.mkdir()
    d = work / "ckpt"
    d.mkdir()
    make(d)
    assert_clean_failures(run_all(reshard_bin, work, DIR_COMMANDS, d), work, make.__name__)


@pytest.mark.parametrize("damage", [c[0] for c in sharded_corrupt_cases()],
                         ids=lambda f: f.__name__)
def test_no_corrupt_sharded_checkpoint_kills_any_command(reshard_bin, tmp_path, damage):
    work = tmp_path / "work"
    work.mkdir()
    full = work / "full"
    full.mkdir()
    save_file(model(), str(full / "model.safetensors"), metadata={"format": "pt"})
    (work / "layouts.json").write_text(json.dumps(LAYOUTS))
    sharded = work / "sharded"
    r = subprocess.run([reshard_bin, "scatter", str(full), "--layouts", str(work / "layouts.json"),
                        "--tp", "2", "-o", str(sharded)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    shutil.rmtree(full)
    damage(sharded)
    commands = [c for c in DIR_COMMANDS if c[0] in ("gather", "convert", "scatter")]
    commands.append(["diff", "{in}", "{in}"])  # even against itself: refused, never equal
    assert_clean_failures(run_all(reshard_bin, work, commands, sharded), work, damage.__name__)


@pytest.mark.parametrize("spoil", [bad_missing_rank_file, bad_truncated_storage,
                                   bad_latest_names_no_tag], ids=lambda f: f.__name__)
def test_no_corrupt_deepspeed_checkpoint_kills_any_command(reshard_bin, tmp_path, ds_checkpoint,
                                                           spoil):
    ckpt = ds_checkpoint(LLAMA_Z1)
    work = tmp_path / "work"
    work.mkdir()
    save = work / "ckpt"
    shutil.copytree(ckpt.save_dir, save)
    spoil(ds_checkpoint, save / ckpt.tag)
    assert_clean_failures(run_all(reshard_bin, work, DIR_COMMANDS, save), work, spoil.__name__)


@pytest.mark.parametrize("make", walk_failures(), ids=lambda f: f.__name__)
def test_inspect_refuses_an_unwalkable_directory_as_malformed_input(reshard_bin, tmp_path, make):
    d = tmp_path / "ckpt"
    d.mkdir()
    make(d)
    for args in (["inspect", d], ["inspect", "--json", d]):
        r = subprocess.run([reshard_bin, *map(str, args)], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and str(d) in r.stderr, (args, r.returncode, r.stderr)
    with pytest.raises(reshard.CheckpointError, match=str(d)):
        reshard.checkpoint.inspect(d)
