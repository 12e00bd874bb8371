"""DCP -> Hugging Face speed and memory (issue 22): `reshard gather DCP_DIR -o HF_DIR` against
what torch offers, `torch.distributed.checkpoint.format_utils.dcp_to_torch_save` followed by
`torch.load` of its output and `safetensors.torch.save_file` of the tensors. Target: >= 5x
faster, reshard's peak memory set by the largest tensor, not by the checkpoint.

The checkpoint is written by torch itself: `dcp.save` under torchrun at world 4 (gloo on the
CPU) of a Llama-shaped state dict of DTensors on a 2 x 2 mesh (dp x tp: Shard(0) over dp and
Shard(0) or Shard(1) over tp, as FSDP2 + TP lay them out), fp32, by default 16 layers of hidden
1024 and intermediate 2816 plus an embedding and LM head of vocabulary 32000: 1.07 GB in 146
tensors, the largest 131 MB.

Then, --repeat times each, alternating, best and median reported:
- `reshard gather DCP -o OUT --no-sync` (torch's save_file does not flush either);
- `python -c "dcp_to_torch_save(DCP, T.pt); save_file(torch.load(T.pt), OUT/model.safetensors)"`.
Outputs are removed and `sync` run before each run; the checkpoint is read once first so that
both sides read it from the page cache. Peak memory is the child's maximum resident set
(getrusage, what GNU time reports: it counts reshard's mapped input pages) and its anonymous
part (RssAnon sampled every 20 ms).

    python bench/dcp_bench.py [--reshard build/tools/reshard/reshard] [--repeat 3]
                              [--layers 16] [--work DIR] [--keep]
"""

import argparse
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap

from _measure import dir_bytes, timed

WORKER = textwrap.dedent("""
    import sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    layers, hidden, inter, vocab = map(int, sys.argv[2:6])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(0)
    def t(*shape, tp_dim=0):
        return distribute_tensor(torch.randn(*shape, generator=g), mesh, [Shard(0), Shard(tp_dim)])
    sd = {"model.embed_tokens.weight": t(vocab, hidden), "lm_head.weight": t(vocab, hidden),
          "model.norm.weight": t(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj"):
            sd[p + f"self_attn.{n}.weight"] = t(hidden, hidden)
        sd[p + "self_attn.o_proj.weight"] = t(hidden, hidden, tp_dim=1)
        sd[p + "mlp.gate_proj.weight"] = t(inter, hidden)
        sd[p + "mlp.up_proj.weight"] = t(inter, hidden)
        sd[p + "mlp.down_proj.weight"] = t(hidden, inter, tp_dim=1)
        sd[p + "input_layernorm.weight"] = t(hidden)
        sd[p + "post_attention_layernorm.weight"] = t(hidden)
    dcp.save(sd, checkpoint_id=sys.argv[1])
    dist.destroy_process_group()
""")

TORCH_SIDE = textwrap.dedent("""
    import sys, torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from safetensors.torch import save_file
    dcp_to_torch_save(sys.argv[1], sys.argv[2])
    sd = torch.load(sys.argv[2], weights_only=False)
    save_file({k: v.contiguous() for k, v in sd.items()}, sys.argv[3])
""")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reshard", default=str(pathlib.Path(__file__).resolve().parents[1] /
                                             "build" / "tools" / "reshard" / "reshard"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--work", default=None)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    work = pathlib.Path(args.work or tempfile.mkdtemp(prefix="dcp_bench-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "dcp"
    try:
        if not (ckpt / ".metadata").exists():
            (work / "worker.py").write_text(WORKER)
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                            "4", "--master_addr", "127.0.0.1", "--master_port", "29517",
                            str(work / "worker.py"), str(ckpt), str(args.layers),
                            str(args.hidden), str(args.intermediate), str(args.vocab)],
                           check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                           capture_output=True)
        size = dir_bytes(ckpt)
        largest = args.vocab * args.hidden * 4
        print(f"checkpoint: {size / 1e9:.2f} GB at world 4, largest tensor {largest / 1e6:.0f} MB")
        for f in ckpt.iterdir():  # into the page cache for both sides
            f.read_bytes()
        (work / "torch_side.py").write_text(TORCH_SIDE)
        sides = {
            "reshard": lambda out: [args.reshard, "gather", str(ckpt), "-o", str(out),
                                    "--no-sync"],
            "torch": lambda out: [sys.executable, str(work / "torch_side.py"), str(ckpt),
                                  str(work / "full.pt"), str(out / "model.safetensors")],
        }
        results = {name: [] for name in sides}
        for _ in range(args.repeat):
            for name, cmd in sides.items():
                out = work / f"out-{name}"
                shutil.rmtree(out, ignore_errors=True)
                (work / "full.pt").unlink(missing_ok=True)
                if name == "torch":
                    out.mkdir()
                subprocess.run(["sync"], check=True)
                results[name].append(timed(cmd(out)))
        for name, runs in results.items():
            secs = [r[0] for r in runs]
            print(f"{name:8s} best {min(secs):6.2f} s  median {statistics.median(secs):6.2f} s  "
                  f"peak RSS {max(r[1] for r in runs) / 1e6:7.0f} MB  "
                  f"peak anonymous {max(r[2] for r in runs) / 1e6:7.0f} MB")
        ratio = min(r[0] for r in results["torch"]) / min(r[0] for r in results["reshard"])
        med = (statistics.median(r[0] for r in results["torch"]) /
               statistics.median(r[0] for r in results["reshard"]))
        print(f"reshard is {ratio:.1f}x faster (best runs), {med:.1f}x (medians); target >= 5x")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
