"""check_no_sync_accumulation (notebook 07's exercise) against a catalogue of wrong solutions, each rejected with a
message that names the mistake, and right solutions written in different ways, all accepted.

Several wrong ones reach the right parameters (no no_sync at all, the forward outside it, an average by hand on
top of DDP's, a loss all-reduced for a printout): only the count of all_reduces, DDP's through its communication
hook and the process group's, catches them. Two more (every forward first, then one backward of the summed
losses) are right in values and in syncs, but keep every micro-batch's activations alive at once: the order of
forwards and backward passes catches them. A broadcast or a barrier of the solution's own is switched off (DDP
does the step's communication), caught or not. A clip_grad_norm_ inside the loop clips a partial gradient: the
inputs are scaled so that a clip to 1.0 acts, and the gradient changed between micro-batches shows. One clip after
the last backward is where clipping belongs in a real run, but not in this exercise, whose step is the large
batch's unclipped: it is rejected, saying so.

Each grading draws its two cases afresh (draw_cases: world sizes, k, rows, dtype, the model's sizes, lr,
momentum, seeds), so the verdicts are matched by patterns, not by the numbers of one draw. Rows of issue 27's classes:
"fixed parameters" (the old grader's constants written in: k x N = 6, 24 rows per step, float64 inputs: each passed
the old fixed cases and fails now), and "counting is not checking" (the right number of all_reduces carrying the
wrong thing: an accumulator of one's own, so that DDP's one all_reduce carries only the last micro-batch; a scratch
copy all-reduced by hand instead of DDP's).
"""

import contextlib
import random
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import labkit
from labkit.exercises._kit._runner import GRADERS
from labkit.exercises.accumulation import MICROBATCHES, WORLD_SIZES, check_no_sync_accumulation, draw_cases, warm_up
from labkit.exercises.verdict import Verdict
from labkit.launch import pools_apart

HANG_SECONDS = 3.0  # a deadlocked solution is stopped after this long (a right one takes milliseconds per step)


@pytest.fixture(scope="module", autouse=True)
def warm_pools():
    """Start the pools of 2, 3 and 4 ranks (the world sizes a grading draws from) and wrap a model in DDP once in
    each, as the grader does before every case: then the first test's time is not the pools' start."""
    with pools_apart(GRADERS):  # the graders' own ranks, apart from the student's
        for world_size in WORLD_SIZES:
            labkit.run(warm_up, world_size=world_size)


def loss_of(ddp_model, x, y, k):
    return F.cross_entropy(ddp_model(x), y) / k


# ---- right solutions, written differently ----------------------------------------------------------------

def if_else(ddp_model, optimizer, microbatches):
    """The lesson's loop: no_sync() for all but the last, then step and zero."""
    k = len(microbatches)
    for i, (x, y) in enumerate(microbatches):
        if i < k - 1:
            with ddp_model.no_sync():
                loss_of(ddp_model, x, y, k).backward()
        else:
            loss_of(ddp_model, x, y, k).backward()
    optimizer.step()
    optimizer.zero_grad()


def nullcontext_zero_first(ddp_model, optimizer, microbatches):
    """One with-statement whose context is no_sync() or contextlib.nullcontext(); zero_grad before the loop."""
    optimizer.zero_grad(set_to_none=False)
    for batch in microbatches:
        context = contextlib.nullcontext() if batch is microbatches[-1] else ddp_model.no_sync()
        with context:
            loss_of(ddp_model, *batch, len(microbatches)).backward()
    optimizer.step()


def summed_losses(ddp_model, optimizer, microbatches):
    """Summed per-example losses over the rank's total count (equal micro-batches: the same as mean / k); the
    first k-1 inside one no_sync() block; the model's own zero_grad after the step."""
    rows = sum(len(y) for _, y in microbatches)
    with ddp_model.no_sync():
        for x, y in microbatches[:-1]:
            (F.cross_entropy(ddp_model(x), y, reduction="sum") / rows).backward()
    x, y = microbatches[-1]
    (F.cross_entropy(ddp_model(x), y, reduction="sum") / rows).backward()
    optimizer.step()
    ddp_model.zero_grad()


def logs_accuracy_without_grad(ddp_model, optimizer, microbatches):
    """The lesson's loop, plus each micro-batch's accuracy from a forward under torch.no_grad(): no graph, no
    gradient, no synchronisation, so no micro-batch."""
    k, correct = len(microbatches), 0
    for i, (x, y) in enumerate(microbatches):
        with ddp_model.no_sync() if i < k - 1 else contextlib.nullcontext():
            loss_of(ddp_model, x, y, k).backward()
        with torch.no_grad():
            correct += (ddp_model(x).argmax(dim=1) == y).sum().item()
    optimizer.step()
    optimizer.zero_grad()
    return correct


def keeps_detached_losses(ddp_model, optimizer, microbatches):
    """Each micro-batch's loss kept for a printout, detached: its graph freed by backward all the same."""
    k, losses = len(microbatches), []
    for i, (x, y) in enumerate(microbatches):
        with ddp_model.no_sync() if i < k - 1 else contextlib.nullcontext():
            loss = loss_of(ddp_model, x, y, k)
            loss.backward()
        losses.append(loss.detach())
    optimizer.step()
    optimizer.zero_grad()
    return losses


def divides_the_gradients(ddp_model, optimizer, microbatches):
    """Each loss undivided, the gradients divided by k after the last backward (DDP's bucket then holds k times the
    accumulated mean, and its all-reduced average divided by k is the large batch's); zero_grad before the loop."""
    k = len(microbatches)
    optimizer.zero_grad()
    with ddp_model.no_sync():
        for x, y in microbatches[:-1]:
            F.cross_entropy(ddp_model(x), y).backward()
    F.cross_entropy(ddp_model(microbatches[-1][0]), microbatches[-1][1]).backward()
    for p in ddp_model.parameters():
        p.grad /= k
    optimizer.step()


@pytest.mark.parametrize("fn", [if_else, nullcontext_zero_first, summed_losses, logs_accuracy_without_grad,
                                keeps_detached_losses, divides_the_gradients])
def test_right_solutions_pass_and_say_what_was_checked(fn):
    verdict = check_no_sync_accumulation(fn, record=False)
    assert verdict and isinstance(verdict, Verdict), verdict
    assert "all-reduced once per optimizer step" in verdict.message, verdict
    assert "equal one process trained on the large batch" in verdict.message, verdict


# ---- wrong solutions: each rejected, naming its mistake ----------------------------------------------------

def accumulate(ddp_model, microbatches, inside, divisor, zero_in_loop=None, reduction_sum_over=None):
    """Forward and backward of every micro-batch, micro-batch i inside no_sync() when inside(i, k), each loss
    divided by divisor(k) (a summed loss divided by reduction_sum_over, if given); zero_in_loop(optimizer) before
    each backward, if given."""
    k = len(microbatches)
    for i, (x, y) in enumerate(microbatches):
        with ddp_model.no_sync() if inside(i, k) else contextlib.nullcontext():
            if reduction_sum_over:
                loss = F.cross_entropy(ddp_model(x), y, reduction="sum") / reduction_sum_over
            else:
                loss = F.cross_entropy(ddp_model(x), y) / divisor(k)
            if zero_in_loop:
                zero_in_loop()
            loss.backward()


def all_but_last(i, k):
    return i < k - 1


def by_k(k):
    return k


def no_no_sync(ddp_model, optimizer, microbatches):
    accumulate(ddp_model, microbatches, lambda i, k: False, by_k)
    optimizer.step()
    optimizer.zero_grad()


def forward_outside_no_sync(ddp_model, optimizer, microbatches):
    k = len(microbatches)
    for i, (x, y) in enumerate(microbatches):
        loss = F.cross_entropy(ddp_model(x), y) / k
        with ddp_model.no_sync() if i < k - 1 else contextlib.nullcontext():
            loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def no_sync_around_all(ddp_model, optimizer, microbatches):
    accumulate(ddp_model, microbatches, lambda i, k: True, by_k)
    optimizer.step()
    optimizer.zero_grad()


def no_sync_on_the_last(ddp_model, optimizer, microbatches):
    accumulate(ddp_model, microbatches, lambda i, k: i > 0, by_k)
    optimizer.step()
    optimizer.zero_grad()


def not_divided(ddp_model, optimizer, microbatches):
    accumulate(ddp_model, microbatches, all_but_last, lambda k: 1)
    optimizer.step()
    optimizer.zero_grad()


def divided_by_k_and_n(ddp_model, optimizer, microbatches):
    accumulate(ddp_model, microbatches, all_but_last, lambda k: k * labkit.world_size())
    optimizer.step()
    optimizer.zero_grad()


def divided_by_n(ddp_model, optimizer, microbatches):
    accumulate(ddp_model, microbatches, all_but_last, lambda k: labkit.world_size())
    optimizer.step()
    optimizer.zero_grad()


def zero_grad_in_the_loop(ddp_model, optimizer, microbatches):
    accumulate(ddp_model, microbatches, all_but_last, by_k, zero_in_loop=optimizer.zero_grad)
    optimizer.step()


def zero_grad_before_step(ddp_model, optimizer, microbatches):
    accumulate(ddp_model, microbatches, all_but_last, by_k)
    optimizer.zero_grad()
    optimizer.step()


def never_zeroed(ddp_model, optimizer, microbatches):
    accumulate(ddp_model, microbatches, all_but_last, by_k)
    optimizer.step()


def step_in_the_loop(ddp_model, optimizer, microbatches):
    k = len(microbatches)
    for i, (x, y) in enumerate(microbatches):
        with ddp_model.no_sync() if i < k - 1 else contextlib.nullcontext():
            (F.cross_entropy(ddp_model(x), y) / k).backward()
        optimizer.step()
    optimizer.zero_grad()


def around_ddp(ddp_model, optimizer, microbatches):
    k = len(microbatches)
    for x, y in microbatches:
        (F.cross_entropy(ddp_model.module(x), y) / k).backward()
    optimizer.step()
    optimizer.zero_grad()


def averaged_by_hand_too(ddp_model, optimizer, microbatches):
    accumulate(ddp_model, microbatches, all_but_last, by_k)
    for p in ddp_model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    optimizer.step()
    optimizer.zero_grad()


def forwards_first_then_one_backward(ddp_model, optimizer, microbatches):
    """Right values and one sync, but all k micro-batches' activations alive at once."""
    k, losses = len(microbatches), []
    for i, (x, y) in enumerate(microbatches):
        with ddp_model.no_sync() if i < k - 1 else contextlib.nullcontext():
            losses.append(F.cross_entropy(ddp_model(x), y) / k)
    sum(losses).backward()
    optimizer.step()
    optimizer.zero_grad()


def mean_loss_one_backward(ddp_model, optimizer, microbatches):
    """No no_sync: k forwards, one backward of the mean loss (DDP syncs once, in that one backward)."""
    loss = sum(F.cross_entropy(ddp_model(x), y) for x, y in microbatches) / len(microbatches)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def loss_all_reduced_for_logging(ddp_model, optimizer, microbatches):
    """Right accumulation, plus an all_reduce of the loss for a printout: a collective of its own."""
    k, total = len(microbatches), torch.zeros((), dtype=torch.float64, device=labkit.device())
    for i, (x, y) in enumerate(microbatches):
        with ddp_model.no_sync() if i < k - 1 else contextlib.nullcontext():
            loss = F.cross_entropy(ddp_model(x), y) / k
            loss.backward()
        total += loss.detach()
    dist.all_reduce(total)
    optimizer.step()
    optimizer.zero_grad()


def broadcast_after_step(ddp_model, optimizer, microbatches):
    """Right accumulation, plus a 'safety' broadcast of the weights from rank 0 after every step."""
    if_else(ddp_model, optimizer, microbatches)
    for p in ddp_model.parameters():
        dist.broadcast(p.data, 0)


def barrier_per_micro_batch(ddp_model, optimizer, microbatches):
    """A dist.barrier() after each micro-batch's backward, 'to keep the ranks together'."""
    k = len(microbatches)
    for i, (x, y) in enumerate(microbatches):
        with ddp_model.no_sync() if i < k - 1 else contextlib.nullcontext():
            (F.cross_entropy(ddp_model(x), y) / k).backward()
        dist.barrier()
    optimizer.step()
    optimizer.zero_grad()


def broadcast_caught(ddp_model, optimizer, microbatches):
    """A broadcast whose error is swallowed: still a collective of its own."""
    if_else(ddp_model, optimizer, microbatches)
    try:
        dist.broadcast(next(ddp_model.parameters()).data, 0)
    except RuntimeError:
        pass


def clip_inside_loop(ddp_model, optimizer, microbatches):
    """clip_grad_norm_ after every micro-batch's backward: the first k-1 clip a partial, unsynchronised sum."""
    k = len(microbatches)
    for i, (x, y) in enumerate(microbatches):
        with ddp_model.no_sync() if i < k - 1 else contextlib.nullcontext():
            (F.cross_entropy(ddp_model(x), y) / k).backward()
        torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), max_norm=1.0)
    optimizer.step()
    optimizer.zero_grad()


def clip_once_after_the_last(ddp_model, optimizer, microbatches):
    """Clipping in the right place for a real run (after the last backward, on the all-reduced gradient), but
    this exercise's step is the large batch's, unclipped."""
    k = len(microbatches)
    for i, (x, y) in enumerate(microbatches):
        with ddp_model.no_sync() if i < k - 1 else contextlib.nullcontext():
            (F.cross_entropy(ddp_model(x), y) / k).backward()
    torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), max_norm=1.0)
    optimizer.step()
    optimizer.zero_grad()


def retain_graph_with_losses_kept(ddp_model, optimizer, microbatches):
    """Right order and values, but backward(retain_graph=True) with every loss kept in a list: every micro-batch's
    graph, and its activations, alive until the step ends."""
    k, losses = len(microbatches), []
    for i, (x, y) in enumerate(microbatches):
        with ddp_model.no_sync() if i < k - 1 else contextlib.nullcontext():
            losses.append(loss_of(ddp_model, x, y, k))
            losses[-1].backward(retain_graph=True)
    optimizer.step()
    optimizer.zero_grad()


# ---- issue 27, "fixed parameters let hard-coded solutions pass": the old grader's constants written in --------
# (its cases were 2 ranks x 3 micro-batches and 3 x 2 of 4 rows, float64: k x N = 6 and 24 rows per step in both)

def six_micro_batches_over_n(ddp_model, optimizer, microbatches):
    """k taken as 6 // N, the old cases' micro-batches per step: right on 2 x 3 and 3 x 2 only."""
    k = 6 // dist.get_world_size()
    accumulate(ddp_model, microbatches, all_but_last, lambda _: k)
    optimizer.step()
    optimizer.zero_grad()


def rows_of_the_old_batch(ddp_model, optimizer, microbatches):
    """Summed losses over the rank's rows, counted from the old verdicts' "a batch of 24 rows" instead of the
    micro-batches themselves."""
    rows = 24 // dist.get_world_size()
    accumulate(ddp_model, microbatches, all_but_last, lambda _: 1, reduction_sum_over=rows)
    optimizer.step()
    optimizer.zero_grad()


def casts_to_float64(ddp_model, optimizer, microbatches):
    """The micro-batches cast to float64 "to be safe", as the old float64 model took them."""
    k = len(microbatches)
    for i, (x, y) in enumerate(microbatches):
        with ddp_model.no_sync() if i < k - 1 else contextlib.nullcontext():
            (F.cross_entropy(ddp_model(x.double()), y) / k).backward()
    optimizer.step()
    optimizer.zero_grad()


# ---- issue 27, "counting is not checking": the right number of all_reduces, carrying something else ---------

def own_accumulator(ddp_model, optimizer, microbatches):
    """Every micro-batch's gradient added into an accumulator of its own, .grad zeroed before each micro-batch
    and set from the accumulator at the end: one all_reduce, DDP's, as wanted, but it carried only the last
    micro-batch's gradient; the others stay on their rank."""
    k = len(microbatches)
    total = [torch.zeros_like(p) for p in ddp_model.parameters()]
    for i, (x, y) in enumerate(microbatches):
        optimizer.zero_grad()
        with ddp_model.no_sync() if i < k - 1 else contextlib.nullcontext():
            (F.cross_entropy(ddp_model(x), y) / k).backward()
        for t, p in zip(total, ddp_model.parameters(), strict=True):
            t += p.grad
    for t, p in zip(total, ddp_model.parameters(), strict=True):
        p.grad = t
    optimizer.step()
    optimizer.zero_grad()


def reduces_a_scratch_copy(ddp_model, optimizer, microbatches):
    """Every micro-batch inside no_sync(), then one all_reduce per step of a flat scratch copy of the gradients,
    divided by N and copied back: the right count (one all_reduce per optimizer step) and the right values, but
    made by hand around DDP, whose one all_reduce never ran."""
    accumulate(ddp_model, microbatches, lambda i, k: True, by_k)
    grads = [p.grad for p in ddp_model.parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    torch.nn.utils.vector_to_parameters(flat, grads)
    optimizer.step()
    optimizer.zero_grad()


K = r"(\d+)"
WRONG = [  # (solution, a pattern of its verdict: the mistake named, whatever the grading drew)
    (no_no_sync, rf"after every micro-batch \({K} all_reduces in one optimizer step"),
    (forward_outside_no_sync, r"entered ddp_model.no_sync\(\), but every forward ran outside it"),
    (no_sync_around_all, r"every micro-batch ran inside no_sync\(\), so DDP never all-reduced: each rank stepped"),
    (no_sync_on_the_last, rf"wrapped the last {K} micro-batch\(es\) instead of the first \1"),
    (not_divided, rf"{K} times the large batch's: the loss was not divided by k = \1"),
    (divided_by_k_and_n, rf"1/{K} of the large batch's: the loss was divided by k x N = {K}"),
    (divided_by_n, rf"{K}/{K} of the large batch's: the loss was divided by N = \2"),
    (zero_grad_in_the_loop, r"carried a gradient that held only the last micro-batch's, not the sum"),
    (zero_grad_before_step, r"gradient at optimizer.step\(\) was zero"),
    (never_zeroed, r"at optimizer step 2 of 3, .*still held the previous step's"),
    (step_in_the_loop, rf"called optimizer.step\(\) {K} times in one call, once per micro-batch"),
    (around_ddp, r"called ddp_model.module\(x\), the model inside DDP"),
    (averaged_by_hand_too, r"made 4 all_reduce\(s\) of its own in one optimizer step, besides DDP's 1: DDP already"),
    (forwards_first_then_one_backward, rf"all {K} forwards ran first, then one backward of their summed losses: the "
                                       r"activations of \1 micro-batches were kept in memory at once"),
    (mean_loss_one_backward, rf"all {K} forwards ran first, then one backward of their summed losses"),
    (loss_all_reduced_for_logging, r"made 1 all_reduce\(s\) of its own in one optimizer step, besides DDP's 1, of "
                                   r"a scalar \(a loss\?\): not a gradient"),
    (broadcast_after_step, r"called torch.distributed.broadcast. This exercise makes no collective of its "
                           "own: DDP does the step's communication"),
    (barrier_per_micro_batch, r"called torch.distributed.barrier. This exercise makes no collective of its own"),
    (broadcast_caught, r"called torch.distributed.broadcast \(and caught the error; it still counts\)"),
    (clip_inside_loop, rf"the gradients changed between micro-batch {K}'s backward and micro-batch {K}'s forward, "
                       "by something other than a backward: clip_grad_norm_ before the last micro-batch"),
    (clip_once_after_the_last, r"That is the right place to clip in a real run"),
    (retain_graph_with_losses_kept, r"when micro-batch 2's forward began, the activations that autograd saved for "
                                    rf"micro-batch\(es\) 1 were still in memory, after their backward: up to {K} "
                                    r"micro-batches' activations were alive at once. A backward\(retain_graph=True\)"),
    # fixed parameters: each passed the old grader's fixed cases
    (six_micro_batches_over_n, r"(the loss was not divided by k = \d|the losses were scaled by something other "
                               r"than 1/k = 1/\d .*take k from len\(microbatches\))"),
    (rows_of_the_old_batch, r"(the loss was not divided by k = \d|the loss was divided by|the losses were scaled "
                            r"by something other than 1/k = 1/\d)"),
    (casts_to_float64, r"raised RuntimeError: .*dtype.* In this case the model and the micro-batches are float32 "
                       r"\(drawn for each grading"),
    # counting is not checking
    (own_accumulator, r"at optimizer step 1 of 3, rank \d's one all_reduce \(DDP's, in the last micro-batch's "
                      r"backward\) carried a gradient that held only the last micro-batch's, not the sum"),
    (reduces_a_scratch_copy, r"every micro-batch ran inside no_sync\(\), so DDP never all-reduced, and rank 0 "
                             r"made 1 all_reduce\(s\) of its own instead: the right number of all_reduces, but "
                             "not DDP's"),
]


@pytest.mark.parametrize(("fn", "named"), WRONG, ids=[fn.__name__ for fn, _ in WRONG])
def test_wrong_solutions_are_rejected_naming_the_mistake(fn, named):
    verdict = check_no_sync_accumulation(fn, record=False)
    assert not verdict and re.search(named, verdict.message, re.DOTALL), verdict
    assert re.match(r"On \d ranks with \d micro-batches each of \d rows \(a batch of \d+ rows per optimizer step; "
                    r"float(32|64), SGD lr [\d.]+(, momentum [\d.]+)?\), ", verdict.message), verdict


@pytest.mark.parametrize("fn", [six_micro_batches_over_n, rows_of_the_old_batch, casts_to_float64])
def test_the_old_constants_passed_the_old_cases(fn, monkeypatch):
    """The fixed-parameter rows are right on the old grader's two fixed cases (2 ranks x 3 micro-batches and 3 x 2,
    4 rows each, float64, lr 0.05): a fixed grading passed them, a drawn one fails them."""
    from labkit.exercises import accumulation
    from labkit.exercises._kit._runner import Case

    old = {"rows": 4, "dtype": torch.float64, "features": 4, "hidden": 8, "lr": 0.05, "momentum": 0.0, "seed": 0,
           "batch_seed": 100}
    monkeypatch.setattr(accumulation, "draw_cases", lambda rng=None: [Case(2, {**old, "microbatches": 3}),
                                                                      Case(3, {**old, "microbatches": 2})])
    verdict = check_no_sync_accumulation(fn, record=False)
    assert verdict, verdict


def test_each_grading_draws_two_cases_that_no_constant_fits():
    """Two world sizes, one float32 and one float64, k never N, and k, k x N and the rows per step different
    between the two cases (a number written in fails one); over many gradings every world size and k occurs."""
    rng, seen = random.Random(27), set()
    for _ in range(300):
        first, second = draw_cases(rng)
        assert first.world_size != second.world_size
        assert {first["dtype"], second["dtype"]} == {torch.float32, torch.float64}
        for value in (lambda c: c["microbatches"], lambda c: c.world_size * c["microbatches"],
                      lambda c: c.world_size * c["microbatches"] * c["rows"]):
            assert value(first) != value(second)
        for case in (first, second):
            assert case["microbatches"] != case.world_size
            assert 0.02 <= case["lr"] <= 0.08 and (case["momentum"] == 0 or 0.5 <= case["momentum"] <= 0.9)
            seen.add((case.world_size, case["microbatches"]))
    assert {n for n, _ in seen} == set(WORLD_SIZES) and {k for _, k in seen} == set(MICROBATCHES)


def test_a_grader_wants_the_function_itself():
    verdict = check_no_sync_accumulation("train_step", record=False)
    assert not verdict and "pass your function itself" in verdict.message
    with pytest.raises(ValueError, match="timeout_seconds=0"):
        check_no_sync_accumulation(print, timeout_seconds=0, record=False)


def the_exercise_stub(ddp_model, optimizer, microbatches):
    raise NotImplementedError("your turn")


def test_the_stub_fails_kindly():
    verdict = check_no_sync_accumulation(the_exercise_stub, record=False)
    assert not verdict and "raised NotImplementedError: your turn" in verdict.message, verdict


def rank_one_runs_out_of_data(ddp_model, optimizer, microbatches):
    """Rank 1 raises before its last micro-batch, while rank 0 waits in DDP's all_reduce for it."""
    if labkit.rank() == 1:
        raise ValueError("rank 1 ran out of data")
    if_else(ddp_model, optimizer, microbatches)


def test_a_rank_that_raises_is_named_while_the_other_waits():
    verdict = check_no_sync_accumulation(rank_one_runs_out_of_data, record=False)
    assert not verdict and "rank 1 raised ValueError: rank 1 ran out of data" in verdict.message, verdict
    assert check_no_sync_accumulation(if_else, record=False), "the ranks after the failed run must be usable again"


def rank_zero_syncs_every_time(ddp_model, optimizer, microbatches):
    """Rank 0 leaves no_sync() out: it all-reduces three times, the other rank once, and waits for ever."""
    inside = (lambda i, k: False) if labkit.rank() == 0 else all_but_last
    accumulate(ddp_model, microbatches, inside, by_k)
    optimizer.step()
    optimizer.zero_grad()


def test_a_deadlock_is_stopped_and_said():
    """Last in the file: the hang stops the pool of 2 ranks."""
    verdict = check_no_sync_accumulation(rank_zero_syncs_every_time, timeout_seconds=HANG_SECONDS,
                                         record=False)
    assert not verdict and f"it never finished (stopped after {HANG_SECONDS:g} s)" in verdict.message, verdict
    assert "whatever its rank" in verdict.message, verdict
