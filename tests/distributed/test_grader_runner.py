"""The graders' runner (labkit/exercises/_kit/_runner.py) on a toy exercise, "sum a tensor over the ranks with
dist.all_reduce", written the way every grader is: a `Spec` (cases drawn afresh, a rank-side attempt under a guard
that records with the kit's `Recorder`, ordered checks, a final check told once every case passed) driven by `grade`.
This file is also the exemplar a grader follows. Checked on real ranks (gloo): a right solution passes on every draw;
a wrong value, a refused call (raised or caught), a ready-made helper run from another thread, a hang and a rank's
own error each get their verdict; the final check only once every case passed the others; and the one rule after a
RankError: the pool is kept when the ranks made the same calls and stopped when they did not."""

from __future__ import annotations

import os
import random
import threading

import pytest
import torch
import torch.distributed as dist

import labkit
from labkit._refusals import refuse_while_graded
from labkit.exercises._kit._group_call import GroupCall, Kind, wrap_group_method
from labkit.exercises._kit._guard import Guard
from labkit.exercises._kit._messages import hang_message, unwaited_message
from labkit.exercises._kit._record import Call, Recorder
from labkit.exercises._kit._runner import GRADERS, Case, Spec, case_problem, grade, stop_if_out_of_step
from labkit.exercises._kit._store import LastAttempt
from labkit.launch import pools_apart
from labkit.launch.owner import OWNER

READY_MADE = "the toy's ready_made_sum"
TIMEOUT_SECONDS = 10.0


def ready_made_sum(t: torch.Tensor) -> None:
    """A ready-made helper the toy exercise refuses, where it runs."""
    refuse_while_graded(READY_MADE)
    dist.all_reduce(t)


class SumGuard(Guard):
    """all_reduce recorded (values kept), everything else that communicates refused."""

    def __init__(self):
        super().__init__()
        self.recorder = Recorder()

    def install(self) -> None:
        self.switch_off_torch_distributed(allowed=("all_reduce", "allreduce"), point_to_point=False)

        def recorded(made: GroupCall):
            call = self.recorder.record(made, keep_values=True)
            return self.recorder.launched(made.proceed(), call)

        wrap_group_method(self, Kind.ALLREDUCE, recorded)
        self.recorder.watch_waits(self)


def attempt(fn, case: Case) -> dict:
    """On a rank: fn(t) under the guard, t drawn for this case; what it left, for the checks."""
    t = (labkit.rank() + 1) * torch.arange(1.0, case["numel"] + 1, dtype=case["dtype"])
    guard = SumGuard()
    with guard:
        fn(t)
    return {"result": t.tolist(), "calls": guard.recorder.calls, "unwaited": guard.recorder.unwaited()}


def draw_cases() -> list[Case]:
    """Sizes and dtypes drawn afresh on each grading: a solution must not depend on them."""
    return [Case(n, {"numel": random.randint(1, 9), "dtype": random.choice((torch.float32, torch.float64))})
            for n in (3, 2)]


def values_problem(outcomes, case) -> str | None:
    want = [sum(r + 1 for r in range(case.world_size)) * i for i in range(1, case["numel"] + 1)]
    wrong = next((r for r, o in enumerate(outcomes) if o["result"] != want), None)
    return None if wrong is None else f"rank {wrong} holds {outcomes[wrong]['result']}, not the sum {want}."


def calls_problem(outcomes, case) -> str | None:
    for rank, outcome in enumerate(outcomes):
        if outcome["unwaited"]:
            return unwaited_message(rank, outcome["unwaited"], "all_reduce", "the sum was read before it was made")
        if not outcome["calls"]:
            return f"rank {rank} made no all_reduce."
    return None


def one_call_problem(outcomes, case) -> str | None:
    """The spec's final check: told only once every case is right (the values, the waits), as the AllReduce
    grader tells an order that would hang on NCCL once every case is right on gloo."""
    extra = next((r for r, o in enumerate(outcomes) if len(o["calls"]) > 1), None)
    return None if extra is None else f"rank {extra} made {len(outcomes[extra]['calls'])} all_reduces; one is enough."


SPEC = Spec(
    attempt=attempt, cases=draw_cases, checks=(calls_problem, values_problem),
    describe=lambda case: f"On {case.world_size} ranks ({case['numel']} {case['dtype']} elements)",
    why_forbidden=lambda spelling, name: "Only dist.all_reduce is allowed here.",
    on_hang=lambda hang, case, seconds: hang_message(hang, seconds, "a rank waited in an all_reduce alone."),
    on_error=lambda error, attempts, case: f"rank {error.failures[0].rank} raised {error.failures[0].summary}",
    passed=lambda cases: "every rank holds the sum.", example="grade(SPEC, my_sum)", ready_made=(READY_MADE,),
    final_checks=(one_call_problem,))


def right(t):
    dist.all_reduce(t)


def right_async(t):
    dist.all_reduce(t, async_op=True).wait()


def sums_twice(t):
    dist.all_reduce(t)
    dist.all_reduce(t)


def never_waits(t):
    dist.all_reduce(t, async_op=True)


def adds_an_idle_call(t):
    """Right values in every case, but a second all_reduce (of zeros): only the final check sees it."""
    dist.all_reduce(t)
    dist.all_reduce(torch.zeros(1, dtype=t.dtype))


def adds_an_idle_call_and_is_wrong_on_two_ranks(t):
    adds_an_idle_call(t)
    if dist.get_world_size() == 2:
        t += 1


def broadcasts(t):
    dist.broadcast(t, src=0)


def catches_the_refusal(t):
    try:
        dist.broadcast(t, src=0)
    except Exception:  # noqa: BLE001 - a student who swallows every error
        dist.all_reduce(t)


def ready_made_in_a_thread(t):
    thread = threading.Thread(target=lambda: _swallow(ready_made_sum, t))
    thread.start()
    thread.join()
    dist.all_reduce(t)


def _swallow(f, *args):
    try:
        f(*args)
    except Exception:  # noqa: BLE001 - the thread swallows the refusal
        pass


def rank_one_alone(t):
    if dist.get_rank() == 1:
        dist.all_reduce(t)


def raises_after_one_call(t):
    dist.all_reduce(t)
    raise ValueError("a mistake of its own")


def raises_out_of_step(t):
    if dist.get_rank() == 0:
        dist.all_reduce(t.clone(), async_op=True)  # its partner never comes: out of step
    raise ValueError("a mistake of its own")


@pytest.mark.parametrize("fn", [right, right_async])
def test_right_solutions_pass_on_every_draw(fn):
    for _ in range(3):
        verdict = grade(SPEC, fn, timeout_seconds=TIMEOUT_SECONDS)
        assert verdict, verdict


@pytest.mark.parametrize(("fn", "phrase"), [
    (sums_twice, "not the sum"),
    (never_waits, "never waited for them"),
    (broadcasts, "called torch.distributed.broadcast. Only dist.all_reduce"),
    (catches_the_refusal, "(and caught the error; it still counts)"),
    (ready_made_in_a_thread, f"called {READY_MADE} (and caught the error"),
    (raises_after_one_call, "raised ValueError: a mistake of its own"),
    ("not a function", "pass your function itself, e.g. grade(SPEC, my_sum), not str."),
])
def test_wrong_solutions_get_their_verdict(fn, phrase):
    verdict = grade(SPEC, fn, timeout_seconds=TIMEOUT_SECONDS)
    assert not verdict and phrase in verdict.message, verdict
    assert verdict.message.startswith("On ") or fn == "not a function"


def test_a_final_check_is_told_only_once_every_case_passed_the_others():
    """draw_cases puts 3 ranks first, then 2: the final check's problem shows in the first case, but a problem of
    the ordinary checks in a later case is the verdict; without one, the final check's, from its first case."""
    verdict = grade(SPEC, adds_an_idle_call, timeout_seconds=TIMEOUT_SECONDS)
    assert not verdict and verdict.message.startswith("On 3 ranks") and "all_reduces; one is enough" in \
        verdict.message, verdict
    verdict = grade(SPEC, adds_an_idle_call_and_is_wrong_on_two_ranks, timeout_seconds=TIMEOUT_SECONDS)
    assert not verdict and verdict.message.startswith("On 2 ranks") and "not the sum" in verdict.message, verdict


def test_a_hang_is_told_and_the_pool_stopped():
    verdict = grade(SPEC, rank_one_alone, timeout_seconds=2.0)
    assert not verdict and "it never finished (stopped after 2 s)" in verdict.message, verdict


def test_after_an_error_the_pool_is_kept_when_the_ranks_agree_and_stopped_when_not():
    case = Case(2, {"numel": 3, "dtype": torch.float32})

    def graders_pids():  # the graders grade on ranks of their own
        with pools_apart(GRADERS):
            return labkit.run(os.getpid, world_size=2)

    pids = graders_pids()
    assert "a mistake of its own" in case_problem(SPEC, (raises_after_one_call,), case, TIMEOUT_SECONDS)
    assert graders_pids() == pids  # both ranks made the same one all_reduce: kept
    assert "a mistake of its own" in case_problem(SPEC, (raises_out_of_step,), case, TIMEOUT_SECONDS)
    assert set(graders_pids()).isdisjoint(pids)  # rank 0's all_reduce had no partner


def test_the_rule_reads_the_store_when_labkit_kept_the_pool():
    """labkit keeps a pool whose ranks' collective counters agree; the store still tells calls apart that the
    counters do not (here, an all_reduce of a different size on each rank, which gloo would mismatch)."""
    attempts = [LastAttempt([Call(Kind.ALLREDUCE, 3)]), LastAttempt([Call(Kind.ALLREDUCE, 4)])]
    labkit.run(os.getpid, world_size=2)
    stop_if_out_of_step(2, attempts[:1] * 2)
    assert OWNER.kept_pool(2) is not None
    stop_if_out_of_step(2, attempts)
    assert OWNER.kept_pool(2) is None


def test_the_rule_stops_the_pool_when_messages_do_not_pair_up():
    """A rank that raised after its dist.isend, whose peer never posted the recv, leaves a message waiting for the
    next case's recvs: the counts of sends and recvs per (source, destination) must agree, or the pool is stopped."""
    paired = [LastAttempt([Call(Kind.SEND, 3, peer=1)]), LastAttempt([Call(Kind.RECV, 3, peer=0)])]
    unpaired = [LastAttempt([Call(Kind.SEND, 3, peer=1)]), LastAttempt([])]
    labkit.run(os.getpid, world_size=2)
    stop_if_out_of_step(2, paired)
    assert OWNER.kept_pool(2) is not None
    stop_if_out_of_step(2, unpaired)
    assert OWNER.kept_pool(2) is None


def test_ranks_started_while_the_kernel_refuses_do_not_keep_refusing():
    """An in-process grader (06, 13) refuses in the kernel; ranks (and a fork server) started meanwhile serve
    every later call, and must not keep refusing once it is done (labkit passes the kernel's environment on)."""
    from labkit._refusals import refusing

    labkit.shutdown()  # every pool and the fork server: the next call starts them afresh, here inside the window
    with refusing((READY_MADE,)):
        labkit.run(os.getpid, world_size=2)
    assert labkit.run(os.environ.get, "LABKIT_REFUSED", world_size=2) == [None, None]
