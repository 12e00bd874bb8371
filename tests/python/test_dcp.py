"""PyTorch Distributed Checkpoints (DCP) read by reshard: checkpoints written by torch's own
`dcp.save` under torchrun (dcp_save_worker.py: DTensors on a 2 x 2 mesh, FSDP2, the HF-storage
variant), gathered and converted through the CLI and the Python package, compared with torch's
`dcp_to_torch_save`; and a corrupt-file table."""

import json
import os
import pathlib
import pickle
import re
import shutil
import struct
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "dcp_save_worker.py"


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def dcp_root(tmp_path_factory):
    """One torchrun launch (4 ranks, gloo) writing every checkpoint of dcp_save_worker.py."""
    out = tmp_path_factory.mktemp("dcp")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), str(WORKER),
           str(out)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert (out / "done").exists(), f"torchrun exited {r.returncode}:\n{r.stderr[-4000:]}"
    return out


def run(reshard_bin, *args):
    return subprocess.run([reshard_bin, *map(str, args)], capture_output=True, text=True)


def flat_tensors(obj, prefix=""):
    """The tensors of a nested state dict, by DCP's flattened names."""
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flat_tensors(v, f"{prefix}{k}."))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flat_tensors(v, f"{prefix}{i}."))
    elif isinstance(obj, torch.Tensor):
        out[prefix[:-1]] = obj
    return out


def torch_reference(ckpt, tmp_path):
    """What torch itself reads from the checkpoint: dcp_to_torch_save, then torch.load."""
    path = tmp_path / f"{ckpt.name}-ref.pt"
    dcp_to_torch_save(str(ckpt), str(path))
    return flat_tensors(torch.load(path, weights_only=False))


def model_only(tensors):
    """The tensors gather writes: all but the optimizer's ("optim." keys here)."""
    return {k: v for k, v in tensors.items() if not k.startswith("optim.")}


def assert_same(got, want):
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


def test_gather_equals_torchs_own_reading(dcp_root, reshard_bin, tmp_path):
    ckpt = dcp_root / "mesh"
    r = run(reshard_bin, "gather", ckpt, "-o", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert_same(got, model_only(torch_reference(ckpt, tmp_path)))
    # And the full tensors the worker distributed (uneven chunks, empty chunks, 0-d, bf16).
    full = json.loads((dcp_root / "full.json").read_text())
    for name, t in full.items():
        assert list(got[name].shape) == t["shape"], name
        assert got[name].float().flatten().tolist() == t["values"], name


def test_optimizer_state_goes_through_convert(dcp_root, reshard_bin, tmp_path):
    # gather keeps the optimizer state out of the Hugging Face files; convert carries it (at any
    # world size, TP 1 included), unless --weights-only, and a gather of that writes it too.
    ref = torch_reference(dcp_root / "mesh", tmp_path)
    r = run(reshard_bin, "convert", dcp_root / "mesh", "--tp", "1", "-o", tmp_path / "tp1")
    assert r.returncode == 0, r.stderr
    r = run(reshard_bin, "gather", tmp_path / "tp1", "-o", tmp_path / "all")
    assert r.returncode == 0, r.stderr
    assert_same(load_file(tmp_path / "all" / "model.safetensors"), ref)
    r = run(reshard_bin, "convert", dcp_root / "mesh", "--tp", "3", "--weights-only", "-o",
            tmp_path / "tp3")
    assert r.returncode == 0, r.stderr
    manifest = json.loads((tmp_path / "tp3" / "reshard.json").read_text())
    assert sorted(manifest["params"]) == sorted(model_only(ref))


def test_gather_writes_the_optimizer_state_when_asked(dcp_root, reshard_bin, tmp_path):
    ref = torch_reference(dcp_root / "mesh", tmp_path)
    assert any(k.startswith("optim.") for k in ref)
    r = run(reshard_bin, "gather", dcp_root / "mesh", "--optimizer-state", "-o", tmp_path / "all")
    assert r.returncode == 0, r.stderr
    assert_same(load_file(tmp_path / "all" / "model.safetensors"), ref)
    import reshard
    reshard.checkpoint.gather(dcp_root / "mesh", tmp_path / "py", optimizer_state=True)
    assert_same(load_file(tmp_path / "py" / "model.safetensors"), ref)
    # Formats whose gather cannot add it refuse, before writing anything.
    r = run(reshard_bin, "convert", dcp_root / "mesh", "--tp", "1", "-o", tmp_path / "tp1")
    assert r.returncode == 0, r.stderr
    r = run(reshard_bin, "gather", tmp_path / "tp1", "--optimizer-state", "-o", tmp_path / "x")
    assert r.returncode == 2 and "optimizer state included" in r.stderr, r.stderr
    assert not (tmp_path / "x").exists()


def test_fsdp2_fully_shard_checkpoint(dcp_root, reshard_bin, tmp_path):
    assert not (dcp_root / "fsdp2.txt").exists(), (dcp_root / "fsdp2.txt").read_text()
    ckpt = dcp_root / "fsdp2"
    ref = torch_reference(ckpt, tmp_path)
    assert any(k.startswith("optim.state.") for k in ref)
    r = run(reshard_bin, "gather", ckpt, "-o", tmp_path / "weights")
    assert r.returncode == 0, r.stderr
    assert_same(load_file(tmp_path / "weights" / "model.safetensors"),
                {k: v for k, v in ref.items() if k.startswith("model.")})
    r = run(reshard_bin, "convert", ckpt, "--tp", "2", "-o", tmp_path / "tp2")
    assert r.returncode == 0, r.stderr
    r = run(reshard_bin, "gather", tmp_path / "tp2", "-o", tmp_path / "all")
    assert r.returncode == 0, r.stderr
    assert_same(load_file(tmp_path / "all" / "model.safetensors"), ref)


def test_convert_then_gather_round_trips(dcp_root, reshard_bin, tmp_path):
    ckpt = dcp_root / "mesh"
    r = run(reshard_bin, "convert", ckpt, "--tp", "2", "-o", tmp_path / "tp2")
    assert r.returncode == 0, r.stderr
    manifest = json.loads((tmp_path / "tp2" / "reshard.json").read_text())
    assert manifest["world_size"] == 2
    # The default layout: dim-0 row splits as DTensor's Shard(0) makes them.
    assert manifest["params"]["model.embed.weight"]["layout"] == {
        "family": "split", "dim": 0, "remainder": "ceil"}
    assert manifest["params"]["model.embed.weight"]["map"]["ranks"]["1"]["shard_shape"] == [5, 6]
    r = run(reshard_bin, "gather", tmp_path / "tp2", "-o", tmp_path / "back")
    assert r.returncode == 0, r.stderr
    assert_same(load_file(tmp_path / "back" / "model.safetensors"),
                torch_reference(ckpt, tmp_path))


def test_per_rank_metadata_and_replicated_chunks(dcp_root, reshard_bin, tmp_path):
    # use_collectives=False: one __{r}.metadata per rank, and each holder of a replicated
    # tensor saves its own copy (replicas, compared before anything is written).
    ckpt = dcp_root / "perrank"
    assert not (ckpt / ".metadata").exists() and (ckpt / "__3.metadata").exists()
    r = run(reshard_bin, "gather", ckpt, "-o", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    assert_same(load_file(tmp_path / "hf" / "model.safetensors"),
                model_only(torch_reference(dcp_root / "mesh", tmp_path)))


def test_replicas_that_disagree_fail_the_check(dcp_root, reshard_bin, tmp_path):
    ckpt = tmp_path / "perrank"
    shutil.copytree(dcp_root / "perrank", ckpt)
    from torch.distributed.checkpoint.metadata import MetadataIndex
    with open(ckpt / "__2.metadata", "rb") as f:
        md = pickle.load(f)
    info = md.storage_data[MetadataIndex("model.norm.scale", [])]
    data = bytearray((ckpt / info.relative_path).read_bytes())
    at = data.index(struct.pack("<f", 1.5), info.offset, info.offset + info.length)
    data[at:at + 4] = struct.pack("<f", 2.5)
    (ckpt / info.relative_path).write_bytes(bytes(data))
    r = run(reshard_bin, "gather", ckpt, "-o", tmp_path / "hf")
    assert r.returncode == 1, r.stderr
    assert "model.norm.scale" in r.stderr, r.stderr
    assert not (tmp_path / "hf").exists()


def test_reads_what_convert_to_dcp_writes(dcp_root, reshard_bin, tmp_path):
    r = run(reshard_bin, "convert", dcp_root / "mesh", "--to", "dcp", "--world", "3", "-o",
            tmp_path / "w3")
    assert r.returncode == 0, r.stderr
    r = run(reshard_bin, "gather", tmp_path / "w3", "-o", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    assert_same(load_file(tmp_path / "hf" / "model.safetensors"),
                model_only(torch_reference(dcp_root / "mesh", tmp_path)))


@pytest.mark.parametrize("ckpt", ["mesh", "perrank", "fsdp2"])
def test_convert_to_dcp_keeps_every_key_its_nesting_and_the_bytes_items(dcp_root, reshard_bin,
                                                                        tmp_path, ckpt):
    """From 2-D boxes on a 2 x 2 mesh, per-rank metadata and FSDP2: torch's own reading of the
    whole structure (dcp_to_torch_save, which nests by planner_data) is the source's, bytes items
    (an int, a str, param_groups' values and lists) included, and planner_data is torch's."""
    src = dcp_root / ckpt
    if ckpt == "fsdp2" and not src.exists():
        pytest.skip((dcp_root / "fsdp2.txt").read_text())
    r = run(reshard_bin, "convert", src, "--to", "dcp", "--world", "3", "-o", tmp_path / "w3")
    assert r.returncode == 0, r.stderr
    metadata = []
    for d in (src, tmp_path / "w3"):
        names = [".metadata"] if (d / ".metadata").exists() else \
            sorted(p.name for p in d.glob("__*.metadata"))
        planner = {}
        for name in names:
            with open(d / name, "rb") as f:
                planner.update(pickle.load(f).planner_data)
        metadata.append(planner)
    assert metadata[1] == metadata[0]
    assert any(isinstance(e, int) for path in metadata[0].values() for e in path)
    # torch's dcp_to_torch_save does not merge per-rank metadata (it returns uninitialised
    # tensors); the per-rank save holds the mesh save's state dict, which it reads.
    dcp_to_torch_save(str(dcp_root / "mesh" if ckpt == "perrank" else src),
                      str(tmp_path / "src.pt"))
    dcp_to_torch_save(str(tmp_path / "w3"), str(tmp_path / "w3.pt"))
    want = torch.load(tmp_path / "src.pt", weights_only=False)
    got = torch.load(tmp_path / "w3.pt", weights_only=False)
    assert sorted(got) == sorted(want)
    assert_same(flat_tensors(got), flat_tensors(want))
    assert without_tensors(got) == without_tensors(want)


def test_convert_to_universal_needs_both_of_adams_moments(dcp_root, reshard_bin, tmp_path):
    # mesh/ holds optimizer state of one parameter, exp_avg alone.
    r = run(reshard_bin, "convert", dcp_root / "mesh", "--to", "universal", "-o", tmp_path / "uc")
    assert r.returncode == 1, r.stderr
    assert '"model.embed.weight" has no exp_avg and exp_avg_sq' in r.stderr, r.stderr
    assert not (tmp_path / "uc").exists()


def without_tensors(obj):
    """A nested state dict with each tensor replaced by a marker."""
    if isinstance(obj, dict):
        return {k: without_tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(without_tensors(v) for v in obj)
    return "<tensor>" if isinstance(obj, torch.Tensor) else obj


def test_hf_storage_variant(dcp_root, reshard_bin, tmp_path):
    ckpt = dcp_root / "hf"
    assert list((ckpt / "sharded").glob("shard-*-model-*-of-*.safetensors"))
    r = run(reshard_bin, "gather", ckpt, "-o", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    got = load_file(tmp_path / "hf" / "model.safetensors")
    full = json.loads((dcp_root / "full.json").read_text())
    want = {k: v for k, v in full.items() if v["shape"]}
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].float().flatten().tolist() == t["values"], name


def test_inspect_shows_chunks_and_bytes_items(dcp_root, reshard_bin):
    r = run(reshard_bin, "inspect", dcp_root / "mesh")
    assert r.returncode == 0, r.stderr
    assert "DCP checkpoint" in r.stdout
    assert "model.embed.weight  F32 [10, 6]" in r.stdout
    assert "rank 3: [5, 3]+[5, 3]" in r.stdout
    assert "step  bytes" in r.stdout and "  7\n" in r.stdout
    # DCP records the ranks that wrote it, not the trainer's mesh: a flat world, said so.
    assert ("parallelism: rank 4 (DCP flat world), optimizer state laid out as its parameters; "
            "not recorded: tp, dp, pp") in r.stdout
    r = run(reshard_bin, "inspect", dcp_root / "mesh", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)["dcp"]
    assert doc["world_size"] == 4
    run_ = json.loads(r.stdout)["parallelism"]
    assert (run_["world"], run_["axes"], run_["optimizer"], run_["unknown"]) == \
        (4, [{"name": "rank", "size": 4}], "as_tensors", ["tp", "dp", "pp"])
    tensors = {t["name"]: t for t in doc["tensors"]}
    assert tensors["model.norm.scale"]["shape"] == []
    assert tensors["optim.state.model.embed.weight.exp_avg"]["optimizer_state"] is True
    items = {b["name"]: b for b in doc["bytes"]}
    assert items["note"]["contents"] == {"value": "hello"}


def test_python_package_takes_dcp_dirs(dcp_root, tmp_path):
    import reshard
    ckpt = dcp_root / "mesh"
    reshard.checkpoint.gather(ckpt, tmp_path / "hf")
    assert_same(load_file(tmp_path / "hf" / "model.safetensors"),
                model_only(torch_reference(ckpt, tmp_path)))
    reshard.checkpoint.convert(ckpt, tmp_path / "tp2", tp=2, weights_only=True)
    manifest = json.loads((tmp_path / "tp2" / "reshard.json").read_text())
    assert manifest["world_size"] == 2
    assert not any(k.startswith("optim.") for k in manifest["params"])
    info = reshard.checkpoint.inspect(ckpt)
    assert info["dcp"]["world_size"] == 4
    assert info["parallelism"]["world"] == 4 and info["parallelism"]["convention"] == \
        "DCP flat world"


# --- zstd items ---------------------------------------------------------------------------


def load_metadata(ckpt):
    with open(ckpt / ".metadata", "rb") as f:
        return pickle.load(f)


def save_metadata(ckpt, md):
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)


def compress_file_items(ckpt, file_name, descriptor="stream.zstd/1"):
    """Rewrites `file_name` with each of its items zstd-compressed (the `zstd` tool), and the
    metadata with the transform descriptor torch's ZStandard extension records."""
    md = load_metadata(ckpt)
    data = (ckpt / file_name).read_bytes()
    out = bytearray()
    for _index, info in sorted(md.storage_data.items(), key=lambda kv: kv[1].offset):
        if info.relative_path != file_name:
            continue
        raw = data[info.offset:info.offset + info.length]
        packed = subprocess.run(["zstd", "-q", "-c"], input=raw, capture_output=True,
                                check=True).stdout
        info.offset, info.length = len(out), len(packed)
        info.transform_descriptors = [descriptor]
        out += packed
    (ckpt / file_name).write_bytes(bytes(out))
    save_metadata(ckpt, md)


def test_zstd_items_are_read(dcp_root, reshard_bin, tmp_path):
    ckpt = tmp_path / "zstd"
    shutil.copytree(dcp_root / "mesh", ckpt)
    compress_file_items(ckpt, "__1_0.distcp")
    r = run(reshard_bin, "gather", ckpt, "-o", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    assert_same(load_file(tmp_path / "hf" / "model.safetensors"),
                model_only(torch_reference(dcp_root / "mesh", tmp_path)))
    r = run(reshard_bin, "inspect", ckpt)
    assert "stream.zstd/1" in r.stdout and "  7\n" in r.stdout


def zstd_zeros(blocks):
    """A zstd frame of `blocks` RLE blocks of 128 KiB zeros each: 4 bytes of file per block, so
    1 GiB of zeros is a 32 KiB stream (no content size in the header, no checksum)."""
    header = struct.pack("<I", 0xFD2FB528) + bytes([0x00, 0x38])  # window 128 KiB

    def block(last):
        return struct.pack("<I", (128 << 10) << 3 | 1 << 1 | last)[:3] + b"\0"

    return header + b"".join(block(int(i == blocks - 1)) for i in range(blocks))


def add_zstd_bomb(ckpt, claimed_elements, blocks):
    """Adds tensor "model.huge" (F32, `claimed_elements`, one chunk) whose item is
    zstd_zeros(blocks) in a file of its own."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, MetadataIndex, TensorProperties, TensorStorageMetadata)
    md = load_metadata(ckpt)
    size = torch.Size([claimed_elements])
    md.state_dict_metadata["model.huge"] = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), size,
        [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=size)])
    stream = zstd_zeros(blocks)
    (ckpt / "__0_1.distcp").write_bytes(stream)
    md.storage_data[MetadataIndex("model.huge", torch.Size([0]))] = _StorageInfo(
        "__0_1.distcp", 0, len(stream), ["stream.zstd/1"])
    md.planner_data["model.huge"] = ("model", "huge")
    save_metadata(ckpt, md)


def limited_memory(gib):
    import resource
    limit = int(gib * (1 << 30))
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


@pytest.mark.parametrize("command", [["gather"], ["convert", "--tp", "2"]])
def test_zstd_item_memory_follows_the_stream_not_its_growth(dcp_root, reshard_bin, tmp_path,
                                                            command):
    # A 32 KiB stream of 1 GiB of zeros for a 1 GiB chunk, in 3 GiB of address space: the
    # stream is decompressed into memory reserved once (it grew by doubling, past the chunk,
    # and ended in std::bad_alloc: exit 3, or std::terminate from a worker thread). The zeros
    # are no torch.save archive: exit 2 naming the item (or, where the output's own buffers
    # leave no room for the reservation, the item refused by name before decompressing; now the
    # claim is also held against the item's 32 KiB, which refuses it before any reservation).
    ckpt = tmp_path / "bomb"
    shutil.copytree(dcp_root / "mesh", ckpt)
    add_zstd_bomb(ckpt, claimed_elements=1 << 28, blocks=8192)
    r = subprocess.run([reshard_bin, *command, str(ckpt), "-o", str(tmp_path / "out")],
                       capture_output=True, text=True, cwd=tmp_path, preexec_fn=limited_memory(3))
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert '"model.huge" chunk 0' in r.stderr, r.stderr
    assert ("not a torch.save archive" in r.stderr
            or "more memory than this process" in r.stderr
            or "more than 256 times its own size" in r.stderr), r.stderr
    assert not (tmp_path / "out").exists()


PEAK_RSS = """
import resource, subprocess, sys
limit = int(sys.argv[1])
r = subprocess.run(sys.argv[2:], capture_output=True, text=True,
                   preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
sys.stderr.write(r.stderr)
print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


@pytest.mark.parametrize("command", [["gather"], ["convert", "--tp", "2"],
                                     ["convert", "--to", "dcp", "--world", "2"]])
def test_zstd_item_that_is_no_archive_stops_at_its_first_window(dcp_root, reshard_bin, tmp_path,
                                                                command):
    # A 2 KiB stream of 64 MiB of zeros (the most a zstd item may hold whatever its size) under
    # a 1 GiB claim: the zip entry a torch.save archive begins with is not there, which the
    # first decompressed window shows, so the item is refused (exit 2, naming it) having cost
    # that window: peak RSS far below the claim (the whole stream was decompressed before: 1.06
    # GB for gather, 2.1 GB for the others, with 1 GiB of zeros).
    ckpt = tmp_path / "bomb"
    shutil.copytree(dcp_root / "mesh", ckpt)
    add_zstd_bomb(ckpt, claimed_elements=1 << 28, blocks=512)
    r = subprocess.run([sys.executable, "-c", PEAK_RSS, str(3 << 30), str(reshard_bin), *command,
                        str(ckpt), "-o", str(tmp_path / "out")],
                       capture_output=True, text=True, cwd=tmp_path)
    rc, peak_kib = map(int, r.stdout.split())
    assert rc == 2, r.stderr
    assert '"model.huge" chunk 0' in r.stderr, r.stderr
    assert "no zip entry at byte 0 of its zstd stream" in r.stderr, r.stderr
    assert peak_kib < 256 << 10, peak_kib
    assert not (tmp_path / "out").exists()


def zstd_archive_bomb(entry, entry_bytes, blocks):
    """A zstd frame that begins as a torch.save archive would: a zip local header (stored, no
    data descriptor) for `entry` declaring `entry_bytes`, in a raw block, then `blocks` RLE
    blocks of 128 KiB zeros for its contents, and nothing after: no central directory."""
    name = entry.encode()
    local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0, 0, entry_bytes, entry_bytes,
                        len(name), 0) + name
    raw = struct.pack("<I", len(local) << 3)[:3] + local  # a raw block, not the last
    return zstd_zeros(blocks)[:6] + raw + zstd_zeros(blocks)[6:]


@pytest.mark.parametrize("entry", ["bomb/data.pkl", "bomb/data/0"])
@pytest.mark.parametrize("command", [["gather"], ["convert", "--tp", "2"]])
def test_zstd_archive_whose_entry_claims_the_chunk_is_refused_before_it_is_held(
        dcp_root, reshard_bin, tmp_path, command, entry):
    # A 32 KiB stream whose first zip entry declares the whole 1 GiB chunk, its bytes the
    # stream's 1 GiB of zeros, no archive after them: the walk of the archive's entries cannot
    # tell it from a real archive until its end, so it was held whole (1.1 GB peak RSS for
    # gather, 2.1 GB for convert). The claim is held against the item's real size: past 64 MiB,
    # at most 256 bytes per byte of stream, so the item is refused (exit 2, naming it) before
    # any byte is decompressed.
    ckpt = tmp_path / "bomb"
    shutil.copytree(dcp_root / "mesh", ckpt)
    add_zstd_bomb(ckpt, claimed_elements=1 << 28, blocks=8192)
    stream = zstd_archive_bomb(entry, 1 << 30, blocks=8192)
    (ckpt / "__0_1.distcp").write_bytes(stream)
    md = load_metadata(ckpt)
    for index, info in md.storage_data.items():
        if index.fqn == "model.huge":
            info.length = len(stream)
    save_metadata(ckpt, md)
    r = subprocess.run([sys.executable, "-c", PEAK_RSS, str(3 << 30), str(reshard_bin), *command,
                        str(ckpt), "-o", str(tmp_path / "out")],
                       capture_output=True, text=True, cwd=tmp_path)
    rc, peak_kib = map(int, r.stdout.split())
    assert rc == 2, r.stderr
    assert '"model.huge" chunk 0' in r.stderr, r.stderr
    assert re.search(f"its zstd stream of {len(stream)} bytes may decompress to [0-9]+ bytes, "
                     "more than 256 times its own size", r.stderr), r.stderr
    assert peak_kib < 256 << 10, peak_kib
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", [["gather"], ["convert", "--tp", "2"]])
def test_a_tensor_no_memory_can_hold_exits_2_naming_it(dcp_root, reshard_bin, tmp_path, command):
    # The same stream under a claim of 256 GiB: the output needs the tensor (or its shard),
    # which 2.5 GiB of address space cannot hold: exit 2 naming the tensor, nothing written.
    ckpt = tmp_path / "bomb"
    shutil.copytree(dcp_root / "mesh", ckpt)
    add_zstd_bomb(ckpt, claimed_elements=1 << 36, blocks=8192)
    r = subprocess.run([reshard_bin, *command, str(ckpt), "-o", str(tmp_path / "out")],
                       capture_output=True, text=True, cwd=tmp_path,
                       preexec_fn=limited_memory(2.5))
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "model.huge" in r.stderr and "more memory than this process" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_a_claim_no_memory_can_hold_exits_2_naming_the_item(dcp_root, reshard_bin, tmp_path):
    # A stream of 2^17 blocks (512 KiB of file, 16 GiB of zeros) under a 256 GiB claim, in 2 GiB
    # of address space: neither the output's tensor nor the stream's bound can be reserved:
    # refused by name before any byte is decompressed (never std::bad_alloc, exit 3).
    ckpt = tmp_path / "bomb"
    shutil.copytree(dcp_root / "mesh", ckpt)
    add_zstd_bomb(ckpt, claimed_elements=1 << 36, blocks=1 << 17)
    r = subprocess.run([reshard_bin, "gather", str(ckpt), "-o", str(tmp_path / "out")],
                       capture_output=True, text=True, cwd=tmp_path, preexec_fn=limited_memory(2))
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "model.huge" in r.stderr and "more memory than this process" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


# --- corrupt files ------------------------------------------------------------------------


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > pwned.txt",))


def missing_distcp(ckpt):
    (ckpt / "__2_0.distcp").unlink()
    return "__2_0.distcp"


def item_past_end(ckpt):
    f = ckpt / "__3_0.distcp"
    f.write_bytes(f.read_bytes()[:100])
    return "__3_0.distcp"


def overlapping_chunks(ckpt):
    md = load_metadata(ckpt)
    from torch.distributed.checkpoint.metadata import MetadataIndex
    meta = md.state_dict_metadata["model.embed.weight"]
    old = meta.chunks[1].offsets
    info = md.storage_data.pop(MetadataIndex("model.embed.weight", old))
    meta.chunks[1].offsets = torch.Size([0, 2])
    md.storage_data[MetadataIndex("model.embed.weight", [0, 2])] = info
    save_metadata(ckpt, md)
    return "model.embed.weight\" chunk 1"


def malicious_global(ckpt):
    md = load_metadata(ckpt)
    md.planner_data["x"] = Evil()
    save_metadata(ckpt, md)
    return "system"


def truncated_metadata(ckpt):
    f = ckpt / ".metadata"
    f.write_bytes(f.read_bytes()[:len(f.read_bytes()) // 2])
    return ".metadata"


def unknown_transform(ckpt):
    compress_file_items(ckpt, "__0_0.distcp", descriptor="stream.lz4/1")
    return "stream.lz4/1"


def corrupt_zstd(ckpt):
    compress_file_items(ckpt, "__0_0.distcp")
    data = bytearray((ckpt / "__0_0.distcp").read_bytes())
    for i in range(20, len(data), 7):
        data[i] ^= 0x5A
    (ckpt / "__0_0.distcp").write_bytes(bytes(data))
    return "zstd"


def nul_in_relative_path(ckpt):
    md = load_metadata(ckpt)
    for info in md.storage_data.values():
        if info.relative_path == "__0_0.distcp":
            info.relative_path = "__0_0.distcp\0junk"
    save_metadata(ckpt, md)
    return "__0_0.distcp\\u0000junk"


def unknown_version(ckpt):
    md = load_metadata(ckpt)
    md.version = "9.9.9"
    save_metadata(ckpt, md)
    return "9.9.9"


def metadata_symlink_loop(ckpt):
    (ckpt / ".metadata").unlink()
    os.symlink(".metadata", ckpt / ".metadata")
    return ".metadata"


CORRUPTIONS = [missing_distcp, item_past_end, overlapping_chunks, malicious_global,
               truncated_metadata, unknown_transform, corrupt_zstd, nul_in_relative_path,
               unknown_version, metadata_symlink_loop]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__)
def test_corrupt_checkpoints_exit_2_naming_what(dcp_root, reshard_bin, tmp_path, corrupt):
    ckpt = tmp_path / "bad"
    shutil.copytree(dcp_root / "mesh", ckpt)
    needle = corrupt(ckpt)
    r = subprocess.run([reshard_bin, "gather", str(ckpt), "-o", str(tmp_path / "out")],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert needle in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "pwned.txt").exists()


@pytest.mark.parametrize("corrupt", [nul_in_relative_path, unknown_version, metadata_symlink_loop],
                         ids=lambda f: f.__name__)
def test_inspect_refuses_malformed_metadata_naming_it(dcp_root, reshard_bin, tmp_path, corrupt):
    ckpt = tmp_path / "bad"
    shutil.copytree(dcp_root / "mesh", ckpt)
    needle = corrupt(ckpt)
    for args in (["inspect", ckpt], ["inspect", "--json", ckpt],
                 ["convert", ckpt, "--tp", 2, "-o", tmp_path / "out"]):
        r = run(reshard_bin, *args)
        assert r.returncode == 2, (args, r.returncode, r.stdout, r.stderr)
        assert needle in r.stderr, (args, r.stderr)
    assert not (tmp_path / "out").exists()


def test_per_rank_metadata_that_disagree_on_the_version_are_refused(dcp_root, reshard_bin,
                                                                     tmp_path):
    ckpt = tmp_path / "perrank"
    shutil.copytree(dcp_root / "perrank", ckpt)
    with open(ckpt / "__2.metadata", "rb") as f:
        md = pickle.load(f)
    md.version = None if md.version else "1.0.0"  # a version torch writes, not the others'
    with open(ckpt / "__2.metadata", "wb") as f:
        pickle.dump(md, f)
    r = run(reshard_bin, "gather", ckpt, "-o", tmp_path / "hf")
    assert r.returncode == 2 and "__2.metadata" in r.stderr and "version" in r.stderr, r.stderr
    assert not (tmp_path / "hf").exists()
