"""The graders accept the reference solutions and reject the usual mistakes, with a hint that names them."""

import torch
import torch.distributed as dist

import labkit
from labkit.exercises import Verdict, check_naive_allreduce, check_ring_allreduce


def naive_reference(t):
    rank, n = labkit.rank(), labkit.world_size()
    if rank == 0:
        incoming = torch.empty_like(t)
        for src in range(1, n):
            dist.recv(incoming, src)
            t += incoming
        for dst in range(1, n):
            dist.send(t, dst)
    else:
        dist.send(t, 0)
        dist.recv(t, 0)


def naive_never_sends_back(t):
    if labkit.rank() == 0:
        incoming = torch.empty_like(t)
        for src in range(1, labkit.world_size()):
            dist.recv(incoming, src)
            t += incoming
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
        incoming = torch.empty_like(t)
        for src in range(1, n):
            dist.recv(incoming, src)
            t += incoming
        for dst in range(1, n):
            dist.send(t, dst)
    else:  # ... but the others send to the last rank
        dist.send(t, n - 1 if rank != n - 1 else 0)
        dist.recv(t, 0)


def naive_uses_all_reduce(t):
    dist.all_reduce(t)


def ring_reference(t):
    rank, n = labkit.rank(), labkit.world_size()
    chunks = list(t.tensor_split(n))
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):  # reduce-scatter
        send, receive = (rank - step - 1) % n, (rank - step - 2) % n
        incoming = torch.empty_like(chunks[receive])
        pending = dist.isend(chunks[send], right)
        dist.recv(incoming, left)
        pending.wait()
        chunks[receive] += incoming
    for step in range(n - 1):  # all-gather
        send, receive = (rank - step) % n, (rank - step - 1) % n
        pending = dist.isend(chunks[send], right)
        dist.recv(chunks[receive], left)
        pending.wait()


def ring_without_allgather(t):
    rank, n = labkit.rank(), labkit.world_size()
    chunks = list(t.tensor_split(n))
    for step in range(n - 1):
        send, receive = (rank - step - 1) % n, (rank - step - 2) % n
        incoming = torch.empty_like(chunks[receive])
        pending = dist.isend(chunks[send], (rank + 1) % n)
        dist.recv(incoming, (rank - 1) % n)
        pending.wait()
        chunks[receive] += incoming


def ring_even_sizes_only(t):
    rank, n = labkit.rank(), labkit.world_size()
    size = t.numel() // n
    chunks = [t[i * size:(i + 1) * size] for i in range(n)]  # drops the remainder
    for step in range(n - 1):
        send, receive = (rank - step - 1) % n, (rank - step - 2) % n
        incoming = torch.empty_like(chunks[receive])
        pending = dist.isend(chunks[send], (rank + 1) % n)
        dist.recv(incoming, (rank - 1) % n)
        pending.wait()
        chunks[receive] += incoming
    for step in range(n - 1):
        send, receive = (rank - step) % n, (rank - step - 1) % n
        pending = dist.isend(chunks[send], (rank + 1) % n)
        dist.recv(chunks[receive], (rank - 1) % n)
        pending.wait()


def test_naive_reference_passes():
    verdict = check_naive_allreduce(naive_reference)
    assert verdict.passed and isinstance(verdict, Verdict), verdict


def test_naive_mistakes_get_their_hint():
    assert "the result never reached it" in check_naive_allreduce(naive_never_sends_back).message
    assert "summed twice" in check_naive_allreduce(naive_sums_twice).message
    wrong_hub = check_naive_allreduce(naive_wrong_hub)
    assert not wrong_hub and "never finished" in wrong_hub.message and "same hub" in wrong_hub.message
    assert "switched off" in check_naive_allreduce(naive_uses_all_reduce).message
    assert "pass your function itself" in check_naive_allreduce(42).message


def test_ring_reference_passes():
    verdict = check_ring_allreduce(ring_reference)
    assert verdict.passed, verdict


def test_ring_mistakes_get_their_hint():
    assert "all-gather" in check_ring_allreduce(ring_without_allgather).message
    assert "tensor_split" in check_ring_allreduce(ring_even_sizes_only).message
    not_a_ring = check_ring_allreduce(naive_reference)  # the right answer, through a hub
    assert not not_a_ring and "this is not a ring" in not_a_ring.message
