"""The grader of notebook 07's "your turn": gradient accumulation with torch DDP's no_sync(), on real ranks.

`check_no_sync_accumulation(fn)` calls `fn(ddp_model, optimizer, microbatches)` once per optimizer step, a few
steps, in two cases drawn afresh for each grading (`draw_cases`). `ddp_model` is a small model in torch's
DistributedDataParallel, `optimizer` its SGD, and `microbatches` this rank's list of k (x, y) micro-batches of the
step's batch. What a right solution must not depend on is drawn: two different world sizes of 2, 3 and 4, one case
in float32 and one in float64, k micro-batches (2-4, never N, so dividing by N instead of k shows) of 2-5 rows,
the model's sizes, SGD's lr and momentum, and the seeds; the two cases differ in k, in k x N and in the rows per
step, so that any of them written in as a number fails one. One optimizer step should:

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
unclipped); DDP's one all_reduce carried this rank's accumulated gradient (the sum of its k micro-batches'
gradients, as its bucket holds them, up to one factor: a loss undivided and the gradients divided by k after the
backward is right too): counting one all_reduce is not checking what it reduced, so an accumulator of one's own
that leaves DDP only the last micro-batch's gradient fails; optimizer.step() ran once, with the gradient of the
whole large batch (every rank's micro-batches) of one process in float64 from the same start (within TOLERANCES,
relative to each value's size beyond 1: 1e-9 in float64, 1e-4 in float32, whose rounding over a few steps stays
below 2e-6); and the parameters after every step equal that process trained on the large batch, the same on every
rank. The watching, on each rank, is below (`attempt`).

The grading is the kit's runner driven by `SPEC` (labkit.exercises._kit._runner): the cases, the rank-side
attempt, the ordered checks and the messages. On a rank (`attempt`):

Each rank wraps the same small model (`accumulation_model`, the case's sizes and dtype, seeded the same
everywhere) in torch's
DistributedDataParallel, makes an SGD optimizer, and calls the student's `fn(ddp_model, optimizer, microbatches)`
once per optimizer step with this rank's micro-batches of that step's batch (`rank_microbatches`). While fn runs,
every way into torch.distributed's communication but all_reduce is switched off (`AccumulationGuard`, the shared
guard of labkit.exercises._kit._guard): DDP's constructor has broadcast the parameters before, and DDP's all_reduce in
the last backward is the step's one communication, so a broadcast, a barrier or a message of the student's own
only adds a round trip. Everything else is watched where DDP and the optimizer report it:

- each forward of the DDP model with gradients on (one under torch.no_grad(), an accuracy logged, is no
  micro-batch), and whether it ran with DDP's gradient synchronisation off (inside
  `no_sync()`): DDP decides at the forward whether that backward will all-reduce (torch's
  DistributedDataParallel.no_sync documentation), so the forward is what counts;
- when each forward's backward reached its output (a tensor hook, Tensor.register_hook), counted in forwards
  run since: accumulation saves memory only if each micro-batch's backward runs before the next forward, so
  that one micro-batch's activations are alive at a time;
- and that memory itself, measured: every tensor autograd saves for backward is packed, through
  torch.autograd.graph.saved_tensors_hooks, into a holder counted under its micro-batch until autograd frees it
  (`SavedActivations`), so a backward(retain_graph=True) whose losses are kept alive shows at the next forward;
- each bucket DDP all-reduces, through a communication hook (`DistributedDataParallel.register_comm_hook`) that
  counts it, notes what it holds, per parameter (GradBucket.parameters() and .gradients()), and then does what
  DDP does by default (`default_hooks.allreduce_hook`: divide by N, all_reduce);
- every all_reduce the process group receives (ProcessGroup.allreduce), so that one made by hand shows, and
  what it held: a parameter's gradient (or a tensor of a parameter's shape), or another tensor (a loss, say);
- each parameter's .grad right after a backward accumulated into it (Tensor.register_post_accumulate_grad_hook),
  compared at the next forward after a backward inside no_sync(): a gradient changed in between by anything but a
  backward or a zeroing (clip_grad_norm_ on the partial, unsynchronised sum, say) shows;
- the gradient at each `optimizer.step()` (a step pre-hook), and the parameters after each call.

The model is small enough that DDP puts all its gradients in one bucket (its first bucket holds 1 MB), so one
synchronisation is one all_reduce. The inputs are scaled (INPUT_SCALE) so that the gradients are large: over 300
draws, the large batch's norm at the first step was at least 2.5 and some rank's partial sum before its last
micro-batch at least 3.5, so that a clip_grad_norm_(max_norm=1.0) in the wrong place acts and shows. Each
micro-batch is a tensor of its own, not a view of the whole step's batch.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import random
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import labkit
from labkit.exercises._kit import _store
from labkit.exercises._kit._group_call import GroupCall, Kind, wrap_group_method
from labkit.exercises._kit._guard import Guard
from labkit.exercises._kit._messages import failure_sentence, first_failure, forbidden_message, hang_message
from labkit.exercises._kit._record import Call
from labkit.exercises._kit._runner import Case, Spec, grade
from labkit.exercises.allreduce import TIMEOUT_SECONDS
from labkit.exercises.progress import graded
from labkit.exercises.verdict import Verdict
from labkit.models import mlp

__all__ = ["WORLD_SIZES", "check_no_sync_accumulation", "draw_cases", "warm_up"]

WORLD_SIZES = (2, 3, 4)  # a grading draws two of them
MICROBATCHES = (2, 3, 4)  # k, drawn per case: never the case's N, so dividing by N instead of k shows
MICRO_ROWS = (2, 3, 4, 5)  # rows per micro-batch, drawn per case
TOLERANCES = {torch.float64: 1e-9, torch.float32: 1e-4}  # relative to the value's size beyond 1, against one
# process in float64 from the same start: a right step is within 1e-14 (float64) or 1e-6 (float32, its rounding
# over a few steps); every mistake is off by 1e-2 and far more
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
        Not yet. On ... ranks with ... micro-batches each of ... rows (a batch of ...after every micro-batch (...
    """
    return grade(SPEC, fn, timeout_seconds=timeout_seconds)


def draw_cases(rng: random.Random | None = None) -> list[Case]:
    """Two cases, drawn afresh for each grading, so that a solution that depends on what it should not fails one
    of them: two different world sizes of WORLD_SIZES, one case in float32 and one in float64, k micro-batches
    (never N) of 2-5 rows each, the model's sizes (3-6 features, 4-8 hidden units), SGD's lr (0.02-0.08) and
    momentum (none, or 0.5-0.9), and the seeds of the model and of the batches. The two cases differ in k, in
    k x N (the micro-batches of one step, all ranks together) and in the rows per step, so that any of them
    written in as a number fails one case. Small enough that a grading stays well under a second once the ranks
    are up."""
    rng = rng or random.Random()
    while True:
        world_sizes = rng.sample(WORLD_SIZES, 2)
        ks = [rng.choice([k for k in MICROBATCHES if k != n]) for n in world_sizes]
        rows = [rng.choice(MICRO_ROWS) for _ in world_sizes]
        totals = [n * k for n, k in zip(world_sizes, ks, strict=True)]
        steps = [t * r for t, r in zip(totals, rows, strict=True)]
        if ks[0] != ks[1] and totals[0] != totals[1] and steps[0] != steps[1]:
            break
    dtypes = rng.sample([torch.float32, torch.float64], 2)
    return [Case(n, {"microbatches": k, "rows": r, "dtype": dtype, "features": rng.randint(3, 6),
                     "hidden": rng.randint(4, 8), "lr": round(rng.uniform(0.02, 0.08), 3),
                     "momentum": rng.choice((0.0, round(rng.uniform(0.5, 0.9), 2))),
                     "seed": rng.randrange(10 ** 6), "batch_seed": rng.randrange(10 ** 6)})
            for n, k, r, dtype in zip(world_sizes, ks, rows, dtypes, strict=True)]


def _cases() -> list[Case]:
    """The cases of this grading (draw_cases), each pool of ranks first started and its DDP warmed up (warm_up),
    so that starting ranks does not eat a case's timeout."""
    cases = draw_cases()
    for case in cases:
        labkit.run(warm_up, world_size=case.world_size, timeout=STARTUP_SECONDS)
    return cases


def _dtype(case: Case) -> str:
    return str(case["dtype"]).removeprefix("torch.")


def _rows_per_step(case: Case) -> int:
    return case.world_size * case["microbatches"] * case["rows"]


def _described(case: Case) -> str:
    momentum = f", momentum {case['momentum']:g}" if case["momentum"] else ""
    return (f"On {case.world_size} ranks with {case['microbatches']} micro-batches each of {case['rows']} rows (a "
            f"batch of {_rows_per_step(case)} rows per optimizer step; {_dtype(case)}, SGD lr {case['lr']:g}"
            f"{momentum})")


def _passed(cases) -> str:
    said = " and ".join(f"{c.world_size} ranks x {c['microbatches']} micro-batches ({_dtype(c)})" for c in cases)
    return (f"on {said}, with the sizes, the dtype, the lr and the momentum drawn afresh, every optimizer step ran "
            "the first k-1 micro-batches inside no_sync() and DDP all-reduced once per optimizer step, not once "
            "per micro-batch, and what it all-reduced was each rank's accumulated gradient (the sum over its "
            "micro-batches); the gradient at optimizer.step() was the large batch's, and after "
            f"{STEPS} steps every rank's parameters equal one process trained on the large batch. "
            "That is gradient accumulation: k times the batch for one AllReduce.")


def _hang_message(hang: labkit.RankTimeout, case: Case, timeout_seconds: float) -> str:
    return hang_message(hang, timeout_seconds, "a rank waited in an all_reduce that the others did not join. Every "
                        "rank must run the same micro-batches inside no_sync(), whatever its rank, so that DDP "
                        "all-reduces at the same moment everywhere.")


def _error_message(error: labkit.RankError, attempts, case: Case) -> str:
    """A rank's own error (a refused call the runner has told already)."""
    first = first_failure(error)[0]
    message = f"{failure_sentence(first)}."
    if "dtype" in first.summary or "Double" in first.summary or "Float" in first.summary:
        message += (f" In this case the model and the micro-batches are {_dtype(case)} (drawn for each grading: "
                    "float32 or float64): use x and y as they come, without casting them.")
    return message


@dataclass
class Reference:
    """One process in float64 on the case's large batches, from the same start (what a rank's model holds, in
    float64): per step, the gradient of the whole batch (`full`), of the ranks' last micro-batches only, divided by
    k (`last_only`: what is left when .grad is zeroed inside the loop), of each rank's own rows (`own[rank]`: the
    sum of its k micro-batches' gradients, each loss divided by k, which DDP's bucket holds when it all-reduces),
    and of each rank's last micro-batch alone, divided by k (`own_last[rank]`); and the parameters after the
    optimizer's step on the whole batch's gradient (`params`)."""

    full: list = field(default_factory=list)
    last_only: list = field(default_factory=list)
    own: list = field(default_factory=list)
    own_last: list = field(default_factory=list)
    params: list = field(default_factory=list)


def reference_run(case: Case) -> Reference:
    """One process on the large batches of `case` (Reference)."""
    model = accumulation_model(case, dtype=torch.float64)
    optimizer = _optimizer(model, case)
    k, n, reference = case["microbatches"], case.world_size, Reference()
    rows = k * case["rows"]
    last = [r * rows + i for r in range(n) for i in range(rows - case["rows"], rows)]
    for step in range(STEPS):
        x, y = step_batch(case, step)
        x = x.to(case["dtype"]).double()  # the values a rank has, in float64
        reference.last_only.append([g / k for g in _gradient(model, x[last], y[last])])
        reference.own.append([_gradient(model, x[r * rows:(r + 1) * rows], y[r * rows:(r + 1) * rows])
                              for r in range(n)])
        reference.own_last.append([[g / k for g in _gradient(model, x[(r + 1) * rows - case["rows"]:(r + 1) * rows],
                                                             y[(r + 1) * rows - case["rows"]:(r + 1) * rows])]
                                   for r in range(n)])
        reference.full.append(_gradient(model, x, y))
        optimizer.step()
        reference.params.append([v for p in model.parameters() for v in p.detach().flatten().tolist()])
    return reference


def _optimizer(model: torch.nn.Module, case: Case) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=case["lr"], momentum=case["momentum"])


def _gradient(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """The flat gradient of the mean cross-entropy on (x, y), left in .grad."""
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    return [v for p in model.parameters() for v in p.grad.flatten().tolist()]


def _forbidden_problem(records, case: Case) -> str | None:
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


def _touched_problem(records, case: Case) -> str | None:
    """A gradient changed between a micro-batch's backward and the next forward, by other than a backward."""
    microbatches = case["microbatches"]
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


def _calls_problem(records, case: Case) -> str | None:
    """Steps, forwards and forwards around DDP, per call: once, k, none; else what happened."""
    microbatches = case["microbatches"]
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


def _sync_problem(records, case: Case) -> str | None:
    """Which micro-batches ran inside no_sync(), all_reduces made by hand, and how many buckets DDP all-reduced,
    per call."""
    microbatches = case["microbatches"]
    wanted = [True] * (microbatches - 1) + [False]
    for rank, calls in enumerate(records):
        for call in calls:
            inside = call.no_sync_forwards
            if inside != wanted:
                return _pattern_message(rank, call, microbatches, _drift(records, case))
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
    if all(inside) and call.own_allreduces:
        return (f"every micro-batch ran inside no_sync(), so DDP never all-reduced, and rank {rank} made "
                f"{len(call.own_allreduces)} all_reduce(s) of its own instead: the right number of all_reduces, "
                "but not DDP's. This exercise is DDP's accumulation: leave the last micro-batch outside no_sync(), "
                "and its backward all-reduces the accumulated sum, with no collective of your own.")
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


def _drift(records, case: Case) -> str:
    """How far the replicas drifted apart by the end, in words."""
    gap, rank = max((_gap(calls[-1].params, records[0][-1].params), r) for r, calls in enumerate(records))
    if gap <= TOLERANCES[case["dtype"]]:
        return "the ranks' gradients differed"
    return (f"the replicas drifted apart (rank {rank}'s parameters differ from rank 0's by {gap:.2g} after {STEPS} "
            "steps)")


def _values_problem(records, case: Case) -> str | None:
    """Per optimizer step: what DDP's one all_reduce carried on each rank (its bucket, against the rank's own
    accumulated gradient), the gradient at optimizer.step() against the large batch's, then the parameters."""
    microbatches, tolerance = case["microbatches"], TOLERANCES[case["dtype"]]
    reference = reference_run(case)
    for step in range(STEPS):
        said = f"at optimizer step {step + 1} of {STEPS}, "
        for rank, calls in enumerate(records):
            previous = records[rank][step - 1].step_grads[0] if step else None
            problem = _contents_problem(rank, calls[step].reduced, reference.own[step][rank],
                                        reference.own_last[step][rank], previous, microbatches, tolerance)
            if problem:
                return said + problem
        for rank, calls in enumerate(records):
            got = calls[step].step_grads[0]
            if _gap(got, reference.full[step], tolerance) > tolerance:
                previous = records[rank][step - 1].step_grads[0] if step else None
                return said + _gradient_message(rank, got, reference.full[step], reference.last_only[step],
                                                previous, microbatches, len(records), tolerance)
        for rank, calls in enumerate(records):
            gap = _gap(calls[step].params, reference.params[step], tolerance)
            if gap > tolerance:
                return (f"rank {rank}'s parameters after optimizer step {step + 1} differ from one process's by "
                        f"{_gap(calls[step].params, reference.params[step]):.3g}, although the gradient at step() "
                        "was right: change the parameters only through optimizer.step().")
    return None


def _contents_problem(rank: int, reduced, own, own_last, previous, k: int, tolerance: float) -> str | None:
    """What DDP's one all_reduce carried on `rank` (`reduced`: its bucket as the communication hook received it,
    in the model's parameter order), when it is not this rank's accumulated gradient (`own`, the sum of its k
    micro-batches' gradients) times some factor (a loss divided by something else than k is told at
    optimizer.step()); else None. Counting one all_reduce is not checking that it carried the accumulation."""
    if _scale(reduced, own, tolerance) not in (None, 0.0) and _gap(reduced, [0.0] * len(reduced)) > tolerance:
        return None
    said = f"rank {rank}'s one all_reduce (DDP's, in the last micro-batch's backward) carried"
    if _gap(reduced, [0.0] * len(reduced)) <= tolerance:
        return (f"{said} zeros: .grad was zeroed (or replaced) before the last backward, so the one all_reduce "
                "synchronised nothing, and whatever .grad held at optimizer.step() came from elsewhere. The "
                "backward passes must add up in .grad, for DDP to all-reduce their sum.")
    if _scale(reduced, own_last, tolerance) is not None:
        return (f"{said} a gradient that held only the last micro-batch's, not the sum of this rank's {k}: the first "
                f"{k - 1} were zeroed (or moved out of .grad) before its backward, by a zero_grad() inside the loop "
                "over the micro-batches, where the backward passes must add up in .grad. Whatever is added to "
                ".grad after the all_reduce (an accumulator of your own, say) stays on its rank, unsynchronised.")
    if previous is not None and _scale([a - b for a, b in zip(reduced, previous, strict=True)], own,
                                       tolerance) is not None:
        return (f"{said} a gradient that still held the previous step's: the gradients were never zeroed, so "
                ".grad kept adding up across optimizer steps.")
    return (f"{said} something other than this rank's accumulated gradient (the sum of its {k} micro-batches' "
            f"gradients, as .grad holds it after their backward passes): it differs from it by "
            f"{_gap(reduced, own):.3g}, by no single factor. The all_reduce must carry what the backward passes "
            "added up in .grad; .grad set afterwards from anything else (a copy, an accumulator of your own) is "
            "not synchronised.")


def _gradient_message(rank: int, got, want, last_only, previous, k: int, world_size: int,
                      tolerance: float) -> str:
    """What the gradient at optimizer.step() is, when it is not the large batch's."""
    if _gap(got, [0.0] * len(got)) <= tolerance:
        return (f"rank {rank}'s gradient at optimizer.step() was zero: the gradients were zeroed after the "
                "backward passes and before step().")
    if _scale(got, last_only, tolerance) is not None:
        return (f"rank {rank}'s gradient at optimizer.step() held only the last micro-batch's: the first {k - 1} "
                "were zeroed before step(), by a zero_grad() inside the loop over the micro-batches, where the "
                "backward passes must add up in .grad.")
    if previous is not None and _gap([a - b for a, b in zip(got, previous, strict=True)], want,
                                     tolerance) <= tolerance:
        return (f"rank {rank}'s gradient at optimizer.step() still held the previous step's: the gradients were "
                "never zeroed, so .grad kept adding up across optimizer steps.")
    scale = _scale(got, want, tolerance)
    if scale is None:
        return (f"rank {rank}'s gradient at optimizer.step() differs from the large batch's by "
                f"{_gap(got, want):.3g}, by no single factor.")
    return _scale_message(rank, scale, k, world_size) or _clipped_message(rank, scale, got, want, k)


def _clipped_message(rank: int, scale: float, got, want, k: int) -> str:
    """The message for a gradient that is the large batch's times `scale`, not a k or N mistake: scaled down
    after the last backward, as clip_grad_norm_ does (it multiplies every gradient by max_norm / total norm)."""
    said = f"rank {rank}'s gradient at optimizer.step() was {scale:.4g} times the large batch's"
    if scale < 1:
        return (f"{said}, norm {_norm(got):.4g} where the large batch's is {_norm(want):.4g}: scaled down after "
                "the last backward, as torch.nn.utils.clip_grad_norm_ does? That is the right place to clip in a "
                "real run: once, after the last micro-batch's backward, on the all-reduced gradient. But this "
                "exercise checks the step against the large batch's gradient, unclipped: leave clipping out "
                f"here. If you did not clip, {_not_one_over_k(k)}")
    return f"{said}: {_not_one_over_k(k)}"


def _not_one_over_k(k: int) -> str:
    return (f"the losses were scaled by something other than 1/k = 1/{k} (DDP averages over the ranks itself). k, "
            "the rows and the world size are drawn for each grading: take k from len(microbatches) and the rows "
            "from the micro-batches themselves, not a number written in.")


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


def _scale(got, want, tolerance: float) -> float | None:
    """s when got = s x want (to `tolerance`, _gap's), else None."""
    norm = sum(b * b for b in want)
    scale = sum(a * b for a, b in zip(got, want, strict=True)) / norm if norm else 0.0
    return scale if _gap(got, [scale * b for b in want], tolerance) <= tolerance else None


def _gap(got, want, tolerance: float | None = None) -> float:
    """The largest absolute difference between two flat lists of floats; with a tolerance, measured relative to
    each wanted value's size beyond 1 (so that it reads against that tolerance: a float32 run's rounding grows
    with its values, and a wrong one may grow large, or to NaN, which is no match)."""
    def apart(a: float, b: float) -> float:
        if a != a or b != b:
            return 0.0 if a != a and b != b else float("inf")
        return abs(a - b) / (max(1.0, abs(b)) if tolerance is not None else 1.0)
    return max((apart(a, b) for a, b in zip(got, want, strict=True)), default=0.0)


# ---- on a rank: the training run, what is watched, and what the student's step left behind -----------

CLASSES = 3
STEPS = 3  # optimizer steps: a second step shows gradients never zeroed
INPUT_SCALE = 20.0  # the inputs' scale: gradient norms of 2.5 and more, so that a misplaced clip to 1.0 acts


def accumulation_model(case: Case, device=None, dtype: torch.dtype | None = None) -> torch.nn.Sequential:
    """The graded model of `case`: its features, one hidden layer of its hidden units, 3 classes, in its dtype
    (or `dtype`), seeded the same on every rank (and in float64 the same values: mlp casts a float32 start)."""
    return mlp(features=case["features"], hidden=case["hidden"], classes=CLASSES, layers=1, seed=case["seed"],
               dtype=dtype or case["dtype"]).to(device)


def step_batch(case: Case, step: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The large batch of optimizer step `step` of `case` (N x k x rows rows), in float64, the same on every rank
    and in the grader; a rank takes it in the case's dtype."""
    generator = torch.Generator().manual_seed(case["batch_seed"] + step)
    rows = case.world_size * case["microbatches"] * case["rows"]
    x = INPUT_SCALE * torch.randn(rows, case["features"], generator=generator, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (rows,), generator=generator)
    return x.to(device), y.to(device)


def rank_microbatches(case: Case, step: int, rank: int, device=None) -> list:
    """Rank `rank`'s share of step `step`'s batch (a contiguous block of rows) in the case's dtype, cut into the
    case's k equal (x, y) micro-batches. Each is a tensor of its own (not a view of the whole batch)."""
    x, y = step_batch(case, step, device)
    k, rows = case["microbatches"], case["microbatches"] * case["rows"]
    mine = slice(rank * rows, (rank + 1) * rows)
    return [(xs.to(case["dtype"]).clone(), ys.clone())
            for xs, ys in zip(x[mine].chunk(k), y[mine].chunk(k), strict=True)]


@dataclass
class StepRecord:
    """One call of the student's step on one rank: per forward of the DDP model, whether it ran inside no_sync()
    and how many later forwards ran before its backward reached it; forwards of the inner module; the buckets DDP
    all-reduced; what each all_reduce made by hand held; the calls the guard refused; after which micro-batches
    (1-based) a gradient changed before the next forward, by anything but a backward or a zeroing; the flat
    gradient at each optimizer.step(); whether no_sync() was entered at all; the parameters after the call; the
    forwards run without gradients; and, measured, which earlier micro-batches' saved activations were alive at
    each forward."""

    no_sync_forwards: list[bool] = field(default_factory=list)
    backward_lags: list[int | None] = field(default_factory=list)  # None: no backward reached that forward
    module_forwards: int = 0
    syncs: int = 0
    own_allreduces: list[str] = field(default_factory=list)  # "gradient", or what else the tensor was
    forbidden: list[str] = field(default_factory=list)  # what the step called that the guard switched off
    touched: list[int] = field(default_factory=list)  # micro-batches after whose backward .grad was changed
    step_grads: list[list[float]] = field(default_factory=list)
    entered_no_sync: bool = False
    synced: dict[int, list[float]] = field(default_factory=dict)  # parameter index -> its gradient as DDP's
    # bucket held it when the communication hook received it (before DDP's division by N)
    reduced: list[float] = field(default_factory=list)  # `synced` flat, in the model's order (zeros where none)
    params: list[float] = field(default_factory=list)
    evaluations: int = 0  # forwards under torch.no_grad() (an accuracy logged, say): no micro-batch, no graph
    still_alive: list[list[int]] = field(default_factory=list)  # per forward: the earlier micro-batches (1-based)
    # whose saved activations were still alive when it started


class Watch:
    """Hooks on one DDP model and its optimizer that fill `current`, the StepRecord of the call under way."""

    def __init__(self, ddp: torch.nn.parallel.DistributedDataParallel, optimizer: torch.optim.Optimizer):
        self.current = StepRecord()
        self.saved = SavedActivations(self)
        self.ddp = ddp
        self.in_sync = False  # True while DDP's own all_reduce runs (in the communication hook)
        self.accumulated: dict[int, torch.Tensor] = {}  # parameter index -> its .grad after its last accumulation
        self.parameters = list(ddp.module.parameters())
        for index, parameter in enumerate(self.parameters):
            parameter.register_post_accumulate_grad_hook(functools.partial(self._accumulated, index))
        ddp.register_forward_pre_hook(self._forward)
        ddp.register_forward_hook(self._forward_done)
        ddp.module.register_forward_pre_hook(self._module_forward)
        ddp.register_comm_hook(None, self._sync)
        optimizer.register_step_pre_hook(self._step)
        self._no_sync = ddp.no_sync
        ddp.no_sync = self._watched_no_sync

    def _forward(self, module, args) -> None:
        """Note whether this forward runs inside no_sync(), and whether .grad changed since the previous
        micro-batch's backward, when that one ran inside no_sync() before this forward (DDP's own write of the
        all-reduced gradient comes after the accumulation, so only a backward inside no_sync() is compared), and
        which earlier micro-batches' activations are still alive. A forward under torch.no_grad() (an accuracy
        logged) is no micro-batch: it builds no graph and DDP does not synchronise for it."""
        record = self.current
        if not torch.is_grad_enabled():
            record.evaluations += 1
            return
        record.still_alive.append(self.saved.alive_before(len(record.no_sync_forwards)))
        if record.no_sync_forwards and record.no_sync_forwards[-1] and record.backward_lags[-1] == 0 \
                and self._changed_since_backward():
            record.touched.append(len(record.no_sync_forwards))
        self.accumulated = {}
        record.no_sync_forwards.append(not self.ddp.require_backward_grad_sync)

    def _accumulated(self, index: int, parameter: torch.Tensor) -> None:
        self.accumulated[index] = parameter.grad.detach().clone()

    def _changed_since_backward(self) -> bool:
        """Whether some .grad differs from what the last backward left in it; a zeroing (every .grad zero or
        None: zero_grad()) does not count, the grader names that by its values."""
        grads = [p.grad for p in self.parameters]
        if all(g is None or not g.any() for g in grads):
            return False
        return any(grads[i] is None or not torch.equal(grads[i], saved) for i, saved in self.accumulated.items())

    def _forward_done(self, module, args, output) -> None:
        """Hook the forward's output, so that the record notes how many forwards had run when its backward
        reached it."""
        if not torch.is_grad_enabled():
            return
        record, index = self.current, len(self.current.no_sync_forwards) - 1
        record.backward_lags.append(None)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(functools.partial(_backward_reached, record, index))

    def _module_forward(self, module, args) -> None:
        if torch.is_grad_enabled():
            self.current.module_forwards += 1

    def _sync(self, state, bucket):
        """DDP's default reduction (divide by N, all_reduce), counted, and what the bucket carried noted, per
        parameter (GradBucket.parameters() and .gradients(), the bucket's views of each gradient)."""
        self.current.syncs += 1
        index = {p.data_ptr(): i for i, p in enumerate(self.parameters)}
        for parameter, gradient in zip(bucket.parameters(), bucket.gradients(), strict=True):
            self.current.synced[index[parameter.data_ptr()]] = gradient.detach().double().flatten().tolist()
        self.in_sync = True
        try:
            return default_hooks.allreduce_hook(None, bucket)
        finally:
            self.in_sync = False

    def _step(self, optimizer, args, kwargs) -> None:
        self.current.step_grads.append(flat_grads(self.ddp.module))

    @contextlib.contextmanager
    def _watched_no_sync(self):
        self.current.entered_no_sync = True
        with self._no_sync():
            yield


class SavedActivations:
    """What autograd saves for backward, per micro-batch, measured while it is alive: while the student's step
    runs, torch.autograd.graph.saved_tensors_hooks packs every saved tensor into a small holder, counted under
    the micro-batch whose forward is running; autograd drops the holder when it frees that graph (after a
    backward without retain_graph=True, or when the last reference to the loss goes), and a finalizer counts it
    out. Deterministic: CPython frees by reference counts (a collection is run before a graph is said alive,
    for graphs held in a cycle; once one has shown graphs alive on purpose, the verdict is that call's, and later
    forwards skip it: a collection costs tenths of a second on a loaded machine)."""

    def __init__(self, watch: Watch):
        self.watch = watch
        self.alive: dict[tuple[int, int], int] = {}  # (id of the step's record, micro-batch index) -> holders
        self.confirmed = False  # a collection has shown graphs alive on purpose: no need to collect again

    def hooks(self):
        """The context under which the student's step runs."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, tensor: torch.Tensor):
        holder = _Saved(tensor)
        key = (id(self.watch.current), len(self.watch.current.no_sync_forwards) - 1)
        self.alive[key] = self.alive.get(key, 0) + 1
        weakref.finalize(holder, self._released, key)
        return holder

    def _released(self, key: tuple[int, int]) -> None:
        self.alive[key] -= 1

    def alive_before(self, index: int) -> list[int]:
        """The micro-batches (1-based) before forward `index` of this call whose saved tensors are alive."""
        def held() -> list[int]:
            record = id(self.watch.current)
            return [i + 1 for (r, i), n in sorted(self.alive.items()) if r == record and 0 <= i < index and n]
        if held() and not self.confirmed:
            gc.collect()  # a graph held only by a reference cycle is garbage, not memory kept on purpose
            self.confirmed = bool(held())  # once shown, the verdict is that call's: later ones skip the collection
        return held()


class _Saved:
    """A tensor autograd saved for backward, held so that its life can be watched (a weakref to a Tensor would
    follow the tensor, which the model's parameters outlive)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _unpack(holder: _Saved) -> torch.Tensor:
    return holder.tensor


def _backward_reached(record: StepRecord, index: int, grad: torch.Tensor) -> None:
    """A tensor hook: the backward reached forward `index`'s output; note how many forwards ran after it."""
    if record.backward_lags[index] is None:
        record.backward_lags[index] = len(record.no_sync_forwards) - 1 - index


def flat_grads(model: torch.nn.Module) -> list[float]:
    """Every parameter's gradient, flattened into one list (zeros where .grad is None)."""
    return [v for p in model.parameters() for v in (p.grad if p.grad is not None else torch.zeros_like(p))
            .flatten().tolist()]


_WARM_UP = Case(1, {"features": 3, "hidden": 4, "seed": 0, "dtype": torch.float64})


def warm_up() -> None:
    """On a rank: wrap a model in DDP once, so that what torch imports on DDP's first use is imported before a
    graded call's timeout starts."""
    torch.nn.parallel.DistributedDataParallel(accumulation_model(_WARM_UP, labkit.device()))


def attempt(fn, case: Case) -> list[StepRecord]:
    """On a rank: STEPS calls of fn(ddp_model, optimizer, this rank's micro-batches), watched; one record each."""
    device = labkit.device()
    ddp = torch.nn.parallel.DistributedDataParallel(accumulation_model(case, device))
    optimizer = _optimizer(ddp, case)
    watch, records = Watch(ddp, optimizer), []
    for step in range(STEPS):
        watch.current, guard = StepRecord(), AccumulationGuard(watch)
        with guard, watch.saved.hooks():
            fn(ddp, optimizer, rank_microbatches(case, step, labkit.rank(), device))
        watch.current.forbidden = guard.forbidden
        watch.current.reduced = [v for i, p in enumerate(watch.parameters)
                                 for v in watch.current.synced.get(i, [0.0] * p.numel())]
        watch.current.params = [v for p in ddp.module.parameters() for v in p.detach().double().flatten().tolist()]
        records.append(watch.current)
    return records


class AccumulationGuard(Guard):
    """While the student's step runs on a rank: every all_reduce made outside DDP's communication hook noted in
    watch.current.own_allreduces, with what it held, then made; every other way into torch.distributed's
    communication (broadcast, barrier, send, ...) raises ForbiddenCall: DDP does the step's communication."""

    def __init__(self, watch: Watch):
        super().__init__()
        self.watch = watch

    def install(self) -> None:
        """Every collective but all_reduce off; each all_reduce made outside DDP's own hook noted."""
        self.switch_off_torch_distributed(allowed=("all_reduce", "allreduce"), point_to_point=False)
        wrap_group_method(self, Kind.ALLREDUCE, self._counted)

    def _counted(self, call: GroupCall):
        """Note a ProcessGroup.allreduce (where dist.all_reduce arrives) made outside DDP's own hook, then make it."""
        _store.add(Call.of(call))  # DDP's and any other: for the runner's rule after a RankError
        if not self.watch.in_sync:
            self.watch.current.own_allreduces.append(_held(call.tensor, list(self.watch.ddp.module.parameters())))
        return call.proceed()


def _held(tensor: torch.Tensor, parameters: list) -> str:
    """What an all_reduce made by hand held: "gradient" for a parameter's .grad or a tensor of a parameter's
    shape (a copy of one), else the tensor's shape in words."""
    if any(p.grad is not None and p.grad.data_ptr() == tensor.data_ptr() or p.shape == tensor.shape
           for p in parameters):
        return "gradient"
    return "a scalar (a loss?)" if tensor.dim() == 0 else f"a tensor of shape {tuple(tensor.shape)}"


SPEC = Spec(attempt=attempt, cases=_cases,
            checks=(_forbidden_problem, _calls_problem, _sync_problem, _touched_problem, _values_problem),
            describe=_described, why_forbidden=_why_forbidden, on_hang=_hang_message, on_error=_error_message,
            passed=_passed, example="check_no_sync_accumulation(train_step)")
