"""The grader of notebook 11's "your turn": ZeRO-1's step, which the student writes, run on real ranks.

`check_sharded_step(fn)` calls `fn(param, grad, lr)` on 2, 3 and 4 ranks: the fixed STEP_CASES, then two runs
drawn afresh at each grading (`draw_runs`: world size, dtype, sizes, lr and the inputs' values), in each of which
the same ranks call fn twice, on fresh inputs of another size and lr, so that a step that keeps state from its
first call, hard-codes lr or a dtype, or leans on the fixed inputs, shows. `param` is the model's flat 1-D
parameter vector, the same on every rank; `grad` is this rank's gradient, different on every rank
(`step_inputs`); both live on labkit.device(). The step is the heart of ZeRO-1 (Rajbhandari et al., "ZeRO:
Memory Optimizations Toward Training Trillion Parameter Models", SC 2020, sections 5.1 and 7): rank r owns
slice r of `shard_sizes(numel, N)` (labkit.plan.counts, the cut of labkit.parallel's ShardedOptimizer), and

1. reduce-scatters the gradients, so that it receives only its slice, averaged over the ranks;
2. updates only its own slice of `param` with SGD (slice -= lr * averaged gradient slice);
3. all-gathers the updated slices, so that every rank's `param` is the whole updated vector again.

A solution passes only if, on every call (sizes that N divides, sizes it does not, fewer elements than ranks,
float32 and float64, several lr), on every rank:

- `param` ends equal to full SGD on the averaged gradient computed in one process, in its own memory, in its
  own dtype, on its own device (the step works in place; returning a new tensor fails);
- every collective it started with async_op=True it waited for (work.wait()) before the step returned;
- its collectives are a reduce-scatter and an all-gather (or one broadcast of each slice from its owner): no
  all_reduce, which would hand every rank the whole gradient; what it sent into the reduce-scatter toward rank d
  is slice d of its own gradient, and what it sent into the all-gather is its own updated slice, not gradients
  (every rank updating the whole vector gives the right values, but is not sharded);
- its traffic is ZeRO-1's, exactly what DDP's ring all-reduce moves: per rank, the reduce-scatter sends every
  slice but the one it completes and the all-gather every slice but the one it receives last, as the ring of
  notebook 03 does (`ring_nbytes_per_rank`): 2(N-1)/N x S bytes when N divides the size. gloo's all_gather
  needs equal sizes, so padding every slice to the largest is allowed: at most 2(N-1) x the largest slice.

The difficulty is ZeRO, not gloo's padding: `padded(flat, N)` hands the student a flat copy cut into N equal
pieces, piece r being slice r padded with zeros to the largest, which gloo's equal-size collectives take as
they are (`padded(...).view(N, -1)`: one row per rank), and `unpad_into(param, buffer, N)` puts the updated
slices back into `param`. Both are labkit.parallel.flat_shards' FlatLayout, which ZeRO's own buckets use.

The guard on each rank, which counts the collectives and refuses everything else, is in
`labkit.exercises.step_guard`; what is wrong with a step's values and traffic, in `labkit.exercises.step_values`
and `labkit.exercises.step_nbytes`.
"""

from __future__ import annotations

import random

import torch

import labkit
from labkit.checks import timeout_seconds as checked_timeout
from labkit.exercises._kit._messages import first_failure, forbidden_message, where_ranks_waited
from labkit.exercises.allreduce import TIMEOUT_SECONDS
from labkit.exercises.progress import graded
from labkit.exercises.step_guard import StepCase, StepOutcome, attempt_step, calls_of_last_attempt
from labkit.exercises.step_nbytes import step_traffic
from labkit.exercises.step_values import wrong_step
from labkit.exercises.verdict import Verdict
from labkit.launch.errors import NoReply
from labkit.parallel.flat_shards import FlatLayout
from labkit.plan.counts import shard_sizes

__all__ = ["DRAWN", "STEP_CASES", "check_sharded_step", "draw_runs", "padded", "unpad_into"]

# (world_size, numel, dtype): sizes N divides first, then sizes it does not, fewer elements than ranks, float64
STEP_CASES = [(3, 6, torch.float32), (2, 4, torch.float32), (4, 8, torch.float32), (3, 7, torch.float32),
              (4, 10, torch.float32), (2, 5, torch.float32), (4, 2, torch.float32), (3, 5, torch.float64)]
# Drawn at each grading: two runs of two calls each, on two different world sizes, one float32 and one float64
# (so that a hard-coded dtype shows whichever it is), sizes and lr of each call its own. No lr is 0.1 (the fixed
# cases'), nor a power of two (a float32 buffer in a float64 step would round invisibly), nor 0.1 / N for N = 2 to 4
# (a hard-coded 0.1 would then read as gradients summed, not averaged).
DRAWN = {"world_size": (2, 3, 4), "dtype": (torch.float32, torch.float64), "numel": tuple(range(5, 15)),
         "lr": (0.03, 0.07, 0.15, 0.2, 0.3, 0.4), "calls": 2}
ALLOWED = "dist.reduce_scatter (or reduce_scatter_tensor) and dist.all_gather (or all_gather_into_tensor, or " \
          "one dist.broadcast of each slice from its owner)"
PADDING_HINT = ("gloo's all_gather wants every rank's tensor the same size, and when N does not divide numel the "
                "slices differ by one element; the rows of the stub's padded copies are all one length.")
SAME_DTYPE_HINT = "Make every buffer like the tensor it holds a piece of: a buffer of another dtype or device."


def padded(flat: torch.Tensor, world_size: int) -> torch.Tensor:
    """A new 1-D buffer of `world_size` equal pieces: piece r is rank r's slice of `flat` (shard_sizes), followed
    by zeros up to the largest slice. `.view(world_size, -1)` gives one row per rank, all of one length, as
    gloo's all_gather and reduce_scatter want them.

    >>> padded(torch.arange(1.0, 8.0), 3).view(3, -1)      # 7 numbers over 3 ranks: slices of 3, 2 and 2
    tensor([[1., 2., 3.],
            [4., 5., 0.],
            [6., 7., 0.]])
    """
    layout = FlatLayout([flat.shape], world_size)
    buffer = flat.new_zeros(world_size * layout.piece)
    buffer[:layout.numel] = flat.reshape(-1)
    layout.spread(buffer)
    return buffer


def unpad_into(param: torch.Tensor, buffer: torch.Tensor, world_size: int) -> None:
    """`padded`'s inverse, in place: every piece of `buffer` (flat, or one row per rank) without its padding,
    copied into `param`, in param's own memory.

    >>> param = torch.zeros(7)
    >>> unpad_into(param, padded(torch.arange(1.0, 8.0), 3), 3); param
    tensor([1., 2., 3., 4., 5., 6., 7.])
    """
    layout = FlatLayout([param.shape], world_size)
    flat = buffer.reshape(-1).clone()
    layout.compact(flat)
    param.copy_(flat[:layout.numel].view_as(param))


@graded("sharded_step")
def check_sharded_step(fn, *, timeout_seconds: float = TIMEOUT_SECONDS) -> Verdict:
    """Grade `fn(param, grad, lr)`: ZeRO-1's step, in place, on 2, 3 and 4 ranks (see the module's docstring).

    Example::

        >>> import torch.distributed as dist
        >>> def all_reduce_step(param, grad, lr):       # right values, but every rank updates everything
        ...     dist.all_reduce(grad)
        ...     param -= lr * grad / dist.get_world_size()
        >>> check_sharded_step(all_reduce_step)
        Not yet. On 3 ranks, with 6 float32 parameters (S = 24 bytes; ...), rank 0 all-reduced the whole gradient...
    """
    timeout_seconds = checked_timeout("timeout_seconds", timeout_seconds)
    if not callable(fn):
        return Verdict(False, f"pass your function itself, e.g. check_sharded_step(sharded_sgd_step), not "
                              f"{type(fn).__name__}.")
    for steps in [[StepCase(*case)] for case in STEP_CASES] + draw_runs():
        problem = _case_problem(fn, steps, timeout_seconds)
        if problem:
            return Verdict(False, problem)
    return Verdict(True, "your sharded step gives full SGD's answer on the averaged gradient on 2, 3 and 4 ranks, "
                         "for sizes that N divides, sizes it does not and fewer elements than ranks, in float32 and "
                         "float64, with inputs and lr drawn for this grading, called more than once on the same "
                         "ranks. Each rank updated only its own slice, reduce-scattered its own gradient and "
                         "all-gathered its updated slice, and sent what DDP's all-reduce sends: a "
                         "reduce-scatter and an all-gather, 2(N-1)/N x S bytes per rank. ZeRO-1 keeps the "
                         "optimizer state of that slice only, 1/N of it, for the same traffic.")


def draw_runs() -> list[list[StepCase]]:
    """The drawn runs of one grading (DRAWN): each a list of calls on the same ranks, every call with its own size,
    lr and inputs; the two runs on different world sizes and dtypes."""
    world_sizes, dtypes = random.sample(DRAWN["world_size"], 2), random.sample(DRAWN["dtype"], 2)
    runs = []
    for world_size, dtype in zip(world_sizes, dtypes, strict=True):
        numels, lrs = random.sample(DRAWN["numel"], DRAWN["calls"]), random.sample(DRAWN["lr"], DRAWN["calls"])
        runs.append([StepCase(world_size, numel, dtype, lr, random.getrandbits(31))
                     for numel, lr in zip(numels, lrs, strict=True)])
    return runs


def _described(steps: list[StepCase], k: int | None) -> str:
    """'On 3 ranks, with 6 float32 parameters (S = 24 bytes; shard_sizes(6, 3) = [2, 2, 2])', with the call's lr
    and place when the inputs were drawn; k None: every call of the run."""
    case = steps[k or 0]
    dtype = str(case.dtype).removeprefix("torch.")
    if k is None and len(steps) > 1:
        sizes = " and ".join(f"{c.numel} (lr = {c.lr:g})" for c in steps)
        return f"On {case.world_size} ranks, in {len(steps)} calls with {sizes} {dtype} parameters"
    element_size = torch.empty(0, dtype=case.dtype).element_size()
    drawn = "" if case.draw is None else (f", drawn values, lr = {case.lr:g}; call {k + 1 if k else 1} of "
                                          f"{len(steps)} on these ranks, each on fresh inputs")
    return (f"On {case.world_size} ranks, with {case.numel} {dtype} parameters (S = {case.numel * element_size} "
            f"bytes; shard_sizes({case.numel}, {case.world_size}) = {shard_sizes(case.numel, case.world_size)}"
            f"{drawn})")


def _case_problem(fn, steps: list[StepCase], timeout_seconds: float) -> str | None:
    """What is wrong with fn in one run of calls on the same ranks, or None, the case described. A step that left
    collectives unmatched stops the pool, or the next run's collectives would meet them."""
    world_size = steps[0].world_size
    try:
        runs = labkit.run(attempt_step, fn, steps, world_size=world_size, timeout=timeout_seconds)
    except labkit.RankTimeout as hang:  # labkit stops a pool whose call timed out
        return f"{_described(steps, None)}, {_hang_message(hang, world_size, timeout_seconds)}"
    except labkit.RankError as error:
        if not (error.pool_stopped or any(f.kind == NoReply.DIED for f in error.failures)):
            try:
                _stop_pool_if_out_of_step(world_size, labkit.run(calls_of_last_attempt, world_size=world_size))
            except labkit.RankError:
                pass  # then labkit has stopped the pool itself
        return f"{_described(steps, None)}, {_error_message(error)}"
    _stop_pool_if_out_of_step(world_size, [[call.kind for o in run for call in o.calls] for run in runs])
    for k, case in enumerate(steps):
        outcomes = [run[k] for run in runs if len(run) > k]
        if len(outcomes) < world_size:
            break  # a call before this one was refused; reported below
        problem = _step_problem(outcomes, case)
        if problem:
            return f"{_described(steps, k)}, {problem}"
    problem = next((forbidden_message(rank, run[-1].forbidden[0], True, _why_forbidden)
                    for rank, run in enumerate(runs) if run[-1].forbidden), None)
    return f"{_described(steps, len(runs[0]) - 1)}, {problem}" if problem else None


def _step_problem(outcomes: list[StepOutcome], case: StepCase) -> str | None:
    """What is wrong with one call on every rank: a refused call, an unwaited one, the values, the traffic."""
    problem = next((forbidden_message(rank, o.forbidden[0], True, _why_forbidden)
                    for rank, o in enumerate(outcomes) if o.forbidden), None)
    return problem or _unwaited_message(outcomes) or wrong_step(outcomes, case) or step_traffic(outcomes, case)


def _unwaited_message(outcomes: list[StepOutcome]) -> str | None:
    """The first collective a rank started with async_op=True and never waited for: what it reads or writes may
    not be there yet (torch.distributed docs: an async op's output is only ready after wait() on its handle)."""
    for rank, outcome in enumerate(outcomes):
        call = next((c for c in outcome.calls if not c.waited), None)
        if call:
            future = " It took the handle's future (work.get_future()) but never waited on it either." \
                if call.future else ""
            return (f"rank {rank} started {call.describe()} with async_op=True and never waited for it.{future} "
                    "Until its handle's wait() returns, the collective may still be running: what it receives is "
                    "not there yet, and changing what it sends changes what the others get.")
    return None


def _stop_pool_if_out_of_step(world_size: int, kinds: list[list[str]]) -> None:
    """Stop the pool of `world_size` ranks if they did not all make the same collectives (a call left waiting,
    async_op=True without wait())."""
    if any(k != kinds[0] for k in kinds):
        labkit.shutdown(world_size=world_size)


def _hang_message(hang: labkit.RankTimeout, world_size: int, timeout_seconds: float) -> str:
    """A step that never finished: where the first ranks waited, and why collectives wait."""
    where = where_ranks_waited(hang)
    stopped = {f.rank for f in hang.failures if f.kind == NoReply.STOPPED}
    returned = sorted(set(range(world_size)) - stopped)
    where += f"; rank(s) {returned} had returned" if returned else ""
    return (f"it never finished (stopped after {timeout_seconds:g} s): some rank waited in a collective that the "
            f"others never joined. {where}. Every rank must make the same collectives in the same order: one "
            "reduce-scatter, then one all-gather (or one broadcast from each owner, in the same order everywhere), "
            "on every rank, even one whose slice is empty.")


def _error_message(error: labkit.RankError) -> str:
    """A step that raised: the first switched-off call it made, else the first rank's own error and a hint."""
    first, spelling = first_failure(error)
    if spelling is not None:
        return forbidden_message(first.rank, spelling, False, _why_forbidden)
    hint = ""
    if "invalid tensor size" in first.summary:
        hint = " " + PADDING_HINT
    elif "outputShape[0] * worldSize == inputShape[0]" in first.summary:
        hint = (" reduce_scatter_tensor wants N equal chunks, and the slices of shard_sizes differ by one element "
                "when N does not divide numel.")
    elif "dtype" in first.summary:
        hint = " " + SAME_DTYPE_HINT
    return f"rank {first.rank} raised {first.summary.strip().removesuffix('.')}.{hint}"


def _why_forbidden(spelling: str, name: str) -> str:
    """Why the call `spelling` (function `name`) is switched off while the ZeRO-1 step is graded, and what instead."""
    if name in ("send", "recv", "isend", "irecv", "batch_isend_irecv", "recv_anysource"):
        return (f"This step is built from collectives, not from messages: {ALLOWED}. (Notebook 03 built the ring "
                "from send and recv; here torch's reduce-scatter and all-gather are the pieces.)")
    if name.endswith("_object") or name.endswith("_object_list"):
        return f"It pickles Python objects; move the tensors themselves with {ALLOWED}."
    return f"ZeRO-1's step needs two collectives only: {ALLOWED}."
