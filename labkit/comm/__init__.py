"""Collectives by hand, written once against a small transport, run over torch.distributed or simulated.

    naive_allreduce(t)        everyone -> rank 0 -> everyone: the hub's link carries (N-1) x S each way
    ring_allreduce(t)         ring_reduce_scatter then ring_allgather: 2(N-1)/N x S per rank
    ring_reduce_scatter(t)    this rank's chunk, reduced over all ranks
    ring_allgather(chunk)     every rank's chunk, in rank order
    broadcast(t, src)         binomial tree from src
    reduce(t, dst)            binomial tree into dst
    tree_allreduce(t)         reduce into rank 0, then broadcast from it: 2 ceil(log2 N) steps of the whole S

Inside a rank each runs on `group=` (None: the whole world; a group from `labkit.groups.new_group` or a
mesh axis), whose members must all call it, and numbers ranks inside it: src, dst and the ring's
neighbours are group ranks, 0 .. group size - 1. `traced()` records their transfers, and `simulate(...)`
runs the same code on simulated ranks in this process.
"""

from labkit.comm.naive import naive_allreduce
from labkit.comm.ring import ring_allgather, ring_allreduce, ring_reduce_scatter
from labkit.comm.simulator import run_simulated, simulate
from labkit.comm.torch_transport import TorchTransport, default_transport
from labkit.comm.tracing import traced
from labkit.comm.transport import Transfer, Transport
from labkit.comm.tree import broadcast, reduce, tree_allreduce

__all__ = ["TorchTransport", "Transfer", "Transport", "broadcast", "default_transport", "naive_allreduce", "reduce",
           "ring_allgather", "ring_allreduce", "ring_reduce_scatter", "run_simulated", "simulate", "traced",
           "tree_allreduce"]
