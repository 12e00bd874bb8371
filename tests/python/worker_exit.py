"""How a torchrun test worker ends once everything it reports is written.

`leave()` waits for every rank (nobody tears gloo down while a peer still talks to it; not with
`wait=False`, for a rank that may disagree with the others on where they are), destroys the
process group and ends the process by `os._exit(0)`, without the interpreter's shutdown.
Something in torch often keeps a destroyed gloo group alive: a `DeviceMesh` (FSDP2's
`fully_shard` builds one; DTensor's caches keep it), `torch.distributed.nn.functional` imported
after `init_process_group`. Its worker threads then outlive the interpreter, and one that lets go of a
collective's tensor while the interpreter finalizes aborts the process ("terminate called without
an active exception") after all its work is done: a run that passed reads as failed. docs/python.md
("At exit") gives users the same advice. test_exit.py checks the case that reshard's own exit
handler covers.
"""

import multiprocessing
import os
import sys

import torch.distributed as dist


def leave(wait: bool = True) -> None:
    if dist.is_initialized():
        if wait:
            dist.barrier()
        dist.destroy_process_group()
    # The process's multiprocessing children (the Manager that Megatron's checkpoint writer
    # starts) are ended first: left behind by os._exit they would live on, holding the
    # launcher's output pipes open, and the test reading those would wait for its timeout.
    for child in multiprocessing.active_children():
        child.terminate()
        child.join(30)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
