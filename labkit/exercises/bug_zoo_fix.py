"""The grader of notebook 15's "your turn": fix a broken data-parallel training loop, on real ranks.

`check_fixed_training(fn)` calls the student's `fn(model, x, y, steps, lr)` on 3 and then 2 ranks. Each rank's
`model` starts from its own random initialisation (seed 100 + rank, as a script that seeds by rank does) and
(x, y) is its own equal shard of one batch. `fn` must train `steps` SGD steps (p -= lr x p.grad) so that every
rank ends where one process trained on the whole batch from rank 0's initial model ends: broadcast rank 0's
parameters before the first step, then, after each backward, all-reduce every gradient and divide it by N
(Li et al., "PyTorch Distributed", VLDB 2020, 3.2.1 and 3.2.2's "broadcast model states from one process").

What a right fix must not depend on is drawn afresh at each grading, per case (`draw_cases`): steps and lr
(different in the two cases, so a fix that hard-codes either fails one), the rows per rank, and the model's
sizes (features, hidden units).

The grader sees each rank's parameters at every training forward (a forward hook; a forward counts once a
backward reaches its output, so one that only logs the loss is no step) and at the end, and compares them,
in float64 within 1e-9, with one process's: where the first step goes wrong, the update a rank applied,
(p_k - p_k+1) / lr, says what is wrong with it (summed and not divided, divided by another number than N, not
averaged, gradients piling up without zero_grad, some parameters only). The exercise is gradient averaging with
dist.broadcast and dist.all_reduce: every other collective is switched off (gathering the data to train on the
whole batch everywhere is not data parallel), and so is what an allowed collective carries when it is not what
the exercise is about: a broadcast or an all_reduce of the rank's data (the whole batch gathered shard by shard,
or by summing zero-padded shards) and an all_reduce of the parameters themselves once training has begun
(parameter averaging, which plain SGD cannot tell from gradient averaging but Adam can). torch's
DistributedDataParallel and labkit.parallel's broadcast_parameters and average_gradients do the fix for you and
are switched off too. A broadcast or all_reduce started with async_op=True must be waited for (its handle or its
future): one never waited for is named first.

Written on the graders' kit (labkit.exercises._kit): a `Spec` driven by the kit's runner, calls recorded as the
kit's `Call`, the kit's messages.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

import labkit
from labkit.exercises._kit._group_call import GroupCall, Kind, wrap_group_method
from labkit.exercises._kit._guard import Guard
from labkit.exercises._kit._messages import failure_sentence, first_failure, unwaited_message, where_ranks_waited
from labkit.exercises._kit._record import Call, Recorder
from labkit.exercises._kit._runner import Case, Spec, grade
from labkit.exercises._kit._stack import outermost_caller
from labkit.exercises.allreduce import TIMEOUT_SECONDS
from labkit.exercises.progress import graded
from labkit.exercises.verdict import Verdict
from labkit.models import mlp

__all__ = ["DRAWN", "check_fixed_training", "draw_cases"]

FIX_WORLD_SIZES = (3, 2)  # three first: N, N - 1 and rank + 1 differ there
# Drawn per case (the two cases' steps and lr differ). No lr is 0.1, the old constant, nor one that a hard-coded 0.1
# would look like a divisor of the sum by (10 N lr is no integer for N = 2, 3): such a fix is told it stepped with
# another lr. The old 3 steps is one draw among others: the other case's steps differ.
DRAWN = {"steps": (2, 3, 4, 5), "lr": (0.06, 0.07, 0.08, 0.09, 0.11, 0.12, 0.13, 0.14),
         "rows": tuple(range(3, 7)), "features": tuple(range(4, 8)), "hidden": tuple(range(6, 11))}
TOLERANCE = 1e-9  # float64: a right fix is within 1e-15; every mistake is off by far more
PARAMETER_AVERAGE = "dist.all_reduce on the parameters themselves after training began"
DATA_GATHERED = "of this rank's shard of the data (x)"  # after "dist.all_reduce " or "dist.broadcast "
_READY_MADE = ("labkit.parallel's broadcast_parameters", "labkit.parallel's average_gradients")
_DATA_PARALLEL = Path(labkit.__file__).parent / "parallel" / "data.py"  # broadcast_parameters, average_gradients


def _ready_made(file: Path, name: str) -> str | None:
    """How the student spells a frame of labkit.parallel's data parallelism, for the kit's outermost_caller."""
    return f"labkit.parallel's {name}" if file == _DATA_PARALLEL else None


def draw_cases() -> list[Case]:
    """One case per world size, each with its own steps and lr (the two cases' differ), rows per rank and model
    sizes, drawn afresh at each grading."""
    steps, lrs = random.sample(DRAWN["steps"], 2), random.sample(DRAWN["lr"], 2)
    return [Case(world_size, {"steps": steps[i], "lr": lrs[i],
                              **{name: random.choice(DRAWN[name]) for name in ("rows", "features", "hidden")}})
            for i, world_size in enumerate(FIX_WORLD_SIZES)]


def fix_model(rank: int, case: Case, device=None) -> torch.nn.Module:
    """Rank `rank`'s model before the fix: features -> hidden -> 3, float64, seeded by the rank (replicas
    differ)."""
    return mlp(features=case["features"], hidden=case["hidden"], classes=3, layers=1, seed=100 + rank,
               dtype=torch.float64).to(device)


def _batch(case: Case, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch (x, y) of the case; rank r trains on rows [r rows, (r + 1) rows)."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(case["rows"] * case.world_size, case["features"], generator=generator, dtype=torch.float64)
    return x.to(device), torch.randint(0, 3, (x.shape[0],), generator=generator).to(device)


_NAMES = ("0.weight", "0.bias", "2.weight", "2.bias")  # mlp(layers=1)'s parameters, whatever the sizes


@dataclass
class FixOutcome:
    """One rank's run: its parameters (flattened per parameter) at each training forward (one whose output a
    backward went through: a forward under torch.no_grad() to log the loss is not a step) and at the end, and the
    collectives it started with async_op=True and never waited for (the kit's records)."""

    forwards: list[tuple[list[list[float]], list[bool]]] = field(default_factory=list)  # (parameters, trained?)
    starts: list[list[list[float]]] = field(default_factory=list)
    final: list[list[float]] = field(default_factory=list)
    unwaited: list[Call] = field(default_factory=list)

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


class FixGuard(Guard):
    """While the student's training runs on a rank: dist.broadcast and dist.all_reduce allowed and recorded (the
    kit's Recorder), every other collective refused (gathering the data or the parameters is not data
    parallelism), and so are torch's DDP, labkit.parallel's broadcast_parameters and average_gradients (found on
    the call stack, by the kit's outermost_caller), a collective of the rank's data, and an all_reduce of the
    parameters' values once the first forward has run (parameter averaging, not gradient averaging): what a
    collective carries is checked, not only that it was made."""

    def __init__(self, model: torch.nn.Module, shard: torch.Tensor, outcome: FixOutcome):
        super().__init__()
        self._model, self._shard, self._outcome = model, shard.detach().reshape(-1), outcome
        self.recorder = Recorder()

    def install(self) -> None:
        """Broadcast and all_reduce watched, every other collective and DDP refused, the handles watched."""
        self.switch_off_torch_distributed(allowed=("all_reduce", "allreduce", "broadcast", "barrier"),
                                          point_to_point=False)
        self.switch_off(torch.nn.parallel.DistributedDataParallel, "__init__",
                        "torch.nn.parallel.DistributedDataParallel")
        for kind in (Kind.ALLREDUCE, Kind.BROADCAST):
            wrap_group_method(self, kind, self._watched)
        self.recorder.watch_waits(self)

    def refuse(self, spelling: str):
        """Refuse `spelling`, named as the ready-made fix that called it when there is one (broadcast_parameters
        checks the replicas' shapes with all_gather_object before it broadcasts)."""
        super().refuse(outermost_caller(_ready_made) or spelling)

    def _watched(self, made: GroupCall):
        """An allreduce or broadcast: the ready-made fixes, the data gathered and parameter averaging refused,
        else recorded (what it was made on, in `target`) and made."""
        if outermost_caller(_ready_made):
            self.refuse(str(made.kind))
        if self._holds_data(made.tensors):
            self.refuse(f"dist.{'all_reduce' if made.kind == Kind.ALLREDUCE else made.kind} {DATA_GATHERED}")
        if made.kind == Kind.ALLREDUCE and self._outcome.forwards and self._holds_parameters(made.tensors):
            self.refuse(PARAMETER_AVERAGE)
        call = self.recorder.record(made, target=self._describe(made.kind, made.tensors))
        return self.recorder.launched(made.proceed(), call)

    def _describe(self, kind: Kind, tensors) -> str:
        """'dist.broadcast of the parameter 0.weight', 'dist.all_reduce of the gradient of 0.bias', or '... of a
        tensor of 48 elements': what a call was made on, for a message."""
        tensor = tensors[0]
        pointer = tensor.untyped_storage().data_ptr()
        named = [(f"the parameter {n}", p) for n, p in self._model.named_parameters()] + [
            (f"the gradient of {n}", p.grad) for n, p in self._model.named_parameters() if p.grad is not None]
        what = next((n for n, t in named if t.untyped_storage().data_ptr() == pointer),
                    f"a tensor of {tensor.numel()} elements")
        return f"dist.{'all_reduce' if kind == Kind.ALLREDUCE else kind} of {what}"

    def _holds_parameters(self, tensors) -> bool:
        """Whether an all_reduce's tensors are parameters: their memory, one's values, or all of them flattened."""
        params = list(self._model.parameters())
        memory = {p.untyped_storage().data_ptr() for p in params}
        values = [p.detach().reshape(-1) for p in params] + [torch.cat([p.detach().reshape(-1) for p in params])]
        for tensor in tensors:
            flat = tensor.detach().reshape(-1)
            if tensor.untyped_storage().data_ptr() in memory or any(
                    v.numel() == flat.numel() and v.dtype == flat.dtype and torch.equal(v, flat) for v in values):
                return True
        return False

    def _holds_data(self, tensors) -> bool:
        """Whether a collective's tensor holds this rank's shard of x, its values in a row anywhere in it (the
        shard broadcast, or a zero-padded copy of the whole batch summed into every rank's)."""
        shard = self._shard
        for tensor in tensors:
            flat = tensor.detach().reshape(-1).to(shard.dtype)
            if flat.numel() >= shard.numel() and bool(
                    (flat.unfold(0, shard.numel(), 1) == shard).all(dim=1).any()):
                return True
        return False


def _flat(model: torch.nn.Module) -> list[list[float]]:
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


def attempt_fix(fn, case: Case) -> FixOutcome:
    """On a rank: fn(model, x, y, steps, lr) on this rank's model and shard, under the guard."""
    rank, device = labkit.rank(), labkit.device()
    model, (x, y) = fix_model(rank, case, device), _batch(case, device)
    rows = slice(rank * case["rows"], (rank + 1) * case["rows"])
    outcome = FixOutcome()
    hook = model.register_forward_hook(lambda module, args, output: outcome.watch_forward(module, output))
    guard = FixGuard(model, x[rows], outcome)
    try:
        with guard:
            fn(model, x[rows], y[rows], case["steps"], case["lr"])
    finally:
        hook.remove()
    outcome.unwaited = guard.recorder.unwaited()
    outcome.close(model)
    return outcome


@dataclass
class _Reference:
    """One process on the whole batch from rank 0's model: parameters before each step and at the end, the
    whole batch's gradient at each step, and each rank's own (shard) gradient there."""

    params: list[list[list[float]]]
    grads: list[list[torch.Tensor]]
    local: list[list[list[torch.Tensor]]]  # [rank][step][parameter]


def _reference(case: Case) -> _Reference:
    model, (x, y) = fix_model(0, case), _batch(case)
    shards = [slice(r * case["rows"], (r + 1) * case["rows"]) for r in range(case.world_size)]
    ref = _Reference([], [], [[] for _ in range(case.world_size)])
    for _ in range(case["steps"]):
        ref.params.append(_flat(model))
        for rank, rows in enumerate(shards):
            ref.local[rank].append(_gradients(model, x[rows], y[rows]))
        ref.grads.append(_gradients(model, x, y))
        with torch.no_grad():
            for p, g in zip(model.parameters(), ref.grads[-1], strict=True):
                p -= case["lr"] * g.view_as(p)
    ref.params.append(_flat(model))
    return ref


def _gradients(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    return [p.grad.detach().reshape(-1).clone() for p in model.parameters()]


def _describe(case: Case) -> str:
    """How a verdict starts: 'On 3 ranks (a batch of 15 rows, 5 per rank; steps=4, lr=0.12)'."""
    return (f"On {case.world_size} ranks (a batch of {case['rows'] * case.world_size} rows, {case['rows']} per "
            f"rank; steps={case['steps']}, lr={case['lr']:g})")


def _why_forbidden(spelling: str, name: str) -> str:
    """Why a refused call is off in this exercise (after the kit's "rank r called ...")."""
    if spelling == PARAMETER_AVERAGE:
        return ("That averages the replicas' parameters after local steps (parameter averaging), not their "
                "gradients (p.data, or a copy of their values, all-reduced). With plain SGD the two happen to agree; "
                "with a nonlinear optimizer such as Adam they do not.")
    if spelling.endswith(DATA_GATHERED):
        return ("Sent to every rank (broadcast, or summed as zero-padded shards), the shards make the whole batch "
                "everywhere: each rank then trains on all of it, one process's run N times over, not data "
                "parallelism, where each rank trains on its own shard and the ranks exchange gradients, not data.")
    if "labkit.parallel" in spelling or "DistributedDataParallel" in spelling:
        return "It does the fix for you and is switched off here. This exercise allows dist.broadcast and " \
               "dist.all_reduce."
    return ("This exercise allows only dist.broadcast and dist.all_reduce. In data parallelism each rank trains on "
            "its own shard and the ranks exchange gradients, not data (gathering the data to train on the whole "
            "batch everywhere is not data parallel).")


def _on_hang(hang: labkit.RankTimeout, case: Case, timeout_seconds: float) -> str:
    return (f"the ranks did not finish within {timeout_seconds:g} s: {where_ranks_waited(hang, case.world_size)}. "
            "A collective returns only when every rank of the group calls it: each broadcast and all_reduce must "
            "be called on every rank, rank 0 included, in the same order.")


def _on_error(error: labkit.RankError, attempts, case: Case) -> str:
    failure, _ = first_failure(error)
    if failure.raised(NotImplementedError):  # its text, "your turn", marks the untouched stub: no attempt
        summary = failure.summary.strip().removesuffix(".")
        return f"your function raised {summary}: delete the stub's `raise`, then fix the loop below it."
    return failure_sentence(failure)


def _passed(cases) -> str:
    drawn = " and ".join(f"{c['steps']} steps at lr={c['lr']:g} on {c.world_size} ranks" for c in cases)
    return (f"with {drawn}, every replica started from rank 0's parameters and took, at each step, the update of "
            "one process on the whole batch: the run is one process's, spread over the ranks. A broadcast at the "
            "start and an average (all_reduce, then divide by N) after every backward is all data parallelism "
            "needs.")


def _unwaited_problem(outcomes: list[FixOutcome], case: Case) -> str | None:
    """The first rank with collectives started with async_op=True and never waited for: until its handle's
    wait() returns, the tensor may not hold the result yet (torch.distributed docs, "Synchronous and asynchronous
    collective operations")."""
    for rank, outcome in enumerate(outcomes):
        if outcome.unwaited:
            kinds = sorted({"all_reduce" if c.kind == Kind.ALLREDUCE else str(c.kind) for c in outcome.unwaited})
            return unwaited_message(rank, outcome.unwaited, "/".join(kinds), (
                f"the first was {outcome.unwaited[0].target}. With async_op=True the call returns at once, while "
                "the collective may still be running: what you read or change next races with it"))
    return None


def _steps_problem(outcomes: list[FixOutcome], case: Case) -> str | None:
    for rank, outcome in enumerate(outcomes):
        if len(outcome.starts) != case["steps"]:
            return (f"rank {rank} ran {len(outcome.starts)} forward passes with a backward for "
                    f"steps={case['steps']}: train exactly `steps` steps, one forward and one backward each (a "
                    "forward whose loss is only logged, with no backward, is not counted).")
    return None


def _start_problem(outcomes: list[FixOutcome], case: Case) -> str | None:
    """Before the first step every replica must hold rank 0's initial parameters."""
    rank0_init = _flat(fix_model(0, case))
    for rank, outcome in enumerate(outcomes):
        problem = _rank_start_problem(rank, outcome.starts[0], rank0_init, outcomes, case)
        if problem:
            return problem
    return None


def _values_problem(outcomes: list[FixOutcome], case: Case) -> str | None:
    """The first step where the parameters leave one process's path, and why."""
    ref, steps = _reference(case), case["steps"]
    for step in range(steps):
        afters = [o.starts[step + 1] if step + 1 < steps else o.final for o in outcomes]
        problem = _factors_problem([o.starts[step] for o in outcomes], afters, ref.grads[step], case["lr"])
        for rank, outcome in enumerate(outcomes):
            problem = problem or _update_problem(rank, step, outcome.starts[step], afters[rank], ref, case["lr"])
        if problem:
            return f"at step {step + 1} of {steps}, {problem}"
    return None


SPEC = Spec(attempt=attempt_fix, cases=draw_cases,
            checks=(_unwaited_problem, _steps_problem, _start_problem, _values_problem),
            describe=_describe, why_forbidden=_why_forbidden, on_hang=_on_hang, on_error=_on_error,
            passed=_passed, example="check_fixed_training(train)", ready_made=_READY_MADE)


@graded("bug_zoo_fix")
def check_fixed_training(fn, *, timeout_seconds: float = TIMEOUT_SECONDS) -> Verdict:
    """Grade `fn(model, x, y, steps, lr)`: the broken training loop fixed (module docstring).

    Example::

        >>> def train(model, x, y, steps, lr):        # the notebook's stub, not yet filled in
        ...     raise NotImplementedError("your turn")
        >>> check_fixed_training(train, record=False)
        Not yet. On 3 ranks (a batch of ... rows, ... per rank; steps=..., lr=...), your function raised ...
    """
    return grade(SPEC, fn, timeout_seconds=timeout_seconds)


def _gap(a: list[float], b) -> float:
    return (torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs().max().item()


def _named(indices: list[int]) -> str:
    return ", ".join(_NAMES[i] for i in indices)


def _applied(before, after, lr: float) -> list[torch.Tensor]:
    """The gradient an SGD step used: (parameters before - after) / lr, per parameter."""
    return [(torch.as_tensor(b, dtype=torch.float64) - torch.as_tensor(a, dtype=torch.float64)) / lr
            for b, a in zip(before, after, strict=True)]


def _factor(applied, average) -> float | None:
    """c when the applied update is c x the average gradient (to 1e-6 of its largest element), else None."""
    g, a = torch.cat(applied), torch.cat(average)
    factor = (g @ a / (a @ a)).item()
    return factor if _gap(g.tolist(), factor * a) <= 1e-6 * a.abs().max().item() else None


def _factors_problem(befores, afters, average, lr: float) -> str | None:
    """Ranks that scaled the average gradient by different factors (a divisor that depends on the rank)."""
    factors = [_factor(_applied(b, a, lr), average) for b, a in zip(befores, afters, strict=True)]
    if None in factors or max(factors) - min(factors) < 1e-6:
        return None
    shown = ", ".join(f"rank {rank}: {factor:.3g} x" for rank, factor in enumerate(factors))
    return (f"the ranks scaled the average gradient by different factors ({shown}), so the replicas drift apart: "
            "a divisor that depends on the rank.")


def _rank_start_problem(rank: int, start, rank0_init, outcomes, case: Case) -> str | None:
    """Rank `rank`'s parameters at its first step against rank 0's initial ones."""
    wrong = [i for i, (got, want) in enumerate(zip(start, rank0_init, strict=True)) if _gap(got, want) > TOLERANCE]
    if not wrong:
        return None
    own = _flat(fix_model(rank, case))
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


def _update_problem(rank: int, step: int, before, after, ref: _Reference, lr: float) -> str | None:
    """The update rank `rank` applied at `step`, (before - after) / lr, against the average gradient there."""
    if all(_gap(a, b) <= TOLERANCE for a, b in zip(after, ref.params[step + 1], strict=True)):
        return None
    applied = _applied(before, after, lr)
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
    return _scaled_message(rank, applied, average, world_size, lr)


def _scaled_message(rank: int, applied, average, world_size: int, lr: float) -> str:
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
    return (f"rank {rank}'s update is {factor:.4g} x the average gradient's, where one process's is 1 x: as if it "
            f"stepped with lr = {factor * lr:.4g}, not the lr = {lr:g} you were given.")
