"""Orbax -> Hugging Face speed and memory: `reshard gather ORBAX_ITEM -o HF_DIR` against Orbax's
own restore into numpy arrays followed by `safetensors.numpy.save_file` of them (the shortest
path JAX users have). Target (issue 41): >= 5x faster, reshard's peak memory set by the largest
array, not by the checkpoint.

Run with the Python of .venv-jax (JAX, orbax-checkpoint; safetensors is installed there by
this script's caller if missing: `pip install --no-deps safetensors`). The checkpoint is written
by Orbax itself (OCDBT + zarr v2, its default) from 8 CPU devices on a (2, 4) mesh ("fsdp",
"tensor"): --arrays F32 arrays of --rows x --cols, split over both axes (P("fsdp", "tensor")),
by default 8 of 4096 x 4096 (537 MB, each array 67 MB).

Then, --repeat times each, alternating, best and median reported:
- `reshard gather ITEM -o OUT --no-sync` (save_file does not flush either);
- `python -c "restore as numpy; save_file(arrays, OUT/model.safetensors)"`.
Peak memory is the child's maximum resident set and its anonymous part (bench/_measure.py).

    .venv-jax/bin/python bench/orbax_bench.py [--reshard build/tools/reshard/reshard]
        [--repeat 3] [--arrays 8] [--rows 4096] [--cols 4096] [--work DIR] [--keep]
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

SAVE = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import orbax.checkpoint as ocp
    out, arrays, rows, cols = sys.argv[1], *map(int, sys.argv[2:5])
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tensor"))
    s = NamedSharding(mesh, P("fsdp", "tensor"))
    tree = {f"layer{i}": {"kernel": jax.device_put(
        jax.random.normal(jax.random.key(i), (rows, cols), jnp.float32), s)}
        for i in range(arrays)}
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).save(out, tree)
""")

ORBAX_SIDE = textwrap.dedent("""
    import sys, jax, numpy as np
    import orbax.checkpoint as ocp
    from safetensors.numpy import save_file
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    tree = ckptr.metadata(sys.argv[1]).item_metadata.tree
    args = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree,
                                  is_leaf=lambda x: not isinstance(x, (dict, list, tuple)))
    restored = ckptr.restore(sys.argv[1], args=ocp.args.PyTreeRestore(restore_args=args))
    flat = {".".join(str(k.key) for k in path): np.ascontiguousarray(v)
            for path, v in jax.tree_util.tree_flatten_with_path(restored)[0]}
    save_file(flat, sys.argv[2])
""")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reshard", default=str(pathlib.Path(__file__).resolve().parents[1] /
                                             "build" / "tools" / "reshard" / "reshard"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--arrays", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--work", default=None)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    work = pathlib.Path(args.work or tempfile.mkdtemp(prefix="orbax_bench-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "orbax"
    env = {"PYTHONWARNINGS": "ignore", "TF_CPP_MIN_LOG_LEVEL": "3"}
    try:
        if not (ckpt / "_METADATA").exists():
            (work / "save.py").write_text(SAVE)
            subprocess.run([sys.executable, str(work / "save.py"), str(ckpt), str(args.arrays),
                            str(args.rows), str(args.cols)], check=True, capture_output=True,
                           env={**os.environ, **env})
        size = dir_bytes(ckpt)
        largest = args.rows * args.cols * 4
        print(f"checkpoint: {size / 1e9:.2f} GB stored ({args.arrays} arrays), largest array "
              f"{largest / 1e6:.0f} MB")
        for f in ckpt.rglob("*"):  # into the page cache for both sides
            if f.is_file():  # in pieces: a child's peak RSS starts from this process's
                with open(f, "rb") as piece:
                    while piece.read(1 << 24):
                        pass
        (work / "orbax_side.py").write_text(ORBAX_SIDE)
        sides = {
            "reshard": lambda out: [args.reshard, "gather", str(ckpt), "-o", str(out),
                                    "--no-sync"],
            "orbax": lambda out: [sys.executable, str(work / "orbax_side.py"), str(ckpt),
                                  str(out / "model.safetensors")],
        }
        results = {name: [] for name in sides}
        for _ in range(args.repeat):
            for name, cmd in sides.items():
                out = work / f"out-{name}"
                shutil.rmtree(out, ignore_errors=True)
                if name == "orbax":
                    out.mkdir()
                subprocess.run(["sync"], check=True)
                results[name].append(timed(cmd(out), env=env))
        for name, runs in results.items():
            secs = [r[0] for r in runs]
            print(f"{name:8s} best {min(secs):6.2f} s  median {statistics.median(secs):6.2f} s  "
                  f"peak RSS {max(r[1] for r in runs) / 1e6:7.0f} MB  "
                  f"peak anonymous {max(r[2] for r in runs) / 1e6:7.0f} MB")
        from safetensors.numpy import load_file
        a = load_file(work / "out-reshard" / "model.safetensors")
        b = load_file(work / "out-orbax" / "model.safetensors")
        same = sorted(a) == sorted(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)
        print(f"tensors bit-equal: {same}")
        ratio = min(r[0] for r in results["orbax"]) / min(r[0] for r in results["reshard"])
        med = (statistics.median(r[0] for r in results["orbax"]) /
               statistics.median(r[0] for r in results["reshard"]))
        print(f"reshard is {ratio:.1f}x faster (best runs), {med:.1f}x (medians); target >= 5x")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
