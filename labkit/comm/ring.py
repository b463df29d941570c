"""Ring AllReduce by hand: ReduceScatter, then AllGather, each N-1 steps between neighbours.

N is the size of the process group the collective runs on (`group=`, None: the whole world), and r a
rank's number inside it: a ring over ranks {1, 3} of 4 has N = 2, and global rank 3 is its r = 1.
The flattened tensor is cut into N chunks (`labkit.plan.shard_sizes`: sizes differ by at most one). In the
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

from labkit._refusals import refuse_while_graded
from labkit.comm.ops import combiner, finish
from labkit.comm.torch_transport import resolve_transport
from labkit.comm.transport import Transfer, Transport, flat_buffer, write_back
from labkit.comm.wire import DTYPES, dtype_index
from labkit.groups import check_gathered
from labkit.plan.counts import shard_sizes

__all__ = ["SEGMENT_NBYTES", "RingStep", "allgather_chunks", "allgather_steps", "allreduce_chunks",
           "reduce_scatter_chunks", "reduce_scatter_steps", "ring_allgather", "ring_allreduce",
           "ring_chunks", "ring_reduce_scatter", "run_ring"]

# Each segment is a message, and each message costs a fixed overhead: on 2 cores over loopback, 4 MiB
# segments beat 256 KiB and 1 MiB ones at every size (benchmarks/collectives.py).
SEGMENT_NBYTES = 4 << 20


def ring_allreduce(tensor: torch.Tensor, op="sum", *, group=None, transport: Transport | None = None) -> torch.Tensor:
    """Reduce `tensor` across the ranks of `group` (None: all ranks), in place, like `dist.all_reduce`; returns it.

    >>> import labkit, torch
    >>> from labkit import comm, groups
    >>> def sum_of_ranks():
    ...     return comm.ring_allreduce(torch.tensor([float(labkit.rank())])).item()
    >>> labkit.run(sum_of_ranks, world_size=4)                 # 0 + 1 + 2 + 3 on every rank
    [6.0, 6.0, 6.0, 6.0]
    >>> def odd_and_even():
    ...     odd, even = groups.new_group([1, 3]), groups.new_group([0, 2])   # every rank makes both
    ...     mine = odd if labkit.rank() % 2 else even
    ...     return comm.ring_allreduce(torch.tensor([float(labkit.rank())]), group=mine).item()
    >>> labkit.run(odd_and_even, world_size=4)                 # 0 + 2 and 1 + 3, at the same time
    [2.0, 4.0, 2.0, 4.0]
    """
    refuse_while_graded("labkit.comm's ring_allreduce")  # the exercise of notebooks 02 and 03, in any thread
    transport = resolve_transport(transport, group, "ring_allreduce")
    transport.check_same_tensors(tensor, "ring_allreduce")
    flat = flat_buffer(tensor)
    allreduce_chunks(transport, ring_chunks(flat, transport.world_size), combiner(op, tensor.dtype))
    finish(op, flat, transport.world_size)
    return write_back(tensor, flat)


def ring_reduce_scatter(tensor: torch.Tensor, op="sum", *, group=None,
                        transport: Transport | None = None) -> torch.Tensor:
    """This rank's chunk of `tensor` (flattened, cut in N = the group's size) reduced across the ranks of `group`
    (None: all ranks); `tensor` is unchanged.

    Like `dist.reduce_scatter_tensor`: group rank r gets chunk r, here for any size (cut by
    `labkit.plan.shard_sizes`: chunks differ by at most one element)."""
    refuse_while_graded("labkit.comm's ring_reduce_scatter")  # the exercise of notebooks 02 and 03, in any thread
    transport = resolve_transport(transport, group, "ring_reduce_scatter")
    transport.check_same_tensors(tensor, "ring_reduce_scatter")
    chunks = ring_chunks(tensor.detach().reshape(-1).clone(), transport.world_size)
    reduce_scatter_chunks(transport, chunks, combiner(op, tensor.dtype))
    finish(op, chunks[transport.rank], transport.world_size)
    return chunks[transport.rank].clone()  # not a view that would keep all N chunks alive


def ring_allgather(chunk: torch.Tensor, *, group=None, transport: Transport | None = None) -> torch.Tensor:
    """The chunks of all ranks of `group` (None: all ranks), flattened and concatenated in group-rank order,
    like `dist.all_gather_into_tensor`.

    Chunks may differ in size (by rank), not in dtype."""
    refuse_while_graded("labkit.comm's ring_allgather")  # the exercise of notebooks 02 and 03, in any thread
    transport = resolve_transport(transport, group, "ring_allgather")
    theirs = transport.signatures([chunk.numel(), dtype_index(chunk.dtype)], chunk.device)
    check_gathered([str(DTYPES[d]).removeprefix("torch.") for _, d in theirs], "ring_allgather", "chunk dtypes",
                   "Chunks may differ in size, not in dtype: pass chunks of one dtype.", transport.global_ranks())
    sizes = [numel for numel, _ in theirs]
    out = torch.empty(sum(sizes), dtype=chunk.dtype, device=chunk.device)
    chunks = list(out.split(sizes))
    chunks[transport.rank].copy_(chunk.reshape(-1))
    allgather_chunks(transport, chunks)
    return out


@dataclass(frozen=True)
class RingStep:
    """One step of a ring phase on this rank: at `step` (the Transfer.step a trace records, counted on through
    both phases of an AllReduce) in `phase` ("reduce-scatter" or "all-gather"), it sends chunk `send` to its right
    neighbour and receives chunk `receive` from its left one, added to its own copy in the reduce-scatter and
    kept as it arrives in the all-gather. `reduce_scatter_steps` and `allgather_steps` list them; `run_ring` runs
    them."""

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


def ring_chunks(flat: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """`flat` cut into `world_size` views by `labkit.plan.shard_sizes` (the first numel % N one element longer)."""
    return list(flat.split(shard_sizes(flat.numel(), world_size)))


def run_ring(transport: Transport, chunks: list[torch.Tensor], steps: list[RingStep], combine=None) -> None:
    """Run ring steps as one pipeline of segments.

    What a rank receives at one step is what it sends at the next, so segment j can travel on as
    soon as it has arrived (and been reduced), while later segments are still on the wire."""
    if steps:
        _SegmentPipeline(transport, chunks, steps, combine).run()


class _SegmentPipeline:
    """One run of `run_ring`: each step's chunks cut into segments of at most SEGMENT_NBYTES, with the
    requests posted for each step (`sends[i]`, `receives[i]`, one per segment) and when it began."""

    def __init__(self, transport: Transport, chunks: list[torch.Tensor], steps: list[RingStep], combine):
        self.transport, self.chunks, self.steps, self.combine = transport, chunks, steps, combine
        self.segments = [_segments(c.numel(), c.element_size()) for c in chunks]
        self.tags_per_step = max(1, max(len(s) for s in self.segments))
        reduces = any(s.phase == "reduce-scatter" for s in steps)
        longest = max(c.numel() for c in chunks) if reduces else 0
        self.buffers = [transport.scratch(longest, chunks[0], slot) for slot in range(2)]
        self.sends: list[list] = [[] for _ in steps]
        self.receives: list[list] = [[] for _ in steps]
        self.started = [0.0] * len(steps)

    def run(self) -> None:
        """Post step 0; then, step by step, take each segment in and pass it on, and finish the step."""
        self.started[0] = self.transport.now()
        self.start(0)
        for i in range(len(self.steps)):
            following = i + 1 < len(self.steps)
            if following:
                self.started[i + 1] = self.transport.now()
            self.take_in(i, pass_on=following)
            if following:
                self.start(i + 1, first=len(self.receives[i]))
            self.finish(i)

    def start(self, i: int, first: int = 0) -> None:
        """Post step i's segments from `first` on (all of them for the first step)."""
        for j in range(first, self.tags_per_step):
            self.post(i, j)

    def incoming(self, i: int) -> torch.Tensor:
        """Where step i receives: a scratch buffer to reduce from in the reduce-scatter, else the chunk itself."""
        step = self.steps[i]
        target = self.chunks[step.receive]
        return self.buffers[i % 2][: target.numel()] if step.phase == "reduce-scatter" else target

    def post(self, i: int, j: int) -> None:
        """Post step i's send of segment j and its receive of segment j (if the chunks have one), together:
        on NCCL as one batch, so that the two directions of the step proceed at once."""
        transport, step = self.transport, self.steps[i]
        tag = step.step * self.tags_per_step + j
        out, into = self.segments[step.send], self.segments[step.receive]
        send = self.chunks[step.send][slice(*out[j])] if j < len(out) else None
        receive = self.incoming(i)[slice(*into[j])] if j < len(into) else None
        if send is not None and receive is not None:
            sent, received = transport.exchange(send, transport.right, receive, transport.left, tag)
            self.sends[i].append(sent)
            self.receives[i].append(received)
        elif send is not None:
            self.sends[i].append(transport.isend(send, transport.right, tag))
        elif receive is not None:
            self.receives[i].append(transport.irecv(receive, transport.left, tag))

    def take_in(self, i: int, pass_on: bool) -> None:
        """Wait for step i's segments in turn, reduce each into its chunk (reduce-scatter), and post the next
        step's segment j as soon as segment j has arrived: it is what the next step sends."""
        step = self.steps[i]
        received, target = self.incoming(i), self.chunks[step.receive]
        for j, pending in enumerate(self.receives[i]):
            pending.wait()
            lo, hi = self.segments[step.receive][j]
            if step.phase == "reduce-scatter":
                self.combine(target[lo:hi], received[lo:hi])
            if pass_on:
                self.post(i + 1, j)

    def finish(self, i: int) -> None:
        """Wait for step i's sends and record the step as one transfer of its whole chunk."""
        for pending in self.sends[i]:
            pending.wait()
        step, transport = self.steps[i], self.transport
        sent = self.chunks[step.send]
        transport.record(Transfer(step.step, step.phase, transport.rank, transport.right, step.send,
                                  sent.numel() * sent.element_size(), self.started[i], transport.now()))


def _segments(numel: int, element_size: int) -> list[tuple[int, int]]:
    """Cut a chunk of `numel` elements into (start, stop) segments of at most SEGMENT_NBYTES."""
    per = max(1, SEGMENT_NBYTES // element_size)
    return [(lo, min(lo + per, numel)) for lo in range(0, numel, per)]
