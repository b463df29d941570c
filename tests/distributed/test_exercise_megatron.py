"""check_megatron_f_g (notebook 05's exercise) against a catalogue of wrong f and g, each rejected with a message
that names the mistake, and right ones written in different ways, all accepted.

Some wrong ones give the right values (labkit's own f and g, torch.distributed.nn.functional's all_reduce, an
in-place all_reduce without ctx.mark_dirty) or right-looking values by luck of timing (a handle's future taken and
never waited, or only the last of two waited): only the guard catches them, at the process-group level and on the
handles and futures.
"""

import importlib

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as autograd_collectives

import labkit
from labkit.exercises.megatron import check_megatron_f_g
from labkit.exercises.verdict import Verdict
from labkit.parallel import all_reduce_sum, copy_to_tensor_parallel, reduce_from_tensor_parallel

HANG_SECONDS = 2.0  # a deadlocked solution is stopped after this long (a right one takes milliseconds)


@pytest.fixture(scope="module", autouse=True)
def warm_pools():
    """Start the pools of 2 and 3 ranks and import the grader's rank side in them, so that no case's timeout is
    spent starting processes on a loaded machine."""
    for world_size in (2, 3):
        labkit.run(importlib.import_module, "labkit.exercises.megatron_guard", world_size=world_size)


def summed(x):
    """A copy of x, all-reduced (SUM)."""
    y = x.clone()
    dist.all_reduce(y)
    return y


class Same(torch.autograd.Function):
    """Identity both ways: no communication."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class Both(torch.autograd.Function):
    """All-reduce both ways."""

    @staticmethod
    def forward(ctx, x):
        return summed(x)

    @staticmethod
    def backward(ctx, grad):
        return summed(grad)


# ---- right solutions, written differently ----------------------------------------------------------------

class F(torch.autograd.Function):
    """The lesson's f: identity forward, all_reduce of a copy of dX backward."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return summed(grad)


class G(torch.autograd.Function):
    """The lesson's g: all_reduce of a copy forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        return summed(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class FInPlace(torch.autograd.Function):
    """f as Megatron-LM's code writes it: the incoming gradient all-reduced in place, async and waited."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, async_op=True).wait()
        return grad


class GMarkDirty(torch.autograd.Function):
    """g all-reducing its input in place, and telling autograd so (ctx.mark_dirty)."""

    @staticmethod
    def forward(ctx, x):
        all_reduce_sum(x)  # labkit's plain SUM, allowed
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad.clone()


class FSetupContext(torch.autograd.Function):
    """f in torch 2's style: forward without ctx, setup_context apart; the sum built from a list of handles."""

    @staticmethod
    def forward(x):
        return x.detach().clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.world_size = dist.get_world_size()

    @staticmethod
    def backward(ctx, grad):
        total = torch.zeros_like(grad)
        total += grad
        dist.all_reduce(total)
        return total


class FPolledFuture(torch.autograd.Function):
    """f whose backward polls the handle's future until done() says True: no wait, since on CUDA done() is True once
    the all_reduce is queued (torch.futures docs); on gloo it happens to follow the sum."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        total = grad.clone()
        future = dist.all_reduce(total, async_op=True).get_future()
        while not future.done():
            pass
        return total


class GPolled(torch.autograd.Function):
    """g whose forward polls the handle's is_completed() until it says True, instead of wait()."""

    @staticmethod
    def forward(ctx, x):
        total = x.clone()
        handle = dist.all_reduce(total, async_op=True)
        while not handle.is_completed():
            pass
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad


class GFutureValue(torch.autograd.Function):
    """g returning what the handle's future waited for: the all-reduced copy."""

    @staticmethod
    def forward(ctx, x):
        return dist.all_reduce(x.clone(), async_op=True).get_future().wait()[0]

    @staticmethod
    def backward(ctx, grad):
        return grad


class GProcessGroup(torch.autograd.Function):
    """g through the process group's own allreduce with its default options (op SUM), its handle waited: right,
    though no ReduceOp is spelled (a grader that read the op from absent options refused it as ReduceOp.None)."""

    @staticmethod
    def forward(ctx, x):
        total = x.clone()
        dist.group.WORLD.allreduce([total]).wait()
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad


@pytest.mark.parametrize(("f", "g"), [(F, G), (FInPlace, GMarkDirty), (FSetupContext, G), (F, GPolled),
                                      (F, GFutureValue), (F, GProcessGroup)])
def test_right_solutions_pass_and_say_what_was_checked(f, g):
    verdict = check_megatron_f_g(f, g, record=False)
    assert verdict and isinstance(verdict, Verdict), verdict
    assert "equal one process's whole MLP" in verdict.message, verdict
    assert "one all_reduce in the forward (your g) and one in the backward (your f)" in verdict.message, verdict


# ---- wrong solutions: each rejected, naming its mistake ----------------------------------------------------

class FDividing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return summed(grad) / dist.get_world_size()


class GAverage(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.AVG)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad


class GInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        dist.all_reduce(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class GInPlaceReturned(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class FAsyncNoWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        total = grad.clone()
        dist.all_reduce(total, async_op=True)
        return total


class FFutureNoWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        total = grad.clone()
        dist.all_reduce(total, async_op=True).get_future()
        return total


class GHalvesLastFutureWaited(torch.autograd.Function):
    """Two all_reduces, one per half of the copy, and only the second half's future waited."""

    @staticmethod
    def forward(ctx, x):
        total = x.clone()
        futures = [dist.all_reduce(half, async_op=True).get_future() for half in total.view(-1).chunk(2)]
        futures[-1].wait()
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad


class FNone(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        summed(grad)
        return None


class GNone(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return summed(x)

    @staticmethod
    def backward(ctx, grad):
        return None


class LabkitF(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        with torch.enable_grad():
            tracked = grad.detach().requires_grad_()
            copy_to_tensor_parallel(tracked).sum().backward()
        return tracked.grad


class LabkitG(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return reduce_from_tensor_parallel(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class AutogradCollectiveG(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return autograd_collectives.all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class Stub(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        raise NotImplementedError("your turn")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("your turn")


@pytest.mark.parametrize(("f", "g", "named"), [
    (G, F, "your f and g are swapped"),
    (Both, Both, "both all-reduce in both directions"),
    (Same, G, "your f's backward made no all_reduce: each rank's dX comes only from its own hidden features"),
    (F, Same, "your g's forward made no all_reduce: each rank returned its own partial sum"),
    (F, Both, "your g's backward all-reduced the gradient"),
    (FDividing, G, "X's gradient is the right one divided by N = 2: an average over the ranks, not their sum"),
    (F, GAverage, "called dist.all_reduce with ReduceOp.AVG"),
    (F, GInPlace, "your g's forward changed its input in place"),
    (F, GInPlaceReturned, "your g's forward changed its input in place"),
    (FAsyncNoWait, G, "your f's backward started an all_reduce with async_op=True and returned without calling wait()"),
    (FFutureNoWait, G, "your f's backward started an all_reduce with async_op=True, took its future "
                       "(handle.get_future()) and returned without waiting for it"),
    (FPolledFuture, G, "A loop on the future's done(), or reading its value(), is no wait either"),
    (F, GHalvesLastFutureWaited, "your g's forward started an all_reduce with async_op=True, took its future "
                                 "(handle.get_future()) and returned without waiting for it"),
    (FNone, G, "X got no gradient: your f's backward returned None"),
    (F, GNone, "your g, whose backward returned None"),
    (F, LabkitG, "called labkit.parallel's reduce_from_tensor_parallel"),
    (LabkitF, G, "called labkit.parallel's CopyToTensorParallel.backward"),
    (F, AutogradCollectiveG, "called torch.distributed.nn.functional's"),
    (Stub, Stub, "Part of your f or g is still the stub"),
])
def test_wrong_solutions_are_rejected_naming_the_mistake(f, g, named):
    verdict = check_megatron_f_g(f, g, record=False)
    assert not verdict and named in verdict.message, verdict
    assert verdict.message.startswith("On 2 ranks (the MLP's 12 hidden features split 6 per rank), "), verdict


def test_the_guard_goes_away_after_a_refused_call():
    """After labkit's g was refused inside the guard, the same ranks' all_reduce and wait() are torch's own again,
    and labkit's g works."""
    assert not check_megatron_f_g(F, LabkitG, record=False)

    def untouched():
        t = torch.ones(1, device=labkit.device(), requires_grad=True)
        dist.all_reduce(t.detach().clone(), async_op=True).wait()
        return reduce_from_tensor_parallel(t).item(), dist.ProcessGroup.allreduce.__name__, dist.Work.wait.__name__

    assert labkit.run(untouched, world_size=2) == [(2.0, "allreduce", "wait")] * 2


def test_the_grader_wants_the_classes_themselves():
    verdict = check_megatron_f_g(F, G.apply, record=False)
    assert not verdict and "pass your two classes themselves" in verdict.message, verdict
    with pytest.raises(ValueError, match="timeout_seconds=0"):
        check_megatron_f_g(F, G, timeout_seconds=0, record=False)


class GRankZeroOnly(torch.autograd.Function):
    """Rank 0 all-reduces; the others think their partial sum is enough: rank 0 waits for ever."""

    @staticmethod
    def forward(ctx, x):
        return summed(x) if dist.get_rank() == 0 else x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_a_deadlock_is_stopped_and_said():
    """Last in the file: the hang stops the pool of 2 ranks."""
    verdict = check_megatron_f_g(F, GRankZeroOnly, timeout_seconds=HANG_SECONDS, record=False)
    assert not verdict and f"it never finished (stopped after {HANG_SECONDS:g} s)" in verdict.message, verdict
    assert "rank 0" in verdict.message, verdict
