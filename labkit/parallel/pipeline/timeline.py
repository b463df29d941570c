"""A pipeline step's timeline: its events (one per action, measured or simulated), its bubble, and the
simulator that computes the timeline from stage costs, without processes.

The bubble is the stages' idle share of the step, 1 - busy / (makespan x stages); with equal stage costs both
GPipe and 1F1B idle (p-1)/(m+p-1) of the time, interleaved 1F1B with v chunks per stage (p-1)/(v m+p-1)
(labkit.plan.bubble_fraction), which the simulator reproduces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from labkit.checks import number, whole
from labkit.parallel.pipeline.schedule import Action, schedule

__all__ = ["PipelineEvent", "measured_bubble", "simulate_pipeline"]


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


def simulate_pipeline(kind: str, stages: int, microbatches: int, forward_seconds: float | Sequence[float] = 1.0,
                      backward_seconds: float | Sequence[float] = 2.0, send_seconds: float = 0.0,
                      chunks: int = 1) -> list[PipelineEvent]:
    """The timeline of `schedule(kind, stages, microbatches, chunks)` when each stage's forward of a
    micro-batch takes `forward_seconds` and its backward `backward_seconds` (one number, or one per stage;
    with v chunks, each chunk's action takes 1/v of it), and a transfer between stages `send_seconds`. Each
    action starts as soon as its stage is free, in the schedule's order, and its input is there: a forward
    after the previous piece of the model's forward (stage r - 1's, or for chunk c > 0 on stage 0, the last
    stage's chunk c - 1), a backward after the next piece's backward (and after its own forward, earlier in
    the order). An output leaves when its action ends, as communication_plan posts it. Events come by stage,
    then time.

    >>> events = simulate_pipeline("gpipe", 4, 8, 1.0, 1.0)
    >>> max(e.end for e in events), round(measured_bubble(events), 4)   # (m+p-1)(F+B); 3/11
    (22.0, 0.2727)
    >>> events = simulate_pipeline("interleaved", 4, 8, 1.0, 1.0, chunks=2)
    >>> max(e.end for e in events), round(measured_bubble(events), 4)   # (m+(p-1)/v)(F+B); 3/19
    (19.0, 0.1579)
    """
    plan = schedule(kind, stages, microbatches, chunks)
    p, v = len(plan), whole("chunks", chunks)
    seconds = {"F": [s / v for s in _costs("forward_seconds", forward_seconds, p)],
               "B": [s / v for s in _costs("backward_seconds", backward_seconds, p)]}
    send = number("send_seconds", send_seconds)
    ends: dict[tuple[int, str, int, int], float] = {}  # (stage, kind, micro-batch, chunk) -> when it ended
    free, done, events = [0.0] * p, [0] * p, []  # per stage: when it is free, how many of its actions ran
    while any(done[r] < len(plan[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while done[r] < len(plan[r]) and (arrived := _arrival(plan[r][done[r]], r, p, v, ends, send)) is not None:
                action = plan[r][done[r]]
                start = max(free[r], arrived)
                end = free[r] = start + seconds[action.kind][r]
                ends[(r, action.kind, action.microbatch, action.chunk)] = end
                events.append(PipelineEvent(r, action.kind, action.microbatch, start, end, action.chunk))
                done[r] += 1
                progressed = True
        if not progressed:  # cannot happen for these schedules; a guard should one ever deadlock
            raise RuntimeError(f"simulate_pipeline: no stage can go on; next actions {done} of {plan}.")
    return sorted(events, key=lambda e: (e.stage, e.start))


def _arrival(action: Action, stage: int, stages: int, chunks: int, ends: dict[tuple[int, str, int, int], float],
             send_seconds: float) -> float | None:
    """When `action`'s input is on `stage`: 0 for the batch or the loss, its producer's end (plus the transfer
    from another stage) once that has run, else None."""
    need = _input(action, stage, stages, chunks)
    if need is None:
        return 0.0
    if need not in ends:
        return None
    return ends[need] + (send_seconds if need[0] != stage else 0.0)
def _input(action: Action, stage: int, stages: int, chunks: int) -> tuple[int, str, int, int] | None:
    """The action, on this or another stage, whose output `action` on `stage` takes (None: the batch or the
    loss, already there): the previous piece of the model for a forward, the next for a backward."""
    i, c = action.microbatch, action.chunk
    if action.kind == "F":
        return (stage - 1, "F", i, c) if stage > 0 else (stages - 1, "F", i, c - 1) if c > 0 else None
    if stage < stages - 1:
        return (stage + 1, "B", i, c)
    return (0, "B", i, c + 1) if c < chunks - 1 else None


def _costs(name: str, value, stages: int) -> list[float]:
    """One cost per stage: `value` repeated, or `value` itself if it is a sequence of `stages` numbers."""
    values = list(value) if isinstance(value, Sequence) else [value] * stages
    if len(values) != stages:
        raise ValueError(f"{name}: give one number, or one per stage ({stages}), not {len(values)}.")
    return [number(name, v) for v in values]
