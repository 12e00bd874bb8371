"""Pieces per rank that reshard infers for DeepSpeed's layouts, next to the pieces per rank
of DeepSpeed's own affine description of the same layout (deepspeed.checkpoint.affine)
where it has one. Run as a script to print the table in docs/inference.md."""

import functools
import sys

from deepspeed.checkpoint import affine
from deepspeed.module_inject.fusedqkv_utils import codegen_block_layout, shared_qk_value_head_ids

import reshard
from ds_partitions import column_split, fused_qkv, index_maps, row_split, yuan


def ours(shape, partition):
    m = reshard.infer(index_maps(shape, partition)).to_dict()
    return max(len(r["pieces"]) for r in m["ranks"].values())


def theirs(ds_map):
    return max(len(p) for p in ds_map.pieces_by_rank.values())


def rows():
    """(layout, shape, tp, ours, deepspeed's or None)."""
    out = []
    for shape, tp in [((16, 4), 2), ((10, 4), 4)]:
        sizes = [len(s) for s in column_split(__import__("torch").zeros(shape), tp)]
        out.append(("column split (dim 0)", shape, tp, ours(shape, functools.partial(column_split, tp=tp)),
                    theirs(affine.contiguous_split_map(shape, sizes, 0))))
    for shape, tp in [((4, 16), 2), ((4, 10), 4)]:
        sizes = [s.shape[1] for s in row_split(__import__("torch").zeros(shape), tp)]
        out.append(("row split (dim 1)", shape, tp, ours(shape, functools.partial(row_split, tp=tp)),
                    theirs(affine.contiguous_split_map(shape, sizes, 1))))
    for tp in (2, 4):
        shape = (48, 8)
        q = [32 // tp] * tp
        out.append(("GPT-BigCode fused QKV (multi-query)", shape, tp,
                    ours(shape, functools.partial(fused_qkv, tp=tp, module_name="GPTBigCodeBlock",
                                                  n_embd=32, num_kv_heads=4, num_attention_heads=4)),
                    theirs(affine.segmented_map(shape, [(32, False), (16, True)], 0, tp, [q]))))
    for hidden, tp, kv in [(8, 2, 8), (16, 2, 8), (64, 2, 16), (64, 4, 16)]:
        shape = (3 * hidden, 8)
        layout = codegen_block_layout(shape[0], tp, kv)
        ds = theirs(affine.block_gather_map(shape, layout[1], layout[0], 0)) if layout else None
        out.append(("CodeGen fused QKV", shape, tp,
                    ours(shape, functools.partial(fused_qkv, tp=tp, module_name="CodeGenBlock",
                                                  num_kv_heads=kv, n_embd=hidden)), ds))
    for tp in (2, 4):
        heads, head_dim = 8, 4
        blocks = {r: shared_qk_value_head_ids(heads, tp, r) for r in range(tp)}
        shape = (heads * head_dim, 8)
        out.append(("Yuan shared-QK value", shape, tp,
                    ours(shape, functools.partial(yuan, tp=tp, num_heads=heads, shard_value=True)),
                    theirs(affine.block_gather_map(shape, blocks, head_dim, 0))))
        shape = (8, heads * head_dim)
        out.append(("Yuan shared-QK o_proj", shape, tp,
                    ours(shape, functools.partial(yuan, tp=tp, num_heads=heads, shard_value=False)),
                    theirs(affine.block_gather_map(shape, blocks, head_dim, 1))))
    for tp in (2, 4):
        shape = (48, 8)
        w = [16 // tp] * tp
        out.append(("GLM/Qwen fused QKV (q, k, v split)", shape, tp,
                    ours(shape, functools.partial(fused_qkv, tp=tp, module_name="GLMBlock", num_kv_heads=8)),
                    theirs(affine.sub_param_map(shape, [16, 16, 16], [w, w, w], 0))))
    return out


def markdown():
    lines = ["| layout | F | TP | reshard pieces/rank | DeepSpeed's description |",
             "|---|---|---|---|---|"]
    for layout, shape, tp, o, t in rows():
        lines.append(f"| {layout} | {'×'.join(map(str, shape))} | {tp} | {o} | {t if t is not None else '—'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(markdown() + "\n")
