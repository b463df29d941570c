"""check_megatron_f_g (notebook 05's exercise) against a catalogue of wrong f and g, each rejected with a message
that names the mistake, and right ones written in different ways, all accepted.

Some wrong ones give the right values (labkit's own f and g, torch.distributed.nn.functional's all_reduce, an
in-place all_reduce without ctx.mark_dirty) or right-looking values by luck of timing (a handle's future taken and
never waited, or only the last of two waited): only the guard catches them, at the process-group level and on the
handles and futures.
"""

import concurrent.futures
import importlib
import random
import re
import threading

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as autograd_collectives

import labkit
from labkit.exercises._kit._runner import GRADERS
from labkit.exercises.megatron import WORLD_SIZES, check_megatron_f_g, draw_cases
from labkit.exercises.verdict import Verdict
from labkit.launch import pools_apart
from labkit.parallel import all_reduce_sum, copy_to_tensor_parallel, reduce_from_tensor_parallel

HANG_SECONDS = 2.0  # a deadlocked solution is stopped after this long (a right one takes milliseconds)


@pytest.fixture(scope="module", autouse=True)
def warm_pools():
    """Start the pools of 2, 3 and 4 ranks and import the grader's rank side in them, so that no case's timeout is
    spent starting processes on a loaded machine."""
    with pools_apart(GRADERS):  # the graders' own ranks, apart from the student's
        for world_size in WORLD_SIZES:
            labkit.run(importlib.import_module, "labkit.exercises.megatron", world_size=world_size)


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


class FSummedInFloat64(torch.autograd.Function):
    """f whose backward sums in float64 whatever the gradient's dtype, and hands back the gradient's own dtype."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        total = grad.to(torch.float64)
        dist.all_reduce(total)
        return total.to(grad.dtype)


class GEmptyLike(torch.autograd.Function):
    """g into a buffer made like its input (torch.empty_like), filled, then summed; it counts its calls on the
    class, which keeps no result."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        GEmptyLike.calls += 1
        total = torch.empty_like(x)
        total.copy_(x)
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad


@pytest.mark.parametrize(("f", "g"), [(F, G), (FInPlace, GMarkDirty), (FSetupContext, G), (F, GPolled),
                                      (F, GFutureValue), (F, GProcessGroup), (FSummedInFloat64, GEmptyLike)])
def test_right_solutions_pass_and_say_what_was_checked(f, g):
    verdict = check_megatron_f_g(f, g, record=False)
    assert verdict and isinstance(verdict, Verdict), verdict
    assert "equal one process's whole MLP" in verdict.message, verdict
    assert "one all_reduce in the forward (your g) and one in the backward (your f)" in verdict.message, verdict
    assert "float32" in verdict.message and "float64" in verdict.message, verdict


def test_every_grading_draws_both_dtypes_two_world_sizes_and_two_token_counts():
    """Fixed parameters would let a hard-coded solution pass: each grading has a float32 and a float64 case, two
    world sizes and two token counts, so a buffer of a fixed dtype, sizes or rank count fails one of them."""
    rng, draws = random.Random(27), set()
    for _ in range(200):
        (n1, s1), (n2, s2) = ((case.world_size, case["sizes"]) for case in draw_cases(rng))
        assert n1 != n2 and {s1.dtype, s2.dtype} == {torch.float32, torch.float64} and s1.batch != s2.batch
        assert s1.hidden >= 2 * n1 and s2.hidden >= 2 * n2 and len(set(s1.seeds)) == len(s1.seeds) >= 2
        draws.add((n1, s1.batch, s1.width, s1.hidden, s1.dtype))
    assert len(draws) > 100  # drawn, not a handful of fixed cases


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


class GFloat64Buffer(torch.autograd.Function):
    """g summing into a float64 buffer: right in a float64 case, a float64 output in a float32 one."""

    @staticmethod
    def forward(ctx, x):
        total = torch.zeros(x.shape, dtype=torch.float64)
        total += x
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad


class GFloat32Buffer(torch.autograd.Function):
    """g summing into torch.zeros' default dtype, float32."""

    @staticmethod
    def forward(ctx, x):
        total = torch.zeros(x.shape)
        total += x
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad


class FFloat32Buffer(torch.autograd.Function):
    """f's backward summing into a float32 buffer: autograd casts it back to float64, rounded."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        total = torch.zeros(grad.shape)
        total += grad
        dist.all_reduce(total)
        return total


class GFixedSizes(torch.autograd.Function):
    """g summing into a buffer of the sizes a first try had: 5 tokens of 6 features."""

    @staticmethod
    def forward(ctx, x):
        total = torch.zeros(5, 6, dtype=x.dtype)
        total += x
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad


_CACHE: dict = {}  # what FCachedInAGlobal keeps between calls, on each rank


def forget_the_caches() -> None:
    """On a rank: as in a fresh kernel, the caching operators have kept nothing yet."""
    _CACHE.clear()
    GCachedOnTheClass.first = None


class GCachedOnTheClass(torch.autograd.Function):
    """g that sums every time but returns the first call's sum, kept on the class."""

    first = None

    @staticmethod
    def forward(ctx, x):
        total = summed(x)
        if GCachedOnTheClass.first is None:
            GCachedOnTheClass.first = total
        return GCachedOnTheClass.first.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


class FCachedInAGlobal(torch.autograd.Function):
    """f whose backward sums once and keeps the sum in a global, 'to save the all_reduce' on later calls."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        if "dx" not in _CACHE:
            _CACHE["dx"] = summed(grad)
        return _CACHE["dx"].clone()


class GReducesBeforeFilling(torch.autograd.Function):
    """g that all-reduces its buffer before filling it: one all_reduce made, of zeros."""

    @staticmethod
    def forward(ctx, x):
        total = torch.zeros_like(x)
        dist.all_reduce(total)
        total += x
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad


class FReducesSavedInput(torch.autograd.Function):
    """f whose backward sums the input it saved in the forward instead of the gradient."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return summed(x) * 0 + grad


class GReturnsItsInput(torch.autograd.Function):
    """g that sums a copy and returns its input."""

    @staticmethod
    def forward(ctx, x):
        summed(x)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


class GLabkitInAThread(torch.autograd.Function):
    """labkit's g run in a worker thread, out of the call stack's sight."""

    @staticmethod
    def forward(ctx, x):
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(reduce_from_tensor_parallel, x.detach()).result()

    @staticmethod
    def backward(ctx, grad):
        return grad


class FLabkitInAThreadCaught(torch.autograd.Function):
    """labkit's f backward tried in a thread, its error swallowed, then the sum made by hand."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        def try_labkit():
            try:
                with torch.enable_grad():
                    tracked = grad.detach().requires_grad_()
                    copy_to_tensor_parallel(tracked).sum().backward()
            except Exception:  # noqa: BLE001 - a student who swallows every error
                pass

        worker = threading.Thread(target=try_labkit)
        worker.start()
        worker.join()
        return summed(grad)


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
    (FDividing, G, "X's gradient is the right one divided by N = "),
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
    (LabkitF, G, "called labkit.parallel's copy_to_tensor_parallel"),
    (F, AutogradCollectiveG, "called torch.distributed.nn.functional's"),
    (Stub, Stub, "Part of your f or g is still the stub"),
    # fixed parameters: each grading has a float32 and a float64 case, and two token counts
    (F, GFloat64Buffer, "your g's forward returned a tensor of dtype torch.float64 for an input of dtype "
                        "torch.float32: a buffer made with a fixed dtype"),
    (F, GFloat32Buffer, "your g's forward returned a tensor of dtype torch.float32 for an input of dtype "
                        "torch.float64: a buffer made with a fixed dtype"),
    (FFloat32Buffer, G, "float32's precision, in a float64 case: a buffer in float32"),
    (F, GFixedSizes, "draws new sizes for each case: a buffer of fixed sizes"),
    # state across calls: the block is called twice per case, on other inputs
    (F, GCachedOnTheClass, "the output Z is the previous call's, computed from other inputs: your f or g kept a "
                           "result from an earlier call"),
    (FCachedInAGlobal, G, "your f's backward made no all_reduce in call 2 of the block, where call 1 made one: it "
                          "kept a result from an earlier call"),
    # counting is not checking: what each all_reduce summed
    (F, GReducesBeforeFilling, "your g's forward all-reduced a tensor of zeros, not the partial sum it received"),
    (FReducesSavedInput, G, "your f's backward all-reduced something other than the gradient it received"),
    (F, GReturnsItsInput, "your g's forward all-reduced a copy of the partial sum it received, but returned the "
                          "partial sum itself, not the sum"),
    # ready-made helpers out of the call stack's sight
    (F, GLabkitInAThread, "called labkit.parallel's reduce_from_tensor_parallel"),
    (FLabkitInAThreadCaught, G, "called labkit.parallel's copy_to_tensor_parallel (and caught the error; it still "
                                "counts)"),
])
def test_wrong_solutions_are_rejected_naming_the_mistake(f, g, named):
    with pools_apart(GRADERS):  # on the graders' own ranks
        for world_size in WORLD_SIZES:
            labkit.run(forget_the_caches, world_size=world_size)
    verdict = check_megatron_f_g(f, g, record=False)
    assert not verdict and named in verdict.message, verdict
    assert re.match(r"On [234] ranks \(the MLP's \d+ hidden features split [\d+]+; float(32|64), \d+ tokens of \d+ "
                    r"features\), ", verdict.message), verdict


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
