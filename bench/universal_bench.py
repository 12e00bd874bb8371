"""DeepSpeed checkpoint -> universal checkpoint: `reshard convert --to universal` against
`python -m deepspeed.checkpoint.ds_to_universal` on the same multi-GB checkpoint.

DeepSpeed trains a Llama-shaped model (hidden 1024, 12 layers, intermediate 2048, vocabulary
8192: 141 M parameters) for one step on the CPU at TP 2 x DP 2 under ZeRO 1 (fp32, AdamW) and
saves it (about 2.3 GB: the module, the fp32 master weights and both Adam moments). Then each
converter runs once on it, timed, with the peak resident memory of its whole process tree
sampled every 50 ms (also its anonymous part: reshard maps its input files, whose pages count
in its RSS but are the page cache's) (ds_to_universal runs worker processes). reshard's files are on disk when it
returns (synced before the output's rename); DeepSpeed's are in the page cache, so its time is
also given with a `sync` after it, and `cp -r` of the input then `sync` gives the disk's floor.
The outputs are compared: the same files, and the same fp32 tensors for a few parameters.

    python bench/universal_bench.py [--reshard build/tools/reshard/reshard] [--work DIR]

The checkpoint is kept in --work (default /tmp/reshard-universal-bench) and reused.
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
    spec = {"stage": STAGE, "tp": TP, "dtype": "float32"}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_train.ds_config(spec))
    ids = torch.randint(3, MODEL["vocab_size"], (ds_train.BATCH, 16),
                        generator=torch.Generator().manual_seed(1))
    loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(save_dir)


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
    ap.add_argument("--train", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.train:
        return train(args.train)
    work = pathlib.Path(args.work)
    save = work / "ckpt"
    if not (save / "latest").exists():
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        t0 = time.perf_counter()
        make_checkpoint(save)
        print(f"DeepSpeed trained and saved in {time.perf_counter() - t0:.0f} s")
    tag = (save / "latest").read_text().strip()
    size = dir_bytes(save / tag)
    print(f"checkpoint: {save / tag}, {size / 1e9:.2f} GB, TP {TP} x DP {DP}, ZeRO {STAGE}")

    ours, theirs = work / "reshard-out", work / "deepspeed-out"
    for d in (ours, theirs):
        shutil.rmtree(d, ignore_errors=True)
    subprocess.run(["sync"], check=True)
    r_s, r_rss = timed([args.reshard, "convert", str(save), "--to", "universal", "-o", str(ours)])
    theirs.mkdir()
    d_s, d_rss = timed([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                        "--input_folder", str(save / tag), "--output_folder",
                        str(theirs / f"{tag}_universal")])
    # reshard's output is on disk when it returns (synced before its rename); DeepSpeed's is in
    # the page cache: `sync` puts it on disk too (this also flushes anything else pending).
    d_sync, _ = timed(["sync"])
    n = compare(ours, theirs, ["model.embed_tokens.weight", "lm_head.weight",
                               "model.layers.0.mlp.down_proj.weight"])
    out_size = dir_bytes(ours)
    print(f"outputs: {n} files, {out_size / 1e9:.2f} GB each, the same files and tensors")
    print(f"{'':24}{'seconds':>10}{'GB/s':>8}{'peak RSS GB':>13}{'(anonymous)':>13}")
    rows = (("reshard convert", r_s, r_rss), ("ds_to_universal", d_s, d_rss),
            ("ds_to_universal + sync", d_s + d_sync, d_rss))
    for label, s, (rss, anon) in rows:
        print(f"{label:24}{s:10.2f}{out_size / 1e9 / s:8.2f}{rss / 1e9:13.2f}{anon / 1e9:13.2f}")
    c_s, _ = timed(["bash", "-c", f"cp -r {save / tag} {work / 'cp'} && sync"])
    shutil.rmtree(work / "cp")
    print(f"{'cp -r input && sync':24}{c_s:10.2f}{size / 1e9 / c_s:8.2f}")
    print(f"speed-up: {d_s / r_s:.1f}x, {(d_s + d_sync) / r_s:.1f}x with sync (target >= 10x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
