"""The grader of notebook 15's "your turn": fix a broken data-parallel training loop, on real ranks.

`check_fixed_training(fn)` calls the student's `fn(model, x, y, steps, lr)` on 3 and then 2 ranks. Each rank's
`model` starts from its own random initialisation (seed 100 + rank, as a script that seeds by rank does) and
(x, y) is its own equal shard of one batch. `fn` must train `steps` SGD steps (p -= lr x p.grad) so that every
rank ends where one process trained on the whole batch from rank 0's initial model ends: broadcast rank 0's
parameters before the first step, then, after each backward, all-reduce every gradient and divide it by N
(Li et al., "PyTorch Distributed", VLDB 2020, 3.2.1 and 3.2.2's "broadcast model states from one process").

The grader sees each rank's parameters at every training forward (a forward hook; a forward counts once a
backward reaches its output, so one that only logs the loss is no step) and at the end, and compares them,
in float64 within 1e-9, with one process's: where the first step goes wrong, the update a rank applied,
(p_k - p_k+1) / lr, says what is wrong with it (summed and not divided, divided by another number than N, not
averaged, gradients piling up without zero_grad, some parameters only). The exercise is gradient averaging with
dist.broadcast and dist.all_reduce: every other collective is switched off (gathering the data to train on the
whole batch everywhere is not data parallel), and so is an all_reduce of the parameters themselves once training
has begun (parameter averaging, which plain SGD cannot tell from gradient averaging but Adam can). torch's
DistributedDataParallel and labkit.parallel's broadcast_parameters and average_gradients do the fix for you and
are switched off too. A broadcast or all_reduce started with async_op=True must be waited for (its handle or its
future; labkit.exercises.wait_watch.watch_waits watches them): one never waited for is named first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import labkit
from labkit.checks import timeout_seconds as checked_timeout
from labkit.exercises._kit._group_call import GroupCall, Kind, wrap_group_method
from labkit.exercises.allreduce import TIMEOUT_SECONDS
from labkit.exercises.average_guard import BATCH, average_batch, ready_made_caller, watch_waits
from labkit.exercises.guard import Guard, first_failure, stop_pool, where_ranks_waited
from labkit.exercises.progress import graded
from labkit.exercises.verdict import Verdict
from labkit.models import mlp

__all__ = ["FIX_CASES", "FIX_LR", "FIX_STEPS", "FixGuard", "FixOutcome", "attempt_fix", "check_fixed_training",
           "fix_model"]

FIX_CASES = (3, 2)  # three first: N, N - 1 and rank + 1 differ there
FIX_STEPS, FIX_LR = 3, 0.1
TOLERANCE = 1e-9  # float64: a right fix is within 1e-15; every mistake is off by far more


def fix_model(rank: int, device=None) -> torch.nn.Module:
    """Rank `rank`'s model before the fix: 6 -> 8 -> 3, float64, seeded by the rank (replicas differ)."""
    return mlp(features=6, hidden=8, classes=3, layers=1, seed=100 + rank, dtype=torch.float64).to(device)


_NAMES = [name for name, _ in fix_model(0).named_parameters()]


@dataclass
class FixOutcome:
    """One rank's run: its parameters (flattened per parameter) at each training forward (one whose output a
    backward went through: a forward under torch.no_grad() to log the loss is not a step) and at the end, and the
    collectives it started with async_op=True and never waited for."""

    forwards: list[tuple[list[list[float]], list[bool]]] = field(default_factory=list)  # (parameters, trained?)
    starts: list[list[list[float]]] = field(default_factory=list)
    final: list[list[float]] = field(default_factory=list)
    unwaited: list[tuple[str, bool]] = field(default_factory=list)  # (what, whether its future was taken)

    def watch_forward(self, module: torch.nn.Module, output) -> None:
        """A forward hook: note the parameters of a forward that builds a graph, marked trained once a backward
        reaches its output (a tensor hook), so that only training forwards count as steps."""
        if isinstance(output, torch.Tensor) and output.requires_grad:
            trained = [False]
            self.forwards.append((_flat(module), trained))
            output.register_hook(lambda grad: trained.__setitem__(0, True))

    def close(self, model: torch.nn.Module) -> None:
        """After the run: the training forwards' parameters, and the parameters at the end."""
        self.starts = [params for params, trained in self.forwards if trained[0]]
        self.forwards = []
        self.final = _flat(model)


PARAMETER_AVERAGE = "dist.all_reduce on the parameters themselves after training began"


class FixGuard(Guard):
    """While the student's training runs on a rank: dist.broadcast and dist.all_reduce allowed, every other
    collective refused (gathering the data or the parameters is not data parallelism), and so are torch's DDP,
    labkit.parallel's broadcast_parameters and average_gradients (found on the call stack), and an all_reduce of
    the parameters' values once the first forward has run (parameter averaging, not gradient averaging)."""

    def __init__(self, model: torch.nn.Module, outcome: FixOutcome):
        super().__init__()
        self._model, self._outcome = model, outcome
        self._works: list[tuple[object, _Call]] = []  # (handle, the call it belongs to), for watch_waits

    def install(self) -> None:
        """Broadcast and all_reduce watched, every other collective and DDP refused, the handles watched."""
        self.switch_off_torch_distributed(allowed=("all_reduce", "allreduce", "broadcast", "barrier"),
                                          point_to_point=False)
        self.switch_off(torch.nn.parallel.DistributedDataParallel, "__init__",
                        "torch.nn.parallel.DistributedDataParallel")
        for kind in (Kind.ALLREDUCE, Kind.BROADCAST):
            wrap_group_method(self, kind, self._watched)
        watch_waits(self._works, self)

    def refuse(self, spelling: str):
        """Refuse `spelling`, named as the ready-made fix that called it when there is one (broadcast_parameters
        checks the replicas' shapes with all_gather_object before it broadcasts)."""
        ready_made = ready_made_caller()
        super().refuse(f"labkit.parallel's {ready_made}" if ready_made else spelling)

    def unwaited(self) -> list[tuple[str, bool]]:
        """The collectives started with async_op=True whose handle the student's code never waited for (named,
        and whether their future was taken);
        they are waited for now, so that the ranks end in step and the parameters stop changing."""
        left = [(work, call) for work, call in self._works if not call.waited]
        for work, _ in left:
            work.wait()  # the guard is off by now: Work.wait is torch's own again
        return [(call.what, call.future) for _, call in left]

    def _watched(self, made: GroupCall):
        """An allreduce or broadcast: the ready-made fixes and parameter averaging refused, else made, its handle
        recorded so that watch_waits sees whether it was waited for."""
        if ready_made_caller():
            self.refuse(str(made.kind))
        if made.kind == Kind.ALLREDUCE and self._outcome.forwards and self._holds_parameters(made.tensors):
            self.refuse(PARAMETER_AVERAGE)
        call = _Call(self._describe(made.kind, made.tensors), waited=not made.asynchronous)
        work = made.proceed()
        self._works.append((work, call))
        return work

    def _describe(self, name: str, tensors) -> str:
        """'dist.broadcast of the parameter 0.weight', 'dist.all_reduce of the gradient of 0.bias', or '... of a
        tensor of 48 elements': what a call was made on, for a message."""
        tensor = tensors[0] if isinstance(tensors, (list, tuple)) else tensors
        pointer = tensor.untyped_storage().data_ptr()
        named = [(f"the parameter {n}", p) for n, p in self._model.named_parameters()] + [
            (f"the gradient of {n}", p.grad) for n, p in self._model.named_parameters() if p.grad is not None]
        what = next((n for n, t in named if t.untyped_storage().data_ptr() == pointer),
                    f"a tensor of {tensor.numel()} elements")
        return f"dist.{'all_reduce' if name == 'allreduce' else name} of {what}"

    def _holds_parameters(self, tensors) -> bool:
        """Whether an all_reduce's tensors are parameters: their memory, one's values, or all of them flattened."""
        params = list(self._model.parameters())
        memory = {p.untyped_storage().data_ptr() for p in params}
        values = [p.detach().reshape(-1) for p in params] + [torch.cat([p.detach().reshape(-1) for p in params])]
        for tensor in tensors if isinstance(tensors, (list, tuple)) else [tensors]:
            flat = tensor.detach().reshape(-1)
            if tensor.untyped_storage().data_ptr() in memory or any(
                    v.numel() == flat.numel() and v.dtype == flat.dtype and torch.equal(v, flat) for v in values):
                return True
        return False


@dataclass
class _Call:
    """One broadcast or all_reduce the student's code made: what it was made on, and whether it was waited for
    (a call without async_op=True waits itself; watch_waits sets it for the others)."""

    what: str
    waited: bool
    future: bool = False  # set by watch_waits when the handle's future was taken


def _flat(model: torch.nn.Module) -> list[list[float]]:
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


def attempt_fix(fn) -> FixOutcome:
    """On a rank: fn(model, x, y, FIX_STEPS, FIX_LR) on this rank's model and shard, under the guard."""
    rank, world_size = labkit.rank(), labkit.world_size()
    model, (x, y) = fix_model(rank, labkit.device()), average_batch(labkit.device())
    rows = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    outcome = FixOutcome()
    hook = model.register_forward_hook(lambda module, args, output: outcome.watch_forward(module, output))
    guard = FixGuard(model, outcome)
    try:
        with guard:
            fn(model, x[rows], y[rows], FIX_STEPS, FIX_LR)
    finally:
        hook.remove()
    outcome.unwaited = guard.unwaited()
    outcome.close(model)
    return outcome


@dataclass
class _Reference:
    """One process on the whole batch from rank 0's model: parameters before each step and at the end, the
    whole batch's gradient at each step, and each rank's own (shard) gradient there."""

    params: list[list[list[float]]]
    grads: list[list[torch.Tensor]]
    local: list[list[list[torch.Tensor]]]  # [rank][step][parameter]


def _reference(world_size: int) -> _Reference:
    model, (x, y) = fix_model(0), average_batch()
    shards = [slice(r * BATCH // world_size, (r + 1) * BATCH // world_size) for r in range(world_size)]
    ref = _Reference([], [], [[] for _ in range(world_size)])
    for _ in range(FIX_STEPS):
        ref.params.append(_flat(model))
        for rank, rows in enumerate(shards):
            ref.local[rank].append(_gradients(model, x[rows], y[rows]))
        ref.grads.append(_gradients(model, x, y))
        with torch.no_grad():
            for p, g in zip(model.parameters(), ref.grads[-1], strict=True):
                p -= FIX_LR * g.view_as(p)
    ref.params.append(_flat(model))
    return ref


def _gradients(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    return [p.grad.detach().reshape(-1).clone() for p in model.parameters()]


@graded("bug_zoo_fix")
def check_fixed_training(fn, *, timeout_seconds: float = TIMEOUT_SECONDS) -> Verdict:
    """Grade `fn(model, x, y, steps, lr)`: the broken training loop fixed (module docstring).

    Example::

        >>> def train(model, x, y, steps, lr):        # the notebook's stub, not yet filled in
        ...     raise NotImplementedError("your turn")
        >>> check_fixed_training(train, record=False)
        Not yet. On 3 ranks (a batch of 24 rows, 8 per rank), your function raised NotImplementedError: ...
    """
    timeout_seconds = checked_timeout("timeout_seconds", timeout_seconds)
    if not callable(fn):
        return Verdict(False, "pass your function itself, e.g. check_fixed_training(train), not "
                              f"{type(fn).__name__}.")
    for world_size in FIX_CASES:
        problem = _case_problem(fn, world_size, timeout_seconds)
        if problem:
            return Verdict(False, f"On {world_size} ranks (a batch of {BATCH} rows, {BATCH // world_size} per "
                                  f"rank), {problem}")
    return Verdict(True, f"on 3 and 2 ranks, every replica started from rank 0's parameters and took, at each of "
                         f"{FIX_STEPS} steps, the update of one process on the whole batch: the run is one "
                         "process's, spread over the ranks. A broadcast at the start and an average (all_reduce, "
                         "then divide by N) after every backward is all data parallelism needs.")


def _case_problem(fn, world_size: int, timeout_seconds: float) -> str | None:
    try:
        outcomes = labkit.run(attempt_fix, fn, world_size=world_size, timeout=timeout_seconds)
    except labkit.RankTimeout as hang:  # labkit stops a pool whose call timed out
        return (f"the ranks did not finish within {timeout_seconds:g} s: {where_ranks_waited(hang, world_size)}. "
                "A collective returns only when every rank of the group calls it: each broadcast and all_reduce "
                "must be called on every rank, rank 0 included, in the same order.")
    except labkit.RankError as error:
        if not error.pool_stopped:
            stop_pool(world_size)  # a rank that raised may have left the others' collectives unmatched
        return _error_message(error)
    return _unwaited_problem(outcomes) or _values_problem(outcomes, _reference(world_size))


def _unwaited_problem(outcomes: list[FixOutcome]) -> str | None:
    """The first collective a rank started with async_op=True and never waited for: until its handle's wait()
    returns, the tensor may not hold the result yet (torch.distributed docs, "Synchronous and asynchronous
    collective operations")."""
    for rank, outcome in enumerate(outcomes):
        if outcome.unwaited:
            (what, future), more = outcome.unwaited[0], len(outcome.unwaited) - 1
            others = f" (and {more} more like it)" if more else ""
            taken = " It took the handle's future (work.get_future()) but never waited on it either." if future \
                else ""
            return (f"rank {rank} started {what}{others} with async_op=True and never waited for it.{taken} "
                    "With async_op=True the call returns at once, while the collective may still be running: what "
                    "you read or change next races with it.")
    return None


def _error_message(error: labkit.RankError) -> str:
    failure, spelling = first_failure(error)
    if spelling == PARAMETER_AVERAGE:
        return (f"rank {failure.rank} all-reduced its parameters themselves (p.data, or a copy of their values) "
                "after training began: that averages the replicas' parameters after local steps (parameter "
                "averaging), not their gradients. "
                "With plain SGD the two happen to agree; with a nonlinear optimizer such as Adam they do not.")
    if spelling and ("labkit.parallel" in spelling or "DistributedDataParallel" in spelling):
        return (f"rank {failure.rank} called {spelling}, which does the fix for you and is switched off here. "
                "This exercise allows dist.broadcast and dist.all_reduce.")
    if spelling:
        return (f"rank {failure.rank} called {spelling}, which is switched off here: this exercise allows only "
                "dist.broadcast and dist.all_reduce. In data parallelism each rank trains on its own shard and "
                "the ranks exchange gradients, not data (gathering the data to train on the whole batch everywhere "
                "is not data parallel).")
    if "NotImplementedError" in failure.summary:  # its text, "your turn", marks the untouched stub: no attempt
        summary = failure.summary.strip().removesuffix(".")
        return f"your function raised {summary}: delete the stub's `raise`, then fix the loop below it."
    return f"rank {failure.rank} raised {failure.summary}"


def _gap(a: list[float], b) -> float:
    return (torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs().max().item()


def _named(indices: list[int]) -> str:
    return ", ".join(_NAMES[i] for i in indices)


def _values_problem(outcomes: list[FixOutcome], ref: _Reference) -> str | None:
    """The first rank and step where the parameters leave one process's path, and why."""
    for rank, outcome in enumerate(outcomes):
        if len(outcome.starts) != FIX_STEPS:
            return (f"rank {rank} ran {len(outcome.starts)} forward passes with a backward for steps={FIX_STEPS}: "
                    "train exactly `steps` steps, one forward and one backward each (a forward whose loss is only "
                    "logged, with no backward, is not counted).")
    for rank, outcome in enumerate(outcomes):
        problem = _start_problem(rank, outcome.starts[0], ref.params[0], outcomes)
        if problem:
            return problem
    for step in range(FIX_STEPS):
        afters = [o.starts[step + 1] if step + 1 < FIX_STEPS else o.final for o in outcomes]
        problem = _factors_problem([o.starts[step] for o in outcomes], afters, ref.grads[step])
        for rank, outcome in enumerate(outcomes):
            problem = problem or _update_problem(rank, step, outcome.starts[step], afters[rank], ref)
        if problem:
            return f"at step {step + 1} of {FIX_STEPS}, {problem}"
    return None


def _applied(before, after) -> list[torch.Tensor]:
    """The gradient an SGD step used: (parameters before - after) / lr, per parameter."""
    return [(torch.as_tensor(b, dtype=torch.float64) - torch.as_tensor(a, dtype=torch.float64)) / FIX_LR
            for b, a in zip(before, after, strict=True)]


def _factor(applied, average) -> float | None:
    """c when the applied update is c x the average gradient (to 1e-6 of its largest element), else None."""
    g, a = torch.cat(applied), torch.cat(average)
    factor = (g @ a / (a @ a)).item()
    return factor if _gap(g.tolist(), factor * a) <= 1e-6 * a.abs().max().item() else None


def _factors_problem(befores, afters, average) -> str | None:
    """Ranks that scaled the average gradient by different factors (a divisor that depends on the rank)."""
    factors = [_factor(_applied(b, a), average) for b, a in zip(befores, afters, strict=True)]
    if None in factors or max(factors) - min(factors) < 1e-6:
        return None
    shown = ", ".join(f"rank {rank}: {factor:.3g} x" for rank, factor in enumerate(factors))
    return (f"the ranks scaled the average gradient by different factors ({shown}), so the replicas drift apart: "
            "a divisor that depends on the rank.")


def _start_problem(rank: int, start, rank0_init, outcomes) -> str | None:
    """Before the first step every replica must hold rank 0's initial parameters."""
    wrong = [i for i, (got, want) in enumerate(zip(start, rank0_init, strict=True)) if _gap(got, want) > TOLERANCE]
    if not wrong:
        return None
    own = _flat(fix_model(rank))
    kept = [i for i in wrong if _gap(start[i], own[i]) <= TOLERANCE]
    if len(kept) == len(start):
        return (f"rank {rank} began training from its own random initialisation: the replicas were never made "
                "identical, so they follow different paths however well the gradients are averaged.")
    if kept:
        return (f"rank {rank}'s {_named(kept)} still held their own initial values at the first step, while "
                f"{_named([i for i in range(len(start)) if i not in kept])} came from rank 0: those were left out "
                "of the broadcast.")
    same = all(_gap(o.starts[0][i], start[i]) <= TOLERANCE for o in outcomes for i in range(len(start)))
    if same:
        return ("the replicas began identical, but not with rank 0's initial parameters (the reference run starts "
                "from rank 0's model): broadcast from another rank, or the parameters averaged?")
    return (f"rank {rank}'s parameters at the first step ({_named(wrong)}) are neither rank 0's nor its own "
            "initial ones: changed between the broadcast and the first step?")


def _update_problem(rank: int, step: int, before, after, ref: _Reference) -> str | None:
    """The update rank `rank` applied at `step`, (before - after) / lr, against the average gradient there."""
    if all(_gap(a, b) <= TOLERANCE for a, b in zip(after, ref.params[step + 1], strict=True)):
        return None
    applied = _applied(before, after)
    average, local = ref.grads[step], ref.local[rank][step]
    wrong = [i for i, (g, want) in enumerate(zip(applied, average, strict=True)) if _gap(g, want) > TOLERANCE]
    kept = [i for i in wrong if _gap(applied[i], local[i]) <= TOLERANCE]
    world_size = len(ref.local)
    if kept and len(kept) < len(applied):
        return (f"rank {rank} updated {_named(kept)} with its own gradient, not the average: those gradients "
                "were left out.")
    if kept:
        return (f"rank {rank} updated its parameters with its own gradient, not the average over the "
                f"{world_size} ranks.")
    if step and all(_gap(g, a + p) <= TOLERANCE * 10 for g, a, p in zip(applied, average, ref.grads[step - 1],
                                                                     strict=True)):
        return ("the update is this step's average gradient plus the last step's: the gradients pile up from "
                "step to step: .grad was never zeroed.")
    return _scaled_message(rank, applied, average, world_size)


def _scaled_message(rank: int, applied, average, world_size: int) -> str:
    """The applied update as a multiple of the average gradient, named when it is one students get."""
    factor = _factor(applied, average)
    if factor is None:
        return (f"rank {rank}'s update is not -lr x the average gradient (the largest gap is "
                f"{_gap(torch.cat(applied).tolist(), torch.cat(average)):.3g}), by no single factor.")
    known = {world_size: f"summed over the ranks but not divided by N = {world_size}: its update is {world_size}x "
                         "one process's on the whole batch",
             1 / world_size: "divided by N twice (or averaged and then divided again)"}
    divisor = world_size / factor if factor > 0 else 0.0
    if factor not in known and divisor > 1 and abs(divisor - round(divisor)) < 1e-6:
        known[factor] = (f"summed and divided by {round(divisor)} on {world_size} ranks, not by N = {world_size}: "
                         "a number other than N")
    name = next((text for f, text in known.items() if abs(factor - f) < 1e-6), None)
    if name:
        return f"rank {rank}'s gradients were {name}."
    return (f"rank {rank}'s update is {factor:.4g} x the average gradient's, where one process's is 1 x, with the "
            "learning rate you were given.")
