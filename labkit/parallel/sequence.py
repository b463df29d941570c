"""Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
section 4.2.2): tensor parallelism leaves the LayerNorms (and dropouts) replicated, every rank of the group storing
the same (batch, sequence, hidden) activations for them; they act on each position alone, so each rank can run
them on its own part of the sequence instead. Activations between the tensor-parallel regions are then
(batch, sequence / t, hidden) on each of the t ranks, and the collectives change:

    gather_from_sequence_parallel(x)         all-gather along the sequence forward; reduce-scatter backward
    reduce_scatter_to_sequence_parallel(x)   reduce-scatter along the sequence forward; all-gather backward
    sequence_parallel_linear(x, w, b)        the all-gather, then x W^T + b, keeping only the shard for the
                                             backward, which all-gathers it again (and reduce-scatters dX)
    sequence_slice(length)                   the positions this rank holds
    allreduce_sequence_parallel_grads(model) once per step: sum the replicated parameters' gradients

In place of Megatron's f (identity forward, all-reduce backward) comes the all-gather (the paper's g), in place of
its g (all-reduce forward) the reduce-scatter (the paper's g-bar). An all-reduce is a reduce-scatter and an
all-gather, so the bytes moved stay those of tensor parallelism alone. `sequence_parallel_linear` stores only the
sequence shard of its input, as Megatron-LM does (megatron/core/tensor_parallel/layers.py,
LinearWithGradAccumulationAndAsyncCommunication): that is what makes every activation of a layer 1/t (the
paper's section 4.2.2, sbh(34/t + 5as/(ht)) bytes, against section 4.2.1's sbh(10 + 24/t + 5as/(ht))), at the
price of one more all-gather in the backward per column-parallel layer.

A replicated parameter used on a sequence shard (a LayerNorm's weight and bias, a row-parallel layer's bias, the
position embedding) gets on each rank only its shard's part of the gradient: `allreduce_sequence_parallel_grads`
sums them over the group once per step, after the last micro-batch's backward (Megatron-LM's
finalize_model_grads, "all-reduce layernorm grads for sequence parallelism"). Layers say which parameters those are
through a method `sequence_sharded_parameters()`.

Activations are (batch, sequence, ...) here (batch first, as labkit's GPT; Megatron puts the sequence first), and
the sequence length must be a multiple of the group's size. Every collective is counted by
labkit.parallel.counters: an all-gather as this rank's part, a reduce-scatter as the whole tensor it sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from labkit import groups
from labkit.parallel._collectives import all_gather, reduce_scatter
from labkit.parallel.counters import all_reduce_sum

__all__ = ["allreduce_sequence_parallel_grads", "gather_from_sequence_parallel", "reduce_scatter_to_sequence_parallel",
           "sequence_parallel_linear", "sequence_slice"]


def _parts(length: int, group) -> int:
    """The group's size, once `length` positions split evenly over it."""
    parts = groups.group_size(group)
    if length % parts:
        raise ValueError(f"sequence parallelism over {parts} ranks: sequences of {length} tokens do not split evenly; "
                         f"pass a sequence length that is a multiple of {parts} (or sequence_parallel=False).")
    return parts


def sequence_slice(length: int, group=None) -> slice:
    """The positions of a `length`-token sequence that this rank holds: its group rank's 1/t of them, in order."""
    part = length // _parts(length, group)
    rank = groups.group_rank(group)
    return slice(rank * part, (rank + 1) * part)


def _all_gather_sequence(part: torch.Tensor, group) -> torch.Tensor:
    """Every group rank's (batch, length / t, ...) `part`, concatenated along the sequence in group-rank order."""
    parts = groups.group_size(group)
    flat = part.contiguous().reshape(-1)
    gathered = flat.new_empty(parts * flat.numel())
    all_gather(gathered, flat, group=group)
    batch, length, *rest = part.shape
    return gathered.view(parts, batch, length, *rest).transpose(0, 1).reshape(batch, parts * length, *rest)


def _reduce_scatter_sequence(whole: torch.Tensor, group) -> torch.Tensor:
    """The sum over the group of (batch, length, ...) `whole`, of which this rank keeps its part of the sequence."""
    batch, length, *rest = whole.shape
    parts = _parts(length, group)
    chunks = whole.reshape(batch, parts, length // parts, *rest).transpose(0, 1).contiguous()
    mine = chunks.new_empty(chunks.shape[1:])
    reduce_scatter(mine.view(-1), chunks.view(-1), group=group)
    return mine


class GatherFromSequenceParallel(torch.autograd.Function):
    """All-gather along the sequence forward; backward: reduce-scatter, since each rank's gradient of the whole
    sequence is a partial sum over its part of the features (Korthikanti et al. 2022, section 4.2.2, g)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_sequence(grad, ctx.group), None


class ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Reduce-scatter along the sequence forward (the group's partial sums, each rank keeping its positions);
    backward: all-gather (Korthikanti et al. 2022, section 4.2.2, g-bar)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_sequence(grad, ctx.group), None


class SequenceParallelLinear(torch.autograd.Function):
    """x W^T + b on the all-gathered sequence, saving only this rank's shard of x: the backward all-gathers it again
    for W's gradient and reduce-scatters x's (Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(_all_gather_sequence(x, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        whole = _all_gather_sequence(x, ctx.group)
        grad_x = _reduce_scatter_sequence(grad.matmul(weight), ctx.group)
        rows = grad.reshape(-1, grad.shape[-1])
        grad_weight = rows.t().matmul(whole.reshape(-1, whole.shape[-1]))
        return grad_x, grad_weight, rows.sum(0) if ctx.has_bias else None, None


def gather_from_sequence_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """The whole sequence from each rank's (batch, length / t, ...) part, forward; backward, the reduce-scatter of
    the gradient. Where a column-parallel layer takes its input under sequence parallelism.

    Example: each of 2 ranks holds 2 of 4 positions::

        >>> import labkit, torch
        >>> from labkit.parallel import count_collectives, gather_from_sequence_parallel
        >>> def gather():
        ...     mine = torch.full((1, 2, 1), float(labkit.rank()), requires_grad=True)
        ...     with count_collectives() as counted:
        ...         whole = gather_from_sequence_parallel(mine)
        ...         whole.sum().backward()       # each rank's 1s, summed: 2 on every position
        ...     return whole.flatten().tolist(), mine.grad.flatten().tolist(), dict(counted.calls)
        >>> labkit.run(gather, world_size=2)[1]
        ([0.0, 0.0, 1.0, 1.0], [2.0, 2.0], {'all_gather': 1, 'reduce_scatter': 1})
    """
    groups.require_member("gather_from_sequence_parallel", group)
    return GatherFromSequenceParallel.apply(x, group)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """The group's sum of (batch, length, ...) `x`, of which this rank keeps its length / t positions, forward;
    backward, the all-gather of the gradient. Where a row-parallel layer's partial sums leave under sequence
    parallelism (in place of Megatron's all-reduce g).

        >>> import labkit, torch
        >>> from labkit.parallel import reduce_scatter_to_sequence_parallel
        >>> def reduce_scatter():
        ...     partial = torch.arange(4.0).view(1, 4, 1) * (labkit.rank() + 1)   # ranks hold x and 2x
        ...     return reduce_scatter_to_sequence_parallel(partial).flatten().tolist()
        >>> labkit.run(reduce_scatter, world_size=2)
        [[0.0, 3.0], [6.0, 9.0]]
    """
    groups.require_member("reduce_scatter_to_sequence_parallel", group)
    return ReduceScatterToSequenceParallel.apply(x, group)


def sequence_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                             group=None) -> torch.Tensor:
    """F.linear on the whole sequence, given this rank's (batch, length / t, in) part of it: the all-gather, then
    the product, keeping only the part for the backward (which gathers it again, and reduce-scatters the input's
    gradient). A column-parallel layer's forward under sequence parallelism.

        >>> import labkit, torch
        >>> from labkit.parallel import sequence_parallel_linear, sequence_slice
        >>> def check():
        ...     torch.manual_seed(0)
        ...     x, weight = torch.randn(2, 4, 3), torch.randn(5, 3)
        ...     mine = x[:, sequence_slice(4)]
        ...     return torch.allclose(sequence_parallel_linear(mine, weight), x @ weight.t())
        >>> labkit.run(check, world_size=2)
        [True, True]
    """
    groups.require_member("sequence_parallel_linear", group)
    return SequenceParallelLinear.apply(x, weight, bias, group)


def _sequence_sharded(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of `model`'s layers that are replicated but used on a sequence shard, each once, with a
    gradient."""
    found: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if hasattr(module, "sequence_sharded_parameters"):
            found.update((id(p), p) for p in module.sequence_sharded_parameters() if p.grad is not None)
    return list(found.values())


def allreduce_sequence_parallel_grads(model: nn.Module, group=None) -> int:
    """Sum over `group` (the tensor-parallel group) the gradients of `model`'s replicated parameters that each rank
    used on its part of the sequence only (LayerNorms, row-parallel biases, position embeddings: what a layer's
    `sequence_sharded_parameters()` lists), in one all-reduce. Call it once per step, after the backward of the
    last micro-batch and before the optimizer, on every rank of the group; returns the numbers summed.

    Example: a LayerNorm run on each rank's half of the sequence gets the whole sequence's gradient::

        >>> import labkit, torch
        >>> from torch import nn
        >>> from labkit.parallel import allreduce_sequence_parallel_grads, sequence_slice
        >>> class ShardedNorm(nn.LayerNorm):
        ...     def sequence_sharded_parameters(self):
        ...         return [self.weight, self.bias]
        >>> def check():
        ...     torch.manual_seed(0)
        ...     x, norm, mine = torch.randn(2, 4, 3), nn.LayerNorm(3), ShardedNorm(3)
        ...     norm(x).pow(2).sum().backward()
        ...     mine(x[:, sequence_slice(4)]).pow(2).sum().backward()
        ...     summed = allreduce_sequence_parallel_grads(mine)
        ...     return summed, torch.allclose(mine.weight.grad, norm.weight.grad)
        >>> labkit.run(check, world_size=2)
        [(6, True), (6, True)]
    """
    groups.require_member("allreduce_sequence_parallel_grads", group)
    params = _sequence_sharded(model)
    if not params:
        return 0
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    all_reduce_sum(flat, group=group)
    for p, summed in zip(params, flat.split([p.numel() for p in params]), strict=True):
        p.grad.copy_(summed.view_as(p.grad))
    return flat.numel()
