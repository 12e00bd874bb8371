"""Expert layouts through the CLI: `reshard layout` with stacked-experts descriptors and
`--placement`, `reshard show` (text, --json, --svg) on expert buffers (docs/layouts.md,
"Mixture of experts").

- a stacked-experts descriptor at --world N is a version-2 map document that `verify` accepts;
- scattering a per-expert checkpoint with it puts on every rank what torch's own stacking of the
  rank's experts (and their TP slices) gives, and `gather` restores the checkpoint;
- bad descriptors exit 2 (malformed) or 1 (a world that does not fit), naming what is wrong;
- `show` draws which rank holds which experts; the SVG is well-formed XML and deterministic;
- random expert counts, EP sizes and descriptors lay out, verify, scatter and gather exactly.
"""

import json
import subprocess
import xml.etree.ElementTree as ET

import pytest
import torch
from safetensors.torch import load_file, save_file

PREFIX = "model.layers.0.mlp.experts"
BUFFER = f"{PREFIX}.gate_up_proj"
GATE = PREFIX + ".{e}.gate_proj.weight"
UP = PREFIX + ".{e}.up_proj.weight"
I, H = 4, 6  # expert intermediate and hidden size


def run(*args):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=60)


def descriptor(placement, tp=1, dp=1, rank_order="tp_fastest", dtype="F32"):
    return {"family": "stacked_experts", "buffer": BUFFER, "dtype": dtype,
            "members": [{"name": GATE, "shape": [I, H], "split_dim": 0},
                        {"name": UP, "shape": [I, H], "split_dim": 0}],
            "fused_dim": 0, "placement": placement, "tp": tp, "dp": dp,
            "rank_order": rank_order}


def autoep(num_experts, ranks):
    return {"version": 1, "num_experts": num_experts, "ep_size": len(ranks),
            "ranks": [{"rank": k, "experts": list(e)} for k, e in enumerate(ranks)]}


def write(path, value):
    path.write_text(json.dumps(value))
    return path


def checkpoint(tmp_path, num_experts, seed=0):
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for e in range(num_experts):
        weights[GATE.format(e=e)] = torch.randn(I, H, generator=g)
        weights[UP.format(e=e)] = torch.randn(I, H, generator=g)
    full = tmp_path / "full"
    full.mkdir(exist_ok=True)
    save_file(weights, str(full / "model.safetensors"))
    return full, weights


def ep_experts(placement, ep):
    """The experts each EP rank holds, in slot order, as the docs define the families."""
    if "ranks" in placement:
        return [r["experts"] for r in sorted(placement["ranks"], key=lambda r: r["rank"])]
    e, family = placement["num_experts"], placement["family"]
    if family == "round_robin":
        return [list(range(k, e, ep)) for k in range(ep)]
    base, extra = divmod(e, ep)
    out, nxt = [], 0
    for k in range(ep):
        n = base + (k < extra)
        out.append(list(range(nxt, nxt + n)))
        nxt += n
    return out


def rank_of(k, t, d, ep, tp, tp_fastest):
    """The global rank of EP rank k, TP rank t, expert-DP replica d (docs/layouts.md)."""
    return (d * ep + k) * tp + t if tp_fastest else (d * tp + t) * ep + k


def expected_buffers(weights, placement, ep, tp, dp, tp_fastest=True):
    """Each rank's gate_up buffer built with torch: per slot, the expert's gate rows then up
    rows of its TP slice; ranks in the (tp, ep, dp) order asked for."""
    out = [None] * (ep * tp * dp)
    for d in range(dp):  # expert-DP replicas of the whole EP x TP layout
        for k, experts in enumerate(ep_experts(placement, ep)):
            for t in range(tp):
                rows = slice(t * I // tp, (t + 1) * I // tp)
                slots = [torch.cat([weights[GATE.format(e=e)][rows],
                                    weights[UP.format(e=e)][rows]]) for e in experts]
                out[rank_of(k, t, d, ep, tp, tp_fastest)] = \
                    torch.stack(slots) if slots else torch.zeros(0, 2 * I // tp, H)
    return out


def lay_out(reshard_bin, tmp_path, desc, world, name="maps.json"):
    d = write(tmp_path / f"{name}.desc.json", desc)
    out = tmp_path / name
    r = run(reshard_bin, "layout", d, "--world", world, "-o", out)
    assert r.returncode == 0, r.stderr
    return out


CASES = [
    # (placement, tp, dp, rank order, world)
    ({"family": "contiguous", "num_experts": 4}, 1, 1, "tp_fastest", 2),
    ({"family": "linear", "num_experts": 5}, 1, 1, "tp_fastest", 3),
    ({"family": "round_robin", "num_experts": 6}, 2, 1, "tp_fastest", 4),
    ({"family": "contiguous", "num_experts": 4}, 2, 2, "tp_fastest", 8),  # Megatron tp, ep, dp
    ({"family": "contiguous", "num_experts": 4}, 2, 1, "ep_fastest", 4),
    ({"family": "linear", "num_experts": 3}, 2, 2, "ep_fastest", 8),
    (autoep(4, [[0, 3], [], [1, 2, 0]]), 1, 1, "tp_fastest", 3),  # uneven, empty, redundant
    (autoep(3, [[2, 0], [1, 0]]), 2, 1, "tp_fastest", 4),
]


@pytest.mark.parametrize("placement,tp,dp,order,world", CASES)
def test_scatter_of_a_layout_equals_torch_stacking(tmp_path, reshard_bin, placement, tp, dp,
                                                   order, world):
    maps = lay_out(reshard_bin, tmp_path, descriptor(placement, tp, dp, order), world)
    doc = json.loads(maps.read_text())
    assert doc["version"] == 2 and list(doc["buffers"]) == [BUFFER]
    r = run(reshard_bin, "verify", maps)
    assert r.returncode == 0, r.stdout + r.stderr

    full, weights = checkpoint(tmp_path, placement["num_experts"])
    sharded = tmp_path / "sharded"
    r = run(reshard_bin, "scatter", full, "--maps", maps, "-o", sharded)
    assert r.returncode == 0, r.stderr
    want = expected_buffers(weights, placement, world // (tp * dp), tp, dp, order == "tp_fastest")
    for rank in range(world):
        held = load_file(str(sharded / f"model-rank-{rank}-part-0.safetensors"))
        if want[rank].numel() == 0:
            assert BUFFER not in held or held[BUFFER].numel() == 0
            continue
        assert torch.equal(held[BUFFER], want[rank]), rank

    gathered = tmp_path / "gathered"
    r = run(reshard_bin, "gather", sharded, "-o", gathered)
    assert r.returncode == 0, r.stderr
    back = load_file(str(gathered / "model.safetensors"))
    assert set(back) == set(weights) and all(torch.equal(back[n], weights[n]) for n in weights)


BAD = [
    # (placement or whole descriptor, world, exit status, message)
    (autoep(4, [[0, 1], [2]]), 2, 2, "expert 3 is on no EP rank"),
    (autoep(4, [[0, 1, 1], [2, 3]]), 2, 2, "ranks[0].experts[2]: rank 0 names expert 1 twice"),
    (autoep(4, [[0, 1], [2, 3]]), 4, 1, "lists 2 EP ranks, not 4"),
    ({"family": "contiguous", "num_experts": 6}, 4, 1,
     "6 experts do not split into 4 equal contiguous blocks"),
    ({"family": "striped", "num_experts": 4}, 2, 2, "unknown expert placement \"striped\""),
    ({"family": "linear", "num_experts": 4.0}, 2, 2, "placement.num_experts"),
    (dict(descriptor({"family": "linear", "num_experts": 4}), tp=3), 3, 1,
     "expert TP 3 does not divide dimension 0"),
    (dict(descriptor({"family": "linear", "num_experts": 4}), tp=2), 3, 1,
     "must be a multiple of 2"),
    (dict(descriptor({"family": "linear", "num_experts": 4}), extra=1), 2, 2, "extra"),
]


@pytest.mark.parametrize("bad,world,status,says", BAD)
def test_bad_descriptors_exit_with_a_clear_message(tmp_path, reshard_bin, bad, world, status,
                                                   says):
    desc = bad if bad.get("family") == "stacked_experts" else descriptor(bad)
    path = write(tmp_path / "bad.json", desc)
    out = tmp_path / "out.json"
    r = run(reshard_bin, "layout", path, "--world", world, "-o", out)
    assert r.returncode == status, r.stderr
    assert says in r.stderr and str(path) in r.stderr
    assert not out.exists()


def test_layout_flags_that_do_not_go_together(tmp_path, reshard_bin):
    path = write(tmp_path / "d.json", descriptor({"family": "linear", "num_experts": 2}))
    r = run(reshard_bin, "layout", path, "--world", 2, "--shape", "4,6")
    assert r.returncode == 2 and "stacked_experts descriptor gives each member's shape" in r.stderr
    r = run(reshard_bin, "layout", path)
    assert r.returncode == 2 and "--world N is required" in r.stderr


def test_placement_prints_an_autoep_descriptor_and_reads_it_back(tmp_path, reshard_bin):
    family = write(tmp_path / "rr.json", {"family": "round_robin", "num_experts": 5})
    r = run(reshard_bin, "layout", "--placement", family, "--world", 2)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == autoep(5, [[0, 2, 4], [1, 3]])
    described = write(tmp_path / "ds.json", json.loads(r.stdout))
    r2 = run(reshard_bin, "layout", "--placement", described)  # its own EP size
    assert r2.returncode == 0 and r2.stdout == r.stdout
    r = run(reshard_bin, "layout", "--placement", described, "--world", 4)
    assert r.returncode == 1 and "lists 2 EP ranks, not 4" in r.stderr
    r = run(reshard_bin, "layout", "--placement", family)
    assert r.returncode == 2 and "needs --world EP" in r.stderr
    bad = write(tmp_path / "bad.json", autoep(3, [[0], [0]]))
    r = run(reshard_bin, "layout", "--placement", bad)
    assert r.returncode == 2 and "expert 1 is on no EP rank" in r.stderr


def show(reshard_bin, *args):
    r = run(reshard_bin, "show", *args)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_show_draws_redundant_experts_as_text_json_and_svg(tmp_path, reshard_bin):
    placement = autoep(4, [[0, 3], [], [1, 2, 0]])
    maps = lay_out(reshard_bin, tmp_path, descriptor(placement), 3)
    text = show(reshard_bin, maps)
    assert f'buffer "{BUFFER}" (F32): 4 experts on 3 ranks' in text
    assert "     1  [0, 8, 6]           (none)" in text
    assert "     2  [3, 8, 6]           1 2 0" in text
    assert "expert 0 is replicated: held 2x, on ranks 0, 2" in text
    # The grid: rank 0 holds expert 0 in slot 0 (replicated) and expert 3 in slot 1.
    grid = [line.split() for line in text.splitlines() if line.startswith("    rank ")]
    assert grid[0] == ["rank", "0", "0+", ".", ".", "1"]
    assert grid[2] == ["rank", "2", "2+", "0", "1", "."]
    assert "8 tensor(s) write into the 1 buffer(s) above" in text

    entries = json.loads(show(reshard_bin, maps, "--json"))
    buffers = [e for e in entries if "buffer" in e]
    params = [e for e in entries if "name" in e]
    assert len(params) == 8 and all(p["ranks"][0]["buffer"] == BUFFER for p in params)
    (b,) = buffers
    assert b["columns"] == "experts" and b["members"] == [GATE, UP]
    assert [x["holders"] for x in b["experts"]] == [[0, 2], [2], [2], [0]]
    assert b["experts"][0]["copies"] == 2
    assert [h["expert"] for h in b["ranks"][2]["held"]] == [0, 1, 2]
    assert b["ranks"][2]["held"][0] == {"expert": 0, "slots": [2], "elements": 48,
                                        "fraction": 1.0, "replicated": True}

    svg = tmp_path / "experts.svg"
    show(reshard_bin, maps, "--svg", svg)
    root = ET.parse(svg).getroot()  # well-formed XML
    ns = "{http://www.w3.org/2000/svg}"
    assert root.tag == ns + "svg"
    cells = root.findall(f".//{ns}rect[@class='cell']")
    assert len(cells) == 3 * 4  # ranks x experts
    titles = [t.text for t in root.iter(ns + "title")]
    assert "rank 2, expert 0, slot 2, 48 of 48 elements, replicated on ranks 0, 2" in titles
    assert "rank 1, expert 3: not held" in titles
    hatched = [r for r in root.iter(ns + "rect") if r.get("fill") == "url(#replica)"]
    assert len(hatched) == 2
    first = svg.read_bytes()
    r = run(reshard_bin, "show", maps, "--svg", svg)
    assert r.returncode == 2 and "--force" in r.stderr
    show(reshard_bin, maps, "--svg", svg, "--force")
    assert svg.read_bytes() == first  # deterministic


def test_show_on_a_sharded_directory_with_expert_tp(tmp_path, reshard_bin):
    placement = {"family": "round_robin", "num_experts": 4}
    maps = lay_out(reshard_bin, tmp_path, descriptor(placement, tp=2), 4)
    full, _ = checkpoint(tmp_path, 4)
    sharded = tmp_path / "sharded"
    assert run(reshard_bin, "scatter", full, "--maps", maps, "-o", sharded).returncode == 0
    text = show(reshard_bin, sharded)
    assert "     1  [2, 4, 6]           0 2  (part of each: a TP slice)" in text
    grid = [line.split() for line in text.splitlines() if line.startswith("    rank ")]
    assert grid[1] == ["rank", "1", "0~", ".", "1~", "."]
    svg = tmp_path / "tp.svg"
    show(reshard_bin, sharded, "--svg", svg)
    root = ET.parse(svg).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    # A TP slice is drawn as the rows of the expert's samples the rank holds: half a cell.
    cell_of = {t.text: t for t in root.iter(ns + "title")}
    assert "rank 1, expert 0, slot 0, 24 of 48 elements" in cell_of
    (b,) = [e for e in json.loads(show(reshard_bin, sharded, "--json")) if "buffer" in e]
    assert b["ranks"][1]["held"][0]["fraction"] == 0.5


def test_show_svg_without_buffers_is_refused(tmp_path, reshard_bin):
    m = write(tmp_path / "m.json", {"logical_shape": [2], "ranks": {"0": {
        "shard_shape": [2], "pieces": [{"shape": [2], "source": [0, [1]], "dest": [0, [1]],
                                        "locations": [0]}]}}})
    r = run(reshard_bin, "show", m, "--svg", tmp_path / "x.svg")
    assert r.returncode == 1 and "has neither" in r.stderr


def test_random_expert_layouts_verify_scatter_and_gather_exactly(tmp_path, reshard_bin, rng):
    for trial in range(8):
        experts = rng.randint(1, 7)
        ep = rng.randint(1, 4)
        tp = rng.choice([1, 2])
        dp = rng.choice([1, 1, 2])
        order = rng.choice(["tp_fastest", "ep_fastest"])
        if rng.random() < 0.5:
            family = rng.choice(["contiguous", "linear", "round_robin"])
            placement = {"family": family,
                         "num_experts": experts * ep if family == "contiguous" else experts}
        else:
            ranks = [[] for _ in range(ep)]
            for e in range(experts):
                holders = rng.sample(range(ep), rng.randint(1, min(2, ep)))
                for k in holders:
                    ranks[k].append(e)
            for r in ranks:
                rng.shuffle(r)
            placement = autoep(experts, ranks)
        world = ep * tp * dp
        work = tmp_path / str(trial)
        work.mkdir()
        desc = descriptor(placement, tp, dp, order)
        maps = lay_out(reshard_bin, work, desc, world)
        again = lay_out(reshard_bin, work, desc, world, name="again.json")
        assert maps.read_bytes() == again.read_bytes()  # deterministic
        r = run(reshard_bin, "verify", maps, "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["valid"], (desc, r.stdout)
        (b,) = [e for e in json.loads(show(reshard_bin, maps, "--json")) if "buffer" in e]
        per_ep = ep_experts(placement, ep)
        for x in b["experts"]:
            holders = sorted(rank_of(k, t, d, ep, tp, order == "tp_fastest")
                             for k, held in enumerate(per_ep) if x["expert"] in held
                             for t in range(tp) for d in range(dp))
            assert x["holders"] == holders, (desc, x)
        full, weights = checkpoint(work, placement["num_experts"], seed=trial)
        sharded = work / "sharded"
        r = run(reshard_bin, "scatter", full, "--maps", maps, "-o", sharded)
        assert r.returncode == 0, r.stderr
        want = expected_buffers(weights, placement, ep, tp, dp, order == "tp_fastest")
        for rank in range(world):
            if want[rank].numel():
                held = load_file(str(sharded / f"model-rank-{rank}-part-0.safetensors"))
                assert torch.equal(held[BUFFER], want[rank]), (desc, rank)
        gathered = work / "gathered"
        assert run(reshard_bin, "gather", sharded, "-o", gathered).returncode == 0
        back = load_file(str(gathered / "model.safetensors"))
        assert all(torch.equal(back[n], weights[n]) for n in weights)
