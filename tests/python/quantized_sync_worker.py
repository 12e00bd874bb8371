"""A bf16 trainer at TP 2 (processes 0, 1) into an FP8-block engine at TP 2 (processes 2, 3)
holding vLLM-shaped buffers: weight float8_e4m3fn + weight_scale_inv float32 in blocks of
128 x 128, q/k/v fused into one qkv_proj per worker, o_proj split by columns, a replicated
layer with edge blocks, and a bf16 norm that is not quantized.

Run under torchrun (4 processes, gloo):  torchrun --nproc_per_node 4 quantized_sync_worker.py OUT

Each process writes OUT/CASE/rank-R.json: the error raised (if any), its last_stats, and on the
engine's processes whether what arrived equals, byte for byte, a reference quantization of the
full bf16 tensors made here (its own FP8 rounding, from the E4M3 value table).
"""

import datetime
import json
import math
import pathlib
import sys
import traceback

import torch
import torch.distributed as dist

import reshard
import reshard.distributed as rd
from maps import piece, replicated_map, split_map
from worker_exit import leave

BLOCK = (128, 128)
TRAINERS, WORKERS = [0, 1], [2, 3]
L0 = "model.layers.0."


# -- the reference quantizer (independent of reshard's) -------------------------------------

def e4m3_table():
    """(finite non-negative E4M3 values ascending, their codes): sign 0, 4 exponent bits of
    bias 7, 3 mantissa bits; exponent 0 subnormal; code 0x7f is NaN."""
    values = []
    for code in range(0x7f):
        e, m = code >> 3, code & 7
        values.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(values, dtype=torch.float64), torch.arange(0x7f)


def round_e4m3(y):
    """float32 values (|y| < 464: x * (1 / scale) may round a little above 448) ->
    float8_e4m3fn, to nearest, ties to the even code."""
    values, codes = e4m3_table()
    a = y.abs().double().reshape(-1)
    assert float(a.max()) < 464.0
    hi = torch.searchsorted(values, a).clamp(max=len(values) - 1)
    lo = (hi - 1).clamp(min=0)
    dlo, dhi = a - values[lo], values[hi] - a
    pick = torch.where(dlo < dhi, lo, torch.where(dhi < dlo, hi,
                                                   torch.where(codes[lo] % 2 == 0, lo, hi)))
    byte = codes[pick] | torch.where(y.reshape(-1) < 0, 0x80, 0)
    return byte.to(torch.uint8).reshape(y.shape).view(torch.float8_e4m3fn)


def reference_quantize(full, block=BLOCK):
    """Per block of a 2-D tensor (128 x 128 unless told; edge blocks partial): amax in float32
    (at least 1e-4), scale = amax / 448, data = RNE(x * (1 / scale))."""
    grid = [math.ceil(s / b) for s, b in zip(full.shape, block)]
    data = torch.empty(full.shape, dtype=torch.float8_e4m3fn)
    scales = torch.empty(grid, dtype=torch.float32)
    (r, c) = block
    for i in range(grid[0]):
        for j in range(grid[1]):
            box = (slice(i * r, (i + 1) * r), slice(j * c, (j + 1) * c))
            x = full[box].float()
            scale = torch.clamp(x.abs().max(), min=1e-4) / 448.0
            scales[i, j] = scale
            data[box] = round_e4m3(x * (1.0 / scale))
    return data, scales


# -- vLLM-shaped maps -----------------------------------------------------------------------

def fused_rows(members, buffer, tp=2):
    """Tensors [(name, [rows, cols])] each split evenly by rows over tp ranks, every rank's
    slices stacked in one buffer in that order (vLLM's qkv_proj); works for scale grids too."""
    parts = [rows // tp for _, (rows, _) in members]
    cols = members[0][1][1]
    maps, row0 = {}, 0
    for (name, (rows, _)), part in zip(members, parts):
        ranks = {str(t): {"buffer": buffer, "shard_shape": [sum(parts), cols], "pieces": [
            piece([part, cols], t * part * cols, [cols, 1], row0 * cols, [cols, 1], [t])]}
            for t in range(tp)}
        maps[name] = {"logical_shape": [rows, cols], "ranks": ranks}
        row0 += part
    return maps


def shared_scale_rows(q_grid, kv_names, buffer):
    """The block image of q split by whole block rows and k, v of half a block each per rank:
    each worker's qkv_proj has 3 local block rows (q's 2, then k's 64 rows and v's 64), and
    k's and v's single scale row both land on local row 2."""
    rows, cols = q_grid[0] // 2, q_grid[1]
    maps = {L0 + "self_attn.q_proj.weight_scale_inv": {"logical_shape": list(q_grid), "ranks": {
        str(t): {"buffer": buffer, "shard_shape": [rows + 1, cols], "pieces": [
            piece([rows, cols], t * rows * cols, [cols, 1], 0, [cols, 1], [t])]}
        for t in range(2)}}}
    for name in kv_names:
        maps[name + "_scale_inv"] = {"logical_shape": [1, cols], "ranks": {
            str(t): {"buffer": buffer, "shard_shape": [rows + 1, cols], "pieces": [
                piece([1, cols], 0, [cols, 1], rows * cols, [cols, 1], [0, 1])]}
            for t in range(2)}}
    return maps


def model(kv_rows=256):
    """name -> (full shape, trainer map, engine map); scale names -> (grid, None, engine map)."""
    q, k, v = (L0 + f"self_attn.{p}_proj.weight" for p in "qkv")
    o, down, norm = L0 + "self_attn.o_proj.weight", L0 + "mlp.down_proj.weight", "model.norm.weight"
    shapes = {q: [512, 256], k: [kv_rows, 256], v: [kv_rows, 256], o: [256, 512],
              down: [200, 300], norm: [256]}
    trainer = {q: split_map(shapes[q], 0, [192, 320]),  # block row 1 split
               k: split_map(shapes[k], 0, [kv_rows // 2] * 2),
               v: split_map(shapes[v], 0, [kv_rows // 2] * 2),
               o: split_map(shapes[o], 1, [192, 320]),  # block column 1 split
               down: split_map(shapes[down], 0, [100, 100]),  # block row 0 split, edges
               norm: replicated_map([256], 2)}
    engine = {**fused_rows([(n, shapes[n]) for n in (q, k, v)], L0 + "self_attn.qkv_proj.weight"),
              o: split_map(shapes[o], 1, [256, 256]),
              o + "_scale_inv": split_map([2, 4], 1, [2, 2]),
              down: replicated_map(shapes[down], 2), down + "_scale_inv": replicated_map([2, 3], 2),
              norm: replicated_map([256], 2)}
    scale_buffer = L0 + "self_attn.qkv_proj.weight_scale_inv"
    if kv_rows >= 256:
        engine.update(fused_rows([(n + "_scale_inv", [math.ceil(shapes[n][0] / 128), 2])
                                  for n in (q, k, v)], scale_buffer))
    else:
        engine.update(shared_scale_rows([4, 2], [k, v], scale_buffer))
    return shapes, trainer, engine


def fulls(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    out = {n: (torch.randn(s, generator=g) * 0.05).to(torch.bfloat16) for n, s in shapes.items()}
    out[L0 + "mlp.down_proj.weight"][:72, 256:] = 0  # a block of zeros: scale from the floor
    return out


def extract_all(maps, tensors, rank, dtype_of):
    """Rank `rank`'s shards {name or buffer: tensor} of `tensors` under `maps`."""
    out = {}
    for name, m in maps.items():
        pm = reshard.ParamMap.from_dict(m)
        full = tensors[name]
        buffer = pm.buffer(rank)
        if buffer:
            out.setdefault(buffer, torch.zeros(pm.shard_shape(rank), dtype=dtype_of(name)))
            reshard.extract(pm, full, rank, out=out[buffer])
        else:
            out[name] = reshard.extract(pm, full, rank)
    return out


def gathered_bytes(shapes, trainer, names):
    """Bytes of split blocks that their owner (the trainer rank holding most) lacks,
    counted on index markers."""
    total = 0
    for name in names:
        shape = shapes[name]
        marker = torch.arange(math.prod(shape)).reshape(shape)
        pm = reshard.ParamMap.from_dict(trainer[name])
        held = [set(reshard.extract(pm, marker, r).reshape(-1).tolist()) for r in range(2)]
        for i in range(math.ceil(shape[0] / 128)):
            for j in range(math.ceil(shape[1] / 128)):
                block = set(marker[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
                            .reshape(-1).tolist())
                total += (len(block) - max(len(block & h) for h in held)) * 2
    return total


def same(got, want):
    return got is not None and got.dtype == want.dtype and got.shape == want.shape and \
        torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


CASES = [
    {"name": "tp2_bf16_into_tp2_fp8", "steps": 2},
    # k and v of 64 rows a worker: one local block of qkv_proj takes rows of both.
    {"name": "error_block_of_two_tensors", "kv_rows": 128},
    # o_proj's engine split at column 192: a local block takes two blocks of o_proj.
    {"name": "error_block_of_two_blocks", "o_split": [192, 320]},
    {"name": "error_integer_source", "int_on": 1},
    {"name": "error_nan", "nan_on": 1, "sentinel_out": True},
    {"name": "after_errors", "steps": 1},
]


def run_case(case, me):
    result = {"error": None, "stats": [], "mismatch": [], "untouched": None}
    shapes, trainer, engine = model(case.get("kv_rows", 256))
    o = L0 + "self_attn.o_proj.weight"
    if "o_split" in case:
        engine[o] = split_map(shapes[o], 1, case["o_split"])
    quantized = [n for n in trainer if n + "_scale_inv" in engine]
    # The same weights pushed as bf16 (no scales), planned but not moved (collective).
    plain = rd.Redistributor(trainer, {n: engine[n] for n in trainer}, source_ranks=TRAINERS,
                             target_ranks=WORKERS, dtypes=torch.bfloat16)
    if me == 0:
        result["bf16_sent"] = sum(p["sent"] for p in plain.schedule()["processes"].values())
        result["expected_gathered"] = gathered_bytes(shapes, trainer, quantized)

    def dtype_of(name):
        return torch.float32 if name.endswith("_scale_inv") else \
            torch.float8_e4m3fn if name in quantized else torch.bfloat16
    try:
        sync = rd.QuantizingRedistributor(trainer, engine, quantize={"block": list(BLOCK)},
                                          source_ranks=TRAINERS, target_ranks=WORKERS,
                                          dtypes=torch.bfloat16, bucket_bytes=1 << 16)
        for step in range(case.get("steps", 1)):
            full = fulls(shapes, 100 + step)
            shards = extract_all(trainer, full, TRAINERS.index(me), None) if me in TRAINERS else {}
            if case.get("int_on") == me:
                shards[L0 + "self_attn.q_proj.weight"] = shards[L0 + "self_attn.q_proj.weight"] \
                    .to(torch.int32)
            if case.get("nan_on") == me:
                shards[o][3, 5] = float("nan")
            want = {}
            if me in WORKERS:
                made = dict(full)
                for n in quantized:
                    made[n], made[n + "_scale_inv"] = reference_quantize(full[n])
                want = extract_all(engine, made, WORKERS.index(me), dtype_of)
            out = None
            if case.get("sentinel_out") and me in WORKERS:
                out = {n: torch.full(w.shape, 0x55, dtype=torch.uint8).view(w.dtype)
                       if w.element_size() == 1 else torch.full(
                           w.reshape(-1).view(torch.uint8).shape, 0x55, dtype=torch.uint8)
                       .view(w.dtype).view(w.shape) for n, w in want.items()}
            try:
                got = sync.run(shards, out)
            finally:
                if out is not None:
                    result["untouched"] = all(bool((t.reshape(-1).view(torch.uint8) == 0x55).all())
                                              for t in out.values())
            result["stats"].append(sync.last_stats)
            if sorted(got) != sorted(want):
                result["mismatch"].append(f"step {step}: got {sorted(got)}, want {sorted(want)}")
            result["mismatch"] += [f"step {step}: {n}" for n, w in want.items()
                                   if not same(got.get(n), w)]
    except Exception as e:  # recorded for the test to judge
        result["error"] = f"{type(e).__name__}: {e}"
        if not isinstance(e, rd.RedistributeError):
            result["traceback"] = traceback.format_exc(limit=8)
    return result


def main():
    out_dir = pathlib.Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    me = dist.get_rank()
    for case in CASES:
        result = run_case(case, me)
        case_dir = out_dir / case["name"]
        case_dir.mkdir(parents=True, exist_ok=True)
        (case_dir / f"rank-{me}.json").write_text(json.dumps(result, indent=1, default=str))
        dist.barrier()
    leave()


if __name__ == "__main__":
    main()
