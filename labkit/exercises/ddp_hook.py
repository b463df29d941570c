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

`check_bucketed_ddp_hook(attach)` trains the same small model on 3 gloo ranks with bucket_nbytes = 480 (a last
bucket left for finish()), then on 2 with 216 (a first bucket of exactly 216 bytes: a bucket full only above the
limit, or one that counts only its newest gradient, makes other buckets), each rank on its own equal shard of one
batch, a few SGD steps (`labkit.exercises.ddp_hook_guard`). A solution passes only if, on every rank:

- it communicated through dist.all_reduce only (torch's DDP and labkit.parallel's BucketedDDP and
  average_gradients are switched off), with hooks from register_post_accumulate_grad_hook, not register_hook;
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
- after finish(), every gradient equals torch's DistributedDataParallel's on the same rank, and the whole batch's
  in one process (float64, within 1e-9), at every step, and the trained parameters equal DDP's.
"""

from __future__ import annotations

import labkit
from labkit.checks import timeout_seconds as checked_timeout
from labkit.exercises.allreduce import TIMEOUT_SECONDS
from labkit.exercises.average_guard import BATCH, OutOfStep
from labkit.exercises.ddp_hook_guard import (
    BUCKET_NBYTES,
    EXACT_BUCKET_NBYTES,
    STEPS,
    attempt_hook,
    ddp_reference,
    hook_model,
    last_hook_attempt,
    one_process_run,
)
from labkit.exercises.guard import first_failure, forbidden_message, stop_pool, where_ranks_waited
from labkit.exercises.progress import graded
from labkit.exercises.verdict import Verdict
from labkit.launch.errors import NoReply

__all__ = ["HOOK_CASES", "TOLERANCE", "check_bucketed_ddp_hook", "expected_buckets"]

HOOK_CASES = ((3, BUCKET_NBYTES), (2, EXACT_BUCKET_NBYTES))  # (world_size, bucket_nbytes); 3 first: a missing
# division by N shows as 3x
TOLERANCE = 1e-9  # float64: a right answer is within 1e-15 of DDP's; every mistake is off by far more
REFERENCE_SECONDS = 120.0  # torch's DDP, the grader's own run: its first use in a rank imports for seconds
_NAMED = [(name, p.numel()) for name, p in hook_model().named_parameters()]
_ITEM_NBYTES = 8  # float64
_WRONG_HOOK = ("You registered p.register_hook(...): a tensor hook runs when the gradient is computed, before "
               "it is accumulated into p.grad (at the first step p.grad is still None). The exercise's hook is "
               "register_post_accumulate_grad_hook's, which runs once p.grad holds the new gradient.")


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
        Not yet. On 3 ranks (a batch of 24 rows, 8 per rank), ...after loss.backward() returned...
    """
    timeout_seconds = checked_timeout("timeout_seconds", timeout_seconds)
    if not callable(attach):
        return Verdict(False, "pass your function itself, e.g. check_bucketed_ddp_hook(attach), not "
                              f"{type(attach).__name__}.")
    alone = one_process_run()
    for world_size, bucket_nbytes in HOOK_CASES:
        problem = _case_problem(attach, world_size, bucket_nbytes, alone, timeout_seconds)
        if problem:
            return Verdict(False, f"On {world_size} ranks (a batch of {BATCH} rows, {BATCH // world_size} per "
                                  f"rank), {problem}")
    cases = " and ".join(f"{world_size} ranks (bucket_nbytes = {nbytes} bytes)" for world_size, nbytes in HOOK_CASES)
    return Verdict(True, f"on {cases} your hooks all-reduced the gradients in buckets as the backward made "
                         f"them, each as soon as it was full, the first while loss.backward() was still running, "
                         f"and finish() waited for every one, once; after it every gradient equals torch's "
                         f"DistributedDataParallel's and the whole batch's in one process, at each of {STEPS} SGD "
                         "steps. That is DDP's bucketing and overlap (Li et al. 2020, 3.2.2-3.2.3).")


def _case_problem(attach, world_size: int, bucket_nbytes: int, alone, timeout_seconds: float) -> str | None:
    """What is wrong with attach on `world_size` ranks, or None. torch's DDP runs only for the values' check."""
    try:
        outcomes = labkit.run(attempt_hook, attach, bucket_nbytes, world_size=world_size, timeout=timeout_seconds)
    except labkit.RankTimeout as hang:  # labkit stops a pool whose call timed out
        return _hang_message(hang, timeout_seconds)
    except labkit.RankError as error:
        return _error_message(error, _last_attempts(error, world_size))
    if any([launch.numel for launch in o.launches] != [launch.numel for launch in outcomes[0].launches]
           for o in outcomes):
        stop_pool(world_size)
    problem = _calls_problem(outcomes, bucket_nbytes)
    if problem:
        return problem
    ddp = labkit.run(ddp_reference, bucket_nbytes, world_size=world_size, timeout=REFERENCE_SECONDS)
    _check_reference(ddp, alone)
    return _values_problem(outcomes, ddp)


def _check_reference(ddp, alone) -> None:
    """torch's DDP must equal one process on the whole batch; if not, the grader itself is broken."""
    for grads, final in ddp:
        if _gap(final, alone[1]) > TOLERANCE or any(_gap(g, a) > TOLERANCE for g, a in zip(grads, alone[0],
                                                                                             strict=True)):
            raise RuntimeError("check_bucketed_ddp_hook: torch's DDP differs from one process on the whole batch; "
                               "the grader cannot judge (please report this).")


def _last_attempts(error: labkit.RankError, world_size: int) -> list[dict] | None:
    """Each rank's hooks and all_reduce sizes when the attempt raised; the pool is stopped if the ranks' all_reduces
    are out of step (the next case's would meet them). None when the pool was stopped already."""
    if error.pool_stopped or any(f.kind == NoReply.DIED for f in error.failures):
        return None
    try:
        last = labkit.run(last_hook_attempt, world_size=world_size)
    except labkit.RankError:
        return None  # then labkit has stopped the pool itself
    if any(entry.get("numels") != last[0].get("numels") for entry in last):
        stop_pool(world_size)
    return last


def expected_buckets(ready: list[int], bucket_nbytes: int = BUCKET_NBYTES) -> list[list[list[int]]]:
    """The buckets (lists of parameter indices) that gradients ready in the order `ready` make: under the
    exercise's rule, torch DDP's (send once a bucket holds at least bucket_nbytes), then under the at-most rule
    (at most bucket_nbytes, a bigger gradient alone)."""
    at_most, capped = [], []
    for index in ready:
        if capped and _nbytes(capped) + _nbytes([index]) > bucket_nbytes:
            at_most.append(capped)
            capped = []
        capped = capped + [index]
    return [_filled(ready, lambda bucket: _nbytes(bucket) >= bucket_nbytes), at_most + [capped] * bool(capped)]


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
    (lambda bucket, limit: _nbytes(bucket[-1:]) >= limit,
     "the bucket is full when the gradients IN it reach bucket_nbytes, not when one gradient does. Add up the "
     "bytes of every gradient in the bucket, not only the newest p.grad's."),
    (lambda bucket, limit: _nbytes(bucket) > limit,
     "a bucket that reaches exactly bucket_nbytes is full. Send it once its gradients hold at least "
     "bucket_nbytes (>=), not only once they hold more (>)."),
)


def _mistaken_rule(numels: list[int], ready: list[int], bucket_nbytes: int) -> str | None:
    """What to tell a student whose all_reduce sizes are the buckets of a known wrong rule, or None."""
    for full, mistake in _MISTAKEN_RULES:
        buckets = _filled(ready, lambda bucket, full=full: full(bucket, bucket_nbytes))
        if numels == [_nbytes(b) // _ITEM_NBYTES for b in buckets]:
            return mistake
    return None


def _nbytes(indices: list[int]) -> int:
    return sum(_NAMED[i][1] for i in indices) * _ITEM_NBYTES


def _calls_problem(outcomes, bucket_nbytes: int) -> str | None:
    """A refused call, a wrong hook, no overlap, a wait too early or never, or all_reduces that are not the buckets."""
    for rank, outcome in enumerate(outcomes):
        if outcome.forbidden:
            return forbidden_message(rank, outcome.forbidden[0], True, _why_forbidden)
    for rank, outcome in enumerate(outcomes):
        problem = _rank_calls_problem(rank, outcome)
        if problem:
            return problem
    for rank, outcome in enumerate(outcomes):
        for step in range(STEPS):
            problem = _buckets_problem(rank, step, outcome, bucket_nbytes)
            if problem:
                return problem
    return None


def _rank_calls_problem(rank: int, outcome) -> str | None:
    """What attach returned, which hooks it used, and when its all_reduces started and were waited, on one rank."""
    if outcome.returned is not None:
        return (f"attach returned {outcome.returned}, not a function: end attach with `return finish`, the "
                "function (no arguments) that the training loop calls after each backward().")
    if outcome.hooks.get("register_hook") and not outcome.hooks.get("register_post_accumulate_grad_hook"):
        return f"on rank {rank}: {_WRONG_HOOK}"
    if not outcome.launches:
        return f"rank {rank} made no all_reduce: each rank kept its own gradient."
    op = next((op for op in outcome.ops if op not in ("SUM", "AVG")), None)
    if op:
        return (f"rank {rank} all-reduced with ReduceOp.{op}: that keeps the {op.lower()} over the ranks, not their "
                "sum.")
    if outcome.unwaited:
        return (f"rank {rank} started {outcome.unwaited} all_reduce(s) in {STEPS} steps with async_op=True and "
                "never called wait() "
                "on the handle: the bucket was read before the reduction finished.")
    return _overlap_problem(rank, outcome)


def _overlap_problem(rank: int, outcome) -> str | None:
    """A wait inside the backward, a step whose all_reduces all started after it, or handles used again later."""
    if outcome.early:
        return _early_message(rank, *outcome.early[0])
    for step in range(len(outcome.order)):
        first = next((launch for launch in outcome.launches if launch.step == step), None)
        if first is None or not first.in_backward:
            hooked = outcome.hooks.get("register_post_accumulate_grad_hook")
            why = "" if hooked else " (attach registered no hook on the parameters)"
            return (f"at step {step + 1} rank {rank}'s first all_reduce started after loss.backward() returned"
                    f"{why}: nothing overlapped the backward.")
    again = [launch for launch in outcome.launches if launch.again]
    if again:
        (step, call), first = again[0].again, again[0].step
        count = sum(launch.step == first and launch.again[0] == step for launch in again)
        return (f"at step {step + 1} rank {rank} called {call} again on {count} handle(s) of step {first + 1}: "
                "the list of buckets in flight was never emptied, so every step waits for, divides and copies "
                "back the old buckets once more (the values came out right here only because each step's own "
                "buckets were copied last).")
    return None


_WHY_EARLY = {  # how each spelling of a wait inside the backward waits
    "dist.all_reduce without async_op=True": "a blocking all_reduce waits for itself",
    "handle.wait()": "handle.wait() right after starting the all_reduce",
    "handle.get_future().wait()": "the handle's future waits just as the handle does",
    "handle.result()": "it reads the bucket before finish() has waited for it",
    "handle.synchronize()": "it waits for the all_reduce as handle.wait() does",
    "dist.barrier()": "gloo's barrier first waits for every all_reduce started before it",
}


def _early_message(rank: int, step: int, call: str) -> str:
    """Rank `rank` waited for an all_reduce (`call`) at step `step` while loss.backward() was still running."""
    why = _WHY_EARLY.get(call, "asking whether it is done, again until it is, waits just as handle.wait() does")
    return (f"rank {rank} waited for an all_reduce while loss.backward() was still running ({call} inside the "
            f"hook at step {step + 1}: {why}): the backward stops until the network is done, so nothing overlaps.")


def _buckets_problem(rank: int, step: int, outcome, bucket_nbytes: int) -> str | None:
    """The step's all_reduce sizes against the buckets that the order the gradients became ready makes."""
    launches = [launch for launch in outcome.launches if launch.step == step]
    numels = [launch.numel for launch in launches]
    ready = outcome.order[step]
    options = expected_buckets(ready, bucket_nbytes)
    matching = [option for option in options if numels == [_nbytes(b) // _ITEM_NBYTES for b in option]]
    if matching:
        late = [_late_bucket(launches, option) for option in matching]
        return None if None in late else _late_message(rank, step, *late[0])
    total, sizes = sum(n for _, n in _NAMED), sorted(n for _, n in _NAMED)
    where = f"at step {step + 1} rank {rank} all-reduced {len(numels)} tensor(s) of {numels} elements"
    rule = (f"With bucket_nbytes = {bucket_nbytes} bytes ({bucket_nbytes // _ITEM_NBYTES} float64 numbers) and the "
            f"gradients ready in the order {', '.join(f'{_NAMED[i][0]} ({_NAMED[i][1]})' for i in ready)}, the "
            f"buckets hold {[_nbytes(b) // _ITEM_NBYTES for b in options[0]]} elements.")
    if sorted(numels) == sizes:
        return f"{where}: one all_reduce per parameter, no buckets. {rule}"
    if sum(numels) < total:
        return (f"{where}: {sum(numels)} of the {total} gradient numbers. The last bucket, not full when the "
                f"backward ended ({total - sum(numels)} numbers), was never sent. {rule}")
    if sum(numels) > total:
        return (f"{where}: {sum(numels)} numbers, more than the {total} of the gradients: a gradient went out "
                f"twice: a bucket kept its gradients after it was sent. {rule}")
    mistake = _mistaken_rule(numels, ready, bucket_nbytes)
    if mistake:
        return f"{where}, not the buckets: {mistake} {rule}"
    return f"{where}, not the buckets. {rule} (Each float64 number is 8 bytes.)"


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


def _late_message(rank: int, step: int, number: int, numel: int, full: int, ready: int) -> str:
    """Bucket `number` went out only once `ready` gradients were ready, though it was full after `full`."""
    total = len(_NAMED)
    when = "every gradient was ready" if ready == total else f"{ready} of the {total} gradients were ready"
    return (f"at step {step + 1} rank {rank} started bucket {number} ({numel} numbers) only once {when}, though "
            f"it was full once {full} were: it waited for gradients that are not in it, so it overlapped "
            f"{'nothing' if ready == total else 'less'} of the backward.")


def _values_problem(outcomes, ddp) -> str | None:
    """Gradients after finish() against torch's DDP's on the same rank, step by step; then the trained models."""
    world_size = len(outcomes)
    for step in range(STEPS):
        for rank, outcome in enumerate(outcomes):
            problem = _step_problem(outcome.averaged[step], outcome.local[step], ddp[rank][0][step], world_size)
            if problem:
                return f"at SGD step {step + 1} of {STEPS}, after finish(), rank {rank}'s {problem}"
    for rank, outcome in enumerate(outcomes):
        gap = _gap(outcome.final, ddp[rank][1])
        if gap > TOLERANCE:
            return (f"rank {rank}'s model after {STEPS} steps differs from torch's DDP's by {gap:.3g}: did attach or "
                    "finish change anything but .grad?")
    return None


def _step_problem(got, local, want, world_size: int) -> str | None:
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
        return (f"gradients of {_names(kept)} are still its own (not averaged), while {_names(averaged)} were: "
                "those never came back from a bucket.")
    scaled = [[x * world_size for x in w] for w in want]
    if len(wrong) == len(got) and _gap(got, scaled) <= TOLERANCE * world_size:
        return (f"gradients are {world_size}x torch's DDP's: the {world_size} ranks' gradients were summed, not "
                "averaged.")
    first = wrong[0]
    return (f"gradient of {_NAMED[first][0]} differs from torch's DistributedDataParallel's by "
            f"{_gap([got[first]], [want[first]]):.3g}: it is neither its own gradient nor the average over the "
            "ranks.")


def _names(indices: list[int]) -> str:
    return ", ".join(_NAMED[i][0] for i in indices)


def _gap(got, want) -> float:
    """The largest absolute difference between two lists of lists of floats (inf if their shapes differ)."""
    if [len(g) for g in got] != [len(w) for w in want]:
        return float("inf")
    return max((abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True)), default=0.0)


def _hang_message(hang: labkit.RankTimeout, timeout_seconds: float) -> str:
    """A run that never finished: where the first ranks waited, and why all_reduce waits."""
    return (f"it never finished (stopped after {timeout_seconds:g} s): a rank waited in an all_reduce that the "
            f"others did not join. {where_ranks_waited(hang)}. Every rank must start the same buckets in the same "
            "order, the order its gradients become ready, which is the same on every rank.")


def _error_message(error: labkit.RankError, last: list[dict] | None) -> str:
    """A run that raised: the first switched-off call, a wrong hook, ranks out of step, else the first error."""
    first, spelling = first_failure(error)
    if spelling is not None:
        return forbidden_message(first.rank, spelling, False, _why_forbidden)
    summary = first.summary.strip().removesuffix(".")
    if first.raised(OutOfStep) and first.exception_args:
        said = str(first.exception_args[0]).strip().removesuffix(".")
        return (f"{said}: the ranks' buckets went out in different orders or sizes. On real "
                "ranks that sums unrelated gradients, or hangs, or aborts (gloo: 'Received data size doesn't "
                "match expected size'). Every rank must fill its buckets in the order its gradients become ready, "
                "whatever the rank.")
    message = f"rank {first.rank} raised {summary}."
    hooks = (last or [{}])[min(first.rank, len(last or [{}]) - 1)].get("hooks", {})
    if hooks.get("register_hook") and not hooks.get("register_post_accumulate_grad_hook"):
        message += f" {_WRONG_HOOK}"
    elif "AVG" in first.summary:
        message += " gloo has no ReduceOp.AVG (NCCL has): on gloo the average is built from a sum."
    return message


def _why_forbidden(spelling: str, name: str) -> str:
    """Why the call `spelling` is switched off while the bucketed hook is graded, and what to use instead."""
    if "labkit.parallel" in spelling or "DistributedDataParallel" in spelling:
        return "That is a ready-made data parallelism, which does the exercise for you: it is switched off here."
    return ("This exercise allows one collective only, dist.all_reduce: other communication is switched off "
            "while it is graded.")
