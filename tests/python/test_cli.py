"""The command-line contract (DESIGN 7): exit statuses, stderr messages, --json output."""

import json
import os
import subprocess

import pytest

from maps import split_map, segmented_map


def run(reshard_bin, *args):
    return subprocess.run([reshard_bin, *map(str, args)], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture
def bigcode(tmp_path):
    m = segmented_map([48, 8], 0, [(32, [8, 8, 8, 8]), (16, None)], 4)
    path = tmp_path / "bigcode.json"
    path.write_text(json.dumps(m))
    return path


def test_verify_accepts_a_valid_map(reshard_bin, bigcode):
    r = run(reshard_bin, "verify", bigcode)
    assert r.returncode == 0, r.stderr
    assert "1 of 1 parameter(s) valid" in r.stdout


def test_verify_names_the_first_violation_per_parameter(reshard_bin, tmp_path):
    doc = {"version": 1,
           "good": split_map([8, 2], 0, [4, 4]),
           "^h\\.0\\.gap$": split_map([8, 2], 0, [4, 3]),
           "bad.bounds": split_map([8, 2], 0, [4, 4])}
    doc["bad.bounds"]["ranks"]["1"]["pieces"][0]["source"][0] = 10
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(doc))
    r = run(reshard_bin, "verify", path)
    assert r.returncode == 1
    assert 'parameter "h.0.gap": element [7, 0] of F (shape [8, 2]) is held by no rank' in r.stderr
    assert ('parameter "bad.bounds": ranks["1"].pieces[0]: source view ends at offset 18 but F '
            'has 16 elements') in r.stderr
    assert str(path) in r.stderr
    r = run(reshard_bin, "verify", path, "--json")
    assert r.returncode == 1
    report = json.loads(r.stdout)
    assert report["valid"] is False and report["num_invalid"] == 2
    assert [p["valid"] for p in report["params"]] == [True, False, False]
    assert report["params"][0]["pieces"] == 2


@pytest.mark.parametrize("content,fragment", [
    ("{not json", "parse"),
    ('{"version": 3}', "version 3"),
    ('{"version": 2}', 'missing key "buffers"'),
    ('{"logical_shape": [4], "ranks": {"0": {"shard_shape": [4.0], "pieces": []}}}', "integer"),
    ('[]', "object"),
])
def test_verify_malformed_input_exits_2(reshard_bin, tmp_path, content, fragment):
    path = tmp_path / "m.json"
    path.write_text(content)
    r = run(reshard_bin, "verify", path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert fragment in r.stderr.lower(), r.stderr
    assert r.stdout == ""


def test_missing_file_and_usage_errors_exit_2(reshard_bin, tmp_path):
    r = run(reshard_bin, "verify", tmp_path / "absent.json")
    assert r.returncode == 2 and "absent.json" in r.stderr
    assert run(reshard_bin, "verify").returncode == 2
    assert run(reshard_bin, "frobnicate").returncode == 2
    assert run(reshard_bin, "show", "--rows", "0", tmp_path / "x.json").returncode == 2
    r = run(reshard_bin, "--help")
    assert r.returncode == 0 and "verify" in r.stdout
    for command in ["verify", "show", "demo"]:
        r = run(reshard_bin, command, "--help")
        assert r.returncode == 0 and command in r.stdout


def test_show_draws_holders_and_counts_bytes(reshard_bin, bigcode):
    r = run(reshard_bin, "show", bigcode, "--rows", "6", "--cols", "8")
    assert r.returncode == 0, r.stderr
    lines = [line.strip() for line in r.stdout.splitlines()]
    assert "|00000000|" in lines and "|33333333|" in lines and "|********|" in lines
    r = run(reshard_bin, "show", bigcode, "--json", "--dtype", "F32")
    summary = json.loads(r.stdout)[0]
    assert summary["pieces"] == 8
    assert summary["ranks"][2]["bytes"] == 24 * 8 * 4
    assert summary["ranks"][2]["replicated_bytes"] == 16 * 8 * 4
    assert summary["held_bytes"] == 4 * 24 * 8 * 4


def test_show_refuses_an_invalid_map_with_exit_1(reshard_bin, tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(split_map([8, 2], 0, [4, 3])))
    r = run(reshard_bin, "show", path)
    assert r.returncode == 1 and "held by no rank" in r.stderr


def test_demo_runs_the_whole_pipeline_and_keeps_its_outputs(reshard_bin, tmp_path):
    out = tmp_path / "demo"
    r = run(reshard_bin, "demo", out, "--layers", 2)
    assert r.returncode == 0, r.stderr
    for step in ("1. wrote the full checkpoint", "2. scattered to TP 4", "3. converted TP 4 -> TP 2",
                 "4. converted TP 2 -> TP 3", "5. gathered TP 3"):
        assert step in r.stdout
    assert "bit-identical to the original" in r.stdout
    assert "every parameter round-tripped" in r.stdout
    # The pre-divided bias goes through a factor of 2/3 at TP 3, and the demo says so.
    assert "not a power of two" in r.stdout
    for d in ("full", "tp4", "tp2", "tp3", "gathered"):
        assert (out / d).is_dir()
    manifest = (out / "tp4" / "reshard.json").read_bytes()
    assert run(reshard_bin, "show", out / "layouts.json").returncode == 2  # not a map document
    # An existing output is never touched without --force; with it, the run is deterministic.
    r = run(reshard_bin, "demo", out, "--layers", 2)
    assert r.returncode == 2 and "--force" in r.stderr
    assert (out / "tp4" / "reshard.json").read_bytes() == manifest
    assert run(reshard_bin, "demo", out, "--layers", 2, "--force").returncode == 0
    assert (out / "tp4" / "reshard.json").read_bytes() == manifest


def test_demo_without_a_directory_leaves_nothing(reshard_bin, tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    r = subprocess.run([reshard_bin, "demo", "--layers", "1"], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert os.listdir(tmp_path) == []

def test_infer_prints_or_writes_the_canonical_map(reshard_bin, tmp_path):
    doc = {"logical_shape": [4, 6],
           "ranks": [{"rank": r, "shard_shape": [4, 3],
                      "index_map": [row * 6 + 3 * r + c for row in range(4) for c in range(3)]}
                     for r in range(2)]}
    path = tmp_path / "obs.json"
    path.write_text(json.dumps(doc))
    r = run(reshard_bin, "infer", path)
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout)
    assert m["ranks"]["1"]["pieces"] == [{"shape": [4, 3], "source": [3, [6, 1]],
                                          "dest": [0, [3, 1]], "locations": [1]}]
    out = tmp_path / "map.json"
    assert run(reshard_bin, "infer", path, "-o", out).returncode == 0
    assert out.read_text() == r.stdout
    assert run(reshard_bin, "verify", out).returncode == 0
    # An element nobody holds: exit 1 naming it, unless the observation is declared partial.
    doc["ranks"][1]["index_map"][0] = 3  # element 9 ([1, 3]) is now held by nobody
    doc["ranks"][1]["index_map"][3] = 4
    path.write_text(json.dumps(doc))
    r = run(reshard_bin, "infer", path)
    assert r.returncode == 1
    assert "repeats element" in r.stderr or "held by no rank" in r.stderr
    doc["ranks"][1]["index_map"] = doc["ranks"][1]["index_map"][:-1]
    path.write_text(json.dumps(doc))
    r = run(reshard_bin, "infer", path)
    assert r.returncode == 1 and "index_map has 11 entries" in r.stderr
    path.write_text('{"logical_shape": [4, 6], "ranks": [{"rank": 0}]}')
    r = run(reshard_bin, "infer", path)
    assert r.returncode == 2 and 'missing key "shard_shape"' in r.stderr


def test_infer_allows_partial_observations_when_asked(reshard_bin, tmp_path):
    doc = {"logical_shape": [2, 3],
           "ranks": [{"rank": 0, "shard_shape": [3], "index_map": [0, 1, 2]}]}
    path = tmp_path / "obs.json"
    path.write_text(json.dumps(doc))
    r = run(reshard_bin, "infer", path)
    assert r.returncode == 1 and "element [1, 0] of F (shape [2, 3]) is held by no rank" in r.stderr
    assert "pass --allow-uncovered" in r.stderr
    r = run(reshard_bin, "infer", path, "--allow-uncovered")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ranks"]["0"]["pieces"][0]["source"] == [0, [1]]


def test_bytes_after_the_json_value_are_malformed(reshard_bin, tmp_path, bigcode):
    path = tmp_path / "trailing.json"
    path.write_bytes(bigcode.read_bytes() + b"\0garbage{{{")
    r = run(reshard_bin, "verify", path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "after the JSON value" in r.stderr


@pytest.mark.parametrize("text,fragment", [
    ('{"version": 1, "*": {"family": "replicated"}, "*": {"family": "split", "dim": 0}}',
     'duplicate key "*"'),
    ('{"version": 1, "^w$": {"family": "replicated"}, "w": {"family": "split", "dim": 0}}',
     'keys "^w$" and "w" both name the layout of "w"'),
])
def test_layouts_documents_refuse_two_layouts_for_one_parameter(reshard_bin, tmp_path, text,
                                                                fragment):
    full = tmp_path / "full"
    r = run(reshard_bin, "demo", tmp_path / "demo", "--layers", 1)
    assert r.returncode == 0, r.stderr
    (tmp_path / "layouts.json").write_text(text)
    r = run(reshard_bin, "scatter", tmp_path / "demo" / "full", "--layouts",
            tmp_path / "layouts.json", "--tp", 2, "-o", full)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert fragment in r.stderr
    assert not full.exists()


def test_a_layout_that_does_not_fit_the_tensor_exits_1_in_every_command(reshard_bin, tmp_path):
    demo = tmp_path / "demo"
    assert run(reshard_bin, "demo", demo, "--layers", 1).returncode == 0
    descriptor = {"family": "split", "dim": 3}
    (tmp_path / "d.json").write_text(json.dumps(descriptor))
    (tmp_path / "layouts.json").write_text(json.dumps({"version": 1, "*": descriptor}))
    r = run(reshard_bin, "layout", tmp_path / "d.json", "--shape", "8,4", "--world", 2)
    assert r.returncode == 1 and "dimension 3 is outside shape [8, 4]" in r.stderr, r.stderr
    r = run(reshard_bin, "scatter", demo / "full", "--layouts", tmp_path / "layouts.json", "--tp",
            2, "-o", tmp_path / "out")
    assert r.returncode == 1 and "dimension 3 is outside shape" in r.stderr, r.stderr


def test_an_invalid_map_in_a_manifest_is_a_failed_check(reshard_bin, tmp_path):
    demo = tmp_path / "demo"
    assert run(reshard_bin, "demo", demo, "--layers", 1).returncode == 0
    manifest = json.loads((demo / "tp4" / "reshard.json").read_text())
    name, param = next(iter(manifest["params"].items()))
    param["map"]["ranks"]["1"]["pieces"] = []  # rank 1's part of F is held by nobody
    (demo / "tp4" / "reshard.json").write_text(json.dumps(manifest))
    r = run(reshard_bin, "convert", demo / "tp4", "--tp", 2, "-o", tmp_path / "out")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert name in r.stderr


def test_show_reads_a_sharded_checkpoint_by_manifest_or_directory(reshard_bin, tmp_path):
    demo = tmp_path / "demo"
    assert run(reshard_bin, "demo", demo, "--layers", 1).returncode == 0
    manifest = json.loads((demo / "tp4" / "reshard.json").read_text())
    for target in (demo / "tp4" / "reshard.json", demo / "tp4"):
        r = run(reshard_bin, "show", target, "--json")
        assert r.returncode == 0, (target, r.stderr)
        shown = json.loads(r.stdout)
        assert sorted(p["name"] for p in shown) == sorted(manifest["params"])
        assert all(p["world_size"] == 4 for p in shown)
        assert all(p["dtype"] == manifest["params"][p["name"]]["dtype"] for p in shown)
    r = run(reshard_bin, "show", demo / "tp4")
    assert r.returncode == 0 and "4 ranks" in r.stdout
    r = run(reshard_bin, "show", demo / "full")
    assert r.returncode == 2 and "reshard.json" in r.stderr


@pytest.mark.parametrize("descriptor,shape,status,fragment", [
    ({"family": "padded_vocab", "dim": 0, "pad_multiple": 2 ** 62}, "13,4", 1,
     "pad_multiple x world size: 4611686018427387904 x 4 is more than 2^62"),
    ({"family": "padded_vocab", "dim": 0, "pad_multiple": 2 ** 61}, "13,4", 1,
     "pad_multiple x world size: 2305843009213693952 x 4 is more than 2^62"),
    ({"family": "codegen_qkv", "dim": 0, "mp_num": 2 ** 62}, "24,4", 2,
     "mp_num: 4611686018427387904 is outside 1..1048576"),
    ({"family": "split", "dim": 0, "sizes": [2 ** 62, 2 ** 62, 0, 0]}, "4", 1,
     "sum to more than 2^62"),
])
def test_layout_counts_near_2_62_are_refused_not_crashed(reshard_bin, tmp_path, descriptor, shape,
                                                         status, fragment):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(descriptor))
    r = run(reshard_bin, "layout", path, "--shape", shape, "--world", 4)
    assert r.returncode == status, (r.returncode, r.stderr)
    assert fragment in r.stderr


def test_layout_names_a_world_of_zero_ranks(reshard_bin, tmp_path):
    desc = tmp_path / "split.json"
    desc.write_text(json.dumps({"family": "split", "dim": 0}))
    assert run(reshard_bin, "layout", desc, "--shape", "4", "--world", 2).returncode == 0
    for world in ("0", "-1"):
        r = run(reshard_bin, "layout", desc, "--shape", "4", "--world", world)
        assert r.returncode == 2, r.stderr
        assert f"{world} is not an integer from 1" in r.stderr and "required" not in r.stderr, \
            r.stderr


def tiny_checkpoint(tmp_path, config, tensors):
    import torch
    from safetensors.torch import save_file
    full = tmp_path / "full"
    full.mkdir()
    save_file({n: torch.randn(*s) for n, s in tensors.items()}, str(full / "model.safetensors"))
    (full / "config.json").write_text(json.dumps(config))
    return full


def test_scatter_config_at_tp_1_splits_nothing_even_without_a_plan(reshard_bin, tmp_path):
    # GPT-2 has no tensor-parallel plan in transformers: TP 2 is refused, TP 1 splits nothing.
    full = tiny_checkpoint(tmp_path, {"model_type": "gpt2", "n_embd": 8, "n_head": 2,
                                      "n_layer": 1, "vocab_size": 16},
                           {"wte.weight": (16, 8), "h.0.attn.c_attn.weight": (8, 24)})
    config = full / "config.json"
    r = run(reshard_bin, "scatter", full, "--config", config, "--tp", 2, "-o", tmp_path / "tp2")
    assert r.returncode == 1 and "no tensor-parallel plan" in r.stderr, r.stderr
    r = run(reshard_bin, "scatter", full, "--config", config, "--tp", 1, "-o", tmp_path / "tp1")
    assert r.returncode == 0, r.stderr
    r = run(reshard_bin, "gather", tmp_path / "tp1", "-o", tmp_path / "back")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "back" / "model.safetensors").read_bytes() != b""


LLAMA = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 32, "vocab_size": 64,
         "tie_word_embeddings": False}

# (--distributed-config, what the message names; "" when accepted) at --tp 2.
DISTRIBUTED_CONFIGS = [
    ('{"tp_size": 2}', ""),
    ('{"tp_size": 4}', "tp_size 4 and the 2 processes"),
    ('{"tp_plan": "auto", "fsdp_size": 2}', "fsdp_size 2"),
    ('{"tp_plan": "auto", "pp_size": 2}', "pp_size 2"),
    ("", "is empty"),
    ("  ", "is empty"),
    ("[1,2]", "expected a JSON object"),
    ('"auto"', "expected a JSON object"),
]


@pytest.mark.parametrize("dc,needle", DISTRIBUTED_CONFIGS, ids=[d[0] or "empty" for d in
                                                                 DISTRIBUTED_CONFIGS])
def test_scatter_refuses_a_distributed_config_it_would_not_follow(reshard_bin, tmp_path, dc,
                                                                   needle):
    full = tiny_checkpoint(tmp_path, LLAMA, {"model.embed_tokens.weight": (64, 32),
                                             "model.layers.0.self_attn.q_proj.weight": (32, 32)})
    out = tmp_path / "out"
    r = run(reshard_bin, "scatter", full, "--config", full / "config.json", "--tp", 2,
            "--distributed-config", dc, "-o", out)
    if not needle:
        assert r.returncode == 0, r.stderr
        return
    assert r.returncode == 2, (dc, r.stderr)
    assert needle in r.stderr and "--distributed-config" in r.stderr, r.stderr
    assert str(full / "config.json") not in r.stderr, r.stderr  # not config.json's fault
    assert not out.exists()
