"""ZeRO-3's layout: each unit's parameters as one flat vector, cut over the ranks of a group.

    choose_units(module, units)              the submodules that are each one unit (default: the children)
    claim_parameters(module, unit_modules)   which trainable parameters each unit owns
    FlatUnit                                 one unit: its parameters' places, this rank's flat shard, and the
                                             full buffer that an all-gather fills and freeing empties

A unit's trainable parameters (each distinct tensor once, in `model.parameters()` order) are concatenated into a
flat vector of `numel` elements, cut with labkit.plan.counts.shard_sizes: group rank r keeps slice r as `shard`,
an nn.Parameter in the parameters' dtype, the master copy its optimizer updates (Rajbhandari et al., "ZeRO",
SC 2020; Zhao et al., "PyTorch FSDP", VLDB 2023, section 3: FSDP's FlatParameter).

The full vector lives only in `full`: a leaf tensor of group size x `piece` elements (`piece`: the largest slice),
in the compute dtype, whose storage is resized to 0 bytes whenever the unit is freed. gloo's all-gather and
reduce-scatter need equal pieces, so every rank sends `piece` elements (a smaller slice padded with one zero) and
the gathered pieces are then moved together (`compact`), so that full[:numel] is the flat vector and each
parameter is a view of it; a gradient goes the other way (`spread`) before its reduce-scatter.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from labkit import groups
from labkit.checks import items, shown
from labkit.parallel.counters import record_collective
from labkit.plan.counts import shard_sizes

__all__ = ["FlatUnit", "Placed", "choose_units", "claim_parameters"]


@dataclass(eq=False)
class Placed:
    """One parameter of a unit: the (qualified name, module, attribute) slots that hold it (two or more when it
    is tied), its shape, and where it starts in the unit's flat vector."""
    slots: list[tuple[str, nn.Module, str]]
    shape: torch.Size
    offset: int

    @property
    def numel(self) -> int:
        return self.shape.numel()


def choose_units(module: nn.Module, units) -> list[nn.Module]:
    """The unit submodules: `units` checked (distinct submodules of `module`, none inside another, not the root),
    or by default every direct child with a trainable parameter."""
    if units is None:
        return [child for child in module.children() if any(p.requires_grad for p in child.parameters())]
    units = items("units", units, "a list of submodules of module")
    names = {id(m): name for name, m in module.named_modules() if name}
    strangers = [u for u in units if id(u) not in names]
    if strangers:
        raise ValueError(f"units: {shown(strangers[0])} is not a submodule of module: pass submodules, e.g. the "
                         "layers (not the module itself: its own parameters form the root's unit anyway).")
    chosen = [names[id(u)] for u in units]
    overlaps = [(a, b) for i, a in enumerate(chosen) for b in chosen[i + 1:]
                if a == b or b.startswith(a + ".") or a.startswith(b + ".")]
    if overlaps:
        raise ValueError(f"units: {overlaps[0][0]!r} and {overlaps[0][1]!r} overlap (the same module, or one inside "
                         "the other): pass units that do not overlap.")
    return units


def claim_parameters(root: nn.Module, unit_modules: list[nn.Module]) -> list[tuple[nn.Module, list]]:
    """For each of `unit_modules`, then for the root, the trainable parameters it owns, as (parameter, its slots)
    in `root.parameters()` order. A parameter belongs to the one unit whose subtree holds every slot of it; one
    that no unit holds, or that two units share (a tied weight), belongs to the root. Frozen parameters
    (requires_grad=False) belong to nobody: they stay where they are, whole on every rank."""
    prefixes = [{name + "." for name, m in root.named_modules(remove_duplicate=False) if m is unit}
                for unit in unit_modules]
    slots: dict[nn.Parameter, list] = {}  # insertion order: root.parameters() order
    for qualified, param in root.named_parameters(remove_duplicate=False):
        if param.requires_grad:
            path, _, attr = qualified.rpartition(".")
            slots.setdefault(param, []).append((qualified, root.get_submodule(path), attr))
    owned: list[list] = [[] for _ in range(len(unit_modules) + 1)]  # the last: the root
    for param, where in slots.items():
        holders = {next((i for i, starts in enumerate(prefixes) if name.startswith(tuple(starts))), None)
                   for name, _, _ in where}
        owned[holders.pop() if len(holders) == 1 and None not in holders else -1].append((param, where))
    return [(module, params) for module, params in zip([*unit_modules, root], owned, strict=True) if params]


class FlatUnit:
    """One unit's parameters, sharded: `shard` (this rank's slice of the flat vector, an nn.Parameter), `full`
    (the gathered vector, storage 0 bytes while freed), `placed` (where each parameter sits in it).

    Built from group rank 0's values (broadcast once), as DDP starts from rank 0's replica. The parameters
    leave their modules: each slot then holds a view of `full` (`use_views`), so that the module's own forward
    computes with the gathered values and autograd sends the gradients into `full.grad`."""

    def __init__(self, index: int, name: str, module: nn.Module, owned: list, group, compute_dtype):
        self.index, self.name, self.module, self.group = index, name, module, group
        params = [param for param, _ in owned]
        if len({p.dtype for p in params}) > 1:
            raise ValueError(f"FullyShardedDP: unit {name!r} mixes dtypes {sorted({str(p.dtype) for p in params})}; "
                             "a unit is one flat vector: pass units= that keep each dtype apart.")
        offsets = [0, *itertools.accumulate(p.numel() for p in params)]
        self.placed = [Placed(where, param.shape, offset)
                       for (param, where), offset in zip(owned, offsets, strict=False)]
        self.numel, self.world = offsets[-1], groups.group_size(group)
        self.sizes = shard_sizes(self.numel, self.world)
        self.piece, me = self.sizes[0], groups.group_rank(group)
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        record_collective("broadcast", flat)
        dist.broadcast(flat, groups.global_rank(group, 0), group=group)
        start = sum(self.sizes[:me])
        self.shard = nn.Parameter(flat[start:start + self.sizes[me]].clone())
        self.full = flat.new_empty(self.piece * self.world, dtype=compute_dtype or flat.dtype).requires_grad_()
        self.work = None  # the all-gather in flight, if one is
        for placed in self.placed:
            for _, slot_module, attr in placed.slots:
                delattr(slot_module, attr)
        with torch.no_grad():
            self.use_views()  # until the first forward: views of the buffer that free() empties, shapes only
        self.free()

    def __repr__(self) -> str:
        return f"FlatUnit({self.index}, {self.name!r}, numel={self.numel}, shard={self.shard.numel()})"

    @property
    def nbytes(self) -> int:
        """Bytes the full buffer holds now: group size x piece x element size while gathered, 0 while freed."""
        return self.full.untyped_storage().nbytes()

    def free(self) -> None:
        """Give the full buffer's memory back; its views keep their shapes and hold no data."""
        self.full.untyped_storage().resize_(0)

    def all_gather(self):
        """Post the all-gather of every rank's piece, in the compute dtype, into `full` (storage allocated here);
        returns torch's work handle. `compact` once it has completed."""
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        mine = _padded(self.shard.detach().to(self.full.dtype), self.piece)
        record_collective("all_gather", mine)
        self.work = dist.all_gather_single(self.full.detach(), mine, group=self.group, async_op=True)
        return self.work

    def compact(self, buffer: torch.Tensor) -> None:
        """Gathered pieces (each `piece` long, the smaller slices padded) -> the flat vector at the front."""
        block = self._padded_block(buffer)
        if block is not None:
            start, rows = self._first_padded() * self.piece, block[:, :-1].reshape(-1)  # a copy: no overlap
            buffer[start:start + rows.numel()] = rows

    def spread(self, buffer: torch.Tensor) -> None:
        """The flat vector at the front -> one `piece` per rank, zeros where a slice is shorter: `compact`'s
        inverse, which a reduce-scatter's input needs."""
        block = self._padded_block(buffer)
        if block is not None:
            start = self._first_padded() * self.piece
            tail = buffer[start:start + block.shape[0] * (self.piece - 1)].clone()
            block[:, :-1] = tail.view(block.shape[0], self.piece - 1)
            block[:, -1] = 0

    def _first_padded(self) -> int:
        """The first group rank whose slice is one shorter than `piece` (shard_sizes gives the longer ones first)."""
        return self.sizes.index(self.piece - 1) if self.sizes[-1] < self.piece else self.world

    def _padded_block(self, buffer: torch.Tensor) -> torch.Tensor | None:
        """The padded ranks' pieces of `buffer`, one row each; None when every slice is `piece` long."""
        first = self._first_padded()
        return None if first == self.world else buffer[first * self.piece:].view(self.world - first, self.piece)

    def use_views(self) -> None:
        """Point every slot at its parameter's view of full[:numel] (under autograd when grad is enabled)."""
        flat = self.full[:self.numel]
        for placed in self.placed:
            view = flat[placed.offset:placed.offset + placed.numel].view(placed.shape)
            for _, slot_module, attr in placed.slots:
                setattr(slot_module, attr, view)

    def reduce_scatter(self, grad: torch.Tensor):
        """Post the reduce-scatter (SUM) of the full gradient `grad`, in its dtype; returns (work, this rank's
        piece of the sum). `add_gradient` once it has completed."""
        grad = grad.contiguous()
        self.spread(grad)
        piece = grad.new_empty(self.piece)
        record_collective("reduce_scatter", grad)
        return dist.reduce_scatter_single(piece, grad, group=self.group, async_op=True), piece

    def add_gradient(self, piece: torch.Tensor) -> None:
        """This rank's piece of the summed gradient, divided by the group size (the average), in the shard's
        dtype, into `shard.grad` (added, if a gradient is there already)."""
        mine = piece[:self.shard.numel()].to(self.shard.dtype) / self.world
        self.shard.grad = mine if self.shard.grad is None else self.shard.grad.add_(mine)

    def gather_master(self) -> torch.Tensor:
        """The flat vector of the master shards (their dtype), all-gathered into a new tensor."""
        buffer = self.shard.detach().new_empty(self.piece * self.world)
        mine = _padded(self.shard.detach(), self.piece)
        record_collective("all_gather", mine)
        dist.all_gather_single(buffer, mine, group=self.group)
        self.compact(buffer)
        return buffer[:self.numel]


def _padded(shard: torch.Tensor, piece: int) -> torch.Tensor:
    """`shard`, with a zero after it when it is one element shorter than `piece`."""
    return shard if shard.numel() == piece else torch.cat([shard, shard.new_zeros(piece - shard.numel())])
