"""labkit.parallel's data- and tensor-parallel primitives on sub-groups: in a world of 4, ranks {0, 2} and ranks
{1, 3} each run the primitive on their own pair at the same time, and every result equals torch's own on the same
group (DistributedDataParallel with process_group=, torch.distributed's collectives with group=) or the unsplit
layer. Each pair gets its own data and its own layers, so a collective that leaked into the world (or the other
pair) would mix them and fail."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import labkit
from labkit import groups
from labkit.models import make_classification, mlp
from labkit.parallel import (
    BucketedDDP,
    ColumnParallelLinear,
    ParallelMLP,
    RowParallelLinear,
    all_reduce_sum,
    average_gradients,
    broadcast_parameters,
    copy_to_tensor_parallel,
    count_allreduces,
    count_collectives,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    shard_sizes,
    split_to_tensor_parallel,
)

pytestmark = pytest.mark.numerics  # compares floating-point results: make unit runs it again on other kernels

PAIRS = [[0, 2], [1, 3]]
SMALL_MB = 0.004  # buckets of at most 4 KiB: mlp()'s 5.5 k parameters fill several


def my_pair():
    """This rank's pair (a process group), its global ranks, and the other pair's group. Every rank makes both
    groups, in the same order, as torch.distributed.new_group requires."""
    made, mine = [groups.new_group(ranks) for ranks in PAIRS], labkit.rank() % 2
    return made[mine], PAIRS[mine], made[1 - mine]


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# --- Data parallelism: BucketedDDP and average_gradients against torch DDP with process_group= ---

def train_on_pair(method: str, steps: int = 3, batch: int = 16):
    group, members, _ = my_pair()
    dev = labkit.device()
    x, y = (t.to(dev) for t in make_classification(batch * steps, seed=10 + labkit.rank() % 2))  # the pair's data
    ours_model, torch_model = mlp(seed=labkit.rank()).to(dev), mlp(seed=labkit.rank()).to(dev)
    if method == "naive":
        broadcast_parameters(ours_model, group=group)
        ours = ours_model
    else:
        ours = BucketedDDP(ours_model, bucket_mb=SMALL_MB, group=group)
    theirs = DistributedDataParallel(torch_model, bucket_cap_mb=SMALL_MB, process_group=group)
    optimizers = {net: torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9) for net in (ours, theirs)}
    with count_allreduces() as counted:
        for step in range(steps):
            rows = slice(step * batch, (step + 1) * batch)
            mine = [t[rows].tensor_split(2)[groups.group_rank(group)] for t in (x, y)]
            for net, optimizer in optimizers.items():
                optimizer.zero_grad()
                F.cross_entropy(net(mine[0]), mine[1]).backward()
                if net is ours:
                    average_gradients(ours_model, group=group) if method == "naive" else ours.finish()
                optimizer.step()
    buckets = 0 if method == "naive" else len(ours.buckets)
    return flat(ours_model), flat(torch_model), flat(mlp(seed=members[0])), counted.calls, buckets


@pytest.mark.parametrize("method", ["naive", "bucketed"])
def test_data_parallel_on_a_pair_equals_torch_ddp_on_that_pair(method):
    results = labkit.run(train_on_pair, method, world_size=4)
    for rank, (ours, theirs, initial, calls, buckets) in enumerate(results):
        # bit for bit: one process runs both on the same data with the same kernels, and the average of two ranks is
        # exact whichever way each divides ((a + b) / 2 = a / 2 + b / 2 for a power of two; a + b = b + a)
        assert torch.equal(ours, theirs), (method, rank, (ours - theirs).abs().max().item())
        assert not torch.equal(ours, initial)  # it trained, from its pair's rank 0
        assert calls == 3 * (buckets or len(list(mlp().parameters()))), (method, rank, calls)
    for a, b in PAIRS:
        assert torch.equal(results[a][0], results[b][0])  # replicas within a pair agree
    assert not torch.equal(results[0][0], results[1][0])  # the pairs trained apart, on their own data


def broadcast_from_group_rank_1():
    group, members, _ = my_pair()
    model = mlp(seed=labkit.rank()).to(labkit.device())
    with count_collectives() as counted:
        broadcast_parameters(model, src=1, group=group)  # a group rank: global rank 2 in {0, 2}, 3 in {1, 3}
    return flat(model), flat(mlp(seed=members[1])), dict(counted.calls)


def test_broadcast_parameters_takes_a_group_rank_as_src():
    for rank, (mine, expected, calls) in enumerate(labkit.run(broadcast_from_group_rank_1, world_size=4)):
        assert torch.equal(mine, expected), rank
        assert calls == {"broadcast": len(list(mlp().parameters()))}, calls


# --- Tensor parallelism: the layers and the four operators on a pair ---

def error(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def against_unsplit(layer: nn.Module, full: nn.Module, x: torch.Tensor, grad_out: torch.Tensor) -> list[float]:
    """Errors of `layer`'s output and input gradient against the unsplit `full` (its gradients zeroed first)."""
    full.zero_grad()
    mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, expected = layer(mine), full(theirs)
    y.backward(grad_out)
    expected.backward(grad_out)
    return [error(y.detach(), expected.detach()), error(mine.grad, theirs.grad)]


def layers_on_pair(in_features=7, hidden=9, out_features=5):
    """Column, row and MLP layers on this rank's pair against the unsplit layers: output, input gradient and this
    group rank's shard of the parameter gradients. Sizes are odd, so the pair's shards are uneven (9: 5 and 4)."""
    group, _, _ = my_pair()
    torch.manual_seed(100 + labkit.rank() % 2)  # each pair its own layers and data
    fc1, fc2 = nn.Linear(in_features, hidden).double(), nn.Linear(hidden, out_features).double()
    x, h = torch.randn(4, in_features, dtype=torch.float64), torch.randn(4, hidden, dtype=torch.float64)
    dh, dy = torch.randn(4, hidden, dtype=torch.float64), torch.randn(4, out_features, dtype=torch.float64)
    column = ColumnParallelLinear.from_linear(fc1, group=group)
    errors = {"column": against_unsplit(column, fc1, x, dh) + [
        error(column.weight.grad, fc1.weight.grad[column.shard]), error(column.bias.grad, fc1.bias.grad[column.shard])]}
    row = RowParallelLinear.from_linear(fc2, group=group)
    errors["row"] = against_unsplit(row, fc2, h, dy) + [
        error(row.weight.grad, fc2.weight.grad[:, row.shard]), error(row.bias.grad, fc2.bias.grad)]
    mlp_layer = ParallelMLP.from_mlp(fc1, fc2, activation=nn.GELU(), group=group)
    errors["mlp"] = against_unsplit(mlp_layer, nn.Sequential(fc1, nn.GELU(), fc2), x, dy) + [
        error(mlp_layer.fc1.weight.grad, fc1.weight.grad[mlp_layer.fc1.shard]),
        error(mlp_layer.fc2.weight.grad, fc2.weight.grad[:, mlp_layer.fc2.shard])]
    return errors, mlp_layer.fc1.shard, row.shard, groups.group_rank(group)


def test_tensor_parallel_layers_on_a_pair_equal_the_unsplit_layers():
    for rank, (errors, hidden_shard, row_shard, group_rank) in enumerate(labkit.run(layers_on_pair, world_size=4)):
        assert max(max(e) for e in errors.values()) <= 1e-12, (rank, errors)
        assert group_rank == rank // 2
        assert shard_sizes(9, 2) == [5, 4]
        assert (hidden_shard, row_shard) == [(slice(0, 5), slice(0, 5)), (slice(5, 9), slice(5, 9))][group_rank]


def operators_on_pair(features=5):
    """The four Megatron operators on this rank's pair, forward and backward, against torch.distributed's own
    collectives with group= on the same tensors."""
    group, _, _ = my_pair()
    dev, me = labkit.device(), groups.group_rank(group)
    x = (torch.arange(2.0 * features, device=dev).reshape(2, features) + 10 * labkit.rank()).requires_grad_()
    expected_sum = x.detach().clone()
    dist.all_reduce(expected_sum, group=group)
    reduced = reduce_from_tensor_parallel(x, group)
    copied = copy_to_tensor_parallel(x, group)
    (reduced * 2 + copied).sum().backward()  # g's backward: 2; f's backward: all_reduce of ones, 2 ranks
    part = split_to_tensor_parallel(x.detach(), group)
    everyone = [torch.empty_like(x.detach()) for _ in range(2)]
    dist.all_gather(everyone, x.detach(), group=group)
    pieces = [t[..., s] for t, s in zip(everyone, [slice(0, 3), slice(3, 5)], strict=True)]
    gathered = gather_from_tensor_parallel(part, features, group)
    return (torch.equal(reduced, expected_sum), x.grad.unique().tolist(), me, tuple(part.shape),
            torch.equal(gathered, torch.cat(pieces, dim=-1)))


def test_the_four_operators_on_a_pair_equal_torchs_collectives_on_that_pair():
    for rank, (reduced_ok, grad, me, part_shape, gathered_ok) in enumerate(labkit.run(operators_on_pair,
                                                                                         world_size=4)):
        assert reduced_ok and gathered_ok, rank
        assert grad == [4.0], (rank, grad)  # 2 from g's identity backward, 2 from f's all_reduce over the pair
        assert part_shape == (2, [3, 2][me]), (rank, part_shape)


# --- Misuse on groups: clear errors, not hangs; only the pair that erred fails ---

def misuse(case: str):
    group, _, other = my_pair()
    model = mlp(seed=0).to(labkit.device())
    if case == "not a member":
        broadcast_parameters(model, group=other)
    elif case == "different src":
        broadcast_parameters(model, src=int(labkit.rank() == 3), group=group)  # only pair {1, 3} disagrees
    elif case == "src past the group":
        broadcast_parameters(model, src=2, group=group)
    elif case == "model off the device":
        BucketedDDP(model.to("meta") if labkit.rank() == 2 else model, group=group)  # only pair {0, 2} fails
    elif case == "different layers":
        torch.manual_seed(int(labkit.rank() == 3))  # only pair {1, 3} has two different layers
        ColumnParallelLinear.from_linear(nn.Linear(4, 4), group=group)
    return "ran"


@pytest.mark.parametrize("case, failing, expected", [
    ("not a member", [0, 1, 2, 3], "global rank 2 is not in the group passed as group="),
    ("different src", [1, 3], "broadcast_parameters: the ranks passed different src (rank 1: 0; rank 3: 1)"),
    ("src past the group", [0, 1, 2, 3], "src=2: pass a rank of the group, 0 to 1 (group ranks; the group holds "
                                         "global ranks [1, 3])"),
    ("model off the device", [0, 2], "BucketedDDP: the model must live on each rank's labkit.device() (the CPU "
                                     "under gloo, cuda:LOCAL_RANK under NCCL), but rank 2: parameter '0.weight' is "
                                     "on meta, not on labkit.device() = "),
    ("different layers", [1, 3], "ColumnParallelLinear.from_linear: the ranks passed different full layers (rank 1: "
                                 "nn.Linear(4, 4, bias=True) float32, weights sha256 "),
])
def test_misuse_on_a_group_gets_a_clear_error_not_a_hang(case, failing, expected):
    with pytest.raises(labkit.RankError) as raised:
        labkit.run(misuse, case, world_size=4, timeout=30)
    assert not isinstance(raised.value, labkit.RankTimeout)
    failures = raised.value.failures
    assert sorted(f.rank for f in failures) == failing, str(raised.value)
    assert all(f.kind == "error" and "ValueError" in f.summary for f in failures), str(raised.value)
    assert expected in str(raised.value), str(raised.value)


def sum_on_the_other_pair():
    _, _, other = my_pair()
    t = torch.ones(1, device=labkit.device())
    with count_collectives() as counted:
        with pytest.raises(ValueError) as raised:
            all_reduce_sum(t, group=other)
    return str(raised.value), dict(counted.calls), t.item()


def test_all_reduce_sum_outside_its_group_is_an_error_and_is_not_counted():
    # torch's all_reduce on a group this rank is not in only warns and returns; the call used to be counted
    for rank, (message, calls, value) in enumerate(labkit.run(sum_on_the_other_pair, world_size=4, timeout=30)):
        assert message.startswith(f"all_reduce_sum: global rank {rank} is not in the group passed as group=.")
        assert calls == {} and value == 1.0


def test_require_member_without_ranks_refuses_unless_alone_is_ok():
    # labkit.checkpoint runs in a single process too, as rank 0 of 1: alone_ok lets it through
    assert groups.require_member("save_checkpoint", alone_ok=True) is None
    with pytest.raises(RuntimeError, match=r"^save_checkpoint needs a torch.distributed process group"):
        groups.require_member("save_checkpoint")
