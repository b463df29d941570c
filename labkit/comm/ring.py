"""Ring AllReduce by hand: ReduceScatter, then AllGather, each N-1 steps between neighbours.

The flattened tensor is cut into N chunks (sizes differ by at most one element). In the
reduce-scatter, at step s rank r sends chunk (r-s-1) to its right neighbour and adds the chunk
(r-s-2) it receives from its left one; after N-1 steps rank r holds chunk r summed over all ranks,
as torch's reduce_scatter leaves it. In the all-gather, at step s rank r passes chunk (r-s) right,
until every rank holds every chunk. Each rank sends 2(N-1)/N of the tensor in all, however large N
is (Patarasuk & Yuan 2009; Thakur, Rabenseifner & Gropp 2005).

The steps run as one pipeline: what a rank receives at one step is what it sends at the next, so
each segment of a chunk travels on as soon as it has arrived and been added, while later segments
are still on the wire. The additions hide behind the transfers. Each step's send to the right and
receive from the left are posted together (`Transport.exchange`): on NCCL as one
dist.batch_isend_irecv, so that both directions of every link are busy at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit.comm.ops import combiner, finish
from labkit.comm.transport import (
    DTYPES,
    Transfer,
    Transport,
    default_transport,
    dtype_index,
    flat_buffer,
    write_back,
)

# Each segment is a message, and each message costs a fixed overhead: on 2 cores over loopback, 4 MiB
# segments beat 256 KiB and 1 MiB ones at every size (benchmarks/collectives.py).
SEGMENT_NBYTES = 4 << 20


def ring_allreduce(tensor: torch.Tensor, op="sum", *, transport: Transport | None = None) -> torch.Tensor:
    """Reduce `tensor` across all ranks, in place, like `dist.all_reduce`; returns it.

    >>> t = torch.tensor([float(labkit.rank())])     # on 4 ranks
    >>> ring_allreduce(t)                             # every rank: tensor([6.])
    """
    transport = transport or default_transport()
    transport.check_same_tensors(tensor, "ring_allreduce")
    flat = flat_buffer(tensor)
    allreduce_chunks(transport, list(flat.tensor_split(transport.world_size)), combiner(op, tensor.dtype))
    finish(op, flat, transport.world_size)
    return write_back(tensor, flat)


def ring_reduce_scatter(tensor: torch.Tensor, op="sum", *, transport: Transport | None = None) -> torch.Tensor:
    """This rank's chunk of `tensor` (flattened, cut in N) reduced across ranks; `tensor` is unchanged.

    Like `dist.reduce_scatter`: rank r gets chunk r, here for any size (chunks differ by at most one)."""
    transport = transport or default_transport()
    transport.check_same_tensors(tensor, "ring_reduce_scatter")
    chunks = list(tensor.detach().reshape(-1).clone().tensor_split(transport.world_size))
    reduce_scatter_chunks(transport, chunks, combiner(op, tensor.dtype))
    finish(op, chunks[transport.rank], transport.world_size)
    return chunks[transport.rank].clone()  # not a view that would keep all N chunks alive


def ring_allgather(chunk: torch.Tensor, *, transport: Transport | None = None) -> torch.Tensor:
    """All ranks' chunks, flattened and concatenated in rank order, like `dist.all_gather_into_tensor`.

    Chunks may differ in size (by rank), not in dtype."""
    transport = transport or default_transport()
    theirs = transport.signatures([chunk.numel(), dtype_index(chunk.dtype)], chunk.device)
    if len({dtype for _, dtype in theirs}) > 1:
        described = ", ".join(f"rank {r}: {DTYPES[d]}" for r, (_, d) in enumerate(theirs))
        raise ValueError(f"ring_allgather: the ranks passed chunks of different dtypes ({described}).")
    sizes = [numel for numel, _ in theirs]
    out = torch.empty(sum(sizes), dtype=chunk.dtype, device=chunk.device)
    chunks = list(out.split(sizes))
    chunks[transport.rank].copy_(chunk.reshape(-1))
    allgather_chunks(transport, chunks)
    return out


@dataclass(frozen=True)
class RingStep:
    step: int
    phase: str
    send: int  # index of the chunk this rank sends right
    receive: int  # index of the chunk it receives from the left (and reduces, in "reduce-scatter")


def reduce_scatter_steps(transport: Transport, first_step: int = 0) -> list[RingStep]:
    """At step s rank r sends chunk r-s-1 and adds chunk r-s-2: after N-1 steps chunk r is complete."""
    n, r = transport.world_size, transport.rank
    return [RingStep(first_step + s, "reduce-scatter", (r - s - 1) % n, (r - s - 2) % n) for s in range(n - 1)]


def allgather_steps(transport: Transport, first_step: int = 0) -> list[RingStep]:
    """At step s rank r passes chunk r-s on and receives chunk r-s-1: after N-1 steps it has them all."""
    n, r = transport.world_size, transport.rank
    return [RingStep(first_step + s, "all-gather", (r - s) % n, (r - s - 1) % n) for s in range(n - 1)]


def reduce_scatter_chunks(transport: Transport, chunks: list[torch.Tensor], combine) -> None:
    """Afterwards chunks[rank] holds the reduction of every rank's chunks[rank]."""
    run_ring(transport, chunks, reduce_scatter_steps(transport), combine)


def allgather_chunks(transport: Transport, chunks: list[torch.Tensor]) -> None:
    """Afterwards every rank holds every rank's chunks[i] in chunks[i]."""
    run_ring(transport, chunks, allgather_steps(transport))


def allreduce_chunks(transport: Transport, chunks: list[torch.Tensor], combine) -> None:
    """Reduce-scatter then all-gather, run as one pipeline of 2(N-1) steps."""
    steps = reduce_scatter_steps(transport) + allgather_steps(transport, first_step=transport.world_size - 1)
    run_ring(transport, chunks, steps, combine)


def run_ring(transport: Transport, chunks: list[torch.Tensor], steps: list[RingStep], combine=None) -> None:
    """Run ring steps as one pipeline of segments.

    What a rank receives at one step is what it sends at the next, so segment j can travel on as
    soon as it has arrived (and been reduced), while later segments are still on the wire."""
    if not steps:
        return
    segments = [_segments(c.numel(), c.element_size()) for c in chunks]
    tags_per_step = max(1, max(len(s) for s in segments))
    longest = max(c.numel() for c in chunks) if any(s.phase == "reduce-scatter" for s in steps) else 0
    buffers = [transport.scratch(longest, chunks[0], slot) for slot in range(2)]

    def incoming(i: int) -> torch.Tensor:
        step = steps[i]
        target = chunks[step.receive]
        return buffers[i % 2][: target.numel()] if step.phase == "reduce-scatter" else target

    def post(i: int, j: int, sends: list, receives: list) -> None:
        """Post step i's send of segment j and its receive of segment j (if the chunks have one), together:
        on NCCL as one batch, so that the two directions of the step proceed at once."""
        step, tag = steps[i], steps[i].step * tags_per_step + j
        out, into = segments[step.send], segments[step.receive]
        send = chunks[step.send][slice(*out[j])] if j < len(out) else None
        receive = incoming(i)[slice(*into[j])] if j < len(into) else None
        if send is not None and receive is not None:
            sent, received = transport.exchange(send, transport.right, receive, transport.left, tag)
            sends.append(sent)
            receives.append(received)
        elif send is not None:
            sends.append(transport.isend(send, transport.right, tag))
        elif receive is not None:
            receives.append(transport.irecv(receive, transport.left, tag))

    pending_sends, pending_receives, started = [[] for _ in steps], [[] for _ in steps], [0.0] * len(steps)
    started[0] = transport.now()
    for j in range(tags_per_step):
        post(0, j, pending_sends[0], pending_receives[0])
    for i, step in enumerate(steps):
        received, target = incoming(i), chunks[step.receive]
        if i + 1 < len(steps):
            started[i + 1] = transport.now()
        for j, pending in enumerate(pending_receives[i]):
            pending.wait()
            lo, hi = segments[step.receive][j]
            if step.phase == "reduce-scatter":
                combine(target[lo:hi], received[lo:hi])
            if i + 1 < len(steps):
                post(i + 1, j, pending_sends[i + 1], pending_receives[i + 1])
        if i + 1 < len(steps):
            for j in range(len(pending_receives[i]), tags_per_step):
                post(i + 1, j, pending_sends[i + 1], pending_receives[i + 1])
        for pending in pending_sends[i]:
            pending.wait()
        sent = chunks[step.send]
        transport.record(Transfer(step.step, step.phase, transport.rank, transport.right, step.send,
                                  sent.numel() * sent.element_size(), started[i], transport.now()))


def _segments(numel: int, element_size: int) -> list[tuple[int, int]]:
    """Cut a chunk into segments of at most SEGMENT_NBYTES."""
    per = max(1, SEGMENT_NBYTES // element_size)
    return [(lo, min(lo + per, numel)) for lo in range(0, numel, per)]
