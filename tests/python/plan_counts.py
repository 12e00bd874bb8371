"""Moves per plan between degrees for DeepSpeed's layouts, at two sizes (the counts must not
depend on the size). Run as a script to print the table in docs/plans.md."""

import functools
import sys

import reshard
from ds_partitions import column_split, fused_qkv, index_maps, row_split, yuan

PAIRS = [(8, 2), (2, 8), (4, 2), (2, 4), (8, 3), (4, 1), (1, 4)]


def layouts(scale):
    """name -> (shape, partition(tp) or None); `scale` multiplies the hidden size."""
    h = 64 * scale
    return {
        "column split (dim 0)": ((h, h), lambda tp: functools.partial(column_split, tp=tp)),
        "row split (dim 1)": ((h, h), lambda tp: functools.partial(row_split, tp=tp)),
        "GPT-BigCode fused QKV": ((h + 2 * 16, h), lambda tp: functools.partial(
            fused_qkv, tp=tp, module_name="GPTBigCodeBlock", n_embd=h, num_kv_heads=4,
            num_attention_heads=4)),
        "CodeGen fused QKV": ((3 * h, h), lambda tp: functools.partial(
            fused_qkv, tp=tp, module_name="CodeGenBlock", num_kv_heads=16, n_embd=h)
            if 16 % (4 * tp) == 0 else None),
        "Yuan value": ((8 * 8 * scale, h), lambda tp: functools.partial(
            yuan, tp=tp, num_heads=8, shard_value=True) if tp in (1, 2, 4) else None),
        "Yuan o_proj": ((h, 8 * 8 * scale), lambda tp: functools.partial(
            yuan, tp=tp, num_heads=8, shard_value=False) if tp in (1, 2, 4) else None),
    }


def moves(shape, make, a, b):
    if make(a) is None or make(b) is None:
        return None
    src = reshard.infer(index_maps(shape, make(a)))
    dst = reshard.infer(index_maps(shape, make(b)))
    return len(reshard.compose(source=src, target=dst).moves)


def table():
    small, large = layouts(1), layouts(8)
    rows = []
    for name in small:
        counts = []
        for a, b in PAIRS:
            c1 = moves(*small[name], a, b)
            c8 = moves(*large[name], a, b)
            counts.append((c1, c8))
        rows.append((name, counts))
    return rows


def markdown():
    head = "| layout | " + " | ".join(f"TP {a}→{b}" for a, b in PAIRS) + " |"
    lines = [head, "|---|" + "---|" * len(PAIRS)]
    for name, counts in table():
        cells = []
        for c1, c8 in counts:
            cells.append("—" if c1 is None else (str(c1) if c1 == c8 else f"{c1} / {c8}"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(markdown() + "\n")
