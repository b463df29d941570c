"""The grader of notebook 04's "your turn": a bucketed DDP gradient hook, run on real ranks against torch's DDP.

The student writes `attach(model, bucket_nbytes)`. It registers a hook on every parameter with
`p.register_post_accumulate_grad_hook(hook)`, which runs as soon as backward() has accumulated that parameter's
gradient into `p.grad`; the hook adds the gradient to the current bucket, and once the bucket holds at least
`bucket_nbytes` bytes it starts `dist.all_reduce(flat, async_op=True)` on the bucket's gradients flattened into
one tensor, and starts a new bucket. `attach` returns `finish()`, which the training loop calls after backward():
it all-reduces the last bucket (not full), waits for every handle, divides by N and copies each averaged slice
back into its `p.grad`. That is torch's DistributedDataParallel (Li et al., "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB 2020, 3.2.2 gradient bucketing, 3.2.3 overlapping computation with
communication). That is also torch DDP's rule for closing a bucket (torch 2.13's
dist._compute_bucket_assignment_by_size: with the gradient that takes it to the cap or past it). The other
common rule, buckets of at most `bucket_nbytes` (a bigger gradient alone), passes too.

`check_bucketed_ddp_hook(attach)` trains small models on 3 gloo ranks with a bucket_nbytes that leaves a last
bucket for finish(), then on 2 with a bucket_nbytes that the first two gradients fill exactly (a bucket full only
above the limit, or one that counts only its newest gradient, makes other buckets), each rank on its own equal
shard of one batch, a few SGD steps. What a right solution must not depend on
is drawn afresh for each case of each grading (`draw_cases`): the model's sizes (never the notebook's), the bucket
size (under constraints that make every known mistake show), the batch's values, the lr and the number of steps
(2-4); and each case calls attach on two models one after the other, so that state kept from an earlier attach (a
global, a class attribute) shows. It runs on the graders' kit (`labkit.exercises._kit._runner`). A solution passes
only if, on every rank:

- it communicated through dist.all_reduce only (torch's DDP and labkit.parallel's BucketedDDP and
  average_gradients are switched off, where they run: from a thread or a forked subprocess too), with hooks
  from register_post_accumulate_grad_hook, not register_hook;
- its all_reduces are the buckets: as many as the gradients, in the order they became ready, make under the rule;
- the first all_reduce of every step started while loss.backward() was still running, and every bucket's started
  from the hooks as soon as the bucket was full, at the latest when the next gradient became ready (the
  at-most rule sends a bucket then): an order counted in gradients, not a timing; so a hook that keeps every
  bucket until the last gradient fails (overlap);
- no handle was waited for before backward() returned, however: handle.wait(), an all_reduce without async_op,
  the handle's future (handle.get_future().wait(), torch.futures.wait_all), a loop on handle.is_completed() or on
  the future's done(), handle.result() or synchronize(), dist.barrier(); every handle was waited for, and none
  used again in a later step (a finish() that never forgets its buckets re-waits and re-copies them). Not watched: a
  stall that goes through none of these (time.sleep in the hook until the bucket has surely arrived, C++ code);
- what every all_reduce took in is this rank's gradients of this step (a bucket of them flattened, as they are
  or already divided by N): an all_reduce of a scratch tensor while the average comes from elsewhere fails, and
  no finish() changes the gradients of a model from an earlier attach;
- after finish(), every gradient equals torch's DistributedDataParallel's on the same rank, and the whole batch's
  in one process (float64, within 1e-9), at every step, and the trained parameters equal DDP's.

On a rank (the first half of this file): the training runs (torch's DDP and the student's hooks), the guard,
and what they left behind.

Each rank builds the same small model (`hook_model`, seeded the same everywhere), takes its own equal shard of one
batch (`labkit.exercises.average.average_batch`) and trains a few SGD steps. `ddp_reference` does it with
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
from labkit.exercises._kit._messages import failure_sentence, first_failure, hang_message
from labkit.exercises._kit._runner import Case, Spec, grade
from labkit.exercises.allreduce import TIMEOUT_SECONDS
from labkit.exercises.average import (
    BATCH,
    READY_MADE,
    AverageGuard,
    OutOfStep,
    average_batch,
    made_of_gradients,
    reference_run,
    sgd_step,
)
from labkit.exercises.progress import graded
from labkit.exercises.verdict import Verdict
from labkit.models import mlp

__all__ = ["check_bucketed_ddp_hook", "draw_cases", "expected_buckets"]


# ==== on a rank: the model, the runs, the guard ====================================================================

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
    """One process trained on the whole batch, each of the case's models (this grader's) in turn: every step's
    gradients (the models one after the other), and each model's parameters at the end."""
    return reference_run(case, _case_model)


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


# ==== in the notebook: the grader ==================================================================================

TOLERANCE = 1e-9  # float64: a right answer is within 1e-15 of DDP's; every mistake is off by far more
REFERENCE_SECONDS = 120.0  # torch's DDP, the grader's own run: its first use in a rank imports for seconds
_ITEM_NBYTES = 8  # float64
_NOTEBOOK = hook_sizes()  # the notebook's model's (name, numel), the default of expected_buckets
_ORDINAL = ("first", "second", "third")
_WRONG_HOOK = ("You registered p.register_hook(...): a tensor hook runs when the gradient is computed, before "
               "it is accumulated into p.grad (at the first step p.grad is still None). The exercise's hook is "
               "register_post_accumulate_grad_hook's, which runs once p.grad holds the new gradient.")
_KEPT = ("something was kept from an earlier attach (the parameters, their buckets or handles, on a global, a "
         "default argument or a class attribute: a list defined in the class body is shared by every instance). "
         "attach is called for every model: keep each model's state in its own closure or instance.")


@graded("bucketed_ddp_hook")
def check_bucketed_ddp_hook(attach, *, timeout_seconds: float = TIMEOUT_SECONDS) -> Verdict:
    """Grade `attach(model, bucket_nbytes) -> finish`: a bucketed DDP from gradient hooks (module docstring).

    Example::

        >>> def attach(model, bucket_nbytes):   # no hooks: everything all-reduced in finish, after the backward
        ...     import torch.distributed as dist
        ...     def finish():
        ...         for p in model.parameters():
        ...             dist.all_reduce(p.grad)
        ...             p.grad /= dist.get_world_size()
        ...     return finish
        >>> check_bucketed_ddp_hook(attach, record=False)
        Not yet. On 3 ranks (a batch of 24 rows, 8 per rank; ...after loss.backward() returned...
    """
    return grade(SPEC, attach, timeout_seconds=timeout_seconds)


# ---- the cases: drawn afresh, so that every known mistake shows on every draw -----------------------------------

def draw_cases(rng: random.Random | None = None) -> list[Case]:
    """The two cases of one grading: 3 ranks with a bucket size that leaves a last bucket for finish(), then 2
    ranks with one that the first two gradients fill exactly; each with its own drawn model sizes and values."""
    rng = rng or random.Random()
    return [_draw_case(3, rng, exact=False), _draw_case(2, rng, exact=True)]


def _draw_case(world_size: int, rng: random.Random, exact: bool) -> Case:
    """Sizes and a bucket size drawn until every mistake of the catalogue shows (`_shows_mistakes`)."""
    while True:
        features, hidden = draw_sizes(rng)
        named = hook_sizes(features, hidden)
        ready = list(range(len(named)))[::-1]  # torch's backward makes an MLP's gradients last layer first
        total = sum(n for _, n in named)
        limit = _nbytes(ready[:2], named) if exact else _ITEM_NBYTES * rng.randint(total // 5, total // 2)
        if limit != BUCKET_NBYTES and _shows_mistakes(ready, limit, named, exact):
            return Case(world_size, {"features": features, "hidden": hidden, "bucket_nbytes": limit,
                                     "named": tuple(named), **draw_values(rng)})


def _shows_mistakes(ready: list[int], limit: int, named, exact: bool) -> bool:
    """Whether, with these sizes and this limit, the right buckets (either rule) differ from those of every
    mistake (one all_reduce per parameter, 4 bytes a number, the notebook's 480 bytes written in, buckets fixed in
    the parameters' order on some ranks); those of the two mistaken rules (`_MISTAKEN_RULES`) are not one per
    parameter, send a bucket before the backward ends, differ from each other where they differ from the right
    ones, and from the right ones where the limit is exact;
    and, where it is not, a last bucket is left for finish() and the first is full before the last gradient."""
    numels = _numels_of(named)

    def at_least(bucket):
        return _nbytes(bucket, named) >= limit

    right = [numels(b) for b in expected_buckets(ready, limit, named)]
    wrong = [numels([[i] for i in ready]),
             numels(_filled(ready, lambda b: sum(named[i][1] for i in b) * 4 >= limit)),
             numels(_filled(ready, lambda b: _nbytes(b, named) >= BUCKET_NBYTES)),
             numels(_filled(ready[::-1], at_least))[::-1]]
    rules = [numels(_filled(ready, lambda b, full=full: full(b, limit, named))) for full, _ in _MISTAKEN_RULES]
    if any(w in right for w in wrong) or wrong[0] in rules or any(len(rule) < 2 for rule in rules):
        return False  # (a mistaken rule that sends nothing before the backward ends is told as no overlap)
    shown = [tuple(rule) for rule in rules if rule not in right]
    if len(set(shown)) < len(shown):
        return False  # two mistaken rules alike where they show: the verdict would name the first for either
    if exact:
        return all(rule not in right for rule in rules)
    buckets = _filled(ready, at_least)
    return len(buckets) >= 3 and _nbytes(buckets[-1], named) < limit and len(buckets[0]) <= len(ready) - 2


def _numels_of(named):
    return lambda buckets: [sum(named[i][1] for i in b) for b in buckets]


def expected_buckets(ready: list[int], bucket_nbytes: int = BUCKET_NBYTES, named=None) -> list[list[list[int]]]:
    """The buckets (lists of parameter indices) that gradients ready in the order `ready` make (`named`: the
    parameters' (name, numel), the notebook's model's by default): under the exercise's rule, torch DDP's (send
    once a bucket holds at least bucket_nbytes), then under the at-most rule (at most bucket_nbytes, a bigger
    gradient alone)."""
    named = named or _NOTEBOOK
    at_most, capped = [], []
    for index in ready:
        if capped and _nbytes(capped, named) + _nbytes([index], named) > bucket_nbytes:
            at_most.append(capped)
            capped = []
        capped = capped + [index]
    return [_filled(ready, lambda bucket: _nbytes(bucket, named) >= bucket_nbytes), at_most + [capped] * bool(capped)]


def _filled(ready: list[int], full) -> list[list[int]]:
    """The buckets that gradients ready in the order `ready` make when a bucket is sent as soon as full(bucket),
    the rest last."""
    buckets, bucket = [], []
    for index in ready:
        bucket = bucket + [index]
        if full(bucket):
            buckets.append(bucket)
            bucket = []
    return buckets + [bucket] * bool(bucket)


_MISTAKEN_RULES = (  # (when a wrong rule calls a bucket full, for a limit in bytes; what to tell the student)
    (lambda bucket, limit, named: _nbytes(bucket[-1:], named) >= limit,
     "the bucket is full when the gradients IN it reach bucket_nbytes, not when one gradient does. Add up the "
     "bytes of every gradient in the bucket, not only the newest p.grad's."),
    (lambda bucket, limit, named: _nbytes(bucket, named) > limit,
     "a bucket that reaches exactly bucket_nbytes is full. Send it once its gradients hold at least "
     "bucket_nbytes (>=), not only once they hold more (>)."),
)


def _mistaken_rule(numels: list[int], ready: list[int], bucket_nbytes: int, named) -> str | None:
    """What to tell a student whose all_reduce sizes are the buckets of a known wrong rule, or None."""
    for full, mistake in _MISTAKEN_RULES:
        buckets = _filled(ready, lambda bucket, full=full: full(bucket, bucket_nbytes, named))
        if numels == _numels_of(named)(buckets):
            return mistake
    return None


def _nbytes(indices: list[int], named) -> int:
    return sum(named[i][1] for i in indices) * _ITEM_NBYTES


# ---- how a case is told -------------------------------------------------------------------------------------------

def _describe(case: Case) -> str:
    n = case.world_size
    return (f"On {n} ranks (a batch of {BATCH} rows, {BATCH // n} per rank; models of {case['features']} features "
            f"and 3 hidden layers of {case['hidden']}, bucket_nbytes = {case['bucket_nbytes']}, lr {case['lr']:g}, "
            f"{case['steps']} SGD steps each)")


def _where(step: int, case: Case) -> str:
    """'on the second model, at step 2': which step of which model the attempt's step `step` is."""
    model, step = divmod(step, case["steps"])
    return f"on the {_ORDINAL[model]} model, at step {step + 1}"


def _passed(cases) -> str:
    told = " and ".join(f"{case.world_size} ranks (bucket_nbytes = {case['bucket_nbytes']} bytes)" for case in cases)
    return (f"on {told}, with the model's sizes, the batch, the lr and the number of steps drawn afresh and "
            f"{MODELS} models in turn, your hooks all-reduced this step's gradients in buckets as the backward made "
            "them, each as soon as it was full, the first while loss.backward() was still running, and finish() "
            "waited for every one, once; after it every gradient equals torch's DistributedDataParallel's and the "
            "whole batch's in one process, at each SGD step. That is DDP's bucketing and overlap (Li et al. 2020, "
            "3.2.2-3.2.3).")


# ---- the checks, in order -----------------------------------------------------------------------------------------

def _calls_problem(outcomes, case: Case) -> str | None:
    """A wrong hook, no overlap, a wait too early or never, handles kept from an earlier step or attach, or
    all_reduces that are not the buckets."""
    for rank, outcome in enumerate(outcomes):
        problem = _rank_calls_problem(rank, outcome, case)
        if problem:
            return problem
    for rank, outcome in enumerate(outcomes):
        for step in range(len(outcome.order)):
            problem = _buckets_problem(rank, step, outcome, case)
            if problem:
                return problem
    return None


def _rank_calls_problem(rank: int, outcome, case: Case) -> str | None:
    """What attach returned, which hooks it used, and when its all_reduces started and were waited, on one rank."""
    if outcome.returned is not None:
        return (f"attach returned {outcome.returned}, not a function: end attach with `return finish`, the "
                "function (no arguments) that the training loop calls after each backward().")
    if outcome.hooks.get(EARLIER_HOOKS):
        return (f"rank {rank}'s attach registered hooks on the parameters of a model from an earlier attach, not "
                f"on the model it was given: {_KEPT}")
    if outcome.hooks.get("register_hook") and not outcome.hooks.get("register_post_accumulate_grad_hook"):
        return f"on rank {rank}: {_WRONG_HOOK}"
    if not outcome.launches:
        return f"rank {rank} made no all_reduce: each rank kept its own gradient."
    op = next((op for op in outcome.ops if op not in ("SUM", "AVG")), None)
    if op:
        return (f"rank {rank} all-reduced with ReduceOp.{op}: that keeps the {op.lower()} over the ranks, not their "
                "sum.")
    if outcome.unwaited:
        return (f"rank {rank} started {outcome.unwaited} all_reduce(s) in {len(outcome.order)} steps with "
                "async_op=True and never called wait() on the handle: the bucket was read before the reduction "
                "finished.")
    if outcome.touched_earlier is not None:
        return (f"{_where(outcome.touched_earlier, case)}, rank {rank}'s finish() changed the gradients of the model "
                f"of an earlier attach: {_KEPT}")
    return _overlap_problem(rank, outcome, case)


def _overlap_problem(rank: int, outcome, case: Case) -> str | None:
    """A wait inside the backward, a step whose all_reduces all started after it, or handles used again later."""
    if outcome.early:
        return _early_message(rank, *outcome.early[0], case)
    for step in range(len(outcome.order)):
        first = next((launch for launch in outcome.launches if launch.step == step), None)
        if first is None or not first.in_backward:
            hooked = outcome.hooks.get("register_post_accumulate_grad_hook")
            why = "" if hooked else " (attach registered no hook on the parameters)"
            later = (f" The first model's steps overlapped, so {_KEPT}" if step >= case["steps"] else "")
            return (f"{_where(step, case)} rank {rank}'s first all_reduce started after loss.backward() returned"
                    f"{why}: nothing overlapped the backward.{later}")
    again = [launch for launch in outcome.launches if launch.again]
    if again:
        (step, call), first = again[0].again, again[0].step
        count = sum(launch.step == first and launch.again[0] == step for launch in again)
        return (f"{_where(step, case)} rank {rank} called {call} again on {count} handle(s) of step "
                f"{first % case['steps'] + 1}: the list of buckets in flight was never emptied, so every step waits "
                "for, divides and copies back the old buckets once more (the values came out right here only "
                "because each step's own buckets were copied last).")
    return None


_WHY_EARLY = {  # how each spelling of a wait inside the backward waits
    "dist.all_reduce without async_op=True": "a blocking all_reduce waits for itself",
    "handle.wait()": "handle.wait() right after starting the all_reduce",
    "handle.get_future().wait()": "the handle's future waits just as the handle does",
    "handle.result()": "it reads the bucket before finish() has waited for it",
    "handle.synchronize()": "it waits for the all_reduce as handle.wait() does",
    "dist.barrier()": "gloo's barrier first waits for every all_reduce started before it",
}


def _early_message(rank: int, step: int, call: str, case: Case) -> str:
    """Rank `rank` waited for an all_reduce (`call`) at step `step` while loss.backward() was still running."""
    why = _WHY_EARLY.get(call, "asking whether it is done, again until it is, waits just as handle.wait() does")
    model, local = divmod(step, case["steps"])
    return (f"rank {rank} waited for an all_reduce while loss.backward() was still running ({call} inside the "
            f"hook at step {local + 1}{f' of the {_ORDINAL[model]} model' if model else ''}: {why}): the backward "
            "stops until the network is done, so nothing overlaps.")


def _buckets_problem(rank: int, step: int, outcome, case: Case) -> str | None:
    """The step's all_reduce sizes against the buckets that the order the gradients became ready makes."""
    named, bucket_nbytes = case["named"], case["bucket_nbytes"]
    launches = [launch for launch in outcome.launches if launch.step == step]
    numels = [launch.numel for launch in launches]
    ready = outcome.order[step]
    options = expected_buckets(ready, bucket_nbytes, named)
    matching = [option for option in options if numels == _numels_of(named)(option)]
    if matching:
        late = [_late_bucket(launches, option) for option in matching]
        return None if None in late else _late_message(rank, step, *late[0], case)
    total, sizes = sum(n for _, n in named), sorted(n for _, n in named)
    where = f"{_where(step, case)} rank {rank} all-reduced {len(numels)} tensor(s) of {numels} elements"
    rule = (f"With bucket_nbytes = {bucket_nbytes} bytes ({bucket_nbytes // _ITEM_NBYTES} float64 numbers) and the "
            f"gradients ready in the order {', '.join(f'{named[i][0]} ({named[i][1]})' for i in ready)}, the "
            f"buckets hold {_numels_of(named)(options[0])} elements.")
    if sorted(numels) == sizes:
        return f"{where}: one all_reduce per parameter, no buckets. {rule}"
    if sum(numels) < total:
        return (f"{where}: {sum(numels)} of the {total} gradient numbers. The last bucket, not full when the "
                f"backward ended ({total - sum(numels)} numbers), was never sent. {rule}")
    if sum(numels) > total:
        return (f"{where}: {sum(numels)} numbers, more than the {total} of the gradients: a gradient went out "
                f"twice: a bucket kept its gradients after it was sent. {rule}")
    mistake = _mistaken_rule(numels, ready, bucket_nbytes, named)
    if mistake:
        return f"{where}, not the buckets: {mistake} {rule}"
    return (f"{where}, not the buckets. {rule} (Each float64 number is 8 bytes; bucket_nbytes and the model's sizes "
            "are drawn for each grading: take them from attach's argument and the gradients, not from the "
            "notebook.)")


def _late_bucket(launches, option: list[list[int]]) -> tuple[int, int, int, int] | None:
    """The first bucket whose all_reduce started more than one gradient after the bucket was full, as (its number,
    its elements, the gradients ready when it was full, those ready when it started), or None. One gradient
    later is allowed: the at-most rule sends a bucket when the next gradient would overflow it."""
    full = 0
    for number, (launch, bucket) in enumerate(zip(launches, option, strict=True), 1):
        full += len(bucket)
        if launch.ready > full + 1:
            return number, launch.numel, full, launch.ready
    return None


def _late_message(rank: int, step: int, number: int, numel: int, full: int, ready: int, case: Case) -> str:
    """Bucket `number` went out only once `ready` gradients were ready, though it was full after `full`."""
    total = len(case["named"])
    when = "every gradient was ready" if ready == total else f"{ready} of the {total} gradients were ready"
    return (f"{_where(step, case)} rank {rank} started bucket {number} ({numel} numbers) only once {when}, though "
            f"it was full once {full} were: it waited for gradients that are not in it, so it overlapped "
            f"{'nothing' if ready == total else 'less'} of the backward.")


def _contents_problem(outcomes, case: Case) -> str | None:
    """What every all_reduce took in must be this rank's gradients of this step (a bucket of them, as they are or
    divided by N): else it reduced a scratch tensor, or a bucket filled after the all_reduce started."""
    for rank, outcome in enumerate(outcomes):
        for launch, values in zip(outcome.launches, outcome.reduced, strict=True):
            if not made_of_gradients(values, outcome.local[launch.step], case.world_size):
                return (f"{_where(launch.step, case)} rank {rank} all-reduced a tensor of {launch.numel} numbers "
                        "whose values are not its gradients (as it started): an all_reduce of a scratch tensor, or of "
                        "a bucket filled only after its all_reduce started, while the average came from elsewhere, is "
                        "not the gradients averaged by it. Fill each bucket with its gradients first, then all-reduce "
                        "it, and copy back what comes out.")
    return None


def _values_problem(outcomes, case: Case) -> str | None:
    """Gradients after finish() against torch's DDP's on the same rank, step by step; then the trained models."""
    ddp = labkit.run(ddp_reference, case, world_size=case.world_size, timeout=REFERENCE_SECONDS)
    _check_reference(ddp, one_process_run(case))
    world_size, named = len(outcomes), case["named"]
    for step in range(len(outcomes[0].order)):
        for rank, outcome in enumerate(outcomes):
            problem = _step_problem(outcome.averaged[step], outcome.local[step], ddp[rank][0][step], world_size,
                                    named)
            if problem:
                return f"{_where(step, case)} of {case['steps']}, after finish(), rank {rank}'s {problem}"
    for rank, outcome in enumerate(outcomes):
        for model, (final, want) in enumerate(zip(outcome.final, ddp[rank][1], strict=True)):
            gap = _gap(final, want)
            if gap > TOLERANCE:
                return (f"rank {rank}'s {_ORDINAL[model]} model after {case['steps']} steps differs from torch's "
                        f"DDP's by {gap:.3g}: did attach or finish change anything but .grad?")
    return None


def _check_reference(ddp, alone) -> None:
    """torch's DDP must equal one process on the whole batch; if not, the grader itself is broken."""
    for grads, finals in ddp:
        if any(_gap(f, a) > TOLERANCE for f, a in zip(finals, alone[1], strict=True)) or any(
                _gap(g, a) > TOLERANCE for g, a in zip(grads, alone[0], strict=True)):
            raise RuntimeError("check_bucketed_ddp_hook: torch's DDP differs from one process on the whole batch; "
                               "the grader cannot judge (please report this).")


def _step_problem(got, local, want, world_size: int, named) -> str | None:
    """One rank's gradients after finish(): the rank's own (not copied back), N times too large, partly averaged."""
    wrong = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if _gap([g], [w]) > TOLERANCE]
    if not wrong:
        return None
    kept = [i for i in wrong if _gap([got[i]], [local[i]]) <= TOLERANCE]
    if len(kept) == len(got):
        return ("gradients are still its own, not the average: the averaged buckets never reached p.grad (the "
                "all-reduce works on the flat copy, not on p.grad).")
    if kept:
        averaged = [i for i in range(len(got)) if i not in kept]
        return (f"gradients of {_names(kept, named)} are still its own (not averaged), while "
                f"{_names(averaged, named)} were: those never came back from a bucket.")
    scaled = [[x * world_size for x in w] for w in want]
    if len(wrong) == len(got) and _gap(got, scaled) <= TOLERANCE * world_size:
        return (f"gradients are {world_size}x torch's DDP's: the {world_size} ranks' gradients were summed, not "
                "averaged.")
    first = wrong[0]
    return (f"gradient of {named[first][0]} differs from torch's DistributedDataParallel's by "
            f"{_gap([got[first]], [want[first]]):.3g}: it is neither its own gradient nor the average over the "
            "ranks.")


def _names(indices: list[int], named) -> str:
    return ", ".join(named[i][0] for i in indices)


def _gap(got, want) -> float:
    """The largest absolute difference between two lists of lists of floats (inf if their shapes differ)."""
    if [len(g) for g in got] != [len(w) for w in want]:
        return float("inf")
    return max((abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True)), default=0.0)


# ---- a hang, an error, a refused call -----------------------------------------------------------------------------

def _hang_message(hang: labkit.RankTimeout, case: Case, timeout_seconds: float) -> str:
    """A run that never finished: where the first ranks waited, and why all_reduce waits."""
    return hang_message(hang, timeout_seconds, "a rank waited in an all_reduce that the others did not join. Every "
                                               "rank must start the same buckets in the same order, the order its "
                                               "gradients become ready, which is the same on every rank.")


def _error_message(error: labkit.RankError, attempts, case: Case) -> str:
    """A run that raised (not a refused call: the runner says those): a wrong hook, ranks out of step, else the
    first error."""
    first, _ = first_failure(error)
    if first.raised(OutOfStep) and first.exception_args:
        said = str(first.exception_args[0]).strip().removesuffix(".")
        return (f"{said}: the ranks' buckets went out in different orders or sizes. On real "
                "ranks that sums unrelated gradients, or hangs, or aborts (gloo: 'Received data size doesn't "
                "match expected size'). Every rank must fill its buckets in the order its gradients become ready, "
                "whatever the rank.")
    message = f"{failure_sentence(first)}."
    hooks = _hooks_after_error(case) if attempts is not None else {}
    if hooks.get("register_hook") and not hooks.get("register_post_accumulate_grad_hook"):
        message += f" {_WRONG_HOOK}"
    elif "AVG" in first.summary:
        message += " gloo has no ReduceOp.AVG (NCCL has): on gloo the average is built from a sum."
    elif any(word in first.summary for word in ("size", "shape", "split")):
        message += (f" The model's sizes are drawn for each grading (here {case['features']} features and hidden "
                    f"layers of {case['hidden']}, not the notebook's 6 and 8), and attach is called on {MODELS} "
                    "models: sizes written into your code, or state kept from an earlier attach (on a global or a "
                    "class attribute), do not fit. Take the sizes from this model's gradients.")
    return message


def _hooks_after_error(case: Case) -> dict:
    """Rank 0's hooks of the attempt that raised, read back from the ranks (still running: the runner kept them)."""
    try:
        return labkit.run(last_hooks, world_size=case.world_size)[0]
    except labkit.RankError:
        return {}


def _why_forbidden(spelling: str, name: str) -> str:
    """Why the call `spelling` is switched off while the bucketed hook is graded, and what to use instead."""
    if "labkit.parallel" in spelling or "DistributedDataParallel" in spelling:
        return "That is a ready-made data parallelism, which does the exercise for you: it is switched off here."
    return ("This exercise allows one collective only, dist.all_reduce: other communication is switched off "
            "while it is graded.")


SPEC = Spec(attempt=attempt_hook, cases=draw_cases, checks=(_calls_problem, _contents_problem, _values_problem),
            describe=_describe, why_forbidden=_why_forbidden, on_hang=_hang_message, on_error=_error_message,
            passed=_passed, example="check_bucketed_ddp_hook(attach)", ready_made=READY_MADE)
