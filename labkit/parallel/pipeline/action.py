"""One step of a pipeline stage's schedule (its own leaf: the schedules of schedule.py and zero_bubble.py build it)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Action"]


@dataclass(frozen=True)
class Action:
    """One step of a stage's schedule: the forward ("F") or backward ("B") of micro-batch `microbatch` through
    the stage's chunk `chunk` (0 to v-1: its layers `chunk * p + stage` of the v p pieces; always 0 without
    interleaving). Written "F3" for chunk 0, "F3.1" for chunk 1. In a schedule that splits the backward
    (SPLIT_BACKWARD: "zb-h1"), "B" is only the gradient with respect to the stage's input (what the previous stage
    waits for) and "W" the gradient with respect to its weights (Qi et al. 2023's names; torch's "I" and "W")."""
    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")
