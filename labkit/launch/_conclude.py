"""Concluding a call: from what the ranks sent back, the results in rank order or the one exception that says what
went wrong (TypeError, RankTimeout, RankError), each rank's `Failure`, and whether the pool may be kept.

Why a room of its own: the verdict is the launcher's contract with its callers (graders read `RankError`'s fields,
a student reads its text); kept apart from moving bytes and from starting and stopping ranks, every rule of it
(a dead rank first, a follow-on failure never the root cause, ranks out of step restart the pool) sits in one file.
Keep or restart: a pool is kept after a failure only if every rank replied, no rank is gone, and every process
group counted the same number of operations on each of its ranks (`same_steps`); the lifecycle then runs a tiny
all_reduce as well.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from labkit.classroom.cgroups import oom_kill_cause
from labkit.launch import serialize
from labkit.launch._channels import Channels, RankHandle
from labkit.launch.errors import (
    Failure,
    NoReply,
    RankError,
    RankTimeout,
    exception_line,
    in_own_code,
    raised_failure,
    rank_list,
    still_running,
)
from labkit.launch.forkserver import describe_exit
from labkit.launch.inflight import collectives_report, where_in_collectives
from labkit.launch.protocol import Outcome, Reply, Stack, StartFailed

__all__ = []

_STOPPED_BY_LABKIT = "interrupted by labkit (Ctrl-C or the stop button)"
DEATH_DETAILS_SECONDS = 3.0  # to collect a dead rank's exit status and last stderr lines (the fork server reports
# within milliseconds when idle; the margin is for a loaded machine)


@dataclass
class Ending:
    """What the ranks left of one call: each rank's reply, the failures, the ranks still running, their stacks."""

    replies: dict[int, Reply]
    failures: list[Failure]
    running: list[int]
    stacks: dict[int, Stack | None]

    def notes(self) -> list[str]:
        """Which collective each group's ranks are in, for the error's headline (labkit.launch.inflight)."""
        return collectives_report({rank: s.collectives if s else None for rank, s in self.stacks.items()})


def gather(channels: Channels, call_id: int) -> Ending:
    """Ask the ranks still running where they are, show all output, take every reply to `call_id`."""
    running = [r for r in channels.ranks if not r.finished(call_id)]
    # Ranks still running: where each is, and from every live rank, the collectives it has not seen complete
    stacks = channels.stacks([r for r in channels.ranks if not r.gone] if running else [])
    channels.flush_output()
    returned = {r.rank: r.returning.get(call_id) for r in running}  # the nbytes of a big result being sent
    replies = channels.take_replies(call_id)
    failures = [death(channels, r) for r in channels.ranks if r.gone and r.rank not in replies]
    failures += [failure_from_reply(rank, reply) for rank, reply in replies.items() if reply.outcome != Outcome.OK]
    failures += [_stopped(r.rank, stacks[r.rank], returned[r.rank]) for r in running]
    return Ending(replies, failures, [r.rank for r in running], stacks)


def results(ending: Ending, world_size: int) -> list:
    """Every rank's result, in rank order, from a call without failures."""
    return [serialize.load_result(r, ending.replies[r].body) for r in range(world_size)]


def may_keep(ending: Ending, channels: Channels) -> bool:
    """Whether the pool may be kept after a failed call, if the health probe agrees: no rank still running or gone,
    every rank replied, and each group's operation counts agree."""
    if ending.running or any(r.gone for r in channels.ranks):
        return False
    return len(ending.replies) == len(channels.ranks) and same_steps([reply.steps for reply in ending.replies.values()])


def call_error(ending: Ending, world_size: int, timeout_seconds: float, pool_stopped: bool) -> Exception:
    """The exception a failed call raises: TypeError if every failure is an unpicklable result,
    RankTimeout if every failure is a rank still running, RankError otherwise; notes (which collective
    each group's ranks are in) go under its headline."""
    failures, running = ending.failures, ending.running
    restarted = "" if not pool_stopped else (
        f" The {world_size}-rank pool was stopped; the next call starts a fresh one"
        " (variables defined in %%ranks cells are gone)."
    )
    unpicklable = [f for f in failures if f.kind == Outcome.UNPICKLABLE]
    if unpicklable and len(unpicklable) == len(failures):
        return TypeError(f"{rank_list(f.rank for f in unpicklable)} returned a value that cannot be "
                         f"sent back: {unpicklable[0].summary}. Return plain data (tensors, numbers, "
                         "lists, dicts) instead.")
    if running and len(running) == len(failures):
        done = [r for r in range(world_size) if r not in running]
        finished = f" ({rank_list(done)} had returned)" if done else ""
        return RankTimeout(f"labkit.run timed out after {timeout_seconds:g} s: {rank_list(running)} "
                           f"still running{finished}.{restarted}", failures, ending.notes(), pool_stopped=pool_stopped)
    failed = sorted({f.rank for f in failures if f.kind != NoReply.STOPPED})
    return RankError(f"{rank_list(failed)} of {world_size} failed.{restarted}", failures, ending.notes(),
                     pool_stopped=pool_stopped)


def destroyed_group(replies: dict[int, Reply]) -> list[int]:
    """The ranks whose call ran dist.destroy_process_group(): such a pool cannot serve another call."""
    return [rank for rank, reply in replies.items() if reply.group_destroyed]


def start_failure(channels: Channels, r: RankHandle, stack: Stack | None, when: str) -> Failure | None:
    """Why rank `r` is not ready (`when` says at which moment it was given up), or None if it is."""
    if isinstance(r.started, StartFailed):
        return raised_failure(r.rank, Outcome.ERROR, r.started.error)
    if r.gone:
        return death(channels, r, "while starting")
    if r.started is None:
        summary, detail = still_running(stack)
        return Failure(r.rank, NoReply.STOPPED, f"not ready {when}: "
                       + summary.replace("was still running", "was still starting"), detail)
    return None


def death(channels: Channels, r: RankHandle, before: str = "before replying") -> Failure:
    """A dead rank, named with its signal or exit code (`before`: at which point it died) and its last lines of
    stderr; one that died because the fork server did, named so, with how the server ended; an attached rank
    (no fork server: torchrun started it) by the connection it lost and its node."""
    if channels.server is None:
        channels.pump(time.monotonic() + DEATH_DETAILS_SECONDS, lambda: all(r.output.closed.values()))
        return Failure(r.rank, NoReply.DIED, f"lost {before}: its connection to the notebook closed (the process "
                       f"{r.where} ended or was killed, or its node or network went down; torchrun says why there)",
                       time=r.gone_at, stderr_tail=list(r.output.stderr_tail))
    channels.server.wait_for_exit([r.pid], DEATH_DETAILS_SECONDS)
    channels.pump(time.monotonic() + DEATH_DETAILS_SECONDS, lambda: all(r.output.closed.values()))
    status = channels.server.exit_status.get(r.pid)
    tail = list(r.output.stderr_tail)
    if status is None and not channels.server.alive:
        server = channels.server
        lines = "\n".join(f"labkit's fork server: {line}" for line in server.stderr_tail())
        return Failure(r.rank, NoReply.DIED, f"process died {before} with labkit's fork server, which "
                       f"{server.exit_text()} (every rank dies with it)", lines, time=r.gone_at, stderr_tail=tail)
    how = describe_exit(status)
    if how.startswith("exited"):
        how += f" {before} (the function never returned: something in it ended the process, e.g. os._exit)"
    elif "SIGKILL" in how and (cause := oom_kill_cause(channels.oom_kills_before)):
        how = f"killed by SIGKILL from {cause}"
    elif "SIGKILL" in how:
        how += " (SIGKILL from outside often means the machine ran out of memory)"
    return Failure(r.rank, NoReply.DIED, f"process {how}", time=r.gone_at, stderr_tail=tail)


def _stopped(rank: int, stack: Stack | None, result_nbytes: int | None) -> Failure:
    """A rank stopped mid-call: errors.still_running, with the collective it is in where its recorder said, and the
    size of the result it had announced (protocol.Returning), if any."""
    collective = where_in_collectives(stack.collectives) if stack else ""
    return Failure(rank, NoReply.STOPPED, *still_running(stack, collective, result_nbytes),
                   in_own_code=result_nbytes is None and in_own_code(stack, collective))


def same_steps(steps: list[dict[str, int] | None]) -> bool:
    """True if every rank counted its operations, and those in one group issued the same number."""
    if any(s is None for s in steps):
        return False
    per_group: dict[str, set[int]] = {}
    for counts in steps:
        for group, count in counts.items():
            per_group.setdefault(group, set()).add(count)
    return all(len(counts) == 1 for counts in per_group.values())


def failure_from_reply(rank: int, reply: Reply) -> Failure:
    """A rank's failed reply as a Failure. One marked follow-on (errors.FOLLOW_ON_ATTRIBUTE) gets an
    unknown time (inf), so that whoever picks the earliest failure as the root cause picks another."""
    if reply.outcome == Outcome.UNPICKLABLE:
        return Failure(rank, Outcome.UNPICKLABLE, reply.body, time=reply.finished_at)
    if reply.outcome == Outcome.INTERRUPTED:
        return raised_failure(rank, Outcome.INTERRUPTED, reply.body, _STOPPED_BY_LABKIT, time=reply.finished_at)
    error = reply.body
    last = error.chain[-1] if error.chain else None
    own = (f"{exception_line(last)}, from the function's own code (raised there, not by the stop button)"
           if last is not None and (last.module, last.type_name) == ("builtins", "KeyboardInterrupt") else None)
    return raised_failure(rank, Outcome.ERROR, error, own, time=float("inf") if error.follow_on else reply.finished_at)
