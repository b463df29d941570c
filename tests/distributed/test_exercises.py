"""The graders accept the reference solutions and reject the usual mistakes, with a hint that names them."""

import torch
import torch.distributed as dist

import labkit
from labkit.exercises import Verdict, check_naive_allreduce, check_ring_allreduce


def hub_gathers_and_sums(t):
    incoming = torch.empty_like(t)
    for src in range(1, labkit.world_size()):
        dist.recv(incoming, src)
        t += incoming


def naive_reference(t):
    if labkit.rank() == 0:
        hub_gathers_and_sums(t)
        for dst in range(1, labkit.world_size()):
            dist.send(t, dst)
    else:
        dist.send(t, 0)
        dist.recv(t, 0)


def naive_never_sends_back(t):
    if labkit.rank() == 0:
        hub_gathers_and_sums(t)
    else:
        dist.send(t, 0)


def naive_sums_twice(t):
    if labkit.rank() == 0:
        naive_reference(t)
    else:
        dist.send(t, 0)
        result = torch.empty_like(t)
        dist.recv(result, 0)
        t += result


def naive_wrong_hub(t):
    rank, n = labkit.rank(), labkit.world_size()
    if rank == 0:  # the hub code runs on rank 0 ...
        naive_reference(t)
    else:  # ... but the others send to the last rank, which waits for rank 0 like everyone else
        dist.send(t, n - 1 if rank != n - 1 else 0)
        dist.recv(t, 0)


def naive_hub_forgets_itself(t):
    if labkit.rank() == 0:
        t.zero_()  # the hub drops its own contribution
    naive_reference(t)


def naive_uses_all_reduce(t):
    dist.all_reduce(t)


def scatter_reduce(chunks):
    rank, n = labkit.rank(), labkit.world_size()
    for step in range(n - 1):
        send, receive = (rank - step - 1) % n, (rank - step - 2) % n
        incoming = torch.empty_like(chunks[receive])
        pending = dist.isend(chunks[send], (rank + 1) % n)
        dist.recv(incoming, (rank - 1) % n)
        pending.wait()
        chunks[receive] += incoming


def all_gather(chunks):
    rank, n = labkit.rank(), labkit.world_size()
    for step in range(n - 1):
        send, receive = (rank - step) % n, (rank - step - 1) % n
        pending = dist.isend(chunks[send], (rank + 1) % n)
        dist.recv(chunks[receive], (rank - 1) % n)
        pending.wait()


def ring_reference(t):
    chunks = list(t.tensor_split(labkit.world_size()))
    scatter_reduce(chunks)
    all_gather(chunks)


def ring_without_allgather(t):
    scatter_reduce(list(t.tensor_split(labkit.world_size())))


def ring_even_sizes_only(t):
    size = t.numel() // labkit.world_size()
    chunks = [t[i * size:(i + 1) * size] for i in range(labkit.world_size())]  # drops the remainder
    scatter_reduce(chunks)
    all_gather(chunks)


def test_naive_reference_passes():
    verdict = check_naive_allreduce(naive_reference)
    assert verdict.passed and isinstance(verdict, Verdict), verdict


def test_naive_mistakes_get_their_hint():
    assert "the result never reached it" in check_naive_allreduce(naive_never_sends_back).message
    assert "summed twice" in check_naive_allreduce(naive_sums_twice).message
    wrong_hub = check_naive_allreduce(naive_wrong_hub)
    assert not wrong_hub and "never finished" in wrong_hub.message and "same hub" in wrong_hub.message
    assert "switched off" in check_naive_allreduce(naive_uses_all_reduce).message
    forgot = check_naive_allreduce(naive_hub_forgets_itself).message
    assert "expected" in forgot and "tensor_split" not in forgot  # no ring advice for a hub
    assert "pass your function itself" in check_naive_allreduce(42).message


def test_ring_reference_passes():
    verdict = check_ring_allreduce(ring_reference)
    assert verdict.passed, verdict


def test_ring_mistakes_get_their_hint():
    assert "all-gather" in check_ring_allreduce(ring_without_allgather).message
    assert "tensor_split" in check_ring_allreduce(ring_even_sizes_only).message
    not_a_ring = check_ring_allreduce(naive_reference)  # the right answer, through a hub
    assert not not_a_ring and "this is not a ring" in not_a_ring.message
