"""Shards produced by DeepSpeed's own AutoTP partition code, for any input tensor.

Each generator takes the full tensor and returns the list of per-rank shards exactly as
DeepSpeed's layers produce them: the sizes come from `get_shard_size_list` /
`get_shard_size` (head and grain alignment), the fused-QKV layouts from
`prepare_tp_fused_qkvw`, Yuan's from `shard_value_with_share_qk`. Running a generator on a
marker tensor (`arange`) gives index maps; on random data, shards to rebuild."""

import logging

import torch

logging.getLogger("DeepSpeed").setLevel(logging.ERROR)

from deepspeed.module_inject.fusedqkv_utils import (  # noqa: E402
    prepare_tp_fused_qkvw, shard_value_with_share_qk)
from deepspeed.module_inject.tp_shard import AutoTPMeta, get_shard_size_list  # noqa: E402


class _NamedModule:
    """What `get_fused_qkv_type` inspects: the module's printed name."""

    def __init__(self, name):
        self.name = name

    def __str__(self):
        return self.name


def column_split(full, tp, num_kv_heads=None, grain=1, name=None):
    """LinearLayer: output features (dim 0) split by get_shard_size_list."""
    meta = AutoTPMeta(num_kv_heads=num_kv_heads, tp_grain_size=grain)
    sizes = get_shard_size_list(full.shape[0], tp, meta, name)
    return list(full.split(sizes, dim=0))


def row_split(full, tp, num_kv_heads=None, grain=1, name=None):
    """LinearAllreduce: input features (dim 1) split by get_shard_size_list."""
    meta = AutoTPMeta(num_kv_heads=num_kv_heads, tp_grain_size=grain)
    sizes = get_shard_size_list(full.shape[1], tp, meta, name)
    return list(full.split(sizes, dim=1))


def fused_qkv(full, tp, module_name, **meta_fields):
    meta = AutoTPMeta(**meta_fields)
    return [prepare_tp_fused_qkvw(_NamedModule(module_name), full, tp, r, meta).contiguous()
            for r in range(tp)]


def yuan(full, tp, num_heads, shard_value):
    meta = AutoTPMeta(num_kv_heads=num_heads)
    return [shard_value_with_share_qk(full, None, r, tp, shard_value, meta)[0].data.contiguous()
            for r in range(tp)]


def index_maps(shape, partition):
    """The DESIGN 6.3 document for `partition` applied to a marker tensor."""
    n = 1
    for d in shape:
        n *= d
    # float64 holds every index exactly (n < 2^53) and passes for a weight where DeepSpeed
    # wraps shards in nn.Parameter.
    marker = torch.arange(n, dtype=torch.float64).reshape(shape)
    shards = partition(marker)
    return {"logical_shape": list(shape),
            "ranks": [{"rank": r, "shard_shape": list(s.shape),
                       "index_map": s.reshape(-1).to(torch.int64).tolist()}
                      for r, s in enumerate(shards)]}


def conv2d(full, tp, shard_by_oc, bias=None):
    """TensorParallelOcShardConv2d / TensorParallelIcShardConv2d: the weight's output (or
    input) channels split with the extra channels on the last ranks; the input-channel form
    holds the bias on every rank divided by the world size. Returns (weights, biases)."""
    from deepspeed.module_inject.layers import TensorParallelConv2d
    oc, ic, kh, kw = full.shape
    conv = torch.nn.Conv2d(ic, oc, (kh, kw), bias=bias is not None, dtype=full.dtype)
    weights, biases = [], []
    for r in range(tp):
        with torch.no_grad():
            conv.weight.copy_(full)
            if bias is not None:
                conv.bias.copy_(bias)
        layer = TensorParallelConv2d(conv, r, tp, shard_by_oc)
        weights.append(layer.conv.weight.data.contiguous())
        if bias is not None:
            biases.append(layer.conv.bias.data.contiguous())
    return weights, biases


def subparam_split(full, tp, subparam_sizes, name=None, **meta_fields):
    """SubParamColumnParallel layers (GateUpPack, fused q/k/v): every sub-parameter cut at
    the widths `_subparam_shard_widths` resolves, a rank's pieces concatenated."""
    from deepspeed.module_inject.layers import _partition_logical_tensor, _subparam_shard_widths
    widths = _subparam_shard_widths(subparam_sizes, tp, AutoTPMeta(**meta_fields), name)
    return [_partition_logical_tensor(full, 0, tp, r, widths, subparam_sizes=subparam_sizes).contiguous()
            for r in range(tp)], widths


class _FakeGroup:
    """Stands for a process group: the layers only ask it for the world size and the rank."""


def ds_layer(cls, module, tp, rank, **kwargs):
    """A real AutoTP layer built as rank `rank` of `tp`, without a distributed backend: the
    layer's two questions to torch.distributed are answered here. Returns the layer, whose
    parameters are that rank's shards and carry DeepSpeed's universal-checkpoint metadata."""
    import deepspeed.module_inject.layers as layers
    saved = layers.dist.get_world_size, layers.dist.get_rank
    layers.dist.get_world_size = lambda group=None: tp
    layers.dist.get_rank = lambda group=None: rank
    try:
        return cls(module, _FakeGroup(), **kwargs)
    finally:
        layers.dist.get_world_size, layers.dist.get_rank = saved
