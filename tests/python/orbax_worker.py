"""Orbax checkpoints saved by Orbax itself, and what Orbax restores from them (run in .venv-jax).

    orbax_worker.py OUT
    orbax_worker.py restore ITEM OUT [ITEM OUT ...]   (Orbax's restore of each ITEM into its
                                                       OUT, as truth/ below)

writes, under OUT, one checkpoint per case (see CASES) and, beside each, `truth/`: every leaf
as Orbax restores it (`<name>.bin`, its bytes row-major) and `truth.json` ({name: [dtype,
shape]}). 8 CPU devices (XLA_FLAGS) carry the meshes.
"""

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys

# `orbax_worker.py multi PROCESS PORT OUT`: one of two jax.distributed processes of 4 devices
MULTI = len(sys.argv) > 1 and sys.argv[1] == "multi"
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={4 if MULTI else 8}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
import tensorstore as ts  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

# dtype name as safetensors writes it
DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int8": "I8", "uint8": "U8",
          "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "int32": "I32", "float8_e5m2": "F8_E5M2"}


def values(rng, shape, dtype):
    if dtype == "bool":
        return jnp.asarray(rng.integers(0, 2, shape).astype(bool))
    if dtype in ("int8", "uint8", "int32"):
        return jnp.asarray(rng.integers(-100 if dtype != "uint8" else 0, 100, shape).astype(dtype))
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def tree_on(mesh, seed):
    """A pytree on `mesh` with every dtype, even and uneven splits, replicated, multi-axis."""
    rng = np.random.default_rng(seed)
    axes = mesh.axis_names
    a0 = axes[0]
    a1 = axes[-1]
    both = tuple(axes) if len(axes) > 1 else axes[0]

    def put(shape, dtype, spec):
        return jax.device_put(values(rng, shape, dtype), NamedSharding(mesh, spec))

    return {
        "params": {
            "embed": {"embedding": put((16, 12), "float32", P(a0, a1 if a1 != a0 else None))},
            "decoder": {
                "layers": [
                    {"kernel": put((12, 8), "bfloat16", P(None, both)),
                     "bias": put((8,), "float16", P())},
                    # saved in zarr chunks smaller than a device's box (chunk_byte_size)
                    {"kernel": put((16, 6), "bfloat16", P(a1, None)),
                     "scale": put((6,), "float8_e4m3fn", P(None))},
                ],
                "mask": put((8, 4), "bool", P(both, None)),
                "q": put((4, 8), "int8", P(None, a0)),
                "u": put((3, 5), "uint8", P()),
                # chunks larger than OCDBT's inline values: stored out of line in data files
                "mlp": put((256, 64), "float32", P(a0, None)),
            },
        },
        "step": put((), "int32", P()),
    }


def optimizer_tree(mesh, params):
    rng = np.random.default_rng(7)
    leaves = {"mu": {}, "nu": {}}
    for k in ("mu", "nu"):
        leaves[k] = {"embed": jax.device_put(values(rng, (16, 12), "float32"),
                                             params["params"]["embed"]["embedding"].sharding)}
    return {"params": params["params"], "opt_state": leaves, "step": params["step"]}


def optax_tree(mesh, whole):
    """A model's parameters and optax's AdamW state after two updates, as a trainer saves them:
    {"params", "opt_state", "step"}. The optimizer holds the tree with its "params" key when
    `whole` (Adam's moments at opt_state.0.mu.params.*), else the subtree under it
    (opt_state.0.mu.*). bf16 and f16 parameters keep moments of their own dtype."""
    import optax

    rng = np.random.default_rng(30)
    axes = mesh.axis_names
    a0, a1 = axes[0], axes[-1]
    both = tuple(axes) if len(axes) > 1 else axes[0]

    def put(shape, dtype, spec):
        return jax.device_put(values(rng, shape, dtype), NamedSharding(mesh, spec))

    params = {"embed": {"embedding": put((16, 12), "float32", P(a0, a1 if a1 != a0 else None))},
              "layers": [{"kernel": put((12, 8), "bfloat16", P(None, both))},
                         {"kernel": put((8, 8), "float32", P(both, None)),
                          "bias": put((8,), "float16", P())}],
              "norm": {"scale": put((8,), "float32", P())}}
    target = {"params": params} if whole else params
    tx = optax.adamw(1e-2)
    state = tx.init(target)
    for _ in range(2):
        grads = jax.tree_util.tree_map(
            lambda x: jax.device_put(values(rng, x.shape, str(x.dtype)), x.sharding), target)
        updates, state = tx.update(grads, state, target)
        target = optax.apply_updates(target, updates)
    return {"params": target["params"] if whole else target, "opt_state": state,
            "step": put((), "int32", P())}


def save_args(tree):
    """Orbax's default for every leaf but one, saved in chunks of at most 8 bytes (a row of
    the uneven (16, 6) kernel's box: chunks of 1 x 3 that tile it)."""
    args = jax.tree_util.tree_map(lambda _: ocp.SaveArgs(), tree)
    if "decoder" in args["params"]:
        args["params"]["decoder"]["layers"][1]["kernel"] = ocp.SaveArgs(chunk_byte_size=8)
    return args


def save(path, tree, **handler_args):
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**handler_args))
    ckptr.save(path, args=ocp.args.PyTreeSave(tree, save_args=save_args(tree)))


def write_truth(item, out, as_numpy=False):
    """Orbax's own restore of `item`, leaf by leaf (as numpy arrays with `as_numpy`: a checkpoint
    saved on devices this process does not have)."""
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    if as_numpy:
        tree = ckptr.metadata(item).item_metadata.tree
        args = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree,
                                      is_leaf=lambda x: not isinstance(x, (dict, list, tuple)))
        restored = ckptr.restore(item, args=ocp.args.PyTreeRestore(restore_args=args))
    else:
        restored = ckptr.restore(item)
    out.mkdir(parents=True, exist_ok=True)
    index = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]:
        name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        arr = np.asarray(leaf)
        (out / f"{name}.bin").write_bytes(np.ascontiguousarray(arr).tobytes())
        index[name] = [DTYPES[str(arr.dtype)], list(arr.shape)]
    (out / "truth.json").write_text(json.dumps(index, indent=1))


def list_ocdbt(item, out):
    """tensorstore's own reading of an item's OCDBT databases (its ocdbt kvstore driver), when it
    has them: `ocdbt.json` in `out`, {database: {key: value length}} for the item's merged
    database and each process's."""
    found = {}
    for db in [item, *sorted(item.glob("ocdbt.process_*"))]:
        if not (db / "manifest.ocdbt").exists():
            continue
        kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{db}/"}).result()
        found[db.name if db != item else ""] = {
            key.decode(): len(kv.read(key).result().value) for key in kv.list().result()}
    if found:
        (out / "ocdbt.json").write_text(json.dumps(found, indent=1))


def uncompress(item, name):
    """Rewrites one zarr v2 array of a checkpoint without OCDBT with uncompressed chunks."""
    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(item / name)}}
    old = ts.open(spec).result()
    data = old.read().result()
    meta = json.loads((item / name / ".zarray").read_text())
    shutil.rmtree(item / name)
    meta["compressor"] = None
    new = ts.open({**spec, "metadata": meta}, create=True).result()
    new.write(data).result()


def save_from_two_processes(out):
    """Two jax.distributed processes of 4 CPU devices each (ids 0-3 and 2048-2051) save one
    checkpoint: a database per process, merged."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, __file__, "multi", str(i), str(port), str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for i in range(2)]
    for p in procs:
        log = p.communicate(timeout=300)[0]
        assert p.returncode == 0, log.decode()[-4000:]


def multi_process_main(process, port, out):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2,
                               process_id=process)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tensor"))
    rng = np.random.default_rng(20)

    def put(shape, dtype, spec):
        x = np.asarray(values(rng, shape, dtype))
        return jax.make_array_from_callback(shape, NamedSharding(mesh, spec), lambda i: x[i])

    tree = {"w": put((64, 64), "float32", P("fsdp", "tensor")),
            "v": put((32, 8), "bfloat16", P(("fsdp", "tensor"), None)),
            "b": put((64,), "float16", P())}
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).save(out, tree)


def main():
    if MULTI:
        return multi_process_main(int(sys.argv[2]), int(sys.argv[3]), pathlib.Path(sys.argv[4]))
    if sys.argv[1] == "restore":  # `orbax_worker.py restore ITEM OUT ...`: Orbax's restores
        for item, dest in zip(sys.argv[2::2], sys.argv[3::2]):
            write_truth(pathlib.Path(item), pathlib.Path(dest))
            list_ocdbt(pathlib.Path(item), pathlib.Path(dest))
        return None
    out = pathlib.Path(sys.argv[1])
    devices = np.array(jax.devices())
    mesh24 = Mesh(devices.reshape(2, 4), ("fsdp", "tensor"))
    mesh8 = Mesh(devices.reshape(8), ("data",))
    cases = {
        # Orbax's default: OCDBT with zarr v2
        "ocdbt_zarr2": (tree_on(mesh24, 1), {}),
        # MaxText's: OCDBT with zarr v3
        "ocdbt_zarr3": (tree_on(mesh8, 2), {"use_zarr3": True}),
        # per-array zarr directories
        "zarr2": (tree_on(mesh24, 3), {"use_ocdbt": False}),
        "zarr3": (tree_on(mesh8, 4), {"use_ocdbt": False, "use_zarr3": True}),
        # with optimizer state
        "optimizer": (optimizer_tree(mesh24, tree_on(mesh24, 5)), {}),
        # optax's AdamW state, the optimizer given the params' subtree / the whole tree
        "optax": (optax_tree(mesh24, whole=False), {}),
        "optax8": (optax_tree(mesh8, whole=True), {"use_zarr3": True}),
    }
    for name, (tree, args) in cases.items():
        item = out / name
        save(item, tree, **args)
        if name == "zarr2":
            uncompress(item, "params.decoder.layers.1.kernel")
            uncompress(item, "params.embed.embedding")
        write_truth(item, out / f"{name}.truth")
    # A checkpoint root of two steps (CheckpointManager), the newest read.
    with ocp.CheckpointManager(out / "root") as mngr:
        for step in (1, 2):
            mngr.save(step, args=ocp.args.PyTreeSave(tree_on(mesh24, 10 + step)))
        mngr.wait_until_finished()
    write_truth(out / "root" / "2" / "default", out / "root.truth")
    save_from_two_processes(out / "two_processes")
    write_truth(out / "two_processes", out / "two_processes.truth", as_numpy=True)


if __name__ == "__main__":
    main()
