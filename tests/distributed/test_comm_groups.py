"""labkit.comm's collectives on process groups: sub-groups of a world of 4 against torch's collectives on the same
groups, while other ranks run their own groups; counters and traces in group ranks; ranks outside a group refused.

Inputs are small whole numbers, so that sums are exact and results compare for equality."""

import pytest
import torch
import torch.distributed as dist

import labkit
from labkit import comm, groups

NUMEL = 12  # divisible by groups of 2 and of 3, as torch's reduce_scatter_tensor and all_gather_into_tensor need


def rank_input(seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 101 + labkit.rank())
    return torch.randint(-8, 9, (NUMEL,), generator=generator).float()


def torch_results(mine: torch.Tensor, group) -> dict[str, torch.Tensor]:
    """What torch's own collectives give on `group` (sources and destinations as group ranks)."""
    n = groups.group_size(group)
    total = mine.clone()
    dist.all_reduce(total, group=group)
    scattered = torch.empty(NUMEL // n)
    dist.reduce_scatter_tensor(scattered, mine.clone(), group=group)
    gathered = torch.empty(NUMEL * n)
    dist.all_gather_into_tensor(gathered, mine, group=group)
    from_last = mine.clone()
    dist.broadcast(from_last, group=group, group_src=n - 1)
    into_first = mine.clone()
    dist.reduce(into_first, group=group, group_dst=0)
    return {"ring_allreduce": total, "naive_allreduce": total, "ring_reduce_scatter": scattered,
            "ring_allgather": gathered, "broadcast": from_last, "reduce": into_first}


def labkit_results(mine: torch.Tensor, group) -> dict[str, torch.Tensor]:
    n = groups.group_size(group)
    return {"ring_allreduce": comm.ring_allreduce(mine.clone(), group=group),
            "naive_allreduce": comm.naive_allreduce(mine.clone(), group=group),
            "ring_reduce_scatter": comm.ring_reduce_scatter(mine, group=group),
            "ring_allgather": comm.ring_allgather(mine, group=group),
            "broadcast": comm.broadcast(mine.clone(), n - 1, group=group),
            "reduce": comm.reduce(mine.clone(), 0, group=group)}


def compare_with_torch(group, seed: int) -> dict[str, bool]:
    """Every labkit.comm collective on `group` equal to torch's; reduce leaves non-destinations unchanged."""
    mine = rank_input(seed)
    ours, theirs = labkit_results(mine, group), torch_results(mine, group)
    if groups.group_rank(group) != 0:
        theirs["reduce"] = mine
    return {name: torch.equal(ours[name], theirs[name]) for name in ours}


def odd_and_even_groups():
    """Ranks {1, 3} and {0, 2} of 4, each rank handed its own: every rank creates both, in the same order."""
    odd, even = groups.new_group([1, 3]), groups.new_group([0, 2])
    return odd if labkit.rank() % 2 else even


def collectives_on_halves(seed):
    return compare_with_torch(odd_and_even_groups(), seed)


@pytest.mark.parametrize("seed", [0, 1])
def test_each_collective_on_two_concurrent_groups_equals_torch(seed):
    results = labkit.run(collectives_on_halves, seed, world_size=4)
    for rank, by_name in enumerate(results):
        assert by_name == dict.fromkeys(by_name, True), f"rank {rank}: {by_name}"
    assert len(results[0]) == 6


def collectives_on_three_of_four():
    three = groups.new_group([0, 1, 3])
    if labkit.rank() == 2:  # outside the group: takes no part
        return None
    return compare_with_torch(three, seed=3)


def test_each_collective_on_a_group_of_three_of_four_equals_torch():
    results = labkit.run(collectives_on_three_of_four, world_size=4)
    assert results[2] is None
    for rank in (0, 1, 3):
        assert results[rank] == dict.fromkeys(results[rank], True), f"rank {rank}: {results[rank]}"


def batched_ring_on_halves():
    group = odd_and_even_groups()
    transport = comm.TorchTransport(group, batched=True)  # P2POps on a sub-group: peers as group ranks
    mine = rank_input()
    expected = mine.clone()
    dist.all_reduce(expected, group=group)
    return torch.equal(comm.ring_allreduce(mine, transport=transport), expected), transport.rank, \
        transport.world_size


def test_the_batched_ring_on_a_sub_group_equals_torch():
    assert labkit.run(batched_ring_on_halves, world_size=4) == [(True, 0, 2), (True, 0, 2), (True, 1, 2),
                                                                (True, 1, 2)]


def ring_traffic_and_trace():
    three = groups.new_group([0, 1, 3])
    if labkit.rank() == 2:
        return None
    transport = comm.default_transport(three)
    before = transport.sent_nbytes, transport.received_nbytes
    with comm.traced(group=three) as events:
        comm.ring_allreduce(torch.zeros(NUMEL), group=three)
    sent, received = transport.sent_nbytes - before[0], transport.received_nbytes - before[1]
    return sent, received, [e.key() for e in events], comm.default_transport(three) is transport


def test_byte_counters_and_traces_are_in_the_groups_terms():
    results = labkit.run(ring_traffic_and_trace, world_size=4)
    n, nbytes = 3, 4 * NUMEL
    simulated = [e.key() for e in comm.simulate("ring_allreduce", n, NUMEL)]
    for group_rank, rank in enumerate((0, 1, 3)):
        sent, received, keys, cached = results[rank]
        assert sent == received == 2 * (n - 1) * nbytes // n  # 2(N-1)/N x S with N the group's size, not 4
        assert keys == [k for k in simulated if k[2] == group_rank]  # src and dst are group ranks
        assert cached
    assert results[2] is None


def outside_the_group():
    three = groups.new_group([1, 2, 3])
    t = torch.ones(4)
    if labkit.rank() != 0:
        return comm.ring_allreduce(t, group=three).tolist()
    messages = []
    for name, call in [("ring_allreduce", lambda: comm.ring_allreduce(t, group=three)),
                       ("broadcast", lambda: comm.broadcast(t, 0, group=three)),
                       ("traced", lambda: comm.traced(group=three).__enter__()),
                       ("labkit.comm", lambda: comm.TorchTransport(three))]:
        with pytest.raises(ValueError, match=f"^{name}: global rank 0 is not in the group passed as group=") as info:
            call()
        messages.append(str(info.value))
    return messages


def test_a_rank_outside_the_group_gets_a_clear_error():
    results = labkit.run(outside_the_group, world_size=4)
    assert results[1:] == [[3.0] * 4] * 3
    assert all("Call it only on the group's ranks" in message for message in results[0])


def group_and_transport():
    with pytest.raises(ValueError, match="ring_allreduce: pass group= or transport=, not both"):
        comm.ring_allreduce(torch.ones(2), group=groups.new_group([0, 1]), transport=comm.default_transport())


def test_a_group_and_a_transport_at_once_is_a_clear_error():
    labkit.run(group_and_transport, world_size=2)


def mismatched_in_a_group():
    odd = groups.new_group([1, 3])
    groups.new_group([0, 2])
    if labkit.rank() % 2:
        comm.ring_allreduce(torch.zeros(2 + labkit.rank()), group=odd)


def test_mismatched_tensors_in_a_group_name_the_global_ranks():
    with pytest.raises(labkit.RankError, match=r"the ranks passed different tensors \(rank 1: float32\[3\]; "
                                               r"rank 3: float32\[5\]\)"):
        labkit.run(mismatched_in_a_group, world_size=4, timeout=30)
