"""A pipeline step's timeline: its events (one per action, measured or simulated), its bubble, and the
simulator that computes the timeline from stage costs, without processes.

The bubble is the stages' idle share of the step, 1 - busy / (makespan x stages); with equal stage costs both
GPipe and 1F1B idle (p-1)/(m+p-1) of the time (labkit.plan.bubble_fraction), which the simulator reproduces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from labkit.checks import number
from labkit.parallel.pipeline.schedule import Action, schedule

__all__ = ["PipelineEvent", "measured_bubble", "simulate_pipeline"]


@dataclass(frozen=True)
class PipelineEvent:
    """One action on a timeline, in seconds from the step's start: what run_pipeline measures and
    simulate_pipeline computes. An executor's `start` is when the stage had its input (after any receive)."""
    stage: int
    kind: str
    microbatch: int
    start: float
    end: float

    @property
    def seconds(self) -> float:
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


def simulate_pipeline(kind: str, stages: int, microbatches: int, forward_seconds: float | Sequence[float] = 1.0,
                      backward_seconds: float | Sequence[float] = 2.0, send_seconds: float = 0.0,
                      ) -> list[PipelineEvent]:
    """The timeline of `schedule(kind, stages, microbatches)` when each stage's forward takes
    `forward_seconds` and backward `backward_seconds` (one number, or one per stage), and a transfer
    between neighbours `send_seconds`. Each action starts as soon as its stage is free, in the schedule's
    order, and its inputs are there: F(i) on stage r after F(i) on r-1, B(i) on r after B(i) on r+1 (and
    after F(i) on r, earlier in the order). Events come by stage, then time.

    >>> events = simulate_pipeline("gpipe", 4, 8, 1.0, 1.0)
    >>> max(e.end for e in events), round(measured_bubble(events), 4)   # (m+p-1)(F+B); 3/11
    (22.0, 0.2727)
    """
    plan = schedule(kind, stages, microbatches)
    p = len(plan)
    seconds = {"F": _costs("forward_seconds", forward_seconds, p), "B": _costs("backward_seconds", backward_seconds, p)}
    send = number("send_seconds", send_seconds)
    ends: dict[tuple[int, str, int], float] = {}  # (stage, kind, micro-batch) -> when it ended
    free, done, events = [0.0] * p, [0] * p, []  # per stage: when it is free, how many of its actions ran
    while any(done[r] < len(plan[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while done[r] < len(plan[r]) and (ready := _inputs_ready(plan[r][done[r]], r, p, ends)) is not None:
                action = plan[r][done[r]]
                start = max([free[r], *[ends[need] + send for need in ready]])
                end = ends[(r, action.kind, action.microbatch)] = free[r] = start + seconds[action.kind][r]
                events.append(PipelineEvent(r, action.kind, action.microbatch, start, end))
                done[r] += 1
                progressed = True
        if not progressed:  # cannot happen for gpipe or 1f1b; a guard should a schedule ever deadlock
            raise RuntimeError(f"simulate_pipeline: no stage can go on; next actions {done} of {plan}.")
    return sorted(events, key=lambda e: (e.stage, e.start))


def _inputs_ready(action: Action, stage: int, stages: int,
                  ends: dict[tuple[int, str, int], float]) -> list[tuple[int, str, int]] | None:
    """The actions of neighbour stages whose output `action` on `stage` takes (F(i) from stage - 1, B(i) from
    stage + 1), or None while one of them has not run yet."""
    i = action.microbatch
    needs = [(stage - 1, "F", i)] if action.kind == "F" and stage > 0 else []
    needs += [(stage + 1, "B", i)] if action.kind == "B" and stage < stages - 1 else []
    return None if any(need not in ends for need in needs) else needs


def _costs(name: str, value, stages: int) -> list[float]:
    """One cost per stage: `value` repeated, or `value` itself if it is a sequence of `stages` numbers."""
    values = list(value) if isinstance(value, Sequence) else [value] * stages
    if len(values) != stages:
        raise ValueError(f"{name}: give one number, or one per stage ({stages}), not {len(values)}.")
    return [number(name, v) for v in values]
