"""The Python package's public API: maps and plans as objects, extract / rebuild / transfer on
torch tensors and numpy arrays of every dtype (bit for bit against DeepSpeed's affine.py),
out= in place, strided and offset inputs, the errors, checkpoints and the degree planner."""

import importlib
import json
import logging
import os
import pathlib
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch

logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
import deepspeed.checkpoint.affine as affine  # noqa: E402

import reshard  # noqa: E402
from maps import split_map  # noqa: E402
from torch_ref import random_tensor, to_bytes  # noqa: E402

TP = 4
DTYPES = ["F32", "BF16", "F16", "I8", "F8_E4M3", "F8_E5M2"]
NUMPY_DTYPES = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16, "I8": np.int8,
                "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def near_even(n, tp):
    return [n // tp + (1 if r < n % tp else 0) for r in range(tp)]


def ds_builders(tp):
    """One map from each of DeepSpeed's builders, every rank holding something."""
    q, kv = 32, 8
    return {
        "replicated": affine.replicated_map((24, 8), tp),
        "pre_divided": affine.replicated_map((16,), tp, scale=1.0 / tp),
        "split_rows": affine.contiguous_split_map((24, 8), near_even(24, tp), 0),
        "split_cols": affine.contiguous_split_map((8, 24), near_even(24, tp), 1),
        "sub_param": affine.sub_param_map((q + 2 * kv, 6), [q, kv, kv],
                                          [near_even(q, tp), near_even(kv, tp), near_even(kv, tp)], 0),
        "segmented": affine.segmented_map((48, 8), [(32, False), (16, True)], 0, tp,
                                          [near_even(32, tp)]),
        "block_gather": affine.block_gather_map((32, 8), {r: list(range(r, 8, tp)) for r in range(tp)},
                                                4, 0),
    }


def as_numpy(t):
    """A torch tensor's bits as a numpy array of the matching (ml_dtypes) dtype."""
    bits = t.contiguous().view(torch.uint8).numpy()
    return bits.view(NUMPY_DTYPES[{torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
                                   torch.int8: "I8", torch.float8_e4m3fn: "F8_E4M3",
                                   torch.float8_e5m2: "F8_E5M2"}[t.dtype]]).reshape(t.shape)


def np_bytes(a):
    return np.ascontiguousarray(a).tobytes()


@pytest.mark.parametrize("name", sorted(ds_builders(TP)))
def test_every_deepspeed_builders_map_round_trips_through_param_map(name):
    ds_map = ds_builders(TP)[name]
    pm = reshard.ParamMap.from_dict(ds_map.to_dict())
    back = affine.ParamAffineMap.from_dict(pm.to_dict())
    back.validate()
    assert back.to_dict() == ds_map.to_dict()
    assert reshard.ParamMap.from_json(pm.to_json()) == pm
    assert pm.logical_shape == tuple(ds_map.logical_shape) and pm.world_size == TP
    for r in range(TP):
        assert pm.shard_shape(r) == tuple(ds_map.shard_shapes[r])
        assert [(p.shape, p.source, p.locations) for p in pm.pieces(r)] == [
            (tuple(p.shape), (p.source_offset, tuple(p.source_strides)), tuple(sorted(p.locations)))
            for p in ds_map.pieces_by_rank[r]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_extract_rebuild_transfer_match_deepspeed_bit_for_bit(dtype, kind):
    gen = torch.Generator().manual_seed(DTYPES.index(dtype))
    for name, ds_map in ds_builders(TP).items():
        if dtype not in ("F32", "BF16", "F16") and name == "pre_divided":
            continue  # a scale on integers and fp8 is refused (tested below)
        pm = reshard.ParamMap.from_dict(ds_map.to_dict())
        full = random_tensor(dtype, ds_map.numel, gen).reshape(ds_map.logical_shape)
        theirs = [ds_map.extract(full, r) if dtype in ("F32", "BF16", "F16")
                  else ds_map.extract(full.view(torch.uint8), r).view(full.dtype) for r in range(TP)]
        given = full if kind == "torch" else as_numpy(full)
        ours = [reshard.extract(pm, given, r, allow_lossy_scale=True) for r in range(TP)]
        for r in range(TP):
            assert type(ours[r]) is type(given) and tuple(ours[r].shape) == pm.shard_shape(r)
            got = to_bytes(ours[r]) if kind == "torch" else np_bytes(ours[r])
            assert got == to_bytes(theirs[r]), f"{name} rank {r}"
        rebuilt = reshard.rebuild(pm, ours, allow_lossy_scale=True)
        assert type(rebuilt) is type(given)
        assert (to_bytes(rebuilt) if kind == "torch" else np_bytes(rebuilt)) == to_bytes(full), name
        # Transfer to the same layout at TP 2 equals DeepSpeed's extraction at TP 2.
        target = ds_builders(2)[name]
        plan = reshard.compose(source=pm, target=target.to_dict())
        moved = reshard.transfer(plan, dict(enumerate(ours)), allow_lossy_scale=True)
        for r in range(2):
            want = (target.extract(full, r) if dtype in ("F32", "BF16", "F16")
                    else target.extract(full.view(torch.uint8), r))
            got = to_bytes(moved[r]) if kind == "torch" else np_bytes(moved[r])
            assert got == to_bytes(want), f"{name} target rank {r}"


def test_out_is_written_in_place_and_returned():
    pm = reshard.ParamMap.from_dict(split_map([8, 6], 0, [4, 4]))
    full = torch.randn(8, 6).to(torch.bfloat16)
    out = torch.empty(4, 6, dtype=torch.bfloat16)
    ptr = out.data_ptr()
    assert reshard.extract(pm, full, 1, out=out) is out and out.data_ptr() == ptr
    assert torch.equal(out, full[4:])
    whole = np.empty((8, 6), dtype=np.float32)
    shards = [reshard.extract(pm, full.float().numpy(), r) for r in range(2)]
    assert reshard.rebuild(pm, shards, out=whole) is whole
    assert np.array_equal(whole, full.float().numpy())
    plan = reshard.compose(source=pm, target=split_map([8, 6], 0, [8]))
    targets = [torch.empty(8, 6, dtype=torch.bfloat16)]
    moved = reshard.transfer(plan, [full[:4], full[4:]], out=targets)
    assert moved[0] is targets[0] and torch.equal(targets[0], full)
    # A non-dense out= is filled through a temporary and still returned.
    strided = torch.zeros(6, 4, dtype=torch.bfloat16).t()
    assert reshard.extract(pm, full, 0, out=strided) is strided and torch.equal(strided, full[:4])


def vm_flags(address):
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                begin, end = (int(x, 16) for x in head.split("-"))
                inside = begin <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
                    reason="no transparent huge pages (Linux only)")
def test_large_new_torch_outputs_get_huge_page_advice():
    # 16 MiB of F32, two shards of 8 MiB: each new output is advised huge pages ("hg"), so it
    # faults in 2 MiB at a time; a plain torch.empty is not.
    pm = reshard.ParamMap.from_dict(split_map([2048, 2048], 0, [1024, 1024]))
    full = torch.randn(2048, 2048)
    shard = reshard.extract(pm, full, 1)
    whole = reshard.rebuild(pm, [full[:1024], shard])
    assert torch.equal(whole, full)
    for t in (shard, whole):
        assert "hg" in vm_flags(t.data_ptr() + t.numel() * t.element_size() // 2)
    plain = torch.empty(2048, 2048)
    assert "hg" not in vm_flags(plain.data_ptr() + plain.numel() * 2)


def test_strided_and_offset_inputs_read_the_right_elements():
    pm = reshard.ParamMap.from_dict(split_map([6, 4], 1, [2, 2]))
    want = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    backing = torch.full((7 + 24,), -1.0)
    backing[7:] = want.reshape(-1)
    inputs = {
        "offset view": backing[7:].view(6, 4),
        "transposed": want.t().contiguous().t(),
        "stepped": torch.stack([want, -want], dim=2)[:, :, 0],
        "numpy offset": backing.numpy()[7:].reshape(6, 4),
        "numpy negative strides": np.ascontiguousarray(want.numpy()[::-1, ::-1])[::-1, ::-1],
        "numpy fortran": np.asfortranarray(want.numpy()),
        "numpy big-endian": want.numpy().astype(">f4"),
    }
    for what, x in inputs.items():
        for r in range(2):
            got = reshard.extract(pm, x, r)
            assert np.array_equal(np.asarray(got), want[:, 2 * r:2 * r + 2].numpy()), (what, r)
    shards = [want[:, :2], want[:, 2:]]  # non-contiguous column slices
    assert torch.equal(reshard.rebuild(pm, shards), want)


def test_wrong_out_is_a_clear_value_error():
    pm = reshard.ParamMap.from_dict(split_map([8, 6], 0, [4, 4]))
    full = torch.randn(8, 6)
    cases = {
        "dtype": (torch.empty(4, 6, dtype=torch.float64), "dtype torch.float64"),
        "shape": (torch.empty(6, 4), r"shape \[6, 4\]; the map needs \[4, 6\]"),
        "device": (torch.empty(4, 6, device="meta"), "device meta"),
        "read-only": (np.zeros((4, 6), dtype=np.float32), "read-only"),
    }
    cases["read-only"][0].flags.writeable = False
    for _what, (out, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            reshard.extract(pm, full, 0, out=out)
    with pytest.raises(ValueError, match=r"full has shape \[48\]"):
        reshard.extract(pm, full.reshape(-1), 0)
    with pytest.raises(TypeError):
        reshard.extract(pm, [1.0] * 48, 0)
    with pytest.raises(ValueError, match="rank 1 has dtype"):
        reshard.rebuild(pm, [full[:4], full[4:].double()])
    with pytest.raises(ValueError, match="missing"):
        reshard.rebuild(pm, {0: full[:4]})


def test_scale_power_and_refused_scales():
    m = affine.replicated_map((8,), 2, scale=0.5).to_dict()
    full = torch.arange(8, dtype=torch.float32)
    assert torch.equal(reshard.extract(m, full, 0, scale_power=-2, allow_scaled_optimizer_state=True),
                       full * 4.0)
    with pytest.raises(ValueError, match="learning rate|epsilon"):
        reshard.extract(m, full, 0, scale_power=-1)
    with pytest.raises(ValueError):
        reshard.extract(m, full.to(torch.int8), 0)


def test_maps_plans_and_errors_are_objects():
    pm = reshard.ParamMap.from_dict(split_map([48, 8], 0, [12] * 4))
    assert "logical_shape=(48, 8)" in repr(pm) and "world_size=4" in repr(pm)
    assert pm.canonical() == pm and pm.validate() is None
    plan = reshard.compose(source=pm, target=split_map([48, 8], 0, [24, 24]))
    assert plan.to_dict()["moves"][0] == {"src_rank": 0, "dst_rank": 0, "shape": [96],
                                          "src": [0, [1]], "dst": [0, [1]]}
    assert plan.bytes_moved(torch.bfloat16) == plan.bytes_moved("BF16") == 48 * 8 * 2
    assert len(plan.moves) == 4 and plan.moves[1].dst == (96, (1,))
    with pytest.raises(reshard.MapError) as err:
        reshard.ParamMap.from_dict({"logical_shape": [4], "ranks": {"0": {"shard_shape": [4], "pieces": []}}})
    assert isinstance(err.value, ValueError) and err.value.code == "INVALID_ARGUMENT"
    with pytest.raises(reshard.MapError, match="different tensors"):
        reshard.compose(source=pm, target=split_map([48, 4], 0, [48]))
    doc = {"version": 1, "^a\\.b$": split_map([4], 0, [2, 2]), "c": split_map([4], 0, [4])}
    maps = reshard.read_maps(doc)
    assert list(maps) == ["a.b", "c"] and isinstance(maps["c"], reshard.ParamMap)
    assert reshard.read_maps(reshard.maps_to_json(maps)) == maps


def test_checkpoint_functions_mirror_the_cli(tmp_path):
    from safetensors.torch import load_file, save_file
    full_dir = tmp_path / "full"
    full_dir.mkdir()
    tensors = {"w": torch.randn(8, 4), "b": torch.randn(8)}
    save_file(tensors, str(full_dir / "model.safetensors"))
    maps = {"w": reshard.ParamMap.from_dict(split_map([8, 4], 0, [4, 4])), "b": split_map([8], 0, [4, 4])}
    seen = []
    reshard.checkpoint.scatter(full_dir, tmp_path / "tp2", maps=maps, progress=lambda d, t: seen.append((d, t)))
    assert seen and seen[-1][0] == seen[-1][1] > 0
    targets = {"w": split_map([8, 4], 0, [8]), "b": split_map([8], 0, [8])}
    reshard.checkpoint.convert(tmp_path / "tp2", tmp_path / "tp1", tp=1, target_maps=targets)
    reshard.checkpoint.gather(tmp_path / "tp1", tmp_path / "back")
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    with pytest.raises(reshard.CheckpointError, match="exists"):
        reshard.checkpoint.gather(tmp_path / "tp1", tmp_path / "back")
    with pytest.raises(FileNotFoundError):
        reshard.checkpoint.gather(tmp_path / "missing", tmp_path / "out")
    # sync=False (--no-sync; checkpoint_sync_test counts the fsync calls it saves): the same bytes.
    reshard.checkpoint.scatter(full_dir, tmp_path / "tp2-ns", maps=maps, sync=False)
    reshard.checkpoint.convert(tmp_path / "tp2-ns", tmp_path / "tp1-ns", tp=1,
                               target_maps=targets, sync=False)
    reshard.checkpoint.gather(tmp_path / "tp1-ns", tmp_path / "back-ns", sync=False)
    for a, b in (("tp2", "tp2-ns"), ("tp1", "tp1-ns"), ("back", "back-ns")):
        names = sorted(p.name for p in (tmp_path / a).iterdir())
        assert names == sorted(p.name for p in (tmp_path / b).iterdir())
        assert all((tmp_path / a / n).read_bytes() == (tmp_path / b / n).read_bytes() for n in names)
    report = reshard.checkpoint.inspect(tmp_path / "tp2")
    assert "w" in json.dumps(report)
    with pytest.raises(FileNotFoundError):
        reshard.checkpoint.inspect(tmp_path / "missing")


def test_inspect_is_the_library_report_without_the_cli(tmp_path, reshard_bin, monkeypatch):
    from safetensors.torch import save_file
    (tmp_path / "full").mkdir()
    save_file({"w": torch.randn(8, 4)}, str(tmp_path / "full" / "model.safetensors"))
    torch.save({"w": torch.randn(3), "step": 7}, tmp_path / "state.pt")
    reshard.checkpoint.scatter(tmp_path / "full", tmp_path / "tp2",
                               maps={"w": split_map([8, 4], 0, [4, 4])})
    (tmp_path / "bad.safetensors").write_bytes(b"\x10" + b"\x00" * 7 + b"{")
    cli = {}
    for name in ("full/model.safetensors", "state.pt", "tp2"):
        r = subprocess.run([reshard_bin, "inspect", str(tmp_path / name), "--json"],
                           capture_output=True, text=True, check=True)
        cli[name] = json.loads(r.stdout)
    r = subprocess.run([reshard_bin, "inspect", str(tmp_path / "bad.safetensors")],
                       capture_output=True, text=True)
    cli_error = r.stderr.strip().removeprefix("reshard inspect: ")

    def no_cli():
        raise AssertionError("inspect ran the CLI")
    monkeypatch.setattr(importlib.import_module("reshard._cli"), "binary", no_cli)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: no_cli())
    for name, want in cli.items():
        assert reshard.checkpoint.inspect(tmp_path / name) == want, name
    with pytest.raises(reshard.CheckpointError) as err:
        reshard.checkpoint.inspect(tmp_path / "bad.safetensors")
    assert str(err.value) == cli_error and err.value.code == "DATA_LOSS"
    with pytest.raises(FileNotFoundError):
        reshard.checkpoint.inspect(tmp_path / "missing")


def test_degree_returns_a_typed_report(tmp_path):
    config = {"model_type": "llama", "num_attention_heads": 12, "num_key_value_heads": 4,
              "hidden_size": 768, "intermediate_size": 2048, "vocab_size": 32000,
              "num_hidden_layers": 2}
    report = reshard.degree(config)
    assert report.ok and report.max_tp_degree == 4 and report.degrees == [1, 2, 4]
    assert any(c.meaning == "key/value heads" and c.count == 4 for c in report.constraints)
    refused = reshard.degree(config, tp=3)
    assert not refused.ok and refused.requested == 3 and "3" in refused.refusal
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert reshard.degree(path, tp=2).chosen == 2
    with pytest.raises(FileNotFoundError):
        reshard.degree(tmp_path / "missing.json")
    path.write_text("{")
    with pytest.raises(reshard.DegreeError):
        reshard.degree(path)


def test_degree_takes_the_distributed_config(tmp_path):
    from transformers.distributed.configuration_utils import DistributedConfig
    configs = pathlib.Path(__file__).resolve().parents[1] / "data" / "hf-configs"
    smol = configs / "HuggingFaceTB--SmolLM2-135M.printout.json"  # 9 attention heads
    report = reshard.degree(smol, distributed_config={"tp_size": 3})
    assert report.ok and report.requested == report.chosen == 3
    refused = reshard.degree(smol, distributed_config=DistributedConfig(tp_size=2))
    assert not refused.ok and refused.requested == 2 and "9 attention heads" in refused.refusal
    path = tmp_path / "dist.json"
    path.write_text(json.dumps({"tp_size": 3, "pp_size": 1}))
    assert reshard.degree(smol, tp=3, distributed_config=path).chosen == 3
    with pytest.raises(reshard.DegreeError, match=r'unknown key\(s\) "tp_sise"'):
        reshard.degree(smol, distributed_config={"tp_size": 3, "tp_sise": 4})
    with pytest.raises(reshard.DegreeError, match="tp 3 and the distributed config's tp_size 9"):
        reshard.degree(smol, tp=3, distributed_config={"tp_size": 9})
    # Expert parallelism answers for the model's expert-parallel plan: 8 experts bind.
    mixtral = configs / "mistralai--Mixtral-8x7B-v0.1.json"
    tp_only = reshard.degree(mixtral, tp=8)
    with_ep = reshard.degree(mixtral, distributed_config={"tp_plan": "auto", "ep_size": 8},
                             tp=8)
    assert with_ep.ok and with_ep.requested == 8
    # The deprecated flag alone empties the TP plan, which transformers 5.24 refuses at tp 8.
    legacy = reshard.degree(mixtral, distributed_config={"tp_size": 8,
                                                         "enable_expert_parallel": True})
    assert not legacy.ok and legacy.refusal_reason == "distributed_config"
    assert "experts" in [c.meaning for c in with_ep.constraints]
    assert "experts" not in [c.meaning for c in tp_only.constraints]


def test_python_dash_m_runs_the_cli():
    r = subprocess.run([sys.executable, "-m", "reshard", "--version"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0 and r.stdout.strip() == f"reshard {reshard.__version__}"
    r = subprocess.run([sys.executable, "-m", "reshard", "verify", "/nonexistent.json"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 2 and "nonexistent" in r.stderr
