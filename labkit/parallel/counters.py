"""How many collectives labkit.parallel makes, and how many bytes they carry, counted on each rank, by kind and
by the group they run on.

    count_collectives()                every kind: all_reduce, all_gather, reduce_scatter, broadcast, send
    counter.by_group[ranks]            the same, for the group of those global ranks
    counter.by_axis(mesh)              the same, for each axis of a Mesh: {"dp": .., "pp": .., "tp": .., ...}
    count_allreduces()                 the all_reduces only
    record_collective(kind, t, group)  what every collective of labkit.parallel calls just before it goes out
    all_reduce_sum(t, group)           a counted all_reduce (SUM) on a process group

The collectives themselves are _collectives.py's, each counted there, where it is called; this module holds the
counters they report to, and opens them.

Data parallelism (data.py; ZeRO and FSDP through flat_shards.py), the tensor-parallel layers (tensor.py) and the
pipeline executor all report here, so one counter sees them all: the way to check a paper's communication count
(Megatron's one all_reduce per MLP forward, DDP's one per bucket) against what the code really sent, and, on a 3D
mesh, which axis sent it (Narayanan et al. 2021, section 3: each axis's traffic decides which links it belongs
on). Only labkit's own collectives are counted, not torch's (a torch DistributedDataParallel beside it counts
nothing).

How the groups are told apart:

- By their global ranks, in group-rank order (`labkit.groups.group_ranks`), not by the ProcessGroup object: the
  world is `None` to one caller and `dist.group.WORLD` to another, a Mesh axis spanning the whole world hands
  back the world's group itself, and ranks are what a layout (`mesh_layout`) and `labkit.plan` name. They are
  also plain tuples, so a counter returns from a rank (labkit.run pickles it). Two groups with the same ranks
  count as one: they join the same processes, over the same links.
- `by_axis(mesh)`: a group of two or more ranks through this rank is at most one axis's (two axes' groups meet
  only at this rank). The one-rank group, this rank alone, is every size-1 axis's group at once (and the
  world's, in a world of one): its ranks cannot say which axis asked, and a collective on it moves nothing over
  any link. It is reported as "alone", under no axis, so an axis of size 1 reads zero, as the ring's
  (N - 1) / N does for N = 1. Groups on no axis of the mesh (the world, in a mesh with more than one axis over
  1; a hand-made sub-group) are reported under their ranks tuple.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from labkit import groups
from labkit.parallel._collectives import all_reduce, counting, record_collective
from labkit.parallel.mesh import AXES

__all__ = ["ALONE", "AllReduceCounter", "CollectiveCounter", "Traffic", "all_reduce_sum", "count_allreduces",
           "count_collectives", "record_collective"]

ALONE = "alone"  # by_axis's key for the one-rank group: this rank alone, every size-1 axis's group


@dataclass(eq=False)  # counters are told apart by identity (nested blocks), never by value
class Traffic:
    """Collectives by kind ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send"): `calls[kind]`,
    and `nbytes[kind]`, each tensor's size summed: for an all_gather, this rank's contribution, padded to the
    largest; for a reduce_scatter, the whole buffer reduced; for a send, the tensor sent. Both are
    collections.Counter, so a kind never called reads 0, and `.total()` sums the kinds."""
    calls: Counter = field(default_factory=Counter)
    nbytes: Counter = field(default_factory=Counter)

    def add(self, kind: str, nbytes: int) -> None:
        """One more call of collective `kind`, to which this rank handed `nbytes`."""
        self.calls[kind] += 1
        self.nbytes[kind] += nbytes


@dataclass(eq=False)
class CollectiveCounter(Traffic):
    """Collectives made by labkit.parallel on this rank: `calls` and `nbytes` by kind (see Traffic), all groups
    together, and `by_group`, a Traffic per group, keyed by the group's global ranks in group-rank order (the
    world of 4: (0, 1, 2, 3)); `by_axis(mesh)` reads those per axis of a Mesh. Summed over the groups, the
    calls and bytes are `calls` and `nbytes`."""
    by_group: dict[tuple[int, ...], Traffic] = field(default_factory=dict)

    def record(self, kind: str, nbytes: int, ranks: tuple[int, ...]) -> None:
        """One collective of `kind`, `nbytes` from this rank, on the group of global ranks `ranks`."""
        self.add(kind, nbytes)
        self.by_group.setdefault(ranks, Traffic()).add(kind, nbytes)

    def by_axis(self, mesh) -> dict[str | tuple[int, ...], Traffic]:
        """This rank's traffic per axis of `mesh` (a labkit.parallel.Mesh, this rank's): "dp", "pp" and "tp"
        always (an axis that sent nothing reads an empty Traffic), then ALONE ("alone": the one-rank group, every
        size-1 axis's) and groups on no axis of the mesh, under their ranks tuple, when they were used. See the
        module's docstring for why a size-1 axis's collectives go to "alone".

        Example: dp=2 x tp=2 on 4 ranks, two all_reduces of 3 floats over tp and one over dp, one over the world::

            >>> import labkit, torch
            >>> from labkit.parallel import Mesh, all_reduce_sum, count_collectives
            >>> def per_axis():
            ...     mesh = Mesh(dp=2, tp=2)
            ...     t = torch.ones(3, device=labkit.device())
            ...     with count_collectives() as counted:
            ...         all_reduce_sum(t, mesh.group("tp"))
            ...         all_reduce_sum(t, mesh.group("tp"))
            ...         all_reduce_sum(t, mesh.group("dp"))
            ...         all_reduce_sum(t)                        # the world: on no axis of this mesh
            ...     return {key: traffic.nbytes.total() for key, traffic in counted.by_axis(mesh).items()}
            >>> labkit.run(per_axis, world_size=4)[0]
            {'dp': 12, 'pp': 0, 'tp': 24, (0, 1, 2, 3): 12}
        """
        axes = getattr(mesh, "axes", AXES)  # a Mesh with a cp axis has four
        axis_of = {tuple(groups.group_ranks(mesh.group(axis))): axis for axis in axes if mesh.size(axis) > 1}
        per_axis: dict[str | tuple[int, ...], Traffic] = {axis: Traffic() for axis in axes}
        for ranks in sorted(self.by_group, key=lambda r: (len(r) > 1, r)):  # ALONE first, then by ranks
            key = axis_of.get(ranks, ALONE if len(ranks) == 1 else ranks)
            per_axis[key] = self.by_group[ranks]
        return per_axis


@dataclass(eq=False)
class AllReduceCounter:
    """All_reduces made by labkit.parallel on this rank: `calls`, and `nbytes` (each tensor's size, summed)."""
    calls: int = 0
    nbytes: int = 0

    def record(self, kind: str, nbytes: int, ranks: tuple[int, ...]) -> None:
        """Count it if `kind` is "all_reduce", whatever the group."""
        if kind == "all_reduce":
            self.calls += 1
            self.nbytes += nbytes


def count_collectives():
    """Count every collective labkit.parallel makes inside the block, on this rank, by kind and by group (a
    CollectiveCounter): the all_reduces of data parallelism and of the tensor-parallel layers, the all_gathers
    of the latter, the reduce-scatters and all_gathers of ZeRO and FSDP, the broadcasts that make replicas
    identical and the sends between pipeline stages. Blocks may nest; each counts what happens inside it.

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
    return counting(CollectiveCounter())


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
    return counting(AllReduceCounter())


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
    return all_reduce(tensor, group, async_op=async_op)
