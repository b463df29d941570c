"""On a rank, while check_average_gradients grades notebook 01's exercise: the training run, the guard, and what
the student's function left behind.

Each rank builds the same small model (`labkit.models.mlp`, seeded the same everywhere), takes its own equal
shard of one batch (`average_batch`) and trains a few SGD steps, calling the student's `fn(model)` between
backward() and step(). While `fn` runs, an `AverageGuard` is on: every all_reduce is recorded where the process
group receives it (ProcessGroup.allreduce: what it reduced, with which op, and whether the student's code waited
for it, through its handle or its future: `WaitWatch`), everything else that communicates raises
`ForbiddenCall`, and so do the ready-made averages: torch's DistributedDataParallel and labkit.parallel's
average_gradients and BucketedDDP (found on the call stack, so an import made before the grader ran is caught
too).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

import labkit
from labkit.exercises._kit._group_call import GroupCall, Kind, wrap_group_method
from labkit.exercises.guard import Guard
from labkit.exercises.wait_watch import FUTURE_POLLS, WaitWatch, watch_waits
from labkit.models import mlp

__all__ = ["BATCH", "FUTURE_POLLS", "LR", "STEPS", "AverageGuard", "AverageOutcome", "OutOfStep", "Reduction",
           "attempt_average", "average_batch", "average_model", "calls_of_last_average", "ready_made_caller",
           "reference_run", "sgd_step", "WaitWatch", "watch_waits"]

BATCH, STEPS, LR = 24, 3, 0.1  # 24 rows: 2, 3 and 4 ranks all get equal shards
_KEY = 10 ** 9  # _check_in_step's key: (gradient's index + 1) x _KEY + numel, exact in float64
_READY_MADE = Path(labkit.__file__).parent / "parallel" / "data.py"  # average_gradients, BucketedDDP


def average_model(device=None) -> torch.nn.Module:
    """The graded model: 6 features, one hidden layer of 8, 3 classes, float64 (so float error stays far below
    any mistake), seeded: the same on every rank."""
    return mlp(features=6, hidden=8, classes=3, layers=1, seed=0, dtype=torch.float64).to(device)


def average_batch(device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch (x, y), the same on every rank; rank r of N trains on rows [r B/N, (r + 1) B/N)."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(BATCH, 6, generator=generator, dtype=torch.float64)
    return x.to(device), torch.randint(0, 3, (BATCH,), generator=generator).to(device)


def reference_run() -> tuple[list[list[list[float]]], list[list[float]]]:
    """One process trained on the whole batch: each step's gradients, and the parameters at the end."""
    model, (x, y) = average_model(), average_batch()
    grads = []
    for _ in range(STEPS):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        grads.append([p.grad.flatten().tolist() for p in model.parameters()])
        sgd_step(model)
    return grads, [p.detach().flatten().tolist() for p in model.parameters()]


def sgd_step(model: torch.nn.Module) -> None:
    """p -= LR x p.grad for every parameter: torch.optim.SGD's step without momentum, written out because building
    a torch optimizer imports torch._dynamo, seconds of CPU in every rank."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= LR * p.grad


@dataclass
class Reduction:
    """One all_reduce the student's function made: on what (`target`: "grad" when its memory is a gradient's,
    "data" when a parameter's own values, else "buffer"), how many elements, which op, and whether its work
    handle was waited (an all_reduce without async_op waits itself) and whether its future was taken
    (handle.get_future())."""

    target: str
    numel: int
    op: str
    waited: bool = False
    future: bool = False
    called_by: str | None = None  # the ready-made average on the call stack, if any


class AverageGuard(Guard):
    """While the student's fn(model) runs on a rank: all_reduce recorded, its work handles watched, everything
    else that communicates refused, and the ready-made averages (DDP, labkit.parallel's) refused."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.calls: list[Reduction] = []
        self._works: list[tuple[object, Reduction]] = []
        self._memory = {"grad": _pointers(p.grad for p in model.parameters()),
                        "data": _pointers(p for p in model.parameters())}
        named = list(model.named_parameters())
        self._names = [name for name, _ in named]
        self._index = {p.grad.untyped_storage().data_ptr(): i for i, (_, p) in enumerate(named) if p.grad is not None}

    def install(self) -> None:
        """All_reduce recorded and watched; everything else, and DDP, refused."""
        self.switch_off_torch_distributed(allowed=("all_reduce", "allreduce", "barrier"), point_to_point=False)
        self.switch_off(torch.nn.parallel.DistributedDataParallel, "__init__",
                        "torch.nn.parallel.DistributedDataParallel")
        self._record_allreduce()
        watch_waits(self._works, self)

    def refuse(self, spelling: str):
        """As Guard.refuse, naming labkit.parallel's ready-made average when that is what made the call."""
        ready_made = ready_made_caller()
        return super().refuse(f"labkit.parallel's {ready_made}" if ready_made else spelling)

    def unwaited(self) -> list[Reduction]:
        """The all_reduces whose handle nobody waited for; they are waited for now, so the ranks stay in step."""
        left = [(work, call) for work, call in self._works if not call.waited]
        for work, _ in left:
            _original_wait(work)
        return [call for _, call in left]

    def _record_allreduce(self) -> None:
        def recorded(made: GroupCall):
            ready_made = ready_made_caller()
            if ready_made:
                self.refuse(f"labkit.parallel's {ready_made}")
            tensor = made.tensor
            call = Reduction(self._target(tensor), tensor.numel(), made.reduce_op,
                             waited=not made.asynchronous)  # a blocking all_reduce waits itself
            self.calls.append(call)
            self._check_in_step(made.original, made.group, tensor)
            work = made.proceed()
            self._works.append((work, call))
            return work

        wrap_group_method(self, Kind.ALLREDUCE, recorded)

    def _check_in_step(self, allreduce, group, tensor: torch.Tensor) -> None:
        """Before each all_reduce, agree with the other ranks on what it reduces (a tiny all_reduce MAX of
        [size, gradient's index] and their negatives): ranks that reduce different gradients at the same moment
        raise OutOfStep here, which names both, instead of gloo summing unrelated tensors or aborting."""
        import torch.distributed as dist

        mine = (self._index.get(tensor.untyped_storage().data_ptr(), -1) + 1) * _KEY + tensor.numel()
        both = torch.tensor([mine, -mine], dtype=torch.float64, device=labkit.device())
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        _original_wait(allreduce(group, [both], options))
        largest, smallest = int(both[0]), -int(both[1])
        if largest == smallest:
            return
        raise OutOfStep(f"rank {labkit.rank()} all-reduced {self._describe(mine)} while another rank "
                        f"all-reduced {self._describe(smallest if mine == largest else largest)} at the same moment")

    def _describe(self, key: int) -> str:
        """What a key of _check_in_step names: a gradient (by its parameter's name) or another tensor."""
        index, numel = divmod(key, _KEY)
        return f"the gradient of {self._names[index - 1]} ({numel} elements)" if index else \
            f"a tensor of {numel} elements"

    def _target(self, tensor: torch.Tensor) -> str:
        pointer = tensor.untyped_storage().data_ptr()
        return next((kind for kind, pointers in self._memory.items() if pointer in pointers), "buffer")


class OutOfStep(RuntimeError):
    """Raised on every rank when the ranks' all_reduces at one moment reduce different gradients."""


def _original_wait(work) -> None:
    import torch.distributed as dist

    vars(dist.Work)["wait"](work)


def _pointers(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t is not None}


def ready_made_caller() -> str | None:
    """The ready-made average on the call stack (average_gradients, BucketedDDP.__init__, ...), or None."""
    frame, found = sys._getframe(1), None
    while frame is not None:
        if Path(frame.f_code.co_filename) == _READY_MADE:
            found = frame.f_code.co_qualname  # the outermost one: what the student called
        frame = frame.f_back
    return found


@dataclass
class AverageOutcome:
    """What one rank's training left behind: per step, its own gradients before fn and what fn left in .grad;
    the parameters at the end; every all_reduce fn made, those never waited for, and what it called that is
    switched off."""

    local: list[list[list[float]]] = field(default_factory=list)
    averaged: list[list[list[float]]] = field(default_factory=list)
    final: list[list[float]] = field(default_factory=list)
    calls: list[Reduction] = field(default_factory=list)
    unwaited: list[Reduction] = field(default_factory=list)
    forbidden: list[str] = field(default_factory=list)


_last_calls: list[Reduction] = []  # on a rank: the all_reduces of the last graded step


def attempt_average(fn) -> AverageOutcome:
    """On a rank: train STEPS SGD steps on this rank's shard, calling fn(model) under the guard after each
    backward; what happened, for the grader."""
    model, (x, y) = average_model(labkit.device()), average_batch(labkit.device())
    rows = slice(labkit.rank() * BATCH // labkit.world_size(), (labkit.rank() + 1) * BATCH // labkit.world_size())
    outcome = AverageOutcome()
    for _ in range(STEPS):
        model.zero_grad()
        F.cross_entropy(model(x[rows]), y[rows]).backward()
        outcome.local.append(_grads(model))
        _graded_call(fn, model, outcome)
        outcome.averaged.append(_grads(model))
        sgd_step(model)
    outcome.final = [p.detach().flatten().tolist() for p in model.parameters()]
    return outcome


def _graded_call(fn, model: torch.nn.Module, outcome: AverageOutcome) -> None:
    """fn(model) under an AverageGuard; its all_reduces (and those left unwaited, then waited) into outcome."""
    guard = AverageGuard(model)
    try:
        with guard:
            fn(model)
    finally:
        _last_calls.clear()
        _last_calls.extend(outcome.calls + guard.calls)
    outcome.calls.extend(guard.calls)
    outcome.unwaited.extend(guard.unwaited())
    outcome.forbidden.extend(guard.forbidden)


def _grads(model: torch.nn.Module) -> list[list[float]]:
    return [p.grad.flatten().tolist() if p.grad is not None else [] for p in model.parameters()]


def calls_of_last_average() -> list[int]:
    """On a rank: the sizes of the all_reduces of the last graded run, when it raised instead of returning them."""
    return [call.numel for call in _last_calls]
