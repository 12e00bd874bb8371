"""Runs re-sharding cases between live processes and records what each process saw.

Run under torchrun (one process per rank, gloo on CPU):

    torchrun --nproc_per_node 4 distributed_worker.py CASES.json OUT_DIR

CASES.json is a list of cases (see test_distributed.py). For every case, in order, each
process builds the full tensors from the case's seed, extracts the source shards it holds,
calls reshard.distributed, and compares what it receives bit for bit with the offline
reshard.transfer of the same maps. What happened goes to OUT_DIR/NAME/rank-R.json: the error
raised (if any), the statistics, the schedule, and the parameters that differ from the
reference. A failing case does not stop the others: the next case starting in step is itself
evidence that no process was left waiting.

A case's "fault" ({"process": P, "kind": K}) makes process P alone pass one wrong argument (see
FAULTS); the others pass good ones, and P stays alive afterwards, as a server would.
RESHARD_TEST_PG_TIMEOUT (seconds, default 60) bounds how long a collective may wait.
"""

import datetime
import json
import os
import pathlib
import sys
import traceback

import torch
import torch.distributed as dist

import reshard
import reshard.distributed as rd
from worker_exit import leave


def full_tensor(shape, dtype, generator):
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(-100, 100, shape, generator=generator).to(dtype)


def setup(case, step):
    """name -> (source map, target map, full tensor) for the case's seed and step."""
    g = torch.Generator().manual_seed(case.get("seed", 0) * 1000 + step)
    out = {}
    for name, p in sorted(case["params"].items()):
        src, dst = reshard.ParamMap.from_dict(p["source"]), reshard.ParamMap.from_dict(p["target"])
        dtype = getattr(torch, p.get("dtype", "float32"))
        out[name] = (src, dst, full_tensor(src.logical_shape, dtype, g))
    return out


def local_shards(params, source_ranks, me):
    """This process's source rank tensors: a shard per parameter, or one buffer (by its name)
    that every parameter over it is extracted into."""
    if me not in source_ranks:
        return {}
    r = source_ranks.index(me)
    out = {}
    for name, (src, _, full) in params.items():
        buffer = src.buffer(r)
        if buffer:
            out.setdefault(buffer, torch.zeros(src.shard_shape(r), dtype=full.dtype))
            reshard.extract(src, full, r, out=out[buffer])
        else:
            out[name] = reshard.extract(src, full, r)
    return out


def reference(params, target_ranks, me):
    """What this process must end up with: the offline transfer of every parameter (into a
    buffer: each parameter's plan run into the same zeroed target)."""
    if me not in target_ranks:
        return {}
    t = target_ranks.index(me)
    out = {}
    for name, (src, dst, full) in params.items():
        shards = [reshard.extract(src, full, r) for r in range(src.world_size)]
        plan = reshard.compose(source=src, target=dst)
        buffer = dst.buffer(t)
        if not buffer:
            out[name] = reshard.transfer(plan, shards)[t]
            continue
        outs = [torch.zeros(dst.shard_shape(r), dtype=full.dtype) for r in range(dst.world_size)]
        outs[t] = out.setdefault(buffer, outs[t])
        reshard.transfer(plan, shards, out=outs)
    return out


def marked(m, marker, r):
    """Rank r's shard of an index marker; a buffer's elements of other tensors read -1."""
    out = torch.full(m.shard_shape(r), -1, dtype=torch.int64) if m.buffer(r) else None
    return reshard.extract(m, marker, r, out=out, scale_power=0)


def lower_bound(params, source_ranks, target_ranks, me):
    """Bytes of this process's target shards that its own source shard does not hold, counted
    element by element on index markers (independently of the planner)."""
    if me not in target_ranks:
        return 0
    total = 0
    for src, dst, full in params.values():
        # Markers: each valid element of F is its flat index in the valid shape; padding -1.
        valid = tuple(slice(0, v) for v in src.valid_shape)
        index = torch.arange(full[valid].numel(), dtype=torch.int64).reshape(src.valid_shape)
        markers = []
        for m in (src, dst):
            marker = torch.full(m.logical_shape, -1, dtype=torch.int64)
            marker[valid] = index
            markers.append(marker)
        need = set(marked(dst, markers[1], target_ranks.index(me)).flatten().tolist())
        need.discard(-1)
        have = set()
        if me in source_ranks:
            have = set(marked(src, markers[0], source_ranks.index(me)).flatten().tolist())
        total += len(need - have) * full.element_size()
    return total


def corrupt(case, shards, me):
    """Makes this process's input wrong the way the case asks."""
    bad = case.get("corrupt")
    if not bad or bad["process"] != me:
        return shards
    name = bad["param"]
    if bad["kind"] == "shape":
        shards[name] = shards[name][..., :-1].contiguous()
    elif bad["kind"] == "dtype":
        shards[name] = shards[name].to(torch.float16)
    elif bad["kind"] == "missing":
        del shards[name]
    return shards


def _target_shape(case, me, name):
    p = case["params"][name]
    dst = reshard.ParamMap.from_dict(p["target"])
    return dst.shard_shape(case["target_ranks"].index(me))


# kind -> what process P does wrong: changes to the constructor's keywords ("options"), to its
# shards or to its out. Each must raise RedistributeError on every process.
FAULTS = {
    "bucket_bytes_not_an_int": lambda c, me: {"options": {"bucket_bytes": "big"}},
    "num_threads_too_large": lambda c, me: {"options": {"num_threads": 2**63}},
    "scale_power_not_an_int": lambda c, me: {"options": {"scale_power": "1"}},
    "dtypes_missing_a_name": lambda c, me: {"options": {"dtypes": {}}},
    "lossy_scale_allowed_on_one": lambda c, me: {"options": {"allow_lossy_scale": True}},
    "unknown_option": lambda c, me: {"options": {"bucket_byte": 64}, "function": True},
    "shards_not_a_mapping": lambda c, me: {"shards": lambda shards: list(shards.values())},
    "meta_shard": lambda c, me: {"shards": lambda shards: {
        n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in shards.items()}},
    "out_not_a_mapping": lambda c, me: {"out": [torch.empty(_target_shape(c, me, "w"))]},
    "out_not_a_tensor": lambda c, me: {"out": {"w": _target_shape(c, me, "w")}},
    "out_on_meta": lambda c, me: {"out": {"w": torch.empty(_target_shape(c, me, "w"),
                                                            device="meta")}},
    "out_requires_grad": lambda c, me: {"out": {"w": torch.zeros(_target_shape(c, me, "w"),
                                                                  requires_grad=True)}},
    "out_negative_bit": lambda c, me: {"out": {"w": torch._neg_view(
        torch.zeros(_target_shape(c, me, "w")))}},
    "out_expanded": lambda c, me: {"out": {"w": torch.zeros(_target_shape(c, me, "w")[-1:])
                                           .expand(_target_shape(c, me, "w"))}},
    "out_unknown_name": lambda c, me: {"out": {"nope": torch.zeros(3)}},
    # Not a refusal: raised on this process alone, once its transfer is through.
    "on_ready_raises": lambda c, me: {"on_ready_raises": True},
}


def fault_of(case, me):
    f = case.get("fault")
    if not f or f["process"] != me:
        return {}
    return FAULTS[f["kind"]](case, me)


def maps_of(case, me, side):
    maps = {name: p[side] for name, p in case["params"].items()}
    other = case.get("different_map")
    if other and other["process"] == me:
        maps[other["param"]] = other[side]
    return maps


def same(got, want):
    """Bit for bit equal, dtype and shape included."""
    return got is not None and want is not None and got.dtype == want.dtype and \
        got.shape == want.shape and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def run_case(case, me):
    group = None
    if "group" in case:
        group = dist.new_group(case["group"])  # every process takes part in new_group
        if me not in case["group"]:
            return {"skipped": True}
    result = {"error": None, "mismatch": [], "stats": [], "schedule": None, "handed_on": []}
    source_ranks, target_ranks = case["source_ranks"], case["target_ranks"]
    try:
        dtypes = case.get("dtypes")
        fault = fault_of(case, me)
        options = {"bucket_bytes": case.get("bucket_bytes", 1 << 20),
                   "dtypes": None if dtypes is None else getattr(torch, dtypes),
                   **fault.get("options", {})}
        if fault.get("function"):  # one-shot redistribute(), with its keyword options
            params = setup(case, 0)
            rd.redistribute(maps_of(case, me, "source"), maps_of(case, me, "target"),
                            local_shards(params, source_ranks, me), source_ranks=source_ranks,
                            target_ranks=target_ranks, group=group, **options)
            raise AssertionError("redistribute() accepted an unknown option")
        sync = rd.Redistributor(maps_of(case, me, "source"), maps_of(case, me, "target"),
                                source_ranks=source_ranks, target_ranks=target_ranks,
                                group=group, **options)
        # The copies a GPU process makes with torch where its shards are, run on the CPU.
        sync._force_torch_copies = bool(case.get("torch_copies"))
        out = fault.get("out")
        for step in range(case.get("steps", 1)):
            params = setup(case, step)
            shards = corrupt(case, local_shards(params, source_ranks, me), me)
            if "shards" in fault:
                shards = fault["shards"](shards)
            if case.get("negative_views"):  # shards held as torch's negative views of -x
                shards = {n: torch._neg_view(-t) for n, t in shards.items()}
            if case.get("out_over_shards") == me:  # out in the memory of its own source shards
                out = {n: t.view(_target_shape(case, me, n)) for n, t in shards.items()}
            if case.get("garbage_out") and me in target_ranks:  # every byte 0xFF (NaN)
                want_shapes = reference(params, target_ranks, me)
                out = {n: torch.full(w.shape, -1, dtype=torch.int8).view(w.dtype)
                       if w.element_size() == 1 else
                       torch.full(w.reshape(-1).view(torch.uint8).shape, 255,
                                  dtype=torch.uint8).view(w.dtype).view(w.shape)
                       for n, w in want_shapes.items()}
            if case.get("dry_run"):
                result["schedule"] = sync.run(shards, dry_run=True)
                continue
            handed_on = []  # per on_ready call: {name: whether it held its final values}

            def on_ready(tensors, params=params, handed_on=handed_on):
                want = reference(params, target_ranks, me)
                handed_on.append({n: same(t, want.get(n)) for n, t in tensors.items()})
                if fault.get("on_ready_raises"):
                    raise RuntimeError(f"on_ready of process {me} fails on purpose")
            got = sync.run(shards, out, on_ready=on_ready)
            result["handed_on"].append(handed_on)
            if case.get("reuse_out"):
                out = got
            want = reference(params, target_ranks, me)
            if sorted(got) != sorted(want):
                result["mismatch"].append(f"step {step}: got {sorted(got)}, want {sorted(want)}")
            for name, w in want.items():
                if not same(got.get(name), w):
                    result["mismatch"].append(f"step {step}: {name}")
                if out is not None and got.get(name) is not out[name]:
                    result["mismatch"].append(f"step {step}: {name} not written into out")
            result["stats"].append(sync.last_stats)
            result["lower_bound"] = lower_bound(params, source_ranks, target_ranks, me)
        if result["schedule"] is None:
            result["schedule"] = sync.schedule()
    except Exception as e:  # recorded for the test to judge
        result["error"] = f"{type(e).__name__}: {e}"
        if not isinstance(e, rd.RedistributeError):
            result["traceback"] = traceback.format_exc(limit=6)
    return result


def main():
    cases = json.loads(pathlib.Path(sys.argv[1]).read_text())
    out_dir = pathlib.Path(sys.argv[2])
    timeout = float(os.environ.get("RESHARD_TEST_PG_TIMEOUT", "60"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    me = dist.get_rank()
    for case in cases:
        result = run_case(case, me)
        case_dir = out_dir / case["name"]
        case_dir.mkdir(parents=True, exist_ok=True)
        (case_dir / f"rank-{me}.json").write_text(json.dumps(result, indent=1, default=str))
        dist.barrier()  # the processes start every case together
    leave()


if __name__ == "__main__":
    main()
