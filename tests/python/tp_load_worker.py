"""Load checkpoints the way transformers shards them, and record what each rank holds.

Run under torchrun (one process per rank, gloo on CPU):

    torchrun --nproc_per_node N tp_load_worker.py CASES.json OUT_DIR

CASES.json is a list of {"name": ..., "dir": ...}, optionally with "distributed_config" (the
keyword arguments of transformers' DistributedConfig, such as {"tp_plan": "auto", "ep_size": 2}).
For every case, in order, each rank loads DIR with `from_pretrained(DIR, tp_plan="auto")`
(tensor parallelism over all N ranks), or with `distributed_config=DistributedConfig(...)` when
the case gives one, writes the local part of every parameter to OUT_DIR/NAME/rank-R.safetensors
under the name transformers gives the parameter (a DTensor's local shard, or the whole tensor
when the parameter is not split), and runs one forward pass on a few tokens. What happened
(loaded, forward, the error if any) goes to OUT_DIR/NAME/rank-R.json. A failing case does not
stop the others.
"""

import datetime
import gc
import json
import os
import pathlib
import sys
import traceback
import warnings

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

PROMPT = [[1, 2, 3, 4, 5]]


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
    (case_dir / f"rank-{rank}.json").write_text(json.dumps(status, indent=1))


def main():
    cases = json.loads(pathlib.Path(sys.argv[1]).read_text())
    out_dir = pathlib.Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    torch.manual_seed(0)
    for case in cases:
        run_case(case, out_dir, rank)
        dist.barrier()  # the ranks start every case together
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
