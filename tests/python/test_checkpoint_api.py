"""reshard.checkpoint as the CLI's commands: paths are refused as os refuses them (an embedded
NUL), and gather / convert read DeepSpeed checkpoints and write DeepSpeed's universal
checkpoint exactly as `reshard gather` / `reshard convert [--to universal]` do, file for file
and byte for byte."""

import os
import pathlib
import subprocess

import pytest

import reshard
from ds_checkpoints import Spec

torch = pytest.importorskip("torch")

SPEC = Spec("llama", tp=2, dp=2, stage=1)  # the fixture trains each spec once per session


def tree(root):
    """{relative path: bytes} of every file under root."""
    root = pathlib.Path(root)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def cli(reshard_bin, *args):
    r = subprocess.run([reshard_bin, *map(str, args)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r


# -- paths ----------------------------------------------------------------------------------

def test_os_refuses_an_embedded_nul():
    with pytest.raises(ValueError, match="embedded null"):
        os.stat("base.pt\0/x")


@pytest.mark.parametrize("call", [
    lambda d: reshard.checkpoint.inspect(d / "base.pt\0/x"),
    lambda d: reshard.checkpoint.inspect(str(d / "base.pt") + "\0"),
    lambda d: reshard.checkpoint.gather(str(d) + "\0/x", d / "out"),
    lambda d: reshard.checkpoint.gather(d, str(d / "out") + "\0x"),
    lambda d: reshard.checkpoint.convert(str(d) + "\0/x", d / "out", tp=2),
    lambda d: reshard.checkpoint.convert(d, str(d / "out") + "\0", to="universal"),
    lambda d: reshard.checkpoint.scatter(str(d) + "\0", d / "out", maps={}),
], ids=["inspect", "inspect_trailing", "gather_in", "gather_out", "convert_in",
        "universal_out", "scatter_in"])
def test_an_embedded_nul_is_refused_as_os_refuses_it(tmp_path, call):
    torch.save({"w": torch.ones(2)}, tmp_path / "base.pt")
    with pytest.raises(ValueError, match="embedded null byte"):
        call(tmp_path)
    assert not (tmp_path / "out").exists()


# -- DeepSpeed checkpoints through Python ---------------------------------------------------

@pytest.mark.parametrize("fp32", [False, True], ids=["module", "fp32"])
def test_gather_reads_a_deepspeed_checkpoint_as_the_cli_does(ds_checkpoint, reshard_bin,
                                                             tmp_path, fp32):
    ckpt = ds_checkpoint(SPEC)
    reshard.checkpoint.gather(ckpt.save_dir, tmp_path / "py", fp32=fp32)
    cli(reshard_bin, "gather", ckpt.save_dir, "-o", tmp_path / "cli", *(["--fp32"] if fp32 else []))
    assert tree(tmp_path / "py") == tree(tmp_path / "cli")
    if not fp32:
        from safetensors.torch import load_file
        got, want = load_file(str(tmp_path / "py" / "model.safetensors")), ckpt.full()
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[n], want[n]) for n in want)


def test_convert_reads_a_deepspeed_checkpoint_as_the_cli_does(ds_checkpoint, reshard_bin,
                                                              tmp_path):
    ckpt = ds_checkpoint(SPEC)
    reshard.checkpoint.convert(ckpt.save_dir, tmp_path / "py", tp=1)
    cli(reshard_bin, "convert", ckpt.save_dir, "--tp", 1, "-o", tmp_path / "cli")
    assert tree(tmp_path / "py") == tree(tmp_path / "cli")
    reshard.checkpoint.convert(ckpt.tag_dir, tmp_path / "py_w", tp=1, weights_only=True)
    cli(reshard_bin, "convert", ckpt.tag_dir, "--tp", 1, "--weights-only", "-o", tmp_path / "cli_w")
    assert tree(tmp_path / "py_w") == tree(tmp_path / "cli_w")


def test_convert_to_universal_writes_what_the_cli_writes(ds_checkpoint, reshard_bin, tmp_path):
    ckpt = ds_checkpoint(SPEC)
    reshard.checkpoint.convert(ckpt.save_dir, tmp_path / "py", to="universal")
    cli(reshard_bin, "convert", ckpt.save_dir, "--to", "universal", "-o", tmp_path / "cli")
    got = tree(tmp_path / "py")
    assert got == tree(tmp_path / "cli")
    assert "latest_universal" in got


@pytest.mark.parametrize("kwargs, message", [
    ({"to": "universal", "tp": 2}, "takes no tp"),
    ({"to": "universal", "weights_only": True}, "takes no weights_only"),
    ({"to": "hf"}, "to='hf'"),
    ({}, "needs tp="),
])
def test_convert_refuses_conflicting_arguments(ds_checkpoint, tmp_path, kwargs, message):
    ckpt = ds_checkpoint(SPEC)
    with pytest.raises(ValueError, match=message):
        reshard.checkpoint.convert(ckpt.save_dir, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_deepspeed_only_options_refuse_a_reshard_checkpoint(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "x.pt")  # not a DeepSpeed checkpoint
    with pytest.raises(ValueError, match="not a DeepSpeed checkpoint"):
        reshard.checkpoint.gather(tmp_path, tmp_path / "out", fp32=True)
    with pytest.raises(ValueError, match="is not one"):
        reshard.checkpoint.convert(tmp_path, tmp_path / "out", to="universal")
    with pytest.raises(ValueError, match="is not one"):
        reshard.checkpoint.convert(tmp_path, tmp_path / "out", tp=1, weights_only=True)
