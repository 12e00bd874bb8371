"""reshard.torch: param maps from DTensors' meshes and placements, checked against torch's own
sharding (its placements' splits and compute_local_shape_and_global_offset), and on a live FSDP2
over tensor-parallel model (torch_maps_worker.py under torchrun, gloo)."""

import contextlib
import itertools
import json
import os
import pathlib
import subprocess
import sys
import types

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import Partial, Replicate, Shard  # noqa: E402
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402

import reshard  # noqa: E402
import reshard.torch as rt  # noqa: E402
from conftest import BUILD  # noqa: E402
from ds_checkpoints import free_loopback_port  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent


def torch_local(full, mesh_shape, coord, placements, order=None):
    """What torch's placements give the rank at ``coord`` when each cuts by its own split
    (``_split_tensor``, no padding), in mesh-dim order or in ``order`` (mesh dims)."""
    local = full
    for m in order if order is not None else range(len(placements)):
        p = placements[m]
        if isinstance(p, (Shard, _StridedShard)):
            local = p._split_tensor(local, mesh_shape[m], with_padding=False)[0][coord[m]]
    return local


@contextlib.contextmanager
def simulated(world):
    """A world of ``world`` ranks simulated in this process (torch's fake process group and
    LocalTensorMode: every rank's local tensor held at once)."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        with LocalTensorMode(world):
            yield
    finally:
        dist.destroy_process_group()


def decodable(placements, mesh_shape):
    """Whether torch reads these placements' split factors as an order of cuts."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    mesh = types.SimpleNamespace(size=lambda i: mesh_shape[i])
    return DTensorSpec._maybe_convert_StridedShard_to_shard_order(tuple(placements),
                                                                  mesh) is not None


def check_against_torch(shape, mesh_shape, placements, ranks=None):
    """The map of ``placements`` over a mesh of ``ranks`` (global ranks shaped mesh_shape;
    default in order) is valid and canonical, and torch agrees with what it gives each rank:
    torch's redistribution rebuilds F from the extracted shards (DTensor.from_local, then
    full_tensor; where it cannot read _StridedShard as an order, each cuts by its own split), and
    without _StridedShard each rank extracts exactly the local tensor distribute_tensor gives
    it, of torch's local shape and first offset. On a mesh of shuffled ranks (which torch's simulated world does not
    take) the map gives each mesh position what it gives the same position in order."""
    from torch.distributed._local_tensor import LocalTensor
    from torch.distributed.tensor import DeviceMesh, DTensor, distribute_tensor
    in_order = torch.arange(int(torch.Size(mesh_shape).numel())).reshape(mesh_shape)
    world = in_order.numel()
    full = torch.arange(int(torch.Size(shape).numel()), dtype=torch.float32).reshape(shape)
    if ranks is not None:
        shuffled = rt.layout_map(shape, ranks, placements, name="w")
        shuffled.validate()
        assert shuffled == shuffled.canonical()
        plain = rt.layout_map(shape, in_order, placements, name="w")
        for coord in itertools.product(*(range(n) for n in mesh_shape)):
            assert torch.equal(reshard.extract(shuffled, full, int(ranks[coord])),
                               reshard.extract(plain, full, int(in_order[coord])))
    ranks = in_order
    m = rt.layout_map(shape, ranks, placements, name="w")
    m.validate()
    assert m == m.canonical()
    assert m.world_size == world and m.logical_shape == tuple(shape)
    shards = {r: reshard.extract(m, full, r) for r in range(world)}
    strided = any(isinstance(p, _StridedShard) for p in placements)
    with simulated(world):
        mesh = DeviceMesh("cpu", ranks)
        if not strided or decodable(placements, mesh_shape):
            dt = DTensor.from_local(LocalTensor(shards), mesh, placements, shape=full.shape,
                                    stride=full.stride(), run_check=False)
            rebuilt = dt.full_tensor()
            rebuilt = (rebuilt._local_tensors.values() if isinstance(rebuilt, LocalTensor) else
                       [rebuilt])
            assert all(torch.equal(t, full) for t in rebuilt), (shape, placements)
        laid = None
        if not strided:  # (the simulated world scatters _StridedShard's pieces wrongly)
            try:
                local = distribute_tensor(full, mesh, placements).to_local()
                # (a tensor the same on every rank may come back as one plain tensor)
                laid = (local._local_tensors if isinstance(local, LocalTensor) else
                        dict.fromkeys(range(world), local))
            except AssertionError:  # torch cuts one dim over two mesh dims evenly only
                assert len({p.dim for p in placements if isinstance(p, Shard)}) < \
                    sum(isinstance(p, Shard) for p in placements)
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        rank = int(ranks[coord])
        if laid is not None:
            assert torch.equal(shards[rank], laid[rank]), (coord, shape, placements)
        if not strided:
            local_shape, offset = _compute_local_shape_and_global_offset(
                shape, mesh_shape, list(coord), placements)
            assert tuple(shards[rank].shape) == tuple(local_shape), (coord, placements)
            for d, runs in enumerate(rt.regions(shape, mesh_shape, placements)[coord]):
                if runs:  # where the rank holds rows of dim d, torch's offset is the first
                    assert runs[0][0] == offset[d], (coord, placements, d)
        elif not decodable(placements, mesh_shape):  # each _StridedShard cuts by its split
            assert torch.equal(shards[rank], torch_local(full, mesh_shape, coord, placements))
    assert torch.equal(reshard.rebuild(m, [shards[r] for r in range(world)]), full)
    return m


def random_placement(rng, ndim):
    k = rng.random()
    if k < 0.25 or ndim == 0:
        return Replicate()
    if k < 0.65:
        return Shard(rng.randrange(ndim))
    return _StridedShard(rng.randrange(ndim), split_factor=rng.choice([1, 2, 2, 3, 4, 6]))


def ordered_placements(rng, ndim, mesh_shape):
    """Shard / Replicate placements cut in a random order of their mesh dims, as torch encodes
    that order (_StridedShard where a mesh dim cuts after one to its right: FSDP2 over TP)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry
    placements = [Shard(rng.randrange(ndim)) if rng.random() < 0.8 else Replicate()
                  for _ in mesh_shape]
    order = []
    for d in range(ndim):
        dims = [m for m, p in enumerate(placements) if isinstance(p, Shard) and p.dim == d]
        rng.shuffle(dims)
        if dims:
            order.append(ShardOrderEntry(tensor_dim=d, mesh_dims=tuple(dims)))
    mesh = types.SimpleNamespace(size=lambda i: mesh_shape[i])
    return list(DTensorSpec._convert_shard_order_to_StridedShard(tuple(order),
                                                                  tuple(placements), mesh))


def test_random_layouts_match_torch(rng):
    """Random shapes (empty dims included) x meshes of 1 to 3 dims x placements (any, or cut in
    a random order as torch encodes it), on meshes whose ranks are a shuffle of the world's."""
    for trial in range(80):
        ndim = rng.randint(0, 3)
        shape = [rng.randint(0, 9) for _ in range(ndim)]
        mesh_shape = [rng.randint(1, 3) for _ in range(rng.randint(1, 3))]
        if ndim and trial % 2:
            placements = ordered_placements(rng, ndim, mesh_shape)
        else:
            placements = [random_placement(rng, ndim) for _ in mesh_shape]
        size = 1
        for n in mesh_shape:
            size *= n
        order = list(range(size))
        rng.shuffle(order)
        ranks = torch.tensor(order).reshape(mesh_shape)
        check_against_torch(shape, mesh_shape, placements, ranks)


def test_uneven_chunks_leave_the_last_ranks_short_or_empty():
    m = check_against_torch([5, 3], [4], [Shard(0)], torch.arange(4))
    assert [m.shard_shape(r) for r in range(4)] == [(2, 3), (2, 3), (1, 3), (0, 3)]
    assert m.pieces(3) == []
    assert [len(m.pieces(r)) for r in range(3)] == [1, 1, 1]


def test_replicate_makes_one_piece_with_every_holder():
    ranks = torch.tensor([[0, 1], [2, 3]])
    m = check_against_torch([6, 4], [2, 2], [Replicate(), Shard(1)], ranks)
    assert m.pieces(0)[0].locations == (0, 2)
    assert m.pieces(3)[0].locations == (1, 3)
    assert m.pieces(3)[0].source == (2, (4, 1))


def test_two_mesh_dims_on_one_tensor_dim_go_first_to_last():
    ranks = torch.tensor([[0, 1], [2, 3]])
    m = check_against_torch([8, 2], [2, 2], [Shard(0), Shard(0)], ranks)
    assert [m.pieces(r)[0].source[0] for r in range(4)] == [0, 4, 8, 12]


def test_strided_shard_is_fsdp2_over_tp():
    """torch's own example: (_StridedShard(0, split_factor=2), Shard(0)) on a (dp, tp) mesh gives
    rows 0-1, 4-5, 2-3, 6-7 to ranks 0..3, each one piece."""
    ranks = torch.tensor([[0, 1], [2, 3]])
    m = check_against_torch([8, 3], [2, 2], [_StridedShard(0, split_factor=2), Shard(0)], ranks)
    assert [m.pieces(r)[0].source[0] // 3 for r in range(4)] == [0, 4, 2, 6]
    assert all(len(m.pieces(r)) == 1 for r in range(4))


def test_strided_shard_follows_fsdp2_data_where_chunks_are_uneven():
    """FSDP2 over TP on a (dp 3, tp 2) mesh, 7 rows: TP cuts 4 + 3, FSDP2 cuts each over dp
    (2, 2, 0 and 1, 1, 1), so rank 4 (dp 2, tp 0) holds nothing and rank 5 row 6, as FSDP2
    holds the data (torch's compute_local_shape_and_global_offset says the opposite)."""
    placements = [_StridedShard(0, split_factor=2), Shard(0)]
    m = check_against_torch([7, 2], [3, 2], placements)
    assert [m.shard_shape(r)[0] for r in range(6)] == [2, 1, 2, 1, 0, 1]
    assert m.pieces(5)[0].source[0] == 6 * 2
    assert _compute_local_shape_and_global_offset([7, 2], [3, 2], [2, 0], placements)[0] == (1, 2)


def test_every_order_of_mesh_dims_over_one_tensor_dim_is_read_as_torch_reads_it():
    """Two and three mesh dims cutting one tensor dim in every order, encoded by torch
    (_StridedShard) and read back: each rank's rows are the nested chunks (torch's Shard split)
    in that order, for every row count (uneven ones where FSDP2's data and torch's local-shape
    function part ways); on two mesh dims torch's redistribution rebuilds F from them too."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry
    for mesh_shape in [(2, 3), (3, 2), (3, 3), (2, 2, 3), (3, 2, 2)]:
        mesh = types.SimpleNamespace(size=lambda i, shape=mesh_shape: shape[i])
        for order in itertools.permutations(range(len(mesh_shape))):
            entry = (ShardOrderEntry(tensor_dim=0, mesh_dims=order),)
            placements = DTensorSpec._convert_shard_order_to_StridedShard(
                entry, (Shard(0),) * len(mesh_shape), mesh)
            for rows in range(14):
                full = torch.arange(rows * 2).reshape(rows, 2)
                got = rt.regions([rows, 2], mesh_shape, placements)
                for coord, region in got.items():
                    want = torch_local(full, mesh_shape, coord, [Shard(0)] * len(mesh_shape),
                                       order=order)
                    held = [g + i for g, n in region[0] for i in range(n)]
                    assert torch.equal(full[held], want), (mesh_shape, order, rows, coord)
                if len(mesh_shape) == 2 and rows < 10:
                    check_against_torch([rows, 2], list(mesh_shape), list(placements))


def test_a_spec_that_does_not_read_split_factors_as_an_order_cuts_by_each_split():
    """use_strided_shard_as_shard_order=False (torch's view propagation): each _StridedShard
    cuts its dim into split_factor parts and each part over its mesh dim, first mesh dim
    first."""
    spec = types.SimpleNamespace(use_strided_shard_as_shard_order=False, shard_order=None)
    placements = [_StridedShard(0, split_factor=2), Shard(0)]
    got = rt.regions([7, 2], [3, 2], placements, spec=spec)
    full = torch.arange(14).reshape(7, 2)
    for coord, region in got.items():
        rows = [g + i for g, n in region[0] for i in range(n)]
        assert torch.equal(full[rows], torch_local(full, [3, 2], coord, placements)), coord
    assert got[(2, 0)] == (((6, 1),), ((0, 2),)) != rt.regions([7, 2], [3, 2], placements)[(2, 0)]


def test_strided_shard_alone_holds_one_chunk_of_each_part():
    m = check_against_torch([12], [2], [_StridedShard(0, split_factor=3)], torch.arange(2))
    assert m.shard_shape(0) == (6,)
    # rank 0: [0, 1], [4, 5], [8, 9]: one folded piece of 3 runs of 2
    assert len(m.pieces(0)) == 1 and m.pieces(0)[0].shape == (3, 2)


def test_a_recorded_shard_order_is_followed():
    """A spec whose shard_order applies mesh dim 1 before mesh dim 0 on tensor dim 0."""
    entry = types.SimpleNamespace(tensor_dim=0, mesh_dims=(1, 0))
    spec = types.SimpleNamespace(shard_order=(entry,), use_strided_shard_as_shard_order=False)
    placements = [Shard(0), Shard(0)]
    got = rt.regions([7, 2], [2, 2], placements, spec=spec)
    full = torch.arange(14).reshape(7, 2)
    for coord, region in got.items():
        want = torch_local(full, [2, 2], coord, placements, order=[1, 0])
        rows = [g + i for g, n in region[0] for i in range(n)]
        assert torch.equal(full[rows], want), coord
    assert got[(1, 0)] != rt.regions([7, 2], [2, 2], placements)[(1, 0)]


def test_partial_is_refused_naming_the_tensor():
    with pytest.raises(reshard.LayoutError, match=r'tensor "layers.0.w".*Partial'):
        rt.layout_map([4, 4], [[0, 1], [2, 3]], [Shard(0), Partial()], name="layers.0.w")
    assert issubclass(reshard.LayoutError, ValueError)


def test_placements_that_do_not_fit_are_refused():
    with pytest.raises(reshard.LayoutError, match=r"Shard\(dim=2\).*2-dimensional"):
        rt.layout_map([4, 4], [0, 1], [Shard(2)], name="w")
    with pytest.raises(reshard.LayoutError, match="1 placements"):
        rt.layout_map([4, 4], [[0, 1]], [Shard(0)], name="w")
    with pytest.raises(reshard.LayoutError, match=r"names a rank twice"):
        rt.layout_map([4, 4], [[0, 1], [1, 0]], [Shard(0), Shard(1)], name="w")
    with pytest.raises(reshard.LayoutError, match=r'"w" is held by processes \[3\]'):
        rt.layout_map([4, 4], [2, 3], [Shard(0)], name="w", ranks=[0, 1, 2])


def test_plain_tensors_are_whole_on_every_rank():
    maps = rt.maps_of({"inv_freq": torch.arange(5.0), "step": 3, "scalar": torch.tensor(2.0)},
                      ranks=[0, 1, 2])
    assert sorted(maps) == ["inv_freq", "scalar"]  # entries that are not tensors are left out
    m = maps["inv_freq"]
    assert m.world_size == 3 and all(m.pieces(r)[0].locations == (0, 1, 2) for r in range(3))
    assert torch.equal(reshard.extract(maps["scalar"], torch.tensor(2.0), 1), torch.tensor(2.0))
    # Without torch.distributed and without ranks=, the world is the one process.
    assert rt.maps_of(torch.nn.Linear(3, 2))["weight"].world_size == 1
    with pytest.raises(TypeError, match="state dict"):
        rt.maps_of([torch.zeros(2)])


def test_merged_views_find_every_holder():
    """A tensor-parallel group inside each of two data-parallel replicas: each process sees its
    own submesh; the merge makes ranks 0 and 2 (and 1 and 3) hold the same rows."""
    def view(ranks):
        return {"w": ((4, 3), rt._by_rank((4, 3), ranks, [Shard(0)], "w"), "float32")}
    views = [view([0, 1]), view([0, 1]), view([2, 3]), view([2, 3])]
    merged = rt._merge(views, [0, 1, 2, 3])
    m = rt._build("w", merged["w"], [0, 1, 2, 3])
    assert [m.pieces(r)[0].locations for r in range(4)] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    full = torch.randn(4, 3)
    assert torch.equal(reshard.rebuild(m, [reshard.extract(m, full, r) for r in range(4)]), full)
    other = {"w": ((4, 3), rt._by_rank((4, 3), [2, 3], [Shard(1)], "w"), "float32")}
    with pytest.raises(reshard.LayoutError, match=r'"w": process 3 says rank 2 holds'):
        rt._merge([view([2, 3]), other], [0, 3])
    with pytest.raises(reshard.LayoutError, match=r"\[4, 3\] float32 on process 0 but \[4, 3\] "
                                                  r"bfloat16 on process 1"):
        rt._merge([view([0, 1]), {"w": ((4, 3), {}, "bfloat16")}], [0, 1])


def launch(tmp, world):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BUILD / "python"), str(HERE)]),
               OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                        str(world), "--master_addr", "127.0.0.1", "--master_port",
                        str(free_loopback_port()), str(HERE / "torch_maps_worker.py"), str(tmp)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    ranks = [json.loads((tmp / f"rank-{p}.json").read_text()) for p in range(world)]
    for p, result in enumerate(ranks):
        assert not result["errors"], f"process {p}: {result['errors'][0]}"
    return ranks


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("torch_maps"), 4)


def check_every_rank(live):
    world = len(live)
    for p, result in enumerate(live):
        assert result["merged_same_everywhere"], p
        for name, info in result["params"].items():
            where = f"process {p}, {name}"
            assert info["own_canonical"] and info["own_extract"], where
            assert info["merged_canonical"] and info["merged_world"] == world, where
            assert info["merged_extract"] == [True] * world, where
            assert info["merged_rebuild"], where


def test_fsdp2_over_tp_maps_hold_what_each_rank_holds(live):
    params = live[0]["params"]
    # the layouts the test is about are there: FSDP2 over TP, TP alone is not left, and FSDP2's
    # own sharding of the norms on the dp submesh
    placements = {n: p["placements"] for n, p in params.items()}
    assert placements["layers.0.q_proj.weight"] == ["_S(0, 2)", "S(0)"]
    assert placements["layers.0.o_proj.weight"] == ["S(0)", "S(1)"]
    assert placements["layers.0.norm"] == ["S(0)"]
    assert placements["inv_freq"] == "plain"
    check_every_rank(live)


def test_fsdp2_over_tp_on_three_by_two_follows_fsdp2s_data(tmp_path):
    """On a (3, 2) mesh the vocabulary's rows (13: TP cuts 7 + 6, each part cut over dp) are
    where FSDP2 holds them, not where torch's local-shape function puts them."""
    live = launch(tmp_path, 6)
    check_every_rank(live)
    assert [r["params"]["lm_head.weight"]["local_shape"][0] for r in live] == [3, 2, 3, 2, 1, 2]
    # and a Redistributor from it (single elements of the uneven biases travel too)
    assert live[2]["redistributed"] == [True, True] and live[3]["redistributed"] == [True, True]
    assert live[0]["source_ranks"] == list(range(6))


def test_fsdp2_over_tp_uneven_rows_are_one_piece_per_rank(live):
    # 10 rows at tp 2 are 5 per rank, cut 3 + 2 by fsdp: each rank one box of rows
    shapes = [r["params"]["layers.0.q_proj.weight"]["local_shape"] for r in live]
    assert shapes == [[3, 10], [3, 10], [2, 10], [2, 10]]
    assert live[0]["params"]["layers.0.q_proj.weight"]["pieces"] == [1, 1, 1, 1]
    assert live[0]["params"]["layers.0.q_proj.weight"]["locations"][2] == [[2]]


def test_fsdp2_norms_on_the_dp_submesh_are_merged_across_it(live):
    """FSDP2 shards a norm over the dp submesh of each tp rank: one process's own map names
    that submesh only; merged, both tp ranks hold each dp chunk."""
    assert [r["params"]["layers.0.norm"]["own_holders"] for r in live] == \
        [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert live[0]["params"]["layers.0.norm"]["locations"] == [[[0, 1]], [[0, 1]], [[2, 3]],
                                                               [[2, 3]]]
    # a plain buffer: whole on every rank
    assert live[0]["params"]["inv_freq"]["locations"][3] == [[0, 1, 2, 3]]


def test_a_partial_dtensor_is_refused_naming_it(live):
    assert 'tensor "o_proj.partial"' in live[1]["partial_refused"]
    assert "Partial" in live[1]["partial_refused"]
    messages = [r["partial_refused_by_redistributor"] for r in live]
    assert all(m == messages[0] for m in messages)
    assert 'process 1: tensor "o_proj.partial"' in messages[0]


def test_redistributor_takes_the_model_as_it_lies(live):
    assert live[0]["source_ranks"] == [0, 1, 2, 3]
    assert live[2]["redistributed"] == [True, True] and live[3]["redistributed"] == [True, True]
    assert live[0]["redistributed"] == []


def test_processes_holding_nothing_pass_an_empty_source(live):
    assert [r["pair_source_ranks"] for r in live] == [[0, 1]] * 4
    assert [r["pair_moved"] for r in live] == [True] * 4
