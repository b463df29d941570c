"""Tensor parallelism by hand (Megatron-LM): one layer's weight matrix split across the ranks of a group, each
rank computing its part of every example, with a collective to put the parts together.

    ColumnParallelLinear.from_linear(fc)   W split by output features: Y_r = X W_r on the same X; an
                                           all_gather completes Y (or nothing, if a row layer follows)
    RowParallelLinear.from_linear(fc)      W split by input features, X too: partial sums X_r W_r, one
                                           all_reduce adds them; the bias is added once, after it
    ParallelMLP.from_mlp(fc1, fc2)         column then row: one all_reduce forward, one backward
    sequence_parallel=True (all three)     the input (batch, sequence / t, ...) all-gathered in place of f, the
                                           output reduce-scattered along the sequence in place of g (sequence.py)
    copy_to_tensor_parallel(x)             the paper's f: identity forward, all_reduce backward
    reduce_from_tensor_parallel(x)         the paper's g: all_reduce forward, identity backward
    split_to_tensor_parallel(x)            this rank's slice of the last dimension; all_gather backward
    gather_from_tensor_parallel(x, n)      all_gather of the last dimension; this rank's slice backward

Source: Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism", section 3 and figure 3, whose conjugate operators f and g the first two functions are (Megatron-LM's
code calls the four copy_to_, reduce_from_, scatter_to_ and gather_from_tensor_model_parallel_region). Each rank
keeps 1/t of the weights, their gradients and optimizer state (t = the TP degree, the group's size).

Every function and layer takes `group=`: None for the whole world, or a sub-group (torch.distributed.new_group,
a labkit.parallel.Mesh axis); its collectives use only that group, and rank r of the group (its group rank, not
its global rank) holds shard r. Uneven sizes are sharded, not refused: a dimension of n features over t ranks is
cut as torch.tensor_split cuts (labkit.plan.counts.shard_sizes), so rank r holds n // t + (1 if r < n % t else
0) of them (10 over 4: 3, 3, 2, 2; 3 over 4: 1, 1, 1, 0) and the result still equals the unsplit layer. gloo's
all_gather needs equal sizes, so the gather pads every part to the largest and trims after. (torch's DTensor cuts
uneven dimensions like torch.chunk instead, 3, 3, 3, 1, and its RowwiseParallel then fails in torch 2.13: see the
tests.) Every rank of the group must pass the same full layer (build it from the same seed), which from_linear
checks with one small all_gather. All collectives are counted by labkit.parallel.counters: `count_collectives()`
shows them.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch import nn

from labkit import groups
from labkit._refusals import refuse_while_graded
from labkit.checks import flag
from labkit.parallel._collectives import all_gather
from labkit.parallel.counters import all_reduce_sum
from labkit.parallel.sequence import reduce_scatter_to_sequence_parallel, sequence_parallel_linear
from labkit.plan.counts import shard_sizes

__all__ = ["ColumnParallelLinear", "CopyToTensorParallel", "GatherFromTensorParallel", "ParallelMLP",
           "ReduceFromTensorParallel", "RowParallelLinear", "SplitToTensorParallel", "copy_to_tensor_parallel",
           "gather_from_tensor_parallel", "reduce_from_tensor_parallel", "split_to_tensor_parallel"]


def _my_slice(features: int, group) -> slice:
    """The features of `features` that this rank holds: its group rank's part of shard_sizes."""
    sizes = shard_sizes(features, groups.group_size(group))
    rank = groups.group_rank(group)
    return slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))


def _all_gather_last(part: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Every group rank's `part`, concatenated along the last dimension in group-rank order; parts may differ
    in size (`sizes`), so each is padded to the largest for the all_gather and trimmed after."""
    widest = max(sizes)
    padded = F.pad(part, (0, widest - part.shape[-1])).contiguous()
    gathered = padded.new_empty(len(sizes) * padded.numel())
    all_gather(gathered, padded.view(-1), group=group)
    parts = gathered.view(len(sizes), *padded.shape).unbind(0)
    return torch.cat([p[..., :n] for p, n in zip(parts, sizes, strict=True)], dim=-1)


# --- The four communication operators, each an autograd function with its backward written out ---

class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f (Shoeybi et al. 2019, section 3, figure 3): identity forward (every rank of the group
    already has X); all_reduce backward (each rank's dX is a partial sum over its part of the output features)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        refuse_while_graded("labkit.parallel's CopyToTensorParallel.backward")  # notebook 05's exercise
        grad = grad.contiguous().clone()
        all_reduce_sum(grad, group=ctx.group)
        return grad, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g (Shoeybi et al. 2019, section 3, figure 3): all_reduce forward (adds the group's partial
    outputs); identity backward (every rank needs the whole dY, which it already has)."""

    @staticmethod
    def forward(ctx, x, group):
        refuse_while_graded("labkit.parallel's ReduceFromTensorParallel.forward")  # notebook 05's exercise
        x = x.contiguous().clone()
        all_reduce_sum(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromTensorParallel(torch.autograd.Function):
    """All-gather along the last dimension forward (a column layer's parts become the whole output);
    backward: keep this rank's slice of dY."""

    @staticmethod
    def forward(ctx, x, features, group):
        ctx.part = _my_slice(features, group)
        return _all_gather_last(x, shard_sizes(features, groups.group_size(group)), group)

    @staticmethod
    def backward(ctx, grad):
        return grad[..., ctx.part].contiguous(), None, None


class SplitToTensorParallel(torch.autograd.Function):
    """Keep this rank's slice of the last dimension forward (a row layer's input that every rank has whole);
    backward: all-gather the slices of dX."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.features, ctx.group = x.shape[-1], group
        return x[..., _my_slice(ctx.features, group)].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_last(grad, shard_sizes(ctx.features, groups.group_size(ctx.group)), ctx.group), None


def copy_to_tensor_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's f (Shoeybi et al. 2019, section 3, figure 3), where a tensor-parallel block takes its input:
    identity forward, all_reduce of the gradient over `group` backward (each rank's dX is a partial sum).

    Example: f then g around this rank's share of a sum gives the whole sum, forward and backward::

        >>> import labkit, torch
        >>> from labkit.parallel import copy_to_tensor_parallel, count_collectives, reduce_from_tensor_parallel
        >>> def f_then_g():
        ...     x = torch.ones(3, requires_grad=True)
        ...     with count_collectives() as forward:
        ...         y = reduce_from_tensor_parallel(copy_to_tensor_parallel(x) * (labkit.rank() + 1))  # 1 + 2
        ...     with count_collectives() as backward:
        ...         y.sum().backward()
        ...     return y.tolist(), x.grad.tolist(), dict(forward.calls), dict(backward.calls)
        >>> labkit.run(f_then_g, world_size=2)[1]
        ([3.0, 3.0, 3.0], [3.0, 3.0, 3.0], {'all_reduce': 1}, {'all_reduce': 1})
    """
    refuse_while_graded("labkit.parallel's copy_to_tensor_parallel")  # notebook 05's exercise
    groups.require_member("copy_to_tensor_parallel", group)
    return CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's g (Shoeybi et al. 2019, section 3, figure 3), where a tensor-parallel block's partial sums
    leave: all_reduce over `group` forward, identity backward. Example: see copy_to_tensor_parallel."""
    refuse_while_graded("labkit.parallel's reduce_from_tensor_parallel")  # notebook 05's exercise
    groups.require_member("reduce_from_tensor_parallel", group)
    return ReduceFromTensorParallel.apply(x, group)


def gather_from_tensor_parallel(x: torch.Tensor, features: int, group=None) -> torch.Tensor:
    """All-gather the group's parts of a last dimension of `features` in all (this rank's part is its group
    rank's share, shard_sizes); backward: this rank's slice of the gradient. A column layer's gather_output."""
    groups.require_member("gather_from_tensor_parallel", group)
    return GatherFromTensorParallel.apply(x, features, group)


def split_to_tensor_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's slice of the last dimension (its group rank's share, shard_sizes); backward: all-gather the
    slices of the gradient over `group`. A row layer's input when it is not already split."""
    groups.require_member("split_to_tensor_parallel", group)
    return SplitToTensorParallel.apply(x, group)


def _layer_description(linear: nn.Linear) -> str:
    """The layer's sizes, dtype and a digest of its weights and bias: equal on two ranks only for the same
    layer (the same seed gives bit-identical weights)."""
    digest = hashlib.sha256()
    for tensor in (linear.weight, linear.bias):
        if tensor is not None:
            digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    dtype = str(linear.weight.dtype).removeprefix("torch.")
    return (f"nn.Linear({linear.in_features}, {linear.out_features}, bias={linear.bias is not None}) {dtype}, "
            f"weights sha256 {digest.hexdigest()[:12]}")


def _check_same_layer(linear: nn.Linear, caller: str, group) -> None:
    """ValueError on every rank of `group` if its ranks were given different full layers (a sharded mix of them
    would silently be no layer at all); TypeError if `linear` is no nn.Linear."""
    groups.require_member(caller, group)
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"{caller}: linear is a {type(linear).__name__}, not a torch.nn.Linear: pass the full "
                        "nn.Linear to split.")
    groups.check_same(_layer_description(linear), caller, "full layers",
                      "Every rank must pass the same full nn.Linear: build it from the same seed on every rank "
                      "(torch.manual_seed before nn.Linear).", group)


# --- The layers ---

class ColumnParallelLinear(nn.Module):
    """Y = X W^T + b with W's output features (rows of torch's weight) split across the group's ranks: group
    rank r holds `weight` (out_r, in) and `bias` (out_r) for the full layer's features `shard`. X enters
    through f (copy_to_tensor_parallel); with gather_output the parts are all-gathered into the whole Y, else
    each rank returns its (…, out_r) part. Shoeybi et al. 2019, section 3 (the first GEMM of the MLP).
    With sequence_parallel the input is this rank's (batch, sequence / t, in) part, all-gathered along the
    sequence in place of f (labkit.parallel.sequence_parallel_linear; Korthikanti et al. 2022, section 4.2.2).

    Example::

        >>> import labkit, torch
        >>> from torch import nn
        >>> from labkit.parallel import ColumnParallelLinear
        >>> def check():
        ...     torch.manual_seed(0)
        ...     full, x = nn.Linear(16, 10), torch.randn(4, 16)     # 10 outputs over 4 ranks: 3, 3, 2, 2
        ...     layer = ColumnParallelLinear.from_linear(full)
        ...     return tuple(layer.weight.shape), torch.allclose(layer(x), full(x))
        >>> labkit.run(check, world_size=4)
        [((3, 16), True), ((3, 16), True), ((2, 16), True), ((2, 16), True)]
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int, gather_output: bool,
                 group=None, sequence_parallel: bool = False):
        super().__init__()
        groups.require_member("ColumnParallelLinear", group)
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.in_features, self.out_features, self.gather_output = weight.shape[1], out_features, gather_output
        self.group, self.sequence_parallel = group, flag("sequence_parallel", sequence_parallel)
        self.shard = _my_slice(out_features, group)

    @classmethod
    def from_linear(cls, linear: nn.Linear, gather_output: bool = True, group=None,
                    sequence_parallel: bool = False) -> ColumnParallelLinear:
        """This rank's share of `linear` over `group` (None: the world), copied: the full layer is left as it
        is. Every rank of the group must pass the same layer."""
        _check_same_layer(linear, "ColumnParallelLinear.from_linear", group)
        part = _my_slice(linear.out_features, group)
        bias = linear.bias.detach()[part].clone() if linear.bias is not None else None
        return cls(linear.weight.detach()[part].clone(), bias, linear.out_features, gather_output, group,
                   sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = sequence_parallel_linear(x, self.weight, self.bias, self.group)
        else:
            y = F.linear(copy_to_tensor_parallel(x, self.group), self.weight, self.bias)
        return gather_from_tensor_parallel(y, self.out_features, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (this rank: "
                f"{self.shard.start}:{self.shard.stop}), gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """Y = X W^T + b with W's input features (columns of torch's weight) split across the group's ranks: group
    rank r holds `weight` (out, in_r) for the full layer's input features `shard`, and the whole `bias` (out),
    the same on every rank. Each rank computes X_r W_r^T, g (reduce_from_tensor_parallel) all-reduces the
    partial sums, then the bias is added, once. With input_is_parallel the input is already this rank's
    (…, in_r) part (a column layer's output); else it is the whole X and the layer takes its slice.
    Shoeybi et al. 2019, section 3 (the second GEMM of the MLP). With sequence_parallel (input_is_parallel
    needed) the partial sums are reduce-scattered along the sequence in place of g: each rank gets its
    (batch, sequence / t, out) part of Y, and the bias, added there, is listed by sequence_sharded_parameters()
    (Korthikanti et al. 2022, section 4.2.2).

    Example::

        >>> import labkit, torch
        >>> from torch import nn
        >>> from labkit.parallel import RowParallelLinear
        >>> def check():
        ...     torch.manual_seed(0)
        ...     full, x = nn.Linear(16, 10), torch.randn(4, 16)
        ...     layer = RowParallelLinear.from_linear(full)
        ...     return tuple(layer.weight.shape), torch.allclose(layer(x), full(x))
        >>> labkit.run(check, world_size=2)
        [((10, 8), True), ((10, 8), True)]
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, in_features: int, input_is_parallel: bool,
                 group=None, sequence_parallel: bool = False):
        super().__init__()
        groups.require_member("RowParallelLinear", group)
        if flag("sequence_parallel", sequence_parallel) and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True (a column "
                             "layer's output part), as in a ParallelMLP.")
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.in_features, self.out_features, self.input_is_parallel = in_features, weight.shape[0], input_is_parallel
        self.group, self.sequence_parallel = group, sequence_parallel
        self.shard = _my_slice(in_features, group)

    @classmethod
    def from_linear(cls, linear: nn.Linear, input_is_parallel: bool = False, group=None,
                    sequence_parallel: bool = False) -> RowParallelLinear:
        """This rank's share of `linear` over `group` (None: the world), copied: the full layer is left as it
        is. Every rank of the group must pass the same layer."""
        _check_same_layer(linear, "RowParallelLinear.from_linear", group)
        weight = linear.weight.detach()[:, _my_slice(linear.in_features, group)].clone()
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        return cls(weight, bias, linear.in_features, input_is_parallel, group, sequence_parallel)

    def sequence_sharded_parameters(self) -> list[nn.Parameter]:
        """The bias under sequence parallelism, added on this rank's part of the sequence: its gradient needs
        labkit.parallel.allreduce_sequence_parallel_grads."""
        return [self.bias] if self.sequence_parallel and self.bias is not None else []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = split_to_tensor_parallel(x, self.group)
        if x.shape[-1] != self.weight.shape[1]:
            raise ValueError(f"RowParallelLinear: this rank holds input features {self.shard.start}:"
                             f"{self.shard.stop} ({self.weight.shape[1]}) but got an input part of {x.shape[-1]}.")
        leave = reduce_scatter_to_sequence_parallel if self.sequence_parallel else reduce_from_tensor_parallel
        y = leave(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (this rank: {self.shard.start}:{self.shard.stop}), "
                f"out_features={self.out_features}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")


class ParallelMLP(nn.Module):
    """fc2(activation(fc1(x))) with fc1 column-parallel (no gather) and fc2 row-parallel (input already
    split), both over one group: the hidden activations never leave their rank. Forward: f (nothing), g (one
    all_reduce); backward: g (nothing), f (one all_reduce): Shoeybi et al. 2019, figure 3a. The activation must
    act elementwise. With sequence_parallel (from_mlp) the input is this rank's part of the sequence: an
    all-gather forward and a reduce-scatter backward in place of f, the reverse in place of g, as in a block of
    Korthikanti et al. 2022, section 4.2.2.

    Example, on a sub-group: ranks 1 and 3 of four split one MLP, while ranks 0 and 2 split it on theirs::

        >>> import labkit, torch
        >>> from torch import nn
        >>> from labkit import groups
        >>> from labkit.parallel import ParallelMLP, count_collectives
        >>> def check():
        ...     pair = [groups.new_group([0, 2]), groups.new_group([1, 3])][labkit.rank() % 2]
        ...     torch.manual_seed(0)
        ...     fc1, fc2, x = nn.Linear(8, 32), nn.Linear(32, 8), torch.randn(4, 8, requires_grad=True)
        ...     mlp = ParallelMLP.from_mlp(fc1, fc2, activation=nn.GELU(), group=pair)
        ...     with count_collectives() as forward:
        ...         y = mlp(x)
        ...     with count_collectives() as backward:
        ...         y.sum().backward()
        ...     same = torch.allclose(y, fc2(nn.GELU()(fc1(x))))
        ...     return mlp.fc1.shard, same, dict(forward.calls), dict(backward.calls)
        >>> for result in labkit.run(check, world_size=4):
        ...     print(result)
        (slice(0, 16, None), True, {'all_reduce': 1}, {'all_reduce': 1})
        (slice(0, 16, None), True, {'all_reduce': 1}, {'all_reduce': 1})
        (slice(16, 32, None), True, {'all_reduce': 1}, {'all_reduce': 1})
        (slice(16, 32, None), True, {'all_reduce': 1}, {'all_reduce': 1})
    """

    def __init__(self, fc1: ColumnParallelLinear, fc2: RowParallelLinear, activation: nn.Module | None = None):
        super().__init__()
        if fc1.gather_output or not fc2.input_is_parallel:
            raise ValueError("ParallelMLP needs fc1 with gather_output=False and fc2 with input_is_parallel=True.")
        if fc1.group is not fc2.group or fc1.sequence_parallel != fc2.sequence_parallel:
            raise ValueError("ParallelMLP needs fc1 and fc2 split over the same group, both sequence-parallel or "
                             "neither: build both with the same group= and sequence_parallel= (from_mlp does).")
        self.fc1, self.activation, self.fc2 = fc1, activation if activation is not None else nn.GELU(), fc2

    @property
    def group(self):
        """The process group the MLP is split over (None: the world)."""
        return self.fc1.group

    @classmethod
    def from_mlp(cls, fc1: nn.Linear, fc2: nn.Linear, activation: nn.Module | None = None,
                 group=None, sequence_parallel: bool = False) -> ParallelMLP:
        """This rank's share of fc2(activation(fc1(x))) over `group` (None: the world); the activation defaults
        to GELU, as in Megatron."""
        if fc1.out_features != fc2.in_features:
            raise ValueError(f"ParallelMLP: fc1 has {fc1.out_features} outputs but fc2 takes {fc2.in_features}.")
        return cls(ColumnParallelLinear.from_linear(fc1, False, group, sequence_parallel),
                   RowParallelLinear.from_linear(fc2, True, group, sequence_parallel), activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation(self.fc1(x)))
