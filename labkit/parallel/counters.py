"""How many collectives labkit.parallel makes, and how many bytes they carry, counted on each rank.

    count_collectives()           every kind: all_reduce, all_gather, broadcast, send (a with block)
    count_allreduces()            the all_reduces only
    record_collective(kind, t)    what every collective of labkit.parallel calls just before it goes out
    all_reduce_sum(t, group)      a counted all_reduce (SUM) on a process group

Data parallelism (data.py), the tensor-parallel layers (tensor.py) and the pipeline executor all report here,
so one counter sees them all: the way to check a paper's communication count (Megatron's one all_reduce per
MLP forward, DDP's one per bucket) against what the code really sent. Only labkit's own collectives are
counted, not torch's (a torch DistributedDataParallel beside it counts nothing).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from labkit import groups

__all__ = ["AllReduceCounter", "CollectiveCounter", "Traffic", "all_reduce_sum", "count_allreduces",
           "count_collectives", "record_collective"]


@dataclass(eq=False)  # counters are told apart by identity (nested blocks), never by value
class Traffic:
    """Collectives by kind: `calls[kind]` and `nbytes[kind]`, both collections.Counter (a kind never called
    reads 0; `.total()` sums the kinds)."""
    calls: Counter = field(default_factory=Counter)
    nbytes: Counter = field(default_factory=Counter)

    def add(self, kind: str, nbytes: int, ranks: tuple[int, ...]) -> None:
        self.calls[kind] += 1
        self.nbytes[kind] += nbytes


@dataclass(eq=False)
class CollectiveCounter(Traffic):
    """Collectives made by labkit.parallel on this rank, by kind ("all_reduce", "all_gather", "broadcast",
    "send"): `calls[kind]` and `nbytes[kind]` (each tensor's size, summed; for an all_gather, this rank's
    contribution, padded to the largest; for a send, the tensor sent). Both are collections.Counter, so a kind
    never called reads 0."""
    by_group: dict[tuple[int, ...], Traffic] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int, ranks: tuple[int, ...]) -> None:
        super().add(kind, nbytes, ranks)
        self.by_group.setdefault(ranks, Traffic()).add(kind, nbytes, ranks)


@dataclass(eq=False)
class AllReduceCounter:
    """All_reduces made by labkit.parallel on this rank: `calls`, and `nbytes` (each tensor's size, summed)."""
    calls: int = 0
    nbytes: int = 0

    def add(self, kind: str, nbytes: int, ranks: tuple[int, ...]) -> None:
        if kind == "all_reduce":
            self.calls += 1
            self.nbytes += nbytes


_counters: list[CollectiveCounter | AllReduceCounter] = []


@contextlib.contextmanager
def _counting(counter):
    _counters.append(counter)
    try:
        yield counter
    finally:
        _counters.remove(counter)


def count_collectives():
    """Count every collective labkit.parallel makes inside the block, on this rank, by kind: the
    all_reduces of data parallelism and of the tensor-parallel layers, the all_gathers of the latter, the
    broadcasts of broadcast_parameters and the sends between pipeline stages. Blocks may nest; each counts
    what happens inside it.

    Example::

        >>> import labkit, torch
        >>> from torch import nn
        >>> from labkit.parallel import ColumnParallelLinear, count_collectives
        >>> def count():
        ...     torch.manual_seed(0)
        ...     layer = ColumnParallelLinear.from_linear(nn.Linear(16, 8), gather_output=True)
        ...     x = torch.randn(4, 16, requires_grad=True)
        ...     with count_collectives() as forward:
        ...         y = layer(x)                     # the parts of y all-gathered
        ...     with count_collectives() as backward:
        ...         y.sum().backward()               # the parts of x.grad all-reduced (Megatron's f, backward)
        ...     return dict(forward.calls), dict(backward.calls)
        >>> labkit.run(count, world_size=2)[0]
        ({'all_gather': 1}, {'all_reduce': 1})
    """
    return _counting(CollectiveCounter())


def count_allreduces():
    """Count the all_reduces that labkit.parallel makes inside the block, on this rank (average_gradients,
    BucketedDDP, the tensor-parallel layers); count_collectives() counts every kind.

    Example::

        >>> import labkit, torch
        >>> from labkit.models import mlp
        >>> from labkit.parallel import average_gradients, count_allreduces
        >>> def count():
        ...     model = mlp()                                  # 6 parameters, 5508 float32 numbers
        ...     model(torch.randn(8, 16)).sum().backward()
        ...     with count_allreduces() as counted:
        ...         average_gradients(model)
        ...     return counted.calls, counted.nbytes
        >>> labkit.run(count, world_size=2)
        [(6, 22032), (6, 22032)]
    """
    return _counting(AllReduceCounter())


def record_collective(kind: str, tensor: torch.Tensor, group=None) -> None:
    """Tell the open counters that this rank makes a collective of `kind` on `tensor` over `group` (None: the
    world; for a send, the group its two stages belong to): every collective of labkit.parallel calls this just
    before it goes out."""
    if not _counters:
        return
    nbytes, ranks = tensor.numel() * tensor.element_size(), tuple(groups.group_ranks(group))
    for counter in _counters:
        counter.add(kind, nbytes, ranks)


def all_reduce_sum(tensor: torch.Tensor, group=None, async_op: bool = False):
    """Sum `tensor` over the ranks of `group` (None: the whole world), in place, and count it as an
    "all_reduce". Returns torch's work handle with async_op=True (wait() on it before reading), else None.

    Averages in labkit are this sum, then a division: ReduceOp.AVG is missing or buggy on gloo in some torch
    releases. A rank outside `group` gets a ValueError (torch's all_reduce would only warn and leave the tensor
    as it was), and nothing is counted.

    Example::

        >>> import labkit, torch
        >>> from labkit.parallel import all_reduce_sum, count_collectives
        >>> def total():
        ...     t = torch.tensor([labkit.rank() + 1.0], device=labkit.device())
        ...     with count_collectives() as counted:
        ...         all_reduce_sum(t)
        ...     return t.item(), dict(counted.nbytes)
        >>> labkit.run(total, world_size=2)
        [(3.0, {'all_reduce': 4}), (3.0, {'all_reduce': 4})]
    """
    groups.require_member("all_reduce_sum", group)
    record_collective("all_reduce", tensor, group)
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
