"""safetensors files: ours against the official `safetensors` package, byte for byte.

Files the package writes read here bit-exactly; files we write load there bit-exactly with the
same metadata; and for the same tensors and metadata our bytes equal the package's. Corrupt
files the package refuses are refused here too.
"""

import json
import struct

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import load_file as np_load_file
from safetensors.numpy import save_file as np_save_file
from safetensors.torch import load_file, save, save_file

import reshard

# Every dtype of our table, as torch spells it.
TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
NUMPY_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
    "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16,
    "U8": np.uint8, "BOOL": np.bool_,
}


def random_tensor(rng, dtype_name, shape):
    """A tensor of random bits (any bit pattern, NaNs included; bools 0/1)."""
    dtype = TORCH_DTYPES[dtype_name]
    numel = int(np.prod(shape, dtype=np.int64))
    if dtype == torch.bool:
        raw = bytes(rng.getrandbits(1) for _ in range(numel))
    else:
        raw = rng.randbytes(numel * dtype.itemsize)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape) \
        if numel else torch.zeros(shape, dtype=dtype)


def raw_bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def random_tensors(rng, count=12):
    names = ["model.embed_tokens.weight", "lm_head.weight", "h.0.attn.c_attn.weight", "a", "B",
             "ü.weight", "x.y.z", "layers.10.mlp", "layers.9.mlp", "zeros", "scalar", "q\"uote"]
    out = {}
    for name in rng.sample(names, count):
        dtype = rng.choice(list(TORCH_DTYPES))
        if name == "zeros":
            shape = (rng.randrange(4), 0)
        elif name == "scalar":
            shape = ()
        else:
            shape = tuple(rng.randrange(1, 5) for _ in range(rng.randrange(1, 4)))
        out[name] = random_tensor(rng, dtype, shape)
    return out


def ours(tensors):
    dtype_of = {v: k for k, v in TORCH_DTYPES.items()}
    return {name: (dtype_of[t.dtype], list(t.shape), raw_bytes(t)) for name, t in tensors.items()}


def test_every_dtype_written_by_the_package_reads_bit_exactly(tmp_path, rng):
    tensors = {f"t.{name}": random_tensor(rng, name, (3, 5)) for name in TORCH_DTYPES}
    path = tmp_path / "theirs.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    got = reshard._core.read_safetensors(str(path))
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        dtype, shape, data = got[name]
        assert dtype == name[2:]
        assert tuple(shape) == (3, 5)
        assert data == raw_bytes(t), name
    assert reshard._core.safetensors_metadata(str(path)) == {"format": "pt"}


def test_numpy_files_read_bit_exactly(tmp_path, rng):
    arrays = {}
    for name, dtype in NUMPY_DTYPES.items():
        if dtype is np.bool_:
            bits = bytes(rng.getrandbits(1) for _ in range(6))
            arrays[name] = np.frombuffer(bits, np.uint8).astype(np.bool_).reshape(2, 3)
        else:
            raw = rng.randbytes(6 * np.dtype(dtype).itemsize)
            arrays[name] = np.frombuffer(raw, dtype).reshape(2, 3)
    path = tmp_path / "np.safetensors"
    np_save_file(arrays, str(path))
    got = reshard._core.read_safetensors(str(path))
    for name, a in arrays.items():
        assert got[name] == (name, (2, 3), a.tobytes())


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}, {"k": "tab\t\"q\" \\ ü €\x01"}])
def test_our_files_load_there_and_match_their_bytes(tmp_path, rng, metadata):
    tensors = random_tensors(rng)
    path = tmp_path / "ours.safetensors"
    reshard._core.write_safetensors(str(path), ours(tensors), metadata)
    loaded = load_file(str(path))
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype
        assert loaded[name].shape == t.shape
        assert raw_bytes(loaded[name]) == raw_bytes(t), name
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == metadata
    # With at most one metadata key the package's output is deterministic: equal bytes.
    assert path.read_bytes() == save(tensors, metadata=metadata)


def test_many_metadata_keys_match_up_to_their_hash_order(tmp_path, rng):
    # The package keeps metadata in a hash map, so its key order varies between runs; ours is
    # sorted. Everything else (length, tensor entries, padding, data) is identical.
    tensors = random_tensors(rng, 5)
    metadata = {f"key{i}": f"value{i}" for i in rng.sample(range(20), 8)}
    path = tmp_path / "ours.safetensors"
    reshard._core.write_safetensors(str(path), ours(tensors), metadata)
    mine, theirs = path.read_bytes(), save(tensors, metadata=metadata)
    assert len(mine) == len(theirs)
    n = struct.unpack("<Q", mine[:8])[0]
    assert mine[:8] == theirs[:8] and mine[8 + n:] == theirs[8 + n:]
    assert json.loads(mine[8:8 + n]) == json.loads(theirs[8:8 + n])
    mine_meta = json.loads(mine[8:8 + n])["__metadata__"]
    assert list(mine_meta) == sorted(metadata)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == metadata


def test_round_trip_through_both(tmp_path, rng):
    tensors = random_tensors(rng)
    theirs = tmp_path / "theirs.safetensors"
    save_file(tensors, str(theirs))
    mine = tmp_path / "mine.safetensors"
    reshard._core.write_safetensors(str(mine), reshard._core.read_safetensors(str(theirs)))
    assert mine.read_bytes() == theirs.read_bytes()


def test_empty_and_zero_element_files(tmp_path):
    path = tmp_path / "empty.safetensors"
    reshard._core.write_safetensors(str(path), {})
    assert path.read_bytes() == save({})
    assert load_file(str(path)) == {}
    assert reshard._core.read_safetensors(str(path)) == {}

    tensors = {"a": torch.zeros((0, 3), dtype=torch.bfloat16), "b": torch.zeros(0, dtype=torch.int8),
               "s": torch.tensor(1.5, dtype=torch.float64)}
    path = tmp_path / "zero.safetensors"
    reshard._core.write_safetensors(str(path), ours(tensors))
    assert path.read_bytes() == save(tensors)
    got = reshard._core.read_safetensors(str(path))
    assert got["a"] == ("BF16", (0, 3), b"")
    assert got["s"] == ("F64", (), struct.pack("<d", 1.5))


def test_overwrite_is_refused_unless_asked(tmp_path):
    path = tmp_path / "x.safetensors"
    reshard._core.write_safetensors(str(path), {"a": ("U8", [1], b"\x01")})
    with pytest.raises(ValueError, match="already exists"):
        reshard._core.write_safetensors(str(path), {"a": ("U8", [1], b"\x02")})
    reshard._core.write_safetensors(str(path), {"a": ("U8", [1], b"\x02")}, overwrite=True)
    assert load_file(str(path))["a"].tolist() == [2]
    with pytest.raises(ValueError, match="needs 4"):
        reshard._core.write_safetensors(str(tmp_path / "y.safetensors"), {"a": ("F32", [1], b"\x01")})


def _raw(header, data=b""):
    h = header.encode() if isinstance(header, str) else header
    return struct.pack("<Q", len(h)) + h + data


CORRUPT = {
    "short": (b"abcde", "too short to hold the 8-byte header length"),
    "header_past_end": (struct.pack("<Q", 1000) + b" " * 60, "runs past the end of the file"),
    "header_over_limit": (struct.pack("<Q", 1_000_000_000) + b"{}", "exceeds the 100 MB limit"),
    "invalid_utf8": (_raw(b'{"a\xff":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"x"),
                     "not valid UTF-8"),
    "invalid_json": (_raw('{"a":{"dtype":"U8",}}'), "not valid JSON"),
    "unknown_dtype": (_raw('{"a":{"dtype":"F17","shape":[1],"data_offsets":[0,1]}}', b"x"),
                      'unknown dtype "F17"'),
    "size_mismatch": (_raw('{"a":{"dtype":"BF16","shape":[4,4],"data_offsets":[0,30]}}',
                           b"x" * 30), "is 32 bytes but data_offsets"),
    "overlap": (_raw('{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},'
                     '"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}', b"xyz"), "overlap"),
    "gap": (_raw('{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},'
                 '"b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]}}', b"xyzzy"), "gap"),
    "not_at_zero": (_raw('{"a":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}', b"xyz"),
                    "do not start at 0"),
    "truncated": (_raw('{"a":{"dtype":"F32","shape":[16],"data_offsets":[0,64]}}', b"x" * 40),
                  "file is truncated"),
    "trailing": (_raw('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', b"x" * 18),
                 "10 trailing bytes"),
    "metadata_not_strings": (_raw('{"__metadata__":{"k":1}}'), "not a string"),
    "negative_shape": (_raw('{"a":{"dtype":"U8","shape":[-2],"data_offsets":[0,0]}}'),
                       "not a non-negative integer"),
    "nul_then_object": (_raw('{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}'
                             '\0{"evil":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}', b"xy"),
                        "bytes after its JSON object"),
    "nul_then_spaces": (_raw('{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}\0      ',
                             b"xy"), "bytes after its JSON object"),
    "nul_inside_object": (_raw('{"a\0":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"x"),
                          "a NUL byte at offset 11"),
}


@pytest.mark.parametrize("kind", sorted(CORRUPT))
def test_corrupt_files_are_refused_here_and_there(tmp_path, kind):
    data, message = CORRUPT[kind]
    path = tmp_path / f"{kind}.safetensors"
    path.write_bytes(data)
    with pytest.raises(ValueError) as err:
        reshard._core.read_safetensors(str(path))
    assert err.value.code == "DATA_LOSS" and message in str(err.value)
    with pytest.raises(Exception):
        load_file(str(path))


def test_duplicate_names_are_refused_though_the_package_keeps_one(tmp_path):
    # The package's JSON map keeps the last duplicate; which tensor a name means is then
    # ambiguous, so we refuse the file.
    path = tmp_path / "dup.safetensors"
    path.write_bytes(_raw('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                          '"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', b"xy"))
    with pytest.raises(ValueError, match='duplicate tensor name "a"'):
        reshard._core.read_safetensors(str(path))


def test_whitespace_after_the_header_object_is_accepted_as_there(tmp_path):
    # The format pads with spaces; the package's JSON reader also takes tabs and newlines.
    for pad in (" " * 7, "\t", "\n \r"):
        path = tmp_path / "padded.safetensors"
        path.write_bytes(_raw('{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}' + pad,
                              b"\x01\x02"))
        assert load_file(str(path))["a"].tolist() == [1, 2]
        assert reshard._core.read_safetensors(str(path))["a"] == ("U8", (2,), b"\x01\x02")


def test_what_the_package_accepts_loosely_we_accept_too(tmp_path):
    # Unknown keys in an entry, null metadata, entries out of data order, unpadded header.
    header = ('{"b":{"data_offsets":[2,6],"extra":[1],"shape":[1],"dtype":"I32"},'
              '"__metadata__":null,"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}')
    path = tmp_path / "loose.safetensors"
    path.write_bytes(_raw(header, b"\x01\x02\x03\x00\x00\x00"))
    theirs = load_file(str(path))
    got = reshard._core.read_safetensors(str(path))
    assert list(got) == ["a", "b"]
    assert got["a"] == ("U8", (2,), raw_bytes(theirs["a"]))
    assert got["b"] == ("I32", (1,), raw_bytes(theirs["b"]))
    assert np_load_file(str(path))["b"].tolist() == [3]
