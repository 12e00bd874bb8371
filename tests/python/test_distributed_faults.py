"""reshard.distributed when one process alone makes a mistake: a wrong argument to the
constructor, to redistribute() or to run() on a single process (the others pass good ones)
must raise RedistributeError on every process, naming the process, and leave none waiting.

One torchrun launch of 3 processes (gloo on the CPU) runs every case of the table in order
(distributed_worker.py, FAULTS); the faulty process stays alive afterwards, as a server would,
and runs the next case with the others. Collectives time out after RESHARD_TEST_PG_TIMEOUT
seconds, so a process left waiting records gloo's timeout (not RedistributeError) instead of
hanging, and the launch itself is bounded by a subprocess timeout. A last good case, and good
cases between the faults, show the group still works after each mistake."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import BUILD
from ds_checkpoints import free_loopback_port
from maps import split_map
from test_distributed import layout

torch = pytest.importorskip("torch")

HERE = pathlib.Path(__file__).resolve().parent
WORLD = 3

# kind: (the process that makes the mistake, a part of the message every process must see).
# Process 2 holds no source shard; processes 1 and 2 hold the target shards.
FAULTS = {
    "bucket_bytes_not_an_int": (2, "bucket_bytes must be an int"),
    "num_threads_too_large": (0, "num_threads is 9223372036854775808"),
    "scale_power_not_an_int": (1, "scale_power must be an int"),
    "dtypes_missing_a_name": (2, "dtypes= has no dtype for ['w']"),
    "unknown_option": (0, "unknown options ['bucket_byte']"),
    "shards_not_a_mapping": (1, "shards must be a mapping"),
    "meta_shard": (0, "is on the meta device"),
    "out_not_a_mapping": (1, "out must be a mapping"),
    "out_not_a_tensor": (2, "not a torch.Tensor"),
    "out_on_meta": (2, "is on the meta device"),
    "out_requires_grad": (1, "requires grad"),
    "out_negative_bit": (2, "negative bit"),
    "out_expanded": (1, "share memory"),
    "out_unknown_name": (2, "unknown parameters ['nope']"),
}


def cases(reshard_bin, tmp):
    w = {"w": {"source": split_map([6, 8], 0, [3, 3]), "target": split_map([6, 8], 1, [4, 4])}}
    base = {"params": w, "source_ranks": [0, 1], "target_ranks": [1, 2], "seed": 11}
    out = []
    for kind, (process, _) in FAULTS.items():
        out.append({**base, "name": kind, "fault": {"process": process, "kind": kind}})
        out.append({**base, "name": f"good_after_{kind}"})
    # Options that differ between processes: process 1 alone allows lossy scales.
    out.append({**base, "name": "scale_options_differ",
                "fault": {"process": 1, "kind": "lossy_scale_allowed_on_one"}})
    # A pre-divided bias at TP 2 (scale 1/2) to TP 3 (1/3): the factor 2/3 rounds the data,
    # which only the processes holding it can see.
    bias = {"family": "replicated", "pre_divided": True}
    out.append({"name": "lossy_scale", "source_ranks": [0, 1], "target_ranks": [0, 1, 2],
                "seed": 12, "params": {"b": {"source": layout(reshard_bin, tmp, bias, [16], 2),
                                             "target": layout(reshard_bin, tmp, bias, [16], 3)}}})
    out.append({**base, "name": "negative_views", "negative_views": True, "seed": 13})
    # Process 1 holds source rank 1 ([3, 8]) and target rank 0 ([6, 4]): its out is a view
    # of its own source shard's memory.
    out.append({**base, "name": "out_over_own_shards", "out_over_shards": 1, "seed": 15})
    # Process 1 (a source and a target) raises from on_ready: the others finish their run.
    out.append({**base, "name": "on_ready_raises", "seed": 16,
                "fault": {"process": 1, "kind": "on_ready_raises"}})
    out.append({**base, "name": "after_faults", "seed": 14})
    return out


@pytest.fixture(scope="module")
def launch(tmp_path_factory, reshard_bin):
    tmp = tmp_path_factory.mktemp("distributed_faults")
    all_cases = cases(reshard_bin, tmp)
    (tmp / "cases.json").write_text(json.dumps(all_cases))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BUILD / "python"), str(HERE)]),
               OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", RESHARD_TEST_PG_TIMEOUT="30")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                        str(WORLD), "--master_addr", "127.0.0.1", "--master_port",
                        str(free_loopback_port()), str(HERE / "distributed_worker.py"),
                        str(tmp / "cases.json"), str(tmp / "out")],
                       capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    return {c["name"]: [json.loads((tmp / "out" / c["name"] / f"rank-{p}.json").read_text())
                        for p in range(WORLD)] for c in all_cases}


def assert_raised_everywhere(ranks, *parts):
    for p, r in enumerate(ranks):
        assert r["error"] is not None and r["error"].startswith("RedistributeError"), (p, r)
        for part in parts:
            assert part in r["error"], (p, part, r["error"])


@pytest.mark.parametrize("kind", sorted(FAULTS))
def test_one_process_mistake_raises_on_every_process(launch, kind):
    process, part = FAULTS[kind]
    assert_raised_everywhere(launch[kind], f"process {process}: ", part)


@pytest.mark.parametrize("kind", sorted(FAULTS))
def test_the_group_works_after_the_mistake(launch, kind):
    for p, r in enumerate(launch[f"good_after_{kind}"]):
        assert r["error"] is None and r["mismatch"] == [], (p, r)


def test_options_that_differ_between_processes_are_refused(launch):
    assert_raised_everywhere(launch["scale_options_differ"], "processes 0 and 1",
                             "scale options")


def test_a_lossy_scale_is_found_before_anything_moves(launch):
    # Found by the source processes (0 and 1) while checking, told to process 2 too.
    assert_raised_everywhere(launch["lossy_scale"], "checking its scales before moving",
                             "refusing to change a value silently")


@pytest.mark.parametrize("name", ["negative_views", "out_over_own_shards", "after_faults"])
def test_good_cases_give_the_offline_result(launch, name):
    # Shards with torch's negative bit, an out over the process's own source shard, and the
    # group after every fault: each bit for bit the offline transfer.
    for p, r in enumerate(launch[name]):
        assert r["error"] is None and r["mismatch"] == [], (name, p, r)


def test_an_exception_from_on_ready_is_raised_after_the_transfer(launch):
    """Raised on the process whose callback failed, once its transfer was through: the other
    processes got their shards, and the next case ran in step (after_faults)."""
    ranks = launch["on_ready_raises"]
    assert ranks[1]["error"] == "RuntimeError: on_ready of process 1 fails on purpose", ranks[1]
    for p in (0, 2):
        assert ranks[p]["error"] is None and ranks[p]["mismatch"] == [], (p, ranks[p])
    assert ranks[2]["handed_on"] and all(all(c.values()) for c in ranks[2]["handed_on"][0])
