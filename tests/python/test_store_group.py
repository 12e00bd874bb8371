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
