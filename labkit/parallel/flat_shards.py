"""A flat vector cut over the ranks of a group: the layout ZeRO's three stages share (zero_buckets.py's buckets for
ZeRO-1 and -2, fsdp_units.py's units for ZeRO-3), and the two collectives that move it.

    FlatLayout(shapes, parts)                   tensors of these shapes end to end, cut over `parts` ranks
    post_all_gather(layout, sent, group)        every rank's slice into one buffer (async, counted)
    post_reduce_scatter(layout, buffer, group)  the buffers summed, each rank receiving its slice (async, counted)
    all_gather_single, reduce_scatter_single    torch's collectives under their torch 2.13 names, on any release
                                                (_collectives.py's, re-exported)

The tensors (each distinct parameter once) are concatenated into one flat vector of `numel` numbers, cut with
labkit.plan.counts.shard_sizes: group rank r owns slice r, `sizes[r]` numbers from `start(r)`. So each rank holds
1/N of it, up to one number (Rajbhandari et al., "ZeRO", SC 2020, section 5; Zhao et al., "PyTorch FSDP",
VLDB 2023, section 3: FSDP's FlatParameter).

torch.distributed's all_gather_single and reduce_scatter_single (the new names of all_gather_into_tensor and
reduce_scatter_tensor; gloo runs both, on the CPU too, in torch 2.13) need the same length from every rank, so
each slice travels padded to `piece` numbers, the largest slice (shard_sizes gives the longer slices first, and
they differ by at most one). A buffer of `parts` x `piece` numbers holds every rank's piece: `compact` moves the
gathered pieces together, so that buffer[:numel] is the flat vector, and `spread` is its inverse, which a
reduce-scatter's input needs. Both work in place: one buffer, no second copy of the whole vector.
_collectives.py counts each collective by what this rank puts in: its piece for an all-gather (a ring
sends N-1 copies of it), its whole buffer for a reduce-scatter (a ring sends (N-1)/N of it).
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from labkit import groups
from labkit.parallel._collectives import (
    all_gather,
    all_gather_by_broadcasts,
    all_gather_single,
    reduce_scatter,
    reduce_scatter_by_all_reduce,
    reduce_scatter_single,
)
from labkit.plan.counts import shard_sizes

__all__ = ["FlatLayout", "all_gather_single", "post_all_gather", "post_reduce_scatter", "reduce_scatter_single"]



class FlatLayout:
    """Tensors of `shapes` laid end to end in one flat vector of `numel` numbers (tensor i from `offsets[i]`),
    cut over `parts` ranks with shard_sizes (`sizes`); each slice travels padded to `piece` = sizes[0].

    >>> layout = FlatLayout([(2, 3), (4,)], parts=4)          # 10 numbers over 4 ranks
    >>> layout.sizes, layout.piece, layout.start(2), layout.owned(1)
    ([3, 3, 2, 2], 3, 6, [(0, 3, 0, 3)])
    >>> buffer = torch.arange(12.0)                          # 4 pieces of 3: the flat vector first
    >>> layout.spread(buffer); buffer                        # ranks 2 and 3 padded with a zero
    tensor([0., 1., 2., 3., 4., 5., 6., 7., 0., 8., 9., 0.])
    >>> layout.compact(buffer); buffer[:layout.numel]
    tensor([0., 1., 2., 3., 4., 5., 6., 7., 8., 9.])
    """

    def __init__(self, shapes, parts: int):
        self.shapes = [torch.Size(shape) for shape in shapes]
        self.offsets = [0, *itertools.accumulate(shape.numel() for shape in self.shapes)]
        self.numel, self.parts = self.offsets[-1], parts
        self.sizes = shard_sizes(self.numel, parts)
        self.piece = self.sizes[0]

    def __repr__(self) -> str:
        return f"FlatLayout(numel={self.numel}, sizes={self.sizes})"

    def start(self, rank: int) -> int:
        """Where group rank `rank`'s slice starts in the flat vector."""
        return sum(self.sizes[:rank])

    def owned(self, rank: int) -> list[tuple[int, int, int, int]]:
        """The tensors `rank`'s slice touches, each as (tensor index, where the slice's part starts in that tensor,
        flattened; where it starts in the slice; how many numbers), in order."""
        lo = self.start(rank)
        hi, found = lo + self.sizes[rank], []
        for i, at in enumerate(self.offsets[:-1]):
            first, stop = max(lo, at), min(hi, self.offsets[i + 1])
            if first < stop:
                found.append((i, first - at, first - lo, stop - first))
        return found

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's view of `flat` (the flat vector, or a buffer that starts with it), in its shape."""
        return [flat[at:at + shape.numel()].view(shape) for at, shape in zip(self.offsets, self.shapes, strict=False)]

    def padded(self, parts: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """One rank's slice, given as `parts` (at least one tensor; an empty one gives the dtype and device), end
        to end and followed by zeros up to `piece` numbers: what each rank sends to an all-gather. No copy when
        the slice is one tensor of `piece` numbers already and no `out` (`piece` numbers to write it into) is
        given."""
        numel = sum(part.numel() for part in parts)
        if out is None and len(parts) == 1 and numel == self.piece:
            return parts[0].reshape(-1)
        out = parts[0].new_empty(self.piece) if out is None else out
        torch.cat([part.reshape(-1) for part in parts], out=out[:numel])
        out[numel:] = 0
        return out

    def compact(self, buffer: torch.Tensor) -> None:
        """Every rank's piece (the shorter slices padded) -> the flat vector at the front of `buffer`, in place."""
        block = self._padded_block(buffer)
        if block is not None:
            start, rows = self._first_padded() * self.piece, block[:, :-1].reshape(-1)  # a copy: no overlap
            buffer[start:start + rows.numel()] = rows

    def spread(self, buffer: torch.Tensor) -> None:
        """The flat vector at the front of `buffer` -> one piece per rank, a zero after each shorter slice, in
        place: `compact`'s inverse."""
        block = self._padded_block(buffer)
        if block is not None:
            start = self._first_padded() * self.piece
            tail = buffer[start:start + block.shape[0] * (self.piece - 1)].clone()
            block[:, :-1] = tail.view(block.shape[0], self.piece - 1)
            block[:, -1] = 0

    def _first_padded(self) -> int:
        """The first rank whose slice is one shorter than `piece`; `parts` when none is."""
        return self.sizes.index(self.piece - 1) if self.sizes[-1] < self.piece else self.parts

    def _padded_block(self, buffer: torch.Tensor) -> torch.Tensor | None:
        """The padded ranks' pieces of `buffer`, one row each; None when every slice is `piece` long."""
        first = self._first_padded()
        return None if first == self.parts else buffer[first * self.piece:].view(self.parts - first, self.piece)


def post_all_gather(layout: FlatLayout, sent: torch.Tensor, group, out: torch.Tensor | None = None):
    """Post the all-gather of every rank's piece (`sent`: this rank's, from layout.padded) into `out` (`parts` x
    `piece` numbers; a new buffer if None). Returns (torch's work handle, out): once the work is done,
    layout.compact(out) puts the flat vector at its front."""
    out = sent.new_empty(layout.parts * layout.piece) if out is None else out
    if dist.get_backend(group) == "gloo":  # gloo's all-gather copies through a buffer of its own: a broadcast each
        return all_gather_by_broadcasts(out, sent, group=group, async_op=True), out
    return all_gather(out, sent, group=group, async_op=True), out


def post_reduce_scatter(layout: FlatLayout, buffer: torch.Tensor, group):
    """Post the reduce-scatter (SUM) of `buffer` (`parts` x `piece` numbers, the flat vector at its front; spread
    here, in place). Returns (torch's work handle, this rank's piece of the sum): once the work is done, its first
    sizes[rank] numbers are the sum of the group's slices.

    On gloo, torch 2.13's reduce-scatter is itself an all-reduce of a copy of `buffer` (measured here: a 100 MB
    reduce-scatter of 2 ranks puts 200 MB on the loopback, as an all-reduce does), so labkit all-reduces
    `buffer` in place instead, sparing two copies; the counter records the reduce-scatter the algorithm needs,
    which is what NCCL moves."""
    layout.spread(buffer)
    if dist.get_backend(group) == "gloo":
        rank = groups.group_rank(group)
        return (reduce_scatter_by_all_reduce(buffer, group=group, async_op=True),
                buffer[rank * layout.piece:(rank + 1) * layout.piece])
    mine = buffer.new_empty(layout.piece)
    return reduce_scatter(mine, buffer, group=group, async_op=True), mine
