"""Run the same collective algorithms with no processes: N threads, an in-memory network, a cost model.

`simulate("ring_allreduce", world_size=8, numel=1024)` runs `ring_allreduce` itself on 8 simulated
ranks, so its transfers (step, phase, src, dst, chunk, nbytes) are exactly those of a real run; only
the times come from a model. The model is alpha-beta (Thakur, Rabenseifner & Gropp 2005): a transfer
of n bytes takes alpha + n * beta, and each rank's outgoing and incoming links carry one transfer at a
time, so that a hub receiving from N-1 ranks waits its turn for each.
"""

from __future__ import annotations

import queue
import threading
from collections import defaultdict

import torch

from labkit.checks import choice, whole
from labkit.comm.naive import naive_allreduce
from labkit.comm.ring import ring_allgather, ring_allreduce, ring_reduce_scatter
from labkit.comm.transport import Transfer, Transport
from labkit.comm.tree import broadcast, reduce, tree_allreduce

__all__ = ["ALGORITHMS", "ALPHA_SECONDS", "BETA_SECONDS_PER_BYTE", "SimTransport", "canonical_order", "run_simulated",
           "simulate", "with_model_times"]

# The algorithms `simulate` and `run_simulated` take by name: labkit.comm's kernels, imported from their own
# modules (not from labkit.comm, whose __init__ imports this module).
ALGORITHMS = {kernel.__name__: kernel for kernel in (ring_allreduce, naive_allreduce, ring_reduce_scatter,
                                                     ring_allgather, broadcast, reduce, tree_allreduce)}

ALPHA_SECONDS = 20e-6  # per-message latency of the model
BETA_SECONDS_PER_BYTE = 1 / 10e9  # a 10 GB/s link (GB = 1e9 bytes)
_WAIT_SECONDS = 30.0


class _Done:
    def wait(self) -> None:
        pass


class _Arrival:
    def __init__(self, mailbox: queue.Queue, into: torch.Tensor):
        self.mailbox, self.into = mailbox, into

    def wait(self) -> None:
        try:
            self.into.copy_(self.mailbox.get(timeout=_WAIT_SECONDS))
        except queue.Empty:
            raise RuntimeError("simulated receive never matched by a send: the algorithm deadlocks") from None


class _Network:
    """What the simulated ranks share: one FIFO mailbox per (src, dst, tag)."""

    def __init__(self):
        self.mailboxes: defaultdict[tuple, queue.Queue] = defaultdict(queue.Queue)
        self.lock = threading.Lock()

    def mailbox(self, src: int, dst: int, tag: int) -> queue.Queue:
        with self.lock:
            return self.mailboxes[(src, dst, tag)]


class SimTransport(Transport):
    """One simulated rank's view of the in-memory network."""

    def __init__(self, rank: int, world_size: int, network: _Network, events: list):
        super().__init__()
        self.rank, self.world_size, self._network = rank, world_size, network
        self.events = events

    def _post_send(self, tensor, dst, tag):
        self._network.mailbox(self.rank, dst, tag).put(tensor.clone())
        return _Done()

    def _post_recv(self, tensor, src, tag):
        return _Arrival(self._network.mailbox(src, self.rank, tag), tensor)

    def now(self) -> float:
        return 0.0  # times come from the cost model once the run is over


def run_simulated(algorithm, inputs: list[torch.Tensor], *args, **kwargs):
    """Run `algorithm(inputs[r], *args, transport=...)` on len(inputs) simulated ranks.

    Returns (results in rank order, the rank's transports, every transfer in order)."""
    if isinstance(algorithm, str):
        algorithm = ALGORITHMS[choice("algorithm", algorithm, list(ALGORITHMS))]
    world_size = len(inputs)
    network, events = _Network(), []
    transports = [SimTransport(r, world_size, network, events) for r in range(world_size)]
    results, errors = [None] * world_size, []

    def rank_main(r: int) -> None:
        try:
            results[r] = algorithm(inputs[r], *args, transport=transports[r], **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors.append((r, exc))

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        rank, exc = min(errors, key=lambda e: e[0])
        raise exc
    return results, transports, with_model_times(canonical_order(events))


def simulate(algorithm: str, world_size: int, numel: int, dtype: torch.dtype = torch.float32, *args,
             **kwargs) -> list[Transfer]:
    """The transfers of `algorithm` on `world_size` ranks for a tensor of `numel` elements, timed by the model.

    `algorithm` is one of labkit.comm's kernels by name (ALGORITHMS: "ring_allreduce", "naive_allreduce",
    "ring_reduce_scatter", "ring_allgather", "broadcast", "reduce", "tree_allreduce"). For ring_allgather,
    `numel` is each rank's chunk."""
    world_size, numel = whole("world_size", world_size), whole("numel", numel, minimum=0)
    inputs = [torch.zeros(numel, dtype=dtype) for _ in range(world_size)]
    return run_simulated(algorithm, inputs, *args, **kwargs)[2]


def canonical_order(events: list[Transfer]) -> list[Transfer]:
    """Transfers sorted by step, then sender, then receiver: the order to compare runs in."""
    return sorted(events, key=lambda e: (e.step, e.src, e.dst))


def with_model_times(events: list[Transfer], alpha: float = ALPHA_SECONDS,
                     beta: float = BETA_SECONDS_PER_BYTE) -> list[Transfer]:
    """Give each transfer start and end times under the alpha-beta model (events in canonical order).

    A transfer starts when its sender has finished the previous step, its sender's outgoing link is
    free and its receiver's incoming link is free."""
    ready, step_done = defaultdict(float), defaultdict(float)
    out_free, in_free = defaultdict(float), defaultdict(float)
    timed, current = [], None
    for e in events:
        if e.step != current:
            ready.update(step_done)
            current = e.step
        start = max(ready[e.src], out_free[e.src], in_free[e.dst])
        end = start + alpha + e.nbytes * beta
        out_free[e.src] = in_free[e.dst] = end
        step_done[e.dst] = max(step_done[e.dst], end)
        step_done[e.src] = max(step_done[e.src], end)
        timed.append(Transfer(e.step, e.phase, e.src, e.dst, e.chunk, e.nbytes, start, end))
    return timed
