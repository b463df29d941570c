"""The four things a collective algorithm needs from the network: the `Transport` it is written against.

A `Transport` posts sends and receives of tensors between ranks (non-blocking, so that a ring can
reduce one segment while the next is still on the wire), counts the bytes, records transfers while
`traced()` is on, and lets every rank see every other rank's tensor signature before an algorithm
starts, so that mismatched shapes fail with an error instead of a hang. `TorchTransport`
(labkit.comm.torch_transport) does this over torch.distributed point-to-point (gloo or NCCL);
`labkit.comm.simulate` has an in-memory one. How each tensor travels is labkit.comm.wire's job.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from labkit.checks import shown, whole
from labkit.comm.wire import describe_signature, signature
from labkit.groups import check_gathered

__all__ = ["Pending", "Transfer", "Transport", "check_rank", "flat_buffer", "write_back"]

HEADER_TAG = 1 << 20  # for the signature exchange; data tags stay below it


@dataclass(frozen=True)
class Transfer:
    """One tensor moving from `src` to `dst`: the unit a trace records and an animation draws.

    step: the algorithm's step (ring_allreduce: 0 .. 2(N-1)-1); phase: "reduce-scatter", "all-gather",
    "gather", "broadcast" or "reduce"; chunk: which of the N chunks (None for a whole tensor);
    start/end: seconds (time.perf_counter on a real run, the alpha-beta model in a simulation). On CUDA
    tensors they are when the host posted and finished waiting for the transfer, not when the GPU ran it."""

    step: int
    phase: str
    src: int
    dst: int
    chunk: int | None
    nbytes: int
    start: float = 0.0
    end: float = 0.0

    def key(self) -> tuple:
        """Everything but the times: equal for a real run and a simulation of the same call."""
        return (self.step, self.phase, self.src, self.dst, self.chunk, self.nbytes)


class Pending(Protocol):
    """A posted send or receive: wait() returns once it has completed."""

    def wait(self) -> None: ...


class Transport:
    """Base class: byte counters and tracing; subclasses move the bytes."""

    rank: int
    world_size: int

    def __init__(self):
        self.sent_nbytes = 0
        self.received_nbytes = 0
        self.events: list[Transfer] | None = None  # a list while traced() is on
        self._scratch: dict[tuple, torch.Tensor] = {}

    def _post_send(self, tensor: torch.Tensor, dst: int, tag: int) -> Pending:
        raise NotImplementedError

    def _post_recv(self, tensor: torch.Tensor, src: int, tag: int) -> Pending:
        raise NotImplementedError

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Pending:
        """Start sending `tensor` to rank `dst`; counted in sent_nbytes."""
        self.sent_nbytes += tensor.numel() * tensor.element_size()
        return self._post_send(tensor, dst, tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Pending:
        """Start receiving into `tensor` from rank `src`; counted in received_nbytes."""
        self.received_nbytes += tensor.numel() * tensor.element_size()
        return self._post_recv(tensor, src, tag)

    def exchange(self, send: torch.Tensor, dst: int, receive: torch.Tensor, src: int,
                 tag: int) -> tuple[Pending, Pending]:
        """Start sending `send` to `dst` and receiving `receive` from `src` (one step of a ring).

        Even ranks post the send first, odd ranks the receive, so that where a send blocks until
        matched, neighbours never both wait on a send."""
        if self.rank % 2 == 0:
            sent = self.isend(send, dst, tag)
            return sent, self.irecv(receive, src, tag)
        received = self.irecv(receive, src, tag)
        return self.isend(send, dst, tag), received

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Post several `isend`/`irecv` calls together (see `TorchTransport.batch`); here each is posted as it
        is made, which is the same for a transport whose sends never wait for their receiver."""
        yield

    def signatures(self, mine: list[int], device: torch.device) -> list[list[int]]:
        """Every rank's `mine` (equal-length lists of ints), in rank order, exchanged as tensors on `device`.

        Each rank sends its list straight to every other rank: one round of small messages, where a
        collective would take several. These bookkeeping messages are not counted as traffic. Each
        pair of ranks posts its two messages in the same order (lower rank sends first), so the
        exchange cannot deadlock even where sends block until matched."""
        own = torch.tensor(mine, dtype=torch.int64, device=device)
        theirs, pending = {}, []
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            theirs[peer] = torch.empty_like(own)
            send_first = self.rank < peer
            if send_first:
                pending.append(self._post_send(own, peer, HEADER_TAG))
            pending.append(self._post_recv(theirs[peer], peer, HEADER_TAG))
            if not send_first:
                pending.append(self._post_send(own, peer, HEADER_TAG))
        for p in pending:
            p.wait()
        return [list(mine) if r == self.rank else theirs[r].tolist() for r in range(self.world_size)]

    def now(self) -> float:
        """Seconds, for the start and end of a recorded transfer."""
        return time.perf_counter()

    def scratch(self, numel: int, like: torch.Tensor, slot: int) -> torch.Tensor:
        """A receive buffer of `numel` elements, kept between calls: fresh memory costs a page fault
        per 4 KiB on first touch, which would double the time of a large reduce-scatter."""
        key = (like.dtype, like.device, slot)
        buffer = self._scratch.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._scratch[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buffer[:numel]

    def send(self, tensor: torch.Tensor, dst: int, step: int, phase: str, chunk: int | None = None) -> None:
        """Blocking send of a whole tensor, recorded as one transfer."""
        start = self.now()
        self.isend(tensor, dst, 0).wait()
        self.record(Transfer(step, phase, self.rank, dst, chunk, tensor.numel() * tensor.element_size(),
                             start, self.now()))

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        """Blocking receive into `tensor`."""
        self.irecv(tensor, src, 0).wait()

    def record(self, event: Transfer) -> None:
        """Keep `event` while traced() is on."""
        if self.events is not None:
            self.events.append(event)

    def global_ranks(self) -> list[int]:
        """The global rank of each of this transport's ranks, in rank order: what error messages name."""
        return list(range(self.world_size))

    @property
    def right(self) -> int:
        """The next rank on the ring."""
        return (self.rank + 1) % self.world_size

    @property
    def left(self) -> int:
        """The previous rank on the ring."""
        return (self.rank - 1) % self.world_size

    def check_same_tensors(self, tensor: torch.Tensor, name: str) -> None:
        """Raise on every rank if the ranks passed tensors of different dtype or shape to `name`."""
        theirs = self.signatures(signature(tensor), tensor.device)
        check_gathered([describe_signature(s) for s in theirs], name, "tensors",
                       "Every rank must pass a tensor of the same dtype and shape.", self.global_ranks())


def flat_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view of `tensor` to work in place, or a copy if it is not contiguous (see `write_back`).
    Detached, like the data torch.distributed works on: parameters that require grad work too."""
    data = tensor.detach()
    return data.view(-1) if data.is_contiguous() else data.reshape(-1).clone()


def write_back(tensor: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """Finish an in-place collective: copy `flat` into `tensor` unless it already is its memory."""
    if not (tensor.is_contiguous() and flat.data_ptr() == tensor.data_ptr()):
        tensor.detach().copy_(flat.view(tensor.shape))
    return tensor


def check_rank(transport: Transport, rank: int, name: str) -> None:
    """TypeError (not a number) or ValueError unless `rank` is one of the transport's ranks: a group rank,
    0 .. world_size - 1 (labkit.checks' rule)."""
    if whole(name, rank, minimum=0) >= transport.world_size:
        raise ValueError(f"{name}={shown(rank)}: pass a rank from 0 to {transport.world_size - 1} (its number in "
                         "group=, not its global rank).")
