"""On a rank: what the grader's last attempt made, kept as it happens (the one last-attempt store).

A run that raises returns nothing, yet the grader needs to know what each rank had made: calls that the ranks
made in different orders leave collectives unmatched, and the pool must then be stopped (the runner's one rule,
labkit.exercises._kit._runner). The recorder adds each call here as it is made and guards add each refusal; the
runner's rank-side wrapper starts a fresh attempt and reads it back (`last_attempt`, also run on its own after a
RankError). One module-level store per rank process: a rank runs one graded attempt at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__: list[str] = []


@dataclass
class LastAttempt:
    """One rank's last attempt: every call recorded (labkit.exercises._kit._record.Call), and every call refused
    (its spelling), in order, including those that graded code caught; and what it left behind in the rank, read
    by the runner (labkit.exercises._kit._leftovers)."""

    calls: list = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)  # what the attempt left changed (_leftovers.found)

    @property
    def signatures(self) -> list[tuple[str, int]]:
        """Each collective's kind and size, in order: equal on every rank when the ranks' collectives matched.
        Point-to-point calls are left out: a send and its recv differ by construction (a message left unmatched
        hangs, and labkit stops a pool whose call timed out)."""
        return [call.signature for call in self.calls if call.signature is not None]


_attempt = LastAttempt()


def begin() -> None:
    """Start a fresh attempt (the runner, on each rank, before the student's code runs)."""
    global _attempt
    _attempt = LastAttempt()


def add(call) -> None:
    """Note a call as it is made."""
    _attempt.calls.append(call)


def refused(spelling: str) -> None:
    """Note a refused call (reported even if graded code catches the ForbiddenCall)."""
    _attempt.refused.append(spelling)


def last_attempt() -> LastAttempt:
    """This rank's last attempt (run on the ranks by the runner)."""
    return _attempt
