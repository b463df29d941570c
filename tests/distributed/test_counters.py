"""The collective counter keyed by group: on a dp x tp mesh of 4 ranks, each axis's collectives (counted
all_reduces, the tensor-parallel MLP on the tp group, BucketedDDP on the dp group, the pipeline's sends on the pp
group) land on that axis, with the calls and bytes the test computes from the shapes it sent, and the groups
together add up to the kind totals. The collectives themselves are checked against torch's on the same group."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import labkit
from labkit import groups
from labkit.models import mlp
from labkit.parallel import (
    BucketedDDP,
    ColumnParallelLinear,
    FullyShardedDP,
    Mesh,
    ParallelMLP,
    ShardedOptimizer,
    all_reduce_sum,
    count_allreduces,
    count_collectives,
    record_collective,
    run_pipeline,
)
from labkit.parallel.counters import ALONE, Traffic

pytestmark = pytest.mark.numerics  # compares floating-point results: make unit runs it again on other kernels

FLOAT32, FLOAT64 = 4, 8  # bytes per number
TP_SIZES, DP_SIZES, ALONE_SIZE, WORLD_SIZE = (5, 6, 7), (11, 13), 17, 19  # float32 numbers per counted all_reduce
IN, HIDDEN, OUT, BATCH = 6, 8, 5, 4  # the MLP, split over tp = 2, replicated over dp = 2; float64


def summed(traffics) -> tuple[dict, dict]:
    """The calls and bytes by kind of several Traffics together, as plain dicts."""
    calls, nbytes = Traffic().calls, Traffic().nbytes
    for traffic in traffics:
        calls.update(traffic.calls)
        nbytes.update(traffic.nbytes)
    return dict(calls), dict(nbytes)


def plain(traffic: Traffic) -> tuple[dict, dict]:
    return dict(traffic.calls), dict(traffic.nbytes)


def reduced_like_torch(sizes, group) -> bool:
    """all_reduce_sum of a tensor of each size over `group`, equal to torch's all_reduce on the same group."""
    same = True
    for size in sizes:
        ours = torch.arange(size, dtype=torch.float32, device=labkit.device()) * (labkit.rank() + 1)
        theirs = ours.clone()
        all_reduce_sum(ours, group)
        dist.all_reduce(theirs, group=group)
        same = same and torch.equal(ours, theirs)
    return same


def mlp_step(mesh: Mesh) -> bool:
    """A Megatron MLP split over tp, wrapped in BucketedDDP over dp (one bucket), one forward and backward on
    the dp replica's own batch; True if its output equals the unsplit MLP's."""
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(IN, HIDDEN, dtype=torch.float64), nn.Linear(HIDDEN, OUT, dtype=torch.float64)
    split = ParallelMLP.from_mlp(fc1, fc2, activation=nn.Tanh(), group=mesh.group("tp")).to(labkit.device())
    model = BucketedDDP(split, bucket_mb=1.0, first_bucket_mb=1.0, group=mesh.group("dp"))
    torch.manual_seed(100 + mesh.coordinate["dp"])
    x = torch.randn(BATCH, IN, dtype=torch.float64, requires_grad=True)
    y = model(x.to(labkit.device()))
    y.sum().backward()
    model.finish()
    return torch.allclose(y.cpu(), fc2(torch.tanh(fc1(x))))


def traffic_on_a_2x2_mesh():
    mesh = Mesh(dp=2, tp=2)
    with count_collectives() as counted:
        same = reduced_like_torch(TP_SIZES, mesh.group("tp"))
        same &= reduced_like_torch(DP_SIZES, mesh.group("dp"))
        same &= reduced_like_torch([ALONE_SIZE], mesh.group("pp"))  # pp = 1: this rank's one-rank group
        same &= reduced_like_torch([WORLD_SIZE], None)
        same &= mlp_step(mesh)
    per_axis = counted.by_axis(mesh)
    return same, {key: plain(traffic) for key, traffic in per_axis.items()}, summed(per_axis.values()), \
        plain(counted)


def test_each_axis_counts_what_was_sent_on_its_group_on_a_dp_x_tp_mesh():
    shard = HIDDEN // 2  # this rank's hidden features: fc1's rows, fc2's columns
    parameters = [shard * IN, shard, OUT * shard, OUT]  # fc1.weight, fc1.bias, fc2.weight, fc2.bias (whole)
    tp = ({"all_reduce": len(TP_SIZES) + 2},  # Megatron: g's all_reduce forward (of y), f's backward (of dx)
          {"all_reduce": sum(TP_SIZES) * FLOAT32 + (BATCH * OUT + BATCH * IN) * FLOAT64})
    dp = ({"all_reduce": len(DP_SIZES) + 1, "broadcast": len(parameters)},  # one bucket; each parameter broadcast
          {"all_reduce": sum(DP_SIZES) * FLOAT32 + (sum(parameters) + len(parameters)) * FLOAT64,  # + used flags
           "broadcast": sum(parameters) * FLOAT64})
    for rank, (same, per_axis, together, totals) in enumerate(labkit.run(traffic_on_a_2x2_mesh, world_size=4)):
        assert same
        assert per_axis == {"dp": dp, "pp": ({}, {}), "tp": tp,
                            ALONE: ({"all_reduce": 1}, {"all_reduce": ALONE_SIZE * FLOAT32}),
                            (0, 1, 2, 3): ({"all_reduce": 1}, {"all_reduce": WORLD_SIZE * FLOAT32})}, rank
        assert together == totals


def world_is_the_tp_axis():
    mesh = Mesh(tp=4)  # dp = pp = 1: their groups are this rank alone; tp's is the whole world
    with count_collectives() as counted:
        same = reduced_like_torch([3], None) & reduced_like_torch([5], mesh.group("tp"))
        same &= reduced_like_torch([7], mesh.group("dp")) & reduced_like_torch([9], mesh.group("pp"))
    per_axis = counted.by_axis(mesh)
    return same, set(counted.by_group), {key: plain(t) for key, t in per_axis.items()}, summed(per_axis.values()), \
        plain(counted)


def test_the_world_is_an_axis_spanning_it_and_size_1_axes_go_to_alone():
    for rank, (same, keys, per_axis, together, totals) in enumerate(labkit.run(world_is_the_tp_axis, world_size=4)):
        assert same and keys == {(rank,), (0, 1, 2, 3)}  # dp's and pp's groups: the same ranks, one key
        assert per_axis == {"dp": ({}, {}), "pp": ({}, {}),
                            "tp": ({"all_reduce": 2}, {"all_reduce": (3 + 5) * FLOAT32}),
                            ALONE: ({"all_reduce": 2}, {"all_reduce": (7 + 9) * FLOAT32})}
        assert together == totals


def every_kind_on_a_2x2_mesh():
    """A column-parallel layer gathering its output over tp; ZeRO-2 and FSDP over dp: one step each."""
    mesh, dev = Mesh(dp=2, tp=2), labkit.device()
    torch.manual_seed(0)
    column = ColumnParallelLinear.from_linear(nn.Linear(16, 8), gather_output=True, group=mesh.group("tp")).to(dev)
    zero2, fsdp = mlp().to(dev), FullyShardedDP(mlp().to(dev), group=mesh.group("dp"))
    x = torch.randn(4, 16, device=dev, requires_grad=True)
    with count_collectives() as counted:
        column(x).sum().backward()
        optimizer = ShardedOptimizer(zero2.parameters(), torch.optim.SGD, group=mesh.group("dp"),
                                     shard_gradients=True, lr=0.1)
        zero2(x).sum().backward()
        optimizer.step()
        fsdp(x).sum().backward()
        fsdp.finish()
    return {key: sorted(t.calls) for key, t in counted.by_axis(mesh).items()}


def test_every_kind_of_collective_lands_on_the_axis_of_its_group():
    # a group left out at any record_collective call would land on the world's ranks (0, 1, 2, 3) instead
    every_kind = {"dp": ["all_gather", "broadcast", "reduce_scatter"], "pp": [], "tp": ["all_gather", "all_reduce"]}
    assert labkit.run(every_kind_on_a_2x2_mesh, world_size=4) == [every_kind] * 4


WIDTH, MICROBATCHES, PIPELINE_BATCH = 10, 4, 8  # the activation crossing between the two stages: 8 x 10, float64


def pipeline_on_the_pp_axis():
    mesh = Mesh(dp=2, pp=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 4), nn.Linear(4, 3)).double()
    torch.manual_seed(1 + mesh.coordinate["dp"])
    x, y = torch.randn(PIPELINE_BATCH, 6, dtype=torch.float64), torch.randint(0, 3, (PIPELINE_BATCH,))
    with count_collectives() as counted:
        run_pipeline(model, "1f1b", MICROBATCHES, x, y, F.cross_entropy, group=mesh.group("pp"))
    return {key: plain(t) for key, t in counted.by_axis(mesh).items()}


def test_pipeline_sends_count_on_the_pp_axis():
    # stage 0 sends each micro-batch's activation, stage 1 its gradient back: the same shape, headers aside
    sent = ({"send": MICROBATCHES}, {"send": PIPELINE_BATCH * WIDTH * FLOAT64})
    assert labkit.run(pipeline_on_the_pp_axis, world_size=4) == [{"dp": ({}, {}), "pp": sent, "tp": ({}, {})}] * 4


def test_without_ranks_the_group_is_this_process_alone_and_nested_counters_each_count():
    with count_collectives() as outer, count_allreduces() as all_reduces:
        record_collective("broadcast", torch.ones(3))
        with count_collectives() as inner:
            record_collective("all_reduce", torch.ones(2, dtype=torch.float64), group=None)
    assert not groups.group_is_up()
    assert {ranks: plain(t) for ranks, t in outer.by_group.items()} == {
        (0,): ({"broadcast": 1, "all_reduce": 1}, {"broadcast": 12, "all_reduce": 16})}
    assert plain(inner) == ({"all_reduce": 1}, {"all_reduce": 16}) and list(inner.by_group) == [(0,)]
    assert (all_reduces.calls, all_reduces.nbytes) == (1, 16)
