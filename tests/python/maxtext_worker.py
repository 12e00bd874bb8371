"""A MaxText-named Orbax checkpoint restored by Orbax and run by a forward pass in jax.numpy
(run in .venv-jax).

    maxtext_worker.py ITEM CONFIG.json IDS.json OUT [ITEM CONFIG.json IDS.json OUT ...]

restores each ITEM (an Orbax item whose tree is MaxText's TrainState params, `params.params...`) with
Orbax on its own shardings (8 CPU devices), writes `OUT/logits.npy`: the logits of the token ids
in IDS.json under MaxText's model semantics, written here from MaxText's layers (not from
transformers): decoder layers stacked on axis 1 of every array (param_scan_axis), DenseGeneral
kernels [in, out], attention kernels [embed, heads, head_dim] and out [heads, head_dim, embed],
no 1/sqrt(head_dim) on the attention logits (MaxText's Llama folds it into the query kernel),
and Llama's rotary embedding on interleaved pairs (d = 2i, 2i + 1: LLaMARotaryEmbedding) - or,
for Qwen3, RMS norms on each query and key head, the half-split rotary embedding and
1/sqrt(head_dim) on the logits. Then saves the restored tree again, as MaxText's
CheckpointManager does (OCDBT + zarr v3, item `items`, with a `step`), on an (8,) mesh with
other shardings: `OUT/ckpt/0/items`.
"""

import json
import os
import pathlib
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def rms_norm(x, scale, eps):
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * scale


def rope_interleaved(x, positions, theta):
    """MaxText's LLaMARotaryEmbedding (without Llama 3.1's frequency scaling): pairs (2i, 2i+1)
    rotate by position / theta^(2i/D). x: [S, heads, D]."""
    d = x.shape[-1]
    fraction = jnp.repeat(2 * jnp.arange(d // 2) / d, 2)
    angle = positions[:, None, None] / (theta ** fraction)[None, None, :]
    shifted_left = jnp.concatenate([x[..., 1:], x[..., :1]], axis=-1)    # x[d + 1]
    shifted_right = jnp.concatenate([x[..., -1:], x[..., :-1]], axis=-1)  # x[d - 1]
    odd = (jnp.arange(d) % 2) == 1
    shifted = jnp.where(odd, shifted_right, shifted_left)
    sign = jnp.where(odd, 1.0, -1.0)
    return x * jnp.cos(angle) + shifted * jnp.sin(angle) * sign


def rope_half(x, positions, theta):
    """MaxText's RotaryEmbedding: the first half of head_dim rotates with the second."""
    d = x.shape[-1]
    timescale = theta ** (2 * jnp.arange(d // 2) / d)
    angle = positions[:, None, None] / timescale[None, None, :]
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([first * jnp.cos(angle) - second * jnp.sin(angle),
                            second * jnp.cos(angle) + first * jnp.sin(angle)], axis=-1)


def forward(params, config, ids):
    """Logits [S, V] of one sequence."""
    eps = config.get("rms_norm_eps", 1e-6)
    theta = config.get("rope_theta") or config.get("rope_parameters", {}).get("rope_theta",
                                                                              10000.0)
    qwen3 = config["model_type"] == "qwen3"
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    positions = jnp.arange(len(ids), dtype=jnp.float32)
    decoder = params["decoder"]
    x = params["token_embedder"]["embedding"][jnp.asarray(ids)]
    for layer in range(config["num_hidden_layers"]):
        lay = jax.tree_util.tree_map(lambda a, layer=layer: jnp.take(a, layer, axis=1),
                                     decoder["layers"])
        attn = lay["self_attention"]
        h = rms_norm(x, lay["pre_self_attention_layer_norm"]["scale"], eps)
        q = jnp.einsum("sh,hnd->snd", h, attn["query"]["kernel"])
        k = jnp.einsum("sh,hnd->snd", h, attn["key"]["kernel"])
        v = jnp.einsum("sh,hnd->snd", h, attn["value"]["kernel"])
        if qwen3:
            q = rms_norm(q, attn["query_norm"]["scale"], eps)
            k = rms_norm(k, attn["key_norm"]["scale"], eps)
            q, k = rope_half(q, positions, theta), rope_half(k, positions, theta)
            q = q / np.sqrt(q.shape[-1])
        else:
            q, k = rope_interleaved(q, positions, theta), rope_interleaved(k, positions, theta)
        k = jnp.repeat(k, heads // kv_heads, axis=1)
        v = jnp.repeat(v, heads // kv_heads, axis=1)
        scores = jnp.einsum("snd,tnd->nst", q, k)
        causal = jnp.tril(jnp.ones((len(ids), len(ids)), dtype=bool))
        scores = jnp.where(causal[None], scores, -1e30)
        weights = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("nst,tnd->snd", weights, v)
        x = x + jnp.einsum("snd,ndh->sh", out, attn["out"]["kernel"])
        h = rms_norm(x, lay["post_self_attention_layer_norm"]["scale"], eps)
        mlp = lay["mlp"]
        gate = jax.nn.silu(h @ mlp["wi_0"]["kernel"]) * (h @ mlp["wi_1"]["kernel"])
        x = x + gate @ mlp["wo"]["kernel"]
    x = rms_norm(x, decoder["decoder_norm"]["scale"], eps)
    if "logits_dense" in decoder:
        return x @ decoder["logits_dense"]["kernel"]
    return x @ params["token_embedder"]["embedding"].T


def resharded(tree, mesh):
    """Every array split over the (8,) mesh along its first dimension that 8 divides."""
    def put(a):
        spec = [None] * a.ndim
        for d, n in enumerate(a.shape):
            if n % 8 == 0:
                spec[d] = "data"
                break
        return jax.device_put(a, NamedSharding(mesh, P(*spec)))
    return jax.tree_util.tree_map(put, tree)


def main():
    args = sys.argv[1:]
    assert args and len(args) % 4 == 0, __doc__
    for at in range(0, len(args), 4):
        one(*args[at:at + 4])


def one(item, config_path, ids_path, out):
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads(pathlib.Path(config_path).read_text())
    ids = json.loads(pathlib.Path(ids_path).read_text())
    restored = ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).restore(item)
    assert set(restored) == {"params"} and set(restored["params"]) == {"params"}, restored.keys()
    params = restored["params"]["params"]
    logits = jax.jit(lambda p: forward(p, config, ids))(params)
    np.save(out / "logits.npy", np.asarray(logits, dtype=np.float32))
    mesh = Mesh(np.array(jax.devices()).reshape(8), ("data",))
    state = {"params": resharded(restored["params"], mesh),
             "step": jax.device_put(np.int32(3), NamedSharding(mesh, P()))}
    options = ocp.CheckpointManagerOptions(create=True)
    mngr = ocp.CheckpointManager(out / "ckpt", options=options,
                                 item_handlers={"items": ocp.PyTreeCheckpointHandler(
                                     use_ocdbt=True, use_zarr3=True)})
    mngr.save(0, args=ocp.args.Composite(items=ocp.args.PyTreeSave(state)))
    mngr.wait_until_finished()
    mngr.close()


if __name__ == "__main__":
    main()
