"""The package reads its inputs as the CLI does, through the same reader: a sharded checkpoint
that `reshard gather` refuses, `reshard.checkpoint.load_rank` (what a push reads) refuses with
the same message; a map document's path is read as `reshard verify` reads it (a FIFO nobody
writes refused at once, a byte-order mark accepted), and JSON text is told from a path by what
it is, not by its first character."""

import json
import os
import shutil
import subprocess
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

import reshard
from maps import split_map

# -- a sharded checkpoint at TP 2, and every way of breaking it ------------------------------


@pytest.fixture
def sharded(tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    save_file({"w": torch.arange(48, dtype=torch.float32).reshape(8, 6),
               "b": torch.arange(6, dtype=torch.float32)}, str(full / "model.safetensors"))
    maps = {"w": split_map([8, 6], 0, [4, 4]), "b": split_map([6], 0, [3, 3])}
    out = tmp_path / "tp2"
    reshard.checkpoint.scatter(full, out, maps=maps)
    return out


def rank_file(d, rank):
    return d / f"model-rank-{rank}-part-0.safetensors"


def retensor(d, rank, change):
    tensors = load_file(str(rank_file(d, rank)))
    change(tensors)
    save_file(tensors, str(rank_file(d, rank)))


def remanifest(d, change):
    m = json.loads((d / "reshard.json").read_text())
    change(m)
    (d / "reshard.json").write_text(json.dumps(m))


def retext(d, change):
    (d / "reshard.json").write_text(change((d / "reshard.json").read_text()))


def outside(d):
    shutil.copy(rank_file(d, 0), d.parent / "outside.safetensors")
    remanifest(d, lambda m: m["files"].update({"0": [str(d.parent / "outside.safetensors")]}))


def above(d):
    shutil.copy(rank_file(d, 0), d.parent / "above.safetensors")
    remanifest(d, lambda m: m["files"].update({"0": ["../above.safetensors"]}))


def hard_link(d):
    os.unlink(rank_file(d, 1))
    os.link(rank_file(d, 0), rank_file(d, 1))


BREAKS = {
    # the files against the manifest
    "shape": lambda d: retensor(d, 0, lambda t: t.update(w=t["w"].reshape(6, 4).contiguous())),
    "dtype": lambda d: retensor(d, 0, lambda t: t.update(w=t["w"].to(torch.int32))),
    "stray_tensor": lambda d: retensor(d, 1, lambda t: t.update(stray=torch.zeros(2))),
    "missing_tensor": lambda d: retensor(d, 0, lambda t: t.pop("b")),
    "file_outside": outside,
    "file_above": above,
    "one_file_two_ranks": lambda d: remanifest(d, lambda m: m["files"].update(
        {"1": m["files"]["0"]})),
    "hard_linked_ranks": hard_link,
    # the manifest itself
    "version_99": lambda d: remanifest(d, lambda m: m.update(version=99)),
    "format_other": lambda d: remanifest(d, lambda m: m.update(format="other")),
    "world_2.9": lambda d: remanifest(d, lambda m: m.update(world_size=2.9)),
    "world_string": lambda d: remanifest(d, lambda m: m.update(world_size="2")),
    "duplicate_key": lambda d: retext(d, lambda t: t.replace("{", '{"world_size": 1, ', 1)),
    "scale_power_x": lambda d: remanifest(d, lambda m: m["params"]["w"].update(scale_power="x")),
    "deep": lambda d: retext(d, lambda t: t.rstrip()[:-1] + ', "junk": ' + "[" * 100000 +
                             "]" * 100000 + "}"),
    "not_json": lambda d: retext(d, lambda t: t[:-3]),
}


def gather_cli(reshard_bin, d, out):
    return subprocess.run([reshard_bin, "gather", str(d), "-o", str(out)], capture_output=True,
                          text=True)


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_load_rank_refuses_what_gather_refuses_with_its_message(sharded, reshard_bin, tmp_path,
                                                                name):
    reshard.checkpoint.load_rank(sharded, 1)  # whole, it reads
    BREAKS[name](sharded)
    cli = gather_cli(reshard_bin, sharded, tmp_path / "out")
    assert cli.returncode == 2, cli.stderr
    for rank in (0, 1):
        with pytest.raises(reshard.CheckpointError) as e:
            reshard.checkpoint.load_rank(sharded, rank)
        assert str(e.value) in cli.stderr


def refused_at_once(call, fifo):
    """`call()` on a thread: what it raised. A reader blocked on the FIFO is released (a
    writer opens and closes it) and the test fails."""
    raised = []

    def body():
        try:
            call()
        except BaseException as e:  # handed to the test
            raised.append(e)
    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(120)  # a bound on a hang, not a timing: the refusal comes at once
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join()
        pytest.fail(f"{call} waited on the FIFO {fifo}")
    assert raised, f"{call} read the FIFO {fifo}"
    return raised[0]


def test_load_rank_refuses_a_fifo_manifest_at_once(sharded, reshard_bin, tmp_path):
    os.unlink(sharded / "reshard.json")
    os.mkfifo(sharded / "reshard.json")
    cli = gather_cli(reshard_bin, sharded, tmp_path / "out")
    assert cli.returncode == 2, cli.stderr
    e = refused_at_once(lambda: reshard.checkpoint.load_rank(sharded, 0), sharded / "reshard.json")
    assert isinstance(e, reshard.CheckpointError) and str(e) in cli.stderr


def test_load_rank_reads_each_rank_and_refuses_a_rank_outside(sharded):
    for rank in (0, 1):
        maps, shards = reshard.checkpoint.load_rank(sharded, rank)
        assert sorted(maps) == ["b", "w"] and sorted(shards) == ["b", "w"]
        assert torch.equal(shards["w"], torch.arange(48, dtype=torch.float32).reshape(8, 6)[
            4 * rank:4 * rank + 4])
    for rank in (-1, 2, True, 1.0, "0"):
        with pytest.raises(ValueError, match="has ranks 0 .. 1"):
            reshard.checkpoint.load_rank(sharded, rank)
    with pytest.raises(FileNotFoundError):
        reshard.checkpoint.load_rank(sharded.parent / "nowhere", 0)


# -- map documents: paths, text, FIFOs --------------------------------------------------------

def document():
    return reshard.maps_to_json({"w": split_map([8, 6], 0, [4, 4])})


@pytest.mark.parametrize("read", [reshard.read_maps, reshard.read_buffers],
                         ids=["read_maps", "read_buffers"])
def test_a_fifo_document_is_refused_at_once(tmp_path, reshard_bin, read):
    fifo = tmp_path / "maps.json"
    os.mkfifo(fifo)
    cli = subprocess.run([reshard_bin, "verify", str(fifo)], capture_output=True, text=True)
    assert cli.returncode == 2, cli.stderr
    for source in (fifo, str(fifo)):
        e = refused_at_once(lambda source=source: read(source), fifo)
        assert isinstance(e, reshard.MapError) and str(e) in cli.stderr


@pytest.mark.parametrize("name", ["{maps}.json", "{x}", " {a} "])
def test_a_path_beginning_with_a_brace_is_a_path(tmp_path, monkeypatch, name):
    (tmp_path / name).write_text(document())
    monkeypatch.chdir(tmp_path)
    want = reshard.read_maps(document())
    assert reshard.read_maps(name) == want
    assert reshard.read_buffers(name) is None
    with pytest.raises(FileNotFoundError):
        reshard.read_maps("{missing}.json")


def test_json_text_after_a_byte_order_mark_is_text_as_the_cli_reads_it(tmp_path, reshard_bin):
    want = reshard.read_maps(document())
    assert reshard.read_maps("\ufeff" + document()) == want
    assert reshard.read_maps("\ufeff \n" + document() + "\n") == want
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + document().encode())
    assert subprocess.run([reshard_bin, "verify", str(path)], capture_output=True).returncode == 0
    assert reshard.read_maps(path) == want
    assert reshard.read_maps(str(path)) == want


def test_a_malformed_document_file_is_named_as_the_cli_names_it(tmp_path, reshard_bin):
    path = tmp_path / "bad.json"
    path.write_text(document().replace('"logical_shape"', '"logical_shape": [1], "logical_shape"',
                                       1))
    cli = subprocess.run([reshard_bin, "verify", str(path)], capture_output=True, text=True)
    assert cli.returncode == 2, cli.stderr
    with pytest.raises(reshard.MapError) as e:
        reshard.read_maps(path)
    assert str(e.value).startswith(f'error reading "{path}"') and str(e.value) in cli.stderr
