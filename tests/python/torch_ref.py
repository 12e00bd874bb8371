"""The reference semantics of extract and rebuild, written with torch.as_strided."""

import json

import torch

TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def random_tensor(name, n, gen):
    dtype = TORCH_DTYPES[name]
    if dtype.is_floating_point and dtype.itemsize >= 2:
        return (torch.randn(n, generator=gen, dtype=torch.float64) * 0.5).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=gen).to(torch.bool)
    # Integers and fp8: random bit patterns (fp8 is copied bit for bit).
    bits = torch.randint(0, 256, (n * dtype.itemsize,), generator=gen, dtype=torch.uint8)
    return bits.view(dtype)


def to_bytes(t):
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def from_bytes(b, name):
    if len(b) == 0:
        return torch.empty(0, dtype=TORCH_DTYPES[name])
    return torch.frombuffer(bytearray(b), dtype=torch.uint8).view(TORCH_DTYPES[name])


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def ref_extract(m, full, rank, power=1):
    flat = full.reshape(-1)
    info = m["ranks"][str(rank)]
    shard = torch.zeros(numel(info["shard_shape"]), dtype=full.dtype)
    for p in info["pieces"]:
        src = torch.as_strided(flat, p["shape"], p["source"][1], p["source"][0])
        factor = p.get("scale", 1.0) ** power
        val = src if factor == 1.0 else src * factor
        torch.as_strided(shard, p["shape"], p["dest"][1], p["dest"][0]).copy_(val)
    return shard


def ref_rebuild(m, shards, power=1):
    """F from each element's lowest-ranked holder; unheld elements stay zero."""
    full = torch.zeros(numel(m["logical_shape"]), dtype=shards[0].dtype)
    for r in range(len(m["ranks"])):
        for p in m["ranks"][str(r)]["pieces"]:
            if p["locations"][0] != r:
                continue
            src = torch.as_strided(shards[r], p["shape"], p["dest"][1], p["dest"][0])
            factor = p.get("scale", 1.0) ** power
            val = src if factor == 1.0 else src / factor
            torch.as_strided(full, p["shape"], p["source"][1], p["source"][0]).copy_(val)
    return full


def valid_mask(m):
    shape = m["logical_shape"]
    valid = m.get("valid_shape", shape)
    mask = torch.ones(shape, dtype=torch.bool)
    for k, v in enumerate(valid):
        index = [slice(None)] * len(shape)
        index[k] = slice(v, None)
        mask[tuple(index)] = False
    return mask.reshape(-1)


def dumps(m):
    return json.dumps(m)
