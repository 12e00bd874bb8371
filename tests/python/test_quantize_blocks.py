"""The FP8 block quantizer and the block owners of reshard.distributed.QuantizingRedistributor,
in one process: the quantizer against the reference in quantized_sync_worker.py (its own
rounding from the E4M3 value table), owners of source layouts that are not plain row splits."""

import math

import pytest

from maps import interleave_map, make_map, piece, split_map

torch = pytest.importorskip("torch")

import reshard  # noqa: E402
import reshard.distributed as rd  # noqa: E402
from reshard.distributed import _quantize  # noqa: E402
from quantized_sync_worker import reference_quantize, round_e4m3  # noqa: E402


@pytest.mark.parametrize("shape,dtype", [((300, 200), torch.bfloat16), ((128, 256), torch.float16),
                                         ((129, 1), torch.float32)])
def test_quantizer_equals_the_reference(rng, shape, dtype):
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    x = (torch.randn(shape, generator=g) * rng.choice([1e-3, 0.05, 30.0])).to(dtype)
    x[:64, :1] = 0
    data, scale = rd.quantize_fp8_blocks(x, (128, 128))
    want_data, want_scale = reference_quantize(x)
    assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8))
    assert torch.equal(scale, want_scale)


def test_zero_blocks_and_the_reciprocal_as_vllm_takes_them():
    """A block of zeros takes the scale of the amax floor (1e-4 / 448); values are multiplied
    by the scale's float32 reciprocal, not divided by the scale: with amax 1.296875,
    0.0303955078125 * (1 / s) and 0.0303955078125 / s round to different FP8 values."""
    x = (torch.randn(256, 256, generator=torch.Generator().manual_seed(5)) * 0.01) \
        .to(torch.bfloat16)
    x[:128, :128] = 0
    x[0, 128], x[0, 129] = 1.296875, 0.0303955078125
    data, scale = rd.quantize_fp8_blocks(x, (128, 128))
    want_data, want_scale = reference_quantize(x)
    assert float(scale[0, 0]) == float(torch.tensor(1e-4) / 448.0)
    assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8))
    assert torch.equal(scale, want_scale)
    s = scale[0, 1]
    assert (x[0, 129].float() / s).to(torch.float8_e4m3fn).view(torch.uint8) != \
        data[0, 129].view(torch.uint8)


def test_cast_rounds_to_nearest_even():
    """Halfway between 1 and 1.125 (codes 0x38, 0x39) goes to the even code, up or down; 2^-10,
    halfway between 0 and the least subnormal 2^-9, to 0; just above 448 to 448."""
    y = torch.tensor([1.0625, 1.1875, -1.0625, 1.0626, 2.0 ** -10, 448.01], dtype=torch.float32)
    want = round_e4m3(y).view(torch.uint8).tolist()
    assert want == [0x38, 0x3a, 0xb8, 0x39, 0x00, 0x7e]
    assert (y.to(torch.float8_e4m3fn).view(torch.uint8).tolist()) == want


def counts_by_markers(m, shape, block=(128, 128)):
    marker = torch.arange(math.prod(shape)).reshape(shape)
    grid = [math.ceil(s / b) for s, b in zip(shape, block)]
    out = torch.zeros([m.world_size, *grid], dtype=torch.int64)
    for r in range(m.world_size):
        held = set(reshard.extract(m, marker, r).reshape(-1).tolist())
        for i in range(grid[0]):
            for j in range(grid[1]):
                b = marker[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].reshape(-1).tolist()
                out[r, i, j] = len(held.intersection(b))
    return out


def flat_rows(shape, sizes):
    """FSDP's flat split: rank r holds flat elements [sum(sizes[:r]), ...) as one 1-D shard."""
    shards, start = [], 0
    for n in sizes:
        shards.append(([n], [piece([n], start, [1], 0, [1], [len(shards)])]))
        start += n
    return make_map(shape, shards)


@pytest.mark.parametrize("case", ["flat", "interleaved", "columns"])
def test_block_owners_follow_what_each_rank_holds(case):
    shape, m = {"flat": ([256, 384], flat_rows([256, 384], [40000, 58304])),
                "interleaved": ([384, 256], interleave_map([3, 2, 64], 1, [0, 1], [256], 2)),
                "columns": ([200, 300], split_map([200, 300], 1, [100, 120, 80]))}[case]
    m = reshard.ParamMap.from_dict(m)
    counts = counts_by_markers(m, shape)
    assert torch.equal(_quantize._block_counts(m, (128, 128), list(counts.shape[1:])), counts)
    owner, whole = _quantize.block_owners(m, (128, 128))
    vol = _quantize._block_volumes(shape, (128, 128), list(counts.shape[1:]))
    held = counts.gather(0, owner.unsqueeze(0))[0]
    assert torch.equal(whole, held == vol) and bool((held == counts.max(0).values).all())


def test_blocks_map_stacks_each_owners_blocks():
    shape = [300, 260]
    src = reshard.ParamMap.from_dict(split_map(shape, 0, [150, 150]))
    owner, _ = _quantize.block_owners(src, (128, 128))
    blocks, runs = _quantize.stacked_blocks_map(owner, (128, 128), shape)
    stacked = reshard.ParamMap.from_dict(blocks)
    full = torch.randn(shape).to(torch.bfloat16)
    data, scale = rd.quantize_fp8_blocks(full, (128, 128))
    scales = reshard.ParamMap.from_dict(_quantize.stacked_scales_map(owner, list(scale.shape)))
    for r in range(2):
        q, s = _quantize.quantize_runs(reshard.extract(stacked, full, r), runs[r])
        assert torch.equal(q.view(torch.uint8), reshard.extract(stacked, data, r).view(torch.uint8))
        assert torch.equal(s, reshard.extract(scales, scale, r))


def test_refusals_name_the_tensor():
    m = {"w": split_map([256, 256], 0, [128, 128])}
    with pytest.raises(rd.RedistributeError, match="no target map names X_scale_inv"):
        _quantize.quant_specs({"block": [128, 128]}, m, m)
    with pytest.raises(rd.RedistributeError, match="format \"float4\""):
        _quantize.quant_specs({"w": {"scale": "s", "block": [128, 128], "format": "float4"}}, m,
                              {**m, "s": {}})
    with pytest.raises(rd.RedistributeError, match=r"block \[0, 128\]"):
        _quantize.quant_specs({"w": {"scale": "s", "block": [0, 128]}}, m, {**m, "s": {}})


class OneProcess(rd.Transport):
    """A group of this process alone (no torch.distributed)."""

    rank, members = 0, [0]

    def gather_object(self, value):
        return [value]

    def exchange(self, sends, receives):
        assert not sends and not receives
        return []


def test_one_process_quantizes_into_its_own_fp8_buffers():
    """Trainer and engine in one process: every block is whole, nothing is gathered or sent,
    and the local copies give the quantization of the full tensor; dry_run moves nothing."""
    shape = [260, 300]
    maps = {"w": split_map(shape, 0, [260])}
    target = {"w": split_map(shape, 1, [300]), "w_scale_inv": split_map([3, 3], 1, [3])}
    sync = rd.QuantizingRedistributor(maps, target, quantize={"block": [128, 128]},
                                      source_ranks=[0], target_ranks=[0], group=OneProcess())
    full = torch.randn(shape).to(torch.bfloat16)
    schedule = sync.run({"w": full.clone()}, dry_run=True)
    assert schedule["rounds"] == 0 and sync.last_stats is None
    got = sync.run({"w": full.clone()})
    data, scale = rd.quantize_fp8_blocks(full, (128, 128))
    assert torch.equal(got["w"].view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(got["w_scale_inv"], scale)
    assert sync.last_stats["sent"] == sync.last_stats["gathered_sent"] == 0
    assert sync.gathered() == 0 and [q.scale for q in sync.quantized] == ["w_scale_inv"]


def test_one_process_quantizes_out_of_a_buffer_it_also_sends_from():
    """A source buffer holding a quantized tensor and one that is not (a Megatron-Core
    linear_qkv with only q quantized): the shard is given by the buffer's name; the quantized
    tensor's blocks are read out of it, the other is sent from it as it is. A buffer of
    tensors that are not quantized named as a quantized tensor's scales is refused."""
    from quantized_sync_worker import fused_rows
    shapes = {"a": [12, 8], "c": [4, 8]}
    maps = fused_rows([(n, shapes[n]) for n in "ac"], "fused", tp=1)
    target = {"a": split_map([12, 8], 0, [12]), "a_scale_inv": split_map([3, 2], 0, [3]),
              "c": split_map([4, 8], 0, [4])}
    quantize = {"block": [4, 4]}
    assert _quantize.check_quantized_targets(quantize, maps, target) == ["a"]
    sync = rd.QuantizingRedistributor(maps, target, quantize=quantize, source_ranks=[0],
                                      target_ranks=[0], group=OneProcess())
    g = torch.Generator().manual_seed(9)
    fulls = {n: (torch.randn(s, generator=g) * 0.05).to(torch.bfloat16) for n, s in shapes.items()}
    buf = torch.cat([fulls["a"], fulls["c"]])
    got = sync.run({"fused": buf})
    data, scale = reference_quantize(fulls["a"], (4, 4))
    assert sorted(got) == ["a", "a_scale_inv", "c"]
    assert torch.equal(got["a"].view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(got["a_scale_inv"], scale)
    assert torch.equal(got["c"], fulls["c"])
    clash = fused_rows([(n, shapes[n]) for n in "ac"], "a_scale_inv", tp=1)
    with pytest.raises(rd.RedistributeError, match="keeps it in a buffer named \"a_scale_inv\""):
        _quantize.check_quantized_targets(quantize, clash, target)
    with pytest.raises(rd.RedistributeError, match="keeps it in a buffer named \"a_scale_inv\""):
        rd.QuantizingRedistributor(clash, target, quantize=quantize, source_ranks=[0],
                                   target_ranks=[0], group=OneProcess())
