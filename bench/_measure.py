"""Timing and peak memory of a child process, for the benchmarks that compare reshard's CLI
with another program (dcp_bench.py, moe_bench.py); the trainer processes of the live-sync
benchmarks (vllm_sync_bench.py, fleet_bench.py)."""

import argparse
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time


def rss_anon(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def timed(cmd, env=None):
    """(seconds, peak RSS bytes of the child, peak anonymous RSS bytes); `env`: variables to
    set for the child."""
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env=None if env is None else {**os.environ, **env})
    anon, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            anon[0] = max(anon[0], rss_anon(child.pid))
            done.wait(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    _, status, usage = os.wait4(child.pid, 0)
    elapsed = time.perf_counter() - t0
    done.set()
    sampler.join()
    err = child.stderr.read().decode(errors="replace")
    child.stderr.close()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({code}): {err[-2000:]}")
    return elapsed, usage.ru_maxrss * 1024, anon[0]


def dir_bytes(path):
    return sum(p.stat().st_size for p in pathlib.Path(path).rglob("*") if p.is_file())


def timed_collective(fn, repeats):
    """The median seconds of `repeats` calls of `fn` that every process of the default
    torch.distributed group makes together, each between two barriers."""
    import statistics

    import torch.distributed as dist

    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kill_all(procs):
    """Kills each process (started with ``start_new_session``) and whatever it started."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def wait_all(procs, timeout_s):
    """Waits up to ``timeout_s`` for each process, then :func:`kill_all`."""
    try:
        for p in procs:
            p.wait(timeout=timeout_s)
    finally:
        kill_all(procs)


def run_ranks(script, args, work, env, timeout_s, ranks=2):
    """``python SCRIPT --rank R --work WORK ARGS...`` for each rank, each in a session of its
    own with its output in WORK/trainerR.log; waited for up to ``timeout_s``, then they and
    whatever they started (an engine's processes) are killed. The result they left in
    WORK/result.json (read as JSON), or exits naming the logs."""
    import json
    logs = [open(os.path.join(work, f"trainer{r}.log"), "w") for r in range(ranks)]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(script), "--rank", str(r),
                               "--work", work, *args], env=env, stdout=logs[r],
                              stderr=subprocess.STDOUT, start_new_session=True)
             for r in range(ranks)]
    wait_all(procs, timeout_s)
    path = os.path.join(work, "result.json")
    if not os.path.exists(path):
        sys.exit(f"the trainer processes failed; see {work}/trainer*.log")
    with open(path) as f:
        return json.load(f)


def trainer_arguments(ap):
    """The hidden arguments with which :func:`live_sync_main` starts a live-sync benchmark's
    trainer processes (vllm_sync_bench.py, fleet_bench.py)."""
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    for name in ("--work", "--model", "--sharded"):
        ap.add_argument(name, default=None, help=argparse.SUPPRESS)


def live_sync_main(script, args, trainer, write, prefix, extra, timeout_s, env_defaults=None):
    """The main of a live-sync benchmark. In a trainer process (``--rank`` given): runs
    ``trainer(args)`` and exits at once (no interpreter teardown under a live engine).
    Otherwise: ``write(work)`` -> (model, sharded) into a scratch folder, the two trainer
    processes run over them with the ``extra`` arguments (vLLM's CPU threads unbound unless
    set; ``env_defaults`` for variables not set), the folder is removed, and their result is
    returned (:func:`run_ranks`)."""
    if args.rank is not None:
        trainer(args)
        sys.stdout.flush()
        os._exit(0)
    work = tempfile.mkdtemp(prefix=prefix)
    model, sharded = write(work)
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=os.environ.get(
        "VLLM_CPU_OMP_THREADS_BIND", "nobind"), TOKENIZERS_PARALLELISM="false")
    for k, v in (env_defaults or {}).items():
        env.setdefault(k, v)
    r = run_ranks(script, ["--model", model, "--sharded", sharded, *extra], work, env, timeout_s)
    shutil.rmtree(work, ignore_errors=True)  # the model and its shards (kept on a failure)
    return r
