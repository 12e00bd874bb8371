"""Load checkpoints the way transformers shards them, and record what each rank holds.

Run under torchrun (one process per rank, gloo on CPU):

    torchrun --nproc_per_node N tp_load_worker.py CASES.json OUT_DIR

or through `launch` below, which the tests call.

CASES.json is a list of {"name": ..., "dir": ...}, optionally with "distributed_config" (the
keyword arguments of transformers' DistributedConfig, such as {"tp_plan": "auto", "ep_size": 2}).
For every case, in order, each rank loads DIR with `from_pretrained(DIR, tp_plan="auto")`
(tensor parallelism over all N ranks), or with `distributed_config=DistributedConfig(...)` when
the case gives one, writes the local part of every parameter to OUT_DIR/NAME/rank-R.safetensors
under the name transformers gives the parameter (a DTensor's local shard, or the whole tensor
when the parameter is not split), and runs one forward pass on a few tokens. What happened
(loaded, forward, the error if any, seconds) goes to OUT_DIR/NAME/rank-R.json. A failing case
does not stop the others. A case that runs past STUCK_AFTER seconds has every thread's stack
written to stderr, so that a rank stuck inside a case says where.
"""

import datetime
import faulthandler
import gc
import json
import os
import pathlib
import socket
import subprocess
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from worker_exit import leave

PROMPT = [[1, 2, 3, 4, 5]]
STUCK_AFTER = 60  # seconds; a case takes about one


def checkpoint_tensors(model):
    """The model's tensors a checkpoint holds: parameters (a tied one once) and persistent
    buffers (such as a router's score-correction bias), by name."""
    saved = model.state_dict().keys()
    params = dict(model.named_parameters())
    buffers = {name: b for name, b in model.named_buffers() if name in saved}
    return {**params, **buffers}


def local_tensors(model):
    """Every checkpoint tensor's local part on this rank."""
    out = {}
    for name, tensor in checkpoint_tensors(model).items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        out[name] = local.detach().to("cpu").contiguous().clone()
    return out


def placements(model):
    return {name: (str(t.placements) if isinstance(t, DTensor) else "local")
            for name, t in checkpoint_tensors(model).items()}


def run_case(case, out_dir, rank):
    from transformers import AutoModelForCausalLM

    case_dir = out_dir / case["name"]
    case_dir.mkdir(parents=True, exist_ok=True)
    status = {"loaded": False, "forward": False, "error": None}
    started = time.monotonic()
    model = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # tp_plan= is deprecated, still served
            if "distributed_config" in case:
                from transformers import DistributedConfig

                kwargs = {"distributed_config": DistributedConfig(**case["distributed_config"])}
            else:
                kwargs = {"tp_plan": "auto"}
            model = AutoModelForCausalLM.from_pretrained(case["dir"], dtype="auto", **kwargs)
        status["loaded"] = True
        status["placements"] = placements(model)
        save_file(local_tensors(model), str(case_dir / f"rank-{rank}.safetensors"))
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(PROMPT), use_cache=False).logits
        status["forward"] = bool(torch.isfinite(logits).all())
        if not status["forward"]:
            status["error"] = "the forward pass gave non-finite logits"
    except Exception as e:  # recorded for the test to judge
        status["error"] = f"{type(e).__name__}: {e}"
        status["traceback"] = traceback.format_exc(limit=4)
    del model
    gc.collect()
    status["seconds"] = round(time.monotonic() - started, 2)
    (case_dir / f"rank-{rank}.json").write_text(json.dumps(status, indent=1))


def main():
    cases = json.loads(pathlib.Path(sys.argv[1]).read_text())
    out_dir = pathlib.Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    torch.manual_seed(0)
    for case in cases:
        faulthandler.dump_traceback_later(STUCK_AFTER)
        run_case(case, out_dir, rank)
        dist.barrier()  # the ranks start every case together
        faulthandler.cancel_dump_traceback_later()
    leave()


def finished(case, out_dir, world):
    return all((out_dir / case["name"] / f"rank-{r}.json").exists() for r in range(world))


def launch(cases, root, world, attempts=2):
    """Run `cases` on `world` ranks, dumps under root/dumps; returns that directory.

    A launch that fails (a rank stuck in a case until the others time out, or dead in C++
    teardown) is made again, up to `attempts` in all, for the cases it did not finish; a
    case's outcome is never retried. The assertion names every attempt's unfinished cases
    and the end of its stderr (with the stuck rank's stacks)."""
    dumps = root / "dumps"
    # Loopback only: gloo binds the interface named here, the rendezvous the address below.
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", GLOO_SOCKET_IFNAME="lo",
               OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    failures = []
    for attempt in range(attempts):
        todo = [c for c in cases if not finished(c, dumps, world)]
        if not todo:
            break
        listed = root / f"cases-{attempt}.json"
        listed.write_text(json.dumps(todo, indent=1))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
               "--master_addr", "127.0.0.1", "--master_port", str(port),
               __file__, str(listed), str(dumps)]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if r.returncode == 0:
            break
        unfinished = [c["name"] for c in todo if not finished(c, dumps, world)]
        failures.append(f"launch {attempt + 1} exited {r.returncode}, unfinished "
                        f"{unfinished[:5]}{'...' if len(unfinished) > 5 else ''}:\n"
                        f"{r.stderr[-6000:]}")
    missing = [c["name"] for c in cases if not finished(c, dumps, world)]
    assert not missing, f"{len(missing)} cases unfinished\n" + "\n".join(failures)
    if failures:  # finished on a later launch: say so without failing
        warnings.warn("tp_load_worker: " + failures[0][:2000], stacklevel=2)
    return dumps


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
