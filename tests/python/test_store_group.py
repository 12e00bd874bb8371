"""reshard.distributed over a group torch.distributed does not know of (DESIGN 18): a
ProcessGroup built over a TCPStore of its own (reshard.vllm's StoreGroup, the transport of the
live vLLM sync), used through the Transport seam, in processes whose default group is another
one. The re-sharded shards must equal reshard.transfer's, and a shard missing on one process
must raise on all of them, the next run still in step; load_rank reads a rank as it was written."""

import json
import pathlib
import subprocess
import sys

import pytest

from conftest import BUILD
from maps import split_map

torch = pytest.importorskip("torch")
HERE = pathlib.Path(__file__).resolve().parent

WORKER = r'''
import json, os, sys
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[5])
import reshard
from reshard.distributed import Redistributor, RedistributeError
from reshard.vllm._group import StoreGroup
from store_procs import process_store
rank, port_file, out = int(sys.argv[2]), sys.argv[3], sys.argv[4]
# A default group of one process each, as a trainer and an engine worker each have their own.
dist.init_process_group("gloo", init_method="file://" + out + f".pg{rank}", rank=0, world_size=1)
store = process_store(rank, port_file)
group = StoreGroup(store, "test", rank, 3, "gloo", 60)
spec = json.loads(open(out + ".spec").read())
r = Redistributor({"w": spec["source"]}, {"w": spec["target"]}, source_ranks=[0, 1],
                  target_ranks=[1, 2], group=group, dtypes=torch.float32)
full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
mine = {"w": reshard.extract(reshard.ParamMap.from_dict(spec["source"]), full, rank)} \
    if rank < 2 else {}
result = {"got": {k: v.tolist() for k, v in r.run(mine).items()}, "stats": r.last_stats}
try:
    r.run({} if rank == 1 else mine)  # process 1 forgets its shard
except RedistributeError as e:
    result["error"] = str(e)
again = r.run(mine)
result["again"] = {k: v.tolist() for k, v in again.items()}
open(out + f".{rank}", "w").write(json.dumps(result))
'''


def test_redistributor_over_a_store_group(tmp_path):
    import reshard
    source, target = split_map([8, 6], 0, [4, 4]), split_map([8, 6], 1, [3, 3])
    (tmp_path / "out.spec").write_text(json.dumps({"source": source, "target": target}))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    procs = [subprocess.Popen([sys.executable, str(script), str(BUILD / "python"), str(r),
                               str(tmp_path / "port"), str(tmp_path / "out"), str(HERE)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(3)]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    want = [reshard.extract(reshard.ParamMap.from_dict(target), full, r) for r in range(2)]
    results = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(3)]
    assert results[0]["got"] == {}
    for proc, j in ((1, 0), (2, 1)):
        assert results[proc]["got"] == {"w": want[j].tolist()}
        assert results[proc]["again"] == {"w": want[j].tolist()}
    for res in results:
        assert "process 1" in res["error"] and "no shard given" in res["error"]


def test_load_rank_reads_what_scatter_wrote(tmp_path):
    import reshard
    from reshard import _core
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    (tmp_path / "full").mkdir()
    _core.write_safetensors(str(tmp_path / "full" / "model.safetensors"),
                            {"w": ("F32", [8, 6], full.numpy().tobytes())})
    m = reshard.ParamMap.from_dict(split_map([8, 6], 1, [3, 3]))
    reshard.checkpoint.scatter(tmp_path / "full", tmp_path / "tp2", maps={"w": m})
    for rank in range(2):
        maps, shards = reshard.checkpoint.load_rank(tmp_path / "tp2", rank)
        assert maps == {"w": m}
        assert torch.equal(shards["w"], reshard.extract(m, full, rank))
    with pytest.raises(ValueError, match="has ranks 0 .. 1"):
        reshard.checkpoint.load_rank(tmp_path / "tp2", 2)


def test_weight_sync_refuses_a_bad_overlap_processing_before_joining():
    """Refused before anything is served or joined, naming the process."""
    from reshard.vllm import WeightSync, WeightSyncError
    with pytest.raises(WeightSyncError, match="overlap_processing must be True, False or "
                                              "None, got 'yes' \\(trainer process 0\\)"):
        WeightSync(None, {}, overlap_processing="yes")


def test_weight_sync_learns_the_engine_layout_at_the_dtype_the_engine_runs(monkeypatch):
    """The default target maps are learned for the dtype the workers report (an engine run at
    float32 over a bfloat16 config), not at "auto" (the config's)."""
    import reshard
    from reshard.vllm import sync
    m = reshard.ParamMap.from_dict(split_map([8, 6], 0, [4, 4]))
    learned = []
    monkeypatch.setattr(sync, "engine_maps", lambda model, tp, dtype="auto": (
        learned.append((model, tp, dtype)) or {"w": m}))
    reports = [{"model": "/models/m", "tp": 2, "rank": r, "dtype": "float32",
                "params": {"w": ([4, 6], "torch.float32")}} for r in range(2)]
    target, dtypes = sync.WeightSync._engine_plan(None, reports, {"w": m}, None, None, 0)
    assert learned == [("/models/m", 2, "float32")]
    assert dtypes == {"w": "float32"} and sorted(target) == ["w"]


ARGUMENTS = r'''
import datetime, gc, json, os, sys
import torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from reshard.vllm import WeightSync
from reshard.vllm import sync as sync_module
rank, out = int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + out + ".pg", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
URL = "http://127.0.0.1:9"  # nothing listens there: the engine cannot join
cases = {"inf": {"timeout_s": float("inf")}, "nan": {"timeout_s": float("nan")},
         "negative": {"timeout_s": -5}, "zero": {"timeout_s": 0}, "string": {"timeout_s": "20"},
         "unresolvable": {"host": "no-such-host.invalid", "timeout_s": 20},
         "not_here": {"host": "192.0.2.1", "timeout_s": 20},
         "no_engine_joins": {"timeout_s": 20}}


def attempt(kwargs):
    try:
        WeightSync(URL if rank == 0 else None, {}, **kwargs)
        return {"type": None}
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e)}


results = {name: attempt(kwargs) for name, kwargs in cases.items()}
# The engine refuses to join and process 0 unwinds its constructor (dropping the store it
# serves) while process 1 is as slow as it can be: any store read it makes waits until
# process 0 has returned.
done = out + ".done0"
if rank == 1:
    join = sync_module.join_store

    class Slow:
        def __init__(self, store):
            self._store = store

        def get(self, key):
            while not os.path.exists(done):
                pass
            return self._store.get(key)

        def __getattr__(self, name):
            return getattr(self._store, name)
    sync_module.join_store = lambda *a: Slow(join(*a))
results["store_gone"] = attempt({"timeout_s": 20})
if rank == 0:
    gc.collect()
    open(done, "w").close()
open(out + f".{rank}", "w").write(json.dumps(results))
dist.barrier()
dist.destroy_process_group()
'''


@pytest.mark.parametrize("case,text", [
    ("inf", "timeout_s must be a number of seconds above 0 and at most 1e+09 (it bounds every "
            "wait), got inf (trainer process 0); "),
    ("nan", "got nan (trainer process 0)"), ("negative", "got -5 (trainer process 0)"),
    ("zero", "got 0 (trainer process 0)"), ("string", "got '20' (trainer process 0)"),
    ("unresolvable", "trainer process 0 could not serve the sync's store on host "
                     "'no-such-host.invalid': OSError: it does not resolve"),
    ("not_here", "trainer process 0 could not serve the sync's store on host '192.0.2.1': "
                 "OSError: it is not an address of this machine (192.0.2.1: "),
    ("no_engine_joins", "the engine could not join: http://127.0.0.1:9/"),
    ("store_gone", "the engine could not join: http://127.0.0.1:9/"),
])
def test_weight_sync_refuses_alike_on_every_trainer_process(weight_sync_arguments, case, text):
    """A bad timeout_s or host, or an engine that cannot join, raises the same WeightSyncError
    on both trainer processes (none waits for the other in a collective), also when the
    process serving the store unwinds while the other is slow to read it."""
    got = [r[case] for r in weight_sync_arguments]
    assert got[0] == got[1], got
    assert got[0]["type"] == "WeightSyncError", got[0]
    assert text in got[0]["message"], got[0]


@pytest.fixture(scope="module")
def weight_sync_arguments(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("arguments")
    script = tmp / "worker.py"
    script.write_text(ARGUMENTS)
    procs = [subprocess.Popen([sys.executable, str(script), str(BUILD / "python"), str(r),
                               str(tmp / "out")], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    return [json.loads((tmp / f"out.{r}").read_text()) for r in range(2)]


def test_a_push_is_refused_unless_every_trainer_process_makes_the_same_one():
    """The agreement before any byte moves: a push overlapped by another (from another
    thread) on any process, pushes of other numbers, or tensors every process holds whole
    that differ between processes are refused on all; the same push goes ahead."""
    from reshard.vllm.sync import PushClaim, push_refusal
    same = [PushClaim(None, 3, {"norm": "aa"}, False), PushClaim(None, 3, {"norm": "aa"}, False)]
    assert push_refusal(same) is None
    mixed = [PushClaim(None, 3, {"norm": "aa", "b": "1"}, False),
             PushClaim(None, 3, {"norm": "bb", "b": "1"}, False)]
    assert push_refusal(mixed).startswith('trainer processes 0 and 1 push different weights: '
                                          'tensor "norm", which every trainer process holds '
                                          'whole, differs between them')
    overlapped = [PushClaim(None, 3, {}, False), PushClaim(None, 3, {}, True)]
    assert push_refusal(overlapped).startswith(
        "trainer process 1 began another push of this WeightSync (from another thread) while "
        "push 3 began")
    assert push_refusal([PushClaim(None, 3, {}, False), PushClaim(None, 4, {}, False)]) == (
        "the trainer processes are at different pushes of this WeightSync (process 0: push 3, "
        "process 1: push 4); every trainer process pushes each time")
    refused = [PushClaim(None, 3, {}, True), PushClaim("the engine did not start", 3, {}, False)]
    assert push_refusal(refused) == "the engine did not start"


def test_the_tensors_every_trainer_process_holds_whole_are_digested():
    """Replicated tensors (norms at TP) are compared between trainer processes, split ones
    are not; the digest is of the bytes."""
    from maps import replicated_map
    from reshard.vllm.sync import whole_digests, whole_tensors
    maps = {"norm": replicated_map([6], 2), "w": split_map([8, 6], 0, [4, 4])}
    assert whole_tensors(maps, 2) == ["norm"]
    assert whole_tensors(maps, 1) == []
    a = whole_digests({"norm": torch.ones(6), "w": torch.ones(4, 6)}, ["norm"])
    b = whole_digests({"norm": torch.ones(6, dtype=torch.bfloat16)}, ["norm"])
    c = whole_digests({"norm": torch.ones(6)}, ["norm"])
    assert list(a) == ["norm"] and a == c and a != b
    assert whole_digests({}, ["norm"]) == {}


def test_a_large_tensor_is_digested_by_an_evenly_spaced_sample(monkeypatch):
    """Above the digest's element budget a tensor is sampled, its last element included: equal
    tensors agree, a change at a sampled element (or the last) is seen, and the digest does not
    read the whole tensor."""
    from reshard.vllm import _agreement, sync
    monkeypatch.setattr(_agreement, "_DIGEST_ELEMENTS", 16)
    base = torch.arange(100, dtype=torch.float32)
    digest = sync.whole_digests({"w": base}, ["w"])
    assert sync.whole_digests({"w": base.clone()}, ["w"]) == digest
    for at in (0, 7, 98, 99):  # step 7: 0, 7, ..., 98 sampled, and the last element
        changed = base.clone()
        changed[at] = -1
        assert sync.whole_digests({"w": changed}, ["w"]) != digest, at
    unsampled = base.clone()
    unsampled[1] = -1
    assert sync.whole_digests({"w": unsampled}, ["w"]) == digest


def test_a_push_overlapping_another_marks_it_and_is_refused_at_once(monkeypatch):
    """A second push while one is in progress raises at once and marks the one in progress as
    overlapped (which the agreement then refuses on every process); the next push is
    unmarked."""
    import threading
    from reshard.vllm import WeightSyncError
    from reshard.vllm.sync import WeightSync
    sync = WeightSync.__new__(WeightSync)
    sync._guard, sync._in_push, sync._overlapped = threading.Lock(), False, False
    seen = []

    def alone(update, send, digest, stages=None):
        if not seen:
            with pytest.raises(WeightSyncError, match="a push of this WeightSync is in "
                                                      "progress"):
                sync._push({"mode": "plan"}, send)
        seen.append(sync._overlapped)
        return None
    monkeypatch.setattr(sync, "_push_alone", alone)
    sync._push({"mode": "plan"}, lambda: None)
    sync._push({"mode": "plan"}, lambda: None)
    assert seen == [True, False]
