"""Real DeepSpeed training checkpoints (ds_checkpoints.py) read by reshard.

The CI matrix, CI_SPECS, is three torchrun launches (TP 2 x DP 2, TP 4 x DP 1, TP 1 x DP 3)
that together cover the three model families, ZeRO stages 0-3, fp32 and bf16, the uneven
vocabulary at TP 4, checkpoints without AutoTP, ZeRO's padding (DP 3, vocabulary 251) and
q/k/v projections cut per sub-parameter (llama_subparams). RESHARD_DS_MATRIX=full runs every family,
stage and dtype at TP 1/2/4 x DP 1/2 (many minutes).

- `reshard inspect SAVE_DIR --json` lists every file of the tag dir `latest` names, and every
  tensor of each file under the dotted name, dtype, shape, strides, storage offset and storage
  that torch.load gives it.
- The reference the fixture records is what the files hold: each TP rank's module weights equal
  the `module` of mp_rank_XX_model_states.pt, and DeepSpeed's own affine map in the file
  rebuilds the full weights from them.
- The ZeRO layouts docs/deepspeed_checkpoints.md describes hold: the flat fp32 partitions of
  stages 1-2 (padding left out of the last one) and the per-parameter slices of stage 3 give
  back each TP rank's module weights.
- A fresh engine of the same topology that loads the checkpoint, from its own files or from
  ds_to_universal's output, takes exactly the next-step loss the training run recorded.
- ds_to_universal converts what it converts into full fp32 states equal to the module weights,
  in the files and dict keys the facts list, and refuses stage 0 and TP 1 below stage 3 with
  the messages they record.
"""

import itertools
import json
import os
import re
import subprocess

import pytest
import torch

from ds_checkpoints import Spec, UniversalRefused, ds_to_universal, universal_accepts

CI_SPECS = [
    Spec("llama", tp=2, dp=2, stage=1),
    Spec("qwen2", tp=2, dp=2, stage=2, dtype="bfloat16"),
    Spec("mistral", tp=2, dp=2, stage=3),
    Spec("llama", tp=2, dp=2, stage=0, dtype="bfloat16"),
    Spec("llama", tp=4, dp=1, stage=1, dtype="bfloat16"),
    Spec("qwen2", tp=4, dp=1, stage=3, dtype="bfloat16"),
    Spec("llama", tp=1, dp=3, stage=2, vocab=251),
    Spec("llama", tp=1, dp=3, stage=3, dtype="bfloat16", vocab=251),
    Spec("qwen2", tp=1, dp=3, stage=1, vocab=251),
    Spec("llama_subparams", tp=2, dp=2, stage=2),
]
FULL_SPECS = [Spec(f, tp=tp, dp=dp, stage=stage, dtype=dtype)
              for f, tp, dp, stage, dtype in itertools.product(
                  ("llama", "qwen2", "mistral"), (1, 2, 4), (1, 2), (0, 1, 2, 3),
                  ("float32", "bfloat16"))]
SPECS = FULL_SPECS if os.environ.get("RESHARD_DS_MATRIX") == "full" else CI_SPECS

DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
          torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}


@pytest.fixture(scope="module")
def checkpoints(ds_checkpoint):
    ds_checkpoint.prepare(SPECS)
    return ds_checkpoint


def torch_tensors(obj, prefix=""):
    """Every tensor in a torch.load result under its dotted path of dict keys and list/tuple
    indices, as reshard names them."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from torch_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from torch_tensors(v, f"{prefix}.{i}" if prefix else str(i))


def torch_listing(path):
    """{name: (dtype, shape, strides, storage offset, storage group)} as torch.load reads the
    file; tensors over one storage share a group number. Empty storages have no address to
    tell them apart by (ZeRO-3 leaves every module weight empty), so they get no group."""
    groups = {}
    out = {}
    for name, t in torch_tensors(torch.load(path, map_location="cpu", weights_only=False)):
        storage = t.untyped_storage()
        group = groups.setdefault(storage.data_ptr(), len(groups)) if storage.nbytes() else None
        out[name] = (DTYPES[t.dtype], list(t.shape), list(t.stride()), t.storage_offset(), group)
    return out


def reshard_listing(contents):
    groups = {}
    out = {}
    sizes = {s["key"]: s["bytes"] for s in contents["storages"]}
    for t in contents["tensors"]:
        group = groups.setdefault(t["storage"], len(groups)) if sizes[t["storage"]] else None
        out[t["name"]] = (t["dtype"], t["shape"], t["strides"], t["storage_offset"], group)
    return out


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_inspect_lists_every_file_and_tensor_as_torch_loads_them(checkpoints, spec, reshard_bin):
    ckpt = checkpoints(spec)
    r = subprocess.run([reshard_bin, "inspect", str(ckpt.save_dir), "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    listing = json.loads(r.stdout)
    assert listing["deepspeed_tag"] == ckpt.tag
    on_disk = sorted(p.name for p in ckpt.tag_dir.glob("*.pt"))
    assert [f["file"] for f in listing["files"]] == on_disk
    assert listing["other_files"] == []
    for f in listing["files"]:
        expected = torch_listing(ckpt.tag_dir / f["file"])
        assert expected, f["file"]
        assert reshard_listing(f["contents"]) == expected, f["file"]


def model_states(ckpt, tp_rank):
    name = (f"zero_pp_rank_0_mp_rank_{tp_rank:02d}_model_states.pt" if ckpt.spec.stage == 3
            else f"mp_rank_{tp_rank:02d}_model_states.pt")
    return torch.load(ckpt.tag_dir / name, map_location="cpu", weights_only=False)


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("spec", [s for s in SPECS if s.stage != 3], ids=lambda s: s.name)
def test_reference_module_weights_are_the_saved_ones(checkpoints, spec):
    ckpt = checkpoints(spec)
    for tp_rank in range(spec.tp):
        saved = model_states(ckpt, tp_rank)["module"]
        reference = ckpt.module(tp_rank)
        assert sorted(saved) == sorted(reference)
        for name, tensor in reference.items():
            assert same_bits(saved[name], tensor), (tp_rank, name)


@pytest.mark.parametrize("spec", [s for s in SPECS if s.tp > 1], ids=lambda s: s.name)
def test_the_affine_map_in_the_checkpoint_rebuilds_the_full_weights(checkpoints, spec):
    import deepspeed.checkpoint.affine as affine

    ckpt = checkpoints(spec)
    params = model_states(ckpt, 0)["universal_checkpoint_info"]["affine_map"]["params"]
    shards = [ckpt.module(r) for r in range(spec.tp)]
    full = ckpt.full()
    assert sorted(full) == sorted(shards[0])
    for name, whole in full.items():
        matches = [p for p in params if re.match(p, name)]
        assert len(matches) == 1, (name, matches)
        ds_map = affine.ParamAffineMap.from_dict(params[matches[0]])
        rebuilt = ds_map.rebuild({r: shards[r][name] for r in range(spec.tp)})
        assert same_bits(rebuilt.reshape(whole.shape).to(whole.dtype), whole), name


def optim_states(ckpt, tp_rank, dp_rank):
    prefix = "bf16_" if ckpt.spec.dtype == "bfloat16" else ""
    name = f"{prefix}zero_pp_rank_{dp_rank}_mp_rank_{tp_rank:02d}_optim_states.pt"
    path = ckpt.tag_dir / name
    return torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]


def zero12_params(ckpt, tp_rank, shapes):
    """The parameters of one TP rank from the flat fp32 partitions of ZeRO 1/2: the
    concatenation over DP ranks is the parameters in order, then the padding (which the last
    rank's fp32 partition leaves out, and its moments keep)."""
    states = [optim_states(ckpt, tp_rank, d) for d in range(ckpt.spec.dp)]
    flat = torch.cat([s["single_partition_of_fp32_groups"][0] for s in states])
    part = states[0]["base_optimizer_state"]["state"][0]["exp_avg"].numel()
    assert [s["group_paddings"][0] for s in states[:-1]] == [0] * (ckpt.spec.dp - 1)
    assert flat.numel() == ckpt.spec.dp * part - states[-1]["group_paddings"][0]
    for d, s in enumerate(states):  # each fragment where the running offset says
        for name, frag in s["param_slice_mappings"][0].items():
            assert 0 <= frag.start and frag.start + frag.numel <= part, (d, name)
    out, offset = {}, 0
    for name, shape in shapes.items():
        out[name] = flat[offset:offset + shape.numel()].reshape(shape)
        offset += shape.numel()
    assert offset == flat.numel()
    return out


def zero3_params(ckpt, tp_rank, shapes):
    """ZeRO 3: each parameter takes ceil(n / DP) elements on every DP rank, in order; the
    parameter is the concatenation over DP ranks, cut to n."""
    dp = ckpt.spec.dp
    flats = [optim_states(ckpt, tp_rank, d)["fp32_flat_groups"][0] for d in range(dp)]
    out, offset = {}, 0
    for name, shape in shapes.items():
        part = -(-shape.numel() // dp)
        whole = torch.cat([f[offset:offset + part] for f in flats])
        out[name] = whole[:shape.numel()].reshape(shape)
        offset += part
    assert all(f.numel() == offset for f in flats)
    return out


@pytest.mark.parametrize("spec", [s for s in SPECS if s.stage > 0], ids=lambda s: s.name)
def test_zero_partitions_hold_the_module_weights(checkpoints, spec):
    ckpt = checkpoints(spec)
    for tp_rank in range(spec.tp):
        shapes = model_states(ckpt, tp_rank)["param_shapes"][0]
        params = (zero3_params if spec.stage == 3 else zero12_params)(ckpt, tp_rank, shapes)
        reference = ckpt.module(tp_rank)
        assert sorted(params) == sorted(reference)
        for name, master in params.items():
            assert same_bits(master.to(reference[name].dtype), reference[name]), (tp_rank, name)


def universal_refusal(spec):
    """What ds_to_universal says of a spec, None when it converts it."""
    if spec.stage == 0:
        return "FileNotFoundError: can't find *_optim_states.pt files"
    if not universal_accepts(spec):
        return "AssertionError: Required universal_checkpoint_info state is missing"
    return None


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_ds_to_universal_writes_full_fp32_states_or_refuses(checkpoints, spec, tmp_path):
    ckpt = checkpoints(spec)
    refusal = universal_refusal(spec)
    if refusal:
        with pytest.raises(UniversalRefused, match=re.escape(refusal)):
            ds_to_universal(ckpt, tmp_path)
        return
    out = ds_to_universal(ckpt, tmp_path)
    assert (tmp_path / "latest_universal").read_text() == out.name
    copied = sorted(p.name for p in out.glob("*.pt"))
    assert copied == sorted(p.name for p in ckpt.tag_dir.glob("*model_states.pt"))
    for name in copied:
        assert (out / name).read_bytes() == (ckpt.tag_dir / name).read_bytes(), name
    full = ckpt.full()
    assert sorted(p.name for p in (out / "zero").iterdir()) == sorted([*full, "optimizer_state.pt"])
    states = ["exp_avg.pt", "exp_avg_sq.pt", "fp32.pt"] + (["step.pt"] if spec.stage < 3 else [])
    # AutoTP splits lm_head by vocabulary; its llama preset (llama_subparams) keeps it whole.
    vocab = set() if spec.family == "llama_subparams" else {"lm_head.weight"}
    for name, weight in full.items():
        folder = out / "zero" / name
        assert sorted(p.name for p in folder.iterdir()) == states, name
        if spec.tp == 1:  # ZeRO 3 without AutoTP: bare flat tensors, not dicts
            fp32 = {"param": torch.load(folder / "fp32.pt", weights_only=True)}
            assert fp32["param"].shape == (weight.numel(),), name
            shape = fp32["param"].shape
        else:
            fp32 = torch.load(folder / "fp32.pt", weights_only=True)
            assert list(fp32) == (["vocab_tensor", "param"] if name in vocab else ["param"])
            assert fp32["param"].shape == weight.shape, name
            shape = weight.shape
        assert fp32["param"].dtype == torch.float32
        assert same_bits(fp32["param"].to(weight.dtype).reshape(weight.shape), weight), name
        for moment in ("exp_avg.pt", "exp_avg_sq.pt"):
            state = torch.load(folder / moment, weights_only=True)
            assert (state if spec.tp == 1 else state["param"]).shape == shape, (name, moment)
        if spec.stage < 3:
            step = torch.load(folder / "step.pt", weights_only=True)
            assert step.dtype == torch.float32 and step.item() == spec.steps


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_deepspeed_resumes_with_the_recorded_next_loss(checkpoints, spec):
    ckpt = checkpoints(spec)
    assert sorted(ckpt.next_loss) == list(range(spec.dp))
    assert ckpt.resumed_next_loss("own") == ckpt.next_loss
    if universal_accepts(spec):
        assert ckpt.resumed_next_loss("universal") == ckpt.next_loss
