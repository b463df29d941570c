"""`traced()`: record the transfers labkit.comm's collectives make on this rank, as `Transfer`s."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from labkit.comm.torch_transport import resolve_transport
from labkit.comm.transport import Transfer, Transport

__all__ = ["traced"]


@contextmanager
def traced(transport: Transport | None = None, *, group=None) -> Iterator[list[Transfer]]:
    """Record every transfer labkit.comm's collectives make on this rank inside the block: those on `group`
    (None: the whole world), or on `transport`. Sources and destinations are group ranks, like the algorithm's.

    >>> import labkit, torch
    >>> from labkit import comm
    >>> def first_transfer():
    ...     with comm.traced() as events:
    ...         comm.ring_allreduce(torch.ones(4))
    ...     return events[0].key()    # (step, phase, src, dst, chunk, nbytes): rank r starts with chunk r-1
    >>> labkit.run(first_transfer, world_size=2)
    [(0, 'reduce-scatter', 0, 1, 1, 8), (0, 'reduce-scatter', 1, 0, 0, 8)]
    """
    transport = resolve_transport(transport, group, "traced")
    previous, transport.events = transport.events, []
    try:
        yield transport.events
    finally:
        transport.events = previous
