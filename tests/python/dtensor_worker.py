"""reshard.dtensor.redistribute between device meshes, 6 processes on gloo (the CPU).

    torchrun --nproc_per_node 6 dtensor_worker.py OUT_DIR

Cases: a (2, 2) mesh on processes 0-3 -> a (3,) mesh on 3-5 (overlapping at 3), and (4,) on 0-3
-> (2,) on 4-5 (disjoint); Shard, Replicate, uneven and empty shards, _StridedShard (FSDP2 over
TP) as a source. Each process writes OUT_DIR/rank-R.json: per case whether each result's
``to_local()`` equals ``distribute_tensor(full, mesh, placements).to_local()`` bit for bit, its
placements and shape, what it got back outside the target mesh, its bytes sent and received and
the least it must receive (counted here from the data: the elements of its target shards that
none of its own source shards hold); and for each refused call the message, or a note that the
call did not raise.
"""

import datetime
import json
import pathlib
import sys
import traceback

import torch
import torch.distributed as dist
from torch.distributed.tensor import (DeviceMesh, DTensor, Partial, Replicate, Shard,
                                      distribute_tensor)
from torch.distributed.tensor.placement_types import _StridedShard

import reshard.dtensor as rdt
from worker_exit import leave


def strided_source(full, mesh):
    """FSDP2's dp chunk of each TP chunk of dim 0 on a (dp, tp) mesh, as FSDP2 over TP holds it
    (torch.chunk, the last chunks short), as a DTensor with _StridedShard."""
    coord = mesh.get_coordinate()
    local = torch.empty(0, *full.shape[1:], dtype=full.dtype)
    if coord is not None:
        dp, tp = coord
        tp_part = torch.chunk(full, mesh.size(1), dim=0)
        tp_part = tp_part[tp] if tp < len(tp_part) else full[:0]
        dp_part = torch.chunk(tp_part, mesh.size(0), dim=0)
        local = (dp_part[dp] if dp < len(dp_part) else tp_part[:0]).contiguous()
    return DTensor.from_local(local, mesh, [_StridedShard(0, split_factor=mesh.size(1)), Shard(0)],
                              run_check=False, shape=full.shape, stride=full.stride())


def fulls(shapes, dtypes):
    """Tensors whose elements are all different (so that where an element lies says which
    element it is), the same on every process."""
    out, start = {}, 0
    for name, shape in shapes.items():
        n = int(torch.Size(shape).numel())
        out[name] = (torch.arange(start, start + n, dtype=torch.float64) / 4).reshape(shape) \
            .to(dtypes.get(name, torch.float32))
        start += n
    return out


def least_received(me, sources, fulls_, target_locals):
    """Bytes of this process's target shards whose elements none of its own source shards hold."""
    total = 0
    for name, local in target_locals.items():
        held = set()
        src = sources[name]
        if me in src.device_mesh.mesh.flatten().tolist():
            held = set(src.to_local().double().flatten().tolist())
        need = local.double().flatten().tolist()
        total += sum(1 for v in need if v not in held) * local.element_size()
    return total


def check_case(me, sources, fulls_, mesh, placements, stats_key, result):
    stats = {}
    got = rdt.redistribute(sources, mesh, placements, stats=stats)
    ranks = mesh.mesh.flatten().tolist()
    case = {"equal": {}, "placements": {}, "shapes": {}, "outside": None, "stats": stats}
    expected = {}
    for name, full in fulls_.items():
        p = placements[name] if isinstance(placements, dict) else placements
        want = distribute_tensor(full, mesh, p)
        if me in ranks:
            expected[name] = want.to_local()
            mine = got[name]
            case["equal"][name] = (isinstance(mine, DTensor)
                                   and mine.to_local().dtype == want.to_local().dtype
                                   and torch.equal(mine.to_local(), want.to_local()))
            case["placements"][name] = [str(q) for q in mine.placements]
            case["shapes"][name] = [list(mine.shape), list(mine.to_local().shape)]
    if me not in ranks:
        case["outside"] = {n: v is None for n, v in got.items()}
    case["least"] = least_received(me, sources, fulls_, expected)
    result[stats_key] = case


def refused(fn):
    try:
        fn()
    except rdt.RedistributeError as e:
        return {"type": type(e).__name__, "message": str(e)}
    except Exception as e:  # the wrong kind: the test says so
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None, "message": "did not raise"}


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    me = dist.get_rank()
    result = {"errors": []}
    try:
        square = DeviceMesh("cpu", [[0, 1], [2, 3]])
        three = DeviceMesh("cpu", [3, 4, 5])
        four = DeviceMesh("cpu", [0, 1, 2, 3])
        two = DeviceMesh("cpu", [4, 5])
        backwards = DeviceMesh("cpu", [5, 4, 3])

        # (2, 2) on 0-3 -> (3,) on 3-5
        shapes = {"w": [7, 10], "b": [5], "e": [13, 6], "r": [4, 3], "z": [2, 3], "h": [6, 4]}
        f = fulls(shapes, {"h": torch.bfloat16})
        src = {"w": distribute_tensor(f["w"], square, [Shard(0), Shard(1)]),
               "b": distribute_tensor(f["b"], square, [Replicate(), Shard(0)]),
               "e": strided_source(f["e"], square),
               "r": distribute_tensor(f["r"], square, [Replicate(), Replicate()]),
               "z": distribute_tensor(f["z"], square, [Shard(1), Replicate()]),
               "h": distribute_tensor(f["h"], square, [Shard(1), Shard(0)])}
        result["strided_source_reads_back"] = (
            torch.equal(src["e"].full_tensor(), f["e"]) if me < 4 else None)
        into = {"w": [Shard(0)], "b": [Shard(0)], "e": [Replicate()], "r": [Shard(1)],
                "z": [Shard(0)], "h": [Shard(-1)]}
        check_case(me, src, f, three, into, "square_to_three", result)

        # (4,) on 0-3 -> (2,) on 4-5, one placement list for all; processes 4 and 5 pass None
        g = fulls({"w": [9, 4], "v": [3]}, {})
        src2 = {"w": distribute_tensor(g["w"], four, [Shard(0)]),
                "v": distribute_tensor(g["v"], four, [Shard(0)])}
        stats = {}
        got = rdt.redistribute(src2 if me < 4 else None, two, [Shard(0)], stats=stats)
        expect = {n: distribute_tensor(t, two, [Shard(0)]) for n, t in g.items()}
        case = {"stats": stats, "equal": {}, "outside": None}
        if me >= 4:
            case["equal"] = {n: torch.equal(got[n].to_local(), expect[n].to_local())
                             for n in g}
        else:
            case["outside"] = {n: v is None for n, v in got.items()}
        case["least"] = least_received(me, src2, g, {n: expect[n].to_local() for n in g}
                                       if me >= 4 else {})
        result["four_to_two"] = case

        # one DTensor (not a dict): a DTensor back on the target mesh, None outside it
        one = rdt.redistribute(src["w"], three, [Replicate()])
        result["single"] = (one is None) if me < 3 else \
            (isinstance(one, DTensor) and torch.equal(one.to_local(), f["w"]))

        # refusals: the same RedistributeError on every process, and the group still works
        result["refused"] = {
            "shard_past_dims": refused(lambda: rdt.redistribute(src, three, {**into, "w": [
                Shard(2)]})),
            "partial_target": refused(lambda: rdt.redistribute(src["r"], three, [Partial()])),
            "meshes_disagree": refused(lambda: rdt.redistribute(
                src["w"], backwards if me == 4 else three, [Shard(0)])),
            "placements_disagree": refused(lambda: rdt.redistribute(
                src["w"], three, [Shard(1)] if me == 0 else [Shard(0)])),
            "shapes_disagree": refused(lambda: rdt.redistribute(
                src["h"] if me == 2 else src["w"], three, [Shard(0)])),
            "too_many_placements": refused(lambda: rdt.redistribute(
                src["w"], three, [Shard(0), Replicate()])),
            "not_a_dtensor": refused(lambda: rdt.redistribute(
                {"w": f["w"] if me == 1 else src["w"]}, three, [Shard(0)])),
            "placements_miss_a_name": refused(lambda: rdt.redistribute(
                src, three, {n: p for n, p in into.items() if n != "b"})),
        }
        # what one process alone gets wrong: a placement that cannot be pickled (to be
        # compared), stats that is not a dict
        result["refused"]["unpicklable_placement"] = refused(lambda: rdt.redistribute(
            src["w"], three, [lambda: 0] if me == 1 else [Shard(0)]))
        result["refused"]["stats_not_a_dict"] = refused(lambda: rdt.redistribute(
            src["w"], three, [Shard(0)], stats=[] if me == 0 else None))
        result["refused"]["holder_passes_none"] = refused(lambda: rdt.redistribute(
            None if me == 2 else src2, two, [Shard(0)]))
        partial = DTensor.from_local(torch.ones(2, 2), four, [Partial()], run_check=False)
        result["refused"]["partial_source"] = refused(
            lambda: rdt.redistribute({"p": partial}, three, [Shard(0)]))

        # a group of the union alone (processes 0-3): 4 and 5 take no part
        sub = dist.new_group([0, 1, 2, 3])
        pair = DeviceMesh("cpu", [2, 3])
        if me < 4:
            cut = {"w": [Shard(1)], "v": [Shard(0)]}
            got = rdt.redistribute(src2, pair, cut, group=sub)
            want = {n: distribute_tensor(t, pair, cut[n]) for n, t in g.items()}
            result["subgroup"] = all(
                (got[n] is None) if me < 2 else torch.equal(got[n].to_local(),
                                                            want[n].to_local())
                for n in g)
        else:
            result["subgroup"] = None
        after = rdt.redistribute(src["w"], three, [Shard(1)])
        result["works_after_refusals"] = (after is None) if me < 3 else torch.equal(
            after.to_local(), distribute_tensor(f["w"], three, [Shard(1)]).to_local())
    except Exception:
        result["errors"].append(traceback.format_exc())
    (out / f"rank-{me}.json").write_text(json.dumps(result))
    leave()


if __name__ == "__main__":
    main()
