"""ZeRO-1 and -2's layout, for zero.py's ShardedOptimizer: the trainable parameters in buckets, each bucket one
flat vector cut over the group's ranks, and the part of it that this rank owns, as pieces.

    shard_buckets(param_groups, cap_nbytes, rank, size)   the buckets, in the order the backward fills them
    ShardBucket                                           one bucket: its parameters, layout and this rank's pieces
    Piece                                                 a view into one parameter: what the inner optimizer steps
    check_ranks_agree, layout_difference                  every rank, and a saved state, on the same layout

The trainable parameters (each tensor once: a tied weight once; frozen ones left out) are laid end to end, per
param group and dtype, in buckets of at most `cap_nbytes`, filled from the last parameter back (the order the
backward produces gradients, as torch DDP fills its buckets: Li et al., VLDB 2020, section 3.2.3). Each bucket is
a flat_shards.FlatLayout over the group's ranks: group rank r owns slice r, 1/N of the bucket up to one number
(Rajbhandari et al., "ZeRO", SC 2020, section 5).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from labkit import groups
from labkit.checks import shown
from labkit.parallel.flat_shards import FlatLayout

__all__ = ["Piece", "ShardBucket", "check_ranks_agree", "layout_difference", "shard_buckets", "trainable_parameters"]


@dataclass
class Piece:
    """The part of `param` (flattened, from `start`) that this rank owns: `tensor`, a view into the parameter's
    storage that the inner optimizer updates, at `offset` in this rank's slice of its bucket."""
    param: nn.Parameter = field(repr=False)
    start: int
    offset: int
    tensor: nn.Parameter = field(repr=False)


@dataclass
class ShardBucket:
    """Parameters (of one param group and dtype) whose gradients are reduce-scattered together. `layout`: the
    bucket's flat vector cut over the group's ranks; `pieces`: this rank's slice, by parameter; `grad`: ZeRO-2's
    averaged gradient slice, kept until zero_grad(); `reduced`: whether the bucket was reduced since the last
    step."""
    index: int
    group_index: int
    params: list[nn.Parameter] = field(repr=False)
    layout: FlatLayout
    pieces: list[Piece] = field(repr=False)
    ready: list[bool] = field(default_factory=list, repr=False)
    grad: torch.Tensor | None = field(default=None, repr=False)
    reduced: bool = field(default=False, repr=False)
    pending: tuple | None = field(default=None, repr=False)  # (work, output, input) of a collective in flight

    @property
    def numel(self) -> int:
        return self.layout.numel


def trainable_parameters(param_groups: list[dict]) -> list[tuple[int, nn.Parameter]]:
    """(group index, parameter) of every trainable parameter, each tensor once, in order."""
    seen, found = set(), []
    for g, group in enumerate(param_groups):
        for p in group["params"]:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                found.append((g, p))
    return found


def shard_buckets(param_groups: list[dict], cap_nbytes: float, rank: int, size: int) -> list[ShardBucket]:
    """Buckets of at most `cap_nbytes` (a larger parameter alone), one param group and dtype each, filled from the
    last parameter back: bucket 0 holds the gradients the backward produces first. `rank` of `size`: whose pieces."""
    runs: list[list[tuple[int, nn.Parameter]]] = []
    nbytes = 0
    for g, p in reversed(trainable_parameters(param_groups)):
        p_nbytes = p.numel() * p.element_size()
        last = runs[-1][-1] if runs else None
        if last is None or (last[0], last[1].dtype) != (g, p.dtype) or nbytes + p_nbytes > cap_nbytes:
            runs.append([])
            nbytes = 0
        runs[-1].append((g, p))
        nbytes += p_nbytes
    buckets = []
    for index, run in enumerate(runs):
        params = [p for _, p in reversed(run)]  # in the model's order within the bucket
        layout = FlatLayout([p.shape for p in params], size)
        pieces = [Piece(params[i], start, offset, nn.Parameter(params[i].detach().view(-1)[start:start + numel]))
                  for i, start, offset, numel in layout.owned(rank)]
        buckets.append(ShardBucket(index, run[0][0], params, layout, pieces, [False] * len(params)))
    return buckets


def layout_difference(saved, mine: dict) -> str:
    """How a state_dict's layout differs from this optimizer's, in words; "" if it does not."""
    if not isinstance(saved, dict):
        return "the state_dict has no 'layout': it is not a ShardedOptimizer's"
    differ = [f"{key} {shown(saved.get(key))} saved, {shown(mine[key])} here" for key in mine
              if key != "buckets" and saved.get(key) != mine[key]]
    theirs = saved.get("buckets") or []
    for b, (a, ours) in enumerate(zip(theirs + [None] * len(mine["buckets"]), mine["buckets"], strict=False)):
        if a != ours:
            differ.append(f"bucket {b}: {shown(a)} saved, {shown(ours)} here (param group, dtype, shapes)")
            break
    if len(theirs) > len(mine["buckets"]):
        differ.append(f"{len(theirs)} buckets saved, {len(mine['buckets'])} here")
    return "; ".join(differ)


def check_ranks_agree(param_groups: list[dict], bucket_mb: float, group) -> None:
    """The same ValueError on every rank of `group` unless each has its trainable parameters on its
    labkit.device(), contiguous (its slice is a view of them), and the same as the others' (groups, shapes,
    dtypes, bucket_mb): mismatched buckets would hang the collectives instead of saying why."""
    ranks = groups.group_ranks(group)
    trainable = trainable_parameters(param_groups)
    named = [(f"a parameter of param group {g} (shape {tuple(p.shape)})", p) for g, p in trainable]
    misplaced = groups.first_misplaced(named) or next(
        (f"{name} is not contiguous" for name, p in named if not p.is_contiguous()), "")
    layout = (bucket_mb, [(g, str(p.dtype), tuple(p.shape)) for g, p in trainable])
    everyone = groups.gather_objects((misplaced, layout), group)
    problems = [f"rank {ranks[r]}: {where}" for r, (where, _) in enumerate(everyone) if where]
    if problems:
        raise ValueError("ShardedOptimizer: every trainable parameter must be contiguous and on its rank's "
                         "labkit.device(), but " + "; ".join(problems) + ". Pass the parameters of a model moved "
                         "with model.to(labkit.device()).")
    groups.check_gathered([theirs for _, theirs in everyone], "ShardedOptimizer", "(bucket_mb, parameters)",
                          "Build it over the same model, param groups and bucket_mb on every rank of the group.",
                          ranks)
