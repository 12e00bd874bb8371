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
            want = reshard.extract(reshard.ParamMap.from_dict(m), f, r)
            assert to_bytes(shards[name]) == to_bytes(want), (name, r)
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


def flip_bit(path, name, index):
    """Flips the lowest bit of element `index` of tensor `name` in a safetensors file."""
    t = load_file(str(path))
    flat = t[name].view(-1)
    raw = flat[index : index + 1].view(torch.uint8)
    raw[0] ^= 1
    save_file(t, str(path), metadata={"format": "pt"})


def test_convert_verifies_replicas_unless_told(reshard_bin, tmp_path, full):
    sharded = scatter(reshard_bin, tmp_path, full, 4)
    # One bit of the pre-divided bias on rank 1, and of a replicated weight on rank 3.
    flip_bit(sharded / "model-rank-1-part-0.safetensors", "mlp.down.bias", 5)
    r = run(reshard_bin, "convert", sharded, "--tp", 2, "-o", tmp_path / "out")
    assert r.returncode == 1, r.stderr
    assert 'tensor "mlp.down.bias"' in r.stderr and "ranks 0 and 1" in r.stderr, r.stderr
    assert "element [5] of F" in r.stderr, r.stderr
    assert siblings(tmp_path / "out") == []
    flip_bit(sharded / "model-rank-1-part-0.safetensors", "mlp.down.bias", 5)
    flip_bit(sharded / "model-rank-3-part-0.safetensors", "attn.c_attn.weight", 12 * 16 + 2)
    r = run(reshard_bin, "convert", sharded, "--tp", 2, "-o", tmp_path / "out")
    assert r.returncode == 1, r.stderr
    assert 'tensor "attn.c_attn.weight"' in r.stderr and "ranks 0 and 3" in r.stderr, r.stderr
    assert "element [48, 2] of F" in r.stderr, r.stderr
    r = run(reshard_bin, "convert", sharded, "--tp", 2, "-o", tmp_path / "out", "--no-verify-replicas")
    assert r.returncode == 0, r.stderr


def test_a_file_serving_two_ranks_is_refused(reshard_bin, tmp_path, full):
    sharded = scatter(reshard_bin, tmp_path, full, 2)
    manifest_path = sharded / "reshard.json"
    good = manifest_path.read_text()
    manifest = json.loads(good)
    manifest["files"]["1"] = ["model-rank-0-part-0.safetensors"]
    manifest_path.write_text(json.dumps(manifest))
    for command in (["convert", sharded, "--tp", 4], ["gather", sharded]):
        r = run(reshard_bin, *command, "-o", tmp_path / "out")
        assert r.returncode == 2, r.stderr
        assert ('"model-rank-0-part-0.safetensors" is listed for rank 0 and again for rank 1'
                in r.stderr), r.stderr
        assert siblings(tmp_path / "out") == []
    # A link to rank 0's file under rank 1's name is the same file.
    manifest_path.write_text(good)
    rank1 = sharded / "model-rank-1-part-0.safetensors"
    rank1.unlink()
    rank1.symlink_to("model-rank-0-part-0.safetensors")
    r = run(reshard_bin, "convert", sharded, "--tp", 4, "-o", tmp_path / "out")
    assert r.returncode == 2, r.stderr
    assert "(listed for rank 1) is the same file as" in r.stderr, r.stderr
    # A tensor the manifest does not list is refused, naming the file's rank and the tensor.
    rank1.unlink()
    t = load_file(str(sharded / "model-rank-0-part-0.safetensors"))
    t["stray"] = torch.zeros(2)
    save_file(t, str(rank1), metadata={"format": "pt"})
    r = run(reshard_bin, "convert", sharded, "--tp", 4, "-o", tmp_path / "out")
    assert r.returncode == 2, r.stderr
    assert "rank 1's files hold tensor \"stray\"" in r.stderr, r.stderr


def half_bias_checkpoint(tmp_path, values, name="b"):
    d = tmp_path / "full"
    d.mkdir(exist_ok=True)
    save_file({name: torch.tensor(values, dtype=torch.float16)}, str(d / "model.safetensors"))
    (tmp_path / "l.json").write_text(json.dumps(
        {"version": 1, "*": {"family": "replicated", "pre_divided": True}}))
    return d


def test_a_scale_that_loses_a_value_is_refused_unless_allowed(reshard_bin, tmp_path):
    d = half_bias_checkpoint(tmp_path, [1e-5, 3e-5, 6e-8, 2])
    args = ["scatter", d, "--layouts", tmp_path / "l.json", "--tp", 4, "-o", tmp_path / "s"]
    r = run(reshard_bin, *args)
    assert r.returncode == 1, r.stderr
    assert 'tensor "b"' in r.stderr and "element [1] of F" in r.stderr, r.stderr
    assert "2.9981136e-05 multiplied by 0.25" in r.stderr, r.stderr
    assert "which scales back to 3.0040741e-05" in r.stderr, r.stderr
    assert "allow lossy scale" in r.stderr, r.stderr
    assert siblings(tmp_path / "s") == []
    r = run(reshard_bin, *args, "--allow-lossy-scale")
    assert r.returncode == 0, r.stderr
    r = run(reshard_bin, "gather", tmp_path / "s", "-o", tmp_path / "g")
    assert r.returncode == 0, r.stderr
    back = load_file(str(tmp_path / "g" / "model.safetensors"))["b"]
    assert back.tolist() == torch.tensor([1e-5, 3.004e-5, 0, 2], dtype=torch.float16).tolist()


def test_an_optimizer_state_that_overflows_its_scale_is_refused(reshard_bin, tmp_path):
    d = tmp_path / "full"
    d.mkdir()
    save_file({"b": torch.ones(4, dtype=torch.float16),
               "b.exp_avg": torch.tensor([1, 60000, 2, 3], dtype=torch.float16)},
              str(d / "model.safetensors"))
    (tmp_path / "l.json").write_text(json.dumps(
        {"version": 1, "*": {"family": "replicated", "pre_divided": True}}))
    args = ["scatter", d, "--layouts", tmp_path / "l.json", "--tp", 4, "-o", tmp_path / "s",
            "--allow-scaled-optimizer-state"]
    r = run(reshard_bin, *args)
    assert r.returncode == 1, r.stderr
    assert 'tensor "b.exp_avg"' in r.stderr and "60000 divided by 0.25 gives inf" in r.stderr
    r = run(reshard_bin, *args, "--allow-lossy-scale")
    assert r.returncode == 0, r.stderr
    shard = load_file(str(tmp_path / "s" / "model-rank-0-part-0.safetensors"))["b.exp_avg"]
    assert shard[1].item() == float("inf")


def test_a_factor_that_is_not_a_power_of_two_needs_allowing(reshard_bin, tmp_path):
    # TP 2 -> 3 moves a pre-divided bias at a factor of 2/3, which rounds.
    d = tmp_path / "full"
    d.mkdir()
    save_file({"mlp.down.bias": torch.randn(64, generator=torch.Generator().manual_seed(5))},
              str(d / "model.safetensors"))
    (tmp_path / "l.json").write_text(json.dumps(
        {"version": 1, "*": {"family": "replicated", "pre_divided": True}}))
    sharded = tmp_path / "tp2"
    r = run(reshard_bin, "scatter", d, "--layouts", tmp_path / "l.json", "--tp", 2, "-o", sharded)
    assert r.returncode == 0, r.stderr
    r = run(reshard_bin, "convert", sharded, "--tp", 3, "-o", tmp_path / "c")
    assert r.returncode == 1, r.stderr
    assert 'tensor "mlp.down.bias"' in r.stderr and "does not survive the scale" in r.stderr
    assert "warning" not in r.stderr
    r = run(reshard_bin, "convert", sharded, "--tp", 3, "-o", tmp_path / "c", "--allow-lossy-scale")
    assert r.returncode == 0, r.stderr
    assert 'warning: parameter "mlp.down.bias"' in r.stderr and "not a power of two" in r.stderr
    # Gathering undoes 1/3 in float; every value held at TP 3 survives that here, so the
    # gather is exact and needs no allowing.
    r = run(reshard_bin, "gather", tmp_path / "c", "-o", tmp_path / "g")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("layouts", [
    {"*": {"family": "replicated", "pre_divided": True}},
    {"b": {"family": "replicated", "pre_divided": True}, "*": {"family": "replicated"}},
])
def test_optimizer_states_take_their_parameters_layout_before_a_default(reshard_bin, tmp_path,
                                                                       layouts):
    d = tmp_path / "full"
    d.mkdir()
    tensors = {"b": torch.tensor([1.0, 2.0]), "b.exp_avg": torch.tensor([0.5, -3.0]),
               "w": torch.tensor([4.0, 8.0])}
    save_file(tensors, str(d / "model.safetensors"))
    (tmp_path / "l.json").write_text(json.dumps({"version": 1, **layouts}))
    args = ["scatter", d, "--layouts", tmp_path / "l.json", "--tp", 2, "-o", tmp_path / "s"]
    r = run(reshard_bin, *args)
    assert r.returncode == 1, r.stderr
    assert "learning rate" in r.stderr and "b.exp_avg" in r.stderr, r.stderr
    r = run(reshard_bin, *args, "--allow-scaled-optimizer-state")
    assert r.returncode == 0, r.stderr
    manifest = json.loads((tmp_path / "s" / "reshard.json").read_text())
    assert manifest["params"]["b.exp_avg"]["scale_power"] == -1
    assert manifest["params"]["b.exp_avg"]["layout"] == manifest["params"]["b"]["layout"]
    shard = load_file(str(tmp_path / "s" / "model-rank-1-part-0.safetensors"))
    assert shard["b.exp_avg"].tolist() == [1.0, -6.0]  # F * (1/2)^-1
