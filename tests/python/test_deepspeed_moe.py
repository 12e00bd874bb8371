"""DeepSpeed AutoEP (mixture-of-experts) checkpoints, trained here on the CPU
(ds_checkpoints.py: toy Mixtral, 4 experts, "expert_parallel": {"autoep_size": 2}, ZeRO 1, at
DP 2 and at DP 4, the latter with an expert-DP degree of 2).

- inspect lists the experts, their placement and their EP maps (those DeepSpeed recorded);
- gather writes what transformers' save_pretrained writes for the trained model, tensor for
  tensor (the reference is saved by the training run, which checks that it computes the
  engine's loss);
- convert --to universal writes what ds_to_universal writes, file for file, and DeepSpeed
  resumes from ours, at the saved topology and at another expert-DP degree;
- placements other than contiguous (checkpoints rewritten with DeepSpeed's own placement
  descriptors and maps) read as DeepSpeed reads them; a recorded map that disagrees with its
  placement, a missing expert file, an expert file of another run (its weights not its
  masters rounded), a stray expert file and a module_path its experts do not lie in, are
  refused;
- DeepSpeed's AutoEP maps of random placements (uneven, non-contiguous, replicated, empty
  ranks) load here and extract what DeepSpeed extracts.
"""

import json
import logging
import shutil
import subprocess
import types

import pytest
import torch

logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
import deepspeed.checkpoint.affine as affine  # noqa: E402
import deepspeed.checkpoint.autoep_affine as autoep_affine  # noqa: E402

import reshard  # noqa: E402
from ds_checkpoints import Spec, ds_to_universal, resume_launch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from torch_ref import to_bytes  # noqa: E402

EP2 = Spec("mixtral", dp=2, ep=2, stage=1)
EP2_EDP2 = Spec("mixtral", dp=4, ep=2, stage=1)
SPECS = [EP2, EP2_EDP2]


def run(*args):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def ckpts(ds_checkpoint):
    ds_checkpoint.prepare(SPECS)
    return {spec: ds_checkpoint(spec) for spec in SPECS}


def same(a, b, path):
    """torch.load results equal: types, dict keys in order, tensors bit for bit with dtype,
    shape and requires_grad, records attribute for attribute."""
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.requires_grad) == (b.dtype, b.shape, b.requires_grad), path
        assert to_bytes(a.detach().reshape(-1)) == to_bytes(b.detach().reshape(-1)), path
    elif isinstance(a, dict):
        assert list(a) == list(b), (path, list(a), list(b))
        for k in a:
            same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}.{i}")
    elif hasattr(a, "__dict__"):
        same(vars(a), vars(b), path)
    else:
        assert a == b, (path, a, b)


def files(root):
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())


def model_states(save_dir, tag):
    return torch.load(save_dir / tag / "mp_rank_00_model_states.pt", weights_only=False)


def test_inspect_lists_the_experts_with_the_placement_and_maps_deepspeed_recorded(
        ckpts, reshard_bin):
    for spec, ckpt in ckpts.items():
        r = run(reshard_bin, "inspect", ckpt.save_dir, "--json")
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        summary = doc["deepspeed"]
        autoep = summary["autoep"]
        saved = model_states(ckpt.save_dir, ckpt.tag)["ds_autoep_layers"]
        assert autoep["ep_size"] == spec.ep
        assert [layer["module_path"] for layer in autoep["layers"]] == \
            [m["module_path"] for m in saved]
        for layer, meta in zip(autoep["layers"], saved):
            assert layer["placement"] == meta["expert_placement"]
            for param in layer["params"]:
                recorded = meta["affine_maps"]["params"][param["name"]]
                assert param["shape"] == recorded["logical_shape"]
                ours = reshard.ParamMap.from_dict(param["affine_map"])
                theirs = reshard.ParamMap.from_dict(recorded)
                assert ours.to_json() == theirs.to_json(), param["name"]
        # The experts are not listed as dense parameters.
        assert not [p for p in summary["params"] if ".experts." in p["name"]]
        # The run: the experts numbered inside dp, EP rank d mod EP (AutoEP's default).
        run_ = doc["parallelism"]
        edp = spec.dp // spec.ep
        assert run_["axes"] == [{"name": "tp", "size": 1}, {"name": "dp", "size": spec.dp},
                                {"name": "pp", "size": 1}]
        assert run_["experts"] == [{"name": "tp", "size": 1}, {"name": "ep", "size": spec.ep},
                                   {"name": "edp", "size": edp}, {"name": "pp", "size": 1}]
        assert run_["optimizer"] == "zero1" and run_["unknown"] == []
        assert "layer_{L}_expert_{e}_mp_rank_00_model_states.pt" in run_["files"]
        text = run(reshard_bin, "inspect", ckpt.save_dir).stdout
        assert f"; experts pp 1 × edp {edp} × ep 2 × tp 1, ZeRO 1\n" in text, text
        assert "AutoEP: EP 2, 2 MoE layers" in text
        assert "model.layers.0.mlp  4 experts: EP 0 [0 1] EP 1 [2 3]" in text


def test_gather_writes_what_save_pretrained_writes(ckpts, reshard_bin, tmp_path):
    for spec, ckpt in ckpts.items():
        out = tmp_path / spec.name
        r = run(reshard_bin, "gather", ckpt.save_dir, "-o", out)
        assert r.returncode == 0, r.stderr
        ours = load_file(str(out / "model.safetensors"))
        theirs = load_file(str(ckpt.hf_dir() / "model.safetensors"))
        assert sorted(ours) == sorted(theirs)
        assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in ours
        for name in theirs:
            assert ours[name].dtype == theirs[name].dtype and \
                to_bytes(ours[name]) == to_bytes(theirs[name]), name
        assert json.loads((out / "config.json").read_text())["model_type"] == "mixtral"


@pytest.fixture(scope="module")
def universal(ckpts, reshard_bin, tmp_path_factory):
    """{spec: (our save dir, DeepSpeed's save dir)}, each with latest_universal."""
    base = tmp_path_factory.mktemp("moe-universal")
    out = {}
    for spec, ckpt in ckpts.items():
        ours = base / f"{spec.name}-reshard"
        r = run(reshard_bin, "convert", ckpt.save_dir, "--to", "universal", "-o", ours)
        assert r.returncode == 0, r.stderr
        out[spec] = (ours, ds_to_universal(ckpt, base / f"{spec.name}-deepspeed").parent)
    return out


def test_universal_output_equals_ds_to_universal_file_by_file(universal):
    for spec, (ours, theirs) in universal.items():
        assert (ours / "latest_universal").read_text() == \
            (theirs / "latest_universal").read_text()
        folder = (theirs / "latest_universal").read_text()
        assert files(ours / folder) == files(theirs / folder), spec.name
        for f in files(theirs / folder):
            same(torch.load(ours / folder / f, weights_only=False),
                 torch.load(theirs / folder / f, weights_only=False), f"{spec.name}/{f}")
        expert = torch.load(ours / folder / "zero/model.layers.0.mlp.experts.w1/fp32.pt",
                            weights_only=False)
        assert expert["param"].shape == (4, 128, 64) and expert["is_expert_param"]


def test_deepspeed_resumes_from_the_universal_output(ckpts, universal, tmp_path):
    # One launch at DP 2 (EP 2): our conversion of the DP 2 checkpoint, and of the DP 4 one
    # (expert-DP 2 -> 1). The loss on DP rank d depends on the weights and d's batch only.
    got = resume_launch(1, 2, [(EP2, universal[EP2][0], "same"),
                               (EP2, universal[EP2_EDP2][0], "edp2")], tmp_path)
    assert got["same"] == ckpts[EP2].next_loss
    assert got["edp2"] == {d: ckpts[EP2_EDP2].next_loss[d] for d in (0, 1)}


def as_placed(ckpt, dest, placement=None, recorded=None):
    """A copy of `ckpt`'s save dir whose ds_autoep_layers say `placement` ([experts of EP rank
    k, ...]) with the maps DeepSpeed's autoep_placement_to_affine_map makes of `recorded`
    (default: of `placement`). The files keep their data: slot s of EP rank k is now expert
    placement[k][s]."""
    shutil.copytree(ckpt.save_dir, dest)
    path = dest / ckpt.tag / "mp_rank_00_model_states.pt"
    states = torch.load(path, weights_only=False)
    for meta in states["ds_autoep_layers"]:
        num = meta["num_experts"]
        desc = autoep_affine.make_autoep_placement_descriptor(num, placement)
        maps_of = autoep_affine.make_autoep_placement_descriptor(num, recorded or placement)
        meta["expert_placement"] = desc
        for name, m in meta["affine_maps"]["params"].items():
            m2 = autoep_affine.autoep_placement_to_affine_map(maps_of, m["logical_shape"])
            meta["affine_maps"]["params"][name] = m2.to_dict()
    torch.save(states, path)
    return dest


def test_a_non_contiguous_placement_reads_as_deepspeed_reads_it(ckpts, reshard_bin, tmp_path):
    ckpt = ckpts[EP2]
    placement = [[3, 0], [2, 1]]
    save = as_placed(ckpt, tmp_path / "placed", placement)
    r = run(reshard_bin, "gather", save, "-o", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    ours = load_file(str(tmp_path / "hf" / "model.safetensors"))
    ref = load_file(str(ckpt.hf_dir() / "model.safetensors"))
    # Before the rewrite, slot s of EP rank k was expert 2k + s.
    for k, held in enumerate(placement):
        for s, e in enumerate(held):
            for w in ("w1", "w2", "w3"):
                name = f"model.layers.0.block_sparse_moe.experts.{{}}.{w}.weight"
                assert to_bytes(ours[name.format(e)]) == to_bytes(ref[name.format(2 * k + s)])
    # The universal output holds expert e at index e, by the placement. ds_to_universal
    # (0.19.8) drops the placement with the rest of the layer metadata but six fields and
    # stacks the EP ranks' tensors in rank order: the same tensors, in slot order.
    r = run(reshard_bin, "convert", save, "--to", "universal", "-o", tmp_path / "uc")
    assert r.returncode == 0, r.stderr
    fake = types.SimpleNamespace(tag=ckpt.tag, tag_dir=save / ckpt.tag, spec=ckpt.spec)
    theirs = ds_to_universal(fake, tmp_path / "ds").parent
    folder = (theirs / "latest_universal").read_text()
    order = [e for held in placement for e in held]
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        f = f"zero/model.layers.1.mlp.experts.w3/{state}.pt"
        ours = torch.load(tmp_path / "uc" / folder / f, weights_only=False)
        ds = torch.load(theirs / folder / f, weights_only=False)
        same({**ours, "param": ours["param"][order]}, ds, f)


def test_a_recorded_map_that_disagrees_with_its_placement_is_refused(ckpts, reshard_bin,
                                                                   tmp_path):
    save = as_placed(ckpts[EP2], tmp_path / "placed", [[0, 1], [2, 3]], recorded=[[1, 0], [2, 3]])
    r = run(reshard_bin, "inspect", save)
    assert r.returncode == 2
    assert "disagrees with the expert placement descriptor" in r.stderr, r.stderr
    assert "model.layers.0.mlp.experts.w1" in r.stderr


def test_a_missing_expert_file_is_named(ckpts, reshard_bin, tmp_path):
    ckpt = ckpts[EP2]
    save = tmp_path / "save"
    shutil.copytree(ckpt.save_dir, save)
    (save / ckpt.tag / "layer_1_expert_3_mp_rank_00_model_states.pt").unlink()
    r = run(reshard_bin, "gather", save, "-o", tmp_path / "out")
    assert r.returncode == 2
    assert "layer_1_expert_3_mp_rank_00_model_states.pt" in r.stderr and "missing" in r.stderr
    assert not (tmp_path / "out").exists()


def expert_from_another_run(ckpts, save, tag):
    # The DP 4 run: the same geometry and expert shapes, trained otherwise.
    other = ckpts[EP2_EDP2]
    name = "layer_0_expert_2_mp_rank_00_model_states.pt"
    shutil.copy(other.save_dir / other.tag / name, save / tag / name)
    return name


def expert_perturbed(ckpts, save, tag):
    name = "layer_1_expert_1_mp_rank_00_model_states.pt"
    states = torch.load(save / tag / name, weights_only=False)
    key = next(k for k in states if ".w2." in k)
    states[key].view(-1)[-1] += 1.0
    torch.save(states, save / tag / name)
    return name


def extra_expert_file(ckpts, save, tag):
    shutil.copy(save / tag / "layer_0_expert_3_mp_rank_00_model_states.pt",
                save / tag / "layer_0_expert_4_mp_rank_00_model_states.pt")
    return "layer_0_expert_4_mp_rank_00_model_states.pt"


def module_path_renamed(ckpts, save, tag):
    path = save / tag / "mp_rank_00_model_states.pt"
    states = torch.load(path, weights_only=False)
    states["ds_autoep_layers"][0]["module_path"] = "model.layers.0.mlp2"
    torch.save(states, path)
    return "model.layers.0.mlp2"


@pytest.mark.parametrize("tamper", [expert_from_another_run, expert_perturbed,
                                    extra_expert_file, module_path_renamed],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("fp32", [False, True], ids=["module", "fp32"])
def test_expert_files_are_tied_to_their_run(ckpts, reshard_bin, tmp_path, tamper, fp32):
    # Each expert file's weights are its fp32 masters (in the optimizer files, tied to the run
    # by their metadata) rounded, as DeepSpeed leaves them; every expert file is one the
    # layers name; the experts lie in their layer's module. Otherwise gather would write one
    # run's expert from the module and another's from the masters.
    ckpt = ckpts[EP2]
    save = tmp_path / "save"
    shutil.copytree(ckpt.save_dir, save)
    needle = tamper(ckpts, save, ckpt.tag)
    r = run(reshard_bin, "gather", save, "-o", tmp_path / "out", *(["--fp32"] if fp32 else []))
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert needle in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_convert_to_a_sharded_checkpoint_says_what_works(ckpts, reshard_bin, tmp_path):
    r = run(reshard_bin, "convert", ckpts[EP2].save_dir, "--tp", "2", "-o", tmp_path / "o")
    assert r.returncode == 2 and "--to universal" in r.stderr, r.stderr


def random_placement(rng, num_experts, ep):
    """Any placement AutoEP's descriptors allow: every expert somewhere, some twice, ranks
    uneven or empty, slots in any order."""
    experts = [[] for _ in range(ep)]
    for e in range(num_experts):
        for k in rng.sample(range(ep), rng.choice([1, 1, 1, 2]) if ep > 1 else 1):
            experts[k].append(e)
    for held in experts:
        rng.shuffle(held)
    return experts


def test_deepspeeds_autoep_maps_load_here_and_extract_what_deepspeed_extracts(rng):
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    for _ in range(60):
        num, ep = rng.randint(1, 9), rng.randint(1, 5)
        placement = random_placement(rng, num, ep)
        desc = autoep_affine.make_autoep_placement_descriptor(num, placement)
        shape = [num] + [rng.randint(1, 4) for _ in range(rng.randint(0, 2))]
        ds_map = autoep_affine.autoep_placement_to_affine_map(desc, shape)
        assert isinstance(ds_map, affine.ParamAffineMap)
        ours = reshard.ParamMap.from_dict(ds_map.to_dict())
        full = torch.randn(shape, generator=gen)
        for k in range(ep):
            assert to_bytes(reshard.extract(ours, full, k)) == \
                to_bytes(autoep_affine.extract_autoep_rank_tensor(full, ds_map, k)), (placement, k)
        shards = [reshard.extract(ours, full, k) for k in range(ep)]
        assert to_bytes(reshard.rebuild(ours, shards)) == to_bytes(full)
