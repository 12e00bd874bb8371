"""Interchange with DeepSpeed's own affine map module (deepspeed.checkpoint.affine): maps we
write load there and rebuild our data; maps its builders produce load here, validate, and
extract the same shards."""

import json
import logging
import math

import pytest
import torch

logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
import deepspeed.checkpoint.affine as affine  # noqa: E402  (installed by scripts/dev; never skipped)

import reshard  # noqa: E402
from maps import random_map  # noqa: E402
from torch_ref import random_tensor, to_bytes, valid_mask  # noqa: E402


def check_extract_parity(ds_map, dtype, gen):
    pm = reshard.ParamMap.from_dict(ds_map.to_dict())
    full = random_tensor(dtype, ds_map.numel, gen).reshape(ds_map.logical_shape)
    for rank in ds_map.shard_shapes:
        ours = reshard.extract(pm, full, rank, allow_lossy_scale=True)
        theirs = ds_map.extract(full, rank)
        assert to_bytes(ours) == to_bytes(theirs), f"rank {rank}: {pm.to_json()}"
    shards = [reshard.extract(pm, full, r, allow_lossy_scale=True) for r in sorted(ds_map.shard_shapes)]
    assert to_bytes(reshard.rebuild(pm, shards)) == to_bytes(full)


def test_our_maps_load_in_deepspeed_and_rebuild_our_data(rng):
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    for _ in range(150):
        m, kind = random_map(rng)
        pm = reshard.ParamMap.from_dict(m)
        ours = pm.to_json()
        ds_map = affine.ParamAffineMap.from_dict(json.loads(ours))
        ds_map.validate()
        # Same document, field for field, apart from our valid_shape.
        written = json.loads(ours)
        written.pop("valid_shape", None)
        assert ds_map.to_dict() == {**written, "ranks": {int(k): v for k, v in written["ranks"].items()}}
        dtype = rng.choice(["F32", "BF16", "F16"])
        full = random_tensor(dtype, ds_map.numel, gen)
        shards = {r: reshard.extract(pm, full.view(pm.logical_shape), r, allow_lossy_scale=True)
                  for r in ds_map.shard_shapes}
        rebuilt = ds_map.rebuild(shards).reshape(-1)
        mask = valid_mask(m)
        ours_rebuilt = reshard.rebuild(pm, shards, allow_lossy_scale=True).reshape(-1)
        assert to_bytes(rebuilt[mask]) == to_bytes(ours_rebuilt[mask]), f"{kind}: {ours}"
        if dtype != "F16" and all(math.frexp(p.get("scale", 1.0))[0] == 0.5
                                  for r in m["ranks"].values() for p in r["pieces"]):
            # Powers of two are exact both ways barring underflow, which F32 and BF16 (with
            # float's exponent range) do not reach here; F16's small values can.
            assert to_bytes(rebuilt[mask]) == to_bytes(full[mask]), f"{kind}: {ours}"


def test_small_maps_pass_deepspeeds_element_wise_coverage_check(rng):
    for _ in range(40):
        m, kind = random_map(rng, allow_padding=False)
        ds_map = affine.ParamAffineMap.from_dict(reshard.ParamMap.from_dict(m).to_dict())
        ds_map.validate_coverage()


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
def test_deepspeed_builders_load_validate_and_extract_alike(tp):
    gen = torch.Generator().manual_seed(tp)
    check_extract_parity(affine.replicated_map((24, 8), tp), "BF16", gen)
    check_extract_parity(affine.replicated_map((16,), tp, scale=1.0 / tp), "F32", gen)
    sizes = [24 // tp + (1 if r < 24 % tp else 0) for r in range(tp)]
    check_extract_parity(affine.contiguous_split_map((24, 8), sizes, 0), "BF16", gen)
    check_extract_parity(affine.contiguous_split_map((8, 24), sizes, 1), "F16", gen)
    q, kv = 32, 8
    qw = [q // tp + (1 if r < q % tp else 0) for r in range(tp)]
    kvw = [kv // tp + (1 if r < kv % tp else 0) for r in range(tp)]
    check_extract_parity(affine.sub_param_map((q + 2 * kv, 6), [q, kv, kv], [qw, kvw, kvw], 0),
                         "BF16", gen)
    check_extract_parity(affine.segmented_map((48, 8), [(32, False), (16, True)], 0, tp,
                                              [[32 // tp + (1 if r < 32 % tp else 0)
                                                for r in range(tp)]]), "F32", gen)
    # Yuan-style block gather: 8 blocks of 4 rows, rank r takes blocks r, r + tp, ...
    blocks = {r: list(range(r, 8, tp)) for r in range(tp)} if 8 % tp == 0 else None
    if blocks:
        check_extract_parity(affine.block_gather_map((32, 8), blocks, 4, 0), "BF16", gen)


def test_invalid_deepspeed_map_is_refused_with_the_rank_and_piece():
    ds_map = affine.contiguous_split_map((10, 4), [3, 3, 2, 1], 0)
    with pytest.raises(reshard.MapError, match=r"element \[9, 0\] of F .* is held by no rank"):
        reshard.ParamMap.from_dict(ds_map.to_dict())
