"""Broadcast and Reduce by hand, along a binomial tree: ceil(log2 N) steps instead of N-1.

In the broadcast, at step k every rank that already has the data (relative rank v < 2^k) sends it
to v + 2^k; the reduce runs the same tree backwards, adding as it goes. Cost: lg(p) x (alpha + n beta)
(Thakur, Rabenseifner & Gropp 2005).
"""

from __future__ import annotations

import torch

from labkit.comm.ops import combiner, finish
from labkit.comm.torch_transport import resolve_transport
from labkit.comm.transport import Transport, check_rank, flat_buffer, write_back

__all__ = ["broadcast", "reduce"]


def broadcast(tensor: torch.Tensor, src: int = 0, *, group=None, transport: Transport | None = None) -> torch.Tensor:
    """Copy rank `src`'s tensor into the `tensor` of every rank of `group` (None: all ranks), in place, like
    `dist.broadcast`; returns it.

    `src` is a group rank (0 .. group size - 1), like the ring's neighbours: on ranks {1, 3} of 4, src=1 is
    global rank 3. (dist.broadcast takes a global `src`, or a group one as `group_src`.)

    >>> import labkit, torch
    >>> from labkit import comm, groups
    >>> def from_the_last_odd_rank():
    ...     odd, even = groups.new_group([1, 3]), groups.new_group([0, 2])
    ...     mine = odd if labkit.rank() % 2 else even
    ...     return comm.broadcast(torch.tensor([labkit.rank()]), src=1, group=mine).item()
    >>> labkit.run(from_the_last_odd_rank, world_size=4)     # group rank 1: global 2 and global 3
    [2, 3, 2, 3]
    """
    transport = resolve_transport(transport, group, "broadcast")
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


def reduce(tensor: torch.Tensor, dst: int = 0, op="sum", *, group=None,
           transport: Transport | None = None) -> torch.Tensor:
    """Reduce the `tensor` of every rank of `group` (None: all ranks) into rank `dst`'s, like `dist.reduce`;
    other ranks' tensors are unchanged. `dst` is a group rank, as in `broadcast`."""
    transport = resolve_transport(transport, group, "reduce")
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
