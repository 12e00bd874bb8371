"""Checkpoints on disk end to end: scatter, convert, gather through the CLI, on files the
official `safetensors` package writes and reads; and every failure leaves nothing behind."""

import hashlib
import json
import os
import resource
import signal
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

import reshard
from torch_ref import to_bytes

LAYOUTS = {
    "version": 1,
    "embed.weight": {"family": "padded_vocab", "dim": 0},
    "attn.c_attn.weight": {"family": "segmented", "dim": 0,
                           "parts": [{"size": 48, "heads": 12}, {"size": 8, "replicated": True}]},
    "attn.qkv.weight": {"family": "codegen_qkv", "dim": 0, "heads": 32},
    "attn.v.weight": {"family": "block_gather", "dim": 0, "pairing": "shared_qk", "heads": 8},
    "mlp.gate_up.weight": {"family": "fused", "dim": 0, "parts": 2},
    "mlp.down.weight": {"family": "split", "dim": 1},
    "mlp.down.bias": {"family": "replicated", "pre_divided": True},
    "*": {"family": "replicated"},
}


def model(seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    return {
        "embed.weight": r(50, 16),
        "attn.c_attn.weight": r(56, 16),
        "attn.qkv.weight": r(3 * 64, 16),
        "attn.v.weight": r(8 * 4, 16),
        "mlp.gate_up.weight": r(96, 16),
        "mlp.down.weight": r(16, 48),
        "mlp.down.bias": torch.randn(16, generator=g),  # F32
        "norm.weight": r(16),
    }


def run(reshard_bin, *args, **kw):
    return subprocess.run([reshard_bin, *map(str, args)], capture_output=True, text=True, timeout=300, **kw)


def tree_hash(path):
    h = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(path)):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(root, f)
            h.update(p[len(str(path)):].encode())
            with open(p, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


def siblings(path):
    """`path` itself and any temporary sibling made for it (".<name>.tmp-*", ".<name>.old-*")."""
    parent, name = os.path.split(str(path))
    return sorted(f for f in os.listdir(parent) if f == name or f.startswith(f".{name}."))


@pytest.fixture
def full(tmp_path):
    d = tmp_path / "full"
    d.mkdir()
    save_file(model(), str(d / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "layouts.json").write_text(json.dumps(LAYOUTS))
    return d


def scatter(reshard_bin, tmp_path, full, tp, name="tp"):
    out = tmp_path / f"{name}{tp}"
    r = run(reshard_bin, "scatter", full, "--layouts", tmp_path / "layouts.json", "--tp", tp, "-o", out)
    assert r.returncode == 0, r.stderr
    return out


def test_scatter_writes_shards_equal_to_extraction(reshard_bin, tmp_path, full):
    out = scatter(reshard_bin, tmp_path, full, 4)
    manifest = json.loads((out / "reshard.json").read_text())
    assert manifest["format"] == "reshard" and manifest["world_size"] == 4
    assert manifest["files"]["2"] == ["model-rank-2-part-0.safetensors"]
    assert manifest["params"]["embed.weight"]["map"]["valid_shape"] == [50, 16]
    assert manifest["params"]["embed.weight"]["map"]["logical_shape"] == [52, 16]
    original = model()
    for r in range(4):
        shards = load_file(str(out / f"model-rank-{r}-part-0.safetensors"))
        assert set(shards) == set(original)
        for name, t in original.items():
            m = manifest["params"][name]["map"]
            f = t
            if "valid_shape" in m:  # padded: F is the tensor plus zero rows
                f = torch.zeros(m["logical_shape"], dtype=t.dtype)
                f[: t.shape[0]] = t
            want = reshard.extract(json.dumps(m), to_bytes(f), manifest["params"][name]["dtype"], r)
            assert to_bytes(shards[name]) == want, (name, r)
    assert load_file(str(out / "model-rank-1-part-0.safetensors"))["mlp.down.bias"].equal(
        original["mlp.down.bias"] / 4)


@pytest.mark.parametrize("path", [[4, 2, 1], [4, 2, 4], [2, 4, 2], [4, 1, 2], [1, 4, 2]])
def test_convert_chains_and_gather_round_trip_bit_exactly(reshard_bin, tmp_path, full, path):
    current = scatter(reshard_bin, tmp_path, full, path[0])
    for i, tp in enumerate(path[1:]):
        nxt = tmp_path / f"conv{i}-{tp}"
        r = run(reshard_bin, "convert", current, "--tp", tp, "-o", nxt)
        assert r.returncode == 0, r.stderr
        # The converted shards equal a direct scatter at that degree.
        direct = scatter(reshard_bin, tmp_path, full, tp, name=f"direct{i}-")
        for rank in range(tp):
            a = load_file(str(nxt / f"model-rank-{rank}-part-0.safetensors"))
            b = load_file(str(direct / f"model-rank-{rank}-part-0.safetensors"))
            for name in a:
                assert to_bytes(a[name]) == to_bytes(b[name]), (name, rank, tp)
        current = nxt
    out = tmp_path / "gathered"
    r = run(reshard_bin, "gather", current, "-o", out)
    assert r.returncode == 0, r.stderr
    back = load_file(str(out / "model.safetensors"))
    for name, t in model().items():
        assert back[name].dtype == t.dtype and to_bytes(back[name]) == to_bytes(t), name


def test_gather_with_max_shard_size_writes_an_index(reshard_bin, tmp_path, full):
    sharded = scatter(reshard_bin, tmp_path, full, 2)
    out = tmp_path / "parts"
    r = run(reshard_bin, "gather", sharded, "-o", out, "--max-shard-size", "4KB")
    assert r.returncode == 0, r.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0].startswith("model-00001-of-")
    original = model()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in original.values())
    loaded = {}
    for f in files:
        loaded.update(load_file(str(out / f)))
    assert set(loaded) == set(original)
    for name, t in original.items():
        assert to_bytes(loaded[name]) == to_bytes(t)
    # An index checkpoint scatters like a single file.
    r = run(reshard_bin, "scatter", out, "--layouts", tmp_path / "layouts.json", "--tp", 2, "-o", tmp_path / "again")
    assert r.returncode == 0, r.stderr


def test_existing_output_is_never_touched_without_force(reshard_bin, tmp_path, full):
    out = scatter(reshard_bin, tmp_path, full, 2)
    before = tree_hash(out)
    r = run(reshard_bin, "scatter", full, "--layouts", tmp_path / "layouts.json", "--tp", 4, "-o", out)
    assert r.returncode == 2 and "--force" in r.stderr
    assert tree_hash(out) == before
    r = run(reshard_bin, "scatter", full, "--layouts", tmp_path / "layouts.json", "--tp", 4, "-o", out, "--force")
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "reshard.json").read_text())["world_size"] == 4
    assert siblings(out) == ["tp2"] and siblings(tmp_path / "out") == []


def corrupt_cases():
    def missing_rank_file(d):
        os.remove(d / "model-rank-1-part-0.safetensors")

    def shape_mismatch(d):
        t = load_file(str(d / "model-rank-1-part-0.safetensors"))
        t["mlp.down.weight"] = t["mlp.down.weight"][:, :-1].contiguous()
        save_file(t, str(d / "model-rank-1-part-0.safetensors"))

    def dtype_mismatch(d):
        t = load_file(str(d / "model-rank-0-part-0.safetensors"))
        t["norm.weight"] = t["norm.weight"].to(torch.float16)
        save_file(t, str(d / "model-rank-0-part-0.safetensors"))

    def truncated(d):
        p = d / "model-rank-1-part-0.safetensors"
        data = p.read_bytes()
        p.write_bytes(data[:-10])

    def bad_manifest(d):
        (d / "reshard.json").write_text('{"format": "reshard", "version": 7}')

    return [(missing_rank_file, "model-rank-1-part-0.safetensors"), (shape_mismatch, "shape"),
            (dtype_mismatch, "F16"), (truncated, "truncated"), (bad_manifest, "version 7")]


@pytest.mark.parametrize("damage,fragment", corrupt_cases(), ids=lambda x: getattr(x, "__name__", ""))
def test_malformed_inputs_exit_2_and_leave_nothing(reshard_bin, tmp_path, full, damage, fragment):
    sharded = scatter(reshard_bin, tmp_path, full, 2)
    damage(sharded)
    before = tree_hash(sharded)
    for args in (["gather", sharded, "-o", tmp_path / "out"],
                 ["convert", sharded, "--tp", 4, "-o", tmp_path / "out"]):
        r = run(reshard_bin, *args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert fragment in r.stderr, r.stderr
        assert siblings(tmp_path / "out") == []
    assert tree_hash(sharded) == before  # inputs are read-only


def test_full_disk_leaves_nothing(reshard_bin, tmp_path, full):
    sharded = scatter(reshard_bin, tmp_path, full, 2)

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))

    for args in (["gather", sharded, "-o", tmp_path / "out"],
                 ["convert", sharded, "--tp", 4, "-o", tmp_path / "out"],
                 ["scatter", full, "--layouts", tmp_path / "layouts.json", "--tp", 4, "-o", tmp_path / "out"]):
        r = run(reshard_bin, *args, preexec_fn=small_files)
        assert r.returncode == 3, (args, r.stderr)
        assert siblings(tmp_path / "out") == [], args


def test_disagreeing_replicas_fail_gather_unless_told(reshard_bin, tmp_path, full):
    sharded = scatter(reshard_bin, tmp_path, full, 2)
    p = sharded / "model-rank-1-part-0.safetensors"
    t = load_file(str(p))
    t["norm.weight"][3] += 1
    save_file(t, str(p), metadata={"format": "pt"})
    r = run(reshard_bin, "gather", sharded, "-o", tmp_path / "out")
    assert r.returncode == 1
    assert "ranks 0 and 1" in r.stderr and "[3]" in r.stderr and "norm.weight" in r.stderr
    assert siblings(tmp_path / "out") == []
    r = run(reshard_bin, "gather", sharded, "-o", tmp_path / "out", "--no-verify-replicas")
    assert r.returncode == 0, r.stderr


def test_optimizer_states_move_with_their_parameters(reshard_bin, tmp_path):
    d = tmp_path / "full"
    d.mkdir()
    g = torch.Generator().manual_seed(3)
    tensors = {"w": torch.randn(8, 4, generator=g), "w.exp_avg": torch.randn(8, 4, generator=g),
               "w.exp_avg_sq": torch.rand(8, 4, generator=g), "b": torch.randn(4, generator=g),
               "b.exp_avg": torch.randn(4, generator=g)}
    save_file(tensors, str(d / "model.safetensors"))
    (tmp_path / "l.json").write_text(json.dumps({"version": 1, "w": {"family": "split", "dim": 0},
                                                 "b": {"family": "replicated", "pre_divided": True}}))
    r = run(reshard_bin, "scatter", d, "--layouts", tmp_path / "l.json", "--tp", 2, "-o", tmp_path / "s")
    assert r.returncode == 1
    assert "learning rate" in r.stderr and "b.exp_avg" in r.stderr
    assert siblings(tmp_path / "s") == []
    r = run(reshard_bin, "scatter", d, "--layouts", tmp_path / "l.json", "--tp", 2, "-o", tmp_path / "s",
            "--allow-scaled-optimizer-state")
    assert r.returncode == 0, r.stderr
    manifest = json.loads((tmp_path / "s" / "reshard.json").read_text())
    assert manifest["params"]["w.exp_avg"]["scale_power"] == -1
    assert manifest["params"]["w.exp_avg_sq"]["scale_power"] == -2
    shard = load_file(str(tmp_path / "s" / "model-rank-1-part-0.safetensors"))
    assert shard["b.exp_avg"].equal(tensors["b.exp_avg"] * 2)  # F * (1/2)^-1
    assert shard["w.exp_avg"].equal(tensors["w.exp_avg"][4:])
    r = run(reshard_bin, "convert", tmp_path / "s", "--tp", 1, "-o", tmp_path / "c")
    assert r.returncode == 1 and "learning rate" in r.stderr
    r = run(reshard_bin, "convert", tmp_path / "s", "--tp", 1, "-o", tmp_path / "c", "--allow-scaled-optimizer-state")
    assert r.returncode == 0, r.stderr
    r = run(reshard_bin, "gather", tmp_path / "c", "-o", tmp_path / "g", "--allow-scaled-optimizer-state")
    assert r.returncode == 0, r.stderr
    back = load_file(str(tmp_path / "g" / "model.safetensors"))
    for name, t in tensors.items():
        assert back[name].equal(t), name


def test_usage_errors(reshard_bin, tmp_path, full):
    assert run(reshard_bin, "scatter", full, "-o", tmp_path / "x").returncode == 2
    assert run(reshard_bin, "scatter", full, "--layouts", tmp_path / "layouts.json", "-o", tmp_path / "x").returncode == 2
    r = run(reshard_bin, "gather", tmp_path / "nope", "-o", tmp_path / "x")
    assert r.returncode == 2 and "nope" in r.stderr
    r = run(reshard_bin, "gather", full, "-o", tmp_path / "x")
    assert r.returncode == 2 and "reshard.json" in r.stderr
    r = run(reshard_bin, "convert", full, "--tp", 0, "-o", tmp_path / "x")
    assert r.returncode == 2
    (tmp_path / "bad.json").write_text(json.dumps({"version": 1, "*": {"family": "split", "dim": 3}}))
    r = run(reshard_bin, "scatter", full, "--layouts", tmp_path / "bad.json", "--tp", 2, "-o", tmp_path / "x")
    assert r.returncode in (1, 2) and "layout of" in r.stderr and "dimension 3" in r.stderr
    assert siblings(tmp_path / "x") == []


TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 96,
              "num_hidden_layers": 2, "tie_word_embeddings": False}


def tiny_llama_checkpoint(path):
    g = torch.Generator().manual_seed(11)
    h, kv, inter, vocab = 64, 2 * 16, 128, 96
    t = {"model.embed_tokens.weight": torch.randn(vocab, h, generator=g),
         "model.norm.weight": torch.randn(h, generator=g), "lm_head.weight": torch.randn(vocab, h, generator=g)}
    for layer in range(2):
        p = f"model.layers.{layer}."
        t[p + "self_attn.q_proj.weight"] = torch.randn(h, h, generator=g)
        t[p + "self_attn.k_proj.weight"] = torch.randn(kv, h, generator=g)
        t[p + "self_attn.v_proj.weight"] = torch.randn(kv, h, generator=g)
        t[p + "self_attn.o_proj.weight"] = torch.randn(h, h, generator=g)
        t[p + "mlp.gate_proj.weight"] = torch.randn(inter, h, generator=g)
        t[p + "mlp.up_proj.weight"] = torch.randn(inter, h, generator=g)
        t[p + "mlp.down_proj.weight"] = torch.randn(h, inter, generator=g)
        t[p + "input_layernorm.weight"] = torch.randn(h, generator=g)
        t[p + "post_attention_layernorm.weight"] = torch.randn(h, generator=g)
    path.mkdir()
    save_file(t, str(path / "model.safetensors"))
    return t


def test_scatter_by_config_uses_the_models_tp_plan(reshard_bin, tmp_path):
    tensors = tiny_llama_checkpoint(tmp_path / "full")
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    r = run(reshard_bin, "scatter", tmp_path / "full", "--config", tmp_path / "config.json", "--tp", 2,
            "-o", tmp_path / "tp2")
    assert r.returncode == 0, r.stderr
    manifest = json.loads((tmp_path / "tp2" / "reshard.json").read_text())
    q = manifest["params"]["model.layers.0.self_attn.q_proj.weight"]
    assert q["map"]["ranks"]["1"]["shard_shape"] == [32, 64]           # colwise: output rows
    o = manifest["params"]["model.layers.1.self_attn.o_proj.weight"]
    assert o["map"]["ranks"]["1"]["shard_shape"] == [64, 32]           # rowwise: input columns
    norm = manifest["params"]["model.norm.weight"]["map"]
    assert norm["ranks"]["0"]["pieces"][0]["locations"] == [0, 1]      # not in the plan: replicated
    # The same maps as `reshard degree --emit-maps`.
    r = run(reshard_bin, "degree", tmp_path / "config.json", "--tp", 2, "--emit-maps", tmp_path / "maps.json",
            "--weights", tmp_path / "full")
    assert r.returncode == 0, r.stderr
    emitted = json.loads((tmp_path / "maps.json").read_text())
    for name, p in manifest["params"].items():
        assert emitted[name] == p["map"], name
    # The recorded layouts let it convert, and everything comes back.
    assert run(reshard_bin, "convert", tmp_path / "tp2", "--tp", 1, "-o", tmp_path / "tp1").returncode == 0
    assert run(reshard_bin, "gather", tmp_path / "tp1", "-o", tmp_path / "back").returncode == 0
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    for name, t in tensors.items():
        assert back[name].equal(t), name
    # A degree the plan cannot take is refused before anything is written.
    r = run(reshard_bin, "scatter", tmp_path / "full", "--config", tmp_path / "config.json", "--tp", 3,
            "-o", tmp_path / "tp3")
    assert r.returncode == 1 and "attention heads" in r.stderr
    assert siblings(tmp_path / "tp3") == []
