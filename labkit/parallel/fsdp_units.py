"""ZeRO-3's units, for fsdp.py's FullyShardedDP: which submodules are units, which parameters each owns, and each
unit's flat shard and full buffer; and the checks and casts the wrapper applies to the module and its tensors.

    choose_units(module, units)              the submodules that are each one unit (default: the children)
    claim_parameters(module, unit_modules)   which trainable parameters each unit owns
    FlatUnit                                 one unit: this rank's flat shard, and the full buffer that an
                                             all-gather fills and freeing empties

A unit's trainable parameters (each distinct tensor once, in `model.parameters()` order) are one flat vector cut
over the group's ranks (flat_shards.FlatLayout): group rank r keeps slice r as `shard`, an nn.Parameter in the
parameters' dtype, the master copy its optimizer updates (Zhao et al., "PyTorch FSDP", VLDB 2023, section 3:
FSDP's FlatParameter). The full vector lives only in `full`, a leaf tensor of group size x piece numbers in the
compute dtype, whose storage is resized to 0 bytes whenever the unit is freed; each parameter is then a view of
full[:numel], so that the module's own forward computes with the gathered values.
"""

from __future__ import annotations

import torch
from torch import nn

from labkit import groups
from labkit.checks import items, shown
from labkit.parallel._collectives import broadcast
from labkit.parallel.flat_shards import FlatLayout, post_all_gather, post_reduce_scatter

__all__ = ["FlatUnit", "cast_floating", "cast_frozen", "check_module", "choose_units", "claim_parameters",
           "output_tensors"]


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
    in `root.parameters()` order; a slot is (qualified name, module, attribute). A parameter belongs to the one
    unit whose subtree holds every slot of it; one that no unit holds, or that two units share (a tied weight),
    belongs to the root. Frozen parameters (requires_grad=False) belong to nobody: they stay where they are,
    whole on every rank."""
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
    (the gathered vector, storage 0 bytes while freed), `layout` (the flat vector's FlatLayout) and `slots`
    (for each parameter, the (qualified name, module, attribute) slots that hold it: two or more when tied).

    Built from group rank 0's values (broadcast once), as DDP starts from rank 0's replica. The parameters
    leave their modules: each slot then holds a view of `full` (`use_views`), so that autograd sends the
    gradients into `full.grad`."""

    def __init__(self, index: int, name: str, module: nn.Module, owned: list, group, compute_dtype):
        self.index, self.name, self.module, self.group = index, name, module, group
        params = [param for param, _ in owned]
        if len({p.dtype for p in params}) > 1:
            raise ValueError(f"FullyShardedDP: unit {name!r} mixes dtypes {sorted({str(p.dtype) for p in params})}; "
                             "a unit is one flat vector: pass units= that keep each dtype apart.")
        self.slots = [where for _, where in owned]
        self.layout = FlatLayout([p.shape for p in params], groups.group_size(group))
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        broadcast(flat, 0, group=group)
        me = groups.group_rank(group)
        start = self.layout.start(me)
        self.shard = nn.Parameter(flat[start:start + self.layout.sizes[me]].clone())
        self.full = flat.new_empty(self.layout.parts * self.layout.piece,
                                   dtype=compute_dtype or flat.dtype).requires_grad_()
        self.work = None  # the all-gather in flight, if one is
        for _, slot_module, attr in (slot for where in self.slots for slot in where):
            delattr(slot_module, attr)
        with torch.no_grad():
            self.use_views()  # until the first forward: views of the buffer that free() empties, shapes only
        self.free()

    def __repr__(self) -> str:
        return f"FlatUnit({self.index}, {self.name!r}, numel={self.numel}, shard={self.shard.numel()})"

    @property
    def numel(self) -> int:
        """How many numbers the unit's trainable parameters hold together."""
        return self.layout.numel

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
        sent = self.layout.padded([self.shard.detach().to(self.full.dtype)])
        self.work, _ = post_all_gather(self.layout, sent, self.group, out=self.full.detach())
        return self.work

    def compact(self) -> None:
        """After the all-gather: the gathered pieces moved together, so that full[:numel] is the flat vector."""
        self.layout.compact(self.full.detach())

    def use_views(self) -> None:
        """Point every slot at its parameter's view of full[:numel] (under autograd when grad is enabled)."""
        for where, view in zip(self.slots, self.layout.views(self.full), strict=True):
            for _, slot_module, attr in where:
                setattr(slot_module, attr, view)

    def reduce_scatter(self, grad: torch.Tensor):
        """Post the reduce-scatter (SUM) of the full gradient `grad`, in its dtype; returns (work, this rank's
        piece of the sum). `add_gradient` once it has completed."""
        return post_reduce_scatter(self.layout, grad.contiguous(), self.group)

    def add_gradient(self, piece: torch.Tensor) -> None:
        """This rank's piece of the summed gradient, divided by the group size (the average), in the shard's
        dtype, into `shard.grad` (added, if a gradient is there already)."""
        mine = piece[:self.shard.numel()].to(self.shard.dtype) / self.layout.parts
        self.shard.grad = mine if self.shard.grad is None else self.shard.grad.add_(mine)

    def gather_master(self) -> list[torch.Tensor]:
        """Every parameter's full values, from the master shards (their dtype), all-gathered into new tensors."""
        work, buffer = post_all_gather(self.layout, self.layout.padded([self.shard.detach()]), self.group)
        work.wait()
        self.layout.compact(buffer)
        return self.layout.views(buffer)


def output_tensors(output) -> list[torch.Tensor]:
    """The tensors in a module's output: itself, or inside a tuple, list or dict."""
    if isinstance(output, torch.Tensor):
        return [output]
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else []
    return [t for v in values for t in output_tensors(v)]


def cast_floating(value, dtype: torch.dtype | None):
    """`value` with its floating-point tensors (also inside tuples, lists and dicts) in `dtype` (None: as is)."""
    if dtype is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(cast_floating(v, dtype) for v in value)
    return {k: cast_floating(v, dtype) for k, v in value.items()} if isinstance(value, dict) else value


def cast_frozen(module: nn.Module, compute_dtype: torch.dtype | None) -> None:
    """The frozen floating-point parameters (all that is left in `module` once the units hold the trainable
    ones) in compute_dtype: never trained, so this one cast is the one each step would make."""
    for frozen in module.parameters() if compute_dtype is not None else ():
        if frozen.is_floating_point():
            frozen.data = frozen.data.to(compute_dtype)


def check_module(module: nn.Module, group=None) -> None:
    """TypeError unless `module` is an nn.Module; the same ValueError on every rank of `group` unless its
    parameters and buffers are all on each rank's labkit.device() (groups.check_placed)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module={shown(module)}: pass a torch.nn.Module, not a {type(module).__name__}.")
    named = [(f"{name!r}", t) for name, t in [*module.named_parameters(), *module.named_buffers()]]
    groups.check_placed(named, "FullyShardedDP", "Move it there first: module.to(labkit.device()).", group)
