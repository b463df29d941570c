"""labkit.parallel's counted collectives (_collectives.py) on 4 gloo ranks: each counts what the collectives of
parallel/ recorded before it existed (record_collective(kind, tensor, group) with the tensor this rank hands in:
its kind, numel x element size, the group's global ranks), and leaves what torch's own collective leaves, on
the world and on a pair of ranks, for tensors of several dtypes and sizes."""

import pytest
import torch
import torch.distributed as dist

import labkit
from labkit import groups
from labkit.parallel import count_collectives
from labkit.parallel._collectives import (
    all_gather,
    all_gather_by_broadcasts,
    all_reduce,
    broadcast,
    reduce_scatter,
    reduce_scatter_by_all_reduce,
)

pytestmark = pytest.mark.numerics  # compares floating-point results: make unit runs it again on other kernels

WORLD_SIZE = 4
KINDS = {"all_reduce": "all_reduce", "broadcast": "broadcast", "all_gather": "all_gather",
         "all_gather_by_broadcasts": "all_gather", "reduce_scatter": "reduce_scatter",
         "reduce_scatter_by_all_reduce": "reduce_scatter"}  # each counted collective -> the kind it counts as
CASES = [(None, torch.float64, 5), ("pair", torch.float32, 6), ("pair", torch.int32, 3)]  # group, dtype, numel


def values(numel: int, dtype) -> torch.Tensor:
    """Numbers that differ from rank to rank, on this rank's device."""
    return (torch.arange(numel, device=labkit.device()) * 3 + 10 * labkit.rank() + 1).to(dtype)


def ours(name: str, t: torch.Tensor, group) -> torch.Tensor:
    """What labkit's counted collective `name` leaves, given `t` (the whole tensor for a reduce-scatter)."""
    parts, rank = groups.group_size(group), groups.group_rank(group)
    out = t.new_empty(parts * t.numel() if "gather" in name else t.numel() // parts)
    if name == "all_reduce":
        all_reduce(t, group)
    elif name == "broadcast":
        broadcast(t, 1, group=group)
    elif name == "all_gather":
        all_gather(out, t, group=group)
    elif name == "all_gather_by_broadcasts":
        all_gather_by_broadcasts(out, t, group=group, async_op=True).wait()
    elif name == "reduce_scatter":
        reduce_scatter(out, t, group=group)
    elif name == "reduce_scatter_by_all_reduce":
        reduce_scatter_by_all_reduce(t, group=group, async_op=True).wait()
        return t.view(parts, -1)[rank]  # this rank's part of the whole sum
    return t if name in ("all_reduce", "broadcast") else out


def theirs(name: str, t: torch.Tensor, group) -> torch.Tensor:
    """What torch's own collective of the same kind leaves, given `t`."""
    parts = groups.group_size(group)
    if name == "all_reduce":
        dist.all_reduce(t, group=group)
        return t
    if name == "broadcast":
        dist.broadcast(t, groups.global_rank(group, 1), group=group)
        return t
    if KINDS[name] == "all_gather":
        out = t.new_empty(parts * t.numel())
        dist.all_gather_into_tensor(out, t, group=group)
        return out
    out = t.new_empty(t.numel() // parts)
    dist.reduce_scatter_tensor(out, t, group=group)
    return out


def each_function(group, dtype, numel: int) -> dict[str, tuple]:
    """For each counted collective: (its result equals torch's, its count by group as plain dicts)."""
    mine, whole = values(numel, dtype), values(numel * groups.group_size(group), dtype)
    found = {}
    for name, kind in KINDS.items():
        given = whole if kind == "reduce_scatter" else mine
        with count_collectives() as counted:
            result = ours(name, given.clone(), group)
        found[name] = (torch.equal(result, theirs(name, given.clone(), group)),
                       {ranks: (dict(t.calls), dict(t.nbytes)) for ranks, t in counted.by_group.items()})
    return found


def on_four_ranks() -> list[dict[str, tuple]]:
    pairs = [groups.new_group([0, 2]), groups.new_group([1, 3])]  # every rank makes both, in the same order
    return [each_function(pairs[labkit.rank() % 2] if group == "pair" else group, dtype, numel)
            for group, dtype, numel in CASES]


def test_each_counts_what_the_callers_recorded_and_leaves_what_torch_leaves():
    for rank, cases in enumerate(labkit.run(on_four_ranks, world_size=WORLD_SIZE)):
        for (group, dtype, numel), found in zip(CASES, cases, strict=True):
            ranks = tuple(range(WORLD_SIZE)) if group is None else (rank % 2, rank % 2 + 2)
            assert set(found) == set(KINDS)
            for name, (same, counted) in found.items():
                handed = numel * (len(ranks) if name.startswith("reduce_scatter") else 1)  # the whole tensor summed
                expected = {ranks: ({KINDS[name]: 1}, {KINDS[name]: handed * dtype.itemsize})}
                assert same, (rank, group, dtype, name)
                assert counted == expected, (rank, group, dtype, name, counted)
