"""Every grader against a catalogue of wrong solutions, each rejected with a message that names the mistake,
and right solutions written in different ways, all accepted.

Several wrong ones give the right answer (a ring that passes the whole tensor around, a ring that runs to
the left, a hub that is not rank 0, a hub through the rendezvous store, torch's own collectives): only the
grader's traffic check and its guard catch them.
"""

import json

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional
import torch.distributed.distributed_c10d as c10d

import labkit
from labkit import comm
from labkit.exercises import check_naive_allreduce, check_ring_allreduce, check_sharded_step
from labkit.exercises._kit._runner import GRADERS
from labkit.exercises.sharded_step import padded, unpad_into
from labkit.launch import pools_apart
from labkit.plan.counts import shard_sizes

DEADLOCK_SECONDS = 3.0  # a wrong solution that hangs is stopped after this long (right ones take milliseconds)


def me():
    return labkit.rank(), labkit.world_size()


def bounds(numel, n):
    """(start, length) of each chunk, the sizes tensor_split gives: the first numel % n are one longer."""
    base, extra = divmod(numel, n)
    lengths = [base + (i < extra) for i in range(n)]
    return [(sum(lengths[:i]), lengths[i]) for i in range(n)]


# ---- ring: right solutions, four ways, each safe on NCCL too ---------------------------------------------

def ring_isend_irecv_by_parity(t):
    """The lesson's numbering; every step posts isend and irecv in parity order (even ranks the send first, odd
    ranks the receive, as labkit's Transport.exchange), then waits for both."""
    rank, n = me()
    chunks = list(t.tensor_split(n))
    right, left = (rank + 1) % n, (rank - 1) % n

    def posted(outgoing, incoming):
        if rank % 2 == 0:
            return [dist.isend(outgoing, right), dist.irecv(incoming, left)]
        return [dist.irecv(incoming, left), dist.isend(outgoing, right)]

    for step in range(n - 1):
        send, receive = (rank - step - 1) % n, (rank - step - 2) % n
        incoming = torch.empty_like(chunks[receive])
        for work in posted(chunks[send], incoming):
            work.wait()
        chunks[receive] += incoming
    for step in range(n - 1):
        send, receive = (rank - step) % n, (rank - step - 1) % n
        for work in posted(chunks[send], chunks[receive]):
            work.wait()


def exchange_by_parity(outgoing, incoming, right, left, rank):
    """Blocking send and recv that cannot deadlock: even ranks send first, odd ranks receive first."""
    if rank % 2 == 0:
        dist.send(outgoing, right)
        dist.recv(incoming, left)
    else:
        dist.recv(incoming, left)
        dist.send(outgoing, right)


def ring_blocking_by_parity(t):
    """Another numbering (send chunk r - s, as many tutorials do: rank r completes chunk r + 1), blocking calls."""
    rank, n = me()
    chunks = list(t.tensor_split(n))
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        send, receive = (rank - step) % n, (rank - step - 1) % n
        incoming = torch.empty_like(chunks[receive])
        exchange_by_parity(chunks[send], incoming, right, left, rank)
        chunks[receive] += incoming
    for step in range(n - 1):
        send, receive = (rank - step + 1) % n, (rank - step) % n
        exchange_by_parity(chunks[send], chunks[receive], right, left, rank)


def ring_narrow_and_copy(t):
    """Chunks as t.narrow views; every chunk is received into a buffer, then added or copied in; each step one
    dist.batch_isend_irecv that lists the receive first."""
    rank, n = me()
    chunks = [t.narrow(0, start, length) for start, length in bounds(t.numel(), n)]
    right, left = (rank + 1) % n, (rank - 1) % n
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(n - 1):
            offset = 1 if phase == "reduce-scatter" else 0
            send, receive = (rank - step - offset) % n, (rank - step - offset - 1) % n
            buffer = torch.zeros(chunks[receive].numel(), dtype=t.dtype)  # t's dtype, whatever it is
            ops = [dist.P2POp(dist.irecv, buffer, left), dist.P2POp(dist.isend, chunks[send], right)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            if phase == "reduce-scatter":
                chunks[receive].add_(buffer)
            else:
                chunks[receive].copy_(buffer)


def ring_batch_isend_irecv(t):
    """Each step's send and receive posted together with dist.batch_isend_irecv."""
    rank, n = me()
    chunks = list(t.tensor_split(n))
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(2 * (n - 1)):
        reducing = step < n - 1
        s = step if reducing else step - (n - 1)
        send, receive = ((rank - s - 1) % n, (rank - s - 2) % n) if reducing else ((rank - s) % n, (rank - s - 1) % n)
        incoming = torch.empty_like(chunks[receive])
        ops = [dist.P2POp(dist.isend, chunks[send], right), dist.P2POp(dist.irecv, incoming, left)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if reducing:
            chunks[receive] += incoming
        else:
            chunks[receive].copy_(incoming)


# ---- ring: wrong solutions -------------------------------------------------------------------------------

def ring_whole_tensor(t):
    """Right answer: every rank passes the inputs around whole, N-1 times. (N-1) x S bytes per rank."""
    rank, n = me()
    passing, incoming = t.clone(), torch.empty_like(t)
    for _ in range(n - 1):
        pending = dist.isend(passing, (rank + 1) % n)
        dist.recv(incoming, (rank - 1) % n)
        pending.wait()
        t += incoming
        passing.copy_(incoming)


def ring_to_the_left(t):
    """Right answer, mirrored: sends to rank - 1, receives from rank + 1."""
    rank, n = me()
    chunks = list(t.tensor_split(n))
    left, right = (rank - 1) % n, (rank + 1) % n
    for step in range(n - 1):
        send, receive = (rank + step + 1) % n, (rank + step + 2) % n
        incoming = torch.empty_like(chunks[receive])
        pending = dist.isend(chunks[send], left)
        dist.recv(incoming, right)
        pending.wait()
        chunks[receive] += incoming
    for step in range(n - 1):
        send, receive = (rank + step) % n, (rank + step + 1) % n
        pending = dist.isend(chunks[send], left)
        dist.recv(chunks[receive], right)
        pending.wait()


def ring_segmented(t):
    """Right answer and bytes, but every chunk goes as two messages: 4(N-1) of them."""
    rank, n = me()
    chunks = list(t.tensor_split(n))
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(2 * (n - 1)):
        reducing = step < n - 1
        s = step if reducing else step - (n - 1)
        send, receive = ((rank - s - 1) % n, (rank - s - 2) % n) if reducing else ((rank - s) % n, (rank - s - 1) % n)
        incoming = torch.empty_like(chunks[receive])
        for out, into in zip(chunks[send].tensor_split(2), incoming.tensor_split(2), strict=True):
            pending = dist.isend(out, right)
            dist.recv(into, left)
            pending.wait()
        if reducing:
            chunks[receive] += incoming
        else:
            chunks[receive].copy_(incoming)


def ring_off_by_one_chunk(t):
    """Adds what it receives into the chunk it just sent, one chunk off."""
    rank, n = me()
    chunks = list(t.tensor_split(n))
    for step in range(n - 1):
        send = (rank - step - 1) % n
        incoming = torch.empty_like(chunks[send])
        pending = dist.isend(chunks[send].clone(), (rank + 1) % n)
        dist.recv(incoming, (rank - 1) % n)
        pending.wait()
        chunks[send] += incoming
    ring_all_gather(chunks)


def ring_reduce_scatter(chunks):
    rank, n = me()
    for step in range(n - 1):
        send, receive = (rank - step - 1) % n, (rank - step - 2) % n
        incoming = torch.empty_like(chunks[receive])
        pending = dist.isend(chunks[send], (rank + 1) % n)
        dist.recv(incoming, (rank - 1) % n)
        pending.wait()
        chunks[receive] += incoming


def ring_all_gather(chunks):
    rank, n = me()
    for step in range(n - 1):
        send, receive = (rank - step) % n, (rank - step - 1) % n
        pending = dist.isend(chunks[send], (rank + 1) % n)
        dist.recv(chunks[receive], (rank - 1) % n)
        pending.wait()


def ring_without_all_gather(t):
    ring_reduce_scatter(list(t.tensor_split(labkit.world_size())))


def ring_even_sizes_only(t):
    n = labkit.world_size()
    size = t.numel() // n
    chunks = [t[i * size:(i + 1) * size] for i in range(n)]  # drops the remainder
    ring_reduce_scatter(chunks)
    ring_all_gather(chunks)


def ring_sums_twice(t):
    result = t.clone()
    ring_batch_isend_irecv(result)
    t += result


def ring_not_in_place(t):
    result = t.clone()
    ring_batch_isend_irecv(result)
    return result


def ring_new_memory(t):
    result = t.clone()
    ring_batch_isend_irecv(result)
    t.set_(result)


def ring_blocking_sends_deadlock(t):
    """Every rank's blocking send waits for a recv that its neighbour has not reached."""
    rank, n = me()
    incoming = torch.empty_like(t)
    dist.send(t, (rank + 1) % n)
    dist.recv(incoming, (rank - 1) % n)


def ring_isend_then_recv(t):
    """Notebook 03's solution until issue 25: dist.isend, then the blocking dist.recv, then the isend's wait. Right
    on gloo; on NCCL every rank's send waits on its stream for a receive its neighbour posts only after its own
    send."""
    rank, n = me()
    chunks = list(t.tensor_split(n))
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        send, receive = (rank - step - 1) % n, (rank - step - 2) % n
        incoming = torch.empty_like(chunks[receive])
        pending = dist.isend(chunks[send], right)
        dist.recv(incoming, left)
        pending.wait()
        chunks[receive] += incoming
    for step in range(n - 1):
        send, receive = (rank - step) % n, (rank - step - 1) % n
        pending = dist.isend(chunks[send], right)
        dist.recv(chunks[receive], left)
        pending.wait()


def ring_isend_irecv_posted_apart(t):
    """isend and irecv posted one after the other on every rank, both waited: the same order as above on NCCL."""
    rank, n = me()
    chunks = list(t.tensor_split(n))
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(2 * (n - 1)):
        reducing = step < n - 1
        s = step if reducing else step - (n - 1)
        send, receive = ((rank - s - 1) % n, (rank - s - 2) % n) if reducing else ((rank - s) % n, (rank - s - 1) % n)
        incoming = torch.empty_like(chunks[receive])
        for work in (dist.isend(chunks[send], right), dist.irecv(incoming, left)):
            work.wait()
        chunks[receive].add_(incoming) if reducing else chunks[receive].copy_(incoming)


def ring_from_any_source(t):
    rank, n = me()
    chunks = list(t.tensor_split(n))
    for step in range(n - 1):
        send, receive = (rank - step - 1) % n, (rank - step - 2) % n
        incoming = torch.empty_like(chunks[receive])
        pending = dist.isend(chunks[send], (rank + 1) % n)
        dist.recv(incoming)  # from whoever sends
        pending.wait()
        chunks[receive] += incoming
    ring_all_gather(chunks)


def ring_catches_the_guard(t):
    try:
        dist.all_reduce(t)
    except Exception:  # noqa: BLE001 - the point: swallowing the guard's error does not help
        ring_batch_isend_irecv(t)


def labkit_ring(t):
    comm.ring_allreduce(t)


def torch_all_reduce(t):
    dist.all_reduce(t)


def world_group_allreduce(t):
    dist.group.WORLD.allreduce([t]).wait()


def c10d_all_reduce(t):
    c10d.all_reduce(t)


def backend_allreduce(t):
    dist.group.WORLD._get_backend(t.device).allreduce([t]).wait()


def c10d_operator(t):
    group = c10d._get_default_group()
    torch.ops.c10d.allreduce_([t], group, dist.ReduceOp.SUM, None, False)[1].wait()


def functional_all_reduce(t):
    t.copy_(functional.all_reduce(t, "sum", dist.group.WORLD))


def in_a_group_of_its_own(t):
    dist.all_reduce(t, group=dist.new_group(list(range(labkit.world_size()))))


def all_gather_object_sum(t):
    everyone = [None] * labkit.world_size()
    dist.all_gather_object(everyone, t)
    t.copy_(sum(everyone))


def gather_then_scatter(t):
    rank, n = me()
    pieces = [torch.empty_like(t) for _ in range(n)] if rank == 0 else None
    dist.gather(t, pieces, dst=0)
    dist.scatter(t, [sum(pieces)] * n if rank == 0 else None, src=0)


def torch_reduce_scatter_all_gather(t):
    n = labkit.world_size()
    mine = torch.empty_like(t.tensor_split(n)[labkit.rank()])
    dist.reduce_scatter(mine, list(t.tensor_split(n)))
    dist.all_gather(list(t.tensor_split(n)), mine)


def reduce_then_broadcast(t):
    dist.reduce(t, dst=0)
    dist.broadcast(t, src=0)


# ---- hub: right solutions, four ways ---------------------------------------------------------------------

def hub_blocking(t):
    """The lesson's solution: blocking recv and send."""
    rank, n = me()
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


def hub_isend_irecv(t):
    """Everything posted at once, then waited for."""
    rank, n = me()
    if rank == 0:
        incoming = [torch.empty_like(t) for _ in range(1, n)]
        for work in [dist.irecv(buffer, src) for src, buffer in enumerate(incoming, start=1)]:
            work.wait()
        t += sum(incoming)
        for work in [dist.isend(t, dst) for dst in range(1, n)]:
            work.wait()
    else:
        dist.isend(t, 0).wait()
        dist.irecv(t, 0).wait()


def hub_buffer_then_copy(t):
    """The sum is built in a new tensor and copied into t at the end, on every rank."""
    rank, n = me()
    result = t.clone()
    if rank == 0:
        for src in range(1, n):
            incoming = torch.zeros_like(t)
            dist.recv(incoming, src)
            result = result + incoming
        for dst in range(1, n):
            dist.send(result, dst)
    else:
        dist.send(t, 0)
        dist.recv(result, 0)
    t.copy_(result)


def hub_batch_isend_irecv(t):
    rank, n = me()
    if rank == 0:
        incoming = [torch.empty_like(t) for _ in range(1, n)]
        receives = [dist.P2POp(dist.irecv, buffer, src) for src, buffer in enumerate(incoming, start=1)]
        for work in dist.batch_isend_irecv(receives):
            work.wait()
        t += sum(incoming)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, dst) for dst in range(1, n)]):
            work.wait()
    else:
        result = torch.empty_like(t)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, 0), dist.P2POp(dist.irecv, result, 0)]):
            work.wait()
        t.copy_(result)


# ---- hub: wrong solutions --------------------------------------------------------------------------------

def hub_irecv_before_isend(t):
    """Every other rank posts the receive of the sum before its send, then waits for both: right on gloo; on NCCL
    rank 1's stream waits in its receive while rank 0 waits in its receive from rank 1."""
    rank, n = me()
    if rank == 0:
        hub_blocking(t)
    else:
        result = torch.empty_like(t)
        for work in (dist.irecv(result, 0), dist.isend(t, 0)):
            work.wait()
        t.copy_(result)


def hub_never_sends_back(t):
    rank, n = me()
    if rank == 0:
        incoming = torch.empty_like(t)
        for src in range(1, n):
            dist.recv(incoming, src)
            t += incoming
    else:
        dist.send(t, 0)


def hub_leaves_sum_twice(t):
    rank, _ = me()
    if rank == 0:
        hub_blocking(t)
    else:
        dist.send(t, 0)
        result = torch.empty_like(t)
        dist.recv(result, 0)
        t += result


def hub_ranks_disagree(t):
    """Rank 0 runs the hub code, the others send to the last rank, which waits for rank 0: a hang."""
    rank, n = me()
    if rank == 0:
        hub_blocking(t)
    else:
        dist.send(t, n - 1 if rank != n - 1 else 0)
        dist.recv(t, 0)


def hub_is_the_last_rank(t):
    """Right answer, consistent, but through rank N-1."""
    rank, n = me()
    hub = n - 1
    if rank == hub:
        incoming = torch.empty_like(t)
        for src in range(n - 1):
            dist.recv(incoming, src)
            t += incoming
        for dst in range(n - 1):
            dist.send(t, dst)
    else:
        dist.send(t, hub)
        dist.recv(t, hub)


def hub_forgets_itself(t):
    if labkit.rank() == 0:
        t.zero_()  # the hub drops its own contribution
    hub_blocking(t)


def hub_not_in_place(t):
    result = t.clone()
    hub_blocking(result)
    return result


def hub_through_the_store(t):
    """Right answer, through the rendezvous store: not one message."""
    t.copy_(_store_sum(t))


def hub_sends_objects(t):
    rank, n = me()
    if rank == 0:
        for src in range(1, n):
            box = [None]
            dist.recv_object_list(box, src)
            t += box[0]
        for dst in range(1, n):
            dist.send(t, dst)
    else:
        dist.send_object_list([t], 0)
        dist.recv(t, 0)


def hub_broadcasts_objects(t):
    rank, n = me()
    if rank == 0:
        incoming = torch.empty_like(t)
        for src in range(1, n):
            dist.recv(incoming, src)
            t += incoming
    else:
        dist.send(t, 0)
    box = [t]
    dist.broadcast_object_list(box, src=0)
    t.copy_(box[0])


def labkit_hub(t):
    comm.naive_allreduce(t)


# ---- ring and hub: handles never waited (on gloo a dropped isend can lose its message: the ranks hang) -----

def ring_isend_never_waited(t):
    """The lesson's ring with dist.isend before the blocking dist.recv, but the isend's handle is dropped."""
    rank, n = me()
    chunks = list(t.tensor_split(n))
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        send, receive = (rank - step - 1) % n, (rank - step - 2) % n
        incoming = torch.empty_like(chunks[receive])
        dist.isend(chunks[send], right)
        dist.recv(incoming, left)
        chunks[receive] += incoming
    for step in range(n - 1):
        dist.isend(chunks[(rank - step) % n], right)
        dist.recv(chunks[(rank - step - 1) % n], left)


def ring_batch_waits_only_the_recv(t):
    """dist.batch_isend_irecv, but only the receive's request is waited ("I only need what comes in")."""
    rank, n = me()
    chunks = list(t.tensor_split(n))
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(2 * (n - 1)):
        reducing = step < n - 1
        s = step if reducing else step - (n - 1)
        send, receive = ((rank - s - 1) % n, (rank - s - 2) % n) if reducing else ((rank - s) % n, (rank - s - 1) % n)
        incoming = torch.empty_like(chunks[receive])
        requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, chunks[send].clone(), right),
                                           dist.P2POp(dist.irecv, incoming, left)])
        requests[1].wait()
        chunks[receive].add_(incoming) if reducing else chunks[receive].copy_(incoming)


def hub_isend_never_waited(t):
    """Every send is a dist.isend whose handle is dropped; the receives block."""
    rank, n = me()
    if rank == 0:
        incoming = torch.empty_like(t)
        for src in range(1, n):
            dist.recv(incoming, src)
            t += incoming
        for dst in range(1, n):
            dist.isend(t, dst)
    else:
        dist.isend(t, 0)
        dist.recv(t, 0)


def hub_irecv_never_waited(t):
    """The hub posts every dist.irecv at once and sums the buffers without waiting for them."""
    rank, n = me()
    if rank == 0:
        incoming = [torch.empty_like(t) for _ in range(1, n)]
        for src, buffer in enumerate(incoming, start=1):
            dist.irecv(buffer, src)
        t += sum(incoming)
        for dst in range(1, n):
            dist.send(t, dst)
    else:
        dist.send(t, 0)
        dist.recv(t, 0)


# ---- issue 27: what a right solution must not depend on (dtype, size), state across calls, what the messages
# carried, and ready-made helpers out of the guard's sight ----------------------------------------------------

def ring_float32_buffers(t):
    """ring_narrow_and_copy as first written: receive buffers made with torch.zeros(n), float32 whatever t is."""
    rank, n = me()
    chunks = [t.narrow(0, start, length) for start, length in bounds(t.numel(), n)]
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(2 * (n - 1)):
        reducing = step < n - 1
        s = step if reducing else step - (n - 1)
        send, receive = ((rank - s - 1) % n, (rank - s - 2) % n) if reducing else ((rank - s) % n, (rank - s - 1) % n)
        buffer = torch.zeros(chunks[receive].numel())
        for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, buffer, left),
                                            dist.P2POp(dist.isend, chunks[send], right)]):
            work.wait()
        chunks[receive].add_(buffer) if reducing else chunks[receive].copy_(buffer)


def hub_float32_buffer(t):
    """The hub receives into torch.empty(n): float32, which only fits a float32 t."""
    rank, n = me()
    if rank == 0:
        incoming = torch.empty(t.numel())
        for src in range(1, n):
            dist.recv(incoming, src)
            t += incoming
        for dst in range(1, n):
            dist.send(t, dst)
    else:
        dist.send(t, 0)
        dist.recv(t, 0)


def ring_sends_float32_copies(t):
    """Every chunk goes as chunk.float() ("the wire is float32"), and is received into a float32 buffer."""
    rank, n = me()
    chunks = list(t.tensor_split(n))
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(2 * (n - 1)):
        reducing = step < n - 1
        s = step if reducing else step - (n - 1)
        send, receive = ((rank - s - 1) % n, (rank - s - 2) % n) if reducing else ((rank - s) % n, (rank - s - 1) % n)
        incoming = torch.empty(chunks[receive].numel())
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, chunks[send].float(), right),
                                            dist.P2POp(dist.irecv, incoming, left)]):
            work.wait()
        chunks[receive].add_(incoming) if reducing else chunks[receive].copy_(incoming)


_KEPT = {}  # the wrong rows' state across calls, on each rank


def hub_keeps_its_first_result(t):
    """Computes the sum once, keeps it in a global and hands it out on every later call."""
    if "sum" not in _KEPT:
        hub_blocking(t)
        _KEPT["sum"] = t.clone()
    t.copy_(_KEPT["sum"])


class RingWithACache:
    """Keeps the last result on the class, per (size, dtype), as if the tensor were the same on every call."""

    results = {}

    def __call__(self, t):
        key = (t.numel(), t.dtype, labkit.world_size())
        if key not in RingWithACache.results:
            ring_batch_isend_irecv(t)
            RingWithACache.results[key] = t.clone()
        t.copy_(RingWithACache.results[key])


ring_caches_on_the_class = RingWithACache()
ring_caches_on_the_class.__name__ = "ring_caches_on_the_class"  # a callable object, named for the test ids


class RingReusingBuffers:
    """Right: keeps its receive buffers between calls (per size and dtype), which is state that does not change the
    answer."""

    buffers = {}

    def __call__(self, t):
        rank, n = me()
        chunks = list(t.tensor_split(n))
        right, left = (rank + 1) % n, (rank - 1) % n
        for step in range(2 * (n - 1)):
            reducing = step < n - 1
            s = step if reducing else step - (n - 1)
            send, receive = ((rank - s - 1) % n, (rank - s - 2) % n) if reducing else \
                ((rank - s) % n, (rank - s - 1) % n)
            key = (chunks[receive].numel(), t.dtype)
            incoming = RingReusingBuffers.buffers.setdefault(key, torch.empty_like(chunks[receive]))
            exchange_by_parity(chunks[send].clone(), incoming, right, left, rank)
            chunks[receive].add_(incoming) if reducing else chunks[receive].copy_(incoming)


ring_reusing_buffers = RingReusingBuffers()
ring_reusing_buffers.__name__ = "ring_reusing_buffers"


def hub_decoy_messages(t):
    """The hub's messages, right in number and size, sent from scratch zeros; the sum comes from the store."""
    total = _store_sum(t)
    scratch = torch.zeros_like(t)
    hub_blocking(scratch)
    t.copy_(total)


def ring_decoy_messages(t):
    """A ring's messages, right in number, sizes and order, sent from a scratch copy; the sum from the store."""
    total = _store_sum(t)
    ring_batch_isend_irecv(torch.zeros_like(t))
    t.copy_(total)


def ring_recomputes_the_inputs(t):
    """The right messages, but the sum recomputed from what rank r's input used to be, (r + 1) x [1, ..., numel]:
    t x N(N+1)/2 / (r + 1). Inputs drawn per grading cannot be recomputed."""
    rank, n = me()
    ring_batch_isend_irecv(t.clone())
    t.mul_(n * (n + 1) / 2 / (rank + 1))


_ROUNDS = {}


def _store_sum(t):
    """Every rank's t, summed through the rendezvous store, under a key of its own per call."""
    rank, n = me()
    store = c10d._get_default_store()
    round_ = _ROUNDS[n] = _ROUNDS.get(n, 0) + 1  # every rank calls as often: the same round on each
    key = f"catalogue-decoy/{n}/{round_}/"
    store.set(key + str(rank), json.dumps(t.tolist()))
    return sum(torch.tensor(json.loads(store.get(key + str(r))), dtype=t.dtype) for r in range(n))


def in_a_thread(helper, t):
    """Run `helper(t)` in a thread of its own, swallowing what it raises (the guard does not see other threads'
    stacks)."""
    import threading

    def run():
        try:
            helper(t)
        except Exception:  # noqa: BLE001 - the student's thread swallows every error
            pass

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()


def labkit_ring_in_a_thread(t):
    in_a_thread(comm.ring_allreduce, t)


def labkit_ring_in_a_thread_then_own(t):
    """Tries labkit.comm's ring from a thread, then does the exercise itself: the try still counts."""
    in_a_thread(comm.ring_allreduce, t.clone())
    ring_batch_isend_irecv(t)


def labkit_tree_in_a_thread(t):
    in_a_thread(comm.tree_allreduce, t)


def labkit_reduce_scatter_then_allgather(t):
    """labkit.comm's two halves of the ring, which make the AllReduce."""
    t.copy_(comm.ring_allgather(comm.ring_reduce_scatter(t)))


def labkit_reduce_then_broadcast(t):
    comm.broadcast(comm.reduce(t, 0), 0)


RING_RIGHT = [ring_isend_irecv_by_parity, ring_blocking_by_parity, ring_narrow_and_copy, ring_batch_isend_irecv,
              ring_reusing_buffers]
HUB_RIGHT = [hub_blocking, hub_isend_irecv, hub_buffer_then_copy, hub_batch_isend_irecv]

NCCL_HANG = "it works here on gloo, but it would hang on NCCL (GPUs)"
COLLECTIVES = [  # (wrong solution, what its verdict must say): the same for the ring and the hub
    (torch_all_reduce, "called torch.distributed.all_reduce"),
    (world_group_allreduce, "called ProcessGroup.allreduce"),
    (c10d_all_reduce, "called torch.distributed.distributed_c10d.all_reduce"),
    (backend_allreduce, "backend's allreduce"),
    (c10d_operator, "called torch.ops.c10d.allreduce_"),
    (functional_all_reduce, "called torch.ops._c10d_functional.all_reduce"),
    (all_gather_object_sum, "called torch.distributed.all_gather_object"),
    (in_a_group_of_its_own, "called torch.distributed.new_group. Work in the default process group"),
    (gather_then_scatter, "called torch.distributed.gather"),
    (torch_reduce_scatter_all_gather, "called torch.distributed.reduce_scatter"),
    (reduce_then_broadcast, "called torch.distributed.reduce."),
]
RING_WRONG = COLLECTIVES + [
    (labkit_ring, "labkit.comm's collectives (ring_allreduce, naive_allreduce, tree_allreduce"),
    (ring_catches_the_guard, "torch.distributed.all_reduce (and caught the error"),
    (ring_whole_tensor, "carried the whole tensor"),
    (ring_to_the_left, "its left neighbour only: your ring runs the wrong way"),
    (hub_blocking, "rank 0 sent to rank(s) [2]. In a ring each rank sends only to its right neighbour"),
    (ring_segmented, "sent 8 messages"),
    (ring_off_by_one_chunk, "of t.tensor_split(3) are wrong"),
    (ring_without_all_gather, "the all-gather that passes the finished chunks around the ring is missing"),
    (ring_even_sizes_only, "t.tensor_split(3)'s chunks hold ["),
    (ring_sums_twice, "summed twice"),
    (ring_not_in_place, "must work in place"),
    (ring_new_memory, "pointed at new memory"),
    (ring_blocking_sends_deadlock, "a blocking dist.send waits for its recv"),
    (ring_from_any_source, "A dist.recv without src takes a message from whichever rank sends first"),
    (ring_isend_never_waited, "rank 0's isend handle(s) were never waited"),
    (ring_batch_waits_only_the_recv, "rank 0's isend handle(s) were never waited"),
    (ring_isend_then_recv, NCCL_HANG),
    (ring_isend_irecv_posted_apart, NCCL_HANG),
]
DTYPE = "every message of an AllReduce carries t's own dtype"
CALLED_AGAIN = "the sum the first call gave, not this call's sum"
CAUGHT = " (and caught the error; it still counts). labkit.comm's collectives"
RING_WRONG += [  # issue 27: one row per honest mistake each class lets through
    (ring_float32_buffers, DTYPE),  # fixed parameters: float32 only
    (ring_sends_float32_copies, "sent a float32 tensor"),
    (ring_caches_on_the_class, CALLED_AGAIN),  # state across calls
    (ring_decoy_messages, "message at step 1 of the reduce-scatter carried"),  # counting is not checking
    (ring_recomputes_the_inputs, "of t.tensor_split(3) are wrong ("),  # a 1-element chunk may be right by chance
    (labkit_ring_in_a_thread, "called labkit.comm's ring_allreduce" + CAUGHT),  # ready-made, out of sight
    (labkit_ring_in_a_thread_then_own, "called labkit.comm's ring_allreduce" + CAUGHT),
    (labkit_reduce_scatter_then_allgather, "called labkit.comm's ring_reduce_scatter. labkit.comm's collectives"),
]
HUB_WRONG = COLLECTIVES + [
    (labkit_hub, "labkit.comm's collectives (ring_allreduce, naive_allreduce, tree_allreduce"),
    (hub_never_sends_back, "the result never reached it"),
    (hub_leaves_sum_twice, "summed twice"),
    (hub_ranks_disagree, "the same hub, rank 0"),
    (hub_is_the_last_rank, "every message has rank 0, the hub, at one end"),
    (hub_forgets_itself, "the sum is missing rank 0's input"),
    (hub_not_in_place, "must work in place"),
    (hub_through_the_store, "rank 1 sent 0 bytes to rank 0, expected "),
    (hub_sends_objects, "a pickled Python object in two messages"),
    (hub_broadcasts_objects, "called torch.distributed.broadcast_object_list"),
    (hub_isend_never_waited, "isend handle(s) were never waited"),
    (hub_irecv_never_waited, "rank 0's irecv handle(s) were never waited (1 irecv from rank 1, 1 irecv from rank 2)"),
    (hub_irecv_before_isend, NCCL_HANG),
    (hub_float32_buffer, "received into a float32 tensor"),  # issue 27: fixed parameters
    (hub_keeps_its_first_result, CALLED_AGAIN),  # state across calls
    (hub_decoy_messages, "'s message to rank 0 carried [0.0"),  # counting is not checking
    (labkit_tree_in_a_thread, "called labkit.comm's tree_allreduce" + CAUGHT),  # ready-made, out of sight
    (labkit_reduce_then_broadcast, "called labkit.comm's reduce. labkit.comm's collectives"),
]


def ids(entries):
    return [fn.__name__ for fn, _ in entries]


@pytest.fixture
def warm_ranks():
    """Ranks of 2, 3 and 4 that have imported this module: a grader stops the pool of its last case when a wrong
    solution leaves it out of step, and on a loaded machine a fresh pool importing this module can take longer than
    DEADLOCK_SECONDS, inside the first case's call."""
    with pools_apart(GRADERS):  # the graders' own ranks
        for world_size in (2, 3, 4):
            labkit.run(me, world_size=world_size)


@pytest.mark.usefixtures("warm_ranks")
@pytest.mark.parametrize("solution", RING_RIGHT, ids=lambda fn: fn.__name__)
def test_ring_grader_accepts_right_solutions_written_differently(solution):
    verdict = check_ring_allreduce(solution)
    assert verdict.passed, verdict


@pytest.mark.usefixtures("warm_ranks")
@pytest.mark.parametrize("solution", HUB_RIGHT, ids=lambda fn: fn.__name__)
def test_hub_grader_accepts_right_solutions_written_differently(solution):
    verdict = check_naive_allreduce(solution)
    assert verdict.passed, verdict


@pytest.mark.usefixtures("warm_ranks")
@pytest.mark.parametrize(("mistake", "phrase"), RING_WRONG, ids=ids(RING_WRONG))
def test_ring_grader_rejects_each_mistake_and_names_it(mistake, phrase):
    verdict = check_ring_allreduce(mistake, timeout_seconds=DEADLOCK_SECONDS)
    assert not verdict and phrase in verdict.message and "rank " in verdict.message, verdict


@pytest.mark.usefixtures("warm_ranks")
@pytest.mark.parametrize(("mistake", "phrase"), HUB_WRONG, ids=ids(HUB_WRONG))
def test_hub_grader_rejects_each_mistake_and_names_it(mistake, phrase):
    verdict = check_naive_allreduce(mistake, timeout_seconds=DEADLOCK_SECONDS)
    assert not verdict and phrase in verdict.message and "rank " in verdict.message, verdict


def test_the_isend_before_recv_ring_is_told_why_it_hangs_on_nccl_and_what_to_do():
    """The old reference solution: every rank's stream would wait in its send (the one-stream NCCL model of
    labkit.comm.stream_model), said rank by rank, with both safe orders."""
    message = check_ring_allreduce(ring_isend_then_recv).message
    assert ("these ranks would wait for ever: rank 0 in its send to rank 1; rank 1 in its send to rank 2; "
            "rank 2 in its send to rank 0.") in message, message  # the first case has 3 ranks
    for advice in ("posted together in one dist.batch_isend_irecv, every request it returns waited",
                   "or ordered by rank parity", "\"blocking for the GPU\"", "it frees the CPU, not the stream"):
        assert advice in message, (advice, message)
    assert "P2POp(" not in message, message  # the orders are named; the code is the hints' (issue 26)


def test_a_ring_that_hangs_is_advised_the_orders_that_are_safe_on_nccl():
    message = check_ring_allreduce(ring_blocking_sends_deadlock, timeout_seconds=DEADLOCK_SECONDS).message
    assert "dist.batch_isend_irecv" in message and "A dist.isend before a blocking dist.recv is not enough" in message
    assert "post sends with dist.isend before the blocking dist.recv" not in message  # the advice until issue 25


# ---- ZeRO-1's sharded step (notebook 11): right solutions ------------------------------------------------

def cut(param, grad):
    """This rank, N, and the shard_sizes slices of param and grad (views)."""
    rank, n = me()
    sizes = shard_sizes(param.numel(), n)
    return rank, n, sizes, param.split(sizes), grad.split(sizes)


def step_padded_all_gather(param, grad, lr):
    """The notebook's solution: reduce_scatter with lists, all_gather of slices padded to the largest."""
    rank, n, sizes, params, grads = cut(param, grad)
    my_grad = torch.empty_like(grads[rank])
    dist.reduce_scatter(my_grad, list(grads))
    params[rank].sub_(lr * my_grad / n)
    mine = param.new_zeros(sizes[0])
    mine[:sizes[rank]] = params[rank]
    gathered = [param.new_zeros(sizes[0]) for _ in range(n)]
    dist.all_gather(gathered, mine)
    for p, g in zip(params, gathered, strict=True):
        p.copy_(g[:p.numel()])


def step_broadcast_from_owners(param, grad, lr):
    """tensor_split instead of shard_sizes, ReduceOp.AVG, and one broadcast per owner into param's own slices."""
    rank, n = me()
    params, grads = param.tensor_split(n), grad.tensor_split(n)
    my_grad = torch.empty_like(grads[rank])
    dist.reduce_scatter(my_grad, list(grads), op=dist.ReduceOp.AVG)
    params[rank].sub_(my_grad, alpha=lr)
    for owner in range(n):
        dist.broadcast(params[owner], src=owner)


def step_tensor_api(param, grad, lr):
    """The single-tensor API (reduce_scatter_single, all_gather_single: torch 2.13's names for
    reduce_scatter_tensor and all_gather_into_tensor) on rows padded to the largest slice, then one cat."""
    rank, n, sizes, params, grads = cut(param, grad)
    rows = grad.new_zeros(n * sizes[0])
    for row, g in zip(rows.view(n, -1), grads, strict=True):
        row[:g.numel()] = g
    my_grad = grad.new_zeros(sizes[0])
    dist.reduce_scatter_single(my_grad, rows)
    mine = param.new_zeros(sizes[0])
    mine[:sizes[rank]] = params[rank] - lr * my_grad[:sizes[rank]] / n
    gathered = param.new_zeros(n * sizes[0])
    dist.all_gather_single(gathered, mine)
    param.copy_(torch.cat([row[:size] for row, size in zip(gathered.view(n, -1), sizes, strict=True)]))


def step_gather_list_then_cat(param, grad, lr):
    """The updated slice made outside param and padded with F.pad, gathered into a list, one cat copied in."""
    rank, n, sizes, params, grads = cut(param, grad)
    my_grad = torch.empty_like(grads[rank])
    dist.reduce_scatter(my_grad, list(grads), op=dist.ReduceOp.AVG)
    mine = torch.nn.functional.pad(params[rank] - lr * my_grad, (0, sizes[0] - sizes[rank]))
    gathered = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(gathered, mine)
    param.copy_(torch.cat([g[:size] for g, size in zip(gathered, sizes, strict=True)]))


def step_sgd_optimizer_on_slice(param, grad, lr):
    """torch.optim.SGD on a copy of the owned slice (the optimizer ZeRO-1 shards), its first use under the guard;
    async collectives, each waited for."""
    rank, n, sizes, params, grads = cut(param, grad)
    my_grad = torch.empty_like(grads[rank])
    dist.reduce_scatter(my_grad, list(grads), async_op=True).wait()
    shard = torch.nn.Parameter(params[rank].clone())
    shard.grad = my_grad / n
    torch.optim.SGD([shard], lr=lr).step()
    params[rank].copy_(shard.detach())
    works = [dist.broadcast(params[owner], src=owner, async_op=True) for owner in range(n)]
    for work in works:
        work.wait()


# ---- ZeRO-1's sharded step: wrong solutions --------------------------------------------------------------

def gather_padded(param, params, sizes, rank, n):
    """The padded all-gather of the right solution, on any split `params` with `sizes`."""
    largest = max(sizes)
    mine = param.new_zeros(largest)
    mine[:sizes[rank]] = params[rank]
    gathered = [param.new_zeros(largest) for _ in range(n)]
    dist.all_gather(gathered, mine)
    for p, g in zip(params, gathered, strict=True):
        p.copy_(g[:p.numel()])


def step_sums(param, grad, lr):
    rank, n, sizes, params, grads = cut(param, grad)
    my_grad = torch.empty_like(grads[rank])
    dist.reduce_scatter(my_grad, list(grads))
    params[rank].sub_(lr * my_grad)  # no / n
    gather_padded(param, params, sizes, rank, n)


def step_without_reduce_scatter(param, grad, lr):
    """Each owner updates its slice with its own gradient, then the slices are gathered."""
    rank, n, sizes, params, grads = cut(param, grad)
    params[rank].sub_(lr * grads[rank])
    gather_padded(param, params, sizes, rank, n)


def step_local_sgd(param, grad, lr):
    param -= lr * grad


def step_without_all_gather(param, grad, lr):
    rank, n, sizes, params, grads = cut(param, grad)
    my_grad = torch.empty_like(grads[rank])
    dist.reduce_scatter(my_grad, list(grads))
    params[rank].sub_(lr * my_grad / n)


def step_even_sizes_only(param, grad, lr):
    """Slices of numel // N elements: the remainder is never updated."""
    rank, n = me()
    size = param.numel() // n
    params, grads = list(param[:n * size].split(size)), list(grad[:n * size].split(size))
    my_grad = torch.empty_like(grads[rank])
    dist.reduce_scatter(my_grad, grads)
    params[rank].sub_(lr * my_grad / n)
    gather_padded(param, params, [size] * n, rank, n)


def step_last_slice_one_short(param, grad, lr):
    """The last slice stops one element early (an off-by-one in its end)."""
    rank, n, sizes, _, _ = cut(param, grad)
    sizes = sizes[:-1] + [sizes[-1] - 1]
    params, grads = param[:-1].split(sizes), grad[:-1].split(sizes)
    my_grad = torch.empty_like(grads[rank])
    dist.reduce_scatter(my_grad, list(grads))
    params[rank].sub_(lr * my_grad / n)
    gather_padded(param, params, sizes, rank, n)


def step_last_rank_takes_the_rest(param, grad, lr):
    """A split that covers the vector once, but not shard_sizes': the last rank takes the remainder."""
    rank, n = me()
    numel = param.numel()
    sizes = [numel // n] * (n - 1) + [numel - (n - 1) * (numel // n)]
    params, grads = param.split(sizes), grad.split(sizes)
    my_grad = torch.empty_like(grads[rank])
    dist.reduce_scatter(my_grad, list(grads))
    params[rank].sub_(lr * my_grad / n)
    gather_padded(param, params, sizes, rank, n)


def step_all_reduce_then_all_gather(param, grad, lr):
    """Right values; the all-reduce moves twice a reduce-scatter's bytes."""
    rank, n, sizes, params, grads = cut(param, grad)
    dist.all_reduce(grad)
    params[rank].sub_(lr * grads[rank] / n)
    gather_padded(param, params, sizes, rank, n)


def step_all_reduce_everywhere(param, grad, lr):
    """Right values and DDP's traffic, but every rank updates the whole vector."""
    dist.all_reduce(grad)
    param -= lr * grad / labkit.world_size()


def step_gathers_gradients(param, grad, lr):
    """Reduce-scatter, then all-gather the averaged gradient slices and update the whole vector: not sharded."""
    rank, n, sizes, _, grads = cut(param, grad)
    my_grad = torch.empty_like(grads[rank])
    dist.reduce_scatter(my_grad, list(grads))
    average = grad.new_zeros(param.numel())
    averaged = list(average.split(sizes))
    averaged[rank].copy_(my_grad / n)
    gather_padded(average, averaged, sizes, rank, n)
    param -= lr * average


def step_gathers_whole_gradients(param, grad, lr):
    """Every rank all-gathers every rank's whole gradient: (N-1) x S bytes per rank."""
    n = labkit.world_size()
    everyone = [torch.empty_like(grad) for _ in range(n)]
    dist.all_gather(everyone, grad)
    param -= lr * sum(everyone) / n


def step_returns(param, grad, lr):
    result = param.clone()
    step_padded_all_gather(result, grad, lr)
    return result


def step_new_memory(param, grad, lr):
    result = param.clone()
    step_padded_all_gather(result, grad, lr)
    param.data = result.double()


def step_float32_buffers(param, grad, lr):
    """Buffers made with the default dtype: fine for float32, an error in a float64 step."""
    rank, n, sizes, params, grads = cut(param, grad)
    my_grad = torch.empty(sizes[rank], device=param.device)
    dist.reduce_scatter(my_grad, list(grads))
    params[rank].sub_(lr * my_grad / n)
    gather_padded(param, params, sizes, rank, n)


def step_unpadded_all_gather(param, grad, lr):
    rank, n, sizes, params, grads = cut(param, grad)
    my_grad = torch.empty_like(grads[rank])
    dist.reduce_scatter(my_grad, list(grads))
    params[rank].sub_(lr * my_grad / n)
    dist.all_gather(list(params), params[rank].clone())


def step_skips_empty_slice(param, grad, lr):
    """A rank that owns nothing leaves early: the others wait for it in the all-gather."""
    rank, _, sizes, _, _ = cut(param, grad)
    if sizes[rank] == 0:
        return
    step_padded_all_gather(param, grad, lr)


def step_all_gather_never_waited(param, grad, lr):
    """The padded all-gather started with async_op=True and copied out without wait()."""
    rank, n, sizes, params, grads = cut(param, grad)
    my_grad = torch.empty_like(grads[rank])
    dist.reduce_scatter(my_grad, list(grads))
    params[rank].sub_(lr * my_grad / n)
    mine = param.new_zeros(sizes[0])
    mine[:sizes[rank]] = params[rank]
    gathered = [param.new_zeros(sizes[0]) for _ in range(n)]
    dist.all_gather(gathered, mine, async_op=True)
    for p, g in zip(params, gathered, strict=True):
        p.copy_(g[:p.numel()])


def step_reduce_scatter_never_waited(param, grad, lr):
    """The reduce-scatter started with async_op=True, never waited for; the update reads my_grad at once."""
    rank, n, sizes, params, grads = cut(param, grad)
    my_grad = torch.empty_like(grads[rank])
    dist.reduce_scatter(my_grad, list(grads), async_op=True)
    params[rank].sub_(lr * my_grad / n)
    for owner in range(n):
        dist.broadcast(params[owner], src=owner)


def step_sends(param, grad, lr):
    rank, n, sizes, params, grads = cut(param, grad)
    for owner in range(n):
        if owner != rank:
            dist.isend(grads[owner], owner)


def step_catches_the_guard(param, grad, lr):
    try:
        dist.all_gather_object([None] * labkit.world_size(), grad)
    except Exception:  # noqa: BLE001 - the point: swallowing the guard's error does not help
        step_padded_all_gather(param, grad, lr)


def step_functional(param, grad, lr):
    grad.copy_(functional.all_reduce(grad, "sum", dist.group.WORLD))
    param -= lr * grad / labkit.world_size()


def step_reduce_then_broadcast(param, grad, lr):
    dist.reduce(grad, dst=0)
    if labkit.rank() == 0:
        param -= lr * grad / labkit.world_size()
    dist.broadcast(param, src=0)


def step_forgets_to_unpad(param, grad, lr):
    """The notebook's padded rows, updated and gathered right, never copied back into param."""
    rank, n = me()
    grads, params = padded(grad, n).view(n, -1), padded(param, n).view(n, -1)
    my_grad = torch.empty_like(grads[rank])
    dist.reduce_scatter(my_grad, list(grads))
    params[rank].sub_(lr * my_grad / n)
    dist.all_gather(list(params), params[rank].clone())


def step_padded_rows(param, grad, lr):
    """Notebook 11's way: the rows of the padded copies (labkit.exercises.sharded_step.padded), AVG, a broadcast
    per owner, then unpad_into."""
    rank, n = me()
    grads, params = padded(grad, n).view(n, -1), padded(param, n).view(n, -1)
    my_grad = torch.empty_like(grads[rank])
    dist.reduce_scatter(my_grad, list(grads), op=dist.ReduceOp.AVG)
    params[rank] -= lr * my_grad
    for owner in range(n):
        dist.broadcast(params[owner], src=owner)
    unpad_into(param, params, n)


STEP_RIGHT = [step_padded_rows, step_padded_all_gather, step_broadcast_from_owners, step_tensor_api,
              step_gather_list_then_cat, step_sgd_optimizer_on_slice]
STEP_WRONG = [  # (wrong solution, what its verdict must say)
    (step_sums, "the sum of the gradients over the ranks, not their average: the reduce-scatter sums"),
    (step_without_reduce_scatter, "the gradients were never summed over the ranks. The reduce-scatter is missing"),
    (step_local_sgd, "it updated with its own gradient, not the average over the ranks. After the step the ranks"),
    (step_without_all_gather, "After the step the ranks disagree. The reduce-scatter and the update worked; the "
                                "all-gather is missing"),
    (step_even_sizes_only, "element 6 is unchanged (expected"),
    (step_last_slice_one_short, "element 5 is unchanged (expected [5.53333]). They are in rank 2's slice"),
    (step_last_rank_takes_the_rest, "rank 0 sent [-2.26667, -0.8, 0] into the all-gather; its slice, elements 0 to 2"),
    (step_all_reduce_then_all_gather, "1.5 x ZeRO-1's 2(N-1)/N x S"),
    (step_all_reduce_everywhere, "the right values and DDP's traffic, but nothing is sharded"),
    (step_gathers_gradients, "sent its slice of the averaged gradient into the all-gather"),
    (step_gathers_whole_gradients, "rank 0 sent 48 bytes in its collectives (an all_gather of 72 bytes"),
    (step_returns, "returned the updated parameters in a new tensor, but its param is unchanged"),
    (step_forgets_to_unpad, "its param is unchanged: the step must update param itself, in place (a padded copy's "
                            "rows reach param only through unpad_into)"),
    (step_new_memory, "pointed at new memory (param.data = ... or param.set_(...)) (it is now float64 on cpu"),
    (step_float32_buffers, "Make every buffer like the tensor it holds a piece of"),
    (step_unpadded_all_gather, "gloo's all_gather wants every rank's tensor the same size"),
    (step_skips_empty_slice, "rank(s) [2, 3] had returned. Every rank must make the same collectives"),
    (step_all_gather_never_waited, "rank 0 started an all_gather of 24 bytes in chunks of [8] (sends 16) with "
                                   "async_op=True and never waited for it"),
    (step_reduce_scatter_never_waited, "rank 0 started a reduce_scatter of 24 bytes in chunks of [8] (sends 16) "
                                       "with async_op=True and never waited for it"),
    (step_sends, "called torch.distributed.isend. This step is built from collectives"),
    (step_catches_the_guard, "torch.distributed.all_gather_object (and caught the error; it still counts)"),
    (step_functional, "called torch.ops._c10d_functional.all_reduce"),
    (step_reduce_then_broadcast, "called torch.distributed.reduce. ZeRO-1's step needs two collectives only"),
]


@pytest.mark.parametrize("solution", STEP_RIGHT, ids=lambda fn: fn.__name__)
def test_sharded_step_grader_accepts_right_solutions_written_differently(solution):
    verdict = check_sharded_step(solution)
    assert verdict.passed, verdict


@pytest.mark.parametrize(("mistake", "phrase"), STEP_WRONG, ids=ids(STEP_WRONG))
def test_sharded_step_grader_rejects_each_mistake_and_names_it(mistake, phrase):
    verdict = check_sharded_step(mistake, timeout_seconds=DEADLOCK_SECONDS)
    assert not verdict and phrase in verdict.message and "rank " in verdict.message, verdict
