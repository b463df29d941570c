"""Measured bubbles on a shared machine: several pipelined steps per setting, the settings taking turns.

    steps_taking_turns(step, settings, rounds)   inside a rank: each setting's events, one entry per round
    bubbles_by_round(per_rank)                   from every rank's: each setting's bubble in each round

A busy machine mostly adds idle time to a step (a late message, a rank waiting for a core); it can also stretch
a stage's own work (a sleep that wakes late, compute sharing a core), which hides idle time, but that is the
smaller effect with emulated compute; and a slow moment lasts longer than one step. So each round runs every
setting once, starting from the next setting each round (as labkit.measure.seconds_taking_turns does), and a
caller takes the least bubble of the rounds as the step's, and their spread as the noise it measured with.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from labkit.checks import whole
from labkit.parallel.pipeline.timeline import PipelineEvent, measured_bubble

__all__ = ["bubbles_by_round", "steps_taking_turns"]


def steps_taking_turns(step: Callable[..., object], settings: Sequence[tuple], rounds: int) -> dict[Hashable, list]:
    """Inside a rank: {setting: [this rank's events in each round]}, `step(*setting)` returning this rank's
    PipelineResult (run_pipeline's), every setting once per round, the first setting moving on each round."""
    settings = list(settings)
    events: dict[Hashable, list[list[PipelineEvent]]] = {setting: [] for setting in settings}
    for r in range(whole("rounds", rounds)):
        for setting in settings[r % len(settings):] + settings[:r % len(settings)]:
            events[setting].append(step(*setting).events)
    return events


def bubbles_by_round(per_rank: Sequence[dict[Hashable, list]]) -> dict[Hashable, list[float]]:
    """{setting: [its bubble in each round]}, from every rank's steps_taking_turns (labkit.run's list): each
    round's bubble over all stages' events (measured_bubble)."""
    return {setting: [measured_bubble([e for rank in per_rank for e in rank[setting][k]])
                      for k in range(len(per_rank[0][setting]))]
            for setting in per_rank[0]}
