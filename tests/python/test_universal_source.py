"""A universal checkpoint as a source: `gather`, `convert --tp` and `convert --to dcp` read it as
they read the DeepSpeed checkpoint it came from.

- From a real DeepSpeed training checkpoint (ds_checkpoints.py: Qwen2, AutoTP 2 x ZeRO 2 over
  DP 2, bf16 module), converted by reshard and by DeepSpeed's own ds_to_universal: `gather`
  writes what `gather` of the DeepSpeed checkpoint writes (the module's bf16 weights: the fp32
  masters rounded; with --fp32 the masters), bit for bit.
- The same from ZeRO 3 at TP 1, whose universal files are bare flat tensors.
- Where the checkpoint records no layout (TP 1), the model's config.json lays it out, as it
  does the DeepSpeed save dir.
- `convert --tp 2` lays the universal checkpoint out as `convert --tp 2` of the DeepSpeed
  checkpoint does (the layouts of the model-states copy), and a gather of it writes the same
  tensors, optimizer state ("<param>.fp32", ".exp_avg", ".exp_avg_sq") included.
- `convert --to dcp --world 2` writes what get_state_dict gives the model and AdamW: a fresh
  model and optimizer load it whole (dcp.load, set_state_dict) into the universal files'
  tensors, step and hyperparameters.
- DCP -> universal -> DCP: a DCP checkpoint of a model and Adam's state (saved here in one
  process), converted to universal and back, loads whole into the same tensors.
"""

import subprocess

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from ds_checkpoints import Spec, ds_to_universal
from test_deepspeed_checkpoints import CI_SPECS

SPEC = Spec("qwen2", tp=2, dp=2, stage=2, dtype="bfloat16")


def run(reshard_bin, *args):
    return subprocess.run([str(reshard_bin), *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def ok(reshard_bin, *args):
    r = run(reshard_bin, *args)
    assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def sources(ds_checkpoint, tmp_path_factory, reshard_bin):
    """{"deepspeed": the save dir, "reshard": reshard's universal output (the dir with
    latest_universal), "ds_to_universal": DeepSpeed's output folder}."""
    # The launches of the CI matrix these specs belong to, whole: in a full run the other
    # modules train them once for all (ds_checkpoint is a session fixture).
    ds_checkpoint.prepare([s for s in CI_SPECS if (s.tp, s.dp) in {(2, 2), (1, 3)}])
    ckpt = ds_checkpoint(SPEC)
    base = tmp_path_factory.mktemp("universal_source")
    ok(reshard_bin, "convert", ckpt.save_dir, "--to", "universal", "-o", base / "reshard")
    theirs = ds_to_universal(ckpt, base / "deepspeed")
    return {"deepspeed": ckpt.save_dir, "reshard": base / "reshard", "ds_to_universal": theirs}


def gathered(reshard_bin, src, out, *flags):
    ok(reshard_bin, "gather", src, "-o", out, *flags)
    return load_file(out / "model.safetensors")


def assert_same(got, want):
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype, (name, got[name].dtype, t.dtype)
        assert got[name].shape == t.shape, name
        assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name


@pytest.mark.parametrize("which", ["reshard", "ds_to_universal"])
@pytest.mark.parametrize("flags", [[], ["--fp32"]], ids=["module", "fp32"])
def test_gather_equals_gather_of_the_deepspeed_checkpoint(sources, reshard_bin, tmp_path, which,
                                                          flags):
    want = gathered(reshard_bin, sources["deepspeed"], tmp_path / "ds", *flags)
    got = gathered(reshard_bin, sources[which], tmp_path / "uc", *flags)
    assert_same(got, want)
    dtype = torch.float32 if flags else torch.bfloat16
    assert {t.dtype for t in got.values()} == {dtype}


# ZeRO 3 at TP 1: ds_to_universal (and reshard, as it does) writes bare flat tensors, shaped
# by the model-states copy's param_shapes.
FLAT = Spec("llama", tp=1, dp=3, stage=3, dtype="bfloat16", vocab=251)
assert SPEC in CI_SPECS and FLAT in CI_SPECS


@pytest.mark.parametrize("flags", [[], ["--fp32"]], ids=["module", "fp32"])
def test_gather_of_the_flat_form(ds_checkpoint, reshard_bin, tmp_path, flags):
    ckpt = ds_checkpoint(FLAT)
    ok(reshard_bin, "convert", ckpt.save_dir, "--to", "universal", "-o", tmp_path / "ours")
    theirs = ds_to_universal(ckpt, tmp_path / "theirs")
    fp32 = torch.load(theirs / "zero" / "lm_head.weight" / "fp32.pt", weights_only=False)
    assert isinstance(fp32, torch.Tensor) and fp32.dim() == 1  # the flat form indeed
    want = gathered(reshard_bin, ckpt.save_dir, tmp_path / "ds", *flags)
    assert_same(gathered(reshard_bin, tmp_path / "ours", tmp_path / "a", *flags), want)
    assert_same(gathered(reshard_bin, theirs, tmp_path / "b", *flags), want)


def test_layouts_from_a_config_where_the_checkpoint_records_none(ds_checkpoint, reshard_bin,
                                                                  tmp_path):
    """TP 1 runs record no universal_checkpoint_info: convert --tp takes the model's config.json
    (given, or in the dir given) as for the DeepSpeed save dir, and writes the same files."""
    ckpt = ds_checkpoint(FLAT)
    uc = tmp_path / "uc"
    ok(reshard_bin, "convert", ckpt.save_dir, "--to", "universal", "-o", uc)
    r = run(reshard_bin, "convert", uc, "--tp", "2", "-o", tmp_path / "none")
    assert r.returncode == 1 and "no recorded layout" in r.stderr and "--config" in r.stderr
    ok(reshard_bin, "convert", ckpt.save_dir, "--tp", "2", "-o", tmp_path / "ds2")
    ok(reshard_bin, "convert", uc, "--tp", "2", "--config", ckpt.save_dir / "config.json", "-o",
       tmp_path / "uc2")
    (uc / "config.json").write_bytes((ckpt.save_dir / "config.json").read_bytes())
    ok(reshard_bin, "convert", uc, "--tp", "2", "-o", tmp_path / "beside")
    files = sorted(f.name for f in (tmp_path / "ds2").glob("*.safetensors"))
    assert len(files) == 2
    for out in ("uc2", "beside"):
        for name in files:
            assert_same(load_file(tmp_path / out / name), load_file(tmp_path / "ds2" / name))
    # A gather copies that config.json, as from the DeepSpeed save dir.
    ok(reshard_bin, "gather", uc, "-o", tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").read_bytes() == \
        (ckpt.save_dir / "config.json").read_bytes()


def test_convert_tp2_then_gather_round_trips(sources, reshard_bin, tmp_path):
    ok(reshard_bin, "convert", sources["reshard"], "--tp", "2", "-o", tmp_path / "uc2")
    ok(reshard_bin, "convert", sources["deepspeed"], "--tp", "2", "-o", tmp_path / "ds2")
    got = gathered(reshard_bin, tmp_path / "uc2", tmp_path / "uc2-hf")
    want = gathered(reshard_bin, tmp_path / "ds2", tmp_path / "ds2-hf")
    assert_same(got, want)
    assert any(k.endswith(".exp_avg_sq") for k in got)
    # Laid out as the DeepSpeed checkpoint is: each rank's file holds the same shards.
    for f in sorted((tmp_path / "ds2").glob("*.safetensors")):
        assert_same(load_file(tmp_path / "uc2" / f.name), load_file(f))
    # And from the folder itself, weights only.
    folder = sources["ds_to_universal"]
    ok(reshard_bin, "convert", folder, "--tp", "2", "--weights-only", "-o", tmp_path / "w2")
    weights = gathered(reshard_bin, tmp_path / "w2", tmp_path / "w2-hf")
    assert_same(weights, gathered(reshard_bin, sources["deepspeed"], tmp_path / "ds-hf"))


def universal_tensors(out):
    """{param: {"fp32", "exp_avg", "exp_avg_sq": tensor}} of a universal checkpoint's files."""
    folder = out / (out / "latest_universal").read_text()
    return {p.name: {s: torch.load(p / f"{s}.pt", weights_only=False)["param"].detach()
                     for s in ("fp32", "exp_avg", "exp_avg_sq")}
            for p in sorted((folder / "zero").iterdir()) if p.is_dir()}


def load_as_a_trainer(ckpt, model, optim):
    """dcp.load of the whole get_state_dict structure of `model` and `optim` (fresh: their
    states as get_state_dict initializes them), then set_state_dict, as TorchTitan's
    checkpointer loads; in this process."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optim)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=str(ckpt), no_dist=True)
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def test_convert_to_dcp_loads_whole_into_a_trainer(sources, reshard_bin, tmp_path):
    """`convert --to dcp` writes what get_state_dict gives the model and torch's AdamW (the
    optimizer the DeepSpeed run used): a fresh transformers model (fp32) and AdamW load it
    whole, and then hold the universal files' tensors (the fp32 masters as the weights), the
    step of step.pt and the hyperparameters of zero/optimizer_state.pt."""
    import transformers

    ok(reshard_bin, "convert", sources["reshard"], "--to", "dcp", "--world", "2", "-o",
       tmp_path / "dcp")
    files = universal_tensors(sources["reshard"])
    folder = sources["reshard"] / (sources["reshard"] / "latest_universal").read_text()
    config = transformers.AutoConfig.from_pretrained(sources["deepspeed"])
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    optim = torch.optim.AdamW(model.parameters(), lr=1.0, betas=(0.5, 0.5), weight_decay=0.5)
    load_as_a_trainer(tmp_path / "dcp", model, optim)
    params = dict(model.named_parameters())
    assert sorted(params) == sorted(files)
    groups = torch.load(folder / "zero" / "optimizer_state.pt", weights_only=False)
    assert len(optim.param_groups) == len(groups["param_groups"]) == 1
    for k, v in groups["param_groups"][0].items():
        if k != "params":
            assert optim.param_groups[0][k] == v, k
    for name, states in files.items():
        assert torch.equal(params[name].detach(), states["fp32"]), name
        held = optim.state[params[name]]
        for s in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(held[s], states[s]), (name, s)
        step = torch.load(folder / "zero" / name / "step.pt", weights_only=False)
        assert torch.equal(held["step"], step) and step.item() == 2, name


def save_small_dcp(path):
    """A model's weights and one Adam step's state, as get_state_dict saves them (one process)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 3))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 6)).square().sum().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path), no_dist=True)
    return {k: v.detach().clone() for k, v in msd.items()}, \
        {k: {s: v.clone() for s, v in st.items()} for k, st in osd["state"].items()}


def test_dcp_to_universal_to_dcp(reshard_bin, tmp_path):
    weights, state = save_small_dcp(tmp_path / "src")
    ok(reshard_bin, "convert", tmp_path / "src", "--to", "universal", "-o", tmp_path / "uc")
    ok(reshard_bin, "convert", tmp_path / "uc", "--to", "dcp", "--world", "3", "-o",
       tmp_path / "back")
    # No model-states copy: the weights are the fp32 masters.
    got = gathered(reshard_bin, tmp_path / "uc", tmp_path / "hf")
    assert_same(got, weights)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 3))
    optim = torch.optim.Adam(model.parameters(), lr=0.5)
    load_as_a_trainer(tmp_path / "back", model, optim)
    params = dict(model.named_parameters())
    assert optim.param_groups[0]["lr"] == 0.01
    for k, v in weights.items():
        assert torch.equal(params[k].detach(), v), k
        for s in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optim.state[params[k]][s], state[k][s]), (k, s)


def test_refusals_name_the_file(sources, reshard_bin, tmp_path):
    import shutil

    uc = tmp_path / "uc"
    shutil.copytree(sources["reshard"], uc)
    folder = uc / (uc / "latest_universal").read_text()
    (uc / "latest_universal").write_text("global_step99_universal")
    r = run(reshard_bin, "gather", uc, "-o", tmp_path / "hf")
    assert r.returncode == 2 and "global_step99_universal" in r.stderr, r.stderr
    (uc / "latest_universal").write_text(folder.name)
    param = sorted(p for p in (folder / "zero").iterdir() if p.is_dir())[0]
    (param / "fp32.pt").unlink()
    r = run(reshard_bin, "gather", uc, "-o", tmp_path / "hf")
    assert r.returncode == 2 and str(param / "fp32.pt") in r.stderr, r.stderr
    assert not (tmp_path / "hf").exists()
    r = run(reshard_bin, "gather", sources["reshard"], "--optimizer-state", "-o", tmp_path / "o")
    assert r.returncode == 2, r.stderr
    # --drop leaves out what the checkpoint holds and a universal one cannot; nothing else.
    r = run(reshard_bin, "convert", sources["deepspeed"], "--to", "universal", "--drop", "x",
            "-o", tmp_path / "d")
    assert r.returncode == 2 and '"x", asked to be dropped' in r.stderr, r.stderr


def test_python_api_reads_it_as_the_cli_does(sources, reshard_bin, tmp_path):
    import reshard

    reshard.checkpoint.gather(sources["reshard"], tmp_path / "py", fp32=True)
    cli = gathered(reshard_bin, sources["reshard"], tmp_path / "cli", "--fp32")
    assert_same(load_file(tmp_path / "py" / "model.safetensors"), cli)
    with pytest.raises(ValueError, match="universal"):
        reshard.checkpoint.gather(sources["reshard"], tmp_path / "bad", optimizer_state=True)


@pytest.mark.parametrize("which", ["reshard", "ds_to_universal"])
def test_inspect_reports_a_universal_checkpoint(sources, reshard_bin, which):
    """`reshard inspect` of a universal checkpoint (the dir with latest_universal, or the
    folder): its parameters with their full shapes and the optimizer states each has, as its
    files hold them (not the DeepSpeed checkpoint its model-states copies come from)."""
    import json
    out = sources[which]
    want = universal_tensors(out if which == "reshard" else out.parent)
    text = ok(reshard_bin, "inspect", out).stdout
    assert f"universal checkpoint: {len(want)} parameters" in text, text
    report = json.loads(ok(reshard_bin, "inspect", "--json", out).stdout)["universal"]
    assert report["parameters"] == len(want)
    assert report["optimizer_states"] == {s: len(want) for s in ("exp_avg", "exp_avg_sq", "fp32")}
    shapes = {p["name"]: p["shape"] for p in report["params"]}
    assert shapes == {name: list(t["fp32"].shape) for name, t in want.items()}
    assert report["elements"] == sum(t["fp32"].numel() for t in want.values())
    # Whole tensors: no ranks, the optimizer's states whole beside them.
    run_ = json.loads(ok(reshard_bin, "inspect", "--json", out).stdout)["parallelism"]
    assert (run_["world"], run_["axes"], run_["optimizer"]) == (1, [], "whole")
    assert "parallelism: 1 rank (DeepSpeed universal: whole tensors), whole tensors" in text


class FrozenNet(torch.nn.Module):
    """A frozen layer (in the optimizer's group, without state: it gets no gradient), a
    trained one, and a buffer."""

    def __init__(self, buffer=True):
        super().__init__()
        self.frozen = torch.nn.Linear(6, 4)
        self.head = torch.nn.Linear(4, 3)
        self.frozen.requires_grad_(False)
        if buffer:
            self.register_buffer("stat", torch.arange(3.0))

    def forward(self, x):
        return self.head(self.frozen(x))


def test_dcp_to_universal_keeps_frozen_parameters_and_amsgrad(reshard_bin, tmp_path):
    """DCP -> universal -> DCP keeps a frozen parameter (its folder holds fp32.pt alone) and
    AdamW(amsgrad=True)'s max_exp_avg_sq; a buffer, which a universal checkpoint has no place
    for, is refused by name unless --drop names it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = FrozenNet()
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, amsgrad=True)
    model(torch.randn(5, 6)).square().sum().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "src"), no_dist=True)
    r = run(reshard_bin, "convert", tmp_path / "src", "--to", "universal", "-o", tmp_path / "uc")
    assert r.returncode == 1 and '"model.stat"' in r.stderr and 'dropping "model.stat" by name' in r.stderr, \
        r.stderr
    assert not (tmp_path / "uc").exists()
    r = run(reshard_bin, "convert", tmp_path / "src", "--to", "universal", "--drop", "model.nope",
            "-o", tmp_path / "uc")
    assert r.returncode == 2 and "model.nope" in r.stderr, r.stderr
    r = run(reshard_bin, "convert", tmp_path / "src", "--to", "dcp", "--world", "2", "--drop",
            "model.stat", "-o", tmp_path / "d")
    assert r.returncode == 2 and "--drop applies" in r.stderr, r.stderr
    ok(reshard_bin, "convert", tmp_path / "src", "--to", "universal", "--drop", "model.stat", "-o",
       tmp_path / "uc")
    zero = tmp_path / "uc" / (tmp_path / "uc" / "latest_universal").read_text() / "zero"
    assert sorted(p.name for p in (zero / "frozen.weight").iterdir()) == ["fp32.pt"]
    assert sorted(p.name for p in (zero / "head.weight").iterdir()) == [
        "exp_avg.pt", "exp_avg_sq.pt", "fp32.pt", "max_exp_avg_sq.pt", "step.pt"]
    import json
    report = json.loads(ok(reshard_bin, "inspect", "--json", tmp_path / "uc").stdout)["universal"]
    assert report["parameters"] == 4
    assert report["optimizer_states"] == {"exp_avg": 2, "exp_avg_sq": 2, "fp32": 4,
                                          "max_exp_avg_sq": 2}
    ok(reshard_bin, "convert", tmp_path / "uc", "--to", "dcp", "--world", "2", "-o",
       tmp_path / "back")
    torch.manual_seed(1)
    fresh = FrozenNet(buffer=False)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.5, amsgrad=True)
    load_as_a_trainer(tmp_path / "back", fresh, fresh_optim)
    params = dict(fresh.named_parameters())
    for k, v in dict(model.named_parameters()).items():
        assert torch.equal(params[k].detach(), v.detach()), k
        want = optim.state[v]
        assert sorted(fresh_optim.state[params[k]]) == sorted(want), k
        for s, t in want.items():
            assert torch.equal(fresh_optim.state[params[k]][s], t), (k, s)
    assert "frozen.weight" in dict(model.named_parameters()) and not optim.state[model.frozen.weight]


def test_dcp_to_universal_keeps_tensor_and_nested_param_group_entries(reshard_bin, tmp_path):
    """`lr` as a tensor (a tensor item of the DCP) and a nested entry ("my.a") come through
    universal (zero/optimizer_state.pt holds them as the optimizer had them) and back, so that
    dcp.load of the whole trainer state finds every key."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    def trainer():
        model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 3))
        optim = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), foreach=False)
        optim.param_groups[0]["my"] = {"a": [1, None, "s"]}
        return model, optim

    torch.manual_seed(0)
    model, optim = trainer()
    model(torch.randn(5, 6)).square().sum().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "src"), no_dist=True)
    ok(reshard_bin, "convert", tmp_path / "src", "--to", "universal", "-o", tmp_path / "uc")
    folder = tmp_path / "uc" / (tmp_path / "uc" / "latest_universal").read_text()
    group = torch.load(folder / "zero" / "optimizer_state.pt", weights_only=False)[
        "param_groups"][0]
    assert torch.equal(group["lr"], torch.tensor(0.01)) and group["my"] == {"a": [1, None, "s"]}
    ok(reshard_bin, "convert", tmp_path / "uc", "--to", "dcp", "--world", "2", "-o",
       tmp_path / "back")
    torch.manual_seed(1)
    fresh, fresh_optim = trainer()
    fresh_optim.param_groups[0]["my"] = {"a": [0]}
    fresh_optim.param_groups[0]["lr"] = torch.tensor(0.5)
    load_as_a_trainer(tmp_path / "back", fresh, fresh_optim)
    assert fresh_optim.param_groups[0]["my"] == {"a": [1, None, "s"]}
    assert torch.equal(torch.as_tensor(fresh_optim.param_groups[0]["lr"]), torch.tensor(0.01))


def save_state(path, state):
    dcp.save(state, checkpoint_id=str(path), no_dist=True)


def adam_state(params, **changes):
    """A model of `params` ({name: shape}) and Adam's state for each, as get_state_dict nests
    them; `changes` replace entries by dotted key ("optim.state.a.exp_avg") or drop them
    (None)."""
    torch.manual_seed(0)
    sd = {"model": {}, "optim": {"state": {}, "param_groups": [
        {"lr": 0.1, "params": sorted(params)}]}}
    for name, shape in params.items():
        sd["model"][name] = torch.randn(shape)
        sd["optim"]["state"][name] = {"exp_avg": torch.randn(shape),
                                      "exp_avg_sq": torch.rand(shape), "step": torch.tensor(2.0)}
    for key, value in changes.items():
        if key.startswith("optim.state."):
            name, last = key.removeprefix("optim.state.").rsplit(".", 1)
            node = sd["optim"]["state"][name]
        else:
            *parents, last = key.split(".")
            node = sd
            for p in parents:
                node = node[int(p)] if isinstance(node, list) else node[p]
        if value is None:
            del node[last]
        else:
            node[last] = value
    return sd


@pytest.mark.parametrize("case", [
    "moment_transposed", "moment_flat", "step_missing_for_one", "group_names_a_stranger",
    "group_leaves_one_out", "group_names_one_twice"])
def test_dcp_to_universal_refuses_an_inconsistent_training_state(reshard_bin, tmp_path, case):
    """Adam's state that does not belong to its parameters is refused (exit 1) naming what
    differs, and nothing is written: a moment of another shape, a step on one parameter only,
    param groups that name a tensor the checkpoint lacks, leave a parameter out or name one
    twice."""
    shapes = {"a.weight": (4, 3), "b.weight": (2,)}
    changes = {
        "moment_transposed": ({"optim.state.a.weight.exp_avg": torch.zeros(3, 4)}, "[3, 4]"),
        "moment_flat": ({"optim.state.a.weight.exp_avg_sq": torch.zeros(12)}, "[12]"),
        "step_missing_for_one": ({"optim.state.b.weight.step": None}, '"b.weight" has no step'),
        "group_names_a_stranger": (
            {"optim.param_groups.0.params": ["a.weight", "b.weight", "c.weight"]}, '"c.weight"'),
        "group_leaves_one_out": (
            {"optim.param_groups.0.params": ["a.weight"]}, '"b.weight" has optimizer state'),
        "group_names_one_twice": (
            {"optim.param_groups.0.params": ["a.weight", "b.weight", "a.weight"]},
            '"a.weight" is in param group 0 and again'),
    }[case]
    save_state(tmp_path / "src", adam_state(shapes, **changes[0]))
    r = run(reshard_bin, "convert", tmp_path / "src", "--to", "universal", "-o", tmp_path / "uc")
    assert r.returncode == 1 and changes[1] in r.stderr, r.stderr
    assert not (tmp_path / "uc").exists()


def test_dcp_to_universal_writes_a_step_stored_as_a_number(reshard_bin, tmp_path):
    """A step stored as a Python int (a bytes item) is written as step.pt, the 0-d fp32 tensor
    torch's Adam keeps, and comes back as optim.state.<param>.step."""
    sd = adam_state({"a.weight": (4, 3)})
    sd["optim"]["state"]["a.weight"]["step"] = 7
    save_state(tmp_path / "src", sd)
    ok(reshard_bin, "convert", tmp_path / "src", "--to", "universal", "-o", tmp_path / "uc")
    folder = tmp_path / "uc" / (tmp_path / "uc" / "latest_universal").read_text()
    step = torch.load(folder / "zero" / "a.weight" / "step.pt", weights_only=False)
    assert step.dtype == torch.float32 and step.shape == () and step.item() == 7
