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
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import labkit
from labkit.exercises.accumulation import check_no_sync_accumulation, warm_up
from labkit.exercises.verdict import Verdict

HANG_SECONDS = 3.0  # a deadlocked solution is stopped after this long (a right one takes milliseconds per step)


@pytest.fixture(scope="module", autouse=True)
def warm_pools():
    """Start the pools of 2 and 3 ranks and wrap a model in DDP once in each, as the grader does before every case:
    then the first test's time is not the pools' start."""
    for world_size in (2, 3):
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


@pytest.mark.parametrize("fn", [if_else, nullcontext_zero_first, summed_losses, logs_accuracy_without_grad,
                                keeps_detached_losses])
def test_right_solutions_pass_and_say_what_was_checked(fn):
    verdict = check_no_sync_accumulation(fn, record=False)
    assert verdict and isinstance(verdict, Verdict), verdict
    assert "all-reduced once per optimizer step" in verdict.message, verdict
    assert "equal one process trained on the large batch" in verdict.message, verdict


# ---- wrong solutions: each rejected, naming its mistake ----------------------------------------------------

def accumulate(ddp_model, microbatches, inside, divisor, zero_in_loop=None):
    """Forward and backward of every micro-batch, micro-batch i inside no_sync() when inside(i, k), each loss
    divided by divisor(k); zero_in_loop(optimizer) before each backward, if given."""
    k = len(microbatches)
    for i, (x, y) in enumerate(microbatches):
        with ddp_model.no_sync() if inside(i, k) else contextlib.nullcontext():
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


WRONG = [
    (no_no_sync, "after every micro-batch (3 all_reduces in one optimizer step"),
    (forward_outside_no_sync, "entered ddp_model.no_sync(), but every forward ran outside it"),
    (no_sync_around_all, "every micro-batch ran inside no_sync(), so DDP never all-reduced"),
    (no_sync_on_the_last, "wrapped the last 2 micro-batch(es) instead of the first 2"),
    (not_divided, "3 times the large batch's: the loss was not divided by k = 3"),
    (divided_by_k_and_n, "1/2 of the large batch's: the loss was divided by k x N = 6"),
    (divided_by_n, "3/2 of the large batch's: the loss was divided by N = 2"),
    (zero_grad_in_the_loop, "held only the last micro-batch's"),
    (zero_grad_before_step, "gradient at optimizer.step() was zero"),
    (never_zeroed, "still held the previous step's"),
    (step_in_the_loop, "called optimizer.step() 3 times in one call, once per micro-batch"),
    (around_ddp, "called ddp_model.module(x), the model inside DDP"),
    (averaged_by_hand_too, "made 4 all_reduce(s) of its own in one optimizer step, besides DDP's 1: DDP already"),
    (forwards_first_then_one_backward, "all 3 forwards ran first, then one backward of their summed losses: the "
                                       "activations of 3 micro-batches were kept in memory at once"),
    (mean_loss_one_backward, "all 3 forwards ran first, then one backward of their summed losses"),
    (loss_all_reduced_for_logging, "made 1 all_reduce(s) of its own in one optimizer step, besides DDP's 1, of a "
                                   "scalar (a loss?): not a gradient"),
    (broadcast_after_step, "called torch.distributed.broadcast. This exercise makes no collective of its "
                           "own: DDP does the step's communication"),
    (barrier_per_micro_batch, "called torch.distributed.barrier. This exercise makes no collective of its "
                              "own"),
    (broadcast_caught, "called torch.distributed.broadcast (and caught the error; it still counts)"),
    (clip_inside_loop, "the gradients changed between micro-batch 1's backward and micro-batch 2's forward, by "
                       "something other than a backward: clip_grad_norm_ before the last micro-batch"),
    (clip_once_after_the_last, "That is the right place to clip in a real run"),
    (retain_graph_with_losses_kept, "when micro-batch 2's forward began, the activations that autograd saved for "
                                    "micro-batch(es) 1 were still in memory, after their backward: up to 3 "
                                    "micro-batches' activations were alive at once. A backward(retain_graph=True)"),
]


@pytest.mark.parametrize(("fn", "named"), WRONG, ids=[fn.__name__ for fn, _ in WRONG])
def test_wrong_solutions_are_rejected_naming_the_mistake(fn, named):
    verdict = check_no_sync_accumulation(fn, record=False)
    assert not verdict and named in verdict.message, verdict
    assert verdict.message.startswith("On 2 ranks with 3 micro-batches each"), verdict


def test_the_second_case_divides_by_its_own_k_and_n():
    """On 3 ranks with 2 micro-batches, dividing by N instead of k is 2/3 of the gradient: the first case's
    right answer would not pass it by luck."""
    from labkit.exercises.accumulation import ACCUMULATION_CASES

    assert all(world_size != k for world_size, k in ACCUMULATION_CASES)
    assert [case[0] for case in ACCUMULATION_CASES] == [2, 3]


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
