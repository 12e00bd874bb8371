"""Runs Redistributor.verify cases between live processes and records what each saw.

Run under torchrun (one process per rank, gloo on CPU):

    torchrun --nproc_per_node 4 verify_worker.py CASES.json OUT_DIR

For every case, in order, each process builds the full tensors from the case's seed, runs the
re-sharding, then (as the case says) alters one element of a target shard, of a target's
padding, or of a source shard, and calls verify() on every process. OUT_DIR/NAME/rank-R.json
records the pairs checked or the error raised, and the full-tensor index of every element of
the altered target shard (index markers moved by the same maps), so that the test can check
the element the error names. The next case starting in step shows no process was left waiting.
OUT_DIR/exit/rank-R.json lists the threads the process still runs once reshard's exit handler
has run, just before the interpreter finalizes.
"""

import atexit
import datetime
import json
import math
import os
import pathlib
import sys
import traceback

import torch
import torch.distributed as dist

import reshard
import reshard.distributed as rd


def full_tensor(shape, dtype, generator):
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(-100, 100, shape, generator=generator).to(dtype)


def shards_of(maps, fulls, rank):
    """A rank's shards: one per tensor, or one buffer (by its name) shared by several."""
    out = {}
    for name, m in maps.items():
        buffer = m.buffer(rank)
        if buffer:
            out.setdefault(buffer, torch.zeros(m.shard_shape(rank), dtype=fulls[name].dtype))
            reshard.extract(m, fulls[name], rank, out=out[buffer])
        else:
            out[name] = reshard.extract(m, fulls[name], rank)
    return out


def flip(t, flat):
    """Changes one element's lowest bit, in place."""
    raw = t.view(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                           8: torch.int64}[t.element_size()])
    raw[flat] ^= 1


def full_indices(m, rank):
    """The flat index in F of every element of rank's shard (-1 where none is: padding or
    another tensor's place in a buffer), moved by reshard.extract from an index marker."""
    marker = torch.arange(math.prod(m.logical_shape), dtype=torch.int64).reshape(m.logical_shape)
    valid = tuple(slice(0, v) for v in m.valid_shape)
    masked = torch.full(m.logical_shape, -1, dtype=torch.int64)
    masked[valid] = marker[valid]
    out = torch.full(m.shard_shape(rank), -1, dtype=torch.int64)
    return reshard.extract(m, masked, rank, out=out, scale_power=0).reshape(-1).tolist()


def build(case, me):
    src = {n: reshard.ParamMap.from_dict(p["source"]) for n, p in case["params"].items()}
    dst = {n: reshard.ParamMap.from_dict(p["target"]) for n, p in case["params"].items()}
    for n in case.get("target_only", []):
        dst[n] = reshard.ParamMap.from_dict(case["target_only"][n])
    g = torch.Generator().manual_seed(case["seed"])
    fulls = {n: full_tensor(src[n].logical_shape, getattr(torch, p.get("dtype", "float32")), g)
             for n, p in sorted(case["params"].items())}
    return src, dst, fulls


def delta_steps(case, me, sync, src, dst, fulls, out):
    """After a first delta run, one element of the full bf16 weight changed per step (each
    in another FP8 block): a delta run, its targets compared bit for bit with the block
    quantization of the whole new weight (rd.quantize_fp8_blocks), and the bytes it sent."""
    sources, targets = case["source_ranks"], case["target_ranks"]
    spec = case["quantize"]["w"]
    steps = []
    for at in [None] + case["delta_after"]:
        if at is not None:
            fulls["w"][tuple(at)] += 1.0
        shards = shards_of(src, fulls, sources.index(me)) if me in sources else {}
        out = sync.run(shards, out, delta=True)
        equal = True
        if me in targets:
            t = targets.index(me)
            data, scales = rd.quantize_fp8_blocks(fulls["w"], spec["block"])
            want = {"w": reshard.extract(dst["w"], data, t),
                    spec["scale"]: reshard.extract(dst[spec["scale"]], scales, t),
                    "n": reshard.extract(dst["n"], fulls["n"], t)}
            equal = all(torch.equal(out[n].view(torch.uint8), w.view(torch.uint8))
                        for n, w in want.items())
        steps.append({"equal": equal, "delta": sync._final.last_stats["delta"],
                      "sent": sync.last_stats["sent"]})
    return steps


def run_case(case, me):
    result = {"error": None, "checked": None, "indices": None}
    sources, targets = case["source_ranks"], case["target_ranks"]
    try:
        src, dst, fulls = build(case, me)
        shards = shards_of(src, fulls, sources.index(me)) if me in sources else {}
        if "quantize" in case:
            sync = rd.QuantizingRedistributor(src, dst, quantize=case["quantize"],
                                              source_ranks=sources, target_ranks=targets,
                                              dtypes=torch.bfloat16, bucket_bytes=1 << 12)
        else:
            sync = rd.Redistributor(src, dst, source_ranks=sources, target_ranks=targets,
                                    bucket_bytes=case.get("bucket_bytes", 1 << 12))
        got = sync.run(shards)
        alter = case.get("alter")
        if alter and alter["process"] == me:
            where = got if alter["side"] == "target" else shards
            flip(where[alter["param"]], alter["flat"])
        if alter and alter["side"] == "target" and alter["process"] == me:
            name = alter["param"]
            m = dst[name] if name in dst else None
            if m is not None:
                result["indices"] = full_indices(m, targets.index(me))
        if case.get("explicit"):
            result["checked"] = sync.verify(got, shards)
        else:
            result["checked"] = sync.verify()
        if case.get("delta_after"):
            result["delta"] = delta_steps(case, me, sync, src, dst, fulls, got)
    except Exception as e:  # recorded for the test to judge
        result["error"] = f"{type(e).__name__}: {e}"
        if not isinstance(e, rd.RedistributeError):
            result["traceback"] = traceback.format_exc(limit=8)
    return result


def run_delta(case, me):
    """Ten AdamW steps of a small model (fp32 master weights, pushed as bf16), trained alike in
    every process; after each, a delta push of the bf16 weights, compared bit for bit with
    what a full push gives (the target map's shard of the full tensor), then verified."""
    result = {"error": None, "steps": []}
    sources, targets = case["source_ranks"], case["target_ranks"]
    try:
        src = {n: reshard.ParamMap.from_dict(p["source"]) for n, p in case["params"].items()}
        dst = {n: reshard.ParamMap.from_dict(p["target"]) for n, p in case["params"].items()}
        torch.manual_seed(case["seed"])
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                                    torch.nn.Linear(128, 64))
        names = {"0.weight": "up.weight", "0.bias": "up.bias", "2.weight": "down.weight",
                 "2.bias": "down.bias"}
        opt = torch.optim.AdamW(model.parameters(), lr=case["lr"], weight_decay=0.01)
        sync = rd.Redistributor(src, dst, source_ranks=sources, target_ranks=targets,
                                dtypes=torch.bfloat16, bucket_bytes=1 << 12)
        out, before = None, None
        for step in range(case["steps"]):
            g = torch.Generator().manual_seed(1000 + step)
            x = torch.randn(32, 64, generator=g)
            loss = (model(x) - x.flip(1)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            fulls = {names[n]: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
            changed = None if before is None else sum(
                int((fulls[n].view(torch.int16) != before[n].view(torch.int16)).sum())
                for n in fulls) / sum(t.numel() for t in fulls.values())
            before = fulls
            shards = shards_of(src, fulls, sources.index(me)) if me in sources else {}
            if step == case.get("lose_copy_at") and me == case.get("lose_copy_on"):
                sync._delta_base = None  # as after a run that failed on this process
            out = sync.run(shards, out, delta=True)
            equal = True
            if me in targets:
                t = targets.index(me)
                equal = all(torch.equal(out[n].view(torch.int16),
                                        reshard.extract(dst[n], fulls[n], t).view(torch.int16))
                            for n in dst)
            stats = dict(sync.last_stats)
            result["steps"].append({"equal": equal, "changed": changed, "stats": stats,
                                    "verified": sync.verify()})
    except Exception as e:  # recorded for the test to judge
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc(limit=8)
    return result


def threads_at_exit(path):
    """Records the threads this process still runs once the exit handlers registered after
    this one (reshard's among them) have run, just before the interpreter finalizes."""
    names = [(pathlib.Path("/proc/self/task") / t / "comm").read_text().strip()
             for t in sorted(os.listdir("/proc/self/task"))]
    path.write_text(json.dumps(names))


def main():
    cases = json.loads(pathlib.Path(sys.argv[1]).read_text())
    out_dir = pathlib.Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    me = dist.get_rank()
    (out_dir / "exit").mkdir(parents=True, exist_ok=True)
    atexit.register(threads_at_exit, out_dir / "exit" / f"rank-{me}.json")
    for case in cases:
        result = run_delta(case, me) if case.get("delta") else run_case(case, me)
        case_dir = out_dir / case["name"]
        case_dir.mkdir(parents=True, exist_ok=True)
        (case_dir / f"rank-{me}.json").write_text(json.dumps(result, indent=1, default=str))
        dist.barrier()  # the processes start every case together
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
