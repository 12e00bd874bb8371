"""reshard.dtensor.redistribute: DTensors moved between device meshes that torch itself will not
move between ("Cross device mesh comm not supported yet!"), checked against torch's own
``distribute_tensor`` on the new mesh (dtensor_worker.py under torchrun, 6 processes on gloo),
and the target maps against torch's splits in one process."""

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
from torch.distributed.tensor import Partial, Replicate, Shard  # noqa: E402

import reshard  # noqa: E402
import reshard.dtensor as rdt  # noqa: E402
from conftest import BUILD  # noqa: E402
from ds_checkpoints import free_loopback_port  # noqa: E402
from test_torch_maps import HERE  # noqa: E402

WORLD = 6


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dtensor")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BUILD / "python"), str(HERE)]),
               OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                        str(WORLD), "--master_addr", "127.0.0.1", "--master_port",
                        str(free_loopback_port()), str(HERE / "dtensor_worker.py"), str(tmp)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    ranks = [json.loads((tmp / f"rank-{p}.json").read_text()) for p in range(WORLD)]
    for p, result in enumerate(ranks):
        assert not result["errors"], f"process {p}: {result['errors'][0]}"
    return ranks


def test_two_by_two_onto_three_overlapping_equals_distribute_tensor(live):
    names = ["b", "e", "h", "r", "w", "z"]
    # the _StridedShard source is what torch itself reads back as the full tensor
    assert all(live[p]["strided_source_reads_back"] for p in range(4))
    for p in (3, 4, 5):
        case = live[p]["square_to_three"]
        assert case["equal"] == {n: True for n in names}, p
        assert case["placements"]["w"] == ["S(0)"] and case["placements"]["e"] == ["R"]
        assert case["placements"]["h"] == ["S(1)"]  # Shard(-1) normalised as torch does
    # uneven and empty shards: 7 rows over 3 are 3, 3, 1; 2 rows are 1, 1, 0
    assert [live[p]["square_to_three"]["shapes"]["w"][1] for p in (3, 4, 5)] == \
        [[3, 10], [3, 10], [1, 10]]
    assert live[5]["square_to_three"]["shapes"]["z"] == [[2, 3], [0, 3]]
    for p in (0, 1, 2):
        assert live[p]["square_to_three"]["outside"] == {n: True for n in names}


def test_four_onto_two_disjoint_equals_distribute_tensor(live):
    for p in (4, 5):
        assert live[p]["four_to_two"]["equal"] == {"v": True, "w": True}
    for p in range(4):
        assert live[p]["four_to_two"]["outside"] == {"v": True, "w": True}


@pytest.mark.parametrize("case", ["square_to_three", "four_to_two"])
def test_bytes_sent_are_the_plan_minimum(live, case):
    """Each process receives exactly the bytes of its target shards that its own source shards
    do not hold (counted by the worker from the data), and no more is sent than received."""
    stats = [r[case]["stats"] for r in live]
    least = [r[case]["least"] for r in live]
    assert [s["received"] for s in stats] == least
    assert [s["lower_bound"] for s in stats] == least
    assert sum(s["sent"] for s in stats) == sum(least) > 0
    if case == "square_to_three":  # process 3 is on both meshes: some of it stays local
        assert stats[3]["local"] > 0


def test_a_group_of_the_meshes_alone_leaves_the_others_out(live):
    """group= a group of processes 0-3 (both meshes' processes): 4 and 5 do not call."""
    assert [r["subgroup"] for r in live] == [True] * 4 + [None] * 2


def test_one_dtensor_in_one_out(live):
    assert all(r["single"] for r in live)


@pytest.mark.parametrize("kind,text", [
    ("shard_past_dims", 'tensor "w" of shape [7, 10]: target placements [Shard(dim=2)]: S(2) '
                        "names dim 2 of a 2-dimensional tensor"),
    ("partial_target", "would hold addends of the elements"),
    ("meshes_disagree", "processes 0 and 4 were given different target meshes: cpu [3, 4, 5] "
                        "and cpu [5, 4, 3]"),
    ("placements_disagree", "processes 0 and 1 were given different target placements"),
    ("shapes_disagree", "is [7, 10] float32 on process 0 but [6, 4] bfloat16 on process 2"),
    ("too_many_placements", "are 2 for a 1-dimensional mesh [3, 4, 5]"),
    ("not_a_dtensor", 'process 1: tensor "w" is a Tensor, not a DTensor'),
    ("placements_miss_a_name", "placements has no entry for ['b']"),
    ("holder_passes_none", 'tensor "v" is held by processes [2] of its mesh, which passed no '
                           "tensors"),
    ("partial_source", 'processes 0, 1, 2, 3, 4, 5: tensor "p" has placements [Partial(sum)]: '
                       "a Partial placement holds"),
    ("unpicklable_placement", "process 1: its arguments cannot be sent to the other processes "
                              "("),
    ("stats_not_a_dict", "process 0: stats must be a dict (filled with this process's figures) "
                         "or None, got list []"),
])
def test_a_bad_argument_raises_the_same_error_everywhere(live, kind, text):
    got = [r["refused"][kind] for r in live]
    assert all(g == got[0] for g in got), got
    assert got[0]["type"] == "RedistributeError", got[0]
    assert text in got[0]["message"]
    assert all(r["works_after_refusals"] for r in live)


def test_redistribute_error_is_a_package_error():
    assert issubclass(rdt.RedistributeError, reshard.ReshardError)
    assert issubclass(rdt.RedistributeError, ValueError)


def test_target_maps_hold_what_torch_splits_give():
    """The target maps without a process group: each rank's extract of F is torch's chunk."""
    full = torch.arange(7 * 10, dtype=torch.float32).reshape(7, 10)
    maps = rdt.target_maps({"w": [7, 10], "v": [7, 10]}, [3, 4, 5],
                           {"w": [Shard(0)], "v": [Replicate()]}, ranks=[3, 4, 5])
    chunks = torch.chunk(full, 3, dim=0)
    for r in range(3):
        assert torch.equal(reshard.extract(maps["w"], full, r), chunks[r])
        assert torch.equal(reshard.extract(maps["v"], full, r), full)
    with pytest.raises(rdt.RedistributeError, match=r"Partial|addends"):
        rdt.target_maps({"w": [7, 10]}, [0, 1], [Partial()])
    with pytest.raises(rdt.RedistributeError, match=r"S\(-3\) names dim -3"):
        rdt.target_maps({"w": [7, 10]}, [0, 1], [Shard(-3)])
    with pytest.raises(rdt.RedistributeError, match=r'no target placements for tensor "w"'):
        rdt.target_maps({"w": [7, 10]}, [0, 1], {"v": [Shard(0)]})


LOST_PEER = r'''
import json, os, sys, datetime
import torch, torch.distributed as dist
from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor
import reshard.dtensor as rdt
me, out = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method="file://" + out + ".pg", rank=me, world_size=3,
                        timeout=datetime.timedelta(seconds=60))
w = distribute_tensor(torch.arange(12.0).reshape(6, 2), DeviceMesh("cpu", [0, 1, 2]), [Shard(0)])
if me == 2:  # lost before the move
    os._exit(0)
try:
    rdt.redistribute(w, DeviceMesh("cpu", [0, 1]), [Shard(1)])
    result = {"type": None}
except Exception as e:
    result = {"type": type(e).__name__, "message": str(e)}
open(out + f".{me}", "w").write(json.dumps(result))
os._exit(0)  # the group is broken: nothing to tear down
'''


def test_a_process_lost_raises_redistribute_error_on_the_others(tmp_path):
    script = tmp_path / "lost.py"
    script.write_text(LOST_PEER)
    env = dict(os.environ, PYTHONPATH=str(BUILD / "python"), OMP_NUM_THREADS="1",
               GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "out")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(3)]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    for r in (0, 1):
        got = json.loads((tmp_path / f"out.{r}").read_text()) if \
            (tmp_path / f"out.{r}").exists() else logs[r][-3000:]
        assert isinstance(got, dict) and got["type"] == "RedistributeError", got
        assert "a process of the group lost or failing" in got["message"], got
