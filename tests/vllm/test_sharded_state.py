"""Checkpoints vLLM's sharded-state loader reads, written by `reshard scatter --maps` (and
`convert --target-maps`) from a layout learned from vLLM: engines load them and generate
transformers' greedy tokens. One engine per (model, degree)."""

import json

import pytest
from safetensors.torch import load_file

import reshard.vllm
from conftest import engine, greedy, run_reshard, transformers_tokens

CASES = [("llama", 1), ("llama", 2), ("moe", 1), ("moe", 2)]


@pytest.fixture(scope="module")
def models(toy_llama, toy_moe):
    return {"llama": toy_llama, "moe": toy_moe}


@pytest.fixture(scope="module")
def reference(models):
    return {name: transformers_tokens(d) for name, d in models.items()}


def scattered(models, tmp_path, name, tp):
    maps = tmp_path / f"{name}-tp{tp}.json"
    maps.write_text(json.dumps(reshard.vllm.layout(models[name], tp, dtype="float32")))
    out = tmp_path / f"{name}-tp{tp}"
    run_reshard("scatter", models[name], "--maps", maps, "-o", out)
    return maps, out


@pytest.mark.parametrize("name,tp", CASES)
def test_vllm_loads_the_scattered_files_and_generates_the_checkpoints_tokens(
        models, reference, tmp_path, name, tp):
    maps, out = scattered(models, tmp_path, name, tp)
    files = sorted(p.name for p in out.iterdir())
    assert {"config.json", "generation_config.json"} <= set(files)
    assert [f for f in files if f.startswith("model-rank-")] == [
        f"model-rank-{r}-part-0.safetensors" for r in range(tp)]
    with engine(out, tp, load_format="sharded_state") as llm:
        assert greedy(llm) == reference[name]
        # The layout names what every worker holds, with its dtypes and shapes.
        reshard.vllm.check_engine(llm, json.loads(maps.read_text()))


def test_convert_from_a_sharded_checkpoint_writes_the_same_files(models, tmp_path):
    maps, want = scattered(models, tmp_path, "llama", 2)
    # A checkpoint split by rows over 2 ranks (torch's chunks), then to vLLM's layout at TP 2.
    config = models["llama"] / "config.json"
    layouts = tmp_path / "rows.json"
    layouts.write_text(json.dumps({"version": 1, "*": {"family": "split", "dim": 0,
                                                       "remainder": "ceil"}}))
    run_reshard("scatter", models["llama"], "--layouts", layouts, "--tp", 2, "-o", tmp_path / "hf2")
    run_reshard("convert", tmp_path / "hf2", "--tp", 2, "--target-maps", maps,
                "-o", tmp_path / "vllm2")
    for r in range(2):
        name = f"model-rank-{r}-part-0.safetensors"
        a, b = load_file(str(want / name)), load_file(str(tmp_path / "vllm2" / name))
        assert sorted(a) == sorted(b)
        for key in a:
            assert a[key].dtype == b[key].dtype and a[key].equal(b[key]), key
    assert (tmp_path / "vllm2" / "config.json").read_bytes() == config.read_bytes()
