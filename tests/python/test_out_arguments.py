"""What reshard.extract / rebuild / transfer do with an `out=` that cannot simply be written:
one that overlaps an input (results must be those without the overlap), outputs that overlap
each other or themselves (refused), read-only memory and tensors autograd or torch's sign bits
forbid writing (refused, with the memory untouched). Each table runs for numpy and torch.
Inputs with torch's negative bit are read as their values."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import reshard
from conftest import BUILD
from maps import make_map, piece, split_map

torch = pytest.importorskip("torch")

KINDS = ["numpy", "torch"]


def transpose_map(n):
    """World 1: the shard is F ([n, n]) transposed."""
    return make_map([n, n], [([n, n], [piece([n, n], 0, [n, 1], 0, [1, n], [0])])])


def arange(kind, shape, dtype=np.float32):
    a = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape) + 1
    return a if kind == "numpy" else torch.from_numpy(a.copy())


def as_np(x):
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


# -- out overlapping an input: staged, so the result is as without the overlap --------------

@pytest.mark.parametrize("kind", KINDS)
def test_extract_into_a_view_of_its_own_input(kind):
    full = arange(kind, [5, 5])
    want = as_np(full).T.copy()
    got = reshard.extract(transpose_map(5), full, 0, out=full[:])  # a view of full's memory
    np.testing.assert_array_equal(as_np(got), want)
    np.testing.assert_array_equal(as_np(full), want)  # written in place


@pytest.mark.parametrize("kind", KINDS)
def test_rebuild_into_its_own_shard(kind):
    shard = arange(kind, [4, 4])
    want = as_np(shard).T.copy()
    got = reshard.rebuild(transpose_map(4), [shard], out=shard)
    np.testing.assert_array_equal(as_np(got), want)


@pytest.mark.parametrize("kind", KINDS)
def test_transfer_out_over_its_source_shards(kind):
    # Rows of a [4, 6] split in two -> the same two shards' memory as columns of width 3.
    src, dst = split_map([4, 6], 0, [2, 2]), split_map([4, 6], 1, [3, 3])
    full = arange(kind, [4, 6])
    shards = [reshard.extract(src, full, r) for r in range(2)]
    want = [as_np(reshard.extract(dst, full, r)).copy() for r in range(2)]
    plan = reshard.compose(source=src, target=dst)
    # Target shard r ([4, 3]) over source shards' memory: both source shards together hold
    # 24 elements; view them as one buffer and give its halves, crosswise, as the outputs.
    buf = np.concatenate([as_np(s).ravel() for s in shards]) if kind == "numpy" else \
        torch.cat([s.reshape(-1) for s in shards])
    sources = [buf[:12].reshape(2, 6), buf[12:].reshape(2, 6)]
    outs = [buf[12:].reshape(4, 3), buf[:12].reshape(4, 3)]
    got = reshard.transfer(plan, sources, out=outs)
    for r in range(2):
        np.testing.assert_array_equal(as_np(got[r]), want[r])


@pytest.mark.parametrize("kind", KINDS)
def test_outputs_that_overlap_each_other_are_refused(kind):
    src, dst = split_map([4, 6], 0, [2, 2]), split_map([4, 6], 0, [2, 2])
    full = arange(kind, [4, 6])
    shards = [reshard.extract(src, full, r) for r in range(2)]
    same = arange(kind, [2, 6]) * 0
    with pytest.raises(ValueError, match=r"out\[1\] and out\[0\] overlap in memory"):
        reshard.transfer(reshard.compose(source=src, target=dst), shards, out=[same, same])


def expanded(kind, shape):
    """A writable output whose rows share memory (stride 0)."""
    if kind == "numpy":
        row = np.zeros(shape[-1], np.float32)
        return np.lib.stride_tricks.as_strided(row, shape, (0, row.strides[0]), writeable=True)
    return torch.zeros(shape[-1]).expand(shape)


def overlapping_strides(kind, shape):
    """A writable [2, 3] output whose rows overlap by one element (strides 2, 1)."""
    if kind == "numpy":
        base = np.zeros(8, np.float32)
        return np.lib.stride_tricks.as_strided(base, shape, (8, 4), writeable=True)
    return torch.zeros(8).as_strided(shape, (2, 1))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("make", [expanded, overlapping_strides])
@pytest.mark.parametrize("op", ["extract", "rebuild", "transfer"])
def test_outputs_whose_elements_share_memory_are_refused(kind, make, op):
    m = split_map([2, 3], 0, [1, 1])
    full = arange(kind, [2, 3])
    shards = [reshard.extract(m, full, r) for r in range(2)]
    with pytest.raises(ValueError, match="share memory"):
        if op == "extract":
            reshard.extract(split_map([2, 3], 0, [2]), full, 0, out=make(kind, [2, 3]))
        elif op == "rebuild":
            reshard.rebuild(m, shards, out=make(kind, [2, 3]))
        else:
            plan = reshard.compose(source=m, target=split_map([2, 3], 0, [2]))
            reshard.transfer(plan, shards, out=[make(kind, [2, 3])])


# -- read-only memory and tensors that must not be written -----------------------------------

def readonly_memmap(kind, path):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    a.tofile(path)
    return np.memmap(path, mode="r", dtype=np.float32, shape=(2, 3))


def immutable_bytes(kind, path):
    data = np.arange(6, dtype=np.float32).tobytes()
    if kind == "numpy":
        return np.frombuffer(data, np.float32).reshape(2, 3)
    return torch.frombuffer(data, dtype=torch.float32).reshape(2, 3)


def requires_grad(kind, path):
    return torch.zeros(2, 3, requires_grad=True)


def negative_bit(kind, path):
    return torch._neg_view(torch.zeros(2, 3))


# (kind, how the out is made, a part of the message). A torch tensor over a read-only memory
# map has its own test below: before, writing it killed the interpreter.
BAD = [
    ("numpy", readonly_memmap, "read-only"),
    ("numpy", immutable_bytes, "read-only"),
    ("torch", immutable_bytes, "read-only"),
    ("torch", requires_grad, "requires grad"),
    ("torch", negative_bit, "negative bit"),
]


def snapshot(x):
    if isinstance(x, torch.Tensor):
        return x.detach().resolve_neg().clone().numpy()
    return np.array(x, copy=True)


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch warns of non-writable sources
@pytest.mark.parametrize("kind, make, message", BAD,
                         ids=[f"{k}-{f.__name__}" for k, f, _ in BAD])
def test_outputs_that_must_not_be_written_are_refused(kind, make, message, tmp_path):
    m = split_map([2, 3], 0, [2])
    full = arange(kind, [2, 3]) * 10
    out = make(kind, tmp_path / "ro.bin")
    before = snapshot(out)
    with pytest.raises(ValueError, match=message):
        reshard.extract(m, full, 0, out=out)
    with pytest.raises(ValueError, match=message):
        reshard.rebuild(m, [full], out=out)
    np.testing.assert_array_equal(snapshot(out), before)


def test_a_torch_out_over_a_read_only_memory_map_does_not_crash(tmp_path):
    # Before, the write faulted and killed the interpreter: run it in a child process.
    script = textwrap.dedent(f"""
        import sys, warnings
        sys.path.insert(0, {str(BUILD / "python")!r})
        import numpy as np, torch, reshard
        warnings.simplefilter("ignore")
        np.zeros(6, np.float32).tofile({str(tmp_path / "ro.bin")!r})
        out = torch.from_numpy(np.memmap({str(tmp_path / "ro.bin")!r}, mode="r",
                                         dtype=np.float32, shape=(2, 3)))
        try:
            reshard.extract({split_map([2, 3], 0, [2])!r}, torch.ones(2, 3), 0, out=out)
        except ValueError as e:
            print("refused:", e)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "refused:" in r.stdout and "read-only" in r.stdout, r.stdout


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_writable_torch_outputs_not_allocated_by_torch_are_written(tmp_path):
    m = split_map([2, 3], 0, [2])
    full = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    array = np.zeros((2, 3), np.float32)
    buffer = bytearray(24)
    torch.save({"x": torch.zeros(2, 3)}, tmp_path / "x.pt")
    for out in (torch.from_numpy(array), torch.frombuffer(buffer, dtype=torch.float32).view(2, 3),
                torch.load(tmp_path / "x.pt")["x"]):
        reshard.extract(m, full, 0, out=out)
        assert torch.equal(out, full)
    assert np.array_equal(array, full.numpy())
    assert bytes(buffer) == full.numpy().tobytes()


def test_a_leaf_requiring_grad_is_written_under_no_grad():
    out = torch.zeros(2, 3, requires_grad=True)
    full = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    with torch.no_grad():  # as an optimizer step updates parameters
        reshard.extract(split_map([2, 3], 0, [2]), full, 0, out=out)
    assert torch.equal(out.detach(), full)


# -- torch's negative bit on inputs: read as the values -------------------------------------

def test_inputs_with_the_negative_bit_are_read_as_their_values():
    m, dst = split_map([4, 6], 0, [2, 2]), split_map([4, 6], 1, [3, 3])
    values = torch.arange(24, dtype=torch.float32).reshape(4, 6) + 1
    full = torch._neg_view(-values)  # its values are `values`; its memory holds -values
    assert full.is_neg()
    shards = [reshard.extract(m, full, r) for r in range(2)]
    for r in range(2):
        assert torch.equal(shards[r], values[2 * r:2 * r + 2])
    neg_shards = [torch._neg_view(-s) for s in shards]
    assert torch.equal(reshard.rebuild(m, neg_shards), values)
    got = reshard.transfer(reshard.compose(source=m, target=dst), neg_shards)
    assert torch.equal(got[0], values[:, :3]) and torch.equal(got[1], values[:, 3:])
