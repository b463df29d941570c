"""One grading runner for every grader that runs the student's code on real ranks: `grade(spec, *solutions)`.

An exercise is a `Spec` (after torchtitan's ModelSpec, torchtitan/protocols/model_spec.py: a bundle that one
loop drives): the cases, drawn afresh on each grading (`cases`), the rank-side attempt, the ready-made helpers
it refuses, the ordered problem checks, and how a case, a hang, an error and a pass are told. The loop is here,
once, so every grader behaves the same:

- a solution that is not a function is told what to pass;
- each case runs `attempt(*solutions, case)` on `case.world_size` ranks under labkit.run, with the helpers in
  `ready_made` refusing to run (labkit._refusals), and the rank's last attempt (labkit.exercises._kit._store)
  returned beside its outcome;
- a call refused and caught is reported as if it had not been caught; a refused call that raised is reported
  before any other error;
- **the one rule after a RankError** (or a case whose ranks disagree): unless labkit stopped the pool itself,
  each rank's last attempt is read back; if the ranks did not make the same collectives (kinds and sizes, in
  order), or their messages do not pair up (each send with its recv), or that cannot be read, the pool of that
  world size is stopped (labkit.shutdown(world_size=...)), so the next case or the next grading starts on ranks
  with no collective or message left unmatched;
- graders grade on ranks of their own (labkit.launch.pools_apart(GRADERS)), never the student's, nor their
  `%%ranks` variables; each rank notes what the attempt left behind (labkit.exercises._kit._leftovers: a
  patched function, a thread, a mode, ...), and a pool whose ranks found anything is stopped, as is one out of
  step, so that no later grading meets it;
- then the spec's checks, in order: the first problem is the verdict, prefixed by how the case is described;
- once every case has passed, the spec's `final_checks` read each case's outcomes again, in the cases' order: a
  problem that only matters once the others are fixed (the AllReduce's order that would hang on NCCL, told
  once every case is right on gloo).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import labkit
from labkit._refusals import refusing
from labkit.exercises._kit import _leftovers, _store
from labkit.exercises._kit._group_call import Kind
from labkit.exercises._kit._messages import first_failure, forbidden_message, not_callable_message
from labkit.exercises._kit._pace import grading_seconds
from labkit.exercises.verdict import Verdict
from labkit.launch import pools_apart
from labkit.launch.errors import NoReply

__all__: list[str] = []

GRADERS = "labkit's graders"  # whose pools the graders run in (labkit.launch.pools_apart)


@dataclass(frozen=True)
class Case:
    """One case of an exercise: how many ranks, and what else this grading drew for it (sizes, dtype, lr, ...), by
    name, so that a solution that depends on the grader's constants fails."""

    world_size: int
    drawn: Mapping[str, object] = field(default_factory=dict)

    def __getitem__(self, name: str):
        return self.drawn[name]


Check = Callable[[list, Case], "str | None"]  # (each rank's outcome, the case) -> the problem, or None


@dataclass(frozen=True)
class Spec:
    """One exercise's grading (module docstring). `attempt(*solutions, case)` runs on each rank and returns its
    outcome; `checks` read the outcomes; `describe(case)` starts a verdict ("On 3 ranks (a batch of ...)");
    `why_forbidden(spelling, name)` says why a refused call is off here; `on_hang(hang, case, timeout_seconds)`
    and `on_error(error, attempts, case)` word a hang and a rank's own error (`attempts`: each rank's
    LastAttempt, or None when they could not be read); `passed(cases)` is the verdict of a pass; `example` shows
    how the grader is called, for a solution that is not a function; `final_checks` run once every case has
    passed `checks`, on each case's outcomes again (module docstring)."""

    attempt: Callable
    cases: Callable[[], Sequence[Case]]
    checks: Sequence[Check]
    describe: Callable[[Case], str]
    why_forbidden: Callable[[str, str], str]
    on_hang: Callable[[labkit.RankTimeout, Case, float], str]
    on_error: Callable[[labkit.RankError, list[_store.LastAttempt] | None, Case], str]
    passed: Callable[[Sequence[Case]], str]
    example: str
    ready_made: tuple[str, ...] = ()
    final_checks: Sequence[Check] = ()


def grade(spec: Spec, *solutions, timeout_seconds: float) -> Verdict:
    """Run `spec`'s cases on the student's `solutions` (module docstring): the first problem, or the pass."""
    timeout_seconds = grading_seconds("timeout_seconds", timeout_seconds)
    given = next((s for s in solutions if not callable(s)), None)
    if given is not None or not solutions:
        return Verdict(False, not_callable_message(spec.example, given))
    with pools_apart(GRADERS):
        cases, passed = list(spec.cases()), []
        for case in cases:
            problem, outcomes = _run_case(spec, solutions, case, timeout_seconds)
            if problem:
                return Verdict(False, f"{spec.describe(case)}, {problem}")
            passed.append((case, outcomes))
    late = next(((case, p) for case, outcomes in passed for check in spec.final_checks
                 if (p := check(outcomes, case))), None)
    if late is not None:
        return Verdict(False, f"{spec.describe(late[0])}, {late[1]}")
    return Verdict(True, spec.passed(cases))


def case_problem(spec: Spec, solutions: tuple, case: Case, timeout_seconds: float) -> str | None:
    """What is wrong with the solutions on one case, or None (module docstring)."""
    with pools_apart(GRADERS):
        return _run_case(spec, solutions, case, timeout_seconds)[0]


def _run_case(spec: Spec, solutions: tuple, case: Case, timeout_seconds: float) -> tuple[str | None, list | None]:
    """One case: (its problem or None, each rank's outcome, or None when a rank failed)."""
    try:
        results = labkit.run(_on_rank, spec.attempt, spec.ready_made, solutions, case, world_size=case.world_size,
                             timeout=timeout_seconds)
    except labkit.RankTimeout as hang:  # labkit stops a pool whose call timed out
        return spec.on_hang(hang, case, timeout_seconds), None
    except labkit.RankError as error:
        attempts = after_error(error, case.world_size)
        first, spelling = first_failure(error)
        if spelling is not None:
            return forbidden_message(first.rank, spelling, False, spec.why_forbidden), None
        return spec.on_error(error, attempts, case), None
    outcomes, attempts = [r[0] for r in results], [r[1] for r in results]
    stop_if_out_of_step(case.world_size, attempts)
    stop_if_left_behind(case.world_size, attempts)
    for rank, attempt in enumerate(attempts):
        if attempt.refused:
            return forbidden_message(rank, attempt.refused[0], True, spec.why_forbidden), outcomes
    return next((p for check in spec.checks if (p := check(outcomes, case))), None), outcomes


def after_error(error: labkit.RankError, world_size: int) -> list[_store.LastAttempt] | None:
    """The one rule after a RankError: read each rank's last attempt and stop the pool unless they agree (module
    docstring). None when labkit stopped the pool itself, a rank died, or the ranks could not answer."""
    if error.pool_stopped or any(f.kind == NoReply.DIED for f in error.failures):
        return None
    try:
        attempts = labkit.run(_read_back, world_size=world_size)
    except labkit.RankError:
        return None  # then labkit has stopped the pool itself
    stop_if_out_of_step(world_size, attempts)
    stop_if_left_behind(world_size, attempts)
    return attempts


def stop_if_out_of_step(world_size: int, attempts: list[_store.LastAttempt]) -> None:
    """Stop the pool of `world_size` ranks if they did not make the same collectives, or if their messages do not
    pair up (a send with no recv posted for it, or the reverse): a collective or a message may be left unmatched,
    for the next case's calls to meet."""
    if any(a.signatures != attempts[0].signatures for a in attempts) or not _messages_pair_up(attempts):
        labkit.shutdown(world_size=world_size)


def stop_if_left_behind(world_size: int, attempts: list[_store.LastAttempt]) -> None:
    """Stop the pool of `world_size` ranks if the attempt left anything behind in a rank (a patched function, a
    thread, ...: labkit.exercises._kit._leftovers), before any later call meets it."""
    if any(a.leftovers for a in attempts):
        labkit.shutdown(world_size=world_size)


def _messages_pair_up(attempts: list[_store.LastAttempt]) -> bool:
    """Whether every send from rank s to rank d has a recv at d from s, and every recv a send, counted per pair.
    A rank that raised after a dist.isend whose peer never posted the recv leaves that message waiting."""
    sent = Counter((rank, call.peer) for rank, a in enumerate(attempts) for call in a.calls if call.kind == Kind.SEND)
    received = Counter((call.peer, rank) for rank, a in enumerate(attempts) for call in a.calls
                       if call.kind == Kind.RECV)
    return sent == received


def _on_rank(attempt: Callable, ready_made: tuple[str, ...], solutions: tuple, case: Case):
    """On a rank: a fresh last attempt, the attempt with the ready-made helpers refusing; (outcome, last attempt,
    with what it left behind). Refusals of the helpers themselves (in any thread) join the store, even when the
    attempt raised."""
    _store.begin()
    _leftovers.take()
    made: list[str] = []
    try:
        with refusing(ready_made) as made:
            outcome = attempt(*solutions, case)
    finally:
        for spelling in made:
            _store.refused(spelling)
    return outcome, _read_back()


def _read_back() -> _store.LastAttempt:
    """On a rank: its last attempt, with what the attempt left behind (read now)."""
    attempt = _store.last_attempt()
    attempt.leftovers = _leftovers.found()
    return attempt
