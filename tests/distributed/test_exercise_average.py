"""check_average_gradients (notebook 01's exercise) against a catalogue of wrong solutions, each rejected with a
message that names the mistake, and right solutions written in different ways, all accepted.

Several wrong ones give the right values (labkit's average_gradients, BucketedDDP, torch's DDP) or right-looking
values by luck of timing (async_op=True without wait(), or with only the last handle or future waited, or a
future taken and never waited): only the guard catches them, at the process-group level and on the handles and
futures.
"""

import copy
import importlib
import itertools
import multiprocessing
import pickle
import random
import re
import sys
import threading
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import labkit
from labkit.exercises import Verdict, check_average_gradients
from labkit.exercises._kit._runner import GRADERS
from labkit.exercises.average import attempt_average, draw_case, with_dead_rank
from labkit.launch import pools_apart
from labkit.parallel import BucketedDDP, all_reduce_sum, average_gradients

HANG_SECONDS = 2.0  # a deadlocked solution is stopped after this long (a right one takes milliseconds per step)


@pytest.fixture(scope="module", autouse=True)
def warm_pools():
    """Start the pools of 2, 3 and 4 ranks and import the grader's rank side in them, so that no case's timeout
    is spent starting processes on a loaded machine."""
    with pools_apart(GRADERS):  # the graders' own ranks, apart from the student's
        for world_size in (2, 3, 4):
            labkit.run(importlib.import_module, "labkit.exercises.average", world_size=world_size)


def n():
    return dist.get_world_size()


# ---- right solutions, written differently ----------------------------------------------------------------

def loop_all_reduce_div(model):
    """The lesson's loop: all_reduce (SUM) each gradient, then divide it in place."""
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad.div_(n())


def flatten_unflatten(model):
    """One all_reduce of every gradient flattened together (torch._utils, as DDP's buckets do)."""
    grads = [p.grad for p in model.parameters()]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat /= n()
    for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(averaged)


def cat_and_split(model):
    """The same with torch.cat and split, the average written back by assignment."""
    params = list(model.parameters())
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    for p, piece in zip(params, (flat / n()).split([p.numel() for p in params]), strict=True):
        p.grad = piece.view_as(p).clone()


def async_handles_waited(model):
    """Every all_reduce started at once (async_op=True), each waited for before its division."""
    params = list(model.parameters())
    handles = [dist.all_reduce(p.grad, async_op=True) for p in params]
    for handle, p in zip(handles, params, strict=True):
        handle.wait()
        p.grad /= n()


def polled_until_completed(model):
    """No wait(): a loop on each handle's is_completed() until it says True, which waits all the same."""
    params = list(model.parameters())
    handles = [dist.all_reduce(p.grad, async_op=True) for p in params]
    for handle in handles:
        while not handle.is_completed():
            pass
    for p in params:
        p.grad /= n()


def futures_chained_and_waited(model):
    """The division chained on each handle's future with then(), every chained future waited (wait_all)."""
    def divided(future):
        return future.value()[0].div_(n())

    torch.futures.wait_all([dist.all_reduce(p.grad, async_op=True).get_future().then(divided)
                            for p in model.parameters()])


def labkit_sum_then_divide(model):
    """labkit's all_reduce_sum is only dist.all_reduce (SUM): allowed, unlike labkit's average_gradients."""
    for p in model.parameters():
        all_reduce_sum(p.grad)
        p.grad.div_(n())


def process_group_default_options(model):
    """The process group's own allreduce with its default options (op SUM), its handle waited: right, though
    no ReduceOp is spelled anywhere (a grader that read the op from absent options called it ReduceOp.None)."""
    for p in model.parameters():
        dist.group.WORLD.allreduce([p.grad]).wait()
        p.grad /= n()


def divided_before_the_sum(model):
    """Each gradient divided by N first, then all-reduced: the sum of the shares is the average (what goes in is
    the gradient divided by N, which the grader's check of what was reduced accepts)."""
    for p in model.parameters():
        p.grad /= n()
        dist.all_reduce(p.grad)


def weights_and_biases_in_two_buckets(model):
    """Two flat buckets, biases first then weights: gradients reduced in an order of their own."""
    params = list(model.parameters())
    for bucket in ([p for p in params if p.dim() == 1], [p for p in params if p.dim() > 1]):
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        dist.all_reduce(flat)
        for p, piece in zip(bucket, (flat / n()).split([p.numel() for p in bucket]), strict=True):
            p.grad.copy_(piece.view_as(p))


_WORLD = {}  # state that may be kept across calls: the world size does not change in a process


def world_size_kept_on_a_global(model):
    """The world size asked once and kept on a global: state across calls that is right to keep."""
    world = _WORLD.setdefault("n", dist.get_world_size())
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world


def averaged_in_a_thread(model):
    """The lesson's loop run in a thread of its own, joined: the all_reduces are the rank's all the same."""
    thread = threading.Thread(target=loop_all_reduce_div, args=(model,))
    thread.start()
    thread.join()


def cloned_reduced_and_rebound(model):
    """Each gradient cloned, the clone all-reduced, then .grad rebound to the clone's average: right. (The grader
    once knew gradients by their address; the clone could take a freed gradient's address on some ranks only, and
    the ranks were told they reduced "in different orders".)"""
    for p in model.parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        p.grad = g / dist.get_world_size()


RIGHT_NEW = [divided_before_the_sum, weights_and_biases_in_two_buckets, world_size_kept_on_a_global,
             averaged_in_a_thread, cloned_reduced_and_rebound]


@pytest.mark.parametrize("fn", [loop_all_reduce_div, flatten_unflatten, cat_and_split, async_handles_waited,
                                polled_until_completed, futures_chained_and_waited, labkit_sum_then_divide,
                                process_group_default_options, *RIGHT_NEW])
def test_right_solutions_pass_and_say_what_was_checked(fn):
    verdict = check_average_gradients(fn)
    assert verdict and isinstance(verdict, Verdict), verdict
    assert "gradient of the whole batch in one process" in verdict.message, verdict
    assert "replicas stayed identical" in verdict.message, verdict


# ---- wrong solutions: each rejected, naming its mistake ----------------------------------------------------

def summed(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)


def divided_by_rank_plus_one(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_rank() + 1


def divided_by_n_minus_one(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= n() - 1


def divided_twice(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= n()
    for p in model.parameters():
        p.grad /= n()


def weights_only(model):
    for name, p in model.named_parameters():
        if name.endswith("weight"):
            dist.all_reduce(p.grad)
            p.grad /= n()


def parameter_values(model):
    for p in model.parameters():
        dist.all_reduce(p.data)
        p.data /= n()


def max_op(model):
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.MAX)


def avg_then_divide(model):
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        p.grad /= n()


def async_without_wait(model):
    for p in model.parameters():
        dist.all_reduce(p.grad, async_op=True)
        p.grad /= n()


def wait_last_only(model):
    params = list(model.parameters())
    handles = [dist.all_reduce(p.grad, async_op=True) for p in params]
    handles[-1].wait()
    for p in params:
        p.grad /= n()


def wait_last_future_only(model):
    params = list(model.parameters())
    futures = [dist.all_reduce(p.grad, async_op=True).get_future() for p in params]
    futures[-1].wait()
    for p in params:
        p.grad /= n()


def future_never_waited(model):
    for p in model.parameters():
        dist.all_reduce(p.grad, async_op=True).get_future()
        p.grad /= n()


def future_then_never_waited(model):
    for p in model.parameters():
        dist.all_reduce(p.grad, async_op=True).get_future().then(lambda future: future.value()[0].div_(n()))


def future_polled_until_done(model):
    """A loop on each future's done(): on gloo it ends with the sum, but on CUDA done() is True once queued."""
    params = list(model.parameters())
    futures = [dist.all_reduce(p.grad, async_op=True).get_future() for p in params]
    for future in futures:
        while not future.done():
            pass
    for p in params:
        p.grad /= n()


def future_value_read(model):
    """The sum read from each future's value(), which does not synchronise on CUDA, with no wait()."""
    params = list(model.parameters())
    futures = [dist.all_reduce(p.grad, async_op=True).get_future() for p in params]
    for p, future in zip(params, futures, strict=True):
        while not future.done():
            pass
        p.grad = future.value()[0] / n()


def rank_dependent_order(model):
    params = list(model.parameters())
    for p in params[::-1] if dist.get_rank() % 2 else params:
        dist.all_reduce(p.grad)
        p.grad /= n()


def labkit_average(model):
    average_gradients(model)


def labkit_bucketed(model):
    BucketedDDP(model)


def torch_ddp(model):
    torch.nn.parallel.DistributedDataParallel(model)


@pytest.mark.parametrize(("fn", "named"), [
    (summed, "rank 0's gradient of 0.weight is 3x one process's on the whole batch: the 3 ranks' gradients were "
             "summed, not averaged"),
    (divided_by_rank_plus_one, "divided the sum by different numbers (rank 0: 1, rank 1: 2, rank 2: 3)"),
    (divided_by_n_minus_one, "divided by 2, not by N = 3"),
    (divided_twice, "divided by N twice (by 9 = 3^2)"),
    (weights_only, "gradients of 0.bias, 2.bias are still its own (not averaged)"),
    (parameter_values, "all-reduced a parameter's values (p or p.data), not its gradient"),
    (max_op, "all-reduced with ReduceOp.MAX"),
    (avg_then_divide, "divided by N twice (by 9 = 3^2). ReduceOp.AVG, if you used it, already divides"),
    (async_without_wait, "async_op=True and never called wait()"),
    (wait_last_only, re.compile(r"started \d+ all_reduce\(s\) with async_op=True and never called wait\(\)")),
    (wait_last_future_only, re.compile(r"never waited for them, though it waited for \d+ other\(s\): one future's "
                                       r"wait\(\) promises")),
    (future_never_waited, re.compile(r"took the futures \(handle.get_future\(\)\) of \d+ all_reduce\(s\) with "
                                     r"async_op=True in \d+ calls of your function \(2 models, \d SGD steps each\) "
                                     r"and never waited for them. get_future\(\) and then\(\) do not wait")),
    (future_then_never_waited, re.compile(r"of \d+ all_reduce\(s\) with async_op=True in \d+ calls of your "
                                          r"function .* and never waited for them.")),
    (future_polled_until_done, "A loop on the future's done(), or reading its value(), is no wait either: on GPUs "
                               "done() is True as soon as the all_reduce is queued"),
    (future_value_read, "and never waited for them"),
    (rank_dependent_order, "the ranks all-reduced the gradients in different orders"),
    (labkit_average, "called labkit.parallel's average_gradients"),
    (labkit_bucketed, "called labkit.parallel's BucketedDDP"),
    (torch_ddp, "called torch.nn.parallel.DistributedDataParallel"),
])
def test_wrong_solutions_are_rejected_naming_the_mistake(fn, named):
    verdict = check_average_gradients(fn)
    assert not verdict and _says(verdict.message, named), verdict
    assert verdict.message.startswith("On 3 ranks (a batch of 24 rows, 8 per rank; models of "), verdict


def _says(message: str, named) -> bool:
    """Whether the verdict names the mistake: a phrase it contains, or a pattern it matches (where a number in it
    depends on what the grading drew)."""
    return bool(named.search(message)) if isinstance(named, re.Pattern) else named in message


# ---- wrong solutions of the classes that fixed parameters, state across calls, counting instead of checking and
# ready-made helpers out of the guard's sight let pass (issue 27): refused on every draw ---------------------

NOTEBOOK_NUMEL = 6 * 8 + 8 + 8 * 3 + 3  # the notebook's model, 6 features, 8 hidden, 3 classes: 83 numbers


def numel_written_in(model):
    """A flat buffer of the notebook's model's 83 numbers, written in by hand: the graded model is never that."""
    flat, offset = torch.zeros(NOTEBOOK_NUMEL, dtype=torch.float64), 0
    for p in model.parameters():
        flat[offset:offset + p.numel()] = p.grad.reshape(-1)
        offset += p.numel()
    dist.all_reduce(flat)
    offset = 0
    for p in model.parameters():
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p) / n())
        offset += p.numel()


def split_sizes_written_in(model):
    """The flat sum split by the sizes printed in the notebook (48, 8, 24, 3), not by the gradients' own."""
    params = list(model.parameters())
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    for p, piece in zip(params, (flat / n()).split([48, 8, 24, 3]), strict=True):
        p.grad.copy_(piece.view_as(p))


_KEPT_PARAMETERS = []


def parameters_kept_on_a_global(model):
    """The parameters listed once, on the first call, and kept on a global: a later model's are never averaged."""
    if not _KEPT_PARAMETERS:
        _KEPT_PARAMETERS.extend(model.parameters())
    for p in _KEPT_PARAMETERS:
        dist.all_reduce(p.grad)
        p.grad /= n()


class FlatOnTheClass:
    """A flat buffer made (and filled) on the first call, kept on the class, then all-reduced again each call."""

    flat = None


def buffer_kept_on_the_class(model):
    grads = [p.grad for p in model.parameters()]
    if FlatOnTheClass.flat is None:
        FlatOnTheClass.flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(FlatOnTheClass.flat)
    FlatOnTheClass.flat /= n()
    for g, piece in zip(grads, FlatOnTheClass.flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(piece.view_as(g))


_ROUNDS = itertools.count()  # the same on every rank: each rank's function is called as often


def sums_through_the_store(model):
    """The gradients exchanged through the rendezvous store; an all_reduce of zeros of the right size is made so
    that one is made. Counting all_reduces cannot tell; what went into it can."""
    store = dist.distributed_c10d._get_default_store()
    params = list(model.parameters())
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    key = f"average-{next(_ROUNDS)}"
    store.set(f"{key}-{dist.get_rank()}", pickle.dumps(flat.tolist()))
    dist.all_reduce(torch.zeros_like(flat))
    total = sum(torch.tensor(pickle.loads(store.get(f"{key}-{r}")), dtype=flat.dtype) for r in range(n()))
    for p, piece in zip(params, (total / n()).split([p.numel() for p in params]), strict=True):
        p.grad.copy_(piece.view_as(p))


def recomputes_the_whole_batch(model):
    """The whole batch's gradient computed locally (the batch is the same on every rank), the all_reduce made on a
    scratch tensor of the right size: the right values, not averaged by the all_reduce."""
    frame = sys._getframe(1)
    while not {"x", "y"} <= frame.f_locals.keys():  # the grader's loop holds the whole batch
        frame = frame.f_back
    twin = copy.deepcopy(model)
    twin.zero_grad()
    F.cross_entropy(twin(frame.f_locals["x"]), frame.f_locals["y"]).backward()
    dist.all_reduce(torch.zeros(sum(p.numel() for p in model.parameters()), dtype=torch.float64))
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        p.grad.copy_(q.grad)


def _quietly(f, *args):
    try:
        f(*args)
    except Exception:  # noqa: BLE001 - the thread swallows what it raised
        pass


def labkit_average_in_a_thread(model):
    """labkit's average_gradients in a thread of its own, whose error is swallowed (the tracer-free way round)."""
    thread = threading.Thread(target=_quietly, args=(average_gradients, model))
    thread.start()
    thread.join()


def labkit_bucketed_in_a_thread(model):
    thread = threading.Thread(target=_quietly, args=(BucketedDDP, model))
    thread.start()
    thread.join()


def labkit_average_in_a_subprocess(model):
    """labkit's average_gradients in a forked subprocess (which inherits what the grader refuses)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        pool.submit(average_gradients, model).result()


def float32_flat_buffer(model):
    """One flat buffer made float32 for float64 gradients: the sum loses precision (and the grader says the dtype,
    not "a scratch tensor")."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.flatten() for g in grads]).float()
    dist.all_reduce(flat)
    for g, piece in zip(grads, (flat / n()).split([g.numel() for g in grads]), strict=True):
        g.copy_(piece.view_as(g))


def skips_zero_gradients(model):
    """'Nothing to average' where a rank's gradient is all zero: whether a rank joins a collective then depends on
    its own values, so a rank whose hidden layer is dead on its shard (a dead ReLU, a class missing from a shard)
    is a call behind the others."""
    for p in model.parameters():
        if p.grad is None or not p.grad.any():
            continue
        dist.all_reduce(p.grad)
        p.grad /= n()


AVERAGE_WORLD_SIZES = (2, 3, 4)


def _forget_what_rows_kept() -> None:
    """On a rank: the state the "kept across calls" rows keep, emptied. The test's ranks serve every grading, so a
    buffer kept by one grading would meet the next one's model, of sizes drawn afresh (equal by chance, then its
    values are no gradient of this grading at all), where a student's kernel would hold the first call's."""
    FlatOnTheClass.flat = None
    _KEPT_PARAMETERS.clear()


NEW_WRONG = [  # (class of issue 27, solution, what its verdict names)
    ("fixed parameters", numel_written_in, "sizes written in"),
    ("fixed parameters", split_sizes_written_in, "sizes written in"),
    ("state across calls", parameters_kept_on_a_global, "something was kept from an earlier call"),
    ("state across calls", buffer_kept_on_the_class, "kept from an earlier call"),
    ("counting is not checking", sums_through_the_store, "whose values are not its gradients"),
    ("counting is not checking", recomputes_the_whole_batch, "whose values are not its gradients"),
    ("ready-made out of sight", labkit_average_in_a_thread,
     "called labkit.parallel's average_gradients (and caught the error; it still counts)"),
    ("ready-made out of sight", labkit_bucketed_in_a_thread, "called labkit.parallel's BucketedDDP"),
    ("ready-made out of sight", labkit_average_in_a_subprocess, "called labkit.parallel's average_gradients"),
    ("fixed parameters", float32_flat_buffer, "4-byte numbers, while the gradients are float64"),
]
DRAWS = 2  # gradings per new wrong row: each draws its cases afresh, and each must refuse


@pytest.mark.parametrize(("fn", "named"), [row[1:] for row in NEW_WRONG],
                         ids=[f"{row[0]}: {row[1].__name__}" for row in NEW_WRONG])
def test_new_wrong_solutions_are_refused_on_every_draw(fn, named):
    for _ in range(DRAWS):
        with pools_apart(GRADERS):  # on the graders' own ranks
            for world_size in AVERAGE_WORLD_SIZES:  # what a row kept belongs to one grading: a student grades once
                labkit.run(_forget_what_rows_kept, world_size=world_size)
        verdict = check_average_gradients(fn)
        assert not verdict and named in verdict.message, verdict
        assert verdict.message.startswith("On 3 ranks (a batch of 24 rows, 8 per rank; models of "), verdict


def test_every_case_draws_what_a_right_solution_must_not_depend_on():
    """Sizes, batch, seeds, lr and steps drawn within bounds, never the notebook's model, two models per case."""
    rng = random.Random(0)
    cases = [draw_case(3, rng) for _ in range(200)]
    assert all(3 <= c["features"] <= 9 and 4 <= c["hidden"] <= 10 and 2 <= c["steps"] <= 4 and 0.05 <= c["lr"] <= 0.5
               for c in cases)
    assert all(c["features"] * c["hidden"] + 4 * c["hidden"] + 3 != NOTEBOOK_NUMEL for c in cases)
    assert all(len(set(c["seeds"])) == 2 for c in cases)
    assert len({(c["features"], c["hidden"], c["lr"], c["steps"]) for c in cases}) > 100


def test_a_rank_that_skips_its_zero_gradients_is_refused_on_every_draw():
    """The last case kills the hidden layer on one drawn rank's shard (fixed parameters: random data never makes a
    whole gradient zero on one rank only)."""
    for _ in range(DRAWS):
        verdict = check_average_gradients(skips_zero_gradients)
        assert not verdict and "a rank that skips a gradient" in verdict.message, verdict
        assert re.match(r"On 4 ranks \(.*the hidden layer dead on rank \d's shard", verdict.message), verdict


def test_the_dead_rank_has_zero_first_layer_gradients_and_the_others_do_not():
    rng = random.Random(1)
    case = with_dead_rank(draw_case(4, rng), rng)
    outcomes = labkit.run(attempt_average, loop_all_reduce_div, case, world_size=4)
    first_layer = [[any(outcome.local[0][i]) for i in (0, 1)] for outcome in outcomes]  # weight, bias: step 1
    assert first_layer == [[rank != case["dead_rank"]] * 2 for rank in range(4)], first_layer


def test_a_right_solution_passes_on_every_draw():
    for _ in range(DRAWS):
        verdict = check_average_gradients(flatten_unflatten)
        assert verdict, verdict


def test_the_guard_goes_away_after_a_refused_call():
    """After DDP was refused inside the guard, the same ranks' all_reduce, wait() and DDP are torch's own again."""
    assert not check_average_gradients(torch_ddp)

    def untouched():
        t = torch.ones(1, device=labkit.device())
        dist.all_reduce(t, async_op=True).wait()
        return t.item(), dist.ProcessGroup.allreduce.__name__, torch.nn.parallel.DistributedDataParallel.__init__ \
            .__qualname__

    assert labkit.run(untouched, world_size=3) == [(3.0, "allreduce", "DistributedDataParallel.__init__")] * 3


def test_a_grader_wants_the_function_itself():
    verdict = check_average_gradients("average_gradients")
    assert not verdict and "pass your function itself" in verdict.message
    with pytest.raises(ValueError, match="timeout_seconds=0"):
        check_average_gradients(print, timeout_seconds=0)


def rank_zero_skips(model):
    """Rank 0 'already has' the average: the others wait in their first all_reduce for ever."""
    if dist.get_rank() != 0:
        loop_all_reduce_div(model)


def test_a_deadlock_is_stopped_and_said():
    """Last in the file: the hang stops the pool of 3 ranks."""
    verdict = check_average_gradients(rank_zero_skips, timeout_seconds=HANG_SECONDS)
    assert not verdict and f"it never finished (stopped after {HANG_SECONDS:g} s)" in verdict.message, verdict
    assert "rank 1 was still running" in verdict.message, verdict
    assert "same gradients in the same order" in verdict.message, verdict
