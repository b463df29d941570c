"""On a rank, while check_bucketed_ddp_hook grades notebook 04's exercise: the training runs (torch's DDP and the
student's hooks), the guard, and what they left behind.

Each rank builds the same small model (`hook_model`, seeded the same everywhere), takes its own equal shard of one
batch (`labkit.exercises.average_guard.average_batch`) and trains a few SGD steps. `ddp_reference` does it with
torch's DistributedDataParallel; `attempt_hook` with the student's `attach(model, bucket_nbytes)`, which registers
hooks and returns `finish`, called after each backward(). While the student's code runs (attach, every backward,
every finish), a `HookGuard` is on: an `AverageGuard` (every all_reduce recorded where the process group receives
it, the ready-made averages and every other collective refused, the ranks' all_reduces checked to be in step),
and on top of it, for each all_reduce, whether loss.backward() was still running when it started and when its
handle was waited, and which hooks attach registered on the parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import labkit
from labkit.exercises.average_guard import BATCH, AverageGuard, average_batch, sgd_step
from labkit.models import mlp

__all__ = ["BUCKET_NBYTES", "STEPS", "HookGuard", "HookOutcome", "Launch", "attempt_hook", "ddp_reference",
           "hook_model", "last_hook_attempt", "one_process_run"]

STEPS = 2  # the second step shows a finish() that does not start afresh
BUCKET_NBYTES = 480  # 60 float64 gradients: buckets of 99, 72 and a last partial 56 of the model's 227
_MiB = 2 ** 20  # torch DDP's bucket_cap_mb counts MiB


def hook_model(device=None) -> torch.nn.Module:
    """The graded model: 6 features, three hidden layers of 8, 3 classes (8 parameter tensors, 227 numbers),
    float64 so that float error stays far below any mistake, seeded: the same on every rank."""
    return mlp(features=6, hidden=8, classes=3, layers=3, seed=0, dtype=torch.float64).to(device)


def _shard() -> slice:
    """This rank's rows of the batch: [r B/N, (r + 1) B/N)."""
    return slice(labkit.rank() * BATCH // labkit.world_size(), (labkit.rank() + 1) * BATCH // labkit.world_size())


def _grads(model: torch.nn.Module) -> list[list[float]]:
    return [p.grad.flatten().tolist() if p.grad is not None else [] for p in model.parameters()]


def _weights(model: torch.nn.Module) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in model.parameters()]


def one_process_run() -> tuple[list[list[list[float]]], list[list[float]]]:
    """One process trained on the whole batch: each step's gradients, and the parameters at the end."""
    model, (x, y) = hook_model(), average_batch()
    grads = []
    for _ in range(STEPS):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        grads.append(_grads(model))
        sgd_step(model)
    return grads, _weights(model)


def ddp_reference() -> tuple[list[list[list[float]]], list[list[float]]]:
    """On a rank: the same training under torch's DistributedDataParallel (buckets of at most BUCKET_NBYTES):
    each step's averaged gradients, and the parameters at the end. No guard: it is the grader's own run."""
    model = torch.nn.parallel.DistributedDataParallel(hook_model(labkit.device()), bucket_cap_mb=BUCKET_NBYTES / _MiB)
    x, y = average_batch(labkit.device())
    grads = []
    for _ in range(STEPS):
        model.zero_grad()
        F.cross_entropy(model(x[_shard()]), y[_shard()]).backward()
        grads.append(_grads(model.module))
        sgd_step(model.module)
    return grads, _weights(model.module)


@dataclass
class Launch:
    """One all_reduce the student's code started: at which step, of how many elements, whether loss.backward()
    was still running when it started, and whether its handle was waited while the backward still ran (a
    blocking all_reduce waits at once)."""

    step: int
    numel: int
    in_backward: bool
    waited_in_backward: bool = False


class HookGuard(AverageGuard):
    """An AverageGuard (all_reduce recorded, everything else refused) that also knows, for each all_reduce, whether
    loss.backward() was running when it started and when it was waited, and which hooks went on the parameters.
    The grader's loop sets `in_backward` around loss.backward() and `step` before each step."""

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        self.step, self.in_backward = 0, False
        self.launches: list[Launch] = []
        self.hooks = {"register_post_accumulate_grad_hook": 0, "register_hook": 0}  # calls on the parameters
        self._handles: list[tuple[object, Launch]] = []
        self._parameters = {id(p) for p in model.parameters()}

    def __enter__(self) -> HookGuard:
        super().__enter__()
        try:
            self._time_allreduce()
            self._time_wait()
            for name in self.hooks:
                self._count_hooks(name)
        except BaseException:
            self._restore()
            raise
        return self

    def _time_allreduce(self) -> None:
        """On top of AverageGuard's recording: note the step and whether the backward is running."""
        import torch.distributed as dist

        below = dist.ProcessGroup.allreduce

        def timed(group, tensors, *args, **kwargs):
            tensor = tensors[0] if isinstance(tensors, list | tuple) else tensors
            options = args[0] if args else kwargs.get("opts")
            launch = Launch(self.step, tensor.numel(), self.in_backward,
                            waited_in_backward=self.in_backward and not getattr(options, "asyncOp", True))
            self.launches.append(launch)
            work = below(group, tensors, *args, **kwargs)
            self._handles.append((work, launch))
            return work

        self._saved.append((dist.ProcessGroup, "allreduce", below))
        dist.ProcessGroup.allreduce = timed

    def _time_wait(self) -> None:
        """Note a student's handle waited while the backward is still running."""
        import torch.distributed as dist

        below = dist.Work.wait

        def timed(work, *args, **kwargs):
            for handle, launch in self._handles:
                launch.waited_in_backward = launch.waited_in_backward or (handle is work and self.in_backward)
            return below(work, *args, **kwargs)

        self._saved.append((dist.Work, "wait", below))
        dist.Work.wait = timed

    def _count_hooks(self, name: str) -> None:
        """Count torch.Tensor.<name> calls on the model's parameters (the grader registered its own before)."""
        below = getattr(torch.Tensor, name)

        def counted(tensor, *args, **kwargs):
            if id(tensor) in self._parameters:
                self.hooks[name] += 1
            return below(tensor, *args, **kwargs)

        self._saved.append((torch.Tensor, name, vars(torch.Tensor)[name]))
        setattr(torch.Tensor, name, counted)


@dataclass
class HookOutcome:
    """What one rank's training with the student's hooks left behind: per step, the order in which the gradients
    became ready (parameter indices), the rank's own gradients and what finish() left in .grad; the parameters at
    the end; every all_reduce started (`launches`) and how many were never waited; the hooks attach registered,
    what it called that is switched off, and what it returned when that was not a function."""

    order: list[list[int]] = field(default_factory=list)
    local: list[list[list[float]]] = field(default_factory=list)
    averaged: list[list[list[float]]] = field(default_factory=list)
    final: list[list[float]] = field(default_factory=list)
    launches: list[Launch] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    unwaited: int = 0
    hooks: dict = field(default_factory=dict)
    forbidden: list[str] = field(default_factory=list)
    returned: str | None = None


_last: dict = {}  # on a rank: the hooks and all_reduce sizes of the last attempt, for a run that raised


def attempt_hook(attach) -> HookOutcome:
    """On a rank: finish = attach(model, BUCKET_NBYTES), then STEPS SGD steps on this rank's shard, each
    zero_grad, forward, backward (the student's hooks fire), finish(), step; under a HookGuard throughout."""
    model, twin = hook_model(labkit.device()), hook_model(labkit.device())
    outcome = HookOutcome()
    for index, p in enumerate(model.parameters()):  # before the student's, so it sees each gradient first
        p.register_post_accumulate_grad_hook(lambda _, index=index: outcome.order[-1].append(index))
    guard = HookGuard(model)
    try:
        with guard:
            finish = attach(model, BUCKET_NBYTES)
            if callable(finish):
                _train(model, twin, finish, guard, outcome)
            else:
                outcome.returned = "None" if finish is None else f"a {type(finish).__name__}"
            outcome.unwaited = len(guard.unwaited())
    finally:
        _last.clear()
        _last.update(hooks=dict(guard.hooks), numels=[launch.numel for launch in guard.launches])
    outcome.final, outcome.launches, outcome.hooks = _weights(model), guard.launches, guard.hooks
    outcome.ops, outcome.forbidden = [call.op for call in guard.calls], guard.forbidden
    return outcome


def _train(model, twin, finish, guard: HookGuard, outcome: HookOutcome) -> None:
    """The grader's loop, with the backward marked on the guard; the rank's own gradient from an unhooked twin."""
    x, y = average_batch(labkit.device())
    mine = _shard()
    for step in range(STEPS):
        twin.load_state_dict(model.state_dict())
        twin.zero_grad()
        F.cross_entropy(twin(x[mine]), y[mine]).backward()
        outcome.local.append(_grads(twin))
        model.zero_grad()
        loss = F.cross_entropy(model(x[mine]), y[mine])
        outcome.order.append([])
        guard.step, guard.in_backward = step, True
        try:
            loss.backward()
        finally:
            guard.in_backward = False
        finish()
        outcome.averaged.append(_grads(model))
        sgd_step(model)


def last_hook_attempt() -> dict:
    """On a rank: the hooks attach registered and the sizes of the all_reduces of the last attempt, when it raised
    instead of returning them: {"hooks": {...}, "numels": [...]}."""
    return dict(_last)
