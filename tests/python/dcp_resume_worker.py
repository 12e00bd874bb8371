"""A trainer that saves and resumes as TorchTitan's checkpointer does, for test_dcp_resume.py.

Run under torchrun, gloo on the CPU:

    torchrun --nproc_per_node 2 dcp_resume_worker.py train OUT_DIR [RESHARD_BIN]
    torchrun --nproc_per_node 4 dcp_resume_worker.py train-tp OUT_DIR
    torchrun --nproc_per_node 3 dcp_resume_worker.py resume RESULT_DIR CKPT...

`train`: a tiny language model wrapped by FSDP2's `fully_shard` (each block, then the root),
AdamW with a step learning-rate schedule, trained STEPS steps; then the whole state
`dcp.save`d as {"model", "optim"} from `get_state_dict`, the scheduler's state, the data
loader's position and the training step (non-tensor values: DCP bytes items) into OUT_DIR/ckpt;
then one more step, whose loss and updated parameters (full, on rank 0) go to
OUT_DIR/reference.pt. With RESHARD_BIN, rank 0 then has `reshard convert --to dcp` re-shard
the checkpoint for this world size into OUT_DIR/world2, and the same processes resume from it
(`resume` below) into OUT_DIR/resumed-2.pt: one launch for the same-world case.

`train-tp`: the same at 4 ranks with FSDP2 over tensor parallelism, as TorchTitan applies them
on a (dp 2, tp 2) mesh: each block's w1 column-wise and w2 row-wise over "tp", then
`fully_shard` over "dp"; its checkpoint only (OUT_DIR/ckpt).

    torchrun --nproc_per_node 3 dcp_resume_worker.py resume-optim RESULT_DIR CKPT...

`resume`: a fresh model and optimizer at this world size (FSDP2 alone), `get_state_dict`,
`dcp.load` of the whole structure, `set_state_dict`, the scheduler and loader restored, then
the same next step; its loss, updated parameters and the restored non-tensor values go to
RESULT_DIR/<CKPT's name>.pt (rank 0), for each CKPT in turn.

`resume-optim`: the same from a checkpoint of the model and the optimizer alone
({"model", "optim"}, as `convert --to dcp` of a universal checkpoint writes one): the scheduler
is not restored (its next change of the learning rate comes after the next step, whose
learning rate is the param_groups' own), the training step is STEPS.

Every step is exact at any world size: every rank computes the same full batch, rank 0's loss
alone is back-propagated (the others' times 0) and the gradients are summed, not averaged
(divide factor 1), so each gradient is the single-process one; AdamW is elementwise. Not so
under tensor parallelism: a row-wise layer sums partial products across "tp", in another order
than one rank does.
"""

import os
import pathlib
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from worker_exit import leave

STEPS = 3
VOCAB, DIM, HIDDEN = 13, 8, 14  # odd sizes: uneven chunks at 2 and 3 ranks


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Linear(DIM, HIDDEN)
        self.w2 = torch.nn.Linear(HIDDEN, DIM, bias=False)
        self.norm = torch.nn.RMSNorm(DIM)

    def forward(self, h):
        return h + self.w2(F.silu(self.w1(self.norm(h))))


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.norm = torch.nn.RMSNorm(DIM)
        self.output = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (4, 6), generator=g)
    targets = torch.randint(0, VOCAB, (4, 6), generator=g)
    return tokens, targets


def build(world, tp=1):
    """The model (under FSDP2 over `world` ranks when a process group is up, over TP of degree
    `tp` when > 1; else plain), AdamW and its scheduler."""
    torch.manual_seed(0)
    model = TinyLM()
    if dist.is_initialized():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)

        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        for layer in model.layers:
            if tp > 1:
                parallelize_module(layer, mesh["tp"],
                                   {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return model, optim, sched


def train_step(model, optim, sched, step):
    tokens, targets = batch(step)
    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    rank = dist.get_rank() if dist.is_initialized() else 0
    (loss if rank == 0 else loss * 0).backward()
    optim.step()
    optim.zero_grad()
    sched.step()
    return loss.detach()


def full_params(model):
    out = {}
    for name, p in model.named_parameters():
        p = p.detach()
        out[name] = p.full_tensor() if hasattr(p, "full_tensor") else p.clone()
    return out


def schedule(optim, sched):
    return {"last_lr": sched.get_last_lr(),
            "param_groups": [{k: v for k, v in g.items() if k != "params"}
                             for g in optim.param_groups]}


def state(model, optim, sched, loader, step):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd, "lr_scheduler": sched.state_dict(),
            "dataloader": {"position": loader}, "train_state": {"step": step}}


def train(out, reshard_bin=None, tp=1):
    model, optim, sched = build(dist.get_world_size(), tp)
    for step in range(STEPS):
        train_step(model, optim, sched, step)
    dcp.save(state(model, optim, sched, loader=STEPS * 4, step=STEPS),
             checkpoint_id=str(out / "ckpt"))
    if tp > 1:
        return
    restored = {"position": STEPS * 4, "step": STEPS, **schedule(optim, sched)}
    loss = train_step(model, optim, sched, STEPS)
    params = full_params(model)
    if dist.get_rank() == 0:
        torch.save({"loss": loss, "params": params, "restored": restored}, out / "reference.pt")
    if reshard_bin is None:
        return
    world = dist.get_world_size()
    failed = torch.zeros(1)
    if dist.get_rank() == 0:
        r = subprocess.run([reshard_bin, "convert", out / "ckpt", "--to", "dcp", "--world",
                            str(world), "-o", out / f"world{world}", "--force"],
                           capture_output=True, text=True, timeout=120)
        (out / "convert.txt").write_text(r.stderr)
        failed += r.returncode != 0
    dist.all_reduce(failed)
    if failed.item() == 0:
        result = resume(out / f"world{world}")
        if dist.get_rank() == 0:
            torch.save(result, out / f"resumed-{world}.pt")


def resume(ckpt, model_and_optim_only=False):
    """Resumes from `ckpt` (in this process when no process group is up) and returns the next
    step's loss, the updated parameters and the restored non-tensor values."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, optim, sched = build(dist.get_world_size() if dist.is_initialized() else 1)
    sd = state(model, optim, sched, loader=0, step=0)
    if model_and_optim_only:
        sd = {"model": sd["model"], "optim": sd["optim"]}
    dcp.load(sd, checkpoint_id=str(ckpt))
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    if model_and_optim_only:
        restored = {"param_groups": schedule(optim, sched)["param_groups"]}
        step = STEPS
    else:
        sched.load_state_dict(sd["lr_scheduler"])
        restored = {"position": sd["dataloader"]["position"], "step": sd["train_state"]["step"],
                    **schedule(optim, sched)}
        step = sd["train_state"]["step"]
    loss = train_step(model, optim, sched, step)
    return {"loss": loss, "params": full_params(model), "restored": restored}


def main():
    dist.init_process_group("gloo")
    if sys.argv[1] == "train":
        train(pathlib.Path(sys.argv[2]), *sys.argv[3:])
    elif sys.argv[1] == "train-tp":
        train(pathlib.Path(sys.argv[2]), tp=2)
    else:
        for ckpt in map(pathlib.Path, sys.argv[3:]):
            result = resume(ckpt, model_and_optim_only=sys.argv[1] == "resume-optim")
            if dist.get_rank() == 0:
                torch.save(result, pathlib.Path(sys.argv[2]) / f"{ckpt.name}.pt")
    leave()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
