"""A process that used reshard.distributed leaves cleanly although torch keeps its destroyed gloo
group alive (torch.distributed.nn.functional imported after init_process_group, as torch.optim
does): reshard's exit handler frees the group while the interpreter is whole. Without it, a gloo
worker that lets go of a collective's tensor as the interpreter finalizes aborts the process
("terminate called without an active exception"), which exit_worker.py provokes. Whether the
abort happens depends on timing; whether a gloo thread is still running when the interpreter
finalizes does not, so that is what the tests check (and the exit status)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import BUILD
from ds_checkpoints import free_loopback_port

pytest.importorskip("torch")
HERE = os.path.dirname(os.path.abspath(__file__))


def leave(mode, out):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BUILD / "python"), HERE]),
               OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_addr", "127.0.0.1", "--master_port",
                           str(free_loopback_port()), os.path.join(HERE, "exit_worker.py"), mode, str(out)],
                          capture_output=True, text=True, timeout=300, env=env)


def gloo_threads_at_exit(out, ranks=(0, 1)):
    return {r: [n for n in json.loads((out / f"rank-{r}.json").read_text()) if "gloo" in n]
            for r in ranks}


def test_a_process_that_used_reshard_leaves_cleanly(tmp_path):
    r = leave("reshard", tmp_path)
    assert r.returncode == 0 and "terminate called" not in r.stderr, r.stderr[-3000:]
    assert gloo_threads_at_exit(tmp_path) == {0: [], 1: []}


def test_without_reshard_the_destroyed_group_lives_into_finalization(tmp_path):
    """The case above is the one that can abort: without reshard's handler, the destroyed
    group's gloo threads are still running when the interpreter finalizes, and either process
    may die of it (process 0 when its worker is still letting go of the all_reduce's tensor).
    The first to die has written its threads (before finalizing); torchrun then ends the other,
    which may not have reached that point."""
    r = leave("plain", tmp_path)
    wrote = tuple(rank for rank in (0, 1) if (tmp_path / f"rank-{rank}.json").exists())
    assert wrote, r.stderr[-3000:]
    left = gloo_threads_at_exit(tmp_path, ranks=wrote)
    assert all(left.values()), (left, r.stderr[-3000:])
    assert r.returncode == 0 or "terminate called without an active exception" in r.stderr, \
        r.stderr[-3000:]
