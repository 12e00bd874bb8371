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
