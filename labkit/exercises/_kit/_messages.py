"""The messages every grader shares: a refused call, a hang, calls never waited for, a solution that is not a
function; and reading a RankError: which rank's failure to report, and what a forbidden call was.

Each grader words what is its own (why a call is off in its exercise, what its collectives should have done);
the sentences here are the same in every exercise, so they are written once.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import labkit
from labkit._refusals import ForbiddenCall
from labkit.launch.errors import OWN_CODE_NOTE, Failure, NoReply

__all__: list[str] = []

_GROUP_MAKERS = ("new_group", "new_subgroups", "new_subgroups_by_enumeration", "split_group", "shrink_group",
                 "merge_remote_group", "init_device_mesh", "init_process_group", "destroy_process_group")


def forbidden_spelling(failure: Failure) -> str | None:
    """What a rank called, from the ForbiddenCall it raised (its one argument: the spelling, as
    `Guard.refuse` raises it); None for another error."""
    if not failure.raised(ForbiddenCall) or not failure.exception_args:
        return None
    return str(failure.exception_args[0])


def first_failure(error: labkit.RankError):
    """The failure a grader reports: the earliest call the guard switched off, else the earliest rank's own
    error (a rank that merely stopped, only when nothing else failed). Returns (failure, what it called: the
    forbidden spelling, or None for an error of its own)."""
    forbidden = [f for f in error.failures if forbidden_spelling(f) is not None]
    if forbidden:
        first = min(forbidden, key=lambda f: (f.time, f.rank))
        return first, forbidden_spelling(first)
    first = min((f for f in error.failures if f.kind != NoReply.STOPPED), key=lambda f: (f.time, f.rank),
                default=error.failures[0])
    return first, None


def failure_sentence(failure: Failure) -> str:
    """A rank's failure as a verdict says it, without a final period: 'rank 1 raised ValueError: bad', "rank 1's
    process exited with code 0 before replying (...)", 'rank 0 was still running in ...' (a rank that died or was
    stopped raised nothing)."""
    summary = failure.summary.strip().removesuffix(".")
    if failure.kind == NoReply.DIED:
        return f"rank {failure.rank}'s {summary}"
    if failure.kind == NoReply.STOPPED:
        return f"rank {failure.rank} {summary}"
    return f"rank {failure.rank} raised {summary}"


def where_ranks_waited(hang: labkit.RankTimeout, ranks: int = 2) -> str:
    """Where the first `ranks` ranks that were stopped mid-call were waiting, from labkit's hang report."""
    waiting = sorted((f for f in hang.failures if f.kind == NoReply.STOPPED), key=lambda f: f.rank)[:ranks]
    return "; ".join(f"rank {f.rank} {_outside_the_graders(f)}" for f in waiting)


_GRADERS_DIR = str(Path(__file__).parents[1]) + "/"  # labkit/exercises/
_FRAME = re.compile(r'^  (?:File "(?P<file>[^"]*)"|\S.*?), line \d+, in (?P<function>\S+)$')  # format_frames' lines


def _outside_the_graders(stopped) -> str:
    """A stopped rank's summary ('was still running in broadcast, ...'), naming the innermost call outside
    labkit.exercises: a guard's stand-in (the watched Work.wait) is not where the student's code waited."""
    frames = [m for m in map(_FRAME.match, stopped.detail.splitlines()) if m]
    ours = [(m["file"] or "").startswith(_GRADERS_DIR) for m in frames]
    if not frames or not ours[-1] or all(ours):
        return stopped.summary
    outside = next(m["function"] for m, mine in zip(reversed(frames), reversed(ours), strict=True) if not mine)
    return stopped.summary.replace(f"running in {frames[-1]['function']}", f"running in {outside}", 1)


def forbidden_message(rank: int, spelling: str, caught: bool, why: Callable[[str, str], str]) -> str:
    """Rank `rank` called `spelling`, which the guard switched off: say so, then why it is off in this exercise
    and what to use instead, `why(spelling, name)` with `name` the function's own name (e.g. "all_reduce")."""
    also = " (and caught the error; it still counts)" if caught else ""
    name = spelling.split(" (")[0].replace("'s ", ".").rsplit(".", 1)[-1].split()[-1]
    if name in _GROUP_MAKERS:
        reason = "Work in the default process group, which every rank already shares: leave out group=."
    else:
        reason = why(spelling, name)
    return f"rank {rank} called {spelling}{also}. {reason}"




def hang_message(hang: labkit.RankTimeout, timeout_seconds: float, why: str) -> str:
    """A run that never finished: how long it ran, `why` (what the ranks must agree on, in the exercise's words),
    and where the first ranks waited (from labkit's hang report). Where every stopped rank was in the student's own
    code (a time.sleep), no rank waited for another, and `why` would be wrong: it says so instead."""
    waited = where_ranks_waited(hang)
    stopped = [f for f in hang.failures if f.kind == NoReply.STOPPED]
    if stopped and all(f.in_own_code for f in stopped):
        why = ("no rank was waiting for a message or a collective: each was still running your own code (a sleep, "
               "or a loop that does not end?).")
        waited = waited.replace(OWN_CODE_NOTE, "")
    return f"it never finished (stopped after {timeout_seconds:g} s): {why}" + (f" {waited}." if waited else "")


def unwaited_message(rank: int, calls: list, what: str, consequence: str) -> str:
    """Calls started with async_op=True that graded code never waited for (`calls`, the kit's records): how many
    of `what` ("all_reduce"), and `consequence`, what went wrong because of it, in the exercise's words."""
    futures = sum(1 for call in calls if call.future)
    taken = (f" It took the future of {futures} of them (handle.get_future()), which is no wait: only its "
             "wait() is." if futures else "")
    return (f"rank {rank} started {len(calls)} {what}(s) with async_op=True and never waited for them "
            f"(handle.wait()): {consequence}.{taken}")


def not_callable_message(example: str, given: object) -> str:
    """A grader given something other than a function: say what to pass, e.g. `example` =
    "check_average_gradients(average_gradients)"."""
    return f"pass your function itself, e.g. {example}, not {type(given).__name__}."
