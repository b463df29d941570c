"""Tensor parallelism by hand (Megatron-LM): one layer's weight matrix split across the ranks, each rank
computing its part of every example, with a collective to put the parts together.

    ColumnParallelLinear.from_linear(fc)   W split by output features: Y_r = X W_r on the same X; an
                                           all_gather completes Y (or nothing, if a row layer follows)
    RowParallelLinear.from_linear(fc)      W split by input features, X too: partial sums X_r W_r, one
                                           all_reduce adds them; the bias is added once, after it
    ParallelMLP.from_mlp(fc1, fc2)         column then row: one all_reduce forward, one backward
    f(x), g(x)                             the paper's two operators; gather_last, split_last the other two

Source: Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism", section 3 and figure 3: `f` is the identity forward and an all_reduce backward, `g` the
reverse. Each rank keeps 1/t of the weights, their gradients and optimizer state (t = the TP degree).

Uneven sizes are sharded, not refused: a dimension of n features over t ranks is cut with
torch.tensor_split, so rank r holds n // t + (1 if r < n % t else 0) of them (10 over 4: 3, 3, 2, 2; 3 over
4: 1, 1, 1, 0) and the result still equals the unsplit layer. gloo's all_gather needs equal sizes, so
gather_last pads every part to the largest and trims after. (torch's DTensor cuts uneven dimensions like
torch.chunk instead, 3, 3, 3, 1, and its RowwiseParallel then fails in torch 2.13: see the tests.)
The ranks are those of the default process group; every rank must pass the same full layer (build it from
the same seed), which from_linear checks with one small all_gather. All collectives go through
labkit.parallel.data's counter: `count_collectives()` shows them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit.parallel.counters import all_reduce_sum, record_collective


def _me() -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("labkit.parallel.tensor needs a torch.distributed process group: use it inside a rank "
                           "(labkit.run, a %%ranks cell, or a script under torchrun).")
    return dist.get_rank(), dist.get_world_size()


def shard_sizes(features: int, ranks: int) -> list[int]:
    """How many of `features` each of `ranks` holds: torch.tensor_split's cut, the first n % t one larger.

    >>> shard_sizes(10, 4)
    [3, 3, 2, 2]
    """
    return [features // ranks + (1 if r < features % ranks else 0) for r in range(ranks)]


def _my_slice(features: int) -> slice:
    rank, world = _me()
    sizes = shard_sizes(features, world)
    return slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))


def _all_gather_last(part: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Every rank's `part`, concatenated along the last dimension in rank order; parts may differ by size."""
    widest = max(sizes)
    padded = F.pad(part, (0, widest - part.shape[-1])).contiguous()
    record_collective("all_gather", padded)
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    return torch.cat([p[..., :n] for p, n in zip(parts, sizes, strict=True)], dim=-1)


# --- The four communication operators, each an autograd function with its backward written out ---

class CopyToParallel(torch.autograd.Function):
    """Megatron's f: identity forward (every rank already has X); all_reduce backward (each rank's dX is a
    partial sum over its part of the output features)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        all_reduce_sum(grad)
        return grad


class ReduceFromParallel(torch.autograd.Function):
    """Megatron's g: all_reduce forward (adds the ranks' partial outputs); identity backward (every rank
    needs the whole dY, which it already has)."""

    @staticmethod
    def forward(ctx, x):
        x = x.contiguous().clone()
        all_reduce_sum(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class GatherFromParallel(torch.autograd.Function):
    """All-gather along the last dimension forward (a column layer's parts become the whole output);
    backward: keep this rank's slice of dY."""

    @staticmethod
    def forward(ctx, x, features):
        ctx.part = _my_slice(features)
        return _all_gather_last(x, shard_sizes(features, _me()[1]))

    @staticmethod
    def backward(ctx, grad):
        return grad[..., ctx.part].contiguous(), None


class SplitToParallel(torch.autograd.Function):
    """Keep this rank's slice of the last dimension forward (a row layer's input that every rank has whole);
    backward: all-gather the slices of dX."""

    @staticmethod
    def forward(ctx, x):
        ctx.features = x.shape[-1]
        return x[..., _my_slice(ctx.features)].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_last(grad, shard_sizes(ctx.features, _me()[1]))


def f(x: torch.Tensor) -> torch.Tensor:
    """Megatron's f: identity forward, all_reduce backward."""
    return CopyToParallel.apply(x)


def g(x: torch.Tensor) -> torch.Tensor:
    """Megatron's g: all_reduce forward, identity backward."""
    return ReduceFromParallel.apply(x)


def gather_last(x: torch.Tensor, features: int) -> torch.Tensor:
    """All-gather the ranks' parts of a last dimension of `features` in all; backward: this rank's slice."""
    return GatherFromParallel.apply(x, features)


def split_last(x: torch.Tensor) -> torch.Tensor:
    """This rank's slice of the last dimension; backward: all-gather."""
    return SplitToParallel.apply(x)


def _check_same_layer(linear: nn.Linear, caller: str) -> None:
    """ValueError on every rank if the ranks were given different full layers (a sharded mix of them would
    silently be no layer at all)."""
    rank, world = _me()
    w = linear.weight.detach().double()
    b = linear.bias.detach().double() if linear.bias is not None else w.new_zeros(1)
    mine = torch.stack([w.sum(), (w * w).sum(), b.sum(), (b * b).sum(), w.new_tensor(float(linear.bias is None))])
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    differ = [r for r, theirs in enumerate(everyone) if not torch.allclose(theirs, everyone[0], rtol=1e-12, atol=0)]
    if differ:
        raise ValueError(f"{caller}: every rank must pass the same full nn.Linear, but rank(s) "
                         f"{', '.join(map(str, differ))} differ from rank 0: build it from the same seed on every "
                         f"rank (torch.manual_seed before nn.Linear).")


# --- The layers ---

class ColumnParallelLinear(nn.Module):
    """Y = X W^T + b with W's output features (rows of torch's weight) split across the ranks: rank r holds
    `weight` (out_r, in) and `bias` (out_r) for the full layer's features `shard`. X enters through f; with
    gather_output the parts are all-gathered into the whole Y, else each rank returns its (…, out_r) part.

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

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int, gather_output: bool):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.in_features, self.out_features, self.gather_output = weight.shape[1], out_features, gather_output
        self.shard = _my_slice(out_features)

    @classmethod
    def from_linear(cls, linear: nn.Linear, gather_output: bool = True) -> ColumnParallelLinear:
        """This rank's share of `linear` (copied: the full layer is left as it is)."""
        _check_same_layer(linear, "ColumnParallelLinear.from_linear")
        part = _my_slice(linear.out_features)
        bias = linear.bias.detach()[part].clone() if linear.bias is not None else None
        return cls(linear.weight.detach()[part].clone(), bias, linear.out_features, gather_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(f(x), self.weight, self.bias)
        return gather_last(y, self.out_features) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (this rank: "
                f"{self.shard.start}:{self.shard.stop}), gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """Y = X W^T + b with W's input features (columns of torch's weight) split across the ranks: rank r holds
    `weight` (out, in_r) for the full layer's input features `shard`, and the whole `bias` (out), the same on
    every rank. Each rank computes X_r W_r^T, g all-reduces the partial sums, then the bias is added, once.
    With input_is_parallel the input is already this rank's (…, in_r) part (a column layer's output); else
    it is the whole X and the layer takes its slice.

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

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, in_features: int, input_is_parallel: bool):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.in_features, self.out_features, self.input_is_parallel = in_features, weight.shape[0], input_is_parallel
        self.shard = _my_slice(in_features)

    @classmethod
    def from_linear(cls, linear: nn.Linear, input_is_parallel: bool = False) -> RowParallelLinear:
        """This rank's share of `linear` (copied: the full layer is left as it is)."""
        _check_same_layer(linear, "RowParallelLinear.from_linear")
        weight = linear.weight.detach()[:, _my_slice(linear.in_features)].clone()
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        return cls(weight, bias, linear.in_features, input_is_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = split_last(x)
        if x.shape[-1] != self.weight.shape[1]:
            raise ValueError(f"RowParallelLinear: this rank holds input features {self.shard.start}:"
                             f"{self.shard.stop} ({self.weight.shape[1]}) but got an input part of {x.shape[-1]}.")
        y = g(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (this rank: {self.shard.start}:{self.shard.stop}), "
                f"out_features={self.out_features}, input_is_parallel={self.input_is_parallel}")


class ParallelMLP(nn.Module):
    """fc2(activation(fc1(x))) with fc1 column-parallel (no gather) and fc2 row-parallel (input already
    split): the hidden activations never leave their rank. Forward: f (nothing), g (one all_reduce);
    backward: g (nothing), f (one all_reduce) — Megatron's figure 3a. The activation must act elementwise.

    Example::

        >>> import labkit, torch
        >>> from torch import nn
        >>> from labkit.parallel import ParallelMLP, count_collectives
        >>> def check():
        ...     torch.manual_seed(0)
        ...     fc1, fc2, x = nn.Linear(8, 32), nn.Linear(32, 8), torch.randn(4, 8, requires_grad=True)
        ...     mlp = ParallelMLP.from_mlp(fc1, fc2, activation=nn.GELU())
        ...     with count_collectives() as forward:
        ...         y = mlp(x)
        ...     with count_collectives() as backward:
        ...         y.sum().backward()
        ...     return torch.allclose(y, fc2(nn.GELU()(fc1(x)))), dict(forward.calls), dict(backward.calls)
        >>> labkit.run(check, world_size=2)[0]
        (True, {'all_reduce': 1}, {'all_reduce': 1})
    """

    def __init__(self, fc1: ColumnParallelLinear, fc2: RowParallelLinear, activation: nn.Module | None = None):
        super().__init__()
        if fc1.gather_output or not fc2.input_is_parallel:
            raise ValueError("ParallelMLP needs fc1 with gather_output=False and fc2 with input_is_parallel=True.")
        self.fc1, self.activation, self.fc2 = fc1, activation if activation is not None else nn.GELU(), fc2

    @classmethod
    def from_mlp(cls, fc1: nn.Linear, fc2: nn.Linear, activation: nn.Module | None = None) -> ParallelMLP:
        """This rank's share of fc2(activation(fc1(x))); the activation defaults to GELU, as in Megatron."""
        if fc1.out_features != fc2.in_features:
            raise ValueError(f"ParallelMLP: fc1 has {fc1.out_features} outputs but fc2 takes {fc2.in_features}.")
        return cls(ColumnParallelLinear.from_linear(fc1, gather_output=False),
                   RowParallelLinear.from_linear(fc2, input_is_parallel=True), activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation(self.fc1(x)))
