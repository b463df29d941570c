"""The grader of notebook 11's "your turn": ZeRO-1's step, which the student writes, run on real ranks.

`check_sharded_step(fn)` calls `fn(param, grad, lr)` on 2, 3 and 4 ranks: fixed cases, then two runs
drawn afresh at each grading (`draw_cases`: world size, dtype, sizes, lr and the inputs' values), in each of which
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

The grading is the kit's runner driven by `SPEC` (labkit.exercises._kit._runner): each case is one run of calls
on the same ranks (`Case(world_size, {"steps": (StepCase, ...)})`), the rank-side attempt, the ordered checks
and the messages. On a rank (`attempt`), each call runs under a `StepGuard`: traffic is counted where torch hands
each collective to the process group (ProcessGroup.reduce_scatter, .allgather, .broadcast, .allreduce and their
single-tensor forms), each recorded as the kit's `Call`, and converted to the bytes each rank sends in the ring
algorithm (`sent_nbytes`). Calls that would move data past that count raise `ForbiddenCall`: point-to-point
messages, object collectives, reduce/gather/scatter/all_to_all, coalesced forms, the backend's methods and the
c10d operators under torch.ops (functional collectives). Each collective's handle is watched, so that one started
with async_op=True and never waited for is named as such. What is wrong with a step's values and traffic is in
the private labkit.exercises._step_diagnosis, with the step's inputs and its reference answer.
"""

from __future__ import annotations

import random

import torch

import labkit
from labkit.exercises._kit import _store
from labkit.exercises._kit._group_call import GroupCall, flat_tensors, wrap_group_method
from labkit.exercises._kit._guard import Guard
from labkit.exercises._kit._messages import failure_sentence, first_failure, hang_message
from labkit.exercises._kit._record import Recorder
from labkit.exercises._kit._runner import Case, Spec, grade
from labkit.exercises._step_diagnosis import (
    COLLECTIVE,
    StepCase,
    StepOutcome,
    described_call,
    step_facts,
    step_inputs,
    step_traffic,
    wrong_step,
)
from labkit.exercises.allreduce import TIMEOUT_SECONDS
from labkit.exercises.progress import graded
from labkit.exercises.verdict import Verdict
from labkit.launch.errors import NoReply
from labkit.parallel.flat_shards import FlatLayout
from labkit.plan.counts import shard_sizes

__all__ = ["DRAWN", "StepGuard", "check_sharded_step", "draw_cases", "padded", "step_inputs", "unpad_into"]

# (world_size, numel, dtype): sizes N divides first, then sizes it does not, fewer elements than ranks, float64
_FIXED = [(3, 6, torch.float32), (2, 4, torch.float32), (4, 8, torch.float32), (3, 7, torch.float32),
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
    return grade(SPEC, fn, timeout_seconds=timeout_seconds)


def _passed(cases) -> str:
    """The verdict of a pass: what was checked."""
    return ("your sharded step gives full SGD's answer on the averaged gradient on 2, 3 and 4 ranks, for sizes that "
            "N divides, sizes it does not and fewer elements than ranks, in float32 and float64, with inputs and lr "
            "drawn for this grading, called more than once on the same ranks. Each rank updated only its own slice, "
            "reduce-scattered its own gradient and all-gathered its updated slice, and sent what DDP's all-reduce "
            "sends: a reduce-scatter and an all-gather, 2(N-1)/N x S bytes per rank. ZeRO-1 keeps the optimizer "
            "state of that slice only, 1/N of it, for the same traffic.")


def draw_cases() -> list[Case]:
    """The cases of one grading: the fixed ones, one call each, then the drawn runs (DRAWN), each a run of calls on
    the same ranks, every call with its own size, lr and inputs; the two runs on different world sizes and
    dtypes."""
    cases = [Case(world_size, {"steps": (StepCase(world_size, numel, dtype),)}) for world_size, numel, dtype in _FIXED]
    world_sizes, dtypes = random.sample(DRAWN["world_size"], 2), random.sample(DRAWN["dtype"], 2)
    for world_size, dtype in zip(world_sizes, dtypes, strict=True):
        numels, lrs = random.sample(DRAWN["numel"], DRAWN["calls"]), random.sample(DRAWN["lr"], DRAWN["calls"])
        cases.append(Case(world_size, {"steps": tuple(StepCase(world_size, numel, dtype, lr, random.getrandbits(31))
                                                      for numel, lr in zip(numels, lrs, strict=True))}))
    return cases


def _described(case: Case) -> str:
    """'On 3 ranks, with 6 float32 parameters (S = 24 bytes; shard_sizes(6, 3) = [2, 2, 2])' for one call; for a
    run of calls: the ranks and every call's size and lr (a check then names the call)."""
    steps = case["steps"]
    if len(steps) == 1:
        return f"On {case.world_size} ranks, with {_one_call(steps[0])}"
    sizes = " and ".join(f"{c.numel} (lr = {c.lr:g})" for c in steps)
    return f"On {case.world_size} ranks, in {len(steps)} calls with {sizes} {_dtype(steps[0].dtype)} parameters"


def _one_call(step: StepCase) -> str:
    """'6 float32 parameters (S = 24 bytes; shard_sizes(6, 3) = [2, 2, 2])', and 'drawn values' when drawn."""
    nbytes = step.numel * torch.empty(0, dtype=step.dtype).element_size()
    drawn = "" if step.draw is None else f"; drawn values, lr = {step.lr:g}"
    return (f"{step.numel} {_dtype(step.dtype)} parameters (S = {nbytes} bytes; shard_sizes({step.numel}, "
            f"{step.world_size}) = {shard_sizes(step.numel, step.world_size)}{drawn})")


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _per_call(check):
    """A check of one call on every rank, run on each call of the case in turn: the first problem, the call named
    when the run has more than one (each on fresh inputs)."""
    def checked(outcomes: list[list[StepOutcome]], case: Case) -> str | None:
        steps = case["steps"]
        for k, step in enumerate(steps):
            problem = check([run[k] for run in outcomes], step)
            if problem:
                return problem if len(steps) == 1 else \
                    f"in call {k + 1} of {len(steps)} on these ranks, each on fresh inputs, with {_one_call(step)}: " \
                    f"{problem}"
        return None
    checked.__name__ = check.__name__
    return checked


def _unwaited_problem(outcomes: list[StepOutcome], step: StepCase) -> str | None:
    """The first collective a rank started with async_op=True and never waited for: what it reads or writes may
    not be there yet (torch.distributed docs: an async op's output is only ready after wait() on its handle)."""
    for rank, outcome in enumerate(outcomes):
        call = next((c for c in outcome.calls if not c.waited), None)
        if call:
            future = " It took the handle's future (work.get_future()) but never waited on it either." \
                if call.future else ""
            return (f"rank {rank} started {described_call(call)} with async_op=True and never waited for it.{future} "
                    "Until its handle's wait() returns, the collective may still be running: what it receives is "
                    "not there yet, and changing what it sends changes what the others get.")
    return None


def _hang_message(hang: labkit.RankTimeout, case: Case, timeout_seconds: float) -> str:
    """A step that never finished: which ranks had returned, why collectives wait, and where the first waited."""
    stopped = {f.rank for f in hang.failures if f.kind == NoReply.STOPPED}
    returned = sorted(set(range(case.world_size)) - stopped)
    returned = f", and rank(s) {returned} had returned" if returned else ""
    return hang_message(hang, timeout_seconds, f"some rank waited in a collective that the others never joined"
                        f"{returned}. Every rank must make the same collectives in the same order: one "
                        "reduce-scatter, then one all-gather (or one broadcast from each owner, in the same order "
                        "everywhere), on every rank, even one whose slice is empty.")


def _error_message(error: labkit.RankError, attempts, case: Case) -> str:
    """A step that raised (a refused call the runner has told already): the first rank's own error and a hint."""
    first = first_failure(error)[0]
    hint = ""
    if "invalid tensor size" in first.summary:
        hint = " " + PADDING_HINT
    elif "outputShape[0] * worldSize == inputShape[0]" in first.summary:
        hint = (" reduce_scatter_tensor wants N equal chunks, and the slices of shard_sizes differ by one element "
                "when N does not divide numel.")
    elif "dtype" in first.summary:
        hint = " " + SAME_DTYPE_HINT
    return f"{failure_sentence(first)}.{hint}"


def _why_forbidden(spelling: str, name: str) -> str:
    """Why the call `spelling` (function `name`) is switched off while the ZeRO-1 step is graded, and what instead."""
    if name in ("send", "recv", "isend", "irecv", "batch_isend_irecv", "recv_anysource"):
        return (f"This step is built from collectives, not from messages: {ALLOWED}. (Notebook 03 built the ring "
                "from send and recv; here torch's reduce-scatter and all-gather are the pieces.)")
    if name.endswith("_object") or name.endswith("_object_list"):
        return f"It pickles Python objects; move the tensors themselves with {ALLOWED}."
    return f"ZeRO-1's step needs two collectives only: {ALLOWED}."


# ---- on a rank: the guard, and what the student's step left behind ----------------------------------------

# What it may call, counted (COLLECTIVE: the process group's methods); the torch.distributed functions that reach
# them stay on too (every other way to communicate is switched off, send/recv included).
_STEP_ALLOWED = (*COLLECTIVE, "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                 "_all_gather_base")


class StepGuard(Guard):
    """While a student's step runs on a rank: the collectives it may use are recorded as the kit's `Call`s where
    the process group receives them (then made; `recorder.calls`), everything else raises `ForbiddenCall`.

    The ring grader's Guard turned around: there collectives are off and messages counted, here messages are
    off and collectives counted. Everything is replaced where Python looks it up, for the whole process, and put
    back on exit (even when the step raises)."""

    def __init__(self):
        super().__init__()
        self.recorder = Recorder()

    def install(self) -> None:
        """Every collective a step does not use off; those it may use recorded, and their handles watched."""
        self.switch_off_torch_distributed(allowed=_STEP_ALLOWED, point_to_point=False)
        for method in COLLECTIVE:
            wrap_group_method(self, method, self._recorded)
        self.recorder.watch_waits(self)

    def _recorded(self, made: GroupCall):
        """Record a call with this grader's facts, then make it and watch its handle: a blocking call (its options'
        asyncOp False) waits itself. A call never waited for is not waited here: a broadcast nobody joins would
        hang; the runner stops ranks left out of step."""
        call = self.recorder.record(made, facts=_facts(made))
        return self.recorder.launched(made.proceed(), call)


def _facts(made: GroupCall) -> dict[str, object]:
    """step_facts from a ProcessGroup method's arguments, in each of its overloads: (outputs, inputs, opts),
    (tensors, opts), (tensor, root) ..."""
    kind, group, args = COLLECTIVE[made.kind], made.group, made.args
    rank, world_size = group.rank(), group.size()
    first, second = (flat_tensors(args[i]) if len(args) > i else [] for i in (0, 1))
    if not first:
        return step_facts([0], 1, rank, world_size)
    element_size = first[0].element_size()
    nbytes = [t.numel() * element_size for t in first]
    if kind == "reduce_scatter":  # (outputs, input lists) or (output, input)
        listed = made.kind == "reduce_scatter"
        pieces = second if listed else [piece for t in second for piece in t.detach().flatten().chunk(world_size)]
        chunks = [t.numel() * element_size for t in second] if listed else nbytes * world_size
        return step_facts(chunks, element_size, rank, world_size, chunks=[_values(t) for t in pieces])
    if kind == "all_gather":  # (output lists, inputs) or (output, input): the input is this rank's contribution
        chunks = nbytes if made.kind == "allgather" else [sum(t.numel() for t in second) * element_size] * world_size
        return step_facts(chunks, element_size, rank, world_size, sent=[x for t in second for x in _values(t)])
    if kind == "broadcast":
        options = args[1] if len(args) > 1 else made.kwargs.get("opts", made.kwargs.get("root"))
        root = options if isinstance(options, int) else getattr(options, "rootRank", 0)
        return step_facts([sum(nbytes)], element_size, rank, world_size, root,
                          sent=_values(first[0]) if root == rank else None)
    return step_facts([sum(nbytes)], element_size, rank, world_size)


def _values(tensor: torch.Tensor) -> list[float]:
    return tensor.detach().flatten().tolist()


def attempt(fn, case: Case) -> list[StepOutcome]:
    """On a rank: call fn(param, grad, lr) once per step of the case, in turn, each on this rank's fresh inputs
    under a StepGuard (a step that keeps state from one call to the next shows); what each call left, for the
    checks. It stops after a call that called something switched off (the runner reports it)."""
    outcomes = []
    for step in case["steps"]:
        outcomes.append(_attempt_one(fn, step))
        if _store.last_attempt().refused:
            break
    return outcomes


def _attempt_one(fn, step: StepCase) -> StepOutcome:
    """One call of fn under a StepGuard (its collectives go to the kit's last-attempt store as they are made)."""
    param, grad = step.inputs(labkit.rank(), device=labkit.device())
    memory, came = param.data_ptr(), _placement(param)
    guard = StepGuard()
    with guard:
        returned = fn(param, grad, step.lr)
    returned = returned.detach().flatten().tolist() if isinstance(returned, torch.Tensor) and returned is not param \
        else None
    return StepOutcome(param.detach().flatten().tolist(), returned, param.data_ptr() == memory, _placement(param),
                       came, guard.recorder.calls)


def _placement(tensor: torch.Tensor) -> str:
    """'float32 on cpu': a tensor's dtype and device type, for a message."""
    return f"{str(tensor.dtype).removeprefix('torch.')} on {tensor.device.type}"


SPEC = Spec(attempt=attempt, cases=draw_cases, checks=tuple(map(_per_call, (_unwaited_problem, wrong_step,
                                                                             step_traffic))),
            describe=_described, why_forbidden=_why_forbidden, on_hang=_hang_message, on_error=_error_message,
            passed=_passed, example="check_sharded_step(sharded_sgd_step)")
