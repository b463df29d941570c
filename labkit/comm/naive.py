"""AllReduce the naive way: everyone sends to a hub, the hub reduces and sends the result back.

Rank 0 (of the group the call runs on) receives N-1 whole tensors and sends N-1 back: (N-1) x S
bytes each way through one link, growing linearly with N. That link is why this design stops scaling
almost at once, and why the ring (`labkit.comm.ring`) exists.
"""

from __future__ import annotations

import torch

from labkit._refusals import refuse_while_graded
from labkit.comm.ops import combiner, finish
from labkit.comm.torch_transport import resolve_transport
from labkit.comm.transport import Transport, flat_buffer, write_back

__all__ = ["HUB", "naive_allreduce"]

HUB = 0  # a group rank: the hub of a group is its first member


def naive_allreduce(tensor: torch.Tensor, op="sum", *, group=None, transport: Transport | None = None) -> torch.Tensor:
    """Reduce `tensor` across the ranks of `group` (None: all ranks) through the group's rank 0, in place;
    returns it. Same result as `dist.all_reduce(tensor, op, group=group)`."""
    refuse_while_graded("labkit.comm's naive_allreduce")  # the exercise of notebooks 02 and 03, in any thread
    transport = resolve_transport(transport, group, "naive_allreduce")
    transport.check_same_tensors(tensor, "naive_allreduce")
    combine = combiner(op, tensor.dtype)
    flat = flat_buffer(tensor)
    if transport.rank == HUB:
        incoming = transport.scratch(flat.numel(), flat, slot=0)
        for src in range(1, transport.world_size):
            transport.recv(incoming, src)
            combine(flat, incoming)
        finish(op, flat, transport.world_size)
        for dst in range(1, transport.world_size):
            transport.send(flat, dst, step=1, phase="broadcast")
    else:
        transport.send(flat, HUB, step=0, phase="gather")
        transport.recv(flat, HUB)
    return write_back(tensor, flat)
