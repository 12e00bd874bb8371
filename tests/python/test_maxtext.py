"""MaxText's names and layouts: Hugging Face <-> Orbax arrays as MaxText holds them.

A toy Llama and a toy Qwen3 from transformers are written by `reshard convert --to orbax
--names maxtext` as MaxText's tree (`params.params.decoder.layers.*` stacked on axis 1, [in, out]
kernels, per-head attention kernels; Llama's rotary pairs interleaved and its query kernel times
1/sqrt(head_dim)) on a (2, 4) mesh with split heads, head_dim, layers and vocabulary. Orbax
restores it (maxtext_worker.py in .venv-jax), a forward pass written in jax.numpy from MaxText's
layers over the restored arrays gives transformers' logits within float32 rounding, and Orbax
saves it again as MaxText's CheckpointManager does (OCDBT + zarr v3, another mesh);
`reshard gather --names maxtext` of both gives the original tensors byte for byte, which
transformers loads.
"""

import json
import os
import pathlib
import subprocess

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
IDS = [3, 17, 42, 5, 60, 8, 23, 1, 33]

SPECS = {
    "*token_embedder.embedding": ["tensor", "fsdp"],
    "*logits_dense.kernel": ["fsdp", "tensor"],
    "*self_attention.query.kernel": ["fsdp", None, "tensor", None],
    "*self_attention.key.kernel": [None, None, None, "tensor"],   # head_dim: rotary pairs split
    "*self_attention.out.kernel": ["tensor", None, "fsdp", None],
    "*mlp.wo.kernel": [None, "fsdp", "tensor"],                   # the layers split
    "*mlp.wi_*": ["fsdp", None, "tensor"],
}


def run(reshard_bin, *args):
    return subprocess.run([reshard_bin, *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def jax_python():
    python = os.environ.get("RESHARD_JAX_PYTHON", str(REPO / ".venv-jax" / "bin" / "python"))
    assert pathlib.Path(python).exists(), f"{python} is missing (scripts/dev setup_jax_venv)"
    return python


def toy_model(out, family="llama", head_dim=16, seed=0):
    """A 2-layer model with every weight random (norms too), F32, untied."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM),
                                 "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[family]
    config = config_class(vocab_size=64, hidden_size=4 * head_dim, intermediate_size=48,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=head_dim, tie_word_embeddings=False, rms_norm_eps=1e-6)
    model = model_class(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 if p.dim() > 1 else 1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(out, safe_serialization=True)
    return model


FAMILIES = ["llama", "qwen3"]


@pytest.fixture(scope="module")
def models(reshard_bin, tmp_path_factory):
    """Per family: the toy model, its Orbax conversion, the worker's logits and Orbax's own save
    (one JAX process for both)."""
    out, jobs = {}, []
    for family in FAMILIES:
        d = tmp_path_factory.mktemp(family)
        hf_model = toy_model(d / "hf", family)
        (d / "specs.json").write_text(json.dumps(SPECS))
        r = run(reshard_bin, "convert", d / "hf", "--to", "orbax", "--names", "maxtext",
                "--mesh", "fsdp=2,tensor=4", "--partition-specs", d / "specs.json", "-o",
                d / "orbax")
        assert r.returncode == 0, r.stderr
        (d / "ids.json").write_text(json.dumps(IDS))
        jobs += [d / "orbax", d / "hf" / "config.json", d / "ids.json", d / "jax"]
        with torch.no_grad():
            logits = hf_model(torch.tensor([IDS])).logits[0].numpy()
        out[family] = {"family": family, "dir": d, "logits": logits}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    w = subprocess.run([jax_python(), str(HERE / "maxtext_worker.py"), *map(str, jobs)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert w.returncode == 0, w.stdout[-4000:] + w.stderr[-4000:]
    return out


@pytest.fixture(params=FAMILIES)
def model(request, models):
    return models[request.param]


@pytest.fixture(scope="module")
def llama(tmp_path_factory, reshard_bin):
    """A toy Llama and its Orbax conversion (no JAX), for the refusals."""
    d = tmp_path_factory.mktemp("llama")
    toy_model(d / "hf")
    r = run(reshard_bin, "convert", d / "hf", "--to", "orbax", "--names", "maxtext", "--mesh",
            "data=2", "-o", d / "orbax")
    assert r.returncode == 0, r.stderr
    return {"dir": d}


def test_written_tree_is_maxtexts(reshard_bin, model):
    doc = json.loads(run(reshard_bin, "inspect", "--json", model["dir"] / "orbax").stdout)
    arrays = {a["name"]: a for a in doc["orbax"]["arrays"]}
    layers = "params.params.decoder.layers."
    assert arrays[layers + "self_attention.query.kernel"]["shape"] == [64, 2, 4, 16]
    assert arrays[layers + "self_attention.key.kernel"]["shape"] == [64, 2, 2, 16]
    assert arrays[layers + "self_attention.out.kernel"]["shape"] == [4, 2, 16, 64]
    assert arrays[layers + "mlp.wi_0.kernel"]["shape"] == [64, 2, 48]
    assert arrays[layers + "mlp.wo.kernel"]["shape"] == [48, 2, 64]
    assert arrays[layers + "pre_self_attention_layer_norm.scale"]["shape"] == [64, 2]
    assert arrays["params.params.decoder.logits_dense.kernel"]["shape"] == [64, 64]
    assert arrays["params.params.token_embedder.embedding"]["shape"] == [64, 64]
    assert arrays[layers + "mlp.wo.kernel"]["sharding"]["partition_spec"] == [[], ["fsdp"],
                                                                               ["tensor"]]
    if model["family"] == "qwen3":
        assert arrays[layers + "self_attention.query_norm.scale"]["shape"] == [16, 2]
        assert arrays[layers + "self_attention.key_norm.scale"]["shape"] == [16, 2]
    assert len(arrays) == (3 + 9 if model["family"] == "llama" else 3 + 11)


def test_jax_forward_over_the_orbax_arrays_equals_transformers(model):
    got = np.load(model["dir"] / "jax" / "logits.npy")
    want = model["logits"]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", ["reshard", "orbax"])
def test_gather_gives_the_original_bytes(reshard_bin, model, tmp_path, which):
    """From what reshard wrote (zarr v2, (2, 4) mesh) and from what Orbax saved again (OCDBT +
    zarr v3 under a CheckpointManager root, (8,) mesh, with a `step`)."""
    from transformers import AutoModelForCausalLM
    d = model["dir"]
    src = d / "orbax" if which == "reshard" else d / "jax" / "ckpt"
    r = run(reshard_bin, "gather", src, "--names", "maxtext", "--config", d / "hf" / "config.json",
            "-o", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    want = load_file(d / "hf" / "model.safetensors")
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name].view(torch.int32), t.view(torch.int32)), name
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        logits = loaded(torch.tensor([IDS])).logits[0].numpy()
    assert np.array_equal(logits, model["logits"])


def test_convert_to_sharded_from_maxtext_names(reshard_bin, llama, tmp_path):
    d = llama["dir"]
    r = run(reshard_bin, "convert", d / "orbax", "--names", "maxtext", "--config",
            d / "hf" / "config.json", "--tp", 2, "-o", tmp_path / "tp2")
    assert r.returncode == 0, r.stderr
    r = run(reshard_bin, "gather", tmp_path / "tp2", "-o", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    want = load_file(d / "hf" / "model.safetensors")
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert all(torch.equal(got[n], want[n]) for n in want) and sorted(got) == sorted(want)


def edited_config(d, tmp_path, **changes):
    config = json.loads((d / "hf" / "config.json").read_text())
    config.update(changes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("changes,message", [
    ({"num_hidden_layers": 3}, "is [64, 2], but the model config.json describes"),
    ({"intermediate_size": 40}, "but the model config.json describes"),
    ({"num_key_value_heads": 4}, "but the model config.json describes"),
    ({"tie_word_embeddings": True}, "\"params.params.decoder.logits_dense.kernel\" is not a "
                                    "parameter of MaxText's llama model"),
    ({"model_type": "gemma"}, "value transforms, not geometry"),
])
def test_a_config_that_does_not_match_is_refused(reshard_bin, llama, tmp_path, changes, message):
    d = llama["dir"]
    r = run(reshard_bin, "gather", d / "orbax", "--names", "maxtext", "--config",
            edited_config(d, tmp_path, **changes), "-o", tmp_path / "out")
    assert r.returncode == 1, r.stderr
    assert message in r.stderr
    assert not (tmp_path / "out").exists()


def test_unknown_parameters_are_refused_naming_them(reshard_bin, llama, tmp_path):
    d = llama["dir"]
    tensors = load_file(d / "hf" / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    (tmp_path / "hf").mkdir()
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "hf" / "config.json").write_text((d / "hf" / "config.json").read_text())
    r = run(reshard_bin, "convert", tmp_path / "hf", "--to", "orbax", "--names", "maxtext",
            "--mesh", "data=1", "-o", tmp_path / "out")
    assert r.returncode == 1, r.stderr
    assert "\"model.layers.0.self_attn.q_proj.bias\" is not a parameter" in r.stderr
    assert not (tmp_path / "out").exists()
    # and without config.json's model in the tree: a gather without --config is a usage error
    r = run(reshard_bin, "gather", d / "orbax", "--names", "maxtext", "-o", tmp_path / "out")
    assert r.returncode == 2 and "needs the model's config.json" in r.stderr


def test_a_query_scale_that_rounds_needs_allow_lossy_scale(reshard_bin, tmp_path):
    """head_dim 8: MaxText's query kernel is the Hugging Face one times 1/sqrt(8), which rounds
    most values: refused unless allowed, then written with a warning, and read back within an
    ulp."""
    toy_model(tmp_path / "hf", head_dim=8, seed=1)
    args = ["convert", tmp_path / "hf", "--to", "orbax", "--names", "maxtext", "--mesh",
            "data=1"]
    r = run(reshard_bin, *args, "-o", tmp_path / "out")
    assert r.returncode == 1, r.stderr
    assert not (tmp_path / "out").exists()
    r = run(reshard_bin, *args, "--allow-lossy-scale", "-o", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert "self_attention.query.kernel" in r.stderr and "not a power of two" in r.stderr
    r = run(reshard_bin, "gather", tmp_path / "out", "--names", "maxtext", "--config",
            tmp_path / "hf" / "config.json", "--allow-lossy-scale", "-o", tmp_path / "back")
    assert r.returncode == 0, r.stderr
    want = load_file(tmp_path / "hf" / "model.safetensors")
    got = load_file(tmp_path / "back" / "model.safetensors")
    for name, t in want.items():
        if "q_proj" in name:
            torch.testing.assert_close(got[name], t, rtol=5e-7, atol=0)
        else:
            assert torch.equal(got[name], t), name


def test_python_package_takes_names(llama, tmp_path):
    import reshard
    d = llama["dir"]
    reshard.checkpoint.gather(d / "orbax", tmp_path / "hf", config=d / "hf" / "config.json",
                   names="maxtext")
    want = load_file(d / "hf" / "model.safetensors")
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    reshard.checkpoint.convert(d / "orbax", tmp_path / "dcp", to="dcp", world=2, weights_only=True,
                    config=d / "hf" / "config.json", names="maxtext")
    assert (tmp_path / "dcp" / ".metadata").exists()
    with pytest.raises(ValueError, match="config.json"):
        reshard.checkpoint.gather(d / "orbax", tmp_path / "again", names="maxtext")
