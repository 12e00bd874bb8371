"""Param maps as plain dicts (DESIGN 6.1), built independently of the C++ library so the
cross-checks compare two implementations, and a random generator of valid maps."""

import math


def row_major(shape):
    strides = [1] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        strides[k] = strides[k + 1] * max(shape[k + 1], 1)
    return strides


def numel(shape):
    return math.prod(shape)


def piece(shape, src_off, src_strides, dst_off, dst_strides, locations, scale=1.0):
    p = {"shape": list(shape), "source": [src_off, list(src_strides)],
         "dest": [dst_off, list(dst_strides)], "locations": sorted(locations)}
    if scale != 1.0:
        p["scale"] = scale
    return p


def make_map(logical_shape, shards, valid_shape=None):
    """shards: list of (shard_shape, [pieces]) indexed by rank."""
    m = {"logical_shape": list(logical_shape),
         "ranks": {str(r): {"shard_shape": list(s), "pieces": ps} for r, (s, ps) in enumerate(shards)}}
    if valid_shape is not None:
        m["valid_shape"] = list(valid_shape)
    return m


def segmented_map(shape, dim, segments, world, scale=1.0):
    """segments: list of (size, widths or None for replicated)."""
    fs = row_major(shape)
    shards = []
    for r in range(world):
        shard = list(shape)
        shard[dim] = sum(size if w is None else w[r] for size, w in segments)
        ss = row_major(shard)
        pieces = []
        seg_start = dest = 0
        for size, widths in segments:
            start, width = seg_start, size
            if widths is not None:
                start += sum(widths[:r])
                width = widths[r]
            if width:
                pshape = list(shape)
                pshape[dim] = width
                locs = list(range(world)) if widths is None else [r]
                pieces.append(piece(pshape, start * fs[dim], fs, dest * ss[dim], ss, locs,
                                    scale if widths is None else 1.0))
            dest += width
            seg_start += size
        shards.append((shard, pieces))
    return make_map(shape, shards)


def split_map(shape, dim, sizes):
    return segmented_map(shape, dim, [(shape[dim], list(sizes))], len(sizes))


def replicated_map(shape, world, scale=1.0):
    s = row_major(shape)
    return make_map(shape, [(list(shape), [piece(shape, 0, s, 0, s, range(world), scale)])
                            for _ in range(world)])


def interleave_map(factors, rank_axis, perm, rest, world):
    """F's dim 0 is a product of `factors`; the factor at `rank_axis` (== world) picks the
    rank; a shard holds the other factors in the order `perm` (CodeGen's fused QKV is
    factors (2, 2, 3, 2), rank axis 0, perm (0, 2, 1))."""
    assert factors[rank_axis] == world
    shape = [math.prod(factors)] + list(rest)
    fstr = row_major(list(factors) + list(rest))
    others = [k for k in range(len(factors)) if k != rank_axis]
    order = [others[i] for i in perm]
    pshape = [factors[k] for k in order] + list(rest)
    src_strides = [fstr[k] for k in order] + fstr[len(factors):]
    shard = [shape[0] // world] + list(rest)
    shards = []
    for r in range(world):
        shards.append((shard, [piece(pshape, r * fstr[rank_axis], src_strides, 0,
                                     row_major(pshape), [r])]))
    return make_map(shape, shards)


def transposed_map(rows, cols, world, sizes):
    """Column split whose shards store their block transposed."""
    shards = []
    start = 0
    for r in range(world):
        c = sizes[r]
        ps = [piece([rows, c], start, [cols, 1], 0, [1, rows], [r])] if c else []
        shards.append(([c, rows], ps))
        start += c
    return make_map([rows, cols], shards)


def random_sizes(rng, extent, world):
    cuts = sorted(rng.randint(0, extent) for _ in range(world - 1))
    bounds = [0] + cuts + [extent]
    return [bounds[i + 1] - bounds[i] for i in range(world)]


def random_map(rng, allow_scale=True, allow_padding=True):
    """A random valid map and a short description of its kind."""
    world = rng.randint(1, 6)
    kind = rng.choice(["split", "segmented", "replicated", "interleave", "transposed", "padded"])
    if kind == "split":
        nd = rng.randint(1, 3)
        shape = [rng.randint(1, 9) for _ in range(nd)]
        dim = rng.randrange(nd)
        return split_map(shape, dim, random_sizes(rng, shape[dim], world)), kind
    if kind == "segmented":
        shape = [rng.randint(1, 6) for _ in range(2)]
        segs = []
        for _ in range(rng.randint(1, 3)):
            size = rng.randint(1, 8)
            segs.append((size, None if rng.random() < 0.4 else random_sizes(rng, size, world)))
        shape[0] = sum(s for s, _ in segs)
        scale = rng.choice([1.0, 0.5, 0.25]) if allow_scale else 1.0
        return segmented_map(shape, 0, segs, world, scale), kind
    if kind == "replicated":
        shape = [rng.randint(1, 7) for _ in range(rng.randint(1, 2))]
        scale = rng.choice([1.0, 1.0 / world, 2.0, 1.0 / 3.0]) if allow_scale else 1.0
        return replicated_map(shape, world, scale), kind
    if kind == "interleave":
        w = rng.randint(1, 4)
        factors = [rng.randint(1, 3) for _ in range(3)]
        axis = rng.randrange(4)
        factors.insert(axis, w)
        perm = list(range(3))
        rng.shuffle(perm)
        return interleave_map(factors, axis, perm, [rng.randint(1, 5)], w), kind
    if kind == "transposed":
        rows, cols = rng.randint(1, 6), rng.randint(1, 9)
        return transposed_map(rows, cols, world, random_sizes(rng, cols, world)), kind
    # A vocabulary padded to a multiple of the world size, split by rows.
    vocab, hidden = rng.randint(1, 20), rng.randint(1, 5)
    padded = -(-vocab // world) * world
    m = split_map([padded, hidden], 0, [padded // world] * world)
    if allow_padding:
        m["valid_shape"] = [vocab, hidden]
    return m, kind


def stacked_expert_maps(placement, members, tp=1, buffer="experts.gate_up_proj", dtype="F32"):
    """Per-expert tensors stacked into one buffer per rank (DESIGN 16), written independently of
    the library: `members` is [(name with "{e}", [rows, cols])] concatenated along rows, each
    expert's slice the TP rank's block of rows; `placement[k]` EP rank k's experts in slot order
    (an expert on several ranks is replicated there); global rank = ep_rank * tp + tp_rank.
    Returns (maps by tensor name, the buffer declarations)."""
    world = len(placement) * tp
    parts = [rows // tp for _, (rows, _) in members]
    cols = members[0][1][1]
    inner = sum(parts)
    shapes = {k * tp + t: [len(placement[k]), inner, cols]
              for k in range(len(placement)) for t in range(tp)}
    experts = sorted({e for p in placement for e in p})
    maps = {}
    row0 = 0
    for (name, (rows, _)), part in zip(members, parts):
        for e in experts:
            holders = [k for k in range(len(placement)) if e in placement[k]]
            ranks = {}
            for r in range(world):
                k, t = divmod(r, tp)
                pieces = []
                if e in placement[k]:
                    slot = placement[k].index(e)
                    pieces.append(piece([part, cols], t * part * cols, [cols, 1],
                                        (slot * inner + row0) * cols, [cols, 1],
                                        [h * tp + t for h in holders]))
                ranks[str(r)] = {"buffer": buffer, "shard_shape": shapes[r], "pieces": pieces}
            maps[name.format(e=e)] = {"logical_shape": [rows, cols], "ranks": ranks}
        row0 += part
    decls = {buffer: {"dtype": dtype, "ranks": {str(r): {"shape": s} for r, s in shapes.items()}}}
    return maps, decls
