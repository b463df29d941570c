"""The grader of notebook 01's "your turn": gradients averaged by hand after backward(), on real ranks.

`check_average_gradients(fn)` trains the same small model on 3, 2 and 4 ranks, each rank on its own equal shard
of one batch, a few SGD steps, calling the student's `fn(model)` between backward() and optimizer.step()
(`labkit.exercises.average_guard`). `fn` should replace every parameter's .grad by its average over the ranks:
dist.all_reduce (SUM), then divide by N (Li et al., "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training", VLDB 2020, 3.2.1). Because the loss is a mean and the shards are equal, that average is the
gradient of the whole batch in one process. A solution passes only if, on every case, on every rank:

- it communicated through dist.all_reduce only (torch's DistributedDataParallel and labkit.parallel's
  average_gradients and BucketedDDP do the exercise for you and are switched off), reduced the gradients rather
  than the parameters, with ReduceOp.SUM (or AVG), and waited for every async_op=True handle: handle.wait(),
  a loop on handle.is_completed(), or its future's wait() (handle.get_future().wait(),
  torch.futures.wait_all); taking the future, chaining then() on it, or a loop on its done() or value(), does
  not wait (on GPUs done() is True once the all_reduce is queued: `wait_watch.WaitWatch`);
- after fn, every gradient equals the full-batch gradient of one process (float64, within 1e-9), at every step;
- the replicas stay identical, and equal to one process trained on the whole batch.
"""

from __future__ import annotations

import labkit
from labkit.checks import timeout_seconds as checked_timeout
from labkit.exercises.allreduce import TIMEOUT_SECONDS
from labkit.exercises.average_guard import (
    BATCH,
    FUTURE_POLLS,
    STEPS,
    OutOfStep,
    attempt_average,
    average_model,
    calls_of_last_average,
    reference_run,
)
from labkit.exercises.guard import first_failure, forbidden_message, stop_pool, where_ranks_waited
from labkit.exercises.progress import graded
from labkit.exercises.verdict import Verdict
from labkit.launch.errors import NoReply

__all__ = ["AVERAGE_CASES", "TOLERANCE", "check_average_gradients"]

AVERAGE_CASES = (3, 2, 4)  # three first: rank + 1, N - 1 and N differ there
TOLERANCE = 1e-9  # float64: a right average is within 1e-15; every mistake is off by far more
_NAMES = [name for name, _ in average_model().named_parameters()]


@graded("average_gradients")
def check_average_gradients(fn, *, timeout_seconds: float = TIMEOUT_SECONDS) -> Verdict:
    """Grade `fn(model)`: every parameter's .grad replaced by its average over the ranks (module docstring).

    Example::

        >>> import torch.distributed as dist
        >>> def summed(model):                       # all-reduced, but never divided by N
        ...     for p in model.parameters():
        ...         dist.all_reduce(p.grad)
        >>> check_average_gradients(summed)
        Not yet. On 3 ranks (a batch of 24 rows, 8 per rank), ...is 3x one process's...summed, not averaged.
    """
    timeout_seconds = checked_timeout("timeout_seconds", timeout_seconds)
    if not callable(fn):
        return Verdict(False, "pass your function itself, e.g. check_average_gradients(average_gradients), not "
                              f"{type(fn).__name__}.")
    reference = reference_run()
    for world_size in AVERAGE_CASES:
        problem = _case_problem(fn, world_size, reference, timeout_seconds)
        if problem:
            return Verdict(False, f"On {world_size} ranks (a batch of {BATCH} rows, {BATCH // world_size} per "
                                  f"rank), {problem}")
    return Verdict(True, f"on 2, 3 and 4 ranks, after your function every rank's gradients equal the gradient of "
                         f"the whole batch in one process, at each of {STEPS} SGD steps; the replicas stayed "
                         "identical and equal to one process trained on the whole batch. That is data "
                         "parallelism: one all_reduce (SUM) per gradient, then a division by N.")


def _case_problem(fn, world_size: int, reference, timeout_seconds: float) -> str | None:
    """What is wrong with fn on `world_size` ranks, or None. A run that left all_reduces unmatched stops the pool,
    or the next case's collectives would meet them."""
    try:
        outcomes = labkit.run(attempt_average, fn, world_size=world_size, timeout=timeout_seconds)
    except labkit.RankTimeout as hang:  # labkit stops a pool whose call timed out
        return _hang_message(hang, timeout_seconds)
    except labkit.RankError as error:
        sizes = None
        if not (error.pool_stopped or any(f.kind == NoReply.DIED for f in error.failures)):
            try:
                sizes = labkit.run(calls_of_last_average, world_size=world_size)
                _stop_pool_if_out_of_step(world_size, sizes)
            except labkit.RankError:
                pass  # then labkit has stopped the pool itself
        return _error_message(error, sizes)
    _stop_pool_if_out_of_step(world_size, [[c.numel for c in o.calls] for o in outcomes])
    return _calls_problem(outcomes) or _values_problem(outcomes, reference)


def _stop_pool_if_out_of_step(world_size: int, sizes: list[list[int]]) -> None:
    if any(s != sizes[0] for s in sizes):
        stop_pool(world_size)


def _calls_problem(outcomes) -> str | None:
    """A refused call, an all_reduce of the wrong thing, with the wrong op, or never waited for; else None."""
    for rank, outcome in enumerate(outcomes):
        if outcome.forbidden:
            return forbidden_message(rank, outcome.forbidden[0], True, _why_forbidden)
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
        if outcome.unwaited:
            return _unwaited_message(rank, outcome)
    return None


def _unwaited_message(rank: int, outcome) -> str:
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
            f"async_op=True in {STEPS} SGD steps and never waited for them{others}. get_future() and then() do "
            "not wait: the gradients were read (and divided, and stepped with) before the reduction finished, or "
            f"changed later under a callback. {FUTURE_POLLS}")


def _values_problem(outcomes, reference) -> str | None:
    """Gradients after fn against the whole batch's, step by step; then the replicas and the trained model."""
    ref_grads, ref_final = reference
    world_size = len(outcomes)
    for step in range(STEPS):
        problem = _step_problem([o.averaged[step] for o in outcomes], [o.local[step] for o in outcomes],
                                ref_grads[step], world_size)
        if problem:
            return f"at SGD step {step + 1} of {STEPS}, {problem}"
    for rank, outcome in enumerate(outcomes):
        if _gap(outcome.final, outcomes[0].final) > TOLERANCE:
            return f"the replicas drifted apart: rank {rank}'s parameters differ from rank 0's after {STEPS} steps."
        if _gap(outcome.final, ref_final) > TOLERANCE:
            return (f"rank {rank}'s model after {STEPS} steps differs from one process trained on the whole batch "
                    f"by {_gap(outcome.final, ref_final):.3g}: did your function change anything but .grad?")
    return None


def _step_problem(averaged, local, reference, world_size: int) -> str | None:
    """One step: which parameters kept their own gradient, or by what factor every gradient is off, per rank."""
    wrong = [[i for i, (got, want) in enumerate(zip(grads, reference, strict=True)) if _gap([got], [want]) > TOLERANCE]
             for grads in averaged]
    if not any(wrong):
        return None
    rank = next(r for r, w in enumerate(wrong) if w)
    kept = [i for i in wrong[rank] if _gap([averaged[rank][i]], [local[rank][i]]) <= TOLERANCE]
    if kept and len(kept) < len(reference):
        return (f"rank {rank}'s gradients of {_named(kept)} are still its own (not averaged), while "
                f"{_named([i for i in range(len(reference)) if i not in kept])} were: those parameters were left "
                "out of the average.")
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


def _hang_message(hang: labkit.RankTimeout, timeout_seconds: float) -> str:
    """A run that never finished: where the first ranks waited, and why all_reduce waits."""
    return (f"it never finished (stopped after {timeout_seconds:g} s): a rank waited in an all_reduce that the "
            f"others did not join with the same tensor. {where_ranks_waited(hang)}. Every rank must all-reduce the "
            "same gradients in the same order.")


def _error_message(error: labkit.RankError, sizes: list[list[int]] | None) -> str:
    """A run that raised: the first switched-off call, else the first rank's error (and what the ranks reduced)."""
    first, spelling = first_failure(error)
    if spelling is not None:
        return forbidden_message(first.rank, spelling, False, _why_forbidden)
    summary = first.summary.strip().removesuffix(".")
    if first.raised(OutOfStep) and first.exception_args:
        said = str(first.exception_args[0]).strip().removesuffix(".")
        return (f"{said}: the ranks all-reduced the gradients in different orders. On real "
                "ranks that sums unrelated tensors, or hangs, or aborts (gloo: 'Received data size doesn't match "
                "expected size'). Every rank must all-reduce the same gradients in the same order, whatever the rank.")
    message = f"rank {first.rank} raised {summary}."
    if "AVG" in first.summary:
        message += " gloo has no ReduceOp.AVG (NCCL has): on gloo the average is built from a sum."
    elif sizes and any(s != sizes[0] for s in sizes):
        message += (f" The ranks all-reduced tensors of different sizes in turn (rank 0: {sizes[0]}, rank "
                    f"{next(r for r, s in enumerate(sizes) if s != sizes[0])}: "
                    f"{next(s for s in sizes if s != sizes[0])} elements): every rank must reduce the same "
                    "gradients in the same order.")
    return message


def _why_forbidden(spelling: str, name: str) -> str:
    """Why the call `spelling` is switched off while the gradient average is graded, and what to use instead."""
    if "labkit.parallel" in spelling or "DistributedDataParallel" in spelling:
        return "That is a ready-made average, which does the exercise for you: it is switched off here."
    return ("This exercise allows one collective only, dist.all_reduce: other communication is switched off "
            "while it is graded.")
