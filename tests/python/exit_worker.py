"""A process that leaves while a gloo worker thread still has to let go of a collective's tensor.

Run under torchrun, 2 processes (gloo on CPU):

    torchrun --nproc_per_node 2 exit_worker.py (reshard | plain) OUT_DIR

torch.distributed.nn.functional is imported after init_process_group (as torch.optim's
optimizers import it): its functions keep the default group as their group= default, so
destroy_process_group does not free it. Process 0 starts an all_reduce that process 1 joins a
second later, destroys the group and keeps the GIL (a switch interval of 1000 s, a busy loop)
until the all_reduce has landed and a little after, so that the gloo worker that ran it waits for
the GIL to let go of the tensor when the process starts to leave. With "reshard" a Redistributor
is built first, whose exit handler lets go of the destroyed group while the interpreter is whole.
OUT_DIR/rank-R.json lists the threads the process still runs once the exit handlers registered
after its own (reshard's) have run, just before the interpreter finalizes: whether the abort
happens is a matter of timing, whether a gloo thread is left to cause it is not.
"""

import atexit
import importlib
import json
import os
import pathlib
import sys
import time

import torch
import torch.distributed as dist

from maps import replicated_map


def threads_at_exit(path):
    names = [(pathlib.Path("/proc/self/task") / t / "comm").read_text().strip()
             for t in sorted(os.listdir("/proc/self/task"))]
    path.write_text(json.dumps(names))


def main():
    dist.init_process_group("gloo")
    importlib.import_module("torch.distributed.nn.functional")  # after init, as torch.optim does
    me = dist.get_rank()
    atexit.register(threads_at_exit, pathlib.Path(sys.argv[2]) / f"rank-{me}.json")
    if sys.argv[1] == "reshard":
        import reshard.distributed as rd
        m = {"w": replicated_map([2], 2)}
        rd.Redistributor(m, m, source_ranks=[0, 1], target_ranks=[0, 1], dtypes=torch.float32)
    t = torch.ones(4)
    if me == 0:
        dist.all_reduce(t, async_op=True)  # no handle kept: the worker holds the last reference
        dist.destroy_process_group()
        sys.setswitchinterval(1000.0)
        landed = None
        while landed is None or time.monotonic() < landed + 0.5:
            if landed is None and t[0].item() == 2:
                landed = time.monotonic()
    else:
        time.sleep(1)
        dist.all_reduce(t)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
