"""The executor through the public API against torch.as_strided: extract and rebuild on
random maps and dtypes, bit for bit."""

import torch
import pytest

import reshard
from maps import random_map, replicated_map, split_map, interleave_map
from torch_ref import (TORCH_DTYPES, dumps, numel, random_tensor, ref_extract, ref_rebuild,
                       to_bytes, valid_mask)

FLOAT_DTYPES = ["F32", "F16", "BF16", "F64"]
ALL_DTYPES = list(TORCH_DTYPES)


def has_scale(m):
    return any(p.get("scale", 1.0) != 1.0 for r in m["ranks"].values() for p in r["pieces"])


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_extract_and_rebuild_match_torch_on_random_maps(dtype, rng):
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    checked = 0
    while checked < 60:
        m, kind = random_map(rng, allow_scale=dtype in FLOAT_DTYPES)
        n = numel(m["logical_shape"])
        full = random_tensor(dtype, n, gen)
        text = dumps(m)
        pm = reshard.ParamMap.from_dict(m)
        shards = []
        for r in range(len(m["ranks"])):
            got = reshard.extract(pm, full.view(m["logical_shape"]), r, allow_lossy_scale=True)
            want = ref_extract(m, full, r)
            assert to_bytes(got) == to_bytes(want), f"{kind} rank {r}: {text}"
            shards.append(got)
        if has_scale(m) and dtype in ("F16", "BF16") and kind == "replicated":
            # Replicas of a non-power-of-two scale may round differently from each other
            # only when their scales differ; here all replicas share one scale.
            pass
        rebuilt = reshard.rebuild(pm, shards, allow_lossy_scale=True).reshape(-1)
        want = ref_rebuild(m, [s.reshape(-1) for s in shards])
        mask = valid_mask(m)
        assert to_bytes(rebuilt[mask]) == to_bytes(want[mask]), f"{kind}: {text}"
        checked += 1


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("scale", [0.25, 0.5, 2.0, 1.0 / 3.0, 0.1])
def test_scaled_pieces_use_the_dtypes_arithmetic(dtype, scale):
    gen = torch.Generator().manual_seed(7)
    m = replicated_map([37, 5], 3, scale)
    full = random_tensor(dtype, 37 * 5, gen)
    # The dtype's arithmetic, rounding included: lossy scales are allowed here.
    got = reshard.extract(m, full.view(37, 5), 1, allow_lossy_scale=True)
    assert to_bytes(got) == to_bytes(ref_extract(m, full, 1))
    shards = [got] * 3
    rebuilt = reshard.rebuild(m, shards, allow_lossy_scale=True)
    assert to_bytes(rebuilt) == to_bytes(ref_rebuild(m, [s.reshape(-1) for s in shards]))
    if scale in (0.25, 0.5, 2.0):
        assert to_bytes(rebuilt) == to_bytes(full)  # powers of two are exact both ways


def test_buffers_may_start_part_way_into_an_allocation():
    m = interleave_map([2, 2, 3, 2], 0, [0, 2, 1], [8], 2)  # CodeGen's fused QKV at TP 2
    gen = torch.Generator().manual_seed(3)
    full = random_tensor("BF16", 24 * 8, gen)
    backing = torch.full((3 + 24 * 8,), -1.0, dtype=torch.bfloat16)
    view = backing[3:].view(24, 8)  # storage offset 3
    view.copy_(full.view(24, 8))
    got = reshard.extract(m, view, 1)
    assert to_bytes(got) == to_bytes(ref_extract(m, full, 1))
    shard_backing = torch.zeros(5 + got.numel(), dtype=torch.bfloat16)
    shard_view = shard_backing[5:].view(got.shape)
    shard_view.copy_(got)
    shards = [reshard.extract(m, view, 0), shard_view]
    assert to_bytes(reshard.rebuild(m, shards)) == to_bytes(full)


def test_disagreeing_replicas_are_named():
    m = replicated_map([4, 4], 3)
    full = torch.arange(16, dtype=torch.float32)
    shards = [reshard.extract(m, full.view(4, 4), r) for r in range(3)]
    shards[2].view(-1)[9] = 100.0
    with pytest.raises(ValueError) as err:
        reshard.rebuild(m, shards)
    message = str(err.value)
    assert "0" in message and "2" in message and "[2, 1]" in message, message
    # Without verification the lowest rank wins.
    out = reshard.rebuild(m, shards, verify_replicas=False)
    assert to_bytes(out) == to_bytes(full)


def test_integer_dtypes_refuse_a_scale():
    m = replicated_map([8], 2, 0.5)
    full = torch.arange(8, dtype=torch.int8)
    with pytest.raises(ValueError):
        reshard.extract(m, full, 0)


def test_scaled_optimizer_state_is_refused_unless_allowed():
    m = replicated_map([8], 2, 0.5)
    full = torch.arange(8, dtype=torch.float32)
    with pytest.raises(ValueError, match="learning rate|epsilon"):
        reshard.extract(m, full, 0, scale_power=-1)
    got = reshard.extract(m, full, 0, scale_power=-1, allow_scaled_optimizer_state=True)
    assert torch.equal(got, full * 2.0)  # F * 0.5^-1
    unscaled = split_map([8], 0, [4, 4])
    assert torch.equal(reshard.extract(unscaled, full, 1, scale_power=-2), full[4:])


def test_invalid_maps_raise_map_error():
    m = split_map([8, 2], 0, [4, 3])
    with pytest.raises(reshard.MapError, match="held by no rank"):
        reshard.ParamMap.from_dict(m)
    lazy = reshard.ParamMap.from_dict(m, validate=False)
    with pytest.raises(reshard.MapError, match="held by no rank"):
        lazy.validate()
    with pytest.raises(reshard.MapError):
        reshard.ParamMap.from_json("{not json")
