"""Real DeepSpeed PipelineModule checkpoints, written on the CPU for the tests.

`make_pipe_checkpoints(specs, base)` trains each PipeSpec with ds_pipe_train.py under
`torchrun --nproc_per_node PP*DP` (gloo over loopback, DS_ACCELERATOR=cpu; one launch per world
size) and returns {spec: PipeCheckpoint}: the save dir and the facts the training run
recorded (losses, the next step's loss, every parameter whole in ref/full.safetensors).
`resume_pipe_launch` loads universal checkpoints into fresh engines at another PP x DP.
"""

import dataclasses
import json
import pathlib
import shutil
import subprocess
import sys

from ds_checkpoints import LAUNCH_TIMEOUT_S, SavedRun, _train_env, free_loopback_port

HERE = pathlib.Path(__file__).resolve().parent
TRAIN = HERE / "ds_pipe_train.py"


@dataclasses.dataclass(frozen=True)
class PipeSpec:
    """One PipelineModule training run (see ds_pipe_train.py): `blocks` residual blocks between
    a tied embedding and a final norm, hidden 16, over `pp` stages of `tp` x `dp` ranks each
    (tp > 1: each block's MLP cut as Megatron cuts it)."""

    pp: int = 2
    dp: int = 1
    tp: int = 1
    stage: int = 1
    dtype: str = "float32"  # or "bfloat16"
    steps: int = 2
    vocab: int = 50
    blocks: int = 3
    seed: int = 20261203
    partition: str = "parameters"
    frozen: str = ""  # a regex: the parameters it matches ("2.norm.weight") are not trained
    buffers: bool = False  # each block keeps a persistent buffer, "running"

    @property
    def world_size(self):
        return self.pp * self.tp * self.dp

    @property
    def name(self):
        dtype = {"float32": "fp32", "bfloat16": "bf16"}[self.dtype]
        seed = "" if self.seed == PipeSpec.seed else f"-s{self.seed}"
        tp = "" if self.tp == 1 else f"-tp{self.tp}"
        extra = ("-frozen" if self.frozen else "") + ("-buffers" if self.buffers else "")
        return f"pipe-pp{self.pp}{tp}-dp{self.dp}-z{self.stage}-{dtype}{seed}{extra}"


@dataclasses.dataclass(frozen=True)
class PipeCheckpoint(SavedRun):
    """next_loss: eval_batch on DP rank 0's batch."""

    spec: PipeSpec
    root: pathlib.Path
    facts: dict  # rank 0's

    def full(self):
        from safetensors.torch import load_file

        return load_file(str(self.root / "ref" / "full.safetensors"))


def _facts(root, world_size, kind):
    paths = [root / "ref" / f"{kind}-{r}.json" for r in range(world_size)]
    return [json.loads(p.read_text()) for p in paths if p.exists()]


def _torchrun(world_size, jobs, jobs_file):
    jobs_file.write_text(json.dumps(jobs))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world_size),
           "--master_addr", "127.0.0.1", "--master_port", str(free_loopback_port()), str(TRAIN),
           str(jobs_file)]
    r = subprocess.run(cmd, env=_train_env(), capture_output=True, text=True,
                       timeout=LAUNCH_TIMEOUT_S)
    jobs_file.with_suffix(".log").write_text(r.stdout + r.stderr)
    return r


def make_pipe_checkpoints(specs, base):
    """Train every spec (one launch per world size). A spec DeepSpeed refuses fails the call
    with DeepSpeed's message."""
    base = pathlib.Path(base)
    by_world = {}
    for spec in dict.fromkeys(specs):
        by_world.setdefault(spec.world_size, []).append(spec)
    out = {}
    for world, group in by_world.items():
        roots = {s: base / s.name for s in group}
        for root in roots.values():
            shutil.rmtree(root, ignore_errors=True)
            (root / "ref").mkdir(parents=True)
        jobs = [{"spec": dataclasses.asdict(s), "out": str(roots[s])} for s in group]
        r = _torchrun(world, jobs, base / f"train-world{world}.json")
        for spec in group:
            facts = _facts(roots[spec], world, "facts")
            errors = [f["error"] for f in facts if "error" in f]
            assert not errors, f"{spec.name}: DeepSpeed refused: {errors[0]}"
            assert len(facts) == world, \
                f"{spec.name}: torchrun exited {r.returncode}:\n{r.stderr[-4000:]}"
            out[spec] = PipeCheckpoint(spec, roots[spec], facts[0])
    return out


def resume_pipe_launch(world_size, jobs, base, universal=True):
    """One launch of `world_size` ranks; each job (spec, load_dir, name) builds a fresh engine
    of `spec` (its pp x tp x dp is world_size), loads the universal checkpoint at load_dir with
    "load_universal" (universal=False: the DeepSpeed save dir at load_dir, without it) and takes
    the next step's loss. Returns {name: {dp_rank: loss}}."""
    base = pathlib.Path(base)
    base.mkdir(parents=True, exist_ok=True)
    todo = [{"spec": dataclasses.asdict(spec), "out": str(base / name),
             "resume": {"from": str(load_dir), "universal": "given" if universal else False,
                        "name": "given"}}
            for spec, load_dir, name in jobs]
    assert all(s.world_size == world_size for s, _, _ in jobs)
    r = _torchrun(world_size, todo, base / "resume.json")
    out = {}
    for _, _, name in jobs:
        facts = _facts(base / name, world_size, "resume-given")
        errors = [f["error"] for f in facts if "error" in f]
        assert not errors, f"{name}: resuming failed: {errors[0]}"
        assert len(facts) == world_size, \
            f"{name}: torchrun exited {r.returncode}:\n{r.stderr[-4000:]}"
        out[name] = {int(k): v for k, v in facts[0]["next_loss"].items()}
    return out
