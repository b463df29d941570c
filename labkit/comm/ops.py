"""Reduction operators for the hand-written collectives: sum by default, like torch.distributed.

AVG is SUM followed by a division by the number of ranks. That is also the portable way to average
gradients: ReduceOp.AVG is missing or unreliable on gloo in some torch releases.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["Combine", "combiner", "finish", "op_name"]

Combine = Callable[[torch.Tensor, torch.Tensor], None]

_COMBINE: dict[str, Combine] = {
    "SUM": lambda acc, x: acc.add_(x),
    "AVG": lambda acc, x: acc.add_(x),
    "PRODUCT": lambda acc, x: acc.mul_(x),
    "MIN": lambda acc, x: torch.minimum(acc, x, out=acc),
    "MAX": lambda acc, x: torch.maximum(acc, x, out=acc),
}


def op_name(op) -> str:
    """'SUM' from torch.distributed.ReduceOp.SUM or from the string 'sum'."""
    name = (op if isinstance(op, str) else getattr(op, "name", str(op))).upper()
    if name not in _COMBINE:
        raise ValueError(f"op={op!r} is not supported; use one of {', '.join(_COMBINE)} (torch.distributed.ReduceOp "
                         "or a string).")
    return name


def combiner(op, dtype: torch.dtype) -> Combine:
    """The in-place `acc <- acc (op) x` for `op`; AVG needs a floating dtype to divide, and complex numbers
    have no order for MIN and MAX (torch.distributed.all_reduce refuses them too)."""
    name = op_name(op)
    if name == "AVG" and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"op=AVG needs a floating-point tensor, got {dtype}: average integers yourself.")
    if name in ("MIN", "MAX") and dtype.is_complex:
        raise ValueError(f"op={name} has no meaning for complex numbers ({dtype}): use SUM, AVG or PRODUCT.")
    return _COMBINE[name]


def finish(op, tensor: torch.Tensor, world_size: int) -> None:
    """The last touch of AVG: divide the sum by the number of ranks."""
    if op_name(op) == "AVG":
        tensor.div_(world_size)
