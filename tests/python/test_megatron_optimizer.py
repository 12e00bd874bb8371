"""Megatron-Core's distributed optimizer state -> Hugging Face names, universal checkpoint, DCP.

megatron-core (in .venv-megatron, see megatron_model.py) builds a toy Llama-style GPT model on
the CPU with its DistributedOptimizer (Adam) at TP 2 x PP 2 (world 4) and at TP 1 x DP 2
(world 2), takes two steps and saves model and optimizer with its own torch_dist writer
(sharding type fully_reshardable). Megatron then loads each checkpoint into the same model and
optimizer built at TP 1 in one process (its own resharding) and every fp32 main weight and Adam
moment it holds equals, bit for bit, what reshard writes for that Hugging Face tensor: the
gather with --optimizer-state, the universal checkpoint's files and a DCP checkpoint.

megatron-core 0.13 (a second copy beside .venv-megatron's, see scripts/dev) saves the state in
its older default sharding type, fully_sharded_model_space: flattened ranges of each
parameter's shard, which 0.16 no longer writes; reshard reads those too, checked the same way
(Megatron 0.13 loading its own checkpoint at TP 1), also with the ranges cut inside blocks as
DP ranks hold them, and refuses ranges that overlap or leave holes.

The step and the param groups Megatron keeps in its common.pt become the universal checkpoint's
step.pt and zero/optimizer_state.pt: DeepSpeed's own universal loader restores them.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from test_checkpoints import run
from test_megatron import MIXTRAL, expected_hf, megatron, megatron_python, same_bits

# Megatron's model (megatron_model.py's spec) and the Hugging Face config.json of the same model;
# Megatron's vocabulary is padded (64 rows for 60 tokens).
SPEC = {"layers": 2, "hidden": 32, "heads": 4, "groups": 2, "ffn": 48, "vocab": 64, "seed": 3,
        "steps": 2}
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2,
          "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
          "intermediate_size": 48, "vocab_size": 60, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
          "max_position_embeddings": 64, "tie_word_embeddings": False, "attention_bias": False,
          "mlp_bias": False, "hidden_act": "silu", "torch_dtype": "float32"}
# name -> (Megatron's spec, config.json, world at save, world at Megatron's load): the fully
# sharded layout, one replicated over DP ranks (each DP rank's optimizer owns a range of the
# flat buffers; fully_reshardable gathers them on save), and a Mixtral-style MoE at TP 2 x PP 2
# x EP 2 (a chain of two optimizers, the experts' apart: keys "chained_{i}.optimizer.state...",
# loaded at EP 2, which builds the same chain).
LAYOUTS = {"tp2pp2": (dict(SPEC, tp=2, pp=2), CONFIG, 4, 1),
           "tp1dp2": (dict(SPEC, tp=1, pp=1), CONFIG, 2, 1),
           "moe": (dict(MIXTRAL[0], steps=2), MIXTRAL[1], 4, 2),
           # At 3 layers megatron-core 0.13 cuts layer 1's linear_fc1 between its 2 DP ranks
           # (flattened ranges [0, 832) and [832, 1536) of a 1536-element block).
           "tp1dp2_3l": (dict(SPEC, tp=1, pp=1, layers=3), dict(CONFIG, num_hidden_layers=3), 2,
                         1)}
# reshard's names of the states (beside "<hf name>") and Megatron's.
STATES = {".fp32": "param", ".exp_avg": "exp_avg", ".exp_avg_sq": "exp_avg_sq"}


def megatron_013():
    """megatron-core 0.13.1, installed with --no-deps into a folder of its own (scripts/dev)."""
    path = os.environ.get("RESHARD_MEGATRON013_PATH",
                          str(pathlib.Path(megatron_python()).parents[1] / "megatron-core-0.13"))
    assert (pathlib.Path(path) / "megatron" / "core").is_dir(), (
        f"{path} holds no megatron-core 0.13: scripts/dev test installs it there "
        "(setup_megatron_venv), or point RESHARD_MEGATRON013_PATH at a folder that has it")
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(layout, sharding type) -> (checkpoint dir, config.json path, Megatron's TP-1 optimizer
    state); fully_sharded_model_space is saved and loaded by megatron-core 0.13."""
    made = {}

    def get(name, sharding="fully_reshardable"):
        if (name, sharding) not in made:
            spec, config, world, load_world = LAYOUTS[name]
            d = tmp_path_factory.mktemp(f"{name}_{sharding}")
            (d / "spec.json").write_text(json.dumps(dict(spec, optim_sharding=sharding)))
            (d / "config.json").write_text(json.dumps(config))
            env = {"PYTHONPATH": megatron_013()} if sharding == "fully_sharded_model_space" else {}
            megatron("train", d / "ckpt", d / "spec.json", procs=world, env=env)
            state = None
            if sharding != "dp_reshardable":
                megatron("optim", d / "ckpt", d / "spec.json", d / "optim.pt", env=env,
                         procs=load_world if load_world > 1 else None)
                state = torch.load(d / "optim.pt")
            made[(name, sharding)] = (d / "ckpt", d / "config.json", state)
        return made[(name, sharding)]

    return get


def expected(state, layout="tp2pp2"):
    """Every Hugging Face tensor and its states, sliced here from Megatron's TP-1 state."""
    spec, config, _, _ = LAYOUTS[layout]
    out = {}
    for suffix, key in STATES.items():
        for name, t in expected_hf(state[key], spec, config).items():
            out[name + suffix] = t.contiguous()
    return out


@pytest.mark.parametrize("layout", ["tp2pp2", "tp1dp2"])
def test_gather_with_optimizer_state_is_what_megatron_loads(reshard_bin, tmp_path, saved, layout):
    ckpt, config, state = saved(layout)
    want = expected(state, layout)
    weights = {k[:-len(".fp32")]: v for k, v in want.items() if k.endswith(".fp32")}
    out = tmp_path / "hf"
    r = run(reshard_bin, "gather", ckpt, "-o", out, "--config", config, "--optimizer-state")
    assert r.returncode == 0, r.stderr
    got = load_file(str(out / "model.safetensors"))
    assert sorted(got) == sorted(list(want) + list(weights))
    for k, v in {**want, **weights}.items():  # fp32 model weights: the main weights themselves
        assert same_bits(got[k], v), k
    # Without the flag: the weights alone, as before.
    r = run(reshard_bin, "gather", ckpt, "-o", tmp_path / "w", "--config", config)
    assert r.returncode == 0, r.stderr
    assert sorted(load_file(str(tmp_path / "w" / "model.safetensors"))) == sorted(weights)


def test_convert_to_universal_writes_megatrons_state_per_parameter(reshard_bin, tmp_path, saved):
    ckpt, config, state = saved("tp2pp2")
    want = expected(state)
    out = tmp_path / "uc"
    r = run(reshard_bin, "convert", ckpt, "--config", config, "--to", "universal", "-o", out)
    assert r.returncode == 0, r.stderr
    folder = out / (out / "latest_universal").read_text()
    assert folder.name == "ckpt_universal"
    params = sorted(p.name for p in (folder / "zero").iterdir() if p.is_dir())
    assert params == sorted(k[:-len(".fp32")] for k in want if k.endswith(".fp32"))
    for name in params:
        for suffix in STATES:
            f = torch.load(folder / "zero" / name / f"{suffix[1:]}.pt", weights_only=True)
            assert list(f) == ["param"], name
            assert same_bits(f["param"], want[name + suffix]), (name, suffix)
            assert f["param"].requires_grad == (suffix == ".fp32")
    # Without a config.json it cannot name them.
    r = run(reshard_bin, "convert", ckpt, "--to", "universal", "-o", tmp_path / "no")
    assert r.returncode == 2 and "config.json" in r.stderr, r.stderr
    assert not (tmp_path / "no").exists()


def test_convert_to_dcp_and_to_tp2_carry_the_state(reshard_bin, tmp_path, saved):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt, config, state = saved("tp1dp2")
    want = expected(state, "tp1dp2")
    out = tmp_path / "dcp"
    r = run(reshard_bin, "convert", ckpt, "--config", config, "--to", "dcp", "--world", 3,
            "-o", out)
    assert r.returncode == 0, r.stderr
    dcp_to_torch_save(out, tmp_path / "all.pt")
    got = torch.load(tmp_path / "all.pt")
    for k, v in want.items():
        name, suffix = k.rsplit(".", 1)
        assert same_bits(got["optim"]["state"][name][suffix], v), k
        if suffix == "fp32":
            assert same_bits(got[name], v), name
    # A reshard sharded checkpoint at TP 2 (transformers' layout, states laid out as their
    # parameters), gathered back: the same tensors.
    r = run(reshard_bin, "convert", ckpt, "--config", config, "--tp", 2, "-o", tmp_path / "tp2")
    assert r.returncode == 0, r.stderr
    manifest = json.loads((tmp_path / "tp2" / "reshard.json").read_text())["params"]
    q = "model.layers.0.self_attn.q_proj.weight"
    assert manifest[q + ".exp_avg"]["map"]["ranks"] == manifest[q]["map"]["ranks"]
    r = run(reshard_bin, "gather", tmp_path / "tp2", "-o", tmp_path / "back")
    assert r.returncode == 0, r.stderr
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    for k, v in want.items():
        assert same_bits(back[k], v), k
    # --weights-only leaves the state out.
    r = run(reshard_bin, "convert", ckpt, "--config", config, "--tp", 2, "--weights-only",
            "-o", tmp_path / "w")
    assert r.returncode == 0, r.stderr
    params = json.loads((tmp_path / "w" / "reshard.json").read_text())["params"]
    assert not [k for k in params if k.endswith((".fp32", ".exp_avg", ".exp_avg_sq"))]


def test_moe_state_from_a_chain_of_optimizers(reshard_bin, tmp_path, saved):
    """Mixtral-style at TP 2 x PP 2 x EP 2: the experts' state (stacked [L, E, ...] keys, from
    the second optimizer of the chain) as Megatron loads it at EP 2; converted to TP 2 and to
    EP 2 (transformers' stacked expert buffers, each state in buffers of its own) and back."""
    ckpt, config, state = saved("moe")
    want = expected(state, "moe")
    out = tmp_path / "hf"
    r = run(reshard_bin, "gather", ckpt, "-o", out, "--config", config, "--optimizer-state")
    assert r.returncode == 0, r.stderr
    got = load_file(str(out / "model.safetensors"))
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight.exp_avg" in got
    for k, v in want.items():
        assert same_bits(got[k], v), k
    for name, dc in (("tp2", []), ("ep2", ["--distributed-config",
                                           '{"tp_plan": "auto", "ep_size": 2}'])):
        r = run(reshard_bin, "convert", ckpt, "--config", config, "--tp", 2, *dc, "-o",
                tmp_path / name)
        assert r.returncode == 0, r.stderr
        buffers = json.loads((tmp_path / name / "reshard.json").read_text())["buffers"]
        assert any(b.endswith(".exp_avg") for b in buffers), buffers
        r = run(reshard_bin, "gather", tmp_path / name, "-o", tmp_path / f"{name}_back")
        assert r.returncode == 0, r.stderr
        back = load_file(str(tmp_path / f"{name}_back" / "model.safetensors"))
        for k, v in want.items():
            assert same_bits(back[k], v), (name, k)
    # The universal checkpoint's param groups: the chain's, in its order ({i: {"optimizer":
    # {"param_groups": ...}}} in common.pt), all at the chain's one step.
    r = run(reshard_bin, "convert", ckpt, "--config", config, "--to", "universal", "-o",
            tmp_path / "uc")
    assert r.returncode == 0, r.stderr
    chain = torch.load(ckpt / "common.pt", weights_only=False)["optimizer"]
    groups = [g for i in sorted(chain) for g in chain[i]["optimizer"]["param_groups"]]
    zero = tmp_path / "uc" / "ckpt_universal" / "zero"
    assert len(groups) > 2
    assert torch.load(zero / "optimizer_state.pt", weights_only=True)["param_groups"] == groups
    step = torch.load(zero / "model.layers.1.block_sparse_moe.experts.3.w2.weight" / "step.pt",
                      weights_only=True)
    assert step.item() == groups[0]["step"] == 2


def test_python_convert_to_universal_takes_the_config(tmp_path, saved):
    import reshard

    ckpt, config, state = saved("tp2pp2")
    reshard.checkpoint.convert(ckpt, tmp_path / "uc", to="universal", config=config)
    f = torch.load(tmp_path / "uc" / "ckpt_universal" / "zero" / "lm_head.weight" / "exp_avg.pt",
                   weights_only=True)
    assert same_bits(f["param"], expected(state)["lm_head.weight.exp_avg"])
    with pytest.raises(ValueError, match="config="):
        reshard.checkpoint.convert(ckpt, tmp_path / "uc2", to="universal")
    reshard.checkpoint.gather(ckpt, tmp_path / "hf", config=config, optimizer_state=True)
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert same_bits(got["model.norm.weight.exp_avg_sq"],
                     expected(state)["model.norm.weight.exp_avg_sq"])


# Cuts the first flattened-range chunk of each of KEYS in two at element AT of the range, the
# second starting SHIFT elements later (< 0: the ranges overlap, > 0: a hole), as two DP ranks
# save one parameter's shard: its .metadata (torch's pickle; Megatron 0.13's planner data in it
# needs megatron importable) names two chunks, each saved as Megatron 0.13's writer saves an item
# (a torch.save archive) in a further data file.
SPLIT = r"""
import io, os, pickle, sys, torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
path, at, shift, keys = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
meta = pickle.load(open(path, "rb"))
for key in keys:
    md = meta.state_dict_metadata[key]
    chunk = md.chunks[0]
    info = meta.storage_data.pop(MetadataIndex(key, chunk.offsets))
    with open(os.path.join(os.path.dirname(path), info.relative_path), "rb") as f:
        f.seek(info.offset)
        data = torch.load(io.BytesIO(f.read(info.length)))
    n, second = chunk.sizes[-1], at + shift
    parts = [(chunk.offsets, data[..., :at]),
             (torch.Size([*chunk.offsets[:-1], chunk.offsets[-1] + second]), data[..., second:])]
    md.chunks[0:1] = [ChunkStorageMetadata(offsets=o, sizes=t.shape) for o, t in parts]
    name = "__split_" + str(len(meta.storage_data)) + ".distcp"
    with open(os.path.join(os.path.dirname(path), name), "wb") as f:
        for o, t in parts:
            b = io.BytesIO()
            torch.save(t.clone(), b)
            meta.storage_data[MetadataIndex(key, o)] = type(info)(name, f.tell(),
                                                                  len(b.getvalue()))
            f.write(b.getvalue())
pickle.dump(meta, open(path, "wb"))
"""
FLAT_KEYS = ["optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight",
             "optimizer.state.fp32_param.embedding.word_embeddings.weight",
             "optimizer.state.exp_avg_sq.decoder.layers.mlp.linear_fc1.weight"]


def split_ranges(ckpt, tmp_path, name, shift=0, keys=FLAT_KEYS, at=300):
    copy = tmp_path / name
    shutil.copytree(ckpt, copy)
    r = subprocess.run([megatron_python(), "-c", SPLIT, str(copy / ".metadata"), str(at),
                        str(shift), *keys], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=megatron_013()))
    assert r.returncode == 0, r.stderr[-4000:]
    return copy


@pytest.mark.parametrize("layout", ["tp2pp2", "tp1dp2_3l"])
def test_flattened_ranges_are_what_megatron_013_loads(reshard_bin, tmp_path, saved, layout):
    ckpt, config, state = saved(layout, "fully_sharded_model_space")
    want = expected(state, layout)
    sources = [ckpt]
    if layout == "tp2pp2":
        # Also with ranges cut inside rows (the first range ends at element 300 of a 1024- or
        # 768-element block), as DP ranks may hold them.
        sources.append(split_ranges(ckpt, tmp_path, "split"))
    for src in sources:
        out = tmp_path / f"hf_{src.name}"
        r = run(reshard_bin, "gather", src, "-o", out, "--config", config, "--optimizer-state")
        assert r.returncode == 0, r.stderr
        got = load_file(str(out / "model.safetensors"))
        for k, v in want.items():
            assert same_bits(got[k], v), (src.name, k)
    r = run(reshard_bin, "convert", src, "--config", config, "--to", "universal", "-o",
            tmp_path / "uc")
    assert r.returncode == 0, r.stderr
    f = torch.load(tmp_path / "uc" / f"{src.name}_universal" / "zero" /
                   "model.embed_tokens.weight" / "fp32.pt", weights_only=True)
    assert same_bits(f["param"], want["model.embed_tokens.weight.fp32"])


@pytest.mark.parametrize("shift,needle", [(-20, "overlap"), (20, "cover")],
                         ids=["overlap", "hole"])
def test_flattened_ranges_that_overlap_or_leave_holes_are_refused(reshard_bin, tmp_path, saved,
                                                                   shift, needle):
    ckpt, config, _ = saved("tp2pp2", "fully_sharded_model_space")
    bad = split_ranges(ckpt, tmp_path, "bad", shift, FLAT_KEYS[:1])
    for args in (["gather", "--optimizer-state"], ["convert", "--to", "universal"],
                 ["convert", "--tp", 2]):
        out = tmp_path / "out"
        r = run(reshard_bin, args[0], bad, *args[1:], "-o", out, "--config", config)
        assert r.returncode in (1, 2), (args, r.stderr)
        assert str(bad) in r.stderr and FLAT_KEYS[0] in r.stderr, (args, r.stderr)
        assert needle in r.stderr and "uncaught" not in r.stderr, (args, r.stderr)
        assert not out.exists()


def test_a_state_missing_or_no_state_at_all_is_refused(reshard_bin, tmp_path, saved):
    ckpt, config, _ = saved("tp2pp2")
    key = "optimizer.state.exp_avg_sq.decoder.layers.mlp.linear_fc2.weight"
    for name, edit, needle in [
            ("missing", f"del md[{key!r}]", "does not hold it whole"),
            ("none", "[md.pop(k) for k in list(md) if k.startswith('optimizer.')]",
             "holds no distributed-optimizer state")]:
        bad = tmp_path / name
        shutil.copytree(ckpt, bad)
        script = ("import pickle, sys, torch\n"
                  "meta = pickle.load(open(sys.argv[1], 'rb'))\n"
                  f"md = meta.state_dict_metadata\n{edit}\n"
                  "pickle.dump(meta, open(sys.argv[1], 'wb'))\n")
        r = subprocess.run([megatron_python(), "-c", script, str(bad / ".metadata")],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-4000:]
        out = tmp_path / "out"
        r = run(reshard_bin, "gather", bad, "-o", out, "--config", config, "--optimizer-state")
        assert r.returncode == 2, (name, r.stderr)
        assert str(bad) in r.stderr and needle in r.stderr, r.stderr
        assert not out.exists()
        # The weights alone still read.
        r = run(reshard_bin, "gather", bad, "-o", tmp_path / f"w_{name}", "--config", config)
        assert r.returncode == 0, r.stderr


def test_a_parameter_without_any_state_keeps_its_weight(reshard_bin, tmp_path, saved):
    """A parameter whose distributed-optimizer state is absent while the others' is there (a
    frozen output layer): --to universal keeps its weight as a folder with fp32.pt alone (as
    from DCP, no step.pt), the others as before; gather --optimizer-state, which would write it
    without states, refuses naming it (exit 2); its weights alone still gather."""
    ckpt, config, state = saved("tp2pp2")
    want = expected(state)
    bad = tmp_path / "frozen"
    shutil.copytree(ckpt, bad)
    script = ("import pickle, sys, torch\n"
              "meta = pickle.load(open(sys.argv[1], 'rb'))\n"
              "md = meta.state_dict_metadata\n"
              "gone = [k for k in md if k.startswith('optimizer.state.')\n"
              "        and k.endswith('.output_layer.weight')]\n"
              "assert len(gone) == 3, gone\n"
              "[md.pop(k) for k in gone]\n"
              "pickle.dump(meta, open(sys.argv[1], 'wb'))\n")
    r = subprocess.run([megatron_python(), "-c", script, str(bad / ".metadata")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    out = tmp_path / "uc"
    r = run(reshard_bin, "convert", bad, "--config", config, "--to", "universal", "-o", out)
    assert r.returncode == 0, r.stderr
    zero = out / (out / "latest_universal").read_text() / "zero"
    params = sorted(p.name for p in zero.iterdir() if p.is_dir())
    assert params == sorted(k[:-len(".fp32")] for k in want if k.endswith(".fp32"))
    assert sorted(p.name for p in (zero / "lm_head.weight").iterdir()) == ["fp32.pt"]
    f = torch.load(zero / "lm_head.weight" / "fp32.pt", weights_only=True)
    assert same_bits(f["param"], want["lm_head.weight.fp32"])
    assert sorted(p.name for p in (zero / "model.norm.weight").iterdir()) == [
        "exp_avg.pt", "exp_avg_sq.pt", "fp32.pt", "step.pt"]
    r = run(reshard_bin, "gather", bad, "-o", tmp_path / "hf", "--config", config,
            "--optimizer-state")
    assert r.returncode == 2 and '"output_layer.weight"' in r.stderr, r.stderr
    assert "frozen" in r.stderr and not (tmp_path / "hf").exists()
    r = run(reshard_bin, "gather", bad, "-o", tmp_path / "w", "--config", config)
    assert r.returncode == 0, r.stderr
    # The universal checkpoint reads back: the frozen weight beside the others.
    r = run(reshard_bin, "gather", out, "-o", tmp_path / "back")
    assert r.returncode == 0, r.stderr
    assert same_bits(load_file(str(tmp_path / "back" / "model.safetensors"))["lm_head.weight"],
                     want["lm_head.weight.fp32"])


def test_megatrons_dp_reshardable_buckets_are_refused(reshard_bin, tmp_path, saved):
    """The dp_reshardable sharding type saves each DP rank's flat bucket buffers, which do not
    name their parameters: refused when the state is asked for, the weights still read."""
    ckpt, config, _ = saved("tp1dp2", "dp_reshardable")
    out = tmp_path / "out"
    r = run(reshard_bin, "gather", ckpt, "-o", out, "--config", config, "--optimizer-state")
    assert r.returncode == 2, r.stderr
    assert "dp_reshardable" in r.stderr and "fully_reshardable" in r.stderr, r.stderr
    assert not out.exists()
    r = run(reshard_bin, "gather", ckpt, "-o", out, "--config", config)
    assert r.returncode == 0, r.stderr


# DeepSpeed's universal loader (the engine's _load_zero_checkpoint with "load_universal": what
# load_checkpoint runs for the optimizer, without the model-states files Megatron has none of)
# at ZeRO 1 over DP 2, into the same model as transformers builds it from config.json, the
# optimizer configured with other hyperparameters than Megatron's: it writes what it then holds.
DS_LOAD = r"""
import datetime, json, os, sys, torch, deepspeed, transformers
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
uc, tag, config, out = sys.argv[1:5]
deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=120))
model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**json.load(open(config))))
cfg = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
       "optimizer": {"type": "AdamW", "params": {"lr": 0.5, "betas": [0.5, 0.5],
                                                 "weight_decay": 0.5, "torch_adam": True}},
       "zero_optimization": {"stage": 1}, "checkpoint": {"load_universal": True}}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                       config=cfg)
engine._load_zero_checkpoint(uc, tag, load_optimizer_states=True)
held = {n: {"fp32": safe_get_full_fp32_param(p),
            "exp_avg": safe_get_full_optimizer_state(p, "exp_avg"),
            "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq")}
        for n, p in engine.module.named_parameters()}
base = engine.optimizer.optimizer
steps = [base.state[p]["step"] for g in base.param_groups for p in g["params"]]
groups = [{k: v for k, v in g.items() if k != "params"} for g in base.param_groups]
if torch.distributed.get_rank() == 0:
    torch.save({"held": held, "steps": steps, "groups": groups}, out)
torch.distributed.barrier()
torch.distributed.destroy_process_group()
os._exit(0)  # as worker_exit.py ends a worker, and why
"""


def test_deepspeed_loads_the_step_and_hyperparameters_of_the_universal_checkpoint(
        reshard_bin, tmp_path, saved):
    """step.pt and zero/optimizer_state.pt from Megatron's common.pt (read by reshard's pickle
    reader): DeepSpeed's own universal loader restores Megatron's step (2), learning rate,
    betas and weight decay over the ones it was configured with, and the fp32 weights and
    moments of the files."""
    from ds_checkpoints import _train_env, free_loopback_port

    ckpt, config, state = saved("tp2pp2")
    want = expected(state)
    out = tmp_path / "uc"
    r = run(reshard_bin, "convert", ckpt, "--config", config, "--to", "universal", "-o", out)
    assert r.returncode == 0, r.stderr
    common = torch.load(ckpt / "common.pt", weights_only=False)
    megatron_groups = common["optimizer"]["optimizer"]["param_groups"]
    zero = out / "ckpt_universal" / "zero"
    written = torch.load(zero / "optimizer_state.pt", weights_only=True)
    assert written["param_groups"] == megatron_groups
    for p in zero.iterdir():
        if p.is_dir():
            step = torch.load(p / "step.pt", weights_only=True)
            assert step.dtype == torch.float32 and step.dim() == 0 and step.item() == 2, p
    script = tmp_path / "ds_load.py"
    script.write_text(DS_LOAD)
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_addr", "127.0.0.1", "--master_port", str(free_loopback_port()), str(script),
         str(out), "ckpt_universal", str(config), str(tmp_path / "held.pt")],
        capture_output=True, text=True, timeout=300, env=_train_env())
    assert r.returncode == 0, r.stderr[-4000:]
    got = torch.load(tmp_path / "held.pt", weights_only=False)
    assert [s.item() for s in got["steps"]] == [2.0] * len(got["steps"]), got["steps"]
    for k in ("lr", "betas", "eps", "weight_decay"):
        assert got["groups"][0][k] == megatron_groups[0][k], k
    for name, states in got["held"].items():
        for s, t in states.items():
            assert same_bits(t, want[f"{name}.{s}"]), (name, s)


def test_inspect_says_the_distributed_optimizer_and_what_is_not_recorded(reshard_bin, saved):
    """The run of a training checkpoint: the distributed optimizer's state over dp; at TP 1 x DP
    2 the second data-parallel rank wrote nothing (each box is written once), so dp is not
    recorded and said so, not guessed."""
    for name, axes, unknown in (("tp2pp2", {"tp": 2, "cp": 1, "dp": 1, "pp": 2}, ["cp"]),
                                ("moe", {"tp": 2, "cp": 1, "dp": 1, "pp": 2}, ["cp"]),
                                ("tp1dp2", {"tp": 1, "pp": 1}, ["dp", "cp"])):
        ckpt, _, _ = saved(name)
        r = run(reshard_bin, "inspect", ckpt, "--json")
        assert r.returncode == 0, r.stderr
        run_ = json.loads(r.stdout)["parallelism"]
        assert {a["name"]: a["size"] for a in run_["axes"]} == axes, (name, run_)
        assert (run_["optimizer"], run_["unknown"]) == ("distributed", unknown), (name, run_)
    text = run(reshard_bin, "inspect", saved("tp1dp2")[0]).stdout
    assert "distributed optimizer over dp; not recorded: dp, cp\n" in text, text
