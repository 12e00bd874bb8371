"""Buffers (DESIGN 16): rank tensors that hold pieces of many checkpoint tensors.

The expectations are written with torch's own slicing and stacking (what transformers and vLLM
do when they fuse): an MoE layer's per-expert gate and up rows stacked into one `gate_up_proj`
per rank, experts placed over EP ranks, and q/k/v rows into one `qkv_proj`. reshard must
produce exactly those rank tensors from the per-expert checkpoint through maps over buffers,
give the checkpoint back, and move between topologies buffer to buffer.
"""

import json
import subprocess

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import reshard
from maps import stacked_expert_maps

E, INTER, HIDDEN = 6, 4, 3


def gate_up_maps(placement, tp=1, buffer="mlp.experts.gate_up_proj", dtype="F32"):
    """Per-expert gate [I, H] and up [I, H] of each expert stacked into `buffer`
    [len(experts on the rank), 2I/tp, H]: the rank's gate rows then its up rows, rank order
    ep_rank * tp + tp_rank. `placement[k]`: EP rank k's experts in slot order."""
    members = [(f"mlp.experts.{{e}}.{m}.weight", [INTER, HIDDEN]) for m in ("gate_proj", "up_proj")]
    return stacked_expert_maps(placement, members, tp, buffer, dtype)


def expected_gate_up(weights, placement, tp=1):
    """What each rank holds, by torch: experts stacked, gate rows then up rows of the TP slice."""
    part = INTER // tp
    out = {}
    for k, experts in enumerate(placement):
        for t in range(tp):
            rows = [torch.cat([weights[f"mlp.experts.{e}.gate_proj.weight"][t * part:(t + 1) * part],
                               weights[f"mlp.experts.{e}.up_proj.weight"][t * part:(t + 1) * part]])
                    for e in experts]
            out[k * tp + t] = (torch.stack(rows) if rows
                               else torch.zeros(0, 2 * part, HIDDEN, dtype=torch.float32))
    return out


@pytest.fixture
def weights():
    g = torch.Generator().manual_seed(7)
    return {f"mlp.experts.{e}.{m}.weight": torch.randn(INTER, HIDDEN, generator=g)
            for e in range(E) for m in ("gate_proj", "up_proj")}


EP2 = [[0, 1, 2], [3, 4, 5]]
EP3_ROUND_ROBIN = [[0, 3], [1, 4], [2, 5]]
EPLB = [[0, 1, 2, 5], [3, 4, 5, 0]]  # experts 0 and 5 have a redundant copy


@pytest.mark.parametrize("placement,tp", [(EP2, 1), (EP3_ROUND_ROBIN, 1), (EPLB, 1), (EP2, 2)])
def test_extract_fills_each_buffer_as_torch_stacks_it(weights, placement, tp):
    maps, decls = gate_up_maps(placement, tp)
    buffers = reshard.BufferSet(decls, maps)
    want = expected_gate_up(weights, placement, tp)
    for r, expected in want.items():
        out = buffers.empty(r)["mlp.experts.gate_up_proj"]
        for name in buffers.tensors_of("mlp.experts.gate_up_proj", r):
            reshard.extract(buffers.maps[name], weights[name], r, out=out)
        assert torch.equal(out, expected)
        # Without out=, each tensor's extract is its part of a zeroed buffer.
        one = reshard.extract(maps["mlp.experts.0.up_proj.weight"], weights["mlp.experts.0.up_proj.weight"], r)
        assert one.shape == expected.shape
        assert torch.count_nonzero(one) <= INTER * HIDDEN // tp
    # Rebuild from the buffers gives each tensor back (replicas compared).
    for name, m in buffers.maps.items():
        assert torch.equal(reshard.rebuild(m, [want[r] for r in range(len(want))]), weights[name])


def test_numpy_buffers_match_torch(weights):
    maps, decls = gate_up_maps(EP2)
    buffers = reshard.BufferSet(decls, maps)
    want = expected_gate_up(weights, EP2)
    out = buffers.empty(1, like=np.zeros(1, np.float32))["mlp.experts.gate_up_proj"]
    assert isinstance(out, np.ndarray)
    for name in buffers.tensors_of("mlp.experts.gate_up_proj", 1):
        reshard.extract(maps[name], weights[name].numpy(), 1, out=out)
    assert np.array_equal(out, want[1].numpy())


def test_transfer_moves_between_expert_topologies_buffer_to_buffer(weights):
    src_maps, _ = gate_up_maps(EP2)
    dst_maps, _ = gate_up_maps(EP3_ROUND_ROBIN, tp=2)
    src = expected_gate_up(weights, EP2)
    want = expected_gate_up(weights, EP3_ROUND_ROBIN, tp=2)
    outs = [torch.full_like(want[r], float("nan")) for r in range(len(want))]
    for name in src_maps:
        plan = reshard.compose(source=src_maps[name], target=dst_maps[name])
        reshard.transfer(plan, [src[r] for r in range(len(src))], out=outs)
    for r, expected in want.items():
        assert torch.equal(outs[r], expected), f"rank {r}"


def test_a_missing_or_doubled_writer_is_named(weights):
    maps, decls = gate_up_maps(EP2)
    del maps["mlp.experts.4.up_proj.weight"]
    with pytest.raises(reshard.MapError, match=r'buffers\["mlp.experts.gate_up_proj"\]\.ranks\["1"\]: '
                                               r"element \[1, 4, 0\].*written by no map"):
        reshard.BufferSet(decls, maps)
    maps, decls = gate_up_maps(EP2)
    maps["mlp.experts.4.up_proj.weight"] = maps["mlp.experts.4.gate_proj.weight"]
    with pytest.raises(reshard.MapError, match=r"written by params\[\"mlp.experts.4.gate_proj.weight\"\]"):
        reshard.BufferSet(decls, maps)
    maps, decls = gate_up_maps(EP2)
    decls["mlp.experts.gate_up_proj"]["dtype"] = "F16"
    with pytest.raises(reshard.MapError):
        reshard.BufferSet({"other": decls["mlp.experts.gate_up_proj"]}, maps)


def test_buffered_documents_round_trip(tmp_path, weights):
    maps, decls = gate_up_maps(EPLB)
    buffers = reshard.BufferSet(decls, maps)
    text = buffers.to_json()
    assert json.loads(text)["version"] == 2
    back = reshard.read_buffers(text)
    assert back is not None and back.to_dict() == buffers.to_dict()
    assert {n: m.to_dict() for n, m in reshard.read_maps(text).items()} == \
        {n: reshard.ParamMap.from_dict(m).to_dict() for n, m in maps.items()}
    whole = {"logical_shape": [4, 3], "ranks": {"0": {"shard_shape": [4, 3], "pieces": [
        {"shape": [4, 3], "source": [0, [3, 1]], "dest": [0, [3, 1]], "locations": [0]}]}}}
    assert reshard.read_buffers(reshard.maps_to_json({"w": whole})) is None


def run(*args):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True)


def test_checkpoint_scatter_gather_convert_through_buffers(tmp_path, reshard_bin, weights):
    full = tmp_path / "full"
    full.mkdir()
    save_file(weights, str(full / "model.safetensors"))
    maps, decls = gate_up_maps(EP2)
    doc = tmp_path / "ep2.json"
    doc.write_text(reshard.BufferSet(decls, maps).to_json())
    assert run(reshard_bin, "verify", doc).returncode == 0

    sharded = tmp_path / "ep2"
    r = run(reshard_bin, "scatter", full, "--maps", doc, "-o", sharded)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((sharded / "reshard.json").read_text())
    assert manifest["version"] == 2 and "mlp.experts.gate_up_proj" in manifest["buffers"]
    want = expected_gate_up(weights, EP2)
    for rank in range(2):
        held = load_file(str(sharded / f"model-rank-{rank}-part-0.safetensors"))
        assert set(held) == {"mlp.experts.gate_up_proj"}  # the buffer, not per-expert tensors
        assert torch.equal(held["mlp.experts.gate_up_proj"], want[rank])

    gathered = tmp_path / "gathered"
    r = run(reshard_bin, "gather", sharded, "-o", gathered)
    assert r.returncode == 0, r.stderr
    back = load_file(str(gathered / "model.safetensors"))
    assert set(back) == set(weights) and all(torch.equal(back[n], weights[n]) for n in weights)

    # EP 2 -> EP 3 (round robin) x expert TP 2: six ranks, straight from buffer to buffer.
    target_maps, target_decls = gate_up_maps(EP3_ROUND_ROBIN, tp=2)
    target = tmp_path / "ep3tp2.json"
    target.write_text(reshard.BufferSet(target_decls, target_maps).to_json())
    converted = tmp_path / "ep3tp2"
    r = run(reshard_bin, "convert", sharded, "--tp", 6, "--target-maps", target, "-o", converted)
    assert r.returncode == 0, r.stderr
    want = expected_gate_up(weights, EP3_ROUND_ROBIN, tp=2)
    for rank in range(6):
        held = load_file(str(converted / f"model-rank-{rank}-part-0.safetensors"))
        assert torch.equal(held["mlp.experts.gate_up_proj"], want[rank]), rank

    r = run(reshard_bin, "inspect", converted, "--json")
    assert r.returncode == 0, r.stderr

    # A corrupt buffer in the files is found: a rank file's buffer of the wrong shape.
    bad = tmp_path / "bad"
    r = run(reshard_bin, "scatter", full, "--maps", doc, "-o", bad)
    held = load_file(str(bad / "model-rank-1-part-0.safetensors"))
    save_file({"mlp.experts.gate_up_proj": held["mlp.experts.gate_up_proj"][:2]},
              str(bad / "model-rank-1-part-0.safetensors"))
    r = run(reshard_bin, "gather", bad, "-o", tmp_path / "bad_out")
    assert r.returncode == 2, r.stderr
    assert 'tensor of buffer "mlp.experts.gate_up_proj" has shape [2, 8, 3]' in r.stderr, r.stderr
    assert not (tmp_path / "bad_out").exists()


def test_adams_moments_over_buffered_maps_go_into_buffers_of_their_own(tmp_path, reshard_bin,
                                                                         weights):
    # The checkpoint holds each expert's moments beside its weights; the map document names the
    # weights only, so each moment takes its parameter's map, into "<buffer>.exp_avg".
    g = torch.Generator().manual_seed(8)
    moments = {f"{n}.{s}": torch.randn(INTER, HIDDEN, generator=g).abs()
               for n in weights for s in ("exp_avg", "exp_avg_sq")}
    full = tmp_path / "full"
    full.mkdir()
    save_file({**weights, **moments}, str(full / "model.safetensors"))
    maps, decls = gate_up_maps(EP2)
    doc = tmp_path / "ep2.json"
    doc.write_text(reshard.BufferSet(decls, maps).to_json())
    sharded = tmp_path / "ep2"
    r = run(reshard_bin, "scatter", full, "--maps", doc, "-o", sharded)
    assert r.returncode == 0, r.stderr
    want = expected_gate_up(weights, EP2)
    for suffix in ("exp_avg", "exp_avg_sq"):
        want_state = expected_gate_up(
            {n: moments[f"{n}.{suffix}"] for n in weights}, EP2)
        for rank in range(2):
            held = load_file(str(sharded / f"model-rank-{rank}-part-0.safetensors"))
            assert set(held) == {"mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj.exp_avg",
                                 "mlp.experts.gate_up_proj.exp_avg_sq"}
            assert torch.equal(held["mlp.experts.gate_up_proj"], want[rank])
            assert torch.equal(held[f"mlp.experts.gate_up_proj.{suffix}"], want_state[rank])
    r = run(reshard_bin, "gather", sharded, "-o", tmp_path / "back")
    assert r.returncode == 0, r.stderr
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    want = {**weights, **moments}
    assert set(back) == set(want) and all(torch.equal(back[n], t) for n, t in want.items())


def test_scatter_refuses_maps_that_leave_a_buffer_unwritten(tmp_path, reshard_bin, weights):
    full = tmp_path / "full"
    full.mkdir()
    del weights["mlp.experts.5.gate_proj.weight"]
    save_file(weights, str(full / "model.safetensors"))
    maps, decls = gate_up_maps(EP2)
    doc = {"version": 2, "buffers": decls, **{n: m for n, m in maps.items()
                                              if n != "mlp.experts.5.gate_proj.weight"}}
    path = tmp_path / "maps.json"
    path.write_text(json.dumps(doc))
    r = run(reshard_bin, "verify", path)
    assert r.returncode == 1 and "written by no map" in r.stderr + r.stdout
    r = run(reshard_bin, "scatter", full, "--maps", path, "-o", tmp_path / "out")
    assert r.returncode == 1 and "written by no map" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_constant_buffers_hold_their_fill_and_model_files_are_copied(tmp_path, reshard_bin):
    # q [4, 2] split by rows over 2 ranks into "qkv" [3, 2] (one padding row per rank), and a
    # scalar that no checkpoint has, 1 on every rank (vLLM's attention scale `_k_scale`).
    full = tmp_path / "full"
    full.mkdir()
    q = torch.arange(8, dtype=torch.float32).reshape(4, 2) + 1
    save_file({"q": q}, str(full / "model.safetensors"))
    (full / "config.json").write_text('{"model_type": "llama"}')
    (full / "tokenizer.json").write_text('{"version": "1.0"}')
    (full / "notes.txt").write_text("not a model file")
    qmap = {"logical_shape": [4, 2], "ranks": {str(r): {
        "buffer": "qkv", "shard_shape": [3, 2],
        "pieces": [{"shape": [2, 2], "source": [4 * r, [2, 1]], "dest": [0, [2, 1]],
                    "locations": [r]}]} for r in range(2)}}
    pad = {"shape": [2], "view": [4, [1]]}
    decls = {"qkv": {"dtype": "F32", "ranks": {str(r): {"shape": [3, 2], "padding": [pad]}
                                               for r in range(2)}},
             "attn._k_scale": {"dtype": "F32", "fill": 1.0, "ranks": {
                 str(r): {"shape": [], "padding": [{"shape": [], "view": [0, []]}]}
                 for r in range(2)}}}
    buffers = reshard.BufferSet(decls, {"q": qmap})
    assert buffers["attn._k_scale"].fill == 1.0 and buffers["qkv"].fill == 0.0
    assert float(buffers.empty(1)["attn._k_scale"]) == 1.0
    doc = tmp_path / "maps.json"
    doc.write_text(buffers.to_json())
    assert json.loads(doc.read_text())["buffers"]["attn._k_scale"]["fill"] == 1.0

    out = tmp_path / "out"
    r = run(reshard_bin, "scatter", full, "--maps", doc, "-o", out)
    assert r.returncode == 0, r.stderr
    for rank in range(2):
        held = load_file(str(out / f"model-rank-{rank}-part-0.safetensors"))
        assert set(held) == {"qkv", "attn._k_scale"}
        assert held["attn._k_scale"].shape == () and float(held["attn._k_scale"]) == 1.0
        assert torch.equal(held["qkv"], torch.cat([q[2 * rank:2 * rank + 2], torch.zeros(1, 2)]))
    assert (out / "config.json").read_text() == '{"model_type": "llama"}'
    assert (out / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert not (out / "notes.txt").exists()
    # convert carries the constant and the model's files on.
    again = tmp_path / "again"
    r = run(reshard_bin, "convert", out, "--tp", 2, "--target-maps", doc, "-o", again)
    assert r.returncode == 0, r.stderr
    held = load_file(str(again / "model-rank-1-part-0.safetensors"))
    assert float(held["attn._k_scale"]) == 1.0
    assert (again / "config.json").read_text() == '{"model_type": "llama"}'

    # A fill the dtype cannot hold exactly is refused when the document is read.
    decls["attn._k_scale"]["dtype"] = "BF16"
    decls["attn._k_scale"]["fill"] = 0.1
    with pytest.raises(reshard.MapError, match=r'fill: 0.1 is not exactly a BF16 value'):
        reshard.BufferSet(decls, {"q": qmap})


def qkv_buffer(**fields):
    """One buffer "B" [3, 2] over 2 ranks, q's rows 2r..2r+1 then a padding row, as a Buffer."""
    pad = (reshard.Block((2,), (4, (1,))),)
    b = dict(name="B", dtype="F32", shapes=((3, 2), (3, 2)), padding=(pad, pad))
    b.update(fields)
    return reshard.Buffer(**b)


def q_into_b():
    return {"q": {"logical_shape": [4, 2], "ranks": {str(r): {
        "buffer": "B", "shard_shape": [3, 2],
        "pieces": [{"shape": [2, 2], "source": [4 * r, [2, 1]], "dest": [0, [2, 1]],
                    "locations": [r]}]} for r in range(2)}}}


@pytest.mark.parametrize("build, error, message", [
    (lambda: reshard.BufferSet([qkv_buffer(), qkv_buffer()], q_into_b()), reshard.MapError,
     r'buffers: "B" is declared twice'),
    (lambda: reshard.BufferSet([qkv_buffer(padding=(qkv_buffer().padding[0],))], q_into_b()),
     reshard.MapError, r'buffers\["B"\]: padding has 1 entries for 2 ranks'),
    (lambda: reshard.BufferSet([qkv_buffer()], q_into_b()).empty(-1), ValueError,
     r"rank -1: the buffer set has ranks 0 \.\. 1"),
    (lambda: reshard.BufferSet([qkv_buffer()], q_into_b()).empty(True), ValueError,
     r"rank True: the buffer set has ranks 0 \.\. 1"),
    (lambda: reshard.BufferSet([qkv_buffer()], q_into_b()).empty(2), ValueError,
     r"rank 2: the buffer set has ranks 0 \.\. 1"),
    (lambda: reshard.BufferSet([qkv_buffer()], q_into_b()).empty(1.0), ValueError,
     r"rank 1\.0: the buffer set has ranks 0 \.\. 1"),
    (lambda: qkv_buffer().shape(-1), ValueError, r"rank -1: buffer 'B' has ranks 0 \.\. 1"),
], ids=["same_name_twice", "short_padding", "rank_-1", "rank_True", "rank_past_world",
        "rank_float", "buffer_shape_rank_-1"])
def test_a_buffer_set_refuses_what_the_cli_refuses_naming_it(build, error, message):
    """Two buffers of one name (the CLI refuses a duplicate key), a padding tuple short of the
    ranks, and ranks outside the world (no index from the end, no bool): clear errors, never a
    silent choice, a wrong rank or a bare IndexError."""
    with pytest.raises(error, match=message):
        build()


def test_a_fill_of_negative_zero_keeps_its_sign():
    buffers = reshard.BufferSet([qkv_buffer(fill=-0.0)], q_into_b())
    assert str(buffers["B"].fill) == "-0.0"
    assert json.loads(buffers.to_json())["buffers"]["B"]["fill"] == 0.0
    assert '"fill": -0.0' in buffers.to_json()
    assert str(reshard.read_buffers(buffers.to_json())["B"].fill) == "-0.0"
    t = buffers.empty(0)["B"]
    assert torch.signbit(t).all()
    # +0.0 is the default, written as no fill at all.
    assert "fill" not in json.loads(reshard.BufferSet([qkv_buffer()], q_into_b()).to_json())[
        "buffers"]["B"]
