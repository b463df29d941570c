"""Effective batch, steps per epoch, and the learning rate when the batch grows.

Adding devices under data parallelism (or accumulation steps) multiplies the effective batch: that is
a hyperparameter change, and the learning rate usually has to follow it.
"""

from __future__ import annotations

import math

from labkit.checks import choice, finite_result, number, whole

__all__ = ["LR_RULES", "effective_batch", "scale_lr", "steps_per_epoch"]

LR_RULES = ("linear", "sqrt")


def effective_batch(per_device_batch: int, devices: int, accumulation_steps: int = 1) -> int:
    """Examples behind one optimizer step: per-device batch x devices x accumulation steps.

    Accumulation and extra devices are interchangeable here (8 x 1 x 16 == 8 x 8 x 2); they differ only
    in wall-clock time. Source: Goyal et al. 2017, "Accurate, Large Minibatch SGD", section 2.

    >>> effective_batch(8, 8, accumulation_steps=2)   # the lesson's 8 GPUs
    128
    """
    batch = (whole("per_device_batch", per_device_batch) * whole("devices", devices)
             * whole("accumulation_steps", accumulation_steps))
    return finite_result("effective_batch", batch, per_device_batch=per_device_batch, devices=devices,
                         accumulation_steps=accumulation_steps)


def steps_per_epoch(examples: int, effective_batch: int) -> int:
    """Optimizer steps to see `examples` once: rounded up, since a last, smaller batch is still a step.

    >>> steps_per_epoch(40_000, 128)                  # the lesson's "~313 steps"
    313
    """
    examples, batch = whole("examples", examples), whole("effective_batch", effective_batch)
    return -(-examples // batch)


def scale_lr(lr: float, old_batch: float, new_batch: float, rule: str = "linear") -> float:
    """The learning rate for `new_batch`, given one tuned at `old_batch`.

    "linear" multiplies by k = new/old (Goyal et al. 2017, with warmup); "sqrt" by sqrt(k) (Krizhevsky
    2014, "One weird trick for parallelizing convolutional neural networks"). Both are heuristics, not laws:
    a starting point for tuning, never a substitute for reading the loss curve.

    >>> scale_lr(1e-4, 16, 128), scale_lr(1e-4, 16, 64, rule="sqrt")
    (0.0008, 0.0002)
    """
    growth = number("new_batch", new_batch, inclusive=False) / number("old_batch", old_batch, inclusive=False)
    factor = growth if choice("rule", rule, LR_RULES) == "linear" else math.sqrt(growth)
    return finite_result("scale_lr", number("lr", lr, inclusive=False) * factor, lr=lr, old_batch=old_batch,
                         new_batch=new_batch)
