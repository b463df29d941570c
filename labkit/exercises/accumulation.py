"""The grader of notebook 07's "your turn": gradient accumulation with torch DDP's no_sync(), on real ranks.

`check_no_sync_accumulation(fn)` calls `fn(ddp_model, optimizer, microbatches)` once per optimizer step, a few
steps, on 2 ranks with 3 micro-batches each and on 3 ranks with 2 (k differs from N, so dividing by N instead of
k shows). `ddp_model` is a small float64 model in torch's DistributedDataParallel, `optimizer` its SGD, and
`microbatches` this rank's list of k (x, y) micro-batches of the step's batch. One optimizer step should:

- run the first k-1 micro-batches, forward and backward, inside `ddp_model.no_sync()`, where each backward only
  adds to .grad, and the last one outside it, whose backward all-reduces the accumulated sum: one
  synchronisation per optimizer step instead of k (torch's DistributedDataParallel.no_sync documentation);
- divide each micro-batch's loss (`F.cross_entropy(ddp_model(x), y)`) by k, so that the sum of the k backward
  passes is the mean over the rank's rows; DDP itself averages over the ranks (Li et al., "PyTorch
  Distributed", VLDB 2020, 3.2.1 and 3.2.4);
- then optimizer.step() once, and zero the gradients once (after the step, or before the first micro-batch).

A solution passes only if, in both cases, on every rank: each call ran one forward per micro-batch, all but the
last inside no_sync(), each followed by its backward before the next forward (so that one micro-batch's
activations are alive at a time: the memory accumulation saves, measured by what autograd still holds at each
forward; a forward under torch.no_grad(), an accuracy logged, is no micro-batch), and DDP all-reduced its one
bucket once, with no collective of the solution's own (an all_reduce is counted; a broadcast, a barrier or a send
is switched off: DDP's constructor broadcast the parameters, and its all_reduce keeps the replicas equal); no
gradient was changed between micro-batches but by a backward (a clip_grad_norm_ there clips a partial,
unsynchronised sum; clipping belongs after the last backward, and this exercise's step is the large batch's,
unclipped); optimizer.step() ran once, with the gradient of
the whole large batch (every rank's micro-batches) of one process (float64, within 1e-9); and the parameters
after every step equal one process trained on the large batch, the same on every rank. The watching, on each
rank, is in `labkit.exercises.accumulation_guard`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import labkit
from labkit.checks import timeout_seconds as checked_timeout
from labkit.exercises.accumulation_guard import (
    LR,
    ROWS_PER_STEP,
    STEPS,
    accumulation_model,
    attempt_accumulation,
    step_batch,
    warm_up,
)
from labkit.exercises.allreduce import TIMEOUT_SECONDS
from labkit.exercises.guard import first_failure, forbidden_message, stop_pool, where_ranks_waited
from labkit.exercises.progress import graded
from labkit.exercises.verdict import Verdict

__all__ = ["ACCUMULATION_CASES", "TOLERANCE", "check_no_sync_accumulation", "reference_run"]

ACCUMULATION_CASES = ((2, 3), (3, 2))  # (world_size, micro-batches per rank): N != k, so /N and /k differ
TOLERANCE = 1e-9  # float64: a right step is within 1e-15; every mistake is off by far more
BUCKETS = 1  # the graded model's gradients fit DDP's first bucket: one synchronisation is one all_reduce
STARTUP_SECONDS = 120.0  # starting a pool of ranks and torch's first DDP, however loaded the machine


@graded("no_sync_accumulation")
def check_no_sync_accumulation(fn, *, timeout_seconds: float = TIMEOUT_SECONDS) -> Verdict:
    """Grade `fn(ddp_model, optimizer, microbatches)`: one optimizer step accumulated over the micro-batches with
    no_sync(), equal to the large batch (module docstring).

    Example::

        >>> import torch.nn.functional as F
        >>> def no_no_sync(ddp_model, optimizer, microbatches):   # DDP all-reduces after every backward
        ...     for x, y in microbatches:
        ...         (F.cross_entropy(ddp_model(x), y) / len(microbatches)).backward()
        ...     optimizer.step()
        ...     optimizer.zero_grad()
        >>> check_no_sync_accumulation(no_no_sync)
        Not yet. On 2 ranks with 3 micro-batches each (a batch of 24 rows...after every micro-batch (3 all_reduces...
    """
    timeout_seconds = checked_timeout("timeout_seconds", timeout_seconds)
    if not callable(fn):
        return Verdict(False, "pass your function itself, e.g. check_no_sync_accumulation(train_step), not "
                              f"{type(fn).__name__}.")
    for world_size, microbatches in ACCUMULATION_CASES:
        problem = _case_problem(fn, world_size, microbatches, timeout_seconds)
        if problem:
            return Verdict(False, f"On {world_size} ranks with {microbatches} micro-batches each (a batch of "
                                  f"{ROWS_PER_STEP} rows per optimizer step), {problem}")
    return Verdict(True, f"on 2 ranks x 3 micro-batches and 3 ranks x 2, every optimizer step ran the first k-1 "
                         "micro-batches inside no_sync() and DDP all-reduced once per optimizer step, not once "
                         "per micro-batch; the gradient at optimizer.step() was the large batch's, and after "
                         f"{STEPS} steps every rank's parameters equal one process trained on the large batch. "
                         "That is gradient accumulation: k times the batch for one AllReduce.")


def reference_run(world_size: int, microbatches: int) -> tuple[list, list, list]:
    """One process on the large batches: per step, the gradient of the whole batch, the gradient of the ranks'
    last micro-batches only (divided by k: what is left when .grad is zeroed inside the loop), and the parameters
    after SGD on the whole batch's gradient."""
    model = accumulation_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    full, last_only, params = [], [], []
    rows = ROWS_PER_STEP // world_size
    last = [r * rows + i for r in range(world_size) for i in range(rows - rows // microbatches, rows)]
    for step in range(STEPS):
        x, y = step_batch(step)
        last_only.append([g / microbatches for g in _gradient(model, x[last], y[last])])
        full.append(_gradient(model, x, y))
        optimizer.step()
        params.append([v for p in model.parameters() for v in p.detach().flatten().tolist()])
    return full, last_only, params


def _gradient(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """The flat gradient of the mean cross-entropy on (x, y), left in .grad."""
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    return [v for p in model.parameters() for v in p.grad.flatten().tolist()]


def _case_problem(fn, world_size: int, microbatches: int, timeout_seconds: float) -> str | None:
    """What is wrong with fn on `world_size` ranks with `microbatches` each, or None. A run whose ranks
    all-reduced different numbers of buckets stops the pool, or the next case's collectives would meet them."""
    labkit.run(warm_up, world_size=world_size, timeout=STARTUP_SECONDS)  # starting ranks does not eat the timeout
    try:
        records = labkit.run(attempt_accumulation, fn, microbatches, world_size=world_size, timeout=timeout_seconds)
    except labkit.RankTimeout as hang:  # labkit stops a pool whose call timed out
        return (f"it never finished (stopped after {timeout_seconds:g} s): a rank waited in an all_reduce that the "
                f"others did not join. {where_ranks_waited(hang)}. Every rank must run the same micro-batches "
                "inside no_sync(), whatever its rank, so that DDP all-reduces at the same moment everywhere.")
    except labkit.RankError as error:
        first, spelling = first_failure(error)
        if spelling is not None:
            return forbidden_message(first.rank, spelling, False, _why_forbidden)
        return f"rank {first.rank} raised {first.summary.strip().removesuffix('.')}."
    if any([r.syncs for r in rank] != [r.syncs for r in records[0]] for rank in records):
        stop_pool(world_size)
    reference = reference_run(world_size, microbatches)
    return (_forbidden_problem(records) or _calls_problem(records, microbatches)
            or _sync_problem(records, microbatches) or _touched_problem(records, microbatches)
            or _values_problem(records, microbatches, reference))


def _forbidden_problem(records) -> str | None:
    """A switched-off call the step made and caught (one it did not catch failed the run), else None."""
    for rank, calls in enumerate(records):
        for call in calls:
            if call.forbidden:
                return forbidden_message(rank, call.forbidden[0], True, _why_forbidden)
    return None


def _why_forbidden(spelling: str, name: str) -> str:
    """Why a collective of the student's own (other than all_reduce, which is counted) is switched off here."""
    if "broadcast" in name:
        extra = ("DDP's constructor broadcast rank 0's parameters once, and since then every rank applies the same "
                 "all-reduced gradient, so the replicas stay equal: a broadcast per step sends the whole model for "
                 "nothing, and were the replicas to drift, it would hide the bug instead of showing it.")
    elif "barrier" in name:
        extra = ("The ranks already meet in DDP's all_reduce of the last backward: a barrier per step adds a round "
                 "trip and synchronises nothing more.")
    else:
        extra = "Any other collective or message adds a round trip per step."
    return (f"This exercise makes no collective of its own: DDP does the step's communication, one all_reduce of "
            f"the gradients in the last micro-batch's backward. {extra} Leave the communication to DDP.")


def _touched_problem(records, microbatches: int) -> str | None:
    """A gradient changed between a micro-batch's backward and the next forward, by other than a backward."""
    for rank, calls in enumerate(records):
        touched = next((call.touched[0] for call in calls if call.touched), None)
        if touched is not None:
            return (f"on rank {rank} the gradients changed between micro-batch {touched}'s backward and micro-batch "
                    f"{touched + 1}'s forward, by something other than a backward: clip_grad_norm_ before the last "
                    f"micro-batch (or a scaling of .grad)? There .grad holds only this rank's "
                    f"{'micro-batch 1' if touched == 1 else f'micro-batches 1 to {touched}'} of {microbatches}, "
                    "not yet all-reduced: clipping it clips a part, differently on "
                    "each rank, and the step is no longer the large batch's. Clip only after the last micro-batch's "
                    "backward, when DDP has all-reduced the whole gradient (and in this exercise not at all: its "
                    "step is the large batch's, unclipped).")
    return None


def _calls_problem(records, microbatches: int) -> str | None:
    """Steps, forwards and forwards around DDP, per call: once, k, none; else what happened."""
    for rank, calls in enumerate(records):
        for call in calls:
            steps, forwards = len(call.step_grads), len(call.no_sync_forwards)
            if steps == 0:
                return f"rank {rank} never called optimizer.step(): the parameters never moved."
            if steps == microbatches:
                return (f"rank {rank} called optimizer.step() {steps} times in one call, once per micro-batch: "
                        f"that is {steps} small steps, not one step on the large batch.")
            if steps > 1:
                return f"rank {rank} called optimizer.step() {steps} times in one call, where one step is the " \
                       "large batch's."
            if call.module_forwards > forwards:
                return (f"rank {rank} called ddp_model.module(x), the model inside DDP: DDP never sees that "
                        "forward, so it cannot synchronise its gradients.")
            if forwards != microbatches:
                return (f"rank {rank} ran the model {forwards} times for {microbatches} micro-batches: one "
                        "forward and one backward per micro-batch.")
            if any(call.backward_lags):
                return _order_message(rank, call.backward_lags)
            if any(call.still_alive):
                return _alive_message(rank, call.still_alive)
    return None


def _alive_message(rank: int, still_alive: list[list[int]]) -> str:
    """The message for graphs kept after their backward: at some forward, earlier micro-batches' saved activations
    were still in memory (measured: autograd had not freed them)."""
    forward = next(i for i, held in enumerate(still_alive) if held)
    most = max(len(held) for held in still_alive) + 1
    earlier = ", ".join(map(str, still_alive[forward]))
    return (f"on rank {rank}, when micro-batch {forward + 1}'s forward began, the activations that autograd saved "
            f"for micro-batch(es) {earlier} were still in memory, after their backward: up to {most} micro-batches' "
            "activations were alive at once. A backward(retain_graph=True) keeps its graph for as long as its loss "
            "is referenced (kept in a list, say); without retain_graph, backward frees each micro-batch's graph, "
            "and the memory of one micro-batch at a time is what accumulation is for.")


def _order_message(rank: int, lags: list) -> str:
    """The message for backward passes that came after later forwards (`lags`: per forward, how many forwards
    ran before its backward reached it)."""
    first = next(i for i, lag in enumerate(lags) if lag)
    alive = lags[first] + 1
    summed = all(lag == len(lags) - 1 - i for i, lag in enumerate(lags))
    how = (f"all {len(lags)} forwards ran first, then one backward of their summed losses" if summed else
           f"micro-batch {first + 1}'s backward came only after {lags[first]} more forward(s)")
    return (f"on rank {rank} {how}: the activations of {alive} micro-batches were kept "
            "in memory at once. That undoes what accumulation is for: the memory of one micro-batch at a time "
            "for the gradient of the large batch.")


def _sync_problem(records, microbatches: int) -> str | None:
    """Which micro-batches ran inside no_sync(), all_reduces made by hand, and how many buckets DDP all-reduced,
    per call."""
    wanted = [True] * (microbatches - 1) + [False]
    for rank, calls in enumerate(records):
        for call in calls:
            inside = call.no_sync_forwards
            if inside != wanted:
                return _pattern_message(rank, call, microbatches, _drift(records))
            if call.own_allreduces:
                return _own_allreduce_message(rank, call)
            if call.syncs != BUCKETS:
                return (f"rank {rank}'s DDP all-reduced {call.syncs} buckets in one optimizer step, where one "
                        f"synchronisation is {BUCKETS}.")
    return None


def _own_allreduce_message(rank: int, call) -> str:
    """The message for all_reduces made by hand: of gradients (averaged twice), or of something else."""
    own, said = call.own_allreduces, f"rank {rank} made {len(call.own_allreduces)} all_reduce(s) of its own"
    others = sorted({held for held in own if held != "gradient"})
    if not others:
        return (f"{said} in one optimizer step, besides DDP's {call.syncs}: DDP already all-reduces and averages "
                "the gradients in the last micro-batch's backward, so averaging them again by hand only sends "
                "them twice. Leave the communication to DDP.")
    return (f"{said} in one optimizer step, besides DDP's {call.syncs}, of {' and '.join(others)}: not a "
            "gradient, so the training itself is not changed. But this exercise allows no collective of your "
            "own: the grader counts every all_reduce to check that DDP synchronises once per optimizer step. "
            "Logging a loss averaged over the ranks is fine in a real run; leave it out here.")


def _syncs_text(call, microbatches: int) -> str:
    """How often DDP all-reduced in one call, in words."""
    if call.syncs == microbatches:
        return f"after every micro-batch ({call.syncs} all_reduces in one optimizer step, where one is enough)"
    return f"{call.syncs} time(s) in one optimizer step"


def _pattern_message(rank: int, call, microbatches: int, drift: str) -> str:
    """The message for micro-batches run inside no_sync() in another pattern than all but the last."""
    inside, k = call.no_sync_forwards, microbatches
    if not any(inside) and not call.entered_no_sync:
        return (f"no forward ran inside no_sync() (rank {rank} never entered it), so DDP all-reduced the gradients "
                f"{_syncs_text(call, k)}. Inside no_sync() a backward only adds to .grad; outside it, DDP "
                "all-reduces.")
    if not any(inside):
        return (f"rank {rank} entered ddp_model.no_sync(), but every forward ran outside it, so DDP still "
                f"all-reduced {_syncs_text(call, k)}. DDP decides at the forward whether its backward will "
                "synchronise.")
    if all(inside):
        return (f"every micro-batch ran inside no_sync(), so DDP never all-reduced: each rank stepped with its "
                f"own gradient, and {drift}. DDP all-reduces only in a backward outside no_sync().")
    if inside == [False] + [True] * (k - 1):
        return (f"no_sync() wrapped the last {k - 1} micro-batch(es) instead of the first {k - 1}: the first "
                "backward all-reduced that micro-batch's gradient alone, and the later ones stayed on their own "
                f"rank, so {drift}. DDP all-reduces in the first backward outside no_sync().")
    ran = ", ".join(str(i + 1) for i, flag in enumerate(inside) if flag)
    outside = ", ".join(str(i + 1) for i, flag in enumerate(inside) if not flag)
    return (f"on rank {rank} micro-batch(es) {ran} of {len(inside)} ran inside no_sync() and {outside} outside it: "
            f"DDP all-reduced {_syncs_text(call, k)}, not once, the whole sum.")


def _drift(records) -> str:
    """How far the replicas drifted apart by the end, in words."""
    gap, rank = max((_gap(calls[-1].params, records[0][-1].params), r) for r, calls in enumerate(records))
    if gap <= TOLERANCE:
        return "the ranks' gradients differed"
    return (f"the replicas drifted apart (rank {rank}'s parameters differ from rank 0's by {gap:.2g} after {STEPS} "
            "steps)")


def _values_problem(records, microbatches: int, reference) -> str | None:
    """The gradient at each optimizer.step() against the large batch's, then the parameters after each step."""
    full, last_only, params = reference
    for step in range(STEPS):
        for rank, calls in enumerate(records):
            got = calls[step].step_grads[0]
            if _gap(got, full[step]) > TOLERANCE:
                previous = records[rank][step - 1].step_grads[0] if step else None
                return f"at optimizer step {step + 1} of {STEPS}, " + _gradient_message(
                    rank, got, full[step], last_only[step], previous, microbatches, len(records))
        for rank, calls in enumerate(records):
            if _gap(calls[step].params, params[step]) > TOLERANCE:
                return (f"rank {rank}'s parameters after optimizer step {step + 1} differ from one process's by "
                        f"{_gap(calls[step].params, params[step]):.3g}, although the gradient at step() was right: "
                        "change the parameters only through optimizer.step().")
    return None


def _gradient_message(rank: int, got, want, last_only, previous, k: int, world_size: int) -> str:
    """What the gradient at optimizer.step() is, when it is not the large batch's."""
    if _gap(got, [0.0] * len(got)) <= TOLERANCE:
        return (f"rank {rank}'s gradient at optimizer.step() was zero: the gradients were zeroed after the "
                "backward passes and before step().")
    if _scale(got, last_only) is not None:
        return (f"rank {rank}'s gradient at optimizer.step() held only the last micro-batch's: the first {k - 1} "
                "were zeroed before step(), by a zero_grad() inside the loop over the micro-batches, where the "
                "backward passes must add up in .grad.")
    if previous is not None and _gap([a - b for a, b in zip(got, previous, strict=True)], want) <= TOLERANCE:
        return (f"rank {rank}'s gradient at optimizer.step() still held the previous step's: the gradients were "
                "never zeroed, so .grad kept adding up across optimizer steps.")
    scale = _scale(got, want)
    if scale is None:
        return (f"rank {rank}'s gradient at optimizer.step() differs from the large batch's by "
                f"{_gap(got, want):.3g}, by no single factor.")
    return _scale_message(rank, scale, k, world_size) or _clipped_message(rank, scale, got, want)


def _clipped_message(rank: int, scale: float, got, want) -> str:
    """The message for a gradient that is the large batch's times `scale`, not a k or N mistake: scaled down
    after the last backward, as clip_grad_norm_ does (it multiplies every gradient by max_norm / total norm)."""
    said = f"rank {rank}'s gradient at optimizer.step() was {scale:.4g} times the large batch's"
    if scale < 1:
        return (f"{said}, norm {_norm(got):.4g} where the large batch's is {_norm(want):.4g}: scaled down after "
                "the last backward, as torch.nn.utils.clip_grad_norm_ does? That is the right place to clip in a "
                "real run: once, after the last micro-batch's backward, on the all-reduced gradient. But this "
                "exercise checks the step against the large batch's gradient, unclipped: leave clipping out "
                "here. If you did not clip, the losses were scaled by something other than 1/k.")
    return f"{said}: the losses were scaled by something other than 1/k (DDP averages over the ranks itself)."


def _norm(values) -> float:
    """The Euclidean norm of a flat list of floats."""
    return sum(v * v for v in values) ** 0.5


def _scale_message(rank: int, scale: float, k: int, world_size: int) -> str | None:
    """The message for a gradient that is the large batch's times `scale`: k, 1/N or k/N; else None."""
    said = f"rank {rank}'s gradient at optimizer.step() was"
    if abs(scale - k) < 1e-6:
        return (f"{said} {k} times the large batch's: the loss was not divided by k = {k}. The {k} backward "
                "passes add up their gradients, each the mean of its micro-batch.")
    if abs(scale - 1 / world_size) < 1e-6:
        return (f"{said} 1/{world_size} of the large batch's: the loss was divided by k x N = {k * world_size}. "
                "DDP already averages over the ranks (it divides by N in its all_reduce).")
    if abs(scale - k / world_size) < 1e-6:
        return (f"{said} {k}/{world_size} of the large batch's: the loss was divided by N = {world_size}, the "
                f"number of ranks, instead of k = {k}, the number of micro-batches. DDP averages over the ranks "
                "itself.")
    return None


def _scale(got, want) -> float | None:
    """s when got = s x want (to TOLERANCE), else None."""
    norm = sum(b * b for b in want)
    scale = sum(a * b for a, b in zip(got, want, strict=True)) / norm
    return scale if _gap(got, [scale * b for b in want]) <= TOLERANCE else None


def _gap(got, want) -> float:
    """The largest absolute difference between two flat lists of floats."""
    return max((abs(a - b) for a, b in zip(got, want, strict=True)), default=0.0)
