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

import random
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import labkit
from labkit.exercises._kit._group_call import GroupCall, Kind, wrap_group_method
from labkit.exercises._kit._runner import Case
from labkit.exercises.average_guard import BATCH, AverageGuard, average_batch, sgd_step
from labkit.models import mlp

__all__ = ["BUCKET_NBYTES", "EARLIER_HOOKS", "EXACT_BUCKET_NBYTES", "MODELS", "NOTEBOOK_SIZES", "STEPS", "HookGuard",
           "HookOutcome", "Launch", "attempt_hook", "ddp_reference", "draw_sizes", "draw_values", "hook_model",
           "hook_sizes", "last_hooks", "one_process_run"]

STEPS = 2  # the notebook's; a grading draws 2-4 (the second step shows a finish() that uses the first's handles)
MODELS = 2  # models trained one after the other in each case (attach called on each): the same sizes, other values
NOTEBOOK_SIZES = (6, 8)  # the notebook's model (features, hidden): never drawn, so sizes written in by hand show
# The notebook's model's gradients become ready as 3, 24, 8, 64, 8, 64, 8, 48 float64 numbers (227, last layer first).
BUCKET_NBYTES = 480  # the notebook's: 60 numbers, buckets of 99, 72 and a last partial 56, which only finish() sends
# 27 numbers: the first two gradients fill a bucket exactly (3 + 24), then buckets of 72, 72 and 56. A bucket that
# counts only its newest gradient makes 99, 72, 56 instead; one full only above the limit (>) makes 35, 64, 72, 56.
EXACT_BUCKET_NBYTES = 216
_HOOKS = ("register_post_accumulate_grad_hook", "register_hook")  # torch.Tensor's, counted on the parameters
EARLIER_HOOKS = "on an earlier model's parameters"  # HookGuard.hooks' count of hooks put there
_MiB = 2 ** 20  # torch DDP's bucket_cap_mb counts MiB


def hook_model(device=None, features: int = 6, hidden: int = 8, seed: int = 0) -> torch.nn.Module:
    """The graded model: `features` features, three hidden layers of `hidden`, 3 classes (8 parameter tensors),
    float64 so that float error stays far below any mistake, seeded: the same on every rank."""
    return mlp(features=features, hidden=hidden, classes=3, layers=3, seed=seed, dtype=torch.float64).to(device)


def hook_sizes(features: int = 6, hidden: int = 8) -> list[tuple[str, int]]:
    """(name, numel) of each parameter of hook_model(features, hidden), in the model's order."""
    return [(name, p.numel()) for name, p in hook_model(None, features, hidden).named_parameters()]


def draw_sizes(rng: random.Random) -> tuple[int, int]:
    """The model's (features, hidden), drawn: features 3-9, hidden 4-10, never the notebook's sizes."""
    while True:
        sizes = rng.randint(3, 9), rng.randint(4, 10)
        if sizes != NOTEBOOK_SIZES:
            return sizes


def draw_values(rng: random.Random) -> dict:
    """What else a case draws: the batch's and the models' seeds, the lr, 2-4 SGD steps."""
    return {"seeds": tuple(rng.sample(range(1, 10 ** 6), MODELS)), "batch_seed": rng.randrange(10 ** 6),
            "lr": round(rng.uniform(0.05, 0.5), 3), "steps": rng.randint(2, 4)}


def _case_model(case: Case, seed: int, device=None) -> torch.nn.Module:
    return hook_model(device, case["features"], case["hidden"], seed)


def _case_batch(case: Case, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    return average_batch(device, case["features"], case["batch_seed"])


def _shard() -> slice:
    """This rank's rows of the batch: [r B/N, (r + 1) B/N)."""
    return slice(labkit.rank() * BATCH // labkit.world_size(), (labkit.rank() + 1) * BATCH // labkit.world_size())


def _grads(model: torch.nn.Module) -> list[list[float]]:
    return [p.grad.flatten().tolist() if p.grad is not None else [] for p in model.parameters()]


def _weights(model: torch.nn.Module) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in model.parameters()]


def one_process_run(case: Case) -> tuple[list[list[list[float]]], list[list[list[float]]]]:
    """One process trained on the whole batch, each of the case's models in turn: every step's gradients (the
    models one after the other), and each model's parameters at the end."""
    (x, y), grads, finals = _case_batch(case), [], []
    for seed in case["seeds"]:
        model = _case_model(case, seed)
        for _ in range(case["steps"]):
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            grads.append(_grads(model))
            sgd_step(model, case["lr"])
        finals.append(_weights(model))
    return grads, finals


def ddp_reference(case: Case) -> tuple[list[list[list[float]]], list[list[list[float]]]]:
    """On a rank: the same training under torch's DistributedDataParallel (buckets of at most the case's
    bucket_nbytes), each model in turn: every step's averaged gradients, and each model's parameters at the end.
    No guard: it is the grader's own run."""
    (x, y), grads, finals = _case_batch(case, labkit.device()), [], []
    for seed in case["seeds"]:
        model = torch.nn.parallel.DistributedDataParallel(_case_model(case, seed, labkit.device()),
                                                          bucket_cap_mb=case["bucket_nbytes"] / _MiB)
        for _ in range(case["steps"]):
            model.zero_grad()
            F.cross_entropy(model(x[_shard()]), y[_shard()]).backward()
            grads.append(_grads(model.module))
            sgd_step(model.module, case["lr"])
        finals.append(_weights(model.module))
    return grads, finals


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

    def __init__(self, model: torch.nn.Module, order: list[list[int]], first_step: int = 0, hooks: dict | None = None):
        super().__init__(model)
        self.step, self.in_backward = first_step, False
        self.launches: list[Launch] = []
        self.early: list[tuple[int, str]] = []  # (step, the call) that waited while the backward ran
        self.hooks = hooks if hooks is not None else {"register_post_accumulate_grad_hook": 0, "register_hook": 0}
        # ^ the calls on the parameters, counted into the attempt's own dict (read back after a RankError)
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
        for name in _HOOKS:
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
        """Count torch.Tensor.<name> calls on the model's parameters (the grader registered its own before), and
        those on the parameters of an earlier model (`EARLIER_HOOKS`: kept from an earlier attach)."""
        def make(below):
            def counted(tensor, *args, **kwargs):
                if id(tensor) in self._parameters:
                    self.hooks[name] += 1
                elif _graded.get(id(tensor)) is tensor:
                    self.hooks[EARLIER_HOOKS] = self.hooks.get(EARLIER_HOOKS, 0) + 1
                return below(tensor, *args, **kwargs)
            return counted

        self.wrap(torch.Tensor, name, make)


@dataclass
class HookOutcome:
    """What one rank's training with the student's hooks left behind, per step (the models one after the other):
    the order in which the gradients became ready (parameter indices), the rank's own gradients and what finish()
    left in .grad; each model's parameters at the end; every all_reduce started (`launches`) and the values that
    went into each (`reduced`), how many were never waited; the hooks attach registered, and what it returned when
    that was not a function; the first step whose finish() changed the gradients of an earlier model."""

    order: list[list[int]] = field(default_factory=list)
    local: list[list[list[float]]] = field(default_factory=list)
    averaged: list[list[list[float]]] = field(default_factory=list)
    final: list[list[list[float]]] = field(default_factory=list)
    launches: list[Launch] = field(default_factory=list)
    reduced: list[list[float]] = field(default_factory=list)
    early: list[tuple[int, str]] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    unwaited: int = 0
    hooks: dict = field(default_factory=dict)
    returned: str | None = None
    touched_earlier: int | None = None


# On a rank, by id: the parameters of every model graded here, while alive (kept by the student's code, say): a
# finish() that changes their gradients later works on something kept from an earlier attach.
_graded: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_last = HookOutcome()  # on a rank: the last attempt's outcome, as far as it got (its hooks, after a RankError)


def last_hooks() -> dict:
    """On a rank: the hooks the last attempt's attach registered on the parameters, when it raised."""
    return dict(_last.hooks)


def attempt_hook(attach, case: Case) -> HookOutcome:
    """On a rank: for each of the case's models in turn, finish = attach(model, bucket_nbytes), then the case's
    SGD steps on this rank's shard, each zero_grad, forward, backward (the student's hooks fire), finish(), step;
    under a HookGuard throughout."""
    global _last
    outcome = _last = HookOutcome(hooks={"register_post_accumulate_grad_hook": 0, "register_hook": 0})
    for seed in case["seeds"]:
        if outcome.returned is not None:
            break
        _attempt_model(attach, case, _case_model(case, seed, labkit.device()), outcome)
    return outcome


def _attempt_model(attach, case: Case, model: torch.nn.Module, outcome: HookOutcome) -> None:
    """One model: attach, then its steps, under a HookGuard; what happened, added to outcome."""
    earlier = [p for key, p in list(_graded.items()) if key not in {id(q) for q in model.parameters()}]
    _graded.update((id(p), p) for p in model.parameters())
    for index, p in enumerate(model.parameters()):  # before the student's, so it sees each gradient first
        p.register_post_accumulate_grad_hook(lambda _, index=index: outcome.order[-1].append(index))
    guard = HookGuard(model, outcome.order, first_step=len(outcome.order), hooks=outcome.hooks)
    with guard:
        finish = attach(model, case["bucket_nbytes"])
        if callable(finish):
            _train(model, case, finish, guard, outcome, earlier)
        else:
            outcome.returned = "None" if finish is None else f"a {type(finish).__name__}"
        outcome.unwaited += len(guard.unwaited())
    outcome.final.append(_weights(model))
    outcome.launches += guard.launches
    outcome.reduced += [call.values for call in guard.calls]
    outcome.early += guard.early
    outcome.ops += [call.op for call in guard.calls]


def _train(model, case: Case, finish, guard: HookGuard, outcome: HookOutcome, earlier: list) -> None:
    """The grader's loop, with the backward marked on the guard; the rank's own gradient from an unhooked twin;
    after each finish(), whether the gradients of an earlier model changed."""
    x, y = _case_batch(case, labkit.device())
    mine, twin = _shard(), _case_model(case, 0, labkit.device())
    for _ in range(case["steps"]):
        twin.load_state_dict(model.state_dict())
        twin.zero_grad()
        F.cross_entropy(twin(x[mine]), y[mine]).backward()
        outcome.local.append(_grads(twin))
        model.zero_grad()
        loss = F.cross_entropy(model(x[mine]), y[mine])
        outcome.order.append([])
        guard.step, guard.in_backward = len(outcome.order) - 1, True
        try:
            loss.backward()
        finally:
            guard.in_backward = False
        before = _fingerprint(earlier)
        finish()
        if outcome.touched_earlier is None and not _unchanged(before, _fingerprint(earlier)):
            outcome.touched_earlier = guard.step
        outcome.averaged.append(_grads(model))
        sgd_step(model, case["lr"])


def _fingerprint(parameters: list) -> list:
    """The gradients of `parameters` as they are now (None for none), to see whether a finish() changed them."""
    return [None if p.grad is None else p.grad.detach().clone() for p in parameters]


def _unchanged(before: list, after: list) -> bool:
    return all((a is None and b is None) or (a is not None and b is not None and a.shape == b.shape
                                             and torch.equal(a, b)) for a, b in zip(before, after, strict=True))
