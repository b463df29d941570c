"""How long a grader waits: its own time limit, scaled on a shared class server (LABKIT_GRADING_TIME_SCALE).

A grader's limits (10 s per case for the AllReduce exercises) say "a right solution needs milliseconds, so a wait
this long is a hang" on a student's own machine. On a class's server every student's ranks share the cores: 8
students at once on 2 cores made a right average_gradients take over 10 s for one case (tests/hub), and the
grader called it a hang. The class's spawner (labkit.classroom.spawner) sets the scale for its students; unset, 1.
"""

from __future__ import annotations

import os

from labkit.checks import timeout_seconds as checked_timeout

__all__: list[str] = []

SCALE_ENV = "LABKIT_GRADING_TIME_SCALE"


def grading_seconds(name: str, seconds: float) -> float:
    """`seconds` checked (labkit.checks.timeout_seconds), times the class's scale. ValueError for a scale that is
    not a number >= 1, naming the variable."""
    seconds = checked_timeout(name, seconds)
    raw = os.environ.get(SCALE_ENV, "1")
    try:
        scale = float(raw)
    except ValueError:
        scale = float("nan")
    if not scale >= 1 or scale == float("inf"):
        raise ValueError(f"{SCALE_ENV}={raw!r}: the graders' time scale must be a number >= 1 (1: as on a laptop); "
                         f"the class's hub sets it (labkit.classroom.spawner.CourseSpawner.grading_time_scale)")
    return seconds * scale
