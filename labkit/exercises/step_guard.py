"""On a rank, while check_sharded_step grades the student's ZeRO-1 step: its inputs, the guard, and what the step
left behind.

Traffic is counted where torch hands each collective to the process group (ProcessGroup.reduce_scatter,
.allgather, .broadcast, .allreduce and their single-tensor forms), as the ring's grader counts each message
in ProcessGroup.send and .recv (`labkit.exercises.guard`), and converted to the bytes each rank sends in the ring
algorithm (`Collective.sent_nbytes`). Calls that would move data past that count raise `ForbiddenCall` while the
step is graded: point-to-point messages, object collectives, reduce/gather/scatter/all_to_all, coalesced forms,
the backend's methods and the c10d operators under torch.ops (functional collectives). Each collective's handle
is watched (`labkit.exercises._kit._wait_watch.watch_waits`), so that one started with async_op=True and never waited
for is named as such.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

import labkit
from labkit.checks import whole
from labkit.exercises._kit._group_call import GroupCall, Kind, flat_tensors, wrap_group_method
from labkit.exercises._kit._guard import Guard
from labkit.exercises._kit._wait_watch import watch_waits
from labkit.exercises.diagnosis import ring_nbytes_per_rank

__all__ = ["LR", "Collective", "StepCase", "StepGuard", "StepOutcome", "attempt_step", "calls_of_last_attempt",
           "step_inputs"]

LR = 0.1  # the fixed cases' lr: not a power of two, so that a float32 buffer inside a float64 step shows


@dataclass(frozen=True)
class StepCase:
    """One call of the student's step: on `world_size` ranks, `numel` parameters of `dtype`, learning rate `lr`;
    `draw` None for the fixed inputs of step_inputs, else the seed of inputs drawn for this grading (the same on
    every rank, each rank's gradient its own)."""

    world_size: int
    numel: int
    dtype: torch.dtype = torch.float32
    lr: float = LR
    draw: int | None = None

    def inputs(self, rank: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank `rank`'s (param, grad) for this call."""
        return step_inputs(rank, self.numel, self.dtype, device, draw=self.draw)

    def resized(self, numel: int) -> StepCase:
        return replace(self, numel=numel)

# What it may call, counted: the process group's method, and the kind it is recorded as; the torch.distributed
# functions that reach them stay on too (every other way to communicate is switched off, send/recv included).
_COUNTED = {Kind.REDUCE_SCATTER: "reduce_scatter", Kind.REDUCE_SCATTER_SINGLE: "reduce_scatter",
            Kind.REDUCE_SCATTER_BASE: "reduce_scatter", Kind.ALLGATHER: "all_gather",
            Kind.ALL_GATHER_SINGLE: "all_gather", Kind.ALLGATHER_BASE: "all_gather", Kind.BROADCAST: "broadcast",
            Kind.ALLREDUCE: "all_reduce", Kind.BARRIER: "barrier"}
_STEP_ALLOWED = (*_COUNTED, "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                 "_all_gather_base")


def step_inputs(rank: int, numel: int, dtype: torch.dtype = torch.float32, device=None, draw: int | None = None):
    """Rank r's (param, grad): param is [1, 2, ..., numel] on every rank, grad is (r + 1)^2 x [numel, ..., 2, 1].
    With `draw` (a seed), param and the gradients' shape are drawn from it instead (the same on every rank): a
    step cannot lean on the fixed values.

    Squares, so that no rank's gradient equals the average over 2, 3 or 4 ranks and every mistake shows.

    >>> step_inputs(1, 3)
    (tensor([1., 2., 3.]), tensor([12.,  8.,  4.]))
    """
    rank, numel = whole("rank", rank, minimum=0), whole("numel", numel, minimum=0)
    param = torch.arange(1, numel + 1, dtype=torch.float64)
    shape = param.flip(0)
    if draw is not None:  # values in [0.5, numel + 1.5): no zero, so that every element's update shows
        generator = torch.Generator().manual_seed(draw)
        param = param + torch.rand(numel, generator=generator, dtype=torch.float64) - 0.5
        shape = shape + torch.rand(numel, generator=generator, dtype=torch.float64) - 0.5
    return param.to(dtype=dtype, device=device), ((rank + 1) ** 2 * shape).to(dtype=dtype, device=device)


@dataclass
class Collective:
    """One collective a rank made while its step was graded, as its process group received it.

    `chunk_nbytes`: the bytes of every rank's chunk of the vector it covers (reduce_scatter, all_gather), or
    [the tensor's bytes] (all_reduce, broadcast); `contribution`: the values this rank put in (its all-gather
    input, or the tensor it broadcast as the root)."""

    kind: str  # "reduce_scatter", "all_gather", "broadcast", "all_reduce" or "barrier"
    chunk_nbytes: list[int]
    element_size: int
    rank: int  # this rank and the size, in the group it was made on
    world_size: int
    root: int | None = None  # a broadcast's source
    contribution: list[float] | None = None
    chunks: list[list[float]] | None = None  # a reduce_scatter's input: the values this rank sent toward each rank
    waited: bool = True  # False for one started with async_op=True whose handle the step never waited for, ...
    future: bool = False  # ... and whether it took the handle's future (work.get_future())

    def sent_nbytes(self) -> int:
        """The bytes this rank sends in the collective's ring algorithm (notebook 03's ring; Patarasuk & Yuan
        2009): a reduce-scatter sends every chunk but the one it completes (its own), an all-gather every chunk
        but the one it receives last (its right neighbour's), a broadcast passes the tensor along a chain from
        the root (every rank but the one before the root sends it once), an all-reduce is both phases."""
        total, n, r = sum(self.chunk_nbytes), self.world_size, self.rank
        if self.kind == "reduce_scatter":
            return total - self.chunk_nbytes[r]
        if self.kind == "all_gather":
            return total - self.chunk_nbytes[(r + 1) % n]
        if self.kind == "broadcast":
            return 0 if r == (self.root - 1) % n else total
        if self.kind == "all_reduce":
            return ring_nbytes_per_rank(total // self.element_size, n, self.element_size)[r]
        return 0

    def describe(self) -> str:
        """'an all_gather of 48 bytes in chunks of [12] (sends 36)', for a message."""
        covered = sum(self.chunk_nbytes)
        if self.kind in ("reduce_scatter", "all_gather"):
            article, chunks = "a" if self.kind == "reduce_scatter" else "an", sorted(set(self.chunk_nbytes))[::-1]
            what = f"{article} {self.kind} of {covered} bytes in chunks of {chunks}"
        elif self.kind == "broadcast":
            what = f"a broadcast of {covered} bytes from rank {self.root}"
        else:
            what = f"an {self.kind} of {covered} bytes" if self.kind == "all_reduce" else "a barrier"
        return f"{what} (sends {self.sent_nbytes()})"


class StepGuard(Guard):
    """While a student's step runs on a rank: the collectives it may use are recorded as `Collective`s where the
    process group receives them (then made), everything else raises `ForbiddenCall`.

    The ring grader's Guard turned around: there collectives are off and messages counted, here messages are
    off and collectives counted. Everything is replaced where Python looks it up, for the whole process, and put
    back on exit (even when the step raises)."""

    def __init__(self):
        super().__init__()
        self.calls: list[Collective] = []
        self._works: list[tuple[object, Collective]] = []  # (handle, the call it belongs to)

    def install(self) -> None:
        """Every collective a step does not use off; those it may use recorded, and their handles watched."""
        self.switch_off_torch_distributed(allowed=_STEP_ALLOWED, point_to_point=False)
        for method in _COUNTED:
            wrap_group_method(self, method, self._recorded)
        watch_waits(self._works, self)

    def _recorded(self, made: GroupCall):
        """Record a call as a Collective of its kind, then make it and watch its handle: a blocking call (its
        options' asyncOp False) waits itself."""
        call = _collective(_COUNTED[made.kind], made.kind, made.group, made.args, made.kwargs)
        call.waited = not made.asynchronous
        self.calls.append(call)
        work = made.proceed()
        self._works.append((work, call))
        return work


def _collective(kind: str, method: str, group, args: tuple, kwargs: dict) -> Collective:
    """A Collective from a ProcessGroup method's arguments, in each of its overloads: (outputs, inputs, opts),
    (tensors, opts), (tensor, root) ..."""
    rank, world_size = group.rank(), group.size()
    first, second = (flat_tensors(args[i]) if len(args) > i else [] for i in (0, 1))
    if not first:
        return Collective(kind, [0], 1, rank, world_size)
    element_size = first[0].element_size()
    nbytes = [t.numel() * element_size for t in first]
    if kind == "reduce_scatter":  # (outputs, input lists) or (output, input)
        pieces = second if method == "reduce_scatter" else \
            [piece for t in second for piece in t.detach().flatten().chunk(world_size)]
        chunks = [t.numel() * element_size for t in second] if method == "reduce_scatter" else nbytes * world_size
        return Collective(kind, chunks, element_size, rank, world_size,
                          chunks=[t.detach().flatten().tolist() for t in pieces])
    if kind == "all_gather":  # (output lists, inputs) or (output, input): the input is this rank's contribution
        chunks = nbytes if method == "allgather" else [sum(t.numel() for t in second) * element_size] * world_size
        return Collective(kind, chunks, element_size, rank, world_size,
                          contribution=[x for t in second for x in t.detach().flatten().tolist()])
    if kind == "broadcast":
        options = args[1] if len(args) > 1 else kwargs.get("opts", kwargs.get("root"))
        root = options if isinstance(options, int) else getattr(options, "rootRank", 0)
        contribution = first[0].detach().flatten().tolist() if root == rank else None
        return Collective(kind, [sum(nbytes)], element_size, rank, world_size, root, contribution)
    return Collective(kind, [sum(nbytes)], element_size, rank, world_size)


@dataclass
class StepOutcome:
    """What one rank's step left behind: param's values, what fn returned, and every collective it made."""

    param: list[float]
    returned: list[float] | None  # a tensor fn returned other than param, as a list
    same_memory: bool  # param still uses the memory it came in
    placement: str  # "float32 on cpu": param's dtype and device after the step, ...
    came: str  # ... and before it
    calls: list[Collective] = field(default_factory=list)
    forbidden: list[str] = field(default_factory=list)  # what it called that is switched off


_last_calls: list[Collective] = []  # on a rank: the collectives of the last graded steps


def attempt_step(fn, steps: list[StepCase]) -> list[StepOutcome]:
    """On a rank: call fn(param, grad, lr) once per case of `steps`, in turn, each on this rank's fresh inputs under
    a StepGuard (a step that keeps state from one call to the next shows); what each call left, for the grader. It
    stops after a call that called something switched off."""
    global _last_calls
    _last_calls = []
    outcomes = []
    for case in steps:
        outcomes.append(_attempt_one(fn, case))
        if outcomes[-1].forbidden:
            break
    return outcomes


def _attempt_one(fn, case: StepCase) -> StepOutcome:
    """One call of fn under a StepGuard, its collectives added to _last_calls even if it raises."""
    param, grad = case.inputs(labkit.rank(), device=labkit.device())
    memory, came = param.data_ptr(), _placement(param)
    guard = StepGuard()
    try:
        with guard:
            returned = fn(param, grad, case.lr)
    finally:
        _last_calls.extend(guard.calls)
    returned = returned.detach().flatten().tolist() if isinstance(returned, torch.Tensor) and returned is not param \
        else None
    return StepOutcome(param.detach().flatten().tolist(), returned, param.data_ptr() == memory, _placement(param),
                       came, guard.calls, guard.forbidden)


def _placement(tensor: torch.Tensor) -> str:
    """'float32 on cpu': a tensor's dtype and device type, for a message."""
    return f"{str(tensor.dtype).removeprefix('torch.')} on {tensor.device.type}"


def calls_of_last_attempt() -> list[str]:
    """On a rank: the kinds of collective the last graded step made, when it raised instead of returning them."""
    return [call.kind for call in _last_calls]
