"""labkit.parallel.Mesh on real gloo processes, and mesh_layout against torch's DeviceMesh: every axis's group
holds the ranks the layout says (tp innermost), collectives over a mesh group reduce exactly those ranks, and bad
sizes or axis names are refused on every rank instead of hanging."""

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import labkit
from labkit.comm import ring_allreduce
from labkit.parallel import AXES, Mesh, mesh_layout

SHAPES = [(2, 1, 2), (1, 2, 2), (2, 2, 1)]  # (dp, pp, tp) on 4 ranks: every axis of size 2 next to one of size 1


def what_the_mesh_says(shapes):
    """For each shape: this rank's coordinate, sizes, rank in each group, the group's ranks (from labkit and
    from torch's DeviceMesh) and the sum of the global ranks all-reduced over it."""
    found = []
    for dp, pp, tp in shapes:
        mesh = Mesh(dp=dp, pp=pp, tp=tp)
        axes = {}
        for axis in AXES:
            total = torch.tensor([labkit.rank()], device=labkit.device())
            dist.all_reduce(total, group=mesh.group(axis))
            axes[axis] = {"ranks": dist.get_process_group_ranks(mesh.group(axis)),
                          "torch": dist.get_process_group_ranks(mesh.device_mesh.get_group(axis)),
                          "rank_in": mesh.rank_in(axis), "size": mesh.size(axis), "sum": total.item()}
        found.append((mesh.coordinate, axes))
    return found


def test_each_axis_group_holds_the_ranks_of_the_layout():
    results = labkit.run(what_the_mesh_says, SHAPES, world_size=4)
    for shape_index, (dp, pp, tp) in enumerate(SHAPES):
        layout = mesh_layout(4, dp, pp, tp)
        for rank, per_shape in enumerate(results):
            coordinate, axes = per_shape[shape_index]
            assert coordinate == layout[rank].coordinate
            assert rank == (coordinate["dp"] * pp + coordinate["pp"]) * tp + coordinate["tp"]   # tp innermost
            for axis, seen in axes.items():
                expected = list(layout[rank].groups[axis])
                assert seen["ranks"] == seen["torch"] == expected, (dp, pp, tp, rank, axis)
                assert seen["sum"] == sum(expected)
                assert seen["rank_in"] == coordinate[axis] == expected.index(rank)
                assert seen["size"] == {"dp": dp, "pp": pp, "tp": tp}[axis]


def dp_fills_the_rest():
    return [(Mesh(tp=2).size("dp"), Mesh(pp=2).size("dp"), Mesh().size("dp"), Mesh(pp=2, tp=2).size("dp"))]


def test_dp_left_out_takes_the_ranks_pp_and_tp_leave():
    assert labkit.run(dp_fills_the_rest, world_size=4) == [[(2, 2, 4, 1)]] * 4


def built_twice():
    first, again = Mesh(tp=2), Mesh(tp=2)
    return first.device_mesh is again.device_mesh, first.device_mesh is not Mesh(pp=2).device_mesh


def test_a_mesh_built_again_reuses_its_groups():
    """init_device_mesh opens new gloo connections for every group each time: a cell run twice must not."""
    assert labkit.run(built_twice, world_size=4) == [(True, True)] * 4


def ring_over_dp(dp, pp, tp):
    mesh = Mesh(dp=dp, pp=pp, tp=tp)
    ours = torch.arange(6.0, device=labkit.device()) * (labkit.rank() + 1)
    theirs = ours.clone()
    ring_allreduce(ours, group=mesh.group("dp"))
    dist.all_reduce(theirs, group=mesh.group("dp"))
    return torch.equal(ours, theirs), ours.tolist()


@pytest.mark.parametrize("shape", [(2, 1, 2), (2, 2, 1)])
def test_ring_allreduce_over_a_mesh_group_matches_torch(shape):
    results = labkit.run(ring_over_dp, *shape, world_size=4)
    layout = mesh_layout(4, *shape)
    for rank, (same, values) in enumerate(results):
        partners = layout[rank].groups["dp"]                 # ranks 0 and 2, and 1 and 3, at once
        assert same and values == [float(i * sum(r + 1 for r in partners)) for i in range(6)]


def refusals():
    """Each bad call's error, caught on every rank (a rank raising alone would leave the others waiting)."""
    calls = {"product": lambda: Mesh(dp=3), "divide": lambda: Mesh(tp=3), "not a size": lambda: Mesh(pp=0),
             "axis": lambda: Mesh(tp=2).group("ep"), "size axis": lambda: Mesh(tp=2).size(1),
             "differ": lambda: Mesh(tp=1 + labkit.rank() % 2)}
    found = {}
    for name, call in calls.items():
        try:
            call()
        except (ValueError, TypeError) as error:
            found[name] = f"{type(error).__name__}: {error}"
    return found


def test_bad_sizes_and_axis_names_are_refused_on_every_rank():
    for found in labkit.run(refusals, world_size=4):
        assert "dp=3 x pp=1 x tp=1 = 3 ranks, but the world has 4" in found["product"]
        assert "pp=1 x tp=3 = 3 ranks does not divide the world of 4" in found["divide"]
        assert found["not a size"].startswith("ValueError: pp=0: pass a whole number >= 1")
        assert found["axis"] == "ValueError: axis='ep': use one of 'dp', 'pp', 'tp'."
        assert found["size axis"] == "ValueError: axis=1: use one of 'dp', 'pp', 'tp'."
        assert "different sizes (dp, pp, tp, cp, ep)" in found["differ"]
        assert "rank 1: (None, 1, 2, 1, 1)" in found["differ"]


def test_outside_a_rank_the_mesh_says_where_to_build_it():
    with pytest.raises(RuntimeError, match="Mesh needs a torch.distributed process group"):
        Mesh(tp=2)


# --- the pure layout against torch's DeviceMesh, any world size, in this one process ---

@contextlib.contextmanager
def fake_rank(rank, world_size):
    """This process as rank `rank` of `world_size` on torch's "fake" backend: DeviceMesh builds the very groups
    it would on a cluster, and no collective runs."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("shape", [(2, 2, 2), (3, 2, 2), (2, 2, 4), (1, 1, 1), (4, 1, 2)])
def test_mesh_layout_is_torchs_device_mesh_layout(shape):
    world_size = shape[0] * shape[1] * shape[2]
    layout = mesh_layout(world_size, *shape)
    assert [place.rank for place in layout] == list(range(world_size))
    for rank in range(world_size):
        with fake_rank(rank, world_size):
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=AXES)
            assert layout[rank].coordinate == dict(zip(AXES, mesh.get_coordinate(), strict=True))
            assert layout[rank].groups == {a: tuple(dist.get_process_group_ranks(mesh.get_group(a))) for a in AXES}


def test_mesh_layout_follows_the_row_major_rule():
    dp, pp, tp = 2, 3, 4
    grid = torch.arange(dp * pp * tp).view(dp, pp, tp)
    for place in mesh_layout(24, dp, pp, tp):
        i, j, k = (place.coordinate[a] for a in AXES)
        assert place.rank == grid[i, j, k] == (i * pp + j) * tp + k
        assert place.groups == {"dp": tuple(grid[:, j, k].tolist()), "pp": tuple(grid[i, :, k].tolist()),
                                "tp": tuple(grid[i, j, :].tolist())}


def test_mesh_layout_refuses_what_it_cannot_lay_out():
    with pytest.raises(ValueError, match=r"dp=2 x pp=1 x tp=2 = 4 ranks, but the world has 8"):
        mesh_layout(8, dp=2, tp=2)
    with pytest.raises(ValueError, match=r"pp=3 x tp=1 = 3 ranks does not divide the world of 8"):
        mesh_layout(8, pp=3)
    with pytest.raises(TypeError, match=r"world_size='8'"):
        mesh_layout("8")
    with pytest.raises(ValueError, match=r"mesh_layout lists at most 65536 ranks"):
        mesh_layout(10**9)


def test_a_large_layout_shares_each_group_between_its_members():
    layout = mesh_layout(4096, pp=8, tp=8)
    assert layout[4095].coordinate == {"dp": 63, "pp": 7, "tp": 7}
    assert layout[0].groups["dp"] is layout[64].groups["dp"]      # one tuple per group: memory stays O(world)


def cp_then_ep():
    """A dp x cp mesh and a dp x ep mesh of one shape, (2, 1, 2, 1), built one after the other in one process:
    each keeps its own axis names (the cache of built meshes once handed the cp mesh back for ep)."""
    from labkit.parallel import Mesh as ContextMesh

    with_cp, with_ep = ContextMesh(dp=2, cp=2), ContextMesh(dp=2, ep=2)
    return with_cp.axes, with_ep.axes, with_ep.rank_in("ep"), with_cp.rank_in("cp")


def test_meshes_of_one_shape_on_other_axes_are_not_mixed_up():
    for cp_axes, ep_axes, ep_rank, cp_rank in labkit.run(cp_then_ep, world_size=4):
        assert cp_axes == ("dp", "pp", "cp", "tp") and ep_axes == ("dp", "pp", "ep", "tp")
        assert ep_rank == cp_rank
