"""Real DeepSpeed training checkpoints, written on the CPU for the tests.

`make_checkpoint(spec, out_dir)` trains a toy transformers model (ds_train.py) under
`torchrun --nproc_per_node TP*DP` (gloo over loopback, DS_ACCELERATOR=cpu, the same seed on every
rank) with AutoTP at degree TP and ZeRO at `spec.stage`, saves a checkpoint, and returns a
`DsCheckpoint`: the save dir (with `latest`, the tag dir and config.json) and the reference
facts the tests compare against, computed by the training run itself and not read back from
the checkpoint files.

In pytest, use the session fixture `ds_checkpoint` (a factory, one training run per spec per
session; conftest.py registers it once for every module, so do not import it into one):

    from ds_checkpoints import Spec

    def test_x(ds_checkpoint):
        ckpt = ds_checkpoint(Spec("llama", tp=2, dp=2, stage=1))
        ckpt.save_dir, ckpt.tag_dir, ckpt.module(tp_rank=0), ckpt.full(), ckpt.next_loss

A spec DeepSpeed refuses (see UNSUPPORTED and docs/deepspeed_checkpoints.md) raises
`DeepSpeedRefused` with DeepSpeed's own message. RESHARD_DS_CHECKPOINT_CACHE=DIR keeps the
checkpoints across sessions (keyed by the spec and by the text of ds_train.py).
"""

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys

import filelock
import pytest

HERE = pathlib.Path(__file__).resolve().parent
TRAIN = HERE / "ds_train.py"
LAUNCH_TIMEOUT_S = 600


@dataclasses.dataclass(frozen=True)
class Spec:
    """One training run. family: "llama", "qwen2" (q/k/v biases), "mistral" or
    "llama_subparams" (q/k/v cut as two sub-parameters each, see ds_train.py), each with 2
    layers, hidden 64, 4 heads of 16, intermediate 128, untied embeddings. vocab 250 does not
    divide by 4, so TP 4 cuts the vocabulary unevenly (63, 63, 62, 62). Every size is a
    multiple of 64, so ZeRO pads only when DP does not divide it: DP 3 pads ZeRO 3's
    parameters, and DP 3 with vocab 251 (total not a multiple of 3) ZeRO 1/2's flat group.
    "mixtral" has 4 experts per layer; ep > 1 trains it with DeepSpeed's AutoEP at that EP
    size (inside the DP ranks: at DP 2 and EP 2 each rank holds two experts; DP 4
    adds an expert-DP degree of 2), and the reference is the model as transformers holds it
    (ref/hf, by save_pretrained) rather than the module's TP shards."""

    family: str = "llama"
    tp: int = 1
    dp: int = 1
    stage: int = 1
    dtype: str = "float32"  # or "bfloat16"
    steps: int = 2
    ep: int = 1
    vocab: int = 250
    seed: int = 20261130
    frozen: str = ""  # a regex: the parameters it matches (re.search) train with requires_grad False
    buffer: bool = False  # the model holds a persistent buffer, model.running_mean

    @property
    def world_size(self):
        return self.tp * self.dp

    @property
    def name(self):
        dtype = {"float32": "fp32", "bfloat16": "bf16"}[self.dtype]
        vocab = "" if self.vocab == 250 else f"-v{self.vocab}"
        ep = "" if self.ep == 1 else f"-ep{self.ep}"
        extra = ("-frozen" if self.frozen else "") + ("-buffer" if self.buffer else "")
        return f"{self.family}{vocab}-tp{self.tp}-dp{self.dp}{ep}-z{self.stage}-{dtype}{extra}"

    def to_json(self):
        fields = dataclasses.asdict(self)
        # The checkpoints of dense specs keep their cache keys.
        for key, default in (("ep", 1), ("frozen", ""), ("buffer", False)):
            if fields[key] == default:
                del fields[key]
        return json.dumps(fields, sort_keys=True)


class DeepSpeedRefused(Exception):
    """The training run failed on this spec (DeepSpeed, or transformers for a config it
    refuses); the message is theirs."""


class SavedRun:
    """What a training run left under `root` (its `facts`: rank 0's facts.json): the save dir
    and its tag; shared by DsCheckpoint and ds_pipe_checkpoints.PipeCheckpoint."""

    root: pathlib.Path
    facts: dict

    @property
    def save_dir(self):
        """What `engine.save_checkpoint` was given: `latest`, the tag dir, config.json."""
        return self.root / "ckpt"

    @property
    def tag(self):
        return self.facts["tag"]

    @property
    def tag_dir(self):
        return self.save_dir / self.tag

    @property
    def next_loss(self):
        """{dp_rank: the loss of the step after the save}, forward only, on the batch that step
        trains on."""
        return {int(k): v for k, v in self.facts["next_loss"].items()}


@dataclasses.dataclass(frozen=True)
class DsCheckpoint(SavedRun):
    spec: Spec
    root: pathlib.Path  # save_dir and ref/ live here
    facts: dict  # rank 0's facts.json: losses, tag, next_loss

    @property
    def losses(self):
        """The training loss of each step, as DP rank 0 saw it."""
        return self.facts["losses"]

    def module(self, tp_rank):
        """TP rank `tp_rank`'s module weights as the engine held them at the save ({name: tensor},
        the module's dtype, whole over DP)."""
        from safetensors.torch import load_file

        return load_file(str(self.root / "ref" / f"module-tp{tp_rank}.safetensors"))

    def resumed_next_loss(self, how):
        """{dp_rank: next step's loss} of a fresh engine of the same topology that loaded this
        checkpoint: how="own" from the save dir, how="universal" from ds_to_universal's output
        with "load_universal" (only where it converts: see universal_accepts)."""
        facts = _read_facts(self.root, self.spec.world_size, f"resume-{how}")
        errors = [f["error"] for f in facts if "error" in f]
        assert not errors, f"{self.spec.name}: resuming ({how}) failed: {errors[0]}"
        assert len(facts) == self.spec.world_size, f"{self.spec.name}: no resume ({how}) ran"
        return {int(k): v for k, v in facts[0]["next_loss"].items()}

    def hf_dir(self):
        """AutoEP specs: the trained model saved by transformers' save_pretrained."""
        return self.root / "ref" / "hf"

    def full(self):
        """Every module weight whole, in the module's dtype ({name: tensor}; AutoEP specs: by the
        engine's names, experts.w1/w2/w3 stacked over every expert)."""
        from safetensors.torch import load_file

        return load_file(str(self.root / "ref" / "full.safetensors"))


def free_loopback_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_env():
    # Loopback only; the same single thread per rank whatever the machine.
    return dict(os.environ, DS_ACCELERATOR="cpu", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
                HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
                PYTHONWARNINGS="ignore")


def universal_accepts(spec):
    """Whether ds_to_universal converts a checkpoint of `spec` (DeepSpeed 0.19.8): not stage 0
    (no optimizer files), and not TP 1 below stage 3 (no universal_checkpoint_info) unless
    AutoEP wrote one."""
    return spec.stage > 0 and (spec.tp > 1 or spec.stage == 3 or spec.ep > 1)


def _read_facts(root, world_size, kind="facts"):
    paths = [root / "ref" / f"{kind}-{r}.json" for r in range(world_size)]
    return [json.loads(p.read_text()) for p in paths if p.exists()]


def _launch(specs_and_roots):
    """One torchrun launch that trains every (spec, root), all of one TP and DP, in order."""
    spec0 = specs_and_roots[0][0]
    assert all((s.tp, s.dp) == (spec0.tp, spec0.dp) for s, _ in specs_and_roots)
    for _, root in specs_and_roots:
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True)
    jobs = specs_and_roots[0][1].parent / f"jobs-{specs_and_roots[0][1].name}.json"
    train = [{"spec": dataclasses.asdict(s), "out": str(root)} for s, root in specs_and_roots]
    # Then each one resumed by a fresh engine of its topology, from its own files and from
    # ds_to_universal's output.
    resume = [{**job, "resume": {"from": str(root / "ckpt"), "universal": universal,
                                 "name": "universal" if universal else "own"}}
              for job, (spec, root) in zip(train, specs_and_roots)
              for universal in (False, True) if not universal or universal_accepts(spec)]
    jobs.write_text(json.dumps(train + resume))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
           str(spec0.world_size), "--master_addr", "127.0.0.1", "--master_port",
           str(free_loopback_port()), str(TRAIN), str(jobs)]
    r = subprocess.run(cmd, env=_train_env(), capture_output=True, text=True,
                       timeout=LAUNCH_TIMEOUT_S)
    (specs_and_roots[0][1] / "train.log").write_text(r.stdout + r.stderr)
    return r


def _outcome(spec, root, launch):
    """The DsCheckpoint of a finished job, DeepSpeedRefused if DeepSpeed refused it, None if
    the launch never reached it."""
    facts = _read_facts(root, spec.world_size)
    errors = [f["error"] for f in facts if "error" in f]
    if errors:
        refused = DeepSpeedRefused(f"{spec.name}: {errors[0]}")
        (root / "refused.txt").write_text(str(refused))
        return refused
    if len(facts) < spec.world_size:
        return None
    (root / "done").write_text("")
    return DsCheckpoint(spec, root, facts[0])


def make_checkpoints(specs, base):
    """Train every spec not yet under `base` (one launch per TP x DP; a spec after a refused
    one gets a launch of its own). Returns {spec: DsCheckpoint or DeepSpeedRefused}."""
    base = pathlib.Path(base)
    out = {}
    todo = {}
    for spec in dict.fromkeys(specs):
        root = base / f"{spec.name}-{_key(spec)}"
        if (root / "done").exists():
            out[spec] = DsCheckpoint(spec, root, _read_facts(root, spec.world_size)[0])
        elif (root / "refused.txt").exists():
            out[spec] = DeepSpeedRefused((root / "refused.txt").read_text())
        else:
            todo.setdefault((spec.tp, spec.dp), []).append((spec, root))
    while todo:
        group = todo.pop(next(iter(todo)))
        launch = _launch(group)
        for i, (spec, root) in enumerate(group):
            result = _outcome(spec, root, launch)
            if result is None and i == 0:
                raise AssertionError(f"{spec.name}: torchrun exited {launch.returncode}:\n"
                                     f"{launch.stderr[-4000:]}")
            if result is None:  # the launch stopped at an earlier refusal
                todo[(spec.tp, spec.dp, i)] = group[i:]
                break
            out[spec] = result
    return out


def _key(spec):
    """Names a checkpoint by its spec and by the training script that made it."""
    return hashlib.sha256((spec.to_json() + TRAIN.read_text()).encode()).hexdigest()[:12]


@pytest.fixture(scope="session")
def ds_checkpoint(tmp_path_factory):
    """A factory: ds_checkpoint(Spec(...)) -> DsCheckpoint, trained once per spec per session.
    ds_checkpoint.prepare([specs]) trains many in as few launches as it can (call it first from
    a module-scoped fixture when a module uses several specs). Do not write into what it
    returns: copy the save dir first."""
    env_dir = os.environ.get("RESHARD_DS_CHECKPOINT_CACHE")
    base = pathlib.Path(env_dir) if env_dir else shared_tmp_dir(tmp_path_factory, "ds_checkpoints")
    base.mkdir(parents=True, exist_ok=True)
    return _Factory(base)


def shared_tmp_dir(tmp_path_factory, name):
    """A temporary directory every pytest-xdist worker of this run shares (one per session
    without xdist): what one worker trained, the others find there."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return tmp_path_factory.getbasetemp().parent / name
    return tmp_path_factory.mktemp(name)


class _Factory:
    def __init__(self, base):
        self.base = base
        self.made = {}

    def prepare(self, specs):
        todo = [s for s in specs if s not in self.made]
        if not todo:
            return
        # One trainer at a time across the run's workers: a spec another worker is training is
        # found done once the lock is ours.
        with filelock.FileLock(str(self.base / ".lock")):
            self.made.update(make_checkpoints(todo, self.base))

    def __call__(self, spec):
        self.prepare([spec])
        result = self.made[spec]
        if isinstance(result, DeepSpeedRefused):
            raise result
        return result


def resume_launch(tp, dp, jobs, base):
    """One torchrun launch of TP * DP ranks in which a fresh engine loads each universal
    checkpoint of `jobs` [(spec, load_dir, name)] with "load_universal" (`spec` says the model,
    ZeRO stage and dtype; its TP and DP become `tp` and `dp`) and takes the next step's loss.
    Returns {name: {dp_rank: loss}}; a job that fails fails the call with DeepSpeed's message."""
    base = pathlib.Path(base)
    base.mkdir(parents=True, exist_ok=True)
    todo = [{"spec": dataclasses.asdict(dataclasses.replace(spec, tp=tp, dp=dp)),
             "out": str(base / name),
             "resume": {"from": str(load_dir), "universal": "given", "name": "given"}}
            for spec, load_dir, name in jobs]
    (base / "jobs.json").write_text(json.dumps(todo))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(tp * dp),
           "--master_addr", "127.0.0.1", "--master_port", str(free_loopback_port()), str(TRAIN),
           str(base / "jobs.json")]
    r = subprocess.run(cmd, env=_train_env(), capture_output=True, text=True,
                       timeout=LAUNCH_TIMEOUT_S)
    (base / "resume.log").write_text(r.stdout + r.stderr)
    out = {}
    for _, _, name in jobs:
        facts = _read_facts(base / name, tp * dp, "resume-given")
        errors = [f["error"] for f in facts if "error" in f]
        assert not errors, f"{name}: resuming failed: {errors[0]}"
        assert len(facts) == tp * dp, f"{name}: torchrun exited {r.returncode}:\n{r.stderr[-4000:]}"
        out[name] = {int(k): v for k, v in facts[0]["next_loss"].items()}
    return out


class UniversalRefused(Exception):
    """ds_to_universal refused a checkpoint; the message is its exception's."""


def ds_to_universal(ckpt, out_root):
    """Convert `ckpt` with DeepSpeed's converter, as `python -m
    deepspeed.checkpoint.ds_to_universal --input_folder TAG_DIR --output_folder
    OUT_ROOT/<tag>_universal --num_extract_workers 1 --num_merge_workers 1` does, but in this
    process (its own main(), no process pool, no second import of torch and DeepSpeed). It
    also writes OUT_ROOT/latest_universal, beside its output folder. Returns the output folder,
    or raises UniversalRefused with DeepSpeed's message (stage 0: no optimizer files; TP 1: no
    universal_checkpoint_info)."""
    from deepspeed.checkpoint import ds_to_universal as converter

    out = pathlib.Path(out_root) / f"{ckpt.tag}_universal"
    argv = ["ds_to_universal", "--input_folder", str(ckpt.tag_dir), "--output_folder",
            str(out), "--num_extract_workers", "1", "--num_merge_workers", "1"]
    saved_argv = sys.argv
    try:
        sys.argv = argv
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            converter.main(converter.parse_arguments())
    except (AssertionError, FileNotFoundError, RuntimeError, ValueError) as e:
        raise UniversalRefused(f"{ckpt.spec.name}: {type(e).__name__}: {e}") from e
    finally:
        sys.argv = saved_argv
    return out
