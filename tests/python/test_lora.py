"""PEFT LoRA adapters as checkpoints, against PEFT and transformers.

A toy Llama (transformers) with a rank-8 adapter made by PEFT on q, k, v, o, gate, up, down and
the embedding (random A and B). `scatter ADAPTER --config BASE/config.json --tp 2` must lay the
adapter out so that every rank merges its own shard of the base weight: W_j + s * B_j @ A_j
(transposed for the embedding) equals rank j's shard of PEFT's `merge_and_unload()` model, which
the same scatter lays out from the same config. Gather gives the adapter back bit for bit (PEFT
loads it), convert moves it between degrees, inspect shows r, alpha and scaling, and what cannot
be laid out is refused naming the tensor, with nothing written.
"""

import json
import math
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "embed_tokens"]
ALPHA, R = 16, 8


def run(reshard_bin, *args):
    return subprocess.run([reshard_bin, *map(str, args)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(20261206)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(root / "base")
    lora = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS,
                           init_lora_weights=False)
    peft_model = peft.get_peft_model(model, lora)
    peft_model.save_pretrained(root / "adapter")
    ids = torch.arange(3, 19).reshape(1, -1)
    with torch.no_grad():
        logits = peft_model(ids).logits
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(root / "merged")
    return root, ids, logits


def rank_tensors(directory, rank):
    out = {}
    for f in sorted(directory.glob(f"model-rank-{rank}-*.safetensors")):
        out.update(load_file(f))
    return out


def test_scattered_adapter_merges_shard_by_shard(toy, reshard_bin):
    root, _, _ = toy
    config = root / "base" / "config.json"
    for name in ("base", "adapter", "merged"):
        r = run(reshard_bin, "scatter", root / name, "--config", config, "--tp", 2,
                "-o", root / f"{name}-tp2")
        assert r.returncode == 0, r.stderr
    scaling = ALPHA / R
    checked = set()
    for rank in range(2):
        base = rank_tensors(root / "base-tp2", rank)
        adapter = rank_tensors(root / "adapter-tp2", rank)
        merged = rank_tensors(root / "merged-tp2", rank)
        for name, a in adapter.items():
            if name.endswith(".lora_A.weight"):
                module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = adapter[name.replace("lora_A", "lora_B")]
                delta = b @ a
            elif name.endswith(".lora_embedding_A"):
                module = name.removeprefix("base_model.model.").removesuffix(".lora_embedding_A")
                delta = (adapter[name.replace("_A", "_B")] @ a).T
            else:
                continue
            w = base[module + ".weight"]
            # Each rank's B_j @ A_j has its shard's shape: column-parallel B is split as W's
            # rows (A whole), row-parallel A as W's columns (B whole).
            assert delta.shape == w.shape, name
            torch.testing.assert_close(w + scaling * delta, merged[module + ".weight"],
                                       rtol=1e-5, atol=1e-6)
            checked.add(module.split(".")[-1])
    assert checked == set(TARGETS)
    # The adapter is really split: a column-parallel B and a row-parallel A are halves.
    r0 = rank_tensors(root / "adapter-tp2", 0)
    full = load_file(root / "adapter" / "adapter_model.safetensors")
    q_b = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    o_a = "base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight"
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert r0[q_b].shape[0] * 2 == full[q_b].shape[0]
    assert r0[o_a].shape[1] * 2 == full[o_a].shape[1]
    assert torch.equal(r0[q_a], full[q_a])


def test_gather_and_convert_give_the_adapter_back(toy, reshard_bin, tmp_path):
    root, ids, logits = toy
    config = root / "base" / "config.json"
    r = run(reshard_bin, "scatter", root / "adapter", "--config", config, "--tp", 2,
            "-o", tmp_path / "tp2")
    assert r.returncode == 0, r.stderr
    r = run(reshard_bin, "convert", tmp_path / "tp2", "--tp", 1, "-o", tmp_path / "tp1")
    assert r.returncode == 0, r.stderr
    r = run(reshard_bin, "convert", tmp_path / "tp1", "--tp", 2, "-o", tmp_path / "tp2b")
    assert r.returncode == 0, r.stderr
    for rank in range(2):
        a, b = rank_tensors(tmp_path / "tp2", rank), rank_tensors(tmp_path / "tp2b", rank)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    original = load_file(root / "adapter" / "adapter_model.safetensors")
    for source in ("tp2", "tp1", "tp2b"):
        out = tmp_path / f"back-{source}"
        r = run(reshard_bin, "gather", tmp_path / source, "-o", out)
        assert r.returncode == 0, r.stderr
        assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json",
                                                         "adapter_model.safetensors"]
        back = load_file(out / "adapter_model.safetensors")
        assert back.keys() == original.keys()
        assert all(torch.equal(back[k], original[k]) for k in back), source
    # PEFT loads the gathered adapter and computes what it computed before.
    base = transformers.LlamaForCausalLM.from_pretrained(root / "base")
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "back-tp1")
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, logits)


def test_inspect_shows_rank_alpha_scaling_and_targets(toy, reshard_bin, tmp_path):
    root, _, _ = toy
    r = run(reshard_bin, "inspect", root / "adapter")
    assert r.returncode == 0, r.stderr
    assert f"LoRA adapter: r {R}, alpha {ALPHA}, scaling {ALPHA / R:g} (alpha/r)" in r.stdout
    assert all(t in r.stdout for t in TARGETS)
    rs = tmp_path / "rslora"
    shutil.copytree(root / "adapter", rs)
    cfg = json.loads((rs / "adapter_config.json").read_text())
    cfg["use_rslora"] = True
    (rs / "adapter_config.json").write_text(json.dumps(cfg))
    r = run(reshard_bin, "inspect", rs, "--json")
    assert r.returncode == 0, r.stderr
    adapter = json.loads(r.stdout)["adapter"]
    # PEFT's own scaling of the adapter it loads with this config.
    base = transformers.LlamaForCausalLM.from_pretrained(root / "base")
    loaded = peft.PeftModel.from_pretrained(base, rs)
    q = loaded.base_model.model.model.layers[0].self_attn.q_proj
    assert math.isclose(adapter["scaling"], q.scaling["default"], rel_tol=1e-15)
    assert adapter["scaling"] != ALPHA / R
    assert adapter["scaling_rule"] == "alpha/sqrt(r)"


def edited(root, tmp_path, config=None, tensors=None):
    out = tmp_path / "edited"
    shutil.copytree(root / "adapter", out)
    if config:
        cfg = json.loads((out / "adapter_config.json").read_text())
        cfg.update(config)
        (out / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors:
        t = load_file(out / "adapter_model.safetensors")
        tensors(t)
        save_file(t, out / "adapter_model.safetensors")
    return out


@pytest.mark.parametrize("case, code, words", [
    ("dora", 1, "DoRA"),
    ("rank", 2, "embed_tokens.lora_embedding_A\" has rank 8 (shape [8, 128]), but "
             "adapter_config.json says r = 4"),
    ("unpaired", 2, "has no B beside it"),
    ("pattern", 1, "rank_pattern"),
])
def test_refusals_name_the_tensor_and_write_nothing(toy, reshard_bin, tmp_path, case, code,
                                                     words):
    root, _, _ = toy
    q = "base_model.model.model.layers.1.self_attn.q_proj"
    adapter = {
        "dora": lambda: edited(root, tmp_path, config={"use_dora": True}),
        "rank": lambda: edited(root, tmp_path, config={"r": 4}),
        "unpaired": lambda: edited(root, tmp_path,
                                   tensors=lambda t: t.pop(q + ".lora_B.weight")),
        "pattern": lambda: edited(root, tmp_path, config={"rank_pattern": {"q_proj": 4}}),
    }[case]()
    r = run(reshard_bin, "scatter", adapter, "--config", root / "base" / "config.json",
            "--tp", 2, "-o", tmp_path / "out")
    assert r.returncode == code, r.stderr
    assert words in r.stderr
    if case == "unpaired":
        assert q + ".lora_A.weight" in r.stderr
    assert not (tmp_path / "out").exists()


Q1 = "base_model.model.model.layers.1.self_attn.q_proj"


def _nan_in_a(t):
    t[Q1 + ".lora_A.weight"][0, 0] = float("nan")


# What PEFT would not load as reshard read it, or what would merge to no finite weight: each
# case merged silently otherwise than PEFT's own merge (or into NaN) before reshard refused it.
@pytest.mark.parametrize("case, code, words", [
    ("untargeted", 2, "v_proj.lora_A.weight\" is of the module \"model.layers.0.self_attn.v_proj\","
                      " which adapter_config.json does not adapt"),
    ("regex", 2, "embed_tokens.lora_embedding_A\" is of the module"),
    ("excluded", 2, "q_proj.lora_A.weight\" is of the module"),
    ("layers", 2, "embed_tokens.lora_embedding_A\" is of the module"),
    ("saved", 2, "lm_head.lora_A.weight\" is of the module \"lm_head\""),
    ("two_a", 2, "are both the A of \"model.layers.1.self_attn.q_proj\""),
    ("mixed", 2, "pair an embedding's LoRA tensor with a linear layer's"),
    ("two_copies", 2, "are both a whole copy of \"model.embed_tokens.weight\""),
    ("copy_of_adapted", 2, "which PEFT saves as "
                           "\"base_model.model.model.embed_tokens.base_layer.weight\""),
    ("no_targets", 1, "records no target_modules"),
    ("nan", 2, "gives nan at element (0, 0) of the update"),
])
def test_merge_lora_refuses_what_peft_would_not_merge(toy, reshard_bin, tmp_path, case, code,
                                                      words):
    root, _, _ = toy
    embed = "base_model.model.model.embed_tokens"
    config, tensors = {
        "untargeted": ({"target_modules": [t for t in TARGETS if t != "v_proj"]}, None),
        "regex": ({"target_modules": r".*\.(q|k|v|o|gate|up|down)_proj"}, None),
        "excluded": ({"exclude_modules": ["q_proj"]}, None),
        "layers": ({"layers_to_transform": [1], "layers_pattern": "layers"}, None),
        "saved": ({"target_modules": TARGETS + ["lm_head"], "modules_to_save": ["lm_head"]},
                  lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.ones(R, 64),
                                      "base_model.model.lm_head.lora_B.weight":
                                      torch.ones(128, R)})),
        "two_a": (None, lambda t: t.update({Q1 + ".lora_embedding_A": torch.ones(R, 64)})),
        "mixed": (None, lambda t: t.update(
            {Q1 + ".lora_embedding_B": t.pop(Q1 + ".lora_B.weight")})),
        "two_copies": (None, lambda t: t.update({embed + ".weight": torch.ones(128, 64)})),
        "copy_of_adapted": (None, lambda t: t.update(
            {embed + ".weight": t.pop(embed + ".base_layer.weight")})),
        "no_targets": ({"target_modules": None}, None),
        "nan": (None, _nan_in_a),
    }[case]
    adapter = edited(root, tmp_path, config=config, tensors=tensors)
    r = run(reshard_bin, "merge-lora", root / "base", adapter, "-o", tmp_path / "out")
    assert r.returncode == code, r.stderr
    assert words in r.stderr
    assert not (tmp_path / "out").exists()


def test_merge_lora_shard_by_shard_refuses_a_nan_and_writes_nothing(toy, reshard_bin, tmp_path):
    root, _, _ = toy
    r = run(reshard_bin, "scatter", root / "base", "--config", root / "base" / "config.json",
            "--tp", 2, "-o", tmp_path / "base-tp2")
    assert r.returncode == 0, r.stderr
    adapter = edited(root, tmp_path, tensors=_nan_in_a)
    r = run(reshard_bin, "merge-lora", tmp_path / "base-tp2", adapter, "-o", tmp_path / "out")
    assert r.returncode == 2, r.stderr
    assert "layers.1.self_attn.q_proj.lora_A.weight\" gives nan at element (" in r.stderr
    assert not (tmp_path / "out").exists()


def test_merge_lora_takes_a_linear_layer_as_peft_does_whatever_fan_in_fan_out_says(
        toy, reshard_bin, tmp_path):
    """PEFT sets fan_in_fan_out aside for a torch Linear (with a warning); the non-square
    weights show that the modules are Linear ones, and the square q_proj and o_proj follow."""
    root, _, _ = toy
    adapter = edited(root, tmp_path, config={"fan_in_fan_out": True})
    r = run(reshard_bin, "merge-lora", root / "base", adapter, "-o", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    got = load_file(tmp_path / "out" / "model.safetensors")
    want = load_file(root / "merged" / "model.safetensors")  # PEFT's merge_and_unload()
    assert got.keys() == want.keys()
    for name in got:
        assert torch.equal(got[name], want[name]), name


def ulp_distance(x, y):
    """The largest distance between x and y in units in the last place (their bit patterns in
    sign-magnitude order)."""
    ints = {torch.float32: (torch.int32, 0x7FFFFFFF), torch.bfloat16: (torch.int16, 0x7FFF)}
    view, mask = ints[x.dtype]

    def ordered(t):
        i = t.contiguous().view(view).to(torch.int64)
        return torch.where(i < 0, -(i & mask), i)

    return int((ordered(x) - ordered(y)).abs().max())


# PEFT keeps a 16-bit model's adapter in float32 (autocast_adapter_dtype) unless told not to.
@pytest.mark.parametrize("dtype, autocast, max_ulp", [
    (torch.float32, True, 2), (torch.bfloat16, True, 1), (torch.bfloat16, False, 1)])
def test_merge_lora_equals_peft_merge_and_unload(reshard_bin, tmp_path, dtype, autocast,
                                                 max_ulp):
    torch.manual_seed(7)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(tmp_path / "base")
    lora = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS[:-1],
                           init_lora_weights=False)
    peft_model = peft.get_peft_model(model, lora, autocast_adapter_dtype=autocast)
    adapter_dtype = torch.float32 if autocast else dtype
    assert peft_model.base_model.model.model.layers[0].self_attn.q_proj.lora_A[
        "default"].weight.dtype == adapter_dtype
    # PEFT's random init leaves B small; scale it so that B @ A moves W by many of its ulps.
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(50)
    peft_model.save_pretrained(tmp_path / "adapter")
    ids = torch.arange(3, 11).reshape(1, -1)
    merged = peft_model.merge_and_unload()
    want = merged.state_dict()
    # Both generate from directories loaded the same way (a model cast in memory keeps its
    # rotary frequencies in the cast dtype, a loaded one in float32).
    merged.save_pretrained(tmp_path / "peft-merged")
    expected_tokens = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "peft-merged", dtype=dtype).generate(ids, max_new_tokens=8, do_sample=False)

    r = run(reshard_bin, "merge-lora", tmp_path / "base", tmp_path / "adapter",
            "-o", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert "14 weights took B @ A" in r.stdout  # 7 modules in each of 2 layers
    got = load_file(tmp_path / "out" / "model.safetensors")
    base = load_file(tmp_path / "base" / "model.safetensors")
    worst = 0
    moved = 0
    for name, w in base.items():
        assert got[name].dtype == dtype
        if not name.endswith(tuple(f"{t}.weight" for t in TARGETS[:-1])):
            assert torch.equal(got[name], w), name
            continue
        worst = max(worst, ulp_distance(got[name], want[name]))
        moved += int((got[name] != w).sum())
    print(f"{dtype} (adapter {adapter_dtype}): largest difference from PEFT's merge_and_unload: {worst} ulp")
    assert worst <= max_ulp
    assert moved > 0
    # transformers loads the merged directory and generates PEFT's tokens.
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", dtype=dtype)
    tokens = loaded.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(tokens, expected_tokens)


def test_merge_lora_refuses_a_target_the_base_lacks(toy, reshard_bin, tmp_path):
    root, _, _ = toy
    q = "base_model.model.model.layers.1.self_attn.q_proj"

    def rename(t):
        for part in ("lora_A", "lora_B"):
            t[f"{q}_x.{part}.weight"] = t.pop(f"{q}.{part}.weight")

    adapter = edited(root, tmp_path, config={"target_modules": TARGETS + ["q_proj_x"]},
                     tensors=rename)
    r = run(reshard_bin, "merge-lora", root / "base", adapter, "-o", tmp_path / "out")
    assert r.returncode == 1, r.stderr
    assert "layers.1.self_attn.q_proj_x.weight\", which the base checkpoint does not hold" in (
        r.stderr)
    assert not (tmp_path / "out").exists()
    dora = tmp_path / "dora"
    shutil.copytree(root / "adapter", dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (dora / "adapter_config.json").write_text(json.dumps(cfg))
    r = run(reshard_bin, "merge-lora", root / "base", dora, "-o", tmp_path / "out")
    assert r.returncode == 1 and "DoRA" in r.stderr
    assert not (tmp_path / "out").exists()


def test_merge_lora_of_a_fan_in_fan_out_adapter(reshard_bin, tmp_path):
    """GPT-2's Conv1D holds its weight [in, out]: B @ A is merged transposed."""
    torch.manual_seed(11)
    config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                     n_positions=64)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(tmp_path / "base")
    lora = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["c_attn", "c_proj", "c_fc"],
                           fan_in_fan_out=True, init_lora_weights=False)
    peft_model = peft.get_peft_model(model, lora)
    peft_model.save_pretrained(tmp_path / "adapter")
    want = peft_model.merge_and_unload().state_dict()
    r = run(reshard_bin, "merge-lora", tmp_path / "base", tmp_path / "adapter",
            "-o", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    got = load_file(tmp_path / "out" / "model.safetensors")
    base = load_file(tmp_path / "base" / "model.safetensors")
    changed = [k for k in got if not torch.equal(got[k], base[k])]
    assert len(changed) == 2 * 4  # c_attn, attn.c_proj, c_fc, mlp.c_proj in each layer
    worst = max(ulp_distance(got[k], want[k]) for k in changed)
    print(f"GPT-2 fan_in_fan_out, float32: largest difference from PEFT: {worst} ulp")
    assert worst <= 2
    # PEFT takes a Conv1D as one whatever fan_in_fan_out says: so does the merge, the square
    # attn.c_proj included (the other weights' shapes show that they are Conv1D ones).
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    cfg["fan_in_fan_out"] = False
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(cfg))
    r = run(reshard_bin, "merge-lora", tmp_path / "base", tmp_path / "adapter",
            "-o", tmp_path / "unflagged")
    assert r.returncode == 0, r.stderr
    unflagged = load_file(tmp_path / "unflagged" / "model.safetensors")
    assert all(torch.equal(unflagged[k], got[k]) for k in got)


def test_the_package_scatters_and_gathers_an_adapter(toy, tmp_path):
    import reshard.checkpoint

    root, _, _ = toy
    reshard.checkpoint.scatter(root / "adapter", tmp_path / "tp2",
                               config=root / "base" / "config.json", tp=2)
    reshard.checkpoint.gather(tmp_path / "tp2", tmp_path / "back")
    original = load_file(root / "adapter" / "adapter_model.safetensors")
    back = load_file(tmp_path / "back" / "adapter_model.safetensors")
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in back)
    o_a = "base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight"
    assert rank_tensors(tmp_path / "tp2", 1)[o_a].shape[1] * 2 == original[o_a].shape[1]


def same_files(a, b):
    """The names of the files of directory a whose bytes differ from b's (or that b lacks), and
    b's files that a lacks."""
    names = {p.name for p in a.iterdir()} | {p.name for p in b.iterdir()}
    return sorted(n for n in names if not ((a / n).is_file() and (b / n).is_file()
                                           and (a / n).read_bytes() == (b / n).read_bytes()))


def test_merge_lora_into_a_sharded_base_shard_by_shard(toy, reshard_bin, tmp_path):
    """A base scattered at TP 2 takes the adapter shard by shard (from its PEFT directory, or
    scattered at TP 2 itself): the output is the Hugging Face merge scattered at TP 2, file for
    file and byte for byte, and within 2 ulp of PEFT's merge_and_unload() on every rank."""
    root, _, _ = toy
    config = root / "base" / "config.json"

    def scatter(src, out):
        r = run(reshard_bin, "scatter", src, "--config", config, "--tp", 2, "-o", out)
        assert r.returncode == 0, r.stderr

    scatter(root / "base", tmp_path / "base-tp2")
    scatter(root / "adapter", tmp_path / "adapter-tp2")
    r = run(reshard_bin, "merge-lora", root / "base", root / "adapter", "-o", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    scatter(tmp_path / "hf", tmp_path / "want")
    for adapter in ("adapter", "adapter-tp2"):
        src = root / adapter if adapter == "adapter" else tmp_path / adapter
        out = tmp_path / f"from-{adapter}"
        r = run(reshard_bin, "merge-lora", tmp_path / "base-tp2", src, "-o", out)
        assert r.returncode == 0, r.stderr
        # PEFT saves the targeted embedding's base weight beside its A and B (merged from it).
        assert "15 weights took B @ A, 1 replaced whole, shard by shard at 2 ranks" in r.stdout
        assert same_files(out, tmp_path / "want") == [], adapter
    # Against PEFT's own merge, scattered alike: each rank's shards within 2 ulp.
    scatter(root / "merged", tmp_path / "peft")
    worst = 0
    for rank in range(2):
        got = rank_tensors(tmp_path / "from-adapter", rank)
        want = rank_tensors(tmp_path / "peft", rank)
        assert got.keys() == want.keys()
        worst = max(worst, max(ulp_distance(got[k], want[k]) for k in got))
    print(f"merge into TP 2 shards, float32: largest difference from PEFT: {worst} ulp")
    assert worst <= 2
    # The shards really were merged: rank 1's q_proj is not the base's.
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(rank_tensors(tmp_path / "from-adapter", 1)[q],
                           rank_tensors(tmp_path / "base-tp2", 1)[q])


def test_merge_lora_into_shards_refuses_what_its_rank_lacks(toy, reshard_bin, tmp_path):
    root, _, _ = toy
    config = root / "base" / "config.json"
    r = run(reshard_bin, "scatter", root / "base", "--config", config, "--tp", 2,
            "-o", tmp_path / "base-tp2")
    assert r.returncode == 0, r.stderr
    # An adapter at another degree.
    r = run(reshard_bin, "scatter", root / "adapter", "--config", config, "--tp", 1,
            "-o", tmp_path / "adapter-tp1")
    assert r.returncode == 0, r.stderr
    r = run(reshard_bin, "merge-lora", tmp_path / "base-tp2", tmp_path / "adapter-tp1",
            "-o", tmp_path / "out")
    assert r.returncode == 1, r.stderr
    assert "is scattered at 1 ranks, the base at 2" in r.stderr
    # An adapter at the base's degree whose q_proj A is split as a row-parallel one's would be:
    # the column-parallel q_proj shard needs every column of A.
    q_a = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
    (tmp_path / "layouts.json").write_text(json.dumps(
        {"version": 1, q_a: {"family": "split", "dim": 1}, "*": {"family": "replicated"}}))
    r = run(reshard_bin, "scatter", root / "adapter", "--layouts", tmp_path / "layouts.json",
            "--tp", 2, "-o", tmp_path / "adapter-odd")
    assert r.returncode == 0, r.stderr
    r = run(reshard_bin, "merge-lora", tmp_path / "base-tp2", tmp_path / "adapter-odd",
            "-o", tmp_path / "out")
    assert r.returncode == 1, r.stderr
    assert (f"rank 0's shard of \"model.layers.1.self_attn.q_proj.weight\" needs column 32 of "
            f"\"{q_a}\", which the adapter's rank 0 does not hold") in r.stderr
    assert not (tmp_path / "out").exists()


def fused_maps(tp=2, layers=2, hidden=64, heads=4, kv_heads=2, inter=96, vocab=128):
    """A map document of the toy Llama as vLLM lays it out at `tp`: q, k and v stacked as rows of
    one qkv_proj buffer per rank, gate and up of one gate_up_proj, o and down split by columns,
    the embedding and lm_head by rows, the norms whole."""
    head = hidden // heads
    doc = {"version": 2, "buffers": {}}

    def rows_of(name, rows, cols, buffer=None, at=None):
        n = rows // tp
        ranks = {}
        for j in range(tp):
            dest = at(j) if at else 0
            piece = {"shape": [n, cols], "source": [j * n * cols, [cols, 1]],
                     "dest": [dest * cols, [cols, 1]], "locations": [j]}
            ranks[str(j)] = {"shard_shape": [n, cols], "pieces": [piece]}
            if buffer:
                ranks[str(j)].update(buffer=buffer[0], shard_shape=[buffer[1], cols])
        doc[name] = {"logical_shape": [rows, cols], "ranks": ranks}

    def cols_of(name, rows, cols):
        n = cols // tp
        doc[name] = {"logical_shape": [rows, cols], "ranks": {
            str(j): {"shard_shape": [rows, n], "pieces": [
                {"shape": [rows, n], "source": [j * n, [cols, 1]], "dest": [0, [n, 1]],
                 "locations": [j]}]} for j in range(tp)}}

    def whole(name, size):
        doc[name] = {"logical_shape": [size], "ranks": {
            str(j): {"shard_shape": [size], "pieces": [
                {"shape": [size], "source": [0, [1]], "dest": [0, [1]],
                 "locations": list(range(tp))}]} for j in range(tp)}}

    def fused(prefix, fused_name, parts, cols):
        name = f"{prefix}.{fused_name}.weight"
        total = sum(rows for _, rows in parts) // tp
        doc["buffers"][name] = {"dtype": "F32", "ranks": {
            str(j): {"shape": [total, cols]} for j in range(tp)}}
        start = 0
        for part, rows in parts:
            rows_of(f"{prefix}.{part}.weight", rows, hidden, (name, total),
                    lambda j, s=start: s)
            start += rows // tp

    for i in range(layers):
        p = f"model.layers.{i}"
        fused(f"{p}.self_attn", "qkv_proj",
              [("q_proj", heads * head), ("k_proj", kv_heads * head), ("v_proj", kv_heads * head)],
              hidden)
        fused(f"{p}.mlp", "gate_up_proj", [("gate_proj", inter), ("up_proj", inter)], hidden)
        cols_of(f"{p}.self_attn.o_proj.weight", hidden, heads * head)
        cols_of(f"{p}.mlp.down_proj.weight", hidden, inter)
        whole(f"{p}.input_layernorm.weight", hidden)
        whole(f"{p}.post_attention_layernorm.weight", hidden)
    rows_of("model.embed_tokens.weight", vocab, hidden)
    rows_of("lm_head.weight", vocab, hidden)
    whole("model.norm.weight", hidden)
    return doc


def test_an_adapter_at_a_fused_layout_stacks_b_as_the_base_rows(toy, reshard_bin, tmp_path):
    """scatter ADAPTER --maps (the base's map document, fused as vLLM fuses): on each rank the
    Bs of q, k and v are stacked as qkv_proj's rows are (each sliced as vLLM's column-parallel
    LoRA layers slice lora_b), each A whole; row-parallel o and down have A split by columns and
    B whole. The adapter gathers back bit for bit, and merging it into the base at that layout
    gives the Hugging Face merge scattered alike, byte for byte."""
    root, _, _ = toy
    (tmp_path / "maps.json").write_text(json.dumps(fused_maps()))
    r = run(reshard_bin, "scatter", root / "adapter", "--maps", tmp_path / "maps.json",
            "-o", tmp_path / "adapter-v")
    assert r.returncode == 0, r.stderr
    full = load_file(root / "adapter" / "adapter_model.safetensors")
    pre = "base_model.model.model.layers.1"
    for j in range(2):
        got = rank_tensors(tmp_path / "adapter-v", j)
        b = {m: full[f"{pre}.self_attn.{m}.lora_B.weight"] for m in ("q_proj", "k_proj", "v_proj")}
        want = torch.cat([t[j * (t.shape[0] // 2):(j + 1) * (t.shape[0] // 2)] for t in b.values()])
        assert torch.equal(got[f"{pre}.self_attn.qkv_proj.lora_B.weight"], want)
        assert f"{pre}.self_attn.q_proj.lora_B.weight" not in got
        assert torch.equal(got[f"{pre}.self_attn.k_proj.lora_A.weight"],
                           full[f"{pre}.self_attn.k_proj.lora_A.weight"])
        gu = [full[f"{pre}.mlp.{m}.lora_B.weight"] for m in ("gate_proj", "up_proj")]
        assert torch.equal(got[f"{pre}.mlp.gate_up_proj.lora_B.weight"],
                           torch.cat([t[j * 48:(j + 1) * 48] for t in gu]))
        assert torch.equal(got[f"{pre}.mlp.down_proj.lora_A.weight"],
                           full[f"{pre}.mlp.down_proj.lora_A.weight"][:, j * 48:(j + 1) * 48])
        assert torch.equal(got[f"{pre}.self_attn.o_proj.lora_B.weight"],
                           full[f"{pre}.self_attn.o_proj.lora_B.weight"])
    r = run(reshard_bin, "gather", tmp_path / "adapter-v", "-o", tmp_path / "back")
    assert r.returncode == 0, r.stderr
    back = load_file(tmp_path / "back" / "adapter_model.safetensors")
    assert back.keys() == full.keys() and all(torch.equal(back[k], full[k]) for k in back)
    import reshard.checkpoint  # the package lays it out alike
    reshard.checkpoint.scatter(root / "adapter", tmp_path / "adapter-p", maps=tmp_path / "maps.json")
    assert same_files(tmp_path / "adapter-p", tmp_path / "adapter-v") == []
    # Merged at the fused layout, shard by shard.
    for src, out in ((root / "base", "base-v"), (root / "merged", "peft-v")):
        r = run(reshard_bin, "scatter", src, "--maps", tmp_path / "maps.json", "-o", tmp_path / out)
        assert r.returncode == 0, r.stderr
    r = run(reshard_bin, "merge-lora", root / "base", root / "adapter", "-o", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    r = run(reshard_bin, "scatter", tmp_path / "hf", "--maps", tmp_path / "maps.json",
            "-o", tmp_path / "want")
    assert r.returncode == 0, r.stderr
    for adapter in (root / "adapter", tmp_path / "adapter-v"):
        r = run(reshard_bin, "merge-lora", tmp_path / "base-v", adapter, "-o", tmp_path / "got",
                "--force")
        assert r.returncode == 0, r.stderr
        assert same_files(tmp_path / "got", tmp_path / "want") == [], adapter
    worst = max(ulp_distance(a, rank_tensors(tmp_path / "peft-v", j)[k])
                for j in range(2) for k, a in rank_tensors(tmp_path / "got", j).items())
    print(f"merge into vLLM's fused layout at TP 2, float32: largest difference from PEFT: "
          f"{worst} ulp")
    assert worst <= 2


def test_an_adapter_that_leaves_a_fused_weight_untargeted_pads_its_rows(toy, reshard_bin,
                                                                        tmp_path):
    """An adapter on q and v only: qkv_proj's lora_B holds zero rows where k's are (declared
    padding), which gather drops again."""
    root, _, _ = toy
    (tmp_path / "maps.json").write_text(json.dumps(fused_maps()))
    qv = edited(root, tmp_path, tensors=lambda t: [
        t.pop(k) for k in list(t) if not any(m in k for m in ("q_proj", "v_proj"))])
    cfg = json.loads((qv / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "v_proj"]
    (qv / "adapter_config.json").write_text(json.dumps(cfg))
    r = run(reshard_bin, "scatter", qv, "--maps", tmp_path / "maps.json", "-o", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    full = load_file(qv / "adapter_model.safetensors")
    pre = "base_model.model.model.layers.0.self_attn"
    got = rank_tensors(tmp_path / "out", 1)[f"{pre}.qkv_proj.lora_B.weight"]
    q, v = full[f"{pre}.q_proj.lora_B.weight"], full[f"{pre}.v_proj.lora_B.weight"]
    assert torch.equal(got, torch.cat([q[32:], torch.zeros(16, R), v[16:]]))
    r = run(reshard_bin, "gather", tmp_path / "out", "-o", tmp_path / "back")
    assert r.returncode == 0, r.stderr
    back = load_file(tmp_path / "back" / "adapter_model.safetensors")
    assert back.keys() == full.keys() and all(torch.equal(back[k], full[k]) for k in back)


def test_merge_lora_refuses_a_quantized_base_naming_the_tensor(toy, reshard_bin, tmp_path):
    root, _, _ = toy
    fp8 = tmp_path / "fp8"
    shutil.copytree(root / "base", fp8)
    t = load_file(fp8 / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj.weight"
    t[q] = t[q].to(torch.float8_e4m3fn)
    save_file(t, fp8 / "model.safetensors", metadata={"format": "pt"})
    r = run(reshard_bin, "scatter", fp8, "--config", fp8 / "config.json", "--tp", 2,
            "-o", tmp_path / "fp8-tp2")
    assert r.returncode == 0, r.stderr
    for base in (fp8, tmp_path / "fp8-tp2"):
        r = run(reshard_bin, "merge-lora", base, root / "adapter", "-o", tmp_path / "out")
        assert r.returncode == 1, r.stderr
        assert f'"{q}" is F8_E4M3: merging takes float32, bfloat16 or float16 weights' in r.stderr
        assert "dequantize" in r.stderr
        assert not (tmp_path / "out").exists()
