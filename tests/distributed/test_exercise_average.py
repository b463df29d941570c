"""check_average_gradients (notebook 01's exercise) against a catalogue of wrong solutions, each rejected with a
message that names the mistake, and right solutions written in different ways, all accepted.

Several wrong ones give the right values (labkit's average_gradients, BucketedDDP, torch's DDP) or right-looking
values by luck of timing (async_op=True without wait(), or with only the last handle or future waited, or a
future taken and never waited): only the guard catches them, at the process-group level and on the handles and
futures.
"""

import importlib
import re

import pytest
import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import labkit
from labkit.exercises import Verdict, check_average_gradients
from labkit.parallel import BucketedDDP, all_reduce_sum, average_gradients

HANG_SECONDS = 2.0  # a deadlocked solution is stopped after this long (a right one takes milliseconds per step)


@pytest.fixture(scope="module", autouse=True)
def warm_pools():
    """Start the pools of 2, 3 and 4 ranks and import the grader's rank side in them, so that no case's timeout
    is spent starting processes on a loaded machine."""
    for world_size in (2, 3, 4):
        labkit.run(importlib.import_module, "labkit.exercises.average_guard", world_size=world_size)


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


@pytest.mark.parametrize("fn", [loop_all_reduce_div, flatten_unflatten, cat_and_split, async_handles_waited,
                                polled_until_completed, futures_chained_and_waited, labkit_sum_then_divide,
                                process_group_default_options])
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
