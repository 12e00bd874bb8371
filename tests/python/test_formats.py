"""The table of checkpoint formats (checkpoint/formats): gather and convert take any format
they detect, and refuse options a format does not take, before anything is written."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import reshard
from test_checkpoints import LAYOUTS, model, run, tree_hash


@pytest.fixture
def full(tmp_path):
    d = tmp_path / "full"
    d.mkdir()
    save_file(model(), str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text('{"model_type": "toy"}\n')
    (tmp_path / "layouts.json").write_text(json.dumps(LAYOUTS))
    return d


def maps_of(sharded_dir, path):
    """The map document of a sharded checkpoint's manifest."""
    manifest = json.loads((sharded_dir / "reshard.json").read_text())
    doc = {"version": 1}
    doc.update({name: p["map"] for name, p in manifest["params"].items()})
    path.write_text(json.dumps(doc))
    return path


def shard_files(d):
    return {p.name: load_file(str(p)) for p in sorted(d.glob("model-rank-*.safetensors"))}


def test_convert_of_a_hugging_face_dir_equals_scatter(reshard_bin, tmp_path, full):
    scattered = tmp_path / "scattered"
    r = run(reshard_bin, "scatter", full, "--layouts", tmp_path / "layouts.json", "--tp", 2,
            "-o", scattered)
    assert r.returncode == 0, r.stderr
    maps = maps_of(scattered, tmp_path / "maps.json")
    converted = tmp_path / "converted"
    r = run(reshard_bin, "convert", full, "--tp", 2, "--target-maps", maps, "-o", converted)
    assert r.returncode == 0, r.stderr
    a, b = shard_files(scattered), shard_files(converted)
    assert a.keys() == b.keys() and len(a) == 2
    for name in a:
        assert a[name].keys() == b[name].keys()
        for t in a[name]:
            assert torch.equal(a[name][t].view(torch.uint8), b[name][t].view(torch.uint8)), t
    # And back: the gathered tensors are the source's, bit for bit.
    gathered = tmp_path / "gathered"
    assert run(reshard_bin, "gather", converted, "-o", gathered).returncode == 0
    src, out = load_file(str(full / "model.safetensors")), load_file(str(gathered / "model.safetensors"))
    assert src.keys() == out.keys()
    for t in src:
        assert torch.equal(src[t].view(torch.uint8), out[t].view(torch.uint8)), t


def test_python_convert_of_a_hugging_face_dir(tmp_path, full, reshard_bin):
    scattered = tmp_path / "scattered"
    assert run(reshard_bin, "scatter", full, "--layouts", tmp_path / "layouts.json", "--tp", 4,
               "-o", scattered).returncode == 0
    maps = maps_of(scattered, tmp_path / "maps.json")
    out = tmp_path / "py"
    reshard.checkpoint.convert(full, out, tp=4, target_maps=maps)
    assert shard_files(out).keys() == shard_files(scattered).keys()


def test_a_hugging_face_dir_without_target_maps_says_what_to_give(reshard_bin, tmp_path, full):
    r = run(reshard_bin, "convert", full, "--tp", 2, "-o", tmp_path / "o")
    assert r.returncode == 1 and "--target-maps" in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()


def test_gather_of_a_hugging_face_dir_is_refused(reshard_bin, tmp_path, full):
    r = run(reshard_bin, "gather", full, "-o", tmp_path / "o")
    assert r.returncode == 2 and "nothing to gather" in r.stderr, r.stderr
    with pytest.raises(ValueError, match="nothing to gather"):
        reshard.checkpoint.gather(full, tmp_path / "o")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("extra, message", [
    (["--config", "CONFIG"], "takes no config.json"),
    (["--weights-only"], "is not one"),
    (["--distributed-config", '{"tp_plan": "auto"}'], "distributed config applies"),
])
def test_options_a_hugging_face_dir_does_not_take(reshard_bin, tmp_path, full, extra, message):
    extra = [str(full / "config.json") if e == "CONFIG" else e for e in extra]
    r = run(reshard_bin, "convert", full, "--tp", 2, *extra, "-o", tmp_path / "o")
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()


def test_a_config_is_refused_by_a_sharded_checkpoint(reshard_bin, tmp_path, full):
    scattered = tmp_path / "scattered"
    assert run(reshard_bin, "scatter", full, "--layouts", tmp_path / "layouts.json", "--tp", 2,
               "-o", scattered).returncode == 0
    before = tree_hash(scattered)
    for cmd in (["gather"], ["convert", "--tp", "1"]):
        r = run(reshard_bin, *cmd, scattered, "--config", full / "config.json", "-o", tmp_path / "o")
        assert r.returncode == 2 and "takes no config.json" in r.stderr, r.stderr
    with pytest.raises(ValueError, match="takes no config.json"):
        reshard.checkpoint.gather(scattered, tmp_path / "o", config=full / "config.json")
    assert tree_hash(scattered) == before and not (tmp_path / "o").exists()
