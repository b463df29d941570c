"""The lesson's worked 7B example, Steps 1-6, recomputed from its assumptions by the planner's functions.

Scenario (the defaults): fine-tune 7.0e9 parameters, per-device batch 8, gradient accumulation 2, 1.0 s of
compute per optimizer step, 40,000 examples for one epoch, 1 GPU against 8, BF16 gradients (2 bytes/param),
16 bytes/param of training state. Give `bandwidth` (bytes/s per rank) to add the AllReduce to the clock.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from labkit.checks import fraction, number, overflow_named, whole
from labkit.plan.batch import effective_batch, scale_lr, steps_per_epoch
from labkit.plan.step_time import bandwidth_for_speedup, step_seconds
from labkit.plan.traffic import GB, allreduce_seconds, ring_allreduce_bytes
from labkit.tables import text_table

__all__ = ["GROWS_WITH", "SLOW_LINK_SPEEDUP", "WorkedExample", "worked_example"]

SLOW_LINK_SPEEDUP = 3.0  # Step 3: "over a slow link it dominates and your 8x becomes 3x"
COMM = ("params", "gradient_bytes_per_param", "devices")  # the gradient AllReduce grows with these
# Each derived number that can overflow, and the fields it grows with, checked in this order when a scenario is
# made, so that an error names the fields (params) rather than a helper's argument (nbytes) or an inf later.
GROWS_WITH = {
    "gradient_bytes": ("params", "gradient_bytes_per_param"),
    "parallel_batch": ("per_device_batch", "devices", "accumulation_steps"),
    "baseline_epoch_seconds": ("examples", "step_compute_seconds"),
    "accumulation_alternative_epoch_seconds": ("examples", "devices", "step_compute_seconds"),
    "ring_bytes_per_rank": COMM,
    "bandwidth_for_slow_link_speedup": (*COMM, "step_compute_seconds", "overlap", "accumulation_steps"),
    "comm_seconds": (*COMM, "bandwidth"),
    "parallel_epoch_seconds": (*COMM, "bandwidth", "examples", "step_compute_seconds"),
    "memory_bytes": ("params", "bytes_per_param"),
}


@dataclass(frozen=True)
class WorkedExample:
    """One scenario and every number the lesson derives from it; `print()` shows them next to the lesson's.

    Fields (the overrides `worked_example` accepts): params; per_device_batch, accumulation_steps, examples
    and devices (counts); step_compute_seconds (one optimizer step's compute on any one GPU);
    gradient_bytes_per_param (what the AllReduce moves); bytes_per_param (weights, grads and optimizer state);
    bandwidth (bytes/s per rank, None: communication ignored); overlap (fraction of the AllReduce started
    during the backward: it hides behind the last of the accumulation_steps micro-batches' backward at most,
    labkit.plan.step_seconds).
    The properties, grouped by lesson step, are the derived numbers; their units are in their names.

    Definitions worth knowing:
    - Speedups are epoch-time ratios against the 1-GPU baseline, so they include the rounding up of steps
      (2,500 / 313 = 7.99, not 8); `bandwidth_for_slow_link_speedup` inverts the per-step model of
      `data_parallel_speedup` instead (exactly 3x at 14.7 GB/s; the epochs then give 2.99x).
    - Step 5, the accumulation alternative: one GPU reaches the data-parallel batch with devices x
      accumulation_steps micro-batches per optimizer step. A micro-batch takes step_compute_seconds /
      accumulation_steps (0.5 s), so a step takes 16 x 0.5 = 8 s and an epoch 313 x 8 = 2,504 s: 8x the
      8-GPU epoch and as long as the 1-GPU baseline's. The lesson's "16x the wall-clock" matches the 16
      sequential passes per optimizer step (against 1 without accumulation), not the time.
    """

    params: float = 7.0e9
    per_device_batch: int = 8
    accumulation_steps: int = 2
    step_compute_seconds: float = 1.0
    examples: int = 40_000
    devices: int = 8
    gradient_bytes_per_param: float = 2
    bytes_per_param: float = 16
    bandwidth: float | None = None
    overlap: float = 0.0

    def __post_init__(self):
        """Check every field, store it as a plain int or float (a Fraction or Decimal would not format), and
        compute the derived numbers once, so that a scenario past float range is refused naming its fields."""
        checked = {name: whole(name, getattr(self, name))
                   for name in ("per_device_batch", "accumulation_steps", "examples", "devices")}
        checked |= {name: number(name, getattr(self, name), inclusive=False)
                    for name in ("params", "step_compute_seconds", "gradient_bytes_per_param", "bytes_per_param")}
        if self.bandwidth is not None:
            checked["bandwidth"] = number("bandwidth", self.bandwidth, inclusive=False)
        checked["overlap"] = fraction("overlap", self.overlap)
        for name, value in checked.items():
            object.__setattr__(self, name, value)  # frozen: the dataclass way to set a field in __post_init__
        for quantity, fields in GROWS_WITH.items():
            inputs = {name: getattr(self, name) for name in fields}
            with overflow_named(f"WorkedExample.{quantity}", **inputs) as finite:
                finite(getattr(self, quantity))

    # Step 1: one GPU
    @property
    def baseline_batch(self) -> int:
        return effective_batch(self.per_device_batch, 1, self.accumulation_steps)

    @property
    def baseline_steps(self) -> int:
        return steps_per_epoch(self.examples, self.baseline_batch)

    @property
    def baseline_epoch_seconds(self) -> float:
        return self.baseline_steps * self.step_compute_seconds

    # Step 2: data parallel, communication ignored
    @property
    def parallel_batch(self) -> int:
        return effective_batch(self.per_device_batch, self.devices, self.accumulation_steps)

    @property
    def parallel_steps(self) -> int:
        return steps_per_epoch(self.examples, self.parallel_batch)

    @property
    def parallel_epoch_seconds_no_comm(self) -> float:
        return self.parallel_steps * self.step_compute_seconds

    @property
    def speedup_no_comm(self) -> float:
        return self.baseline_epoch_seconds / self.parallel_epoch_seconds_no_comm

    # Step 3: the gradient AllReduce
    @property
    def gradient_bytes(self) -> float:
        return self.params * self.gradient_bytes_per_param

    @property
    def ring_bytes_per_rank(self) -> float:
        return ring_allreduce_bytes(self.gradient_bytes, self.devices)

    @property
    def bandwidth_for_slow_link_speedup(self) -> float | None:
        """Per-rank bytes/s at which the speedup falls to 3x; None with 3 devices or fewer."""
        if self.devices <= SLOW_LINK_SPEEDUP:
            return None
        return bandwidth_for_speedup(SLOW_LINK_SPEEDUP, self.devices, self.step_compute_seconds,
                                     self.ring_bytes_per_rank, self.overlap, self.accumulation_steps)

    @property
    def comm_seconds(self) -> float | None:
        """Seconds of one gradient AllReduce over `bandwidth` (latency ignored); None without a bandwidth."""
        if self.bandwidth is None:
            return None
        return allreduce_seconds(self.gradient_bytes, self.devices, self.bandwidth)

    @property
    def parallel_step_seconds(self) -> float | None:
        if self.comm_seconds is None:
            return None
        return step_seconds(self.step_compute_seconds, self.comm_seconds, self.overlap, self.accumulation_steps)

    @property
    def parallel_epoch_seconds(self) -> float | None:
        if self.parallel_step_seconds is None:
            return None
        return self.parallel_steps * self.parallel_step_seconds

    @property
    def speedup(self) -> float | None:
        if self.parallel_epoch_seconds is None:
            return None
        return self.baseline_epoch_seconds / self.parallel_epoch_seconds

    # Step 4: the learning rate follows the batch
    @property
    def batch_growth(self) -> float:
        return self.parallel_batch / self.baseline_batch

    @property
    def lr_factor_linear(self) -> float:
        return scale_lr(1.0, self.baseline_batch, self.parallel_batch, rule="linear")

    @property
    def lr_factor_sqrt(self) -> float:
        return scale_lr(1.0, self.baseline_batch, self.parallel_batch, rule="sqrt")

    # Step 5: the same batch on one GPU by accumulation
    @property
    def accumulation_alternative_steps(self) -> int:
        return self.devices * self.accumulation_steps

    @property
    def accumulation_alternative_batch(self) -> int:
        return effective_batch(self.per_device_batch, 1, self.accumulation_alternative_steps)

    @property
    def accumulation_alternative_step_seconds(self) -> float:
        # micro-batches x (step_compute_seconds / accumulation_steps), multiplied first: a tiny step cannot round to 0
        return self.accumulation_alternative_steps * self.step_compute_seconds / self.accumulation_steps

    @property
    def accumulation_alternative_epoch_seconds(self) -> float:
        steps = steps_per_epoch(self.examples, self.accumulation_alternative_batch)
        return steps * self.accumulation_alternative_step_seconds

    @property
    def accumulation_alternative_slowdown(self) -> float:
        """Epoch time of the accumulation alternative over the data-parallel epoch's (communication ignored)."""
        return self.accumulation_alternative_epoch_seconds / self.parallel_epoch_seconds_no_comm

    # Step 6: does one replica fit?
    @property
    def memory_bytes(self) -> float:
        return self.params * self.bytes_per_param

    def rows(self) -> list[tuple[str, str, str, str]]:
        """(step, quantity, value, the lesson's figure) for every number above."""
        n, hidden = self.devices, f", overlap {self.overlap:.0%}" if self.overlap else ""
        rows = [
            ("1", "effective batch, 1 GPU", f"{self.baseline_batch:,}", "8 x 1 x 2 = 16"),
            ("1", "steps per epoch", f"{self.baseline_steps:,}", "40,000 / 16 = 2,500"),
            ("1", "wall-clock per epoch", _clock(self.baseline_epoch_seconds), "2,500 s ~ 41.7 min"),
            ("2", f"effective batch, {n} GPUs", f"{self.parallel_batch:,}", "8 x 8 x 2 = 128"),
            ("2", "steps per epoch", f"{self.parallel_steps:,}", "40,000 / 128 ~ 313"),
            ("2", "wall-clock per epoch, no comm", _clock(self.parallel_epoch_seconds_no_comm), "313 s ~ 5.2 min"),
            ("2", "speedup, no comm", f"{self.speedup_no_comm:.2f}x", "8x"),
            ("3", "gradient bytes per step", _gigabytes(self.gradient_bytes), "14.0e9 bytes"),
            ("3", "ring traffic per rank per step", _gigabytes(self.ring_bytes_per_rank), "24.5 GB"),
            ("3", f"per-rank bandwidth where speedup is 3x{hidden}", _rate(self.bandwidth_for_slow_link_speedup),
             '"your 8x becomes 3x"'),
        ]
        if self.bandwidth is not None:
            rows += [
                ("3", f"AllReduce at {_rate(self.bandwidth)}", f"{self.comm_seconds:.3f} s", "24.5 GB / bandwidth"),
                ("3", f"step time, overlap {self.overlap:.0%}", f"{self.parallel_step_seconds:.3f} s", "-"),
                ("3", "wall-clock per epoch, with comm", _clock(self.parallel_epoch_seconds), "-"),
                ("3", "speedup, with comm", f"{self.speedup:.2f}x", "8x, or 3x on a slow link"),
            ]
        return rows + [
            ("4", "effective batch growth", f"{self.batch_growth:g}x", "16 -> 128, 8x"),
            ("4", "learning-rate factor, linear / sqrt", f"{self.lr_factor_linear:g}x / {self.lr_factor_sqrt:.2f}x",
             "linear or square root"),
            ("5", "accumulation steps on 1 GPU", f"{self.accumulation_alternative_steps}", "8 x 1 x 16 = 128"),
            ("5", "effective batch, 1 GPU", f"{self.accumulation_alternative_batch:,}", "same effective batch"),
            ("5", "time per optimizer step", f"{self.accumulation_alternative_step_seconds:g} s", "-"),
            ("5", "wall-clock per epoch", _clock(self.accumulation_alternative_epoch_seconds), "-"),
            ("5", f"wall-clock vs {n} GPUs, no comm", f"{self.accumulation_alternative_slowdown:.2f}x",
             "16x the wall-clock"),
            ("6", "weights + grads + Adam state", _gigabytes(self.memory_bytes), "16 bytes/param ~ 112 GB"),
        ]

    def table(self) -> str:
        """The rows as aligned text: step, quantity, value, lesson (GB = 1e9 bytes)."""
        return text_table(("step", "quantity", "value", "lesson"), self.rows(), rule=False)

    def __str__(self) -> str:
        return self.table()


def worked_example(**overrides) -> WorkedExample:
    """The lesson's scenario, with any field replaced by keyword (see WorkedExample for the names).

    >>> example = worked_example()
    >>> example.parallel_batch, example.parallel_steps, example.ring_bytes_per_rank
    (128, 313, 24500000000.0)
    >>> worked_example(devices=4).parallel_steps
    625
    """
    known = {field.name for field in dataclasses.fields(WorkedExample)}
    for name in overrides:
        if name not in known:
            raise ValueError(f"{name}: not a scenario field; use one of {', '.join(sorted(known))}.")
    return WorkedExample(**overrides)


def _gigabytes(nbytes: float) -> str:
    return f"{nbytes / GB:.1f} GB"


def _rate(bytes_per_second: float | None) -> str:
    return "n/a" if bytes_per_second is None else f"{bytes_per_second / GB:.1f} GB/s"


def _clock(seconds: float) -> str:
    return f"{seconds:,.0f} s ({seconds / 60:.1f} min)"
