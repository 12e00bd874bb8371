"""Timing and peak memory of a child process, for the benchmarks that compare reshard's CLI
with another program (dcp_bench.py, moe_bench.py)."""

import os
import pathlib
import subprocess
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
