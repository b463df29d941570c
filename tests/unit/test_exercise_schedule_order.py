"""The 1F1B order grader (notebook 06) against its catalogue: wrong orders, each rejected with a message that names
the mistake, and right orders written in different ways (and returned in each accepted spelling), all accepted.
No processes: the grader compares lists."""

import inspect
import sys
import threading
from collections import deque
from functools import cache

import pytest
from torch.distributed.pipelining import schedules

from labkit.exercises import Verdict, check_1f1b_order
from labkit.exercises.schedule_order import DRAWN, FIRST_CASE, GRID, draw_cases
from labkit.parallel.pipeline import Action, schedule, zero_bubble_h1

GRADINGS = 3  # a wrong row is graded this many times, each on a fresh draw: it must be refused on every one

# The course's answer, kept here and in notebook 06's solution cell, not in the package (issue 27: reference
# solutions are not shipped as importable text, which graded code could exec out of the grader's sight).
REFERENCE_SOLUTION = '''
def one_f_one_b(stage, stages, microbatches):
    """Stage `stage` of `stages`: warm-up forwards, then one forward and one backward in turn, then the
    remaining backwards (the cool-down)."""
    warmup = min(stages - stage - 1, microbatches)  # the later stages send the first gradients back sooner
    actions = [("F", i) for i in range(warmup)]
    for i in range(microbatches - warmup):  # steady state: one forward, one backward
        actions += [("F", warmup + i), ("B", i)]
    return actions + [("B", i) for i in range(microbatches - warmup, microbatches)]  # cool-down
'''


def order(warmup, m, backwards=None, cooldown=True):
    """Warm-up forwards, then forward/backward pairs, then (if cooldown) the rest of the backwards."""
    backwards = list(range(m)) if backwards is None else backwards
    actions = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [("F", warmup + i), ("B", backwards[i])]
    return actions + ([("B", i) for i in backwards[m - warmup:]] if cooldown else [])


# ---- right solutions, three ways -------------------------------------------------------------------------

def phases(stage, stages, microbatches):
    """Warm-up, steady state, cool-down, as three loops; strings "F3"."""
    warmup = min(stages - stage - 1, microbatches)
    actions = [f"F{i}" for i in range(warmup)]
    for i in range(microbatches - warmup):
        actions += [f"F{warmup + i}", f"B{i}"]
    return actions + [f"B{i}" for i in range(microbatches - warmup, microbatches)]


def two_queues(stage, stages, microbatches):
    """A simulation: run a forward while fewer than p - r wait, else the oldest waiting backward; Actions."""
    forwards, waiting, actions = deque(range(microbatches)), deque(), []
    while forwards or waiting:
        if forwards and len(waiting) < stages - stage:
            waiting.append(forwards.popleft())
            actions.append(Action("F", waiting[-1]))
        else:
            actions.append(Action("B", waiting.popleft()))
    return actions


def per_index(stage, stages, microbatches):
    """A formula for the action at each position k, as a generator of tuples."""
    w = min(stages - stage - 1, microbatches)
    for k in range(2 * microbatches):
        if k < w:
            yield "F", k
        elif k < 2 * microbatches - w:
            yield ("F", w + (k - w) // 2) if (k - w) % 2 == 0 else ("B", (k - w) // 2)
        else:
            yield "B", k - microbatches


@cache
def cached_on_every_argument(stage, stages, microbatches):
    """Right, memoized on all three arguments (a tuple, so that a caller cannot change the cached answer): state
    across calls that is keyed on everything the answer depends on is fine (issue 27)."""
    return tuple(phases(stage, stages, microbatches))


@pytest.mark.parametrize("fn", [phases, two_queues, per_index, cached_on_every_argument])
def test_right_orders_written_differently_pass(fn):
    verdict = check_1f1b_order(fn)
    assert verdict and isinstance(verdict, Verdict), verdict
    assert "min(p - r, m)" in verdict.message and repr(verdict).startswith("Correct! ")


def test_the_folded_reference_solution_passes():
    namespace = {}
    exec(REFERENCE_SOLUTION, namespace)
    assert check_1f1b_order(namespace["one_f_one_b"]), check_1f1b_order(namespace["one_f_one_b"])


def test_each_grading_covers_the_grid_and_larger_pipelines_drawn_afresh_in_a_shuffled_order():
    draws = [draw_cases() for _ in range(20)]
    for calls in draws:
        assert calls[:4] == [(r, *FIRST_CASE) for r in range(4)], "the first case reads best: graded first"
        cases = {(p, m) for _, p, m in calls}
        assert set(GRID) <= cases and all(sorted(r for r, q, k in calls if (q, k) == case) == list(range(case[0]))
                                          for case in cases), "every stage of every case, once"
        larger = [(p, m) for p, m in cases if m > 9]
        assert larger and all(m in DRAWN["microbatches"] and m >= 11 for _, m in larger), "text order shows at 11"
        assert any(p > 6 for p, _ in larger), "a pipeline deeper than the grid"
        first_short = next(k for k, (_, p, m) in enumerate(calls) if m < p)
        assert all(m < p for _, p, m in calls[first_short:]), "m < p comes last: its messages are the hardest"
    assert len({tuple(calls) for calls in draws}) == len(draws), "the order and the larger cases are drawn afresh"


# ---- wrong solutions, each with the words its message must have ------------------------------------------

WRONG = {
    "gpipe": (lambda r, p, m: [("F", i) for i in range(m)] + [("B", i) for i in range(m)],
              ["Stage 0 of 4 with 8 micro-batches", "all 8 forwards before any backward", "GPipe",
               "Up to 8 micro-batches", "1F1B holds at most 4 here"]),
    "warm-up p - r": (lambda r, p, m: order(min(p - r, m), m),
                      ["runs 5 forwards before its first backward, where 1F1B runs 4: a warm-up of 3 forwards, "
                       "then the steady state's first forward", "one forward too many", "Up to 5"]),
    "warm-up p - r - 2": (lambda r, p, m: order(max(p - r - 2, 0), m),
                          ["runs 3 forwards before its first backward, where 1F1B runs 4: a warm-up of 3",
                           "one forward too few"]),
    "warm-up r": (lambda r, p, m: order(min(r, m), m),
                  ["Stage 0 of 4", "runs 1 forward before its first backward, where 1F1B runs 4",
                   "counted from the last"]),
    "reversed backwards": (lambda r, p, m: order(min(p - r - 1, m), m, backwards=list(range(m))[::-1]),
                           ["backwards in reverse micro-batch order"]),
    "no cool-down": (lambda r, p, m: order(min(p - r - 1, m), m, cooldown=False),
                     ["runs 5 backwards, not m = 8", "B5 B6 B7 never run", "cool-down is missing"]),
    "duplicate": (lambda r, p, m: order(min(p - r - 1, m), m) + [("F", 0)],
                  ["runs F0 2 times", "each micro-batch runs once"]),
    "missing micro-batch": (lambda r, p, m: [a for a in order(min(p - r - 1, m), m) if a[1] != m - 1],
                            ["F7 never runs"]),
    "m < p": (lambda r, p, m: order(p - r - 1, m),
              ["but micro-batches run from 0 to m - 1", "the warm-up runs out of micro-batches, of which there are"]),
    "backward first": (lambda r, p, m: [a for i in range(m) for a in (("B", i), ("F", i))] if r == p - 1
                       else order(min(p - r - 1, m), m),
                       ["Stage 3 of 4", "runs B0 before F0", "activations its forward saved"]),
    "raises": (lambda r, p, m: order(list(range(m + 1))[p - r - 1], m),
               ["(stage=", "raised IndexError: list index out of range"]),
    "bad format": (lambda r, p, m: [f"forward {i}" for i in range(m)],
                   ["action 0 is 'forward 0' (str)", '("F", i)']),
    "the course's schedule": (lambda r, p, m: schedule("1f1b", p, m)[r],
                              ["fn(0, 4, 8) calls labkit.parallel.pipeline's schedule(), a ready-made"]),
    "torch's schedule": (lambda r, p, m: schedules._format_pipeline_order({}) or order(min(p - r - 1, m), m),
                         ["calls torch.distributed.pipelining.schedules._format_pipeline_order(), a ready-made"]),
}


# ---- issue 27: honest mistakes that the old fixed grid (p <= 6, m <= 9, always in one order) let pass ----------

def sorted_as_text(stage, stages, microbatches):
    """Right phases, each sorted as the strings "F3": "F10" sorts before "F2", wrong from m = 11."""
    warmup = min(stages - stage - 1, microbatches)
    forwards = sorted(f"F{i}" for i in range(microbatches))
    backwards = sorted(f"B{i}" for i in range(microbatches))
    actions = forwards[:warmup]
    for i in range(microbatches - warmup):
        actions += [forwards[warmup + i], backwards[i]]
    return actions + backwards[microbatches - warmup:]


TABLE = {(r, p, m): phases(r, p, m) for p in range(1, 7) for m in range(1, 10) for r in range(p)}  # the old range


def cached_per_stage():
    """A cache keyed on the stage alone: right for the first pipeline asked, stale for every other."""
    remembered = {}

    def fn(stage, stages, microbatches):
        if stage not in remembered:
            remembered[stage] = phases(stage, stages, microbatches)
        return remembered[stage]
    return fn


def replayed_in_an_earlier_order():
    """Right answers recorded during one grading, handed back one per call in the order they were asked."""
    asked = []
    check_1f1b_order(lambda r, p, m: asked.append((r, p, m)) or phases(r, p, m), record=False)
    answers = deque(phases(*call) for call in asked)
    return lambda r, p, m: answers.popleft()


def in_a_thread(stage, stages, microbatches):
    """The course's schedule, computed in a thread of its own, out of a tracer's sight."""
    box = []

    def compute():
        try:
            box.append(schedule("1f1b", stages, microbatches)[stage])
        except Exception:  # noqa: BLE001 - a thread's error is lost to its caller, as it would be in the notebook
            pass
    thread = threading.Thread(target=compute)
    thread.start()
    thread.join()
    return box[0] if box else phases(stage, stages, microbatches)


def tracer_off(stage, stages, microbatches):
    """The course's schedule after switching off whatever tracer watches."""
    sys.settrace(None)
    return schedule("1f1b", stages, microbatches)[stage]


def from_its_text(stage, stages, microbatches):
    """A copy of the course's schedule made from its source text, exec'd in its own module's namespace."""
    module = sys.modules[schedule.__module__]
    namespace = dict(vars(module))
    exec(inspect.getsource(module), namespace)  # every function anew, the course's file out of sight
    return namespace["schedule"]("1f1b", stages, microbatches)[stage]


def caught(stage, stages, microbatches):
    """The course's schedule, its refusal caught and the student's own (right) order returned instead."""
    try:
        return schedule("1f1b", stages, microbatches)[stage]
    except Exception:  # noqa: BLE001 - the honest 'fallback' that hides the refusal
        return phases(stage, stages, microbatches)


WRONG.update({
    "sorted as text": (sorted_as_text, ["runs its forwards out of micro-batch order"]),
    "a table for the old range": (lambda r, p, m: TABLE[r, p, m], ["raised KeyError"]),
    "a cache keyed on the stage": (cached_per_stage, ["Yours:"]),
    "answers replayed in an earlier order": (replayed_in_an_earlier_order, ["Yours:"]),
    "the course's schedule in a thread": (in_a_thread, ["calls labkit.parallel.pipeline's schedule(), a ready-made"]),
    "the course's schedule, tracer off": (tracer_off, ["calls labkit.parallel.pipeline's schedule(), a ready-made"]),
    "the course's schedule from its text": (from_its_text,
                                            ["calls labkit.parallel.pipeline's schedule(), a ready-made"]),
    "the course's schedule, refusal caught": (caught, ["calls labkit.parallel.pipeline's schedule(), a ready-made"]),
    "zero bubble without its W's": (lambda r, p, m: [(a.kind, a.microbatch) for a in zero_bubble_h1(r, p, m)
                                                     if a.kind != "W"],   # ZB-H1's order less W is 1F1B's
                                    ["calls labkit.parallel.pipeline's schedule(), a ready-made"]),
})
MADE_PER_GRADING = {"a cache keyed on the stage", "answers replayed in an earlier order"}  # fresh state each time


@pytest.mark.parametrize("name", WRONG)
def test_wrong_orders_are_rejected_with_their_mistake_named(name):
    for _ in range(GRADINGS):
        fn, words = WRONG[name]
        fn = fn() if name in MADE_PER_GRADING else fn
        verdict = check_1f1b_order(fn)
        assert not verdict and repr(verdict).startswith("Not yet. "), verdict
        for word in words:
            assert word in verdict.message, (name, word, verdict.message)


def test_the_text_sorted_order_is_refused_where_m_reaches_11_and_right_below():
    assert sorted_as_text(0, 4, 10) == phases(0, 4, 10) and sorted_as_text(0, 4, 11) != phases(0, 4, 11)
    verdict = check_1f1b_order(sorted_as_text)
    assert "micro-batches: it runs its forwards out of micro-batch order" in verdict.message
    assert int(verdict.message.split(" with ")[1].split()[0]) >= 11, verdict


@pytest.mark.parametrize("fn", [tracer_off, caught, WRONG["raises"][0]])
def test_the_course_s_schedule_runs_again_once_grading_ends(fn):
    check_1f1b_order(fn, record=False)
    assert [str(a) for a in schedule("1f1b", 2, 2)[0]] == ["F0", "F1", "B0", "B1"]


def test_other_returns_are_refused_showing_what_came_back():
    assert "return a list of actions, not NoneType" in check_1f1b_order(lambda r, p, m: None).message
    assert "action 0 is Action(kind='F', microbatch=0, chunk=1)" in check_1f1b_order(
        lambda r, p, m: [Action("F", i, 1) for i in range(m)]).message
    assert "pass your function itself, e.g. check_1f1b_order(one_f_one_b)" in check_1f1b_order("fn").message


def test_forwards_alone_are_not_called_a_missing_cool_down():
    verdict = check_1f1b_order(lambda r, p, m: [("F", i) for i in range(m)])
    assert "B0 B1 B2 B3 B4 B5 B6 B7 never run; every micro-batch's forward and backward" in verdict.message, verdict
    assert "cool-down" not in verdict.message


def test_forwards_out_of_order_are_named():
    swapped = {"F0": "F1", "F1": "F0"}
    verdict = check_1f1b_order(lambda r, p, m: [swapped.get(action, action) for action in phases(r, p, m)])
    assert "it runs its forwards out of micro-batch order" in verdict.message, verdict


def test_a_steady_state_that_does_not_alternate_is_shown_where_it_departs():
    pairs = "F0 F1 F2 F3 B0 B1 F4 F5 B2 B3 F6 F7 B4 B5 B6 B7".split()
    verdict = check_1f1b_order(lambda r, p, m: pairs if (r, p, m) == (0, 4, 8) else phases(r, p, m))
    assert "Stage 0 of 4 with 8 micro-batches: action 5 is B1, 1F1B runs F4 there" in verdict.message, verdict
