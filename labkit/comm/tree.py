"""Broadcast and Reduce by hand, along a binomial tree: ceil(log2 N) steps instead of N-1.

In the broadcast, at step k every rank that already has the data (relative rank v < 2^k) sends it
to v + 2^k; the reduce runs the same tree backwards, adding as it goes. Cost: lg(p) x (alpha + n beta)
(Thakur, Rabenseifner & Gropp 2005).
"""

from __future__ import annotations

import torch

from labkit.comm.ops import combiner, finish
from labkit.comm.transport import Transport, check_rank, default_transport, flat_buffer, write_back


def broadcast(tensor: torch.Tensor, src: int = 0, *, transport: Transport | None = None) -> torch.Tensor:
    """Copy rank `src`'s tensor into every rank's `tensor`, in place, like `dist.broadcast`; returns it."""
    transport = transport or default_transport()
    check_rank(transport, src, "broadcast's src")
    transport.check_same_tensors(tensor, "broadcast")
    n, v = transport.world_size, (transport.rank - src) % transport.world_size
    flat = flat_buffer(tensor)
    mask, step = 1, 0
    while mask < n:
        if v < mask and v + mask < n:
            transport.send(flat, (v + mask + src) % n, step, "broadcast")
        elif mask <= v < 2 * mask:
            transport.recv(flat, (v - mask + src) % n)
        mask, step = mask * 2, step + 1
    return write_back(tensor, flat)


def reduce(tensor: torch.Tensor, dst: int = 0, op="sum", *, transport: Transport | None = None) -> torch.Tensor:
    """Reduce every rank's `tensor` into rank `dst`'s, like `dist.reduce`; other ranks' tensors are unchanged."""
    transport = transport or default_transport()
    check_rank(transport, dst, "reduce's dst")
    transport.check_same_tensors(tensor, "reduce")
    combine = combiner(op, tensor.dtype)
    n, v = transport.world_size, (transport.rank - dst) % transport.world_size
    partial = tensor.detach().reshape(-1).clone()
    incoming = transport.scratch(partial.numel(), partial, slot=0)
    mask, step = 1, 0
    while mask < n:
        if v & mask:
            transport.send(partial, (v - mask + dst) % n, step, "reduce")
            break
        if v + mask < n:
            transport.recv(incoming, (v + mask + dst) % n)
            combine(partial, incoming)
        mask, step = mask * 2, step + 1
    if transport.rank == dst:
        finish(op, partial, n)
        tensor.detach().copy_(partial.view(tensor.shape))
    return tensor
