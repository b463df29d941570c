"""labkit.parallel.sequence on real gloo processes, against torch's own collectives on the same groups: the
all-gather and the reduce-scatter along the sequence and their backwards, the linear layer that keeps only its
input's shard, and the gradient sum of the replicated parameters; on pairs {0, 2} and {1, 3} of a world of 4."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import labkit
from labkit import groups
from labkit.parallel import (
    count_collectives,
    gather_from_sequence_parallel,
    reduce_scatter_to_sequence_parallel,
    sequence_parallel_linear,
    sequence_slice,
)

pytestmark = pytest.mark.numerics  # compares floating-point results: make unit runs it again on other kernels

BATCH, LENGTH, WIDTH = 3, 8, 5


def torch_all_reduce(tensor, group):
    tensor = tensor.clone()
    dist.all_reduce(tensor, group=group)
    return tensor


def torch_all_gather_sequence(tensor, group):
    parts = [torch.empty_like(tensor) for _ in range(groups.group_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def mine(seed):
    """A tensor of this rank's own: a different seed on every global rank."""
    return torch.randn(BATCH, LENGTH, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def on_pairs():
    pair = [groups.new_group([0, 2]), groups.new_group([1, 3])][labkit.rank() % 2]
    part = mine(labkit.rank())[:, :LENGTH // 2].requires_grad_()
    whole = mine(10 + labkit.rank()).requires_grad_()
    with count_collectives() as counted:
        gathered = gather_from_sequence_parallel(part, pair)
        gathered.backward(mine(20 + labkit.rank()))
        scattered = reduce_scatter_to_sequence_parallel(whole, pair)
        scattered.backward(mine(30 + labkit.rank())[:, :LENGTH // 2])
    mine_slice = sequence_slice(LENGTH, pair)
    summed = torch_all_reduce(mine(20 + labkit.rank()), pair)
    return {
        "gather": (gathered - torch_all_gather_sequence(part.detach(), pair)).abs().max().item(),
        "gather backward": (part.grad - summed[:, mine_slice]).abs().max().item(),
        "scatter": (scattered - torch_all_reduce(whole.detach(), pair)[:, mine_slice]).abs().max().item(),
        "scatter backward": (whole.grad - torch_all_gather_sequence(mine(30 + labkit.rank())[:, :LENGTH // 2],
                                                                    pair)).abs().max().item(),
        "groups": sorted(counted.by_group), "calls": dict(counted.calls),
    }


def test_gather_and_reduce_scatter_equal_torchs_collectives_on_sub_groups():
    for rank, result in enumerate(labkit.run(on_pairs, world_size=4)):
        assert result.pop("groups") == [(0, 2) if rank % 2 == 0 else (1, 3)], rank
        assert result.pop("calls") == {"all_gather": 2, "reduce_scatter": 2}, rank
        assert all(e <= 1e-15 for e in result.values()), (rank, result)


def linear():
    """sequence_parallel_linear of a column part against F.linear on the whole sequence: the output, the input's
    gradient (summed over the group: each rank's output part pulls on the whole input) and the weight's."""
    torch.manual_seed(0)
    weight = torch.randn(4, WIDTH, dtype=torch.float64)[labkit.rank() * 2:(labkit.rank() + 1) * 2]
    x, grad_out = mine(0), mine(40 + labkit.rank())[..., :2]
    ours_x, ours_w = x[:, sequence_slice(LENGTH)].clone().requires_grad_(), weight.clone().requires_grad_()
    with count_collectives() as forward:
        y = sequence_parallel_linear(ours_x, ours_w)
    with count_collectives() as backward:
        y.backward(grad_out)
    theirs_x, theirs_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
    F.linear(theirs_x, theirs_w).backward(grad_out)
    grad_x = torch_all_reduce(theirs_x.grad, None)[:, sequence_slice(LENGTH)]
    return ((y - F.linear(x, weight)).abs().max().item(), (ours_x.grad - grad_x).abs().max().item(),
            (ours_w.grad - theirs_w.grad).abs().max().item(), dict(forward.calls), dict(backward.calls))


def test_linear_keeps_the_shard_and_gathers_it_again_for_the_backward():
    for rank, (y, dx, dw, forward, backward) in enumerate(labkit.run(linear, world_size=2)):
        assert max(y, dx, dw) <= 1e-13, (rank, y, dx, dw)
        assert forward == {"all_gather": 1} and backward == {"all_gather": 1, "reduce_scatter": 1}, rank


def uneven():
    reduce_scatter_to_sequence_parallel(torch.ones(1, 5, 2))


def test_a_length_the_group_does_not_divide_is_refused_by_name():
    with pytest.raises(labkit.RankError, match="sequence parallelism over 2 ranks: sequences of 5 tokens do not "
                                               "split evenly"):
        labkit.run(uneven, world_size=2, timeout=60)
