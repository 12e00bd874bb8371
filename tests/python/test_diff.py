"""reshard diff / reshard.diff: two checkpoints in different formats and layouts compared
tensor by tensor, checked against torch's own comparison of the full tensors."""

import json
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

import reshard
from test_checkpoints import LAYOUTS, model, run


class Ckpts:
    """A Hugging Face checkpoint of test_checkpoints.model() and its scatters."""

    def __init__(self, reshard_bin, root):
        self.bin = reshard_bin
        self.root = root
        self.hf = root / "hf"
        self.hf.mkdir()
        save_file(model(), str(self.hf / "model.safetensors"), metadata={"format": "pt"})
        self.layouts = root / "layouts.json"
        self.layouts.write_text(json.dumps(LAYOUTS))
        self.tp2 = self.scatter(self.hf, 2, "tp2")
        self.tp4 = self.scatter(self.hf, 4, "tp4")
        self.dcp = root / "dcp3"
        r = run(reshard_bin, "convert", self.tp2, "--to", "dcp", "--world", 3, "-o", self.dcp)
        assert r.returncode == 0, r.stderr

    def scatter(self, full, tp, name):
        out = self.root / name
        r = run(self.bin, "scatter", full, "--layouts", self.layouts, "--tp", tp, "-o", out)
        assert r.returncode == 0, r.stderr
        return out

    def hf_with(self, tmp_path, tensors, name="changed"):
        d = tmp_path / name
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        return d


@pytest.fixture(scope="module")
def ckpts(reshard_bin, tmp_path_factory):
    return Ckpts(reshard_bin, tmp_path_factory.mktemp("diff"))


def f32(text):
    """A value as reshard prints it (the shortest text that reads back to the float32 value of
    a bf16, f16 or f32 element), as that float32 value."""
    return struct.unpack("f", struct.pack("f", float(text)))[0]


def diff_json(ckpts, a, b, *flags):
    r = run(ckpts.bin, "diff", a, b, "--json", *flags)
    assert r.returncode in (0, 1), r.stderr
    report = json.loads(r.stdout)
    assert report["equal"] == (r.returncode == 0)
    return r.returncode, report


@pytest.mark.parametrize("a,b", [("hf", "tp2"), ("tp2", "hf"), ("hf", "tp4"), ("tp4", "tp2"),
                                 ("dcp", "hf"), ("tp4", "dcp")])
def test_equal_checkpoints_in_different_layouts_are_equal(ckpts, a, b):
    r = run(ckpts.bin, "diff", getattr(ckpts, a), getattr(ckpts, b))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{len(model())} tensors in both compared" in r.stdout
    assert "0 differences" in r.stdout


def changed_at(name, flat, value):
    tensors = model()
    t = tensors[name]
    t.view(-1)[flat] = value
    return tensors


# mlp.down.weight [16, 48] is split by columns: at TP 4, rank 1 holds columns 12..23, and F's
# element [8, 17] sits in the middle of that middle shard. embed.weight [50, 16] is a padded
# vocabulary (52 rows at TP 4): its last valid element is flat 799.
@pytest.mark.parametrize("name,flat", [("mlp.down.weight", 0), ("mlp.down.weight", 8 * 48 + 17),
                                       ("embed.weight", 799), ("mlp.down.bias", 15),
                                       ("attn.c_attn.weight", 55 * 16 + 3)])
def test_one_changed_element_is_named_with_its_index_and_both_values(ckpts, tmp_path, name, flat):
    changed = ckpts.hf_with(tmp_path, changed_at(name, flat, 42.0))
    want_a = model()[name].view(-1)[flat].item()
    for a in (ckpts.tp4, ckpts.scatter(changed, 2, f"{tmp_path.name}-tp2")):
        b = changed if a == ckpts.tp4 else ckpts.hf
        code, report = diff_json(ckpts, a, b)
        assert code == 1
        assert len(report["differences"]) == 1, report
        d = report["differences"][0]
        assert d["name"] == name and d["kind"] == "value"
        assert d["index"] == flat
        shape = list(model()[name].shape)
        want_index = [flat // shape[1], flat % shape[1]] if len(shape) == 2 else [flat]
        assert d["multi_index"] == want_index
        if a == ckpts.tp4:
            assert f32(d["value_a"]) == want_a and f32(d["value_b"]) == 42.0
        else:
            assert f32(d["value_a"]) == 42.0 and f32(d["value_b"]) == want_a
    r = run(ckpts.bin, "diff", ckpts.tp4, changed)
    assert r.returncode == 1
    assert f"value   {name}: first difference at" in r.stdout and f"(flat {flat})" in r.stdout


def test_missing_extra_dtype_and_shape_differences_are_each_reported(ckpts, tmp_path):
    tensors = model()
    del tensors["attn.qkv.weight"]
    tensors["extra.weight"] = torch.ones(3, 2)
    tensors["norm.weight"] = tensors["norm.weight"].float()
    tensors["attn.v.weight"] = tensors["attn.v.weight"].reshape(16, 32).contiguous()
    code, report = diff_json(ckpts, ckpts.tp2, ckpts.hf_with(tmp_path, tensors))
    assert code == 1
    got = {d["name"]: d for d in report["differences"]}
    assert set(got) == {"attn.qkv.weight", "extra.weight", "norm.weight", "attn.v.weight"}
    assert got["attn.qkv.weight"]["kind"] == "missing"
    assert got["attn.qkv.weight"]["shape_a"] == [192, 16] and got["attn.qkv.weight"]["dtype_b"] is None
    assert got["extra.weight"]["kind"] == "extra" and got["extra.weight"]["dtype_b"] == "F32"
    assert got["norm.weight"]["kind"] == "dtype"
    assert (got["norm.weight"]["dtype_a"], got["norm.weight"]["dtype_b"]) == ("BF16", "F32")
    assert got["attn.v.weight"]["kind"] == "shape"
    assert (got["attn.v.weight"]["shape_a"], got["attn.v.weight"]["shape_b"]) == ([32, 16], [16, 32])
    assert report["differences"][-1]["name"] == "extra.weight"  # B's extras come last
    assert report["tensors_compared"] == len(model()) - 1


def test_tolerances_compare_bf16_against_fp32(ckpts, tmp_path):
    g = torch.Generator().manual_seed(7)
    exact = {"w": torch.randn(24, 16, generator=g), "b": torch.randn(16, generator=g)}
    fp32 = ckpts.hf_with(tmp_path, exact, "fp32")
    rounded = ckpts.hf_with(tmp_path, {k: v.bfloat16() for k, v in exact.items()}, "bf16")
    layouts = tmp_path / "l.json"
    layouts.write_text(json.dumps({"version": 1, "w": {"family": "split", "dim": 1},
                                   "*": {"family": "replicated"}}))
    sharded = tmp_path / "bf16-tp2"
    r = run(ckpts.bin, "scatter", rounded, "--layouts", layouts, "--tp", 2, "-o", sharded)
    assert r.returncode == 0, r.stderr
    code, report = diff_json(ckpts, fp32, sharded)
    assert code == 1 and {d["kind"] for d in report["differences"]} == {"dtype"}
    # bf16 keeps 8 significant bits: rounding moves a value by at most 2^-8 of itself.
    code, report = diff_json(ckpts, fp32, sharded, "--rtol", 2.0 ** -7)
    assert code == 0, report
    assert report["elements_compared"] == 24 * 16 + 16
    code, report = diff_json(ckpts, fp32, sharded, "--atol", 0)
    assert code == 1
    # The first element torch finds off, in row-major order, for each tensor.
    for d in report["differences"]:
        off = (exact[d["name"]] != exact[d["name"]].bfloat16().float()).view(-1).nonzero()
        assert d["index"] == off[0].item()
        assert f32(d["value_a"]) == exact[d["name"]].view(-1)[d["index"]].item()
    assert reshard.diff(fp32, sharded, rtol=2.0 ** -7).equal
    with pytest.raises(ValueError):
        reshard.diff(fp32, sharded, atol=-1.0)


def test_a_tolerance_must_be_finite_and_not_negative(ckpts):
    for bad in ("inf", "-1", "nan", "x"):
        r = run(ckpts.bin, "diff", ckpts.hf, ckpts.tp2, "--atol", bad)
        assert r.returncode == 2 and f"finite number >= 0, not {bad}" in r.stderr, r.stderr
        assert len(r.stderr) < 400, r.stderr


def test_unreadable_input_exits_2(ckpts, tmp_path):
    r = run(ckpts.bin, "diff", ckpts.hf, tmp_path / "nowhere")
    assert r.returncode == 2 and "nowhere" in r.stderr
    bad = tmp_path / "bad"
    shutil.copytree(ckpts.hf, bad)
    (bad / "model.safetensors").write_bytes(b"\xff" * 16)
    r = run(ckpts.bin, "diff", bad, ckpts.tp2)
    assert r.returncode == 2 and "model.safetensors" in r.stderr
    assert r.stdout == ""
    pt = tmp_path / "model.pt"
    pt.write_bytes(b"PK\x03\x04" + b"\0" * 60)  # a zip that is not one
    r = run(ckpts.bin, "diff", pt, ckpts.hf)
    assert r.returncode == 2 and "model.pt" in r.stderr
    with pytest.raises((reshard.CheckpointError, FileNotFoundError)):
        reshard.diff(ckpts.hf, tmp_path / "nowhere")


def test_a_torch_save_file_is_compared_as_its_state_dict(ckpts, tmp_path):
    """A .pt file's tensors by their dotted paths, whole, read without running its pickle: a
    tensor saved as a view with other strides (a transpose) compares by its values."""
    state = model()
    name = next(n for n, t in state.items() if t.dim() == 2 and t.shape[0] != t.shape[1])
    as_view = dict(state)
    as_view[name] = state[name].t().contiguous().t()  # the same values, column-major storage
    assert not as_view[name].is_contiguous()
    pt = tmp_path / "model.pt"
    torch.save(as_view, str(pt))
    code, report = diff_json(ckpts, pt, ckpts.tp4)
    assert code == 0 and report["tensors_compared"] == len(state), report
    changed = dict(as_view)
    changed[name] = as_view[name].clone()
    changed[name][1, 0] += 1
    torch.save(changed, str(tmp_path / "changed.pt"))
    code, report = diff_json(ckpts, ckpts.hf, tmp_path / "changed.pt")
    assert code == 1 and [d["name"] for d in report["differences"]] == [name]
    assert report["differences"][0]["multi_index"] == [1, 0]
    assert reshard.diff(tmp_path / "changed.pt", pt).differences[0].multi_index == (1, 0)
    r = run(ckpts.bin, "gather", pt, "-o", tmp_path / "out")  # whole tensors already
    assert r.returncode == 2 and "export" in r.stderr, r.stderr
    # An expanded view claims far more than its storage: refused, not allocated.
    torch.save({"big": torch.zeros(1).expand(2**30)}, str(tmp_path / "expanded.pt"))
    r = run(ckpts.bin, "diff", tmp_path / "expanded.pt", tmp_path / "expanded.pt")
    assert r.returncode == 2 and "storage's size plus 1 GiB" in r.stderr, r.stderr


def test_python_diff_returns_the_cli_report(ckpts, tmp_path):
    report = reshard.diff(ckpts.tp4, ckpts.hf)
    assert report.equal and report.tensors_compared == len(model())
    changed = ckpts.hf_with(tmp_path, changed_at("mlp.gate_up.weight", 100, -3.0))
    report = reshard.diff(ckpts.hf, changed)
    assert not report.equal
    (d,) = report.differences
    assert isinstance(d, reshard.TensorDifference)
    assert (d.name, d.kind, d.index, d.multi_index) == ("mlp.gate_up.weight", "value", 100, (6, 4))
    assert d.dtype_a == d.dtype_b == "BF16" and d.shape_a == (96, 16)
    assert f32(d.value_b) == -3.0
    _, cli = diff_json(ckpts, ckpts.hf, changed)
    assert cli["differences"][0]["value_a"] == d.value_a


def test_random_changes_match_torchs_comparison_of_the_full_tensors(ckpts, tmp_path, rng):
    tensors = model()
    names = sorted(tensors)
    for name in rng.sample(names, 3):
        flat = tensors[name].view(-1)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(flat.numel())
            flat[i] = flat[i] + rng.choice([1.0, -2.0, 0.5])
    changed = ckpts.hf_with(tmp_path, tensors)
    sharded = ckpts.scatter(changed, rng.choice([2, 4]), f"{tmp_path.name}-random")
    _, report = diff_json(ckpts, ckpts.tp4, sharded)
    got = {d["name"]: d for d in report["differences"]}
    a, b = load_file(str(ckpts.hf / "model.safetensors")), load_file(str(changed / "model.safetensors"))
    want = {}
    for name in names:
        off = (a[name] != b[name]).view(-1).nonzero()
        if len(off):
            want[name] = off[0].item()
    assert {n: d["index"] for n, d in got.items()} == want
    for name, d in got.items():
        assert f32(d["value_a"]) == a[name].view(-1)[d["index"]].item()
        assert f32(d["value_b"]) == b[name].view(-1)[d["index"]].item()


def test_dequantize_compares_an_fp8_checkpoint_with_its_numbers(ckpts, tmp_path):
    from quant_models import dequantize_fp8_reference, qwen3_fp8
    fp8 = qwen3_fp8(tmp_path / "fp8")
    tensors = load_file(str(fp8 / "model.safetensors"))
    numbers = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv")
        numbers[name] = t if scale is None else dequantize_fp8_reference(t, scale)
    source = ckpts.hf_with(tmp_path, numbers, "bf16")
    code, report = diff_json(ckpts, fp8, source, "--dequantize")
    assert code == 0, report
    # Without --dequantize: FP8 data against bf16 numbers, and the scales B lacks.
    code, report = diff_json(ckpts, fp8, source)
    kinds = {d["kind"] for d in report["differences"]}
    assert code == 1 and kinds == {"dtype", "missing"}
    name = "model.layers.0.mlp.down_proj.weight"
    numbers[name] = numbers[name].clone()
    numbers[name][3, 200] = 1.0
    changed = ckpts.hf_with(tmp_path, numbers, "changed")
    code, report = diff_json(ckpts, fp8, changed, "--dequantize")
    assert code == 1
    (d,) = report["differences"]
    assert (d["name"], d["index"], f32(d["value_b"])) == (name, 3 * 512 + 200, 1.0)
    assert reshard.diff(fp8, changed, dequantize=True).differences[0].index == 3 * 512 + 200
