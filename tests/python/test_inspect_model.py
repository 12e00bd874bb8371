"""`reshard inspect DIR` on checkpoint directories: the model view of a reshard sharded
checkpoint (from its manifest, every file checked) and of a Hugging Face directory (tensors
listed once, through the index)."""

import json

import pytest
import torch
from safetensors.torch import save_file

from test_torch_files import inspect_json, run


@pytest.fixture(scope="module")
def demo(tmp_path_factory, reshard_bin):
    """The demo's checkpoints: full, and sharded at TP 2, 3 and 4."""
    out = tmp_path_factory.mktemp("inspect") / "demo"
    assert run(reshard_bin, "demo", out).returncode == 0
    return out


def test_sharded_dir_shows_the_model_its_manifest_describes(demo, reshard_bin):
    sharded = demo / "tp3"
    manifest = json.loads((sharded / "reshard.json").read_text())
    info = inspect_json(reshard_bin, sharded)
    model = info["model"]
    assert model["format"] == "reshard" and model["world_size"] == 3
    # The run: a rank per tensor rank, the files by rank, no optimizer state.
    run_ = info["parallelism"]
    assert (run_["world"], run_["axes"], run_["optimizer"]) == (3, [{"name": "tp", "size": 3}],
                                                                 "none")
    assert run_["files"] == "model-rank-{tp}-part-{p}.safetensors" and run_["unknown"] == []
    assert model["files"] == manifest["files"]
    assert [p["name"] for p in model["params"]] == list(manifest["params"])
    total = 0
    for p in model["params"]:
        m = manifest["params"][p["name"]]
        assert p["dtype"] == m["dtype"]
        assert p["logical_shape"] == m["map"]["logical_shape"]
        assert p.get("valid_shape") == m["map"].get("valid_shape")
        assert p["layout"] == m["layout"]
        assert p["scale_power"] == m.get("scale_power", 1)
        for r in p["ranks"]:
            shard = m["map"]["ranks"][str(r["rank"])]
            assert r["shard_shape"] == shard["shard_shape"]
            assert r["pieces"] == len(shard["pieces"])
            numel = 1
            for d in shard["shard_shape"]:
                numel *= d
            assert r["elements"] == numel
            total += numel * {"BF16": 2, "F32": 4, "F16": 2}[p["dtype"]]
    assert model["bytes"] == total
    # The files are listed too, each with its tensors.
    assert [f["file"] for f in info["files"]] == [
        f"model-rank-{r}-part-0.safetensors" for r in range(3)]

    text = run(reshard_bin, "inspect", sharded)
    assert text.returncode == 0, text.stderr
    assert "reshard sharded checkpoint: world size 3" in text.stdout
    assert "parallelism: tp 3 (reshard: a rank per tensor rank), no optimizer state" in text.stdout
    assert 'embed_tokens.weight  BF16 [32004, 384] (valid [32003, 384])' in text.stdout
    assert "rank 2 files: [\"model-rank-2-part-0.safetensors\"]" in text.stdout


def test_sharded_dir_with_a_bad_file_is_refused(demo, reshard_bin):
    sharded = demo / "tp2"
    save_file({"stray": torch.ones(1)}, sharded / "model-rank-1-part-0.safetensors")
    r = run(reshard_bin, "inspect", sharded)
    assert r.returncode == 2, r.stderr
    assert "model-rank-1-part-0.safetensors" in r.stderr


def test_huggingface_dir_lists_each_tensor_once_through_its_index(tmp_path, reshard_bin):
    hf = tmp_path / "hf"
    hf.mkdir()
    parts = {"model-00001-of-00002.safetensors": {"a.weight": torch.ones(2, 3)},
             "model-00002-of-00002.safetensors": {"b.weight": torch.zeros(4, dtype=torch.bfloat16),
                                                  "a.bias": torch.ones(2)}}
    weight_map = {}
    for name, tensors in parts.items():
        save_file(tensors, hf / name, metadata={"format": "pt"})
        weight_map.update({t: name for t in tensors})
    (hf / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 40}, "weight_map": weight_map}))
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    info = inspect_json(reshard_bin, hf)
    model = info["model"]
    assert model["format"] == "huggingface"
    assert info["parallelism"]["world"] == 1 and info["parallelism"]["axes"] == []
    assert model["index"] == "model.safetensors.index.json"
    assert model["bytes"] == 40
    got = {t["name"]: (t["dtype"], t["shape"], t["file"]) for t in model["tensors"]}
    assert got == {"a.weight": ("F32", [2, 3], "model-00001-of-00002.safetensors"),
                   "a.bias": ("F32", [2], "model-00002-of-00002.safetensors"),
                   "b.weight": ("BF16", [4], "model-00002-of-00002.safetensors")}
    text = run(reshard_bin, "inspect", hf).stdout
    assert "Hugging Face checkpoint (model.safetensors.index.json): 3 tensors, 40 bytes" in text
    assert text.count("a.weight") == 1  # once, not again under its file

    # An index that names a missing file is refused.
    weight_map["c"] = "model-00003-of-00002.safetensors"
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    r = run(reshard_bin, "inspect", hf)
    assert r.returncode == 2 and "model-00003-of-00002.safetensors" in r.stderr
