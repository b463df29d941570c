"""On a rank, while check_bucketed_ddp_hook grades notebook 04's exercise: the training runs (torch's DDP and the
student's hooks), the guard, and what they left behind.

Each rank builds the same small model (`hook_model`, seeded the same everywhere), takes its own equal shard of one
batch (`labkit.exercises.average_guard.average_batch`) and trains a few SGD steps. `ddp_reference` does it with
torch's DistributedDataParallel; `attempt_hook` with the student's `attach(model, bucket_nbytes)`, which registers
hooks and returns `finish`, called after each backward(). While the student's code runs (attach, every backward,
every finish), a `HookGuard` is on: an `AverageGuard` (every all_reduce recorded where the process group receives
it, the ready-made averages and every other collective refused, the ranks' all_reduces checked to be in step),
and on top of it, for each all_reduce, whether loss.backward() was still running when it started and how many of
the step's gradients were ready then; every wait for a handle while the backward ran, however it was spelled
(handle.wait(), handle.get_future().wait(), a loop on handle.is_completed() or on the future's done(), a
dist.barrier(), ...); a handle used again in a later step; and which hooks attach registered on the parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import labkit
from labkit.exercises._kit._group_call import GroupCall, Kind, wrap_group_method
from labkit.exercises.average_guard import BATCH, AverageGuard, average_batch, sgd_step
from labkit.models import mlp

__all__ = ["BUCKET_NBYTES", "EXACT_BUCKET_NBYTES", "STEPS", "HookGuard", "HookOutcome", "Launch", "attempt_hook",
           "ddp_reference", "hook_model", "last_hook_attempt", "one_process_run"]

STEPS = 2  # the second step shows a finish() that does not start afresh: it uses the first step's handles
# The gradients become ready as 3, 24, 8, 64, 8, 64, 8, 48 float64 numbers (the model's 227, last layer first).
BUCKET_NBYTES = 480  # 60 numbers: buckets of 99, 72 and a last partial 56, which only finish() can send
# 27 numbers: the first two gradients fill a bucket exactly (3 + 24), then buckets of 72, 72 and 56. A bucket that
# counts only its newest gradient makes 99, 72, 56 instead; one full only above the limit (>) makes 35, 64, 72, 56.
EXACT_BUCKET_NBYTES = 216
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


def ddp_reference(bucket_nbytes: int = BUCKET_NBYTES) -> tuple[list[list[list[float]]], list[list[float]]]:
    """On a rank: the same training under torch's DistributedDataParallel (buckets of at most bucket_nbytes):
    each step's averaged gradients, and the parameters at the end. No guard: it is the grader's own run."""
    model = torch.nn.parallel.DistributedDataParallel(hook_model(labkit.device()), bucket_cap_mb=bucket_nbytes / _MiB)
    x, y = average_batch(labkit.device())
    grads = []
    for _ in range(STEPS):
        model.zero_grad()
        F.cross_entropy(model(x[_shard()]), y[_shard()]).backward()
        grads.append(_grads(model.module))
        sgd_step(model.module)
    return grads, _weights(model.module)


# What a rank may do with a handle only once the backward has returned: wait for it or ask after it (a loop on
# is_completed() waits as wait() does). get_future() and get_future_result() are watched for a later step only.
_WAITING = ("wait", "is_completed", "is_success", "exception", "result", "synchronize")
_HANDLE_METHODS = (*_WAITING, "get_future", "get_future_result")
_FUTURE_WAITING = ("wait", "done")  # of torch.futures.Future, as handle.get_future() returns


@dataclass
class Launch:
    """One all_reduce the student's code started: at which step, of how many elements, whether loss.backward()
    was still running, how many of the step's gradients were ready then, and, if its handle was used again in a
    later step, (that step, the call)."""

    step: int
    numel: int
    in_backward: bool
    ready: int
    again: tuple[int, str] | None = None


class HookGuard(AverageGuard):
    """An AverageGuard (all_reduce recorded, everything else refused) that also knows, for each all_reduce, whether
    loss.backward() was running when it started and how many gradients were ready, every wait while the backward
    ran, handles of a step used in a later one, and which hooks went on the parameters. The grader's loop sets
    `in_backward` around loss.backward(), `step` before each step, and appends to `order` as gradients get ready."""

    def __init__(self, model: torch.nn.Module, order: list[list[int]]):
        super().__init__(model)
        self.step, self.in_backward = 0, False
        self.launches: list[Launch] = []
        self.early: list[tuple[int, str]] = []  # (step, the call) that waited while the backward ran
        self.hooks = {"register_post_accumulate_grad_hook": 0, "register_hook": 0}  # calls on the parameters
        self._handles: list[tuple[object, Launch]] = []
        self._parameters = {id(p) for p in model.parameters()}
        self._order = order

    def install(self) -> None:
        """AverageGuard's, then the all_reduces timed, the handles, futures and barriers watched, hooks counted."""
        import torch.distributed as dist

        super().install()
        wrap_group_method(self, Kind.ALLREDUCE, self._timed)
        for name in _HANDLE_METHODS:
            self._watch(dist.Work, name, self._handle_used)
        for name in _FUTURE_WAITING:
            self._watch(torch._C.Future, name, self._future_used)
        wrap_group_method(self, Kind.BARRIER, self._barrier_used)
        for name in self.hooks:
            self._count_hooks(name)

    def unwaited(self) -> list:
        """As AverageGuard's, once the student's code is done: the grader's own waits are no step's."""
        self.step = None
        return super().unwaited()

    def _timed(self, call: GroupCall):
        """On top of AverageGuard's recording: the step, whether the backward runs, how many gradients are ready."""
        if self.in_backward and not call.asynchronous:
            self.early.append((self.step, "dist.all_reduce without async_op=True"))
        launch = Launch(self.step, call.tensor.numel(), self.in_backward, len(self._order[-1]) if self._order else 0)
        self.launches.append(launch)
        work = call.proceed()
        self._handles.append((work, launch))
        return work

    def _watch(self, owner, name: str, note) -> None:
        """Call note(obj, name) before every owner.name(...), then owner's own method."""
        def make(below):
            def watched(obj, *args, **kwargs):
                note(obj, name)
                return below(obj, *args, **kwargs)
            return watched

        self.wrap(owner, name, make)

    def _handle_used(self, work, name: str) -> None:
        """A student's handle waited (or asked after) while the backward runs, or used in a step after its own."""
        launch = next((launch for handle, launch in self._handles if handle is work), None)
        if launch is None:
            return  # the guard's own handles (AverageGuard's check that the ranks are in step)
        if self.in_backward and name in _WAITING:
            self.early.append((self.step, f"handle.{name}()"))
        if self.step is not None and launch.step < self.step and launch.again is None:
            launch.again = (self.step, f"handle.{name}()")

    def _barrier_used(self, call: GroupCall):
        """dist.barrier() while the backward runs: gloo's barrier waits for every earlier all_reduce first."""
        if self.in_backward:
            self.early.append((self.step, "dist.barrier()"))
        return call.proceed()

    def _future_used(self, _future, name: str) -> None:
        """A future waited for (or asked after) while the backward runs: only the student's code runs there."""
        if self.in_backward:
            self.early.append((self.step, f"handle.get_future().{name}()"))

    def _count_hooks(self, name: str) -> None:
        """Count torch.Tensor.<name> calls on the model's parameters (the grader registered its own before)."""
        def make(below):
            def counted(tensor, *args, **kwargs):
                if id(tensor) in self._parameters:
                    self.hooks[name] += 1
                return below(tensor, *args, **kwargs)
            return counted

        self.wrap(torch.Tensor, name, make)


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
    early: list[tuple[int, str]] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    unwaited: int = 0
    hooks: dict = field(default_factory=dict)
    forbidden: list[str] = field(default_factory=list)
    returned: str | None = None


_last: dict = {}  # on a rank: the hooks and all_reduce sizes of the last attempt, for a run that raised


def attempt_hook(attach, bucket_nbytes: int = BUCKET_NBYTES) -> HookOutcome:
    """On a rank: finish = attach(model, bucket_nbytes), then STEPS SGD steps on this rank's shard, each
    zero_grad, forward, backward (the student's hooks fire), finish(), step; under a HookGuard throughout."""
    model, twin = hook_model(labkit.device()), hook_model(labkit.device())
    outcome = HookOutcome()
    for index, p in enumerate(model.parameters()):  # before the student's, so it sees each gradient first
        p.register_post_accumulate_grad_hook(lambda _, index=index: outcome.order[-1].append(index))
    guard = HookGuard(model, outcome.order)
    try:
        with guard:
            finish = attach(model, bucket_nbytes)
            if callable(finish):
                _train(model, twin, finish, guard, outcome)
            else:
                outcome.returned = "None" if finish is None else f"a {type(finish).__name__}"
            outcome.unwaited = len(guard.unwaited())
    finally:
        _last.clear()
        _last.update(hooks=dict(guard.hooks), numels=[launch.numel for launch in guard.launches])
    outcome.final, outcome.launches, outcome.early = _weights(model), guard.launches, guard.early
    outcome.hooks = guard.hooks
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
