"""A push into several engines executes the sync schedule (DESIGN 21) without vLLM: trainer
processes and stand-in engine workers over one StoreGroup run reshard.vllm.sync's stages
(plan_stages, run_stages) as WeightSync and the engines' workers do. Every worker must hold
what reshard.extract gives of the full tensors; the bytes on every link must equal what
reshard.plan_sync plans for the same maps and topology (one schedule object drives both); a
worker's shards reach on_ready only once nothing more is sent from them (processing in place
must not leak into a relay); trainer egress is one copy."""

import json
import math
import pathlib
import subprocess
import sys

import pytest

from conftest import BUILD
from maps import make_map, piece, replicated_map, split_map, stacked_expert_maps

torch = pytest.importorskip("torch")
HERE = pathlib.Path(__file__).resolve().parent

TRAINERS = 2
WORKERS = [2, 1]  # engine 0 at TP 2, engine 1 at TP 1

WORKER = r'''
import json, os, sys
import torch
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[5])
import reshard
from reshard.distributed import _torch_dtype
from reshard.vllm._group import StoreGroup
from store_procs import process_store
from reshard.vllm.sync import lane_groups, plan_stages, run_stages, stage_bytes, engine_ranks
rank, port_file, out = int(sys.argv[2]), sys.argv[3], sys.argv[4]
spec = json.loads(open(out + ".spec").read())
plan, fulls = spec["plan"], {n: torch.tensor(v) for n, v in spec["fulls"].items()}
trainers, workers = spec["trainers"], plan["workers"]
size = trainers + sum(workers)
store = process_store(rank, port_file)
comm = StoreGroup(store, "t/pg", rank, size, "gloo", 60)
made = [comm]
stages = plan_stages(plan["source"], plan, trainers,
                     lane_groups(store, "t", rank, comm, "gloo", 60, made), None)
engine, me = -1, rank
for e in range(len(workers)):
    if rank in engine_ranks(trainers, workers, e):
        engine, me = e, rank - engine_ranks(trainers, workers, e).start
lanes = {}
for st in stages:
    lanes.setdefault(st.lane, set()).add(st.source)
result = {"levels": sorted({st.level for st in stages}), "pushes": [],
          "lane_senders": sorted(len(v) for v in lanes.values())}
for push in range(2):
    scale = 1.0 + push
    shards, outs, ready = {}, {}, []
    if engine < 0:
        for n, m in plan["source"].items():
            pm = reshard.ParamMap.from_dict(m)
            if pm.buffer(rank):  # a fused buffer: every tensor's pieces written into it
                buf = shards.setdefault(pm.buffer(rank), torch.zeros(pm.shard_shape(rank)))
                reshard.extract(pm, fulls[n] * scale, rank, out=buf)
            else:
                shards[n] = reshard.extract(pm, fulls[n] * scale, rank)
    else:
        for st in stages:
            if st.engine == engine:
                sync = st.redistributor
                for n, m, d in zip(sync._names, sync._dst, sync._dtypes):
                    key = m.buffer(me) or n
                    shape = list(m.shard_shape(me))
                    if spec.get("strided") and len(shape) > 1:  # staged through a copy
                        dims = list(reversed(range(len(shape))))
                        t = torch.zeros([shape[i] for i in dims], dtype=_torch_dtype(d))
                        outs.setdefault(key, t.permute(dims))
                    else:
                        outs.setdefault(key, torch.zeros(shape, dtype=_torch_dtype(d)))
    def on_ready(got):
        for k, t in got.items():
            ready.append(k)
            if spec["process"]:
                t.mul_(2)  # processed in place: must not reach another worker
    run_stages(stages, engine, me, shards, outs if engine >= 0 else None, on_ready, None)
    sent, here, relayed, links = stage_bytes(stages, trainers, workers, rank)
    result["pushes"].append({"out": {k: v.float().tolist() for k, v in outs.items()},
                             "ready": ready,
                             "sent": sent, "relayed": relayed,
                             "links": [[a, b, n] for (a, b), n in sorted(links.items())]})
for g in made:
    g.shutdown()
open(out + f".{rank}", "w").write(json.dumps(result))
'''


EXPERT = [4, 12]  # as large as "w": the two experts get different root engines


def _experts(placement):
    return stacked_expert_maps(placement, [("e{e}.w", EXPERT)], buffer="experts")


def _case():
    """The trainer's maps over 2 processes and two engines': a row split, a replicated norm,
    two experts split by rows; engine 0 splits the weight by columns, replicates the norm and
    holds both experts in one buffer on each worker (pieces every worker of the engine needs:
    handed on within it), engine 1 holds everything whole, its experts in a buffer too."""
    e0 = make_map(EXPERT, [([2, 12], [piece([2, 12], 0, [12, 1], 0, [12, 1], [0])]),
                           ([2, 12], [piece([2, 12], 24, [12, 1], 0, [12, 1], [1])])])
    source = {"w": split_map([8, 6], 0, [4, 4]), "norm": replicated_map([6], 2),
              "e0.w": e0, "e1.w": e0}
    one, one_buffers = _experts([[0, 1], [0, 1]])
    whole, whole_buffers = _experts([[0, 1]])
    targets = [{"w": split_map([8, 6], 1, [3, 3]), "norm": replicated_map([6], 2), **one},
               {"w": split_map([8, 6], 0, [8]), "norm": replicated_map([6], 1), **whole}]
    return source, targets, [one_buffers, whole_buffers]


def _expected(name_or_buffer, engine, worker, fulls, targets):
    import reshard
    if name_or_buffer == "experts":
        return torch.stack([fulls["e0.w"], fulls["e1.w"]])
    return reshard.extract(reshard.ParamMap.from_dict(targets[engine][name_or_buffer]),
                           fulls[name_or_buffer], worker)


def _run(tmp_path, plan, fulls, process=True, strided=False):
    """Every process of the sync (the trainer processes, then each engine's workers) run from
    ``plan``; their results. ``strided``: the workers' shards are not contiguous (each
    exchange writes one through a copy of it)."""
    (tmp_path / "out.spec").write_text(json.dumps(
        {"plan": plan, "trainers": TRAINERS, "process": process, "strided": strided,
         "fulls": {n: t.tolist() for n, t in fulls.items()}}))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    size = TRAINERS + sum(plan["workers"])
    procs = [subprocess.Popen([sys.executable, str(script), str(BUILD / "python"), str(r),
                               str(tmp_path / "port"), str(tmp_path / "out"), str(HERE)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(size)]
    logs = [p.communicate(timeout=180)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    return [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(size)]


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_a_push_into_two_engines_runs_the_sync_schedule(tmp_path, strided):
    """The lanes of the schedule run at once. ``strided``: engine 1's expert buffer is written
    by two lanes of one wave (an expert from the trainer processes, the other relayed), each
    through a copy of the whole buffer: they must not overlap, or one loses the other's."""
    import reshard
    source, targets, buffers = _case()
    shapes = {"w": [8, 6], "norm": [6], "e0.w": EXPERT, "e1.w": EXPERT}
    fulls = {n: (torch.arange(torch.Size(s).numel(), dtype=torch.float32).reshape(s) * 0.5
                 + i * 100) for i, (n, s) in enumerate(shapes.items())}
    topology = {"hosts": [{"name": "a", "gpus": 3}, {"name": "b", "gpus": 2}],
                "placement": {"trainer": ["a:0", "a:1"], "engines": [["a:2", "b:0"], ["b:1"]]}}
    plan = {"error": None, "source": source, "targets": targets,
            "dtypes": [{n: "float32" for n in t} for t in targets], "bucket_bytes": 4096,
            "quantize": None, "workers": WORKERS, "waves": [["w", "norm"], ["e0.w", "e1.w"]],
            "topology": json.dumps(topology)}
    results = _run(tmp_path, plan, fulls, strided=strided)

    # The schedule plan_sync reports for the same maps and topology, per link.
    report = reshard.plan_sync(topology, source={"version": 1, **source},
                               targets=[{"version": 2, "buffers": b, **t}
                                        for t, b in zip(targets, buffers)], dtype="F32",
                               transfers=True)
    planned: dict[tuple[int, int], int] = {}
    assert report.transfers is not None
    for _, a, b, n, *_ in report.transfers:
        planned[(a, b)] = planned.get((a, b), 0) + n
    one_copy = 4 * sum(t.numel() for t in fulls.values())
    assert report.one_copy_bytes == one_copy
    assert len(results[0]["levels"]) >= 2  # relays, and pieces handed on within engine 0
    for push, scale in enumerate((1.0, 2.0)):
        first = results[0]["pushes"][push]
        assert {(a, b): n for a, b, n in first["links"]} == planned
        assert first["sent"] == one_copy  # every byte leaves the trainer processes once
        assert first["relayed"] > 0
        for e, count in enumerate(WORKERS):
            for w in range(count):
                got = results[TRAINERS + sum(WORKERS[:e]) + w]["pushes"][push]
                assert sorted(got["ready"]) == sorted(got["out"])  # each shard once
                for key, value in got["out"].items():
                    want = 2 * scale * _expected(key, e, w, fulls, targets)
                    assert torch.equal(torch.tensor(value), want), (e, w, key)


def test_relays_two_deep_into_four_engines(tmp_path):
    """Four engines on two hosts: the cost model relays within a host over NVLink, so a tensor
    reaches the far host once and is relayed on there (two deep); an engine's lane at one
    depth takes relays from more than one engine in turn. Every worker holds the full
    tensors' shards, each link carries plan_sync's bytes, one copy leaves the trainer."""
    import reshard
    shapes = {"w": [8, 6], "v": [6, 8], "u": [4, 4], "norm": [6]}
    fulls = {n: torch.arange(torch.Size(s).numel(), dtype=torch.float32).reshape(s) + i * 100
             for i, (n, s) in enumerate(shapes.items())}
    source = {"w": split_map([8, 6], 0, [4, 4]), "v": split_map([6, 8], 1, [5, 3]),
              "u": split_map([4, 4], 0, [1, 3]), "norm": replicated_map([6], 2)}
    whole = {n: split_map(s, 0, [s[0]]) for n, s in shapes.items()}
    split = {"w": split_map([8, 6], 1, [3, 3]), "v": split_map([6, 8], 0, [2, 4]),
             "u": split_map([4, 4], 1, [2, 2]), "norm": replicated_map([6], 2)}
    targets = [whole, whole, whole, split]
    workers = [1, 1, 1, 2]
    topology = {"hosts": [{"name": "t", "gpus": 2}, {"name": "b", "gpus": 2},
                          {"name": "c", "gpus": 3}], "nic_gbps": 50, "nvlink_gbps": 450,
                "placement": {"trainer": ["t:0", "t:1"], "engines": [["b:0"], ["b:1"],
                                                                     ["c:0"], ["c:1", "c:2"]]}}
    plan = {"error": None, "source": source, "targets": targets,
            "dtypes": [{n: "float32" for n in t} for t in targets], "bucket_bytes": 4096,
            "quantize": None, "workers": workers, "waves": [["w", "v"], ["u", "norm"]],
            "topology": json.dumps(topology)}
    results = _run(tmp_path, plan, fulls)
    report = reshard.plan_sync(topology, source={"version": 1, **source},
                               targets=[{"version": 1, **t} for t in targets], dtype="F32",
                               transfers=True)
    planned: dict[tuple[int, int], int] = {}
    assert report.transfers is not None
    for _, a, b, n, *_ in report.transfers:
        planned[(a, b)] = planned.get((a, b), 0) + n
    assert max(results[0]["levels"]) >= 2  # relayed on at the far host
    assert max(results[0]["lane_senders"]) >= 2  # relays from two engines into one lane
    for push, scale in enumerate((1.0, 2.0)):
        first = results[0]["pushes"][push]
        assert {(a, b): n for a, b, n in first["links"]} == planned
        assert first["sent"] == report.one_copy_bytes == 4 * sum(t.numel() for t in
                                                                 fulls.values())
        for e, count in enumerate(workers):
            for w in range(count):
                got = results[TRAINERS + sum(workers[:e]) + w]["pushes"][push]
                assert sorted(got["ready"]) == sorted(got["out"])
                for key, value in got["out"].items():
                    want = 2 * scale * reshard.extract(
                        reshard.ParamMap.from_dict(targets[e][key]), fulls[key], w)
                    assert torch.equal(torch.tensor(value), want), (e, w, key)


def test_fp8_engines_share_one_quantizing_at_the_trainer(tmp_path):
    """quantize= into two FP8 engines: the trainer processes quantize each 128 x 128 block
    once (a block split between them gathered at its owner first), and the schedule moves the
    FP8 data and scales: one copy out of the trainer, every worker's blocks and scales equal to
    quantizing the full tensor."""
    import reshard
    import reshard.distributed as rd
    full = torch.randn(256, 128, generator=torch.Generator().manual_seed(3)) * 0.05
    norm = torch.arange(6, dtype=torch.float32)
    data, scales = rd.quantize_fp8_blocks(full, (128, 128))
    source = {"x": split_map([256, 128], 0, [100, 156]), "norm": replicated_map([6], 2)}
    targets = [{"x": split_map([256, 128], 0, [128, 128]), "x_scale_inv": split_map([2, 1], 0,
                                                                                     [1, 1]),
                "norm": replicated_map([6], 2)},
               {"x": split_map([256, 128], 0, [256]), "x_scale_inv": split_map([2, 1], 0, [2]),
                "norm": replicated_map([6], 1)}]
    dtypes = {"x": "float8_e4m3fn", "x_scale_inv": "float32", "norm": "float32"}
    topology = {"hosts": [{"name": "a", "gpus": 5}]}
    plan = {"error": None, "source": source, "targets": targets,
            "dtypes": [dict(dtypes), dict(dtypes)], "bucket_bytes": 4096,
            "quantize": {"block": [128, 128]}, "workers": WORKERS, "waves": [["x", "norm"]],
            "topology": json.dumps(topology)}
    results = _run(tmp_path, plan, {"x": full, "norm": norm}, process=False)
    wants = {"x": data.float(), "x_scale_inv": scales, "norm": norm}
    for push, scale in enumerate((1.0, 2.0)):
        first = results[0]["pushes"][push]
        assert first["sent"] == 256 * 128 + 2 * 4 + 6 * 4  # FP8 data, scales, the norm: once
        for e, count in enumerate(WORKERS):
            for w in range(count):
                got = results[TRAINERS + sum(WORKERS[:e]) + w]["pushes"][push]
                assert sorted(got["out"]) == ["norm", "x", "x_scale_inv"]
                for key, value in got["out"].items():
                    want = reshard.extract(reshard.ParamMap.from_dict(targets[e][key]),
                                           wants[key], w)
                    if key != "x":  # twice the weights: the same FP8 data, twice the scales
                        want = want * scale
                    assert torch.equal(torch.tensor(value), want), (e, w, key)


def test_fp8_engines_quantize_out_of_a_fused_trainer_buffer(tmp_path):
    """quantize= into two FP8 engines from trainer maps that keep tensors in a fused buffer (a
    Megatron-Core linear_qkv: "a" and "b" quantized, "c" not, each split by rows between the
    two trainer processes, every rank's slices stacked in one buffer): the quantized tensors'
    blocks are gathered out of the buffer (4 x 4 blocks straddle the trainers' row split in
    both), "c" is sent from the same buffer as it is, and a tensor replicated on both trainer
    processes is quantized at one of them (the other owns none of its blocks). Every worker
    holds the reference quantization of the full tensors (its own rounding), byte for byte."""
    import reshard
    from quantized_sync_worker import fused_rows, reference_quantize
    block = (4, 4)
    shapes = {"a": [12, 8], "b": [6, 8], "c": [4, 8], "r": [4, 4]}
    g = torch.Generator().manual_seed(5)
    fulls = {n: torch.randn(s, generator=g) * 0.05 for n, s in shapes.items()}
    source = {**fused_rows([(n, shapes[n]) for n in "abc"], "fused"),
              "r": replicated_map([4, 4], 2)}
    targets = [{"a": split_map([12, 8], 0, [8, 4]), "a_scale_inv": split_map([3, 2], 0, [2, 1]),
                "b": replicated_map([6, 8], 2), "b_scale_inv": replicated_map([2, 2], 2),
                "c": split_map([4, 8], 1, [4, 4]), "r": replicated_map([4, 4], 2),
                "r_scale_inv": replicated_map([1, 1], 2)},
               {"a": split_map([12, 8], 0, [12]), "a_scale_inv": split_map([3, 2], 0, [3]),
                "b": split_map([6, 8], 0, [6]), "b_scale_inv": split_map([2, 2], 0, [2]),
                "c": split_map([4, 8], 0, [4]), "r": split_map([4, 4], 0, [4]),
                "r_scale_inv": split_map([1, 1], 0, [1])}]
    dtypes = {n: "float8_e4m3fn" for n in "abr"}
    dtypes.update({n + "_scale_inv": "float32" for n in "abr"}, c="float32")
    plan = {"error": None, "source": source, "targets": targets,
            "dtypes": [dict(dtypes), dict(dtypes)], "bucket_bytes": 4096,
            "quantize": {"block": list(block)}, "workers": WORKERS,
            "waves": [["a", "b", "c"], ["r"]],
            "topology": json.dumps({"hosts": [{"name": "a", "gpus": 5}]})}
    results = _run(tmp_path, plan, fulls, process=False)
    wants = {"c": fulls["c"]}
    for n in "abr":
        data, scales = reference_quantize(fulls[n], block)
        wants[n], wants[n + "_scale_inv"] = data.float(), scales
    grid = sum(math.prod(-(-s // b) for s, b in zip(shapes[n], block)) for n in "abr")
    for push, scale in enumerate((1.0, 2.0)):
        first = results[0]["pushes"][push]
        # FP8 data, one scale per block, "c" in float32: once out of the trainer processes.
        assert first["sent"] == sum(math.prod(shapes[n]) for n in "abr") + 4 * grid + 4 * 32
        for e, count in enumerate(WORKERS):
            for w in range(count):
                got = results[TRAINERS + sum(WORKERS[:e]) + w]["pushes"][push]
                assert sorted(got["out"]) == sorted(targets[e])
                for key, value in got["out"].items():
                    want = reshard.extract(reshard.ParamMap.from_dict(targets[e][key]),
                                           wants[key], w)
                    if key not in "abr":  # twice the weights: the same FP8 data
                        want = want * scale
                    assert torch.equal(torch.tensor(value), want), (push, e, w, key)
