"""count_torch_collectives sees every collective a rank makes, torch's own included: on real ranks it counts
torch.distributed's functions of every kind with the bytes worked out from their shapes (count_collectives'
convention), labkit's all_reduce_sum as count_collectives does, and the broadcasts of torch's
ZeroRedundancyOptimizer, which count_collectives cannot see, one per parameter tensor."""

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

import labkit
from labkit.models import mlp
from labkit.parallel import all_reduce_sum, average_gradients, count_collectives, count_torch_collectives

FLOAT32 = 4


def every_kind():
    """One call of each kind through torch.distributed's own functions; (calls, nbytes) as plain dicts."""
    rank, n, dev = dist.get_rank(), dist.get_world_size(), labkit.device()
    with count_torch_collectives() as seen:
        dist.all_reduce(torch.ones(5, device=dev))
        dist.broadcast(torch.ones(7, device=dev), src=1)
        dist.all_gather_into_tensor(torch.empty(3 * n, device=dev), torch.ones(3, device=dev))
        dist.all_gather([torch.empty(2, device=dev) for _ in range(n)], torch.ones(2, device=dev))
        dist.reduce_scatter_tensor(torch.empty(4, device=dev), torch.ones(4 * n, device=dev))
        dist.reduce_scatter(torch.empty(6, device=dev), [torch.ones(6, device=dev) for _ in range(n)])
        ops = [dist.P2POp(dist.isend, torch.ones(9, device=dev), (rank + 1) % n),
               dist.P2POp(dist.irecv, torch.empty(9, device=dev), (rank - 1) % n)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        dist.barrier()
    return dict(seen.calls), dict(seen.nbytes)


def test_every_kind_counts_what_this_rank_hands_it():
    n = 3
    calls = {"all_reduce": 1, "broadcast": 1, "all_gather": 2, "reduce_scatter": 2, "send": 1}
    nbytes = {"all_reduce": 5, "broadcast": 7, "all_gather": 3 + 2,  # an all-gather: this rank's part
              "reduce_scatter": 4 * n + 6 * n,                      # a reduce-scatter: the whole input it sums
              "send": 9}                                            # the receive and the barrier: nothing
    expected = (calls, {kind: count * FLOAT32 for kind, count in nbytes.items()})
    assert labkit.run(every_kind, world_size=n) == [expected] * n


def labkits_all_reduce_both_ways():
    with count_collectives() as ours, count_torch_collectives() as seen:
        all_reduce_sum(torch.ones(11, device=labkit.device()))
        all_reduce_sum(torch.ones(2, 3, dtype=torch.float64, device=labkit.device()))
    return (dict(ours.calls), dict(ours.nbytes)), (dict(seen.calls), dict(seen.nbytes))


def test_labkits_all_reduce_counts_the_same_both_ways():
    for ours, seen in labkit.run(labkits_all_reduce_both_ways, world_size=2):
        assert ours == seen == ({"all_reduce": 2}, {"all_reduce": 11 * FLOAT32 + 6 * 8})


def zero_redundancy_step():
    """One step with torch's ZeroRedundancyOptimizer after the gradients' averaging (as notebook 11 trains it)."""
    torch.manual_seed(0)
    model = mlp(hidden=32, layers=3).to(labkit.device())
    optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    model(torch.randn(8, 16, device=labkit.device())).sum().backward()
    with count_collectives() as ours, count_torch_collectives() as seen:
        average_gradients(model)
        optimizer.step()
    tensors = [p.numel() * p.element_size() for p in model.parameters()]
    return dict(ours.nbytes), (dict(seen.calls), dict(seen.nbytes)), tensors


def test_it_sees_zero_redundancy_optimizers_broadcasts():
    for ours, (calls, nbytes), tensors in labkit.run(zero_redundancy_step, world_size=3):
        assert ours == {"all_reduce": sum(tensors)}                          # labkit's own: the averaging only
        # every rank takes part in one broadcast per parameter tensor, from the rank that updated it
        assert calls == {"all_reduce": len(tensors), "broadcast": len(tensors)}
        assert nbytes == {"all_reduce": sum(tensors), "broadcast": sum(tensors)}


def test_outside_collectives_nothing_is_counted():
    with count_torch_collectives() as seen:
        torch.ones(3).sum()
    assert not seen.calls and not seen.nbytes
