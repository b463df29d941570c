"""The grader of notebook 01's "your turn": gradients averaged by hand after backward(), on real ranks.

`check_average_gradients(fn)` trains small models on 3, 2 and 4 ranks, each rank on its own equal shard of one
batch, a few SGD steps, calling the student's `fn(model)` between backward() and optimizer.step()
(`labkit.exercises.average_guard`). `fn` should replace every parameter's .grad by its average over the ranks:
dist.all_reduce (SUM), then divide by N (Li et al., "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training", VLDB 2020, 3.2.1). Because the loss is a mean and the shards are equal, that average is the
gradient of the whole batch in one process.

What a right solution must not depend on is drawn afresh for each case of each grading (`draw_case`): the model's
sizes (never the notebook's), the batch's values, the lr and the number of steps (2-4); and each case trains two
models one after the other, so that a function that keeps something from an earlier call fails. It runs on the
graders' kit (`labkit.exercises._kit._runner`: one `Spec`, the one rule after a RankError). A solution passes only
if, on every case, on every rank:

- it communicated through dist.all_reduce only (torch's DistributedDataParallel and labkit.parallel's
  average_gradients and BucketedDDP do the exercise for you and are switched off, where they run: from a thread
  or a forked subprocess too), reduced the gradients rather than the parameters, with ReduceOp.SUM (or AVG), and
  waited for every async_op=True handle: handle.wait(), a loop on handle.is_completed(), or its future's wait()
  (handle.get_future().wait(), torch.futures.wait_all); taking the future, chaining then() on it, or a loop on its
  done() or value(), does not wait (on GPUs done() is True once the all_reduce is queued: `wait_watch.WaitWatch`);
- what every all_reduce took in is this rank's gradients of this call (one, or several flattened together, as
  they are or already divided by N): counting that an all_reduce was made is not checking that it averaged the
  gradients (a scratch tensor all-reduced while the average came from elsewhere fails);
- after fn, every gradient equals the full-batch gradient of one process (float64, within 1e-9), at every step
  of every model;
- the replicas stay identical, and equal to one process trained on the whole batch.
"""

from __future__ import annotations

import random

import labkit
from labkit.exercises._kit._messages import first_failure, hang_message
from labkit.exercises._kit._runner import Case, Spec, grade
from labkit.exercises.allreduce import TIMEOUT_SECONDS
from labkit.exercises.average_guard import (
    BATCH,
    FUTURE_POLLS,
    MODELS,
    READY_MADE,
    OutOfStep,
    attempt_average,
    average_model,
    draw_case,
    made_of_gradients,
    reference_run,
)
from labkit.exercises.progress import graded
from labkit.exercises.verdict import Verdict

__all__ = ["AVERAGE_CASES", "TOLERANCE", "check_average_gradients"]

AVERAGE_CASES = (3, 2, 4)  # three first: rank + 1, N - 1 and N differ there
TOLERANCE = 1e-9  # float64: a right average is within 1e-15; every mistake is off by far more
_NAMES = [name for name, _ in average_model().named_parameters()]  # the same whatever the sizes drawn
_ORDINAL = ("first", "second", "third")
_KEPT = ("something was kept from an earlier call (the parameters, their gradients or a buffer, on a global, a "
         "default argument or a class attribute). Your function is called on every step, and on more than one model: "
         "average the gradients of the model it is given, each time.")


@graded("average_gradients")
def check_average_gradients(fn, *, timeout_seconds: float = TIMEOUT_SECONDS) -> Verdict:
    """Grade `fn(model)`: every parameter's .grad replaced by its average over the ranks (module docstring).

    Example::

        >>> import torch.distributed as dist
        >>> def summed(model):                       # all-reduced, but never divided by N
        ...     for p in model.parameters():
        ...         dist.all_reduce(p.grad)
        >>> check_average_gradients(summed)
        Not yet. On 3 ranks (a batch of 24 rows, 8 per rank; ...is 3x one process's...summed, not averaged.
    """
    return grade(SPEC, fn, timeout_seconds=timeout_seconds)


def _draw_cases() -> list[Case]:
    """The cases of one grading, drawn afresh (average_guard.draw_case)."""
    rng = random.Random()
    return [draw_case(world_size, rng) for world_size in AVERAGE_CASES]


def _describe(case: Case) -> str:
    """How a verdict starts: the ranks, the batch, and what was drawn for the case."""
    n = case.world_size
    return (f"On {n} ranks (a batch of {BATCH} rows, {BATCH // n} per rank; models of {case['features']} features "
            f"and {case['hidden']} hidden units, lr {case['lr']:g}, {case['steps']} SGD steps each)")


def _passed(cases) -> str:
    return ("on 2, 3 and 4 ranks, with the model's sizes, the batch, the lr and the number of steps drawn afresh, "
            f"and {MODELS} models in turn, every all_reduce carried the rank's own gradients, and after your "
            "function every rank's gradients equal the gradient of the whole batch in one process, at each SGD "
            "step; the replicas stayed identical and equal to one process trained on the whole batch. That is "
            "data parallelism: one all_reduce (SUM) per gradient, then a division by N.")


def _calls_problem(outcomes, case: Case) -> str | None:
    """An all_reduce of the wrong thing, with the wrong op, or never waited for; else None."""
    for rank, outcome in enumerate(outcomes):
        if not outcome.calls:
            return (f"rank {rank} made no all_reduce: each rank kept its own gradient, so the replicas step with "
                    "different gradients.")
        call = next((c for c in outcome.calls if c.op not in ("SUM", "AVG")), None)
        if call:
            return (f"rank {rank} all-reduced with ReduceOp.{call.op}: that keeps the {call.op.lower()} over the "
                    "ranks, not their sum.")
        if any(c.target == "data" for c in outcome.calls):
            return (f"rank {rank} all-reduced a parameter's values (p or p.data), not its gradient: that sums the "
                    "weights over the ranks, while the gradients that backward() left in p.grad stay each rank's own.")
        if any(c.target == "earlier" for c in outcome.calls):
            return (f"rank {rank} all-reduced the gradients of a model from an earlier call of your function, not "
                    f"those of the model it was given: {_KEPT}")
        if outcome.unwaited:
            return _unwaited_message(rank, outcome, case)
    return None


def _unwaited_message(rank: int, outcome, case: Case) -> str:
    """All_reduces started with async_op=True that nobody waited for: through their handle, or their future."""
    futures = [call for call in outcome.unwaited if call.future]
    if not futures:
        return (f"rank {rank} started {len(outcome.unwaited)} all_reduce(s) with async_op=True and never called "
                "wait() on the handle: the values were read (and divided, and stepped with) before the "
                "reduction finished.")
    waited = sum(call.future for call in outcome.calls) - len(futures)
    others = f", though it waited for {waited} other(s): one future's wait() promises only its own all_reduce" \
        if waited else ""
    return (f"rank {rank} took the futures (handle.get_future()) of {len(futures)} all_reduce(s) with "
            f"async_op=True in {len(outcome.averaged)} calls of your function ({MODELS} models, {case['steps']} "
            f"SGD steps each) and never waited for them{others}. get_future() and then() do not wait: the "
            "gradients were read (and divided, and stepped with) before the reduction finished, or changed later "
            f"under a callback. {FUTURE_POLLS}")


def _contents_problem(outcomes, case: Case) -> str | None:
    """What every all_reduce took in must be this rank's gradients of this call (as they are, or divided by N,
    one or several flattened together): else it reduced a scratch tensor, or gradients kept from an earlier call."""
    n = case.world_size
    for rank, outcome in enumerate(outcomes):
        for call in outcome.calls:
            index = call.facts["call"]
            if made_of_gradients(call.values, outcome.local[index], n):
                continue
            where = _where(index, case)
            earlier = [grads for i in range(index) for grads in (outcome.local[i], outcome.averaged[i])]
            if any(made_of_gradients(call.values, grads, n) for grads in earlier):
                return (f"{where} rank {rank} all-reduced gradients of an earlier call of your function, not this "
                        "call's: something was kept from an earlier call (the parameters or their gradients on a "
                        "global, a default argument or a class attribute). Work on the model you are given, each "
                        "time.")
            total = sum(len(g) for g in outcome.local[index])
            return (f"{where} rank {rank} all-reduced a tensor of {call.numel} numbers whose values are not its "
                    f"gradients (this model's gradients hold {total} numbers): an all_reduce of a scratch tensor, "
                    "while the average came from elsewhere (or from sizes written in by hand, which change here), "
                    "is not the gradients averaged by it. All-reduce the gradients themselves (or a flat copy of "
                    "them) and take the average from what comes back.")
    return None


def _where(index: int, case: Case) -> str:
    """'On the second model, at SGD step 2 of 3,': which call of fn `index` is."""
    model, step = divmod(index, case["steps"])
    return f"on the {_ORDINAL[model]} model, at SGD step {step + 1} of {case['steps']},"


def _values_problem(outcomes, case: Case) -> str | None:
    """Gradients after fn against the whole batch's, call by call; then the replicas and the trained models."""
    ref_grads, ref_finals = reference_run(case)
    world_size = len(outcomes)
    for index, reference in enumerate(ref_grads):
        problem = _step_problem([o.averaged[index] for o in outcomes], [o.local[index] for o in outcomes],
                                reference, world_size, [o.averaged[:index] for o in outcomes])
        if problem:
            return f"{_where(index, case)} {problem}"
    for model, ref_final in enumerate(ref_finals):
        for rank, outcome in enumerate(outcomes):
            said = f"after the {_ORDINAL[model]} model's {case['steps']} steps"
            if _gap(outcome.final[model], outcomes[0].final[model]) > TOLERANCE:
                return f"the replicas drifted apart: rank {rank}'s parameters differ from rank 0's {said}."
            if _gap(outcome.final[model], ref_final) > TOLERANCE:
                return (f"rank {rank}'s model {said} differs from one process trained on the whole batch by "
                        f"{_gap(outcome.final[model], ref_final):.3g}: did your function change anything but .grad?")
    return None


def _step_problem(averaged, local, reference, world_size: int, before) -> str | None:
    """One call of fn: which parameters kept their own gradient, a result kept from an earlier call, or by what
    factor every gradient is off, per rank."""
    wrong = [[i for i, (got, want) in enumerate(zip(grads, reference, strict=True)) if _gap([got], [want]) > TOLERANCE]
             for grads in averaged]
    if not any(wrong):
        return None
    rank = next(r for r, w in enumerate(wrong) if w)
    if any(_gap(averaged[rank], earlier) <= TOLERANCE for earlier in before[rank]):
        return f"rank {rank}'s gradients after your function are what it left at an earlier step: {_KEPT}"
    kept = [i for i in wrong[rank] if _gap([averaged[rank][i]], [local[rank][i]]) <= TOLERANCE]
    if kept and len(kept) < len(reference):
        return (f"rank {rank}'s gradients of {_named(kept)} are still its own (not averaged), while "
                f"{_named([i for i in range(len(reference)) if i not in kept])} were: those parameters were left "
                "out of the average.")
    if kept:
        return f"rank {rank}'s gradients are all still its own: the average never reached p.grad."
    divisors = [_divisor(grads, reference, world_size) for grads in averaged]
    return _factor_message(rank, divisors, world_size, _named(wrong[rank][:1])) or (
        f"rank {rank}'s gradient of {_named(wrong[rank][:1])} differs from one process's on the whole batch by "
        f"{_gap([averaged[rank][wrong[rank][0]]], [reference[wrong[rank][0]]]):.3g}: it is neither its own "
        "gradient nor the average over the ranks.")


def _divisor(grads, reference, world_size: int) -> float | None:
    """d when grads = sum over ranks / d (the whole batch's gradient is sum / N), for one d; else None."""
    flat_got = [x for g in grads for x in g]
    flat_want = [x * world_size for g in reference for x in g]
    scale = sum(a * b for a, b in zip(flat_got, flat_want, strict=True)) / sum(b * b for b in flat_want)
    if scale == 0 or _gap([flat_got], [[scale * b for b in flat_want]]) > TOLERANCE * world_size:
        return None
    return round(1 / scale, 6)


def _factor_message(rank: int, divisors: list[float | None], world_size: int, name: str) -> str | None:
    """The message for gradients off by one factor: not divided, divided by the wrong N, or twice; `name` is the
    first wrong parameter's, where the factor shows."""
    d = divisors[rank]
    if d is None:
        return None
    if len(set(divisors)) > 1 and None not in divisors:
        each = ", ".join(f"rank {r}: {x:g}" for r, x in enumerate(divisors))
        return (f"the ranks divided the sum by different numbers ({each}): a divisor that depends on the rank, "
                "so the replicas step differently.")
    said = f"rank {rank}'s gradient of {name} is"
    if d == 1:
        return (f"{said} {world_size}x one process's on the whole batch: the {world_size} ranks' gradients were "
                "summed, not averaged.")
    if abs(d - world_size ** 2) < 1e-6:
        return (f"{said} 1/{world_size} of one process's: the sum over the ranks was divided by N twice (by {d:g} "
                f"= {world_size}^2). ReduceOp.AVG, if you used it, already divides.")
    return f"{said} the sum over the ranks divided by {d:g}, not by N = {world_size}: a number other than N."


def _gap(got, want) -> float:
    """The largest absolute difference between two lists of lists of floats (inf if their shapes differ)."""
    if [len(g) for g in got] != [len(w) for w in want]:
        return float("inf")
    return max((abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True)), default=0.0)


def _named(indices: list[int]) -> str:
    return ", ".join(_NAMES[i] for i in indices)


def _hang_message(hang: labkit.RankTimeout, case: Case, timeout_seconds: float) -> str:
    """A run that never finished: where the first ranks waited, and why all_reduce waits."""
    return hang_message(hang, timeout_seconds, "a rank waited in an all_reduce that the others did not join with "
                                               "the same tensor. Every rank must all-reduce the same gradients in "
                                               "the same order.")


def _error_message(error: labkit.RankError, attempts, case: Case) -> str:
    """A run that raised (not a refused call: the runner says those): ranks out of step, else the first rank's
    error, and what the ranks reduced, or what was drawn when the sizes did not fit."""
    first, _ = first_failure(error)
    summary = first.summary.strip().removesuffix(".")
    if first.raised(OutOfStep) and first.exception_args:
        said = str(first.exception_args[0]).strip().removesuffix(".")
        return (f"{said}: the ranks all-reduced the gradients in different orders. On real "
                "ranks that sums unrelated tensors, or hangs, or aborts (gloo: 'Received data size doesn't match "
                "expected size'). Every rank must all-reduce the same gradients in the same order, whatever the rank.")
    message = f"rank {first.rank} raised {summary}."
    sizes = [[call.numel for call in attempt.calls] for attempt in attempts] if attempts else None
    if "AVG" in first.summary:
        message += " gloo has no ReduceOp.AVG (NCCL has): on gloo the average is built from a sum."
    elif sizes and any(s != sizes[0] for s in sizes):
        message += (f" The ranks all-reduced tensors of different sizes in turn (rank 0: {sizes[0]}, rank "
                    f"{next(r for r, s in enumerate(sizes) if s != sizes[0])}: "
                    f"{next(s for s in sizes if s != sizes[0])} elements): every rank must reduce the same "
                    "gradients in the same order.")
    elif any(word in first.summary for word in ("size", "shape", "split")):
        message += (f" The model's sizes are drawn for each grading (here {case['features']} features and "
                    f"{case['hidden']} hidden units, not the notebook's 6 and 8), and each case trains {MODELS} "
                    "models: sizes written into your function, or a tensor kept from an earlier call (on a global or "
                    "a class attribute), do not fit. Take them from this call's gradients (p.grad.numel(), "
                    "p.grad.shape).")
    return message


def _why_forbidden(spelling: str, name: str) -> str:
    """Why the call `spelling` is switched off while the gradient average is graded, and what to use instead."""
    if "labkit.parallel" in spelling or "DistributedDataParallel" in spelling:
        return "That is a ready-made average, which does the exercise for you: it is switched off here."
    return ("This exercise allows one collective only, dist.all_reduce: other communication is switched off "
            "while it is graded.")


SPEC = Spec(attempt=attempt_average, cases=_draw_cases, checks=(_calls_problem, _contents_problem, _values_problem),
            describe=_describe, why_forbidden=_why_forbidden, on_hang=_hang_message, on_error=_error_message,
            passed=_passed, example="check_average_gradients(average_gradients)", ready_made=READY_MADE)
