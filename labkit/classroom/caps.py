"""The class caps: how many ranks one call may start and how many threads each rank may use, set by the instructor.

On one JupyterHub server thirty students share the cores: one who asks for 16 ranks of 8 threads each slows every
other student's cells. The hub puts the caps in the environment of each student's server (so of every kernel and
rank it starts), and they are read here and only here, at each call (a kernel started before the instructor changed
them picks up the new values with its next call):

- LABKIT_MAX_WORLD_SIZE: ranks per labkit.run or %%ranks call, and so the ranks a student keeps warm;
- LABKIT_MAX_THREADS_PER_RANK: torch threads per rank (the launcher otherwise shares the machine's cores).

Unset (or empty), a cap does not apply: a laptop behaves as before. A value that is not a whole number >= 1 is the
instructor's mistake, and every call says so rather than guess. The caps are a fair share, not a wall: a student
can change their own environment; what bounds a student for certain is their server's cgroup (labkit.classroom's
`confine`).

    >>> max_world_size({"LABKIT_MAX_WORLD_SIZE": "4"})
    4
    >>> capped_world_size(8, {"LABKIT_MAX_WORLD_SIZE": "4"})
    Traceback (most recent call last):
    ...
    ValueError: world_size=8: this class allows at most 4 ranks per call (set by your instructor for this class: ...
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

__all__ = ["MAX_THREADS_PER_RANK_VARIABLE", "MAX_WORLD_SIZE_VARIABLE", "capped_threads", "capped_world_size",
           "class_cap", "max_threads_per_rank", "max_world_size"]

MAX_WORLD_SIZE_VARIABLE = "LABKIT_MAX_WORLD_SIZE"
MAX_THREADS_PER_RANK_VARIABLE = "LABKIT_MAX_THREADS_PER_RANK"
_WHAT = {MAX_WORLD_SIZE_VARIABLE: "ranks per call", MAX_THREADS_PER_RANK_VARIABLE: "torch threads per rank"}
_WHOLE = re.compile(r"\s*[0-9]+\s*")  # int() would also take "4_0" (40), "+4" and Arabic-Indic digits


def class_cap(variable: str, environ: Mapping[str, str] | None = None) -> int | None:
    """The cap `variable` sets in `environ` (default: this process's environment), None when unset or empty;
    ValueError when it is set to anything but a whole number >= 1."""
    raw = (os.environ if environ is None else environ).get(variable)
    if raw is None or not raw.strip():
        return None
    if not _WHOLE.fullmatch(raw) or int(raw) < 1:
        raise ValueError(f"{variable}={raw!r}: this class cap ({_WHAT.get(variable, 'a limit')}) must be a whole "
                         f"number >= 1. It comes from your server's environment, set by your instructor for this "
                         f"class: ask them to fix it (or, on your own machine, unset {variable}).")
    return int(raw)


def max_world_size(environ: Mapping[str, str] | None = None) -> int | None:
    """LABKIT_MAX_WORLD_SIZE: the most ranks one labkit.run or %%ranks call may start, None when uncapped."""
    return class_cap(MAX_WORLD_SIZE_VARIABLE, environ)


def max_threads_per_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """LABKIT_MAX_THREADS_PER_RANK: the most torch threads a rank may use, None when uncapped."""
    return class_cap(MAX_THREADS_PER_RANK_VARIABLE, environ)


def capped_world_size(world_size: int, environ: Mapping[str, str] | None = None) -> int:
    """`world_size` (an int already checked by labkit.checks.rank_count), or ValueError naming the request, the
    class cap, where the cap comes from and what to do, when it asks for more ranks than LABKIT_MAX_WORLD_SIZE."""
    cap = max_world_size(environ)
    if cap is not None and world_size > cap:
        raise ValueError(
            f"world_size={world_size}: this class allows at most {cap} rank{'s' if cap != 1 else ''} per call (set "
            f"by your instructor for this class: {MAX_WORLD_SIZE_VARIABLE}={cap}), because every student on this "
            f"server shares its cores and memory. Ask for {cap} or fewer: labkit.run(..., world_size={cap}) or "
            f"%%ranks {cap} (a notebook's parameters cell sets its world_size).")
    return world_size


def capped_threads(threads: int, environ: Mapping[str, str] | None = None) -> int:
    """`threads` per rank, at most LABKIT_MAX_THREADS_PER_RANK when that is set."""
    cap = max_threads_per_rank(environ)
    return threads if cap is None else min(threads, cap)
