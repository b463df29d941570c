"""The 1F1B grader of notebook 06: the student's action order for one pipeline stage, checked with no processes.

The student writes `fn(stage, stages, microbatches)`: the actions stage r of p runs, in order, for m micro-batches.
The format is a list of pairs, ("F", i) for micro-batch i's forward and ("B", i) for its backward, i from 0 to
m - 1. Two other spellings are accepted, since the notebook shows both: labkit.parallel.pipeline's `Action("F", i)`
(chunk 0) and the string "F3" (what str(Action) prints). Anything else is refused with a message that shows what
came back.

`check_1f1b_order(fn)` compares the order with `schedule("1f1b", p, m)[r]` for every stage of p = 1 to 6 stages and
m = 1 to 9 micro-batches (m < p included) and of a few larger pipelines drawn afresh at each grading (`draw_cases`:
m from 11 up, where actions sorted as text, "F10" before "F2", go wrong; one of them with more than 6 stages), and
checks that a stage never holds more than min(p - r, m) micro-batches' activations (`peak_in_flight`). After the
first case (stage 0 to 3 of 4 with 8, whose messages read best) the calls come in a shuffled order, so an order
that depends on the calls before it (a table filled for the old fixed range, a cache keyed on the first call, answers
replayed in a remembered order) shows. 1F1B (PipeDream-Flush; Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", section 2.2): stage r runs
min(p - r - 1, m) warm-up forwards, then one forward and one backward in turn, then the remaining backwards
(the cool-down), every kind in micro-batch order. The first case that goes wrong is reported, with the
mistake named where the grader recognises it: GPipe's order, a warm-up one too long or short, a warm-up counted
from the last stage, backwards in reverse order, a missing cool-down, duplicated or missing micro-batches,
m < p, a backward before its forward, and exceptions. Calling a ready-made schedule is refused: labkit's
`schedule` (which the grader compares with) refuses to run while the student's function runs, in any thread and
from a copy of its text (labkit._refusals), and a tracer sees calls into torch.distributed.pipelining's.
"""

from __future__ import annotations

import operator
import random
import re
import sys
from pathlib import Path

from labkit._refusals import refusing
from labkit.exercises.progress import graded
from labkit.exercises.verdict import Verdict
from labkit.parallel.pipeline import Action, peak_in_flight, schedule

__all__ = ["DRAWN", "FIRST_CASE", "GRID", "check_1f1b_order", "draw_cases"]

FIRST_CASE = (4, 8)  # (p, m) graded first, stage by stage: a typical pipeline, whose messages read best
GRID = [(p, m) for p in range(1, 7) for m in range(1, 10)]  # every small pipeline, m < p included
# The larger pipelines drawn at each grading: m from 11 (where "F10" sorts before "F2" as text) up to a bound that
# keeps a grading well under a second, and one of them deeper than the grid.
DRAWN = {"cases": 4, "microbatches": range(11, 33), "stages": range(2, 7), "deep_stages": range(7, 10)}

_READY_MADE_SCHEDULE = "labkit.parallel.pipeline's schedule"  # as schedule() refuses itself (refuse_while_graded)
_TORCH_SCHEDULES = str(Path("torch", "distributed", "pipelining"))  # torch's ready-made schedules, seen by a tracer
_ACTION_TEXT = re.compile(r"([FB])(\d+)")
_FORMAT = 'write each action as ("F", i) or ("B", i) (an Action("F", i) or the string "F3" also work)'


def draw_cases() -> list[tuple[int, int, int]]:
    """The (stage, stages, microbatches) calls of one grading: FIRST_CASE's stages in order, then the grid's and
    DRAWN's larger pipelines' stages shuffled together (m < p last: their messages are the hardest), drawn afresh
    each time so that an order cannot lean on the calls before it."""
    deep = (random.choice(DRAWN["deep_stages"]), random.choice(DRAWN["microbatches"]))
    shallow = [(p, m) for p in DRAWN["stages"] for m in DRAWN["microbatches"]]
    drawn = [deep] + random.sample(shallow, DRAWN["cases"] - 1)  # distinct: each stage is asked once
    calls = [(r, p, m) for p, m in GRID + drawn if (p, m) != FIRST_CASE for r in range(p)]
    random.shuffle(calls)
    calls.sort(key=lambda call: call[2] < call[1])  # stable: shuffled within m >= p and within m < p
    return [(r, *FIRST_CASE) for r in range(FIRST_CASE[0])] + calls


@graded("one_f_one_b")
def check_1f1b_order(fn) -> Verdict:
    """Grade `fn(stage, stages, microbatches)`: stage r's 1F1B actions, for every r of p = 1-6 and m = 1-9 and of
    larger pipelines drawn for this grading (draw_cases), called in a shuffled order.

    >>> check_1f1b_order(lambda stage, stages, microbatches: [("F", i) for i in range(microbatches)]
    ...                  + [("B", i) for i in range(microbatches)])
    Not yet. Stage 0 of 4 with 8 micro-batches: it runs all 8 forwards before any backward: GPipe's order...
    """
    if not callable(fn):
        return Verdict(False, f"pass your function itself, e.g. check_1f1b_order(one_f_one_b), "
                              f"not {type(fn).__name__}.")
    calls = draw_cases()
    for r, p, m in calls:
        problem = _case_problem(fn, r, p, m)
        if problem:
            return Verdict(False, f"Stage {r} of {p} with {m} micro-batch{'es' if m > 1 else ''}: {problem}")
    larger = sorted({(p, m) for _, p, m in calls if m > 9})
    return Verdict(True, "your order is 1F1B's on every stage of 1 to 6 stages with 1 to 9 micro-batches (fewer "
                         f"micro-batches than stages too) and of {', '.join(f'{p} x {m}' for p, m in larger)} "
                         "(stages x micro-batches, drawn for this grading), called in a shuffled order: "
                         "min(p - r - 1, m) warm-up forwards, one forward and one backward in turn, then the "
                         "cool-down, and no stage holds more than min(p - r, m) micro-batches' activations.")


def _case_problem(fn, r: int, p: int, m: int) -> str | None:
    """What is wrong with fn's order for stage r of p with m micro-batches, or None."""
    returned, ready_made = _without_ready_made(fn, r, p, m)
    if ready_made:
        return (f"fn({r}, {p}, {m}) calls {ready_made}, a ready-made schedule: build the order yourself from the "
                "warm-up, the steady state and the cool-down.")
    if isinstance(returned, Exception):
        return (f"fn({r}, {p}, {m}) (stage={r}, stages={p}, microbatches={m}) raised {type(returned).__name__}: "
                f"{returned}")
    got, problem = _actions(returned)
    if problem:
        return f"fn({r}, {p}, {m}) returned {_shown(returned)}: {problem}"
    want = [(action.kind, action.microbatch) for action in schedule("1f1b", p, m)[r]]  # outside the refusal
    for find in (_count_problem, _order_problem, _dependency_problem, _warmup_problem, _in_flight_problem):
        problem = find(got, r, p, m)
        if problem:
            return f"{problem} Yours: {_spelled(got)}."
    if got != want:
        k = next(k for k, (mine, theirs) in enumerate(zip(got, want, strict=True)) if mine != theirs)
        return (f"action {k} is {_spelled([got[k]])}, 1F1B runs {_spelled([want[k]])} there (after the warm-up, "
                f"one forward then one backward, in turn). Yours: {_spelled(got)}.")
    return None


class _ReadyMade(BaseException):
    """The student's function called torch's ready-made schedules. A BaseException: their `except Exception`
    cannot swallow it."""


def _without_ready_made(fn, r: int, p: int, m: int) -> tuple[object, str | None]:
    """What fn(r, p, m) returned (a generator run to its end) or raised, and the ready-made schedule it called, if
    any: labkit's refuses to run meanwhile (wherever it runs; reported even if fn caught the ForbiddenCall), and a
    tracer (sys.settrace) stops a call into torch's schedules."""
    def trace(frame, event, arg):
        filename = frame.f_code.co_filename
        if event == "call" and _TORCH_SCHEDULES in filename:
            raise _ReadyMade(f"{frame.f_globals.get('__name__', Path(filename).stem)}.{frame.f_code.co_name}()")
    previous = sys.gettrace()
    with refusing((_READY_MADE_SCHEDULE,)) as made:
        sys.settrace(trace)
        try:
            returned = fn(r, p, m)
            returned = list(returned) if hasattr(returned, "__next__") else returned
        except _ReadyMade as refused:
            return None, str(refused)
        except Exception as error:  # noqa: BLE001 - the student's error, reported with the call that raised it
            returned = error
        finally:
            sys.settrace(previous)
    return returned, f"{_READY_MADE_SCHEDULE}()" if made else None


def _actions(returned) -> tuple[list[tuple[str, int]], str | None]:
    """fn's answer as (kind, micro-batch) pairs, or why it cannot be read as a list of actions."""
    if isinstance(returned, (str, bytes, dict, set)) or not hasattr(returned, "__iter__"):
        return [], f"return a list of actions, not {type(returned).__name__}; {_FORMAT}."
    actions = []
    for k, item in enumerate(returned):
        action = _action(item)
        if action is None:
            return [], f"action {k} is {item!r} ({type(item).__name__}); {_FORMAT}."
        actions.append(action)
    return actions, None


def _action(item) -> tuple[str, int] | None:
    """One action as ("F" or "B", micro-batch), or None when it is not one of the accepted spellings."""
    if isinstance(item, Action):
        return (item.kind, item.microbatch) if item.chunk == 0 and item.kind in ("F", "B") else None
    if isinstance(item, str):
        match = _ACTION_TEXT.fullmatch(item.strip())
        return (match[1], int(match[2])) if match else None
    if isinstance(item, (tuple, list)) and len(item) == 2 and item[0] in ("F", "B") and type(item[1]) is not bool:
        try:
            return item[0], operator.index(item[1])
        except TypeError:
            return None
    return None


def _count_problem(got, r: int, p: int, m: int) -> str | None:
    """Micro-batches that do not exist, run twice, or never run."""
    for kind in "FB":
        ids = [i for k, i in got if k == kind]
        outside = sorted({i for i in ids if not 0 <= i < m})
        if outside:
            return (f"it runs {_spelled([(kind, outside[0])])}, but micro-batches run from 0 to m - 1 = {m - 1}."
                    + (f" With fewer micro-batches than stages (m = {m} < p = {p}) the warm-up runs out of "
                       f"micro-batches, of which there are m = {m}." if m < p else ""))
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            return f"it runs {_spelled([(kind, twice[0])])} {ids.count(twice[0])} times; each micro-batch runs once."
        missing = [i for i in range(m) if i not in ids]
        if missing:
            return _missing(kind, missing, m)
    return None


def _missing(kind: str, missing: list[int], m: int) -> str:
    """The message for micro-batches whose forward or backward never runs."""
    never = f"{_spelled([(kind, i) for i in missing])} never run{'s' if len(missing) == 1 else ''}"
    if kind == "B" and len(missing) < m and missing == list(range(m - len(missing), m)):
        return (f"it runs {m - len(missing)} backwards, not m = {m}: {never}. The cool-down is missing: after the "
                f"last forward, the backwards still owed run one after another.")
    return f"{never}; every micro-batch's forward and backward run once."


def _dependency_problem(got, r: int, p: int, m: int) -> str | None:
    """A backward that runs before its own forward."""
    done = set()
    for kind, i in got:
        if kind == "B" and i not in done:
            return f"it runs B{i} before F{i}: a backward needs the activations its forward saved."
        if kind == "F":
            done.add(i)
    return None


def _order_problem(got, r: int, p: int, m: int) -> str | None:
    """Forwards or backwards out of micro-batch order (reverse order named as such)."""
    for kind, name in (("F", "forwards"), ("B", "backwards")):
        ids = [i for k, i in got if k == kind]
        if ids == list(range(m)):
            continue
        how = "in reverse micro-batch order" if ids == list(range(m))[::-1] else "out of micro-batch order"
        return (f"it runs its {name} {how}. 1F1B, like GPipe, runs them in order 0, 1, ..., m - 1: the first "
                f"micro-batch in is the first whose gradient comes back from the next stage.")
    return None


def _warmup_problem(got, r: int, p: int, m: int) -> str | None:
    """A warm-up (forwards before the first backward) of the wrong length, with the likely reason."""
    before = _forwards_before_backward(got)
    if before == min(p - r, m):  # the warm-up's forwards and the steady state's first
        return None
    warmup, want = before - 1, min(p - r - 1, m)
    held = f"Up to {peak_in_flight(_as_actions(got))} micro-batches' activations wait on this stage; 1F1B holds " \
           f"at most {min(p - r, m)} here."
    runs = (f"it runs {_forwards(before)} before its first backward, where 1F1B runs {min(p - r, m)}: a warm-up of "
            f"{_forwards(want)}, then the steady state's first forward")
    if before == m:
        return f"it runs all {m} forwards before any backward: GPipe's order, not 1F1B's. {held}"
    if warmup == p - r:
        return f"{runs}. Yours warms up with one forward too many. {held}"
    if warmup == r:
        return (f"{runs}. Yours warms up as if stages were counted from the last: the first stage warms up longest, "
                f"the last stage, p - 1, not at all.")
    if warmup == p - r - 2:
        return f"{runs}. Yours warms up with one forward too few (the stage counted from 1?)."
    return f"{runs}."


def _forwards(count: int) -> str:
    return f"{count} forward{'s' * (count != 1)}"


def _in_flight_problem(got, r: int, p: int, m: int) -> str | None:
    """More micro-batches waiting between forward and backward than 1F1B ever holds."""
    peak = peak_in_flight(_as_actions(got))
    if peak <= min(p - r, m):
        return None
    return (f"up to {peak} micro-batches' activations wait on this stage; 1F1B holds at most {min(p - r, m)} here: "
            "after the warm-up, every forward is followed by a backward.")


def _forwards_before_backward(got) -> int:
    """How many forwards run before the first backward: 1F1B's warm-up and one more, or all m."""
    return next((k for k, (kind, _) in enumerate(got) if kind == "B"), len(got))


def _as_actions(got) -> list[Action]:
    """(kind, micro-batch) pairs as labkit's Actions."""
    return [Action(kind, i) for kind, i in got]


def _spelled(got) -> str:
    """Actions the way the notebook prints them: "F0 F1 B0"."""
    return " ".join(f"{kind}{i}" for kind, i in got) or "(nothing)"


def _shown(value) -> str:
    """A short repr of what fn returned."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
