"""DeepSpeed checkpoint -> universal checkpoint: `reshard convert --to universal` against
`python -m deepspeed.checkpoint.ds_to_universal` on the same multi-GB checkpoint.

DeepSpeed trains a Llama-shaped model (hidden 1024, 12 layers, intermediate 2048, vocabulary
8192: 141 M parameters) for one step on the CPU at TP 2 x DP 2 under ZeRO 1 (fp32, AdamW) and
saves it (about 2.4 GB: the module, the fp32 master weights and both Adam moments). Then each
converter runs --repeat times on it (the median is reported), timed, with the peak resident
memory of its whole process tree sampled every 50 ms (also its anonymous part: reshard maps its
input files, whose pages count in its RSS but are the page cache's; ds_to_universal runs worker
processes).

Two like-for-like comparisons, since the converters differ in what "done" means:
- neither syncs: `reshard convert --no-sync` against `ds_to_universal`, both leaving their
  output in the page cache;
- both sync: `reshard convert` (its default: files and folders flushed to disk before the
  output's rename) against `ds_to_universal` followed by `sync`.
`cp -r` of the input then `sync` gives the disk's floor for the second. The outputs are
compared: the same files, and the same fp32 tensors for a few parameters.

    python bench/universal_bench.py [--reshard build/tools/reshard/reshard] [--work DIR]
                                    [--repeat 3]

The checkpoint is kept in --work (default /tmp/reshard-universal-bench) and reused.

With --pp, the checkpoint is a DeepSpeed PipelineModule's instead (tests/python/ds_pipe_train.py
at hidden 1024, 32 residual MLP blocks of 4 M parameters cut over TP as Megatron cuts them, a
tied embedding of 8192 x 1024: 143 M parameters) at PP 2 x TP 2 x DP 2, ZeRO 1, fp32, one
step: its layer files, per-stage model states and partitions (default --work
/tmp/reshard-universal-bench-pp).
"""

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
TP, DP, STAGE = 2, 2, 1
MODEL = dict(model_type="llama", hidden_size=1024, intermediate_size=2048, num_hidden_layers=12,
             num_attention_heads=16, num_key_value_heads=16, head_dim=64, vocab_size=8192,
             max_position_embeddings=256, tie_word_embeddings=False)


def train(save_dir):
    """Under torchrun: one optimizer step, then save_checkpoint(save_dir)."""
    import deepspeed
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, str(REPO / "tests" / "python"))
    import ds_train

    ds_train.init_distributed()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**MODEL), dtype=torch.float32)
    spec = {"family": "llama", "stage": STAGE, "tp": TP, "dtype": "float32"}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_train.ds_config(spec))
    ids = torch.randint(3, MODEL["vocab_size"], (ds_train.BATCH, 16),
                        generator=torch.Generator().manual_seed(1))
    loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(save_dir)


PIPE = dict(pp=2, tp=2, dp=2, stage=1, dtype="float32", steps=1, vocab=8192, blocks=32,
            hidden=1024, seed=1, partition="parameters", reference=False)


def make_pipe_checkpoint(work):
    """Under torchrun (PP x TP x DP ranks): ds_pipe_train.py trains PIPE one step and saves it
    to work/ckpt."""
    import json

    env = dict(os.environ, DS_ACCELERATOR="cpu", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    jobs = work / "jobs.json"
    jobs.write_text(json.dumps([{"spec": PIPE, "out": str(work)}]))
    world = PIPE["pp"] * PIPE["tp"] * PIPE["dp"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
           "--master_addr", "127.0.0.1", "--master_port", "29518",
           str(REPO / "tests" / "python" / "ds_pipe_train.py"), str(jobs)]
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    facts = json.loads((work / "ref" / "facts-0.json").read_text())
    if "error" in facts:
        raise SystemExit(f"DeepSpeed refused: {facts['error']}")


def make_checkpoint(save_dir):
    env = dict(os.environ, DS_ACCELERATOR="cpu", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(TP * DP),
           "--master_addr", "127.0.0.1", "--master_port", "29517", __file__, "--train",
           str(save_dir)]
    subprocess.run(cmd, env=env, check=True, capture_output=True)


def anon_rss(pid):
    """RssAnon of a process: its resident memory that is not pages of mapped files."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def tree_rss(proc):
    """(RSS, anonymous RSS) summed over the process and its descendants."""
    import psutil

    total = anon = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
            anon += anon_rss(p.pid)
        except (psutil.Error, OSError):
            pass
    return total, anon


def timed(cmd):
    """(seconds, peak bytes of the process tree's summed RSS, and of its anonymous RSS)."""
    import psutil

    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    proc = psutil.Process(child.pid)
    peak = [0, 0]
    done = threading.Event()

    def sample():
        while not done.is_set():
            try:
                peak[:] = map(max, peak, tree_rss(proc))
            except psutil.Error:
                pass
            done.wait(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    _, err = child.communicate()
    elapsed = time.perf_counter() - t0
    done.set()
    sampler.join()
    if child.returncode != 0:
        raise SystemExit(f"{cmd} failed: {err[-2000:]}")
    return elapsed, peak


def dir_bytes(path):
    return sum(p.stat().st_size for p in pathlib.Path(path).rglob("*") if p.is_file())


def compare(ours, theirs, names):
    import torch

    files = sorted(p.relative_to(ours) for p in ours.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(theirs) for p in theirs.rglob("*") if p.is_file())
    folder = (ours / "latest_universal").read_text()
    for name in names:
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            rel = pathlib.Path(folder) / "zero" / name / f"{state}.pt"
            a = torch.load(ours / rel, weights_only=True)["param"]
            b = torch.load(theirs / rel, weights_only=True)["param"]
            assert torch.equal(a, b), rel
    return len(files)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reshard", default=str(REPO / "build" / "tools" / "reshard" / "reshard"))
    ap.add_argument("--work", default="/tmp/reshard-universal-bench")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each converter (median)")
    ap.add_argument("--pp", action="store_true",
                    help="a PipelineModule checkpoint at PP 2 x TP 2 x DP 2 instead")
    ap.add_argument("--train", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.train:
        return train(args.train)
    work = pathlib.Path(args.work)
    if args.pp and args.work == ap.get_default("work"):
        work = pathlib.Path(args.work + "-pp")
    save = work / "ckpt"
    if not (save / "latest").exists():
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        t0 = time.perf_counter()
        make_pipe_checkpoint(work) if args.pp else make_checkpoint(save)
        print(f"DeepSpeed trained and saved in {time.perf_counter() - t0:.0f} s")
    tag = (save / "latest").read_text().strip()
    size = dir_bytes(save / tag)
    topology = f"PP {PIPE['pp']} x TP {PIPE['tp']} x DP {PIPE['dp']}" if args.pp else \
        f"TP {TP} x DP {DP}"
    print(f"checkpoint: {save / tag}, {size / 1e9:.2f} GB, {topology}, ZeRO {STAGE}")

    ours, theirs = work / "reshard-out", work / "deepspeed-out"
    convert = [args.reshard, "convert", str(save), "--to", "universal", "-o", str(ours)]

    def fresh(*dirs):
        """Removes outputs and flushes what is pending, so that no run pays for another."""
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
        subprocess.run(["sync"], check=True)
        time.sleep(1)

    def deepspeed():
        theirs.mkdir()
        took = timed([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                      "--input_folder", str(save / tag), "--output_folder",
                      str(theirs / f"{tag}_universal")])
        # `sync` puts DeepSpeed's output on disk (this also flushes anything else pending).
        return took, timed(["sync"])[0]

    runs = {"synced": [], "no_sync": [], "ds": [], "ds_sync": []}
    for _ in range(args.repeat):
        fresh(ours, theirs)
        runs["synced"].append(timed(convert))
        fresh(ours)
        runs["no_sync"].append(timed(convert + ["--no-sync"]))
        fresh()
        (d_s, d_rss), d_sync = deepspeed()
        runs["ds"].append((d_s, d_rss))
        runs["ds_sync"].append((d_s + d_sync, d_rss))
    names = ["tied_modules.embed.weight", "1.up.weight", "32.down.weight"] if args.pp else \
        ["model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.down_proj.weight"]
    n = compare(ours, theirs, names)
    out_size = dir_bytes(ours)
    print(f"outputs: {n} files, {out_size / 1e9:.2f} GB each, the same files and tensors")

    def median(key):
        times = sorted(t for t, _ in runs[key])
        peak = [max(r[i] for _, r in runs[key]) for i in (0, 1)]
        return times[len(times) // 2], peak, times

    print(f"{'':32}{'median s':>9}{'GB/s':>7}{'peak RSS GB':>13}{'(anonymous)':>13}   runs")
    rows = (("reshard convert --no-sync", "no_sync"), ("ds_to_universal", "ds"),
            ("reshard convert (synced)", "synced"), ("ds_to_universal + sync", "ds_sync"))
    for label, key in rows:
        s, (rss, anon), times = median(key)
        print(f"{label:32}{s:9.2f}{out_size / 1e9 / s:7.2f}{rss / 1e9:13.2f}{anon / 1e9:13.2f}   "
              + " ".join(f"{t:.2f}" for t in times))
    c_s, _ = timed(["bash", "-c", f"cp -r {save / tag} {work / 'cp'} && sync"])
    shutil.rmtree(work / "cp")
    print(f"{'cp -r input && sync':32}{c_s:9.2f}{size / 1e9 / c_s:7.2f}")
    print(f"speed-up, neither syncs: {median('ds')[0] / median('no_sync')[0]:.1f}x; "
          f"both sync: {median('ds_sync')[0] / median('synced')[0]:.1f}x (target >= 10x)")
    memory_bound(convert, ours, fresh)
    return 0


# What the process needs besides the tensors it handles: its code's own data, two threads'
# stacks (8 MiB each, private memory like any other), the JSON of a manifest.
BASELINE = 32 << 20


def memory_bound(convert, ours, fresh):
    """The convert again under a cap on its private memory (`ulimit -d`: RLIMIT_DATA, the
    writable private mappings and the heap; not the input files reshard maps read-only, which
    are the page cache's and which `ulimit -v` would count) of 3x the largest parameter's fp32
    bytes plus BASELINE: the checkpoint's size does not enter. Then at half of that, where it
    must fail cleanly (exit 2, nothing written)."""
    largest = max(p.stat().st_size for p in ours.rglob("fp32.pt"))
    for label, cap in (("3x the largest parameter + baseline", 3 * largest + BASELINE),
                       ("half that", (3 * largest + BASELINE) // 2)):
        fresh(ours)
        shell = f"ulimit -d {cap // 1024} && exec " + " ".join(convert + ["--no-sync"])
        r = subprocess.run(["bash", "-c", shell], capture_output=True, text=True)
        print(f"under ulimit -d {cap / 2**20:.0f} MiB ({label}; largest parameter "
              f"{largest / 2**20:.1f} MiB): exit {r.returncode}"
              + ("" if r.returncode == 0 else f", {r.stderr.strip()[:160]}")
              + f"; output {'written' if ours.exists() else 'absent'}")


if __name__ == "__main__":
    sys.exit(main())
