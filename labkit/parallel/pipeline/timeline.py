"""A pipeline step's timeline: its events (one per action, measured by run_pipeline or computed by
simulate_pipeline), and its bubble.

The bubble is the stages' idle share of the step, 1 - busy / (makespan x stages); with equal stage costs both
GPipe and 1F1B idle (p-1)/(m+p-1) of the time, interleaved 1F1B with v chunks per stage (p-1)/(v m+p-1)
(labkit.plan.bubble_fraction), which the simulator (simulate.py) reproduces when hand-overs cost nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PipelineEvent", "measured_bubble"]


@dataclass(frozen=True)
class PipelineEvent:
    """One action on a timeline, in seconds from the step's start: what run_pipeline measures and
    simulate_pipeline computes. An executor's `start` is when the stage had its input (after any receive).
    `chunk`: the stage's chunk it ran (interleaved; else 0)."""
    stage: int
    kind: str
    microbatch: int
    start: float
    end: float
    chunk: int = 0

    @property
    def seconds(self) -> float:
        """How long the action ran: end - start."""
        return self.end - self.start


def measured_bubble(events: Sequence[PipelineEvent]) -> float:
    """Idle share of a timeline: 1 - (sum of action times) / (makespan x stages), the definition behind
    (p-1)/(m+p-1). Pass every stage's events together.

    >>> measured_bubble([PipelineEvent(0, "F", 0, 0.0, 1.0), PipelineEvent(1, "F", 0, 1.0, 2.0)])  # 2 of 4 idle
    0.5
    """
    if not events:
        raise ValueError("measured_bubble needs the events of at least one action.")
    stages = len({e.stage for e in events})
    makespan = max(e.end for e in events) - min(e.start for e in events)
    return 1.0 - sum(e.seconds for e in events) / (makespan * stages)
