"""labkit.parallel's communication in one place: every collective the package's parallelisms make goes out
through here, counted where it is called (picotron keeps each parallelism's communication in one small file the
same way, tensor_parallel/tp_communications.py). Package-private: labkit.parallel does not re-export it;
counters.py opens the counters and re-exports record_collective.

    all_reduce(t, group, async_op)               the group's sum of `t`, in place, counted as "all_reduce" of t
    broadcast(t, group_src, group, async_op)     group rank group_src's `t` to every rank, counted as "broadcast"
    all_gather(out, t, group, async_op)          every rank's `t` end to end in `out`, counted as "all_gather" of t
    reduce_scatter(out, t, group, async_op)      this rank's part of the sum of `t`, counted as "reduce_scatter"
    all_gather_by_broadcasts(out, t, group, ..)  all_gather's result and count, one broadcast per rank (for gloo)
    reduce_scatter_by_all_reduce(t, group, ..)   reduce_scatter's count, the whole sum in `t` (for gloo)
    all_to_all(out, t, out_splits, in_splits, ..)  rows of `t` to each group rank, counted as "all_to_all" of t
    all_to_all_sizes(out, t, group)              the split sizes first, equal parts, counted as "all_to_all_sizes"
    record_collective(kind, t, group)            what each of them tells the open counters, before it goes out
    all_gather_single, reduce_scatter_single     torch's collectives under their torch 2.13 names, on any release

Every one of them is `_counted`: record, then call torch.distributed, looked up at each call (a grader that
switches a collective off, or a test that watches one, sees every call). The counting convention, which
labkit.plan's formulas and the notebooks' counted-equals-planned checks rely on: the bytes are what this rank
hands the collective, `t`'s numel x element size (an all_gather: this rank's part; a reduce_scatter: the whole
tensor it sums), on the group named by its global ranks (counters.py says why). Nothing here checks that this
rank is in `group`: all_reduce_sum and the public classes refuse a rank outside it before they get here.

Tensors come as the callers made them, on labkit.device() (tests/unit/test_device_discipline.py treats these
functions as collectives); nothing here moves a tensor to another device.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from labkit import groups

__all__: list[str] = []  # private: labkit.parallel's modules call these; counters.py re-exports record_collective

_open: list = []  # the counters open now, innermost last (counters.count_collectives, count_allreduces)


@contextlib.contextmanager
def counting(counter):
    """Let `counter` (anything with record(kind, nbytes, ranks)) see every collective recorded inside the block."""
    _open.append(counter)
    try:
        yield counter
    finally:
        _open.remove(counter)


def record_collective(kind: str, tensor: torch.Tensor, group=None) -> None:
    """Tell the open counters that this rank makes a collective of `kind` on `tensor` over `group` (None: the
    world; for a send, the group its two stages belong to): every collective of labkit.parallel calls this just
    before it goes out."""
    if not _open:
        return
    nbytes, ranks = tensor.numel() * tensor.element_size(), tuple(groups.group_ranks(group))
    for counter in _open:
        counter.record(kind, nbytes, ranks)


def _counted(kind: str, counted: torch.Tensor, group, collective, *args, **kwargs):
    """The one way out: record a collective of `kind` handing `counted` to `group`, then return
    `collective(*args, group=group, **kwargs)` (torch's work handle with async_op=True, else None)."""
    record_collective(kind, counted, group)
    return collective(*args, group=group, **kwargs)


def all_reduce(tensor: torch.Tensor, group=None, async_op: bool = False):
    """The sum of `tensor` over `group` (None: the world), in place: ReduceOp.SUM, as averages in labkit are a
    sum then a division (AVG is missing or buggy on gloo in some torch releases)."""
    return _counted("all_reduce", tensor, group, dist.all_reduce, tensor, op=dist.ReduceOp.SUM, async_op=async_op)


def broadcast(tensor: torch.Tensor, group_src: int = 0, group=None, async_op: bool = False):
    """Group rank `group_src`'s `tensor` into every rank's `tensor` (torch's `src` is the global rank)."""
    return _counted("broadcast", tensor, group, dist.broadcast, tensor, groups.global_rank(group, group_src),
                    async_op=async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Every group rank's `input` (equal sizes), end to end in group-rank order, into `output`."""
    return _counted("all_gather", input, group, all_gather_single, output, input, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """The group's sum of `input` (group size x output's numel), of which this rank keeps its part in `output`."""
    return _counted("reduce_scatter", input, group, reduce_scatter_single, output, input, async_op=async_op)


def all_to_all(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None = None,
               input_split_sizes: list[int] | None = None, group=None, async_op: bool = False):
    """`input`'s rows, input_split_sizes[r] of them to group rank r in order, and `output` filled with what each
    rank sent this one, output_split_sizes[r] rows from rank r: dist.all_to_all_single, uneven where the sizes say
    (None: equal). Counted as what this rank hands it, the part it keeps included."""
    return _counted("all_to_all", input, group, dist.all_to_all_single, output, input, output_split_sizes,
                    input_split_sizes, async_op=async_op)


def all_to_all_sizes(output: torch.Tensor, input: torch.Tensor, group=None):
    """Equal parts of `input` (split sizes, one per expert) to each group rank, before an uneven all_to_all of the
    rows they size; counted as "all_to_all_sizes"."""
    return _counted("all_to_all_sizes", input, group, dist.all_to_all_single, output, input)


def all_gather_by_broadcasts(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """all_gather's result, and its count, made of one broadcast per group rank into `output`'s pieces, in place:
    gloo's own all-gather copies through a buffer of its own (flat_shards.py)."""
    return _counted("all_gather", input, group, _broadcast_each, output, input, async_op=async_op)


def reduce_scatter_by_all_reduce(tensor: torch.Tensor, group=None, async_op: bool = False):
    """The group's sum of `tensor`, whole, in place, counted as the reduce_scatter the algorithm needs (what NCCL
    moves); each rank then reads its part. On gloo, torch's reduce_scatter is itself an all-reduce of a copy
    (flat_shards.py): this spares the two copies."""
    return _counted("reduce_scatter", tensor, group, dist.all_reduce, tensor, op=dist.ReduceOp.SUM,
                    async_op=async_op)


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """torch.distributed.all_gather_single, the name torch 2.13 gave all_gather_into_tensor (same arguments and
    behaviour; the old name warns there); a release before it, such as the torch a GPU machine brings, has only
    the old name, which is then called. Looked up at each call. Not counted: all_gather counts."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """torch.distributed.reduce_scatter_single (SUM), torch 2.13's name of reduce_scatter_tensor, on any release:
    as all_gather_single. Not counted: reduce_scatter counts."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, group=group, async_op=async_op)


def _broadcast_each(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """`input` into this rank's piece of `output`, then each group rank's piece broadcast from it."""
    pieces = output.view(groups.group_size(group), -1)
    pieces[groups.group_rank(group)].copy_(input)
    works = _AllOf([dist.broadcast(piece, groups.global_rank(group, r), group=group, async_op=True)
                    for r, piece in enumerate(pieces)])
    if async_op:
        return works
    works.wait()
    return None


class _AllOf:
    """Several works as one: wait() waits for each (the broadcasts that make up a gloo all-gather)."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        for work in self.works:
            work.wait()
        return True

    def get_future(self):
        return torch.futures.collect_all([w.get_future() for w in self.works])
