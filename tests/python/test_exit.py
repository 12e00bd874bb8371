"""A process that used reshard.distributed leaves cleanly although torch keeps its destroyed gloo
group alive (torch.distributed.nn.functional imported after init_process_group, as torch.optim
does): reshard's exit handler frees the group while the interpreter is whole. Without it, a gloo
worker that lets go of a collective's tensor as the interpreter finalizes aborts the process
("terminate called without an active exception"); exit_worker.py makes that happen every time."""

import os
import subprocess
import sys

import pytest

from conftest import BUILD
from ds_checkpoints import free_loopback_port

pytest.importorskip("torch")
HERE = os.path.dirname(os.path.abspath(__file__))


def leave(mode):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BUILD / "python"), HERE]),
               OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_addr", "127.0.0.1", "--master_port",
                           str(free_loopback_port()), os.path.join(HERE, "exit_worker.py"), mode],
                          capture_output=True, text=True, timeout=300, env=env)


def test_a_process_that_used_reshard_leaves_cleanly():
    r = leave("reshard")
    assert r.returncode == 0 and "terminate called" not in r.stderr, r.stderr[-3000:]


def test_without_reshard_the_same_exit_aborts():
    """The case above is the one that aborts: without reshard's handler, process 0 dies."""
    r = leave("plain")
    assert r.returncode != 0 and "terminate called without an active exception" in r.stderr, \
        r.stderr[-3000:]
