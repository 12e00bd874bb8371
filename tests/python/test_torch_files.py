"""`.pt` files (torch.save) read without running their pickle: `reshard inspect` and
`reshard export` cross-checked against torch itself, hostile pickles and corrupt files."""

import argparse
import collections
import io
import json
import struct
import subprocess
import zipfile

import pytest
import torch
from safetensors.torch import load_file

# Every dtype torch.save writes that reshard names (safetensors spelling).
DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64", torch.complex128: "C128",
}


def run(reshard_bin, *args):
    # The timeout turns a command that never ends (an exponential walk) into a failure.
    return subprocess.run([reshard_bin, *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def inspect_json(reshard_bin, path):
    r = run(reshard_bin, "inspect", "--json", path)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def random_tensor(rng, dtype, shape):
    """Random bits of `dtype` (every bit pattern, NaNs included, for floats)."""
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, size), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def bits(t):
    """The bytes of a tensor's elements in row-major order."""
    t = t.contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def check_against_torch(info, expected):
    """`info` is inspect's JSON; `expected` maps dotted names to the tensors torch saved."""
    got = {t["name"]: t for t in info["tensors"]}
    assert list(got) == list(expected)
    for name, t in expected.items():
        g = got[name]
        assert g["dtype"] == DTYPES[t.dtype], name
        assert g["shape"] == list(t.shape), name
        assert g["strides"] == list(t.stride()), name
        assert g["storage_offset"] == t.storage_offset(), name
        assert g["bytes"] == t.numel() * t.element_size(), name
        assert g["contiguous"] == t.is_contiguous(), name


def test_every_dtype_reads_and_exports_bit_exactly(tmp_path, rng, reshard_bin):
    tensors = {f"t.{DTYPES[d]}": random_tensor(rng, d, (3, 5)) for d in DTYPES}
    path = tmp_path / "all.pt"
    torch.save(tensors, path)
    check_against_torch(inspect_json(reshard_bin, path), tensors)

    real = {k: v for k, v in tensors.items() if not v.dtype.is_complex}
    torch.save(real, path)
    out = tmp_path / "all.safetensors"
    r = run(reshard_bin, "export", path, "-o", out)
    assert r.returncode == 0, r.stderr
    back = load_file(out)
    assert set(back) == set(real)
    for name, t in real.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape
        assert bits(back[name]) == bits(t), name


def test_complex_tensors_are_listed_but_not_exported(tmp_path, reshard_bin):
    path = tmp_path / "c.pt"
    torch.save({"z": torch.ones(2, dtype=torch.complex64)}, path)
    assert inspect_json(reshard_bin, path)["tensors"][0]["dtype"] == "C64"
    r = run(reshard_bin, "export", path, "-o", tmp_path / "c.safetensors")
    assert r.returncode == 2
    assert 'tensor "z" is C64' in r.stderr
    assert not (tmp_path / "c.safetensors").exists()


def test_views_offsets_strides_transposes_scalars_and_empties(tmp_path, rng, reshard_bin):
    base = random_tensor(rng, torch.float32, (6, 8))
    tensors = {
        "base": base,
        "row": base[2],                  # offset 16
        "col": base[:, 3],               # stride 8
        "t": base.t(),                   # transpose
        "block": base[1:5:2, 2:7:3],     # offset and steps in both dimensions
        "expanded": torch.arange(3.0).expand(4, 3),  # stride 0
        "scalar": torch.tensor(2.5, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 4),
        "narrow_empty": base[3:3],
        "alone": random_tensor(rng, torch.int16, (2, 3, 4)).permute(2, 0, 1),
    }
    path = tmp_path / "views.pt"
    torch.save(tensors, path)
    info = inspect_json(reshard_bin, path)
    check_against_torch(info, tensors)
    by_name = {t["name"]: t for t in info["tensors"]}
    shared = {by_name[n]["storage"] for n in ("base", "row", "col", "t", "block", "narrow_empty")}
    assert len(shared) == 1  # views of one storage stay views of one storage

    out = tmp_path / "views.safetensors"
    assert run(reshard_bin, "export", path, "-o", out).returncode == 0
    back = load_file(out)
    for name, t in tensors.items():
        assert back[name].shape == t.shape, name
        assert bits(back[name]) == bits(t), name


def test_nested_containers_give_dotted_names(tmp_path, rng, reshard_bin):
    t = lambda *s: random_tensor(rng, torch.float16, s)  # noqa: E731
    tree = collections.OrderedDict(
        module=collections.OrderedDict([("layers.0.weight", t(2, 2)), ("bias", t(2))]),
        optimizer={"state": {0: {"exp_avg": t(3), "step": 5}, 1: {"exp_avg": t(1)}},
                   "param_groups": [{"lr": 0.1, "params": [0, 1]}]},
        lists=[t(1), (t(2), [t(3)])],
        unicode={"ключ": t(2), "名前": {"é": t(1)}},
        flags={True: t(1), None: t(1)},
    )
    expected = {
        "module.layers.0.weight": tree["module"]["layers.0.weight"],
        "module.bias": tree["module"]["bias"],
        "optimizer.state.0.exp_avg": tree["optimizer"]["state"][0]["exp_avg"],
        "optimizer.state.1.exp_avg": tree["optimizer"]["state"][1]["exp_avg"],
        "lists.0": tree["lists"][0],
        "lists.1.0": tree["lists"][1][0],
        "lists.1.1.0": tree["lists"][1][1][0],
        "unicode.ключ": tree["unicode"]["ключ"],
        "unicode.名前.é": tree["unicode"]["名前"]["é"],
        "flags.True": tree["flags"][True],
        "flags.None": tree["flags"][None],
    }
    path = tmp_path / "nested.pt"
    torch.save(tree, path)
    info = inspect_json(reshard_bin, path)
    check_against_torch(info, expected)
    assert info["tree"]["optimizer"]["param_groups"] == [{"lr": 0.1, "params": [0, 1]}]
    assert info["tree"]["optimizer"]["state"]["dict"][0][1]["step"] == 5


def test_parameters_shared_tensors_and_module_state_dicts(tmp_path, reshard_bin):
    lin = torch.nn.Linear(3, 2)
    p = torch.nn.Parameter(torch.ones(2))
    obj = {"model": lin.state_dict(), "p": p, "same": p, "also": lin.weight.data}
    path = tmp_path / "m.pt"
    torch.save(obj, path)
    info = inspect_json(reshard_bin, path)
    by_name = {t["name"]: t for t in info["tensors"]}
    assert set(by_name) == {"model.weight", "model.bias", "p", "same", "also"}
    assert by_name["p"]["parameter"] and by_name["p"]["requires_grad"]
    assert by_name["same"]["storage"] == by_name["p"]["storage"]
    assert by_name["also"]["storage"] == by_name["model.weight"]["storage"]
    out = tmp_path / "m.safetensors"
    assert run(reshard_bin, "export", path, "-o", out).returncode == 0
    back = load_file(out)
    assert torch.equal(back["model.weight"], lin.weight.data)
    assert torch.equal(back["same"], p.data)


def test_tensors_with_attributes_read_and_write_back(tmp_path, reshard_bin):
    # DeepSpeed's ZeRO-3 flat groups carry a ds_id: torch saves such a tensor through
    # torch._tensor._rebuild_from_type_v2 with the attributes as its state.
    flat = torch.arange(6, dtype=torch.float32)[1:]
    flat.ds_id = 7
    param = torch.nn.Parameter(torch.ones(2, 2))
    param.ds_numel = 4
    obj = {"fp32_flat_groups": [flat], "p": param}
    path = tmp_path / "zero3.pt"
    torch.save(obj, path)
    assert b"_rebuild_from_type_v2" in zipfile.ZipFile(path).read("zero3/data.pkl")
    info = inspect_json(reshard_bin, path)
    check_against_torch(info, {"fp32_flat_groups.0": flat, "p": param.data})
    out = tmp_path / "zero3.safetensors"
    assert run(reshard_bin, "export", path, "-o", out).returncode == 0
    assert torch.equal(load_file(out)["fp32_flat_groups.0"], flat)
    again = tmp_path / "again.pt"
    assert run(reshard_bin, "export", path, "-o", again).returncode == 0
    back = torch.load(again, weights_only=False)
    assert type(back["fp32_flat_groups"][0]) is torch.Tensor
    assert back["fp32_flat_groups"][0].ds_id == 7
    assert torch.equal(back["fp32_flat_groups"][0], flat)
    assert isinstance(back["p"], torch.nn.Parameter) and back["p"].ds_numel == 4


def test_training_records_are_kept_inert(tmp_path, reshard_bin):
    ns = argparse.Namespace(lr=0.5, name="run")
    obj = {"args": ns, "w": torch.ones(1), "device": torch.device("cpu"),
           "dtype": torch.bfloat16, "size": torch.Size([2, 3]), "raw": b"\x00\xff",
           "set": {1, 2}, "big": 2**70, "nan": float("nan")}
    path = tmp_path / "rec.pt"
    torch.save(obj, path)
    info = inspect_json(reshard_bin, path)
    tree = info["tree"]
    assert tree["args"]["record"] == "argparse.Namespace"
    assert tree["args"]["state"] == {"lr": 0.5, "name": "run"}
    assert tree["device"] == {"record": "torch.device", "args": ["cpu"]}
    assert tree["dtype"] == {"global": "torch.bfloat16"}
    assert tree["size"] == {"tuple": [2, 3]}
    assert tree["raw"] == {"bytes": "00ff"}
    assert tree["set"] == {"set": [1, 2]}
    assert tree["big"] == {"int_bytes_le": (2**70).to_bytes(9, "little").hex()}
    assert tree["nan"] == {"float": "nan"}
    text = run(reshard_bin, "inspect", path)
    assert text.returncode == 0 and "args.lr = 0.5" in text.stdout


def test_deepspeed_records_are_kept_inert(tmp_path, reshard_bin):
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    scaler = loss_scaler.DynamicLossScaler(init_scale=2**16, scale_window=1000, min_scale=1,
                                           delayed_shift=2, consecutive_hysteresis=False)
    obj = {"loss_scaler": scaler, "static": loss_scaler.LossScaler(scale=128),
           "zero_stage": ZeroStageEnum.gradients,
           "param_slice_mappings": [{"w": fragment_address(numel=4, start=8)}]}
    path = tmp_path / "ds.pt"
    torch.save(obj, path)
    tree = inspect_json(reshard_bin, path)["tree"]
    assert tree["loss_scaler"]["record"] == "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"
    assert tree["loss_scaler"]["state"]["cur_scale"] == 2**16
    assert tree["static"]["state"]["cur_scale"] == 128
    assert tree["zero_stage"] == {"record": "deepspeed.runtime.zero.config.ZeroStageEnum",
                                  "args": [2]}
    frag = tree["param_slice_mappings"][0]["w"]
    assert frag["record"] == "deepspeed.utils.tensor_fragment.fragment_address"


# --- hand-made archives -------------------------------------------------------------------

def make_pt(pickle_bytes, storages=None, byteorder=b"little", compress=False):
    buf = io.BytesIO()
    method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(buf, "w", method) as z:
        z.writestr("archive/data.pkl", pickle_bytes)
        if byteorder is not None:
            z.writestr("archive/byteorder", byteorder)
        for key, data in (storages or {}).items():
            z.writestr(f"archive/data/{key}", data)
        z.writestr("archive/version", b"3\n")
    return buf.getvalue()


def tensor_pickle(numel=6, size=(2, 3), stride=(3, 1), offset=0):
    """The pickle torch.save writes for one F32 tensor over storage "0"."""
    def tup(xs):
        return b"(" + b"".join(b"J" + struct.pack("<i", x) for x in xs) + b"t"
    return (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage"
            b"ctorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK" + bytes([numel]) +
            b"tQK" + bytes([offset]) + tup(size) + tup(stride) +
            b"\x89ccollections\nOrderedDict\n)RtR.")


def test_hand_made_archive_reads(tmp_path, reshard_bin):
    data = struct.pack("<6f", *range(6))
    path = tmp_path / "ok.pt"
    path.write_bytes(make_pt(tensor_pickle(), {"0": data}))
    info = inspect_json(reshard_bin, path)
    assert info["tensors"][0]["name"] == "" and info["tensors"][0]["shape"] == [2, 3]
    assert torch.load(path, weights_only=True).tolist() == [[0, 1, 2], [3, 4, 5]]


HOSTILE = {
    "os.system": b"\x80\x02cos\nsystem\nX\x05\x00\x00\x00touchq\x00\x85R.",
    "builtins.exec": b"\x80\x02cbuiltins\nexec\nX\x01\x00\x00\x001\x85R.",
    "subprocess.Popen": b"\x80\x02csubprocess\nPopen\nX\x02\x00\x00\x00ls\x85R.",
    "posix.system": (b"\x80\x04\x8c\x05posix\x8c\x06system\x93X\x05\x00\x00\x00touch\x85R."),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_pickles_are_refused_and_nothing_runs(tmp_path, reshard_bin, name):
    sentinel = tmp_path / "ran"
    pickle_bytes = HOSTILE[name].replace(b"touch", str(sentinel).encode()[:5])
    path = tmp_path / "evil.pt"
    path.write_bytes(make_pt(pickle_bytes))
    for args in (["inspect", path], ["inspect", "--json", path],
                 ["export", path, "-o", tmp_path / "out.safetensors"]):
        r = run(reshard_bin, *args)
        assert r.returncode == 2, r.stderr
        assert f"global {name} is not allowed" in r.stderr
        assert "pickle byte " in r.stderr
    assert not sentinel.exists()
    assert not (tmp_path / "out.safetensors").exists()


def corrupt_cases(tmp_path):
    data = struct.pack("<6f", *range(6))
    good = make_pt(tensor_pickle(), {"0": data})
    eocd = good.rfind(b"PK\x05\x06")
    cd = struct.unpack_from("<I", good, eocd + 16)[0]
    legacy = io.BytesIO()
    torch.save({"x": 1}, legacy, _use_new_zipfile_serialization=False)
    dag = torch.zeros(1)
    for _ in range(60):
        dag = (dag, dag)  # one tensor under 2^60 paths
    dag_file = io.BytesIO()
    torch.save(dag, dag_file)
    huge_view = io.BytesIO()
    torch.save(torch.zeros(1, dtype=torch.complex128).expand(2**61), huge_view)
    bad_cd = bytearray(good)
    bad_cd[cd:cd + 4] = b"XXXX"
    out_of_range = bytearray(good)
    struct.pack_into("<I", out_of_range, cd + 42, len(good) * 2)
    return {
        "truncated zip": (good[: len(good) // 2], "no end-of-central-directory record"),
        "bad central directory": (bytes(bad_cd), "no central directory signature"),
        "entry out of range": (bytes(out_of_range), "no local header at byte"),
        "compressed entry": (make_pt(tensor_pickle(), {"0": data}, compress=True),
                             "is compressed (method 8)"),
        "storage shorter than declared": (make_pt(tensor_pickle(), {"0": data[:20]}),
                                          'declares 6 elements of F32 but "archive/data/0" holds 20'),
        "view past its storage": (make_pt(tensor_pickle(offset=1), {"0": data}),
                                  "reaches past storage"),
        "missing storage": (make_pt(tensor_pickle()), 'has no entry "archive/data/0"'),
        "unknown opcode": (make_pt(b"\x80\x02\xff."), "opcode 0xFF is not read"),
        "memo out of range": (make_pt(b"\x80\x02h\x07."), "memo entry 7 was never set"),
        "cyclic structure": (make_pt(b"\x80\x02]q\x00h\x00a."), "cyclic structure"),
        "huge string": (make_pt(b"\x80\x02\x8d" + struct.pack("<Q", 2**62) + b"."),
                        "operand of 4611686018427387904 bytes runs past the end"),
        "huge shape": (make_pt(tensor_pickle(size=(2**31 - 1,) * 3, stride=(1, 1, 1)),
                               {"0": data}), "has more than 2^62 elements"),
        "big-endian storages": (make_pt(tensor_pickle(), {"0": data}, byteorder=b"big"),
                                "storages are big-endian"),
        "not a torch file": (zipfile_only(), "without a <root>/data.pkl entry"),
        "legacy format": (legacy.getvalue(), "legacy torch.save file"),
        "tensor under 2^60 paths": (dag_file.getvalue(), "more than 4194304 objects"),
        "nested 10^5 deep": (make_pt(b"\x80\x02K\x01" + b"\x85" * 10**5 + b"."),
                             "objects nested deeper than 1000"),
        "10^5 MARKs": (make_pt(b"\x80\x02" + b"(" * 10**5 + b"N."), "more than 1000 nested MARKs"),
        "view of 2^65 bytes": (huge_view.getvalue(), "more than 2^62 bytes"),
    }


def zipfile_only():
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("readme.txt", b"hi")
    return buf.getvalue()


def test_corrupt_files_each_have_their_own_message(tmp_path, reshard_bin):
    cases = corrupt_cases(tmp_path)
    messages = set()
    for kind, (content, message) in cases.items():
        path = tmp_path / "bad.pt"
        path.write_bytes(content)
        r = run(reshard_bin, "inspect", path)
        assert r.returncode == 2, (kind, r.stderr)
        assert message in r.stderr, (kind, r.stderr)
        assert "Traceback" not in r.stderr and "Segmentation" not in r.stderr
        messages.add(r.stderr)
        for args in (["inspect", "--json", path], ["export", path, "-o", tmp_path / "o.pt"],
                     ["export", path, "-o", tmp_path / "o.safetensors"]):
            r = run(reshard_bin, *args)
            assert r.returncode == 2 and message in r.stderr, (kind, args, r.stderr)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.pt"], kind
    assert len(messages) == len(cases)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_export_never_replaces_unless_forced(tmp_path, reshard_bin, suffix):
    path = tmp_path / "a.pt"
    torch.save({"w": torch.ones(2)}, path)
    out = tmp_path / ("out" + suffix)
    out.write_bytes(b"keep")
    r = run(reshard_bin, "export", path, "-o", out)
    assert r.returncode == 2 and "--force" in r.stderr
    assert out.read_bytes() == b"keep"
    assert run(reshard_bin, "export", path, "-o", out, "--force").returncode == 0
    if suffix == ".pt":  # the .pt written back whole
        assert torch.equal(torch.load(out, weights_only=True)["w"], torch.ones(2))
        return
    assert torch.equal(load_file(out)["w"], torch.ones(2))
    assert json.loads(out.read_bytes()[8:8 + struct.unpack("<Q", out.read_bytes()[:8])[0]])[
        "__metadata__"] == {"format": "pt"}


def test_inspect_reads_safetensors_files(tmp_path, reshard_bin):
    from safetensors.torch import save_file
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(2, 3, dtype=torch.bfloat16)}, path, metadata={"k": "v"})
    info = inspect_json(reshard_bin, path)
    assert info["format"] == "safetensors"
    assert info["tensors"] == [{"name": "a", "dtype": "BF16", "shape": [2, 3],
                                "data_offsets": [0, 12], "bytes": 12}]
    assert info["metadata"] == {"k": "v"}


# --- writing .pt files ----------------------------------------------------------------------

def test_safetensors_exported_to_pt_load_in_torch_weights_only(tmp_path, rng, reshard_bin):
    from safetensors.torch import save_file
    shapes = [(3, 5), (), (0, 4), (300,), (2, 3, 4, 5), (70000,)]
    tensors = {}
    for i, d in enumerate(d for d in DTYPES if not d.is_complex):
        tensors[f"model.layers.{i}.{DTYPES[d]}"] = random_tensor(rng, d, shapes[i % len(shapes)])
    tensors["ünïcode.名前"] = random_tensor(rng, torch.float32, (2, 2))
    st = tmp_path / "in.safetensors"
    save_file(tensors, st, metadata={"format": "pt"})
    pt = tmp_path / "out.pt"
    r = run(reshard_bin, "export", st, "-o", pt)
    assert r.returncode == 0, r.stderr

    for mmap in (False, True):
        loaded = torch.load(pt, weights_only=True, mmap=mmap)
        assert isinstance(loaded, collections.OrderedDict)
        assert set(loaded) == set(tensors)
        for name, t in tensors.items():
            assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape, name
            assert bits(loaded[name]) == bits(t), name
    with zipfile.ZipFile(pt) as z:
        assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
        assert z.testzip() is None  # every CRC-32 agrees

    # Back to safetensors: the very file we started from.
    back = tmp_path / "back.safetensors"
    assert run(reshard_bin, "export", pt, "-o", back).returncode == 0
    assert back.read_bytes() == st.read_bytes()


def test_pt_storages_are_64_byte_aligned_like_torch(tmp_path, reshard_bin):
    from safetensors.torch import save_file
    st = tmp_path / "in.safetensors"
    save_file({"a": torch.ones(3), "bb": torch.ones(5, dtype=torch.int8)}, st)
    pt = tmp_path / "out.pt"
    assert run(reshard_bin, "export", st, "-o", pt).returncode == 0
    raw = pt.read_bytes()
    with zipfile.ZipFile(pt) as z:
        for info in z.infolist():
            name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
            assert (info.header_offset + 30 + name_len + extra_len) % 64 == 0, info.filename
    assert run(reshard_bin, "export", st, "-o", pt).returncode == 2  # exists, no --force


# --- real DeepSpeed checkpoints (DESIGN 12: made on the CPU in the test) --------------------

DEEPSPEED_SAVE = """
import os, sys
os.environ.update(DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
import torch, deepspeed
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
config = {"train_batch_size": 2, "zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}
engine, _, _, _ = deepspeed.initialize(
    model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3), config=config)
loss = engine(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum()
engine.backward(loss)
engine.step()
engine.save_checkpoint(sys.argv[1], tag="step1")
"""


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def deepspeed_checkpoint(tmp_path_factory):
    pytest.importorskip("deepspeed")
    import sys
    port = free_port()
    out = tmp_path_factory.mktemp("ds") / "ckpt"
    r = subprocess.run([sys.executable, "-c", DEEPSPEED_SAVE, str(out), str(port)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return out / "step1"


def flatten(obj, prefix=""):
    """(dotted name, tensor) in reshard's naming: dict keys and list/tuple indices."""
    join = (lambda k: f"{prefix}.{k}") if prefix else str
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from flatten(v, join(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from flatten(v, join(i))


def test_real_deepspeed_files_read_bit_exactly_with_their_records(
        deepspeed_checkpoint, tmp_path, reshard_bin):
    files = sorted(deepspeed_checkpoint.glob("*.pt"))
    assert {f.name for f in files} == {"mp_rank_00_model_states.pt",
                                       "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"}
    for f in files:
        # The reference reads with weights_only=False: it runs the pickle, which is exactly
        # what reshard avoids (weights_only=True refuses DeepSpeed's own classes).
        ref = dict(flatten(torch.load(f, weights_only=False)))
        info = inspect_json(reshard_bin, f)
        assert [t["name"] for t in info["tensors"]] == list(ref)
        out = tmp_path / (f.stem + ".safetensors")
        r = run(reshard_bin, "export", f, "-o", out)
        assert r.returncode == 0, r.stderr
        back = load_file(out)
        for name, t in ref.items():
            assert back[name].dtype == t.dtype and bits(back[name]) == bits(t), name

    optim = inspect_json(reshard_bin, deepspeed_checkpoint /
                         "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")["tree"]
    state = optim["optimizer_state_dict"]
    assert state["loss_scaler"]["record"] == "deepspeed.runtime.fp16.loss_scaler.LossScaler"
    assert state["zero_stage"] == {"record": "deepspeed.runtime.zero.config.ZeroStageEnum",
                                   "args": [1]}
    frag = state["param_slice_mappings"][0]["0.weight"]
    assert frag["record"] == "deepspeed.utils.tensor_fragment.fragment_address"
    assert frag["state"] == {"numel": 128, "start": 0}
    with pytest.raises(Exception):
        torch.load(deepspeed_checkpoint / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                   weights_only=True)


# The pickle cost test inside a DeepSpeed checkpoint: a DAG of shared tuples 60 deep added to
# the model-states file leaves gather, --to universal and inspect as they were (they never
# ended); the same DAG over a tensor (2^60 names) is refused at once with nothing written.
@pytest.mark.parametrize("leaf", ["plain", "tensor"])
def test_shared_objects_in_deepspeed_files(deepspeed_checkpoint, tmp_path, reshard_bin, leaf):
    import shutil
    save = tmp_path / "ckpt"
    shutil.copytree(deepspeed_checkpoint.parent, save)
    states = save / "step1" / "mp_rank_00_model_states.pt"
    obj = torch.load(states, weights_only=False)
    node = torch.zeros(1) if leaf == "tensor" else [1, "x"]
    for _ in range(60):
        node = (node, node)
    obj["shared"] = node
    torch.save(obj, states)
    for args in (["gather", save, "-o", tmp_path / "hf"],
                 ["convert", save, "--to", "universal", "-o", tmp_path / "uc"],
                 ["inspect", save]):
        r = run(reshard_bin, *args)
        if leaf == "plain":
            assert r.returncode == 0, (args, r.stderr)
        else:
            assert r.returncode == 2 and "more than 4194304 objects" in r.stderr, (args, r.stderr)
    if leaf == "tensor":
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_shared_objects_in_deepspeed_metadata_are_bounded(deepspeed_checkpoint, tmp_path,
                                                           reshard_bin):
    """The same DAG inside the metadata reshard reads as JSON (universal_checkpoint_info) is
    refused at once: copying it out would never end."""
    import shutil
    save = tmp_path / "ckpt"
    shutil.copytree(deepspeed_checkpoint.parent, save)
    states = save / "step1" / "mp_rank_00_model_states.pt"
    obj = torch.load(states, weights_only=False)
    node = [1, "x"]
    for _ in range(60):
        node = (node, node)
    obj["universal_checkpoint_info"] = {"shared": node}
    torch.save(obj, states)
    r = subprocess.run([reshard_bin, "gather", save, "-o", tmp_path / "hf"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "expand to more than" in r.stderr, r.stderr
    assert not (tmp_path / "hf").exists()


def test_directories_list_every_tensor_file(deepspeed_checkpoint, tmp_path, reshard_bin):
    from safetensors.torch import save_file
    save_dir = deepspeed_checkpoint.parent
    info = inspect_json(reshard_bin, save_dir)  # through `latest`
    assert info["format"] == "directory" and info["deepspeed_tag"] == "step1"
    assert [f["file"] for f in info["files"]] == sorted(
        ["mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"])
    model = next(f for f in info["files"] if f["file"] == "mp_rank_00_model_states.pt")
    assert model["contents"]["format"] == "torch"
    assert {t["name"] for t in model["contents"]["tensors"]} >= {"module.0.weight"}

    plain = tmp_path / "plain"
    plain.mkdir()
    save_file({"a": torch.ones(2)}, plain / "model.safetensors")
    torch.save({"b": torch.zeros(3)}, plain / "extra.pt")
    (plain / "config.json").write_text("{}")
    info = inspect_json(reshard_bin, plain)
    assert [(f["file"], f["contents"]["format"]) for f in info["files"]] == [
        ("extra.pt", "torch"), ("model.safetensors", "safetensors")]
    assert info["other_files"] == ["config.json"]
    text = run(reshard_bin, "inspect", plain)
    assert text.returncode == 0 and "2 tensor files" in text.stdout and "b  F32 [3]" in text.stdout

    (save_dir / "latest").write_text("missing")
    r = run(reshard_bin, "inspect", save_dir)
    assert r.returncode == 2 and 'names "missing", which is not a directory' in r.stderr
    (save_dir / "latest").write_text("step1")


def resolve_refs(value, tree):
    """`value` of inspect --json's tree with every {"ref": pointer} replaced by what it names."""
    if isinstance(value, dict) and set(value) == {"ref"}:
        target = tree
        for token in value["ref"].split("/")[1:]:
            token = token.replace("~1", "/").replace("~0", "~")
            target = target[int(token)] if isinstance(target, list) else target[token]
        return resolve_refs(target, tree)
    if isinstance(value, dict):
        return {k: resolve_refs(v, tree) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_refs(v, tree) for v in value]
    return value


def as_tree_json(obj):
    """What inspect --json writes for plain data, every object in full."""
    if isinstance(obj, tuple):
        return {"tuple": [as_tree_json(x) for x in obj]}
    if isinstance(obj, list):
        return [as_tree_json(x) for x in obj]
    if isinstance(obj, dict):
        return {k: as_tree_json(v) for k, v in obj.items()}
    return obj


def shared_dag(depth):
    leaf = [1, "x" * 100]
    for _ in range(depth):
        leaf = (leaf, leaf)
    return leaf


# The pickle cost test: nested tuples that share their halves through the memo (torch.save
# writes l = (l, l) as two memo recalls) are objects, not copies. Every command costs what
# the file holds: the work is counted in what is printed, one line or one reference per
# level, where expanding every path would double it with each level.
@pytest.mark.parametrize("depth", [4, 16, 60])
def test_shared_objects_cost_what_the_file_holds(tmp_path, reshard_bin, depth):
    path = tmp_path / "dag.pt"
    w = torch.arange(4.0)
    torch.save({"w": w, "dag": shared_dag(depth), "again": w}, path)
    size = path.stat().st_size
    text = run(reshard_bin, "inspect", path)
    assert text.returncode == 0, text.stderr
    assert text.stdout.count("(same object as ") == depth, text.stdout[:2000]
    assert text.stdout.count("\n") <= depth + 8 and len(text.stdout) < 20 * size
    assert "  dag.1 = (same object as dag.0)\n" in text.stdout
    r = run(reshard_bin, "inspect", "--json", path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count('"ref"') == depth and len(r.stdout) < 100 * size, r.stdout[:2000]
    info = json.loads(r.stdout)
    assert [t["name"] for t in info["tensors"]] == ["w", "again"]
    assert info["tree"]["dag"]["tuple"][1] == {"ref": "/dag/tuple/0"}
    if depth <= 16:  # refs resolved give what torch.load gives, in full
        loaded = torch.load(path, weights_only=True)
        assert resolve_refs(info["tree"]["dag"], info["tree"]) == as_tree_json(loaded["dag"])
    out = tmp_path / "out.safetensors"
    r = run(reshard_bin, "export", path, "-o", out)
    assert r.returncode == 0, r.stderr
    assert sorted(load_file(out)) == ["again", "w"]
    back = tmp_path / "back.pt"
    r = run(reshard_bin, "export", path, "-o", back)
    assert r.returncode == 0, r.stderr
    assert back.stat().st_size < 2 * size
    loaded = torch.load(back, weights_only=True)
    node = loaded["dag"]
    for _ in range(depth):
        assert node[0] is node[1]
        node = node[0]
    assert node == [1, "x" * 100]


# torch.save of an expanded tensor keeps its small storage and stride 0. Exported to a .pt it
# stays so; to safetensors (dense tensors only) it is written dense while that adds at most
# the storages' size or 1 GiB, and refused before anything is allocated past that.
def test_expanded_tensors_export_dense_or_are_refused(tmp_path, reshard_bin):
    small = tmp_path / "small.pt"
    tensors = {"b": torch.arange(3.0).expand(4, 3), "one": torch.tensor([2.0]).expand(5)}
    torch.save(tensors, small)
    out = tmp_path / "small.safetensors"
    assert run(reshard_bin, "export", small, "-o", out).returncode == 0
    for name, t in load_file(out).items():
        assert torch.equal(t, tensors[name].contiguous()), name

    big = tmp_path / "big.pt"
    torch.save({"e": torch.tensor([1.0]).expand(2**40)}, big)
    info = inspect_json(reshard_bin, big)
    assert info["tensors"][0]["bytes"] == 2**42 and info["tensors"][0]["strides"] == [0]
    r = run(reshard_bin, "export", big, "-o", tmp_path / "big.safetensors")
    assert r.returncode == 2, r.stderr
    assert 'tensor "e"' in r.stderr and "written dense" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.pt", "small.pt",
                                                          "small.safetensors"]
    back = tmp_path / "big_back.pt"
    r = run(reshard_bin, "export", big, "-o", back)
    assert r.returncode == 0, r.stderr
    e = torch.load(back, weights_only=True)["e"]
    assert e.shape == (2**40,) and e.stride() == (0,) and e[12345].item() == 1.0
