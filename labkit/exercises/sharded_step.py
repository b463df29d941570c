"""The grader of notebook 11's "your turn": ZeRO-1's step, which the student writes, run on real ranks.

`check_sharded_step(fn)` calls `fn(param, grad, lr)` on 2, 3 and 4 ranks. `param` is the model's flat 1-D
parameter vector, the same on every rank; `grad` is this rank's gradient, different on every rank
(`step_inputs`); both live on labkit.device(). The step is the heart of ZeRO-1 (Rajbhandari et al., "ZeRO:
Memory Optimizations Toward Training Trillion Parameter Models", SC 2020, sections 5.1 and 7): rank r owns
slice r of `shard_sizes(numel, N)` (labkit.plan.counts, the cut of labkit.parallel's ShardedOptimizer), and

1. reduce-scatters the gradients, so that it receives only its slice, averaged over the ranks;
2. updates only its own slice of `param` with SGD (slice -= lr * averaged gradient slice);
3. all-gathers the updated slices, so that every rank's `param` is the whole updated vector again.

A solution passes only if, on every case (sizes that N divides, sizes it does not, fewer elements than ranks,
float32 and float64), on every rank:

- `param` ends equal to full SGD on the averaged gradient computed in one process, in its own memory, in its
  own dtype, on its own device (the step works in place; returning a new tensor fails);
- its collectives are a reduce-scatter and an all-gather (or one broadcast of each slice from its owner): no
  all_reduce, which would hand every rank the whole gradient, and what it sent into the all-gather is its own
  updated slice, not gradients (every rank updating the whole vector gives the right values, but is not sharded);
- its traffic is ZeRO-1's, exactly what DDP's ring all-reduce moves: per rank, the reduce-scatter sends every
  slice but the one it completes and the all-gather every slice but the one it receives last, as the ring of
  notebook 03 does (`ring_nbytes_per_rank`): 2(N-1)/N x S bytes when N divides the size. gloo's all_gather
  needs equal sizes, so padding every slice to the largest is allowed: at most 2(N-1) x the largest slice.

Traffic is counted where torch hands each collective to the process group (ProcessGroup.reduce_scatter,
.allgather, .broadcast, .allreduce and their single-tensor forms), as the ring's grader counts each message
in ProcessGroup.send and .recv, and converted to the bytes each rank sends in the ring algorithm
(`Collective.sent_nbytes`). Calls that would move data past that count raise `ForbiddenCall` while the step is
graded: point-to-point messages, object collectives, reduce/gather/scatter/all_to_all, coalesced forms, the
backend's methods and the c10d operators under torch.ops (functional collectives).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import labkit
from labkit.checks import timeout_seconds as checked_timeout
from labkit.checks import whole
from labkit.exercises.allreduce import TIMEOUT_SECONDS
from labkit.exercises.diagnosis import ring_nbytes_per_rank
from labkit.exercises.guard import Guard, forbidden_spelling, stop_pool
from labkit.exercises.verdict import Verdict
from labkit.launch.errors import NoReply
from labkit.plan.counts import shard_sizes

__all__ = ["LR", "STEP_CASES", "TOLERANCES", "Collective", "StepGuard", "StepOutcome", "attempt_step",
           "calls_of_last_attempt", "check_sharded_step", "reference_step", "step_inputs", "step_nbytes_bounds",
           "step_traffic", "wrong_step"]

LR = 0.1  # not a power of two, so that a float32 buffer inside a float64 step shows in the result
# (world_size, numel, dtype): sizes N divides first, then sizes it does not, fewer elements than ranks, float64
STEP_CASES = [(3, 6, torch.float32), (2, 4, torch.float32), (4, 8, torch.float32), (3, 7, torch.float32),
              (4, 10, torch.float32), (2, 5, torch.float32), (4, 2, torch.float32), (3, 5, torch.float64)]
TOLERANCES = {torch.float32: 1e-6, torch.float64: 1e-12}  # relative; roundings of right solutions differ by ulps
ALLOWED = "dist.reduce_scatter (or reduce_scatter_tensor) and dist.all_gather (or all_gather_into_tensor, or " \
          "one dist.broadcast of each slice from its owner)"
PADDING_HINT = ("gloo's all_gather wants every rank's tensor the same size, and when N does not divide numel the "
                "slices differ by one element: pad each slice to the largest, shard_sizes(numel, N)[0] elements, "
                "and keep the first sizes[r] elements of what comes from rank r (or broadcast each slice from its "
                "owner, dist.broadcast(params[r], src=r), which takes any size).")
SAME_DTYPE_HINT = ("Make every buffer like the tensor it holds a piece of: torch.empty_like(grads[rank]), "
                   "param.new_zeros(n), or dtype=param.dtype, device=param.device.")

# What the step may not call: torch.distributed's functions whose data the process group count would miss or that
# this step does not need, ...
_TORCH_FUNCTIONS = (
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_gather_object", "broadcast_object_list",
    "gather_object", "scatter_object_list", "send_object_list", "recv_object_list", "reduce", "gather", "scatter",
    "all_to_all", "all_to_all_single", "all_reduce_coalesced", "all_gather_coalesced", "new_group",
    "new_subgroups", "new_subgroups_by_enumeration", "split_group", "shrink_group", "init_device_mesh",
    "init_process_group", "destroy_process_group",
)
# ... the process group's other methods (its point-to-point ones included), ...
_GROUP_METHODS = (
    "send", "recv", "recv_anysource", "reduce", "gather", "scatter", "alltoall", "alltoall_base",
    "all_to_all_single", "allreduce_coalesced", "allgather_coalesced", "allgather_into_tensor_coalesced",
    "all_gather_single_coalesced", "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced",
    "monitored_barrier", "split_group", "merge_remote_group",
)
# ... every communication method of a backend (reached through ProcessGroup._get_backend), and every c10d operator.
_BACKEND_METHODS = (
    "allreduce", "allreduce_coalesced", "reduce", "broadcast", "allgather", "_allgather_base",
    "allgather_coalesced", "gather", "scatter", "reduce_scatter", "_reduce_scatter_base", "alltoall",
    "alltoall_base", "barrier", "monitored_barrier", "send", "recv", "recv_anysource",
)
# What it may call, counted: the process group's method, and the kind it is recorded as.
_COUNTED = {"reduce_scatter": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
            "_reduce_scatter_base": "reduce_scatter", "allgather": "all_gather", "all_gather_single": "all_gather",
            "_allgather_base": "all_gather", "broadcast": "broadcast", "allreduce": "all_reduce",
            "barrier": "barrier"}


def step_inputs(rank: int, numel: int, dtype: torch.dtype = torch.float32, device=None):
    """Rank r's (param, grad): param is [1, 2, ..., numel] on every rank, grad is (r + 1)^2 x [numel, ..., 2, 1].

    Squares, so that no rank's gradient equals the average over 2, 3 or 4 ranks and every mistake shows.

    >>> step_inputs(1, 3)
    (tensor([1., 2., 3.]), tensor([12.,  8.,  4.]))
    """
    rank, numel = whole("rank", rank, minimum=0), whole("numel", numel, minimum=0)
    param = torch.arange(1, numel + 1, dtype=dtype, device=device)
    return param, (rank + 1) ** 2 * param.flip(0)


def reference_step(numel: int, world_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The answer, in one process: torch.optim.SGD's step (param - LR x gradient) on the gradient averaged over
    `world_size` ranks.

    >>> reference_step(3, 2)    # the average gradient is 2.5 x [3, 2, 1]
    tensor([0.2500, 1.5000, 2.7500])
    """
    param = torch.nn.Parameter(step_inputs(0, numel, dtype)[0])
    param.grad = torch.stack([step_inputs(r, numel, dtype)[1] for r in range(world_size)]).mean(0)
    torch.optim.SGD([param], lr=LR).step()
    return param.detach()


def step_nbytes_bounds(numel: int, world_size: int, element_size: int = 4) -> list[tuple[int, int]]:
    """(fewest, most) bytes each rank may send in ZeRO-1's step: the fewest are the ring's exact bytes for
    reduce-scatter plus all-gather (`ring_nbytes_per_rank`, what DDP's all-reduce sends); the most allow padding
    every slice to the largest, 2(N-1) x the largest slice. The same when N divides numel: 2(N-1)/N x S.

    >>> step_nbytes_bounds(8, 4)     # S = 32 bytes: 2 x 3/4 x 32 = 48
    [(48, 48), (48, 48), (48, 48), (48, 48)]
    >>> step_nbytes_bounds(10, 4)    # slices of 3, 3, 2, 2 elements
    [(56, 72), (60, 72), (64, 72), (60, 72)]
    """
    numel, world_size = whole("numel", numel, minimum=0), whole("world_size", world_size)
    most = 2 * (world_size - 1) * shard_sizes(numel, world_size)[0] * element_size
    return [(fewest, most) for fewest in ring_nbytes_per_rank(numel, world_size, element_size)]


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

    def __enter__(self) -> StepGuard:
        try:
            self.switch_off_torch_distributed(_TORCH_FUNCTIONS, _GROUP_METHODS, _BACKEND_METHODS)
            for name, kind in _COUNTED.items():
                self._record(name, kind)
        except BaseException:
            self._restore()
            raise
        return self

    def _record(self, name: str, kind: str) -> None:
        """Record each call of ProcessGroup.`name` as a Collective of `kind`, then make it."""
        import torch.distributed as dist

        original = vars(dist.ProcessGroup)[name]

        def recorded(group, *args, **kwargs):
            self.calls.append(_collective(kind, name, group, args, kwargs))
            return original(group, *args, **kwargs)

        self._saved.append((dist.ProcessGroup, name, original))
        setattr(dist.ProcessGroup, name, recorded)


def _flat(value) -> list[torch.Tensor]:
    """The tensors in a tensor or a (nested) list of them, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for item in value for t in _flat(item)]
    return []


def _collective(kind: str, method: str, group, args: tuple, kwargs: dict) -> Collective:
    """A Collective from a ProcessGroup method's arguments, in each of its overloads: (outputs, inputs, opts),
    (tensors, opts), (tensor, root) ..."""
    rank, world_size = group.rank(), group.size()
    first, second = (_flat(args[i]) if len(args) > i else [] for i in (0, 1))
    if not first:
        return Collective(kind, [0], 1, rank, world_size)
    element_size = first[0].element_size()
    nbytes = [t.numel() * element_size for t in first]
    if kind == "reduce_scatter":  # (outputs, input lists) or (output, input)
        chunks = [t.numel() * element_size for t in second] if method == "reduce_scatter" else nbytes * world_size
        return Collective(kind, chunks, element_size, rank, world_size)
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


_last_calls: list[Collective] = []  # on a rank: the collectives of the last graded step


def attempt_step(fn, numel: int, dtype: torch.dtype = torch.float32) -> StepOutcome:
    """On a rank: call fn(param, grad, LR) on this rank's inputs under a StepGuard; what happened, for the grader."""
    global _last_calls
    param, grad = step_inputs(labkit.rank(), numel, dtype, device=labkit.device())
    memory, came = param.data_ptr(), _placement(param)
    guard = StepGuard()
    try:
        with guard:
            returned = fn(param, grad, LR)
    finally:
        _last_calls = guard.calls
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


# ---- the grader -------------------------------------------------------------------------------------------

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
    for world_size, numel, dtype in STEP_CASES:
        problem = _case_problem(fn, world_size, numel, dtype, timeout_seconds)
        if problem:
            element_size = torch.empty(0, dtype=dtype).element_size()
            return Verdict(False, f"On {world_size} ranks, with {numel} {str(dtype).removeprefix('torch.')} "
                                  f"parameters (S = {numel * element_size} bytes; shard_sizes({numel}, {world_size})"
                                  f" = {shard_sizes(numel, world_size)}), {problem}")
    return Verdict(True, "your sharded step gives full SGD's answer on the averaged gradient on 2, 3 and 4 ranks, "
                         "for sizes that N divides, sizes it does not and fewer elements than ranks, in float32 and "
                         "float64. Each rank updated only its own slice, and sent what DDP's all-reduce sends: a "
                         "reduce-scatter and an all-gather, 2(N-1)/N x S bytes per rank. ZeRO-1 keeps the "
                         "optimizer state of that slice only, 1/N of it, for the same traffic.")


def _case_problem(fn, world_size: int, numel: int, dtype: torch.dtype, timeout_seconds: float) -> str | None:
    """What is wrong with fn on one case, or None. A step that left collectives unmatched stops the pool, or the
    next case's collectives would meet them."""
    try:
        outcomes = labkit.run(attempt_step, fn, numel, dtype, world_size=world_size, timeout=timeout_seconds)
    except labkit.RankTimeout as hang:  # labkit stops a pool whose call timed out
        return _hang_message(hang, world_size, timeout_seconds)
    except labkit.RankError as error:
        if not ("pool was stopped" in error.headline or any(f.kind == NoReply.DIED for f in error.failures)):
            try:
                _stop_pool_if_out_of_step(world_size, labkit.run(calls_of_last_attempt, world_size=world_size))
            except labkit.RankError:
                pass  # then labkit has stopped the pool itself
        return _error_message(error)
    _stop_pool_if_out_of_step(world_size, [[call.kind for call in o.calls] for o in outcomes])
    problem = next((_forbidden_message(rank, o.forbidden[0], caught=True)
                    for rank, o in enumerate(outcomes) if o.forbidden), None)
    return problem or wrong_step(outcomes, numel, dtype) or step_traffic(outcomes, numel, dtype)


def _stop_pool_if_out_of_step(world_size: int, kinds: list[list[str]]) -> None:
    """Stop the pool of `world_size` ranks if they did not all make the same collectives (a call left waiting,
    async_op=True without wait())."""
    if any(k != kinds[0] for k in kinds):
        stop_pool(world_size)


def _hang_message(hang: labkit.RankTimeout, world_size: int, timeout_seconds: float) -> str:
    """A step that never finished: where the first ranks waited, and why collectives wait."""
    waiting = sorted((f for f in hang.failures if f.kind == NoReply.STOPPED), key=lambda f: f.rank)[:2]
    where = "; ".join(f"rank {f.rank} {f.summary}" for f in waiting)
    stopped = {f.rank for f in hang.failures if f.kind == NoReply.STOPPED}
    returned = sorted(set(range(world_size)) - stopped)
    where += f"; rank(s) {returned} had returned" if returned else ""
    return (f"it never finished (stopped after {timeout_seconds:g} s): some rank waited in a collective that the "
            f"others never joined. {where}. Every rank must make the same collectives in the same order: one "
            "reduce-scatter, then one all-gather (or one broadcast from each owner, in the same order everywhere), "
            "on every rank, even one whose slice is empty.")


def _error_message(error: labkit.RankError) -> str:
    """A step that raised: the first switched-off call it made, else the first rank's own error and a hint."""
    forbidden = [f for f in error.failures if forbidden_spelling(f.summary) is not None]
    if forbidden:
        first = min(forbidden, key=lambda f: (f.time, f.rank))
        return _forbidden_message(first.rank, forbidden_spelling(first.summary), caught=False)
    first = min((f for f in error.failures if f.kind != NoReply.STOPPED), key=lambda f: (f.time, f.rank),
                default=error.failures[0])
    hint = ""
    if "invalid tensor size" in first.summary:
        hint = " " + PADDING_HINT
    elif "outputShape[0] * worldSize == inputShape[0]" in first.summary:
        hint = (" reduce_scatter_tensor wants N equal chunks. Use dist.reduce_scatter(my_grad, list(grads)) with "
                "the slices themselves, which may differ in size, or pad each slice to the largest.")
    elif "dtype" in first.summary:
        hint = " " + SAME_DTYPE_HINT
    return f"rank {first.rank} raised {first.summary.strip().removesuffix('.')}.{hint}"


def _forbidden_message(rank: int, spelling: str, caught: bool) -> str:
    """Rank `rank` called `spelling`, which is switched off while the step is graded: why, and what to use."""
    also = " (and caught the error; it still counts)" if caught else ""
    called = spelling.split(" (")[0].replace("'s ", ".").rsplit(".", 1)[-1].split()[-1]
    if called in ("send", "recv", "isend", "irecv", "batch_isend_irecv", "recv_anysource"):
        why = (f"This step is built from collectives, not from messages: {ALLOWED}. (Notebook 03 built the ring "
               "from send and recv; here torch's reduce-scatter and all-gather are the pieces.)")
    elif called.endswith("_object") or called.endswith("_object_list"):
        why = f"It pickles Python objects; move the tensors themselves with {ALLOWED}."
    elif called in ("new_group", "new_subgroups", "new_subgroups_by_enumeration", "split_group", "shrink_group",
                    "merge_remote_group", "init_device_mesh", "init_process_group", "destroy_process_group"):
        why = "Work in the default process group, which every rank already shares: leave out group=."
    else:
        why = f"ZeRO-1's step needs two collectives only: {ALLOWED}."
    return f"rank {rank} called {spelling}{also}. {why}"


# ---- what is wrong with the values ------------------------------------------------------------------------

def _shown(values) -> str:
    """Values for a message: '[0.25, 1.5, 2.75]', six significant digits."""
    return "[" + ", ".join(f"{float(x):.6g}" for x in values) + "]"


def _span(start: int, stop: int) -> str:
    """'element 9' or 'elements 6 to 7' for the elements start..stop-1."""
    return f"element {start}" if stop - start == 1 else f"elements {start} to {stop - 1}"


def _close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Elementwise: equal up to the roundings that right solutions may differ by."""
    return torch.isclose(got, expected, rtol=TOLERANCES[dtype], atol=TOLERANCES[dtype])


def wrong_step(outcomes: list[StepOutcome], numel: int, dtype: torch.dtype) -> str | None:
    """The first rank whose param is not full SGD on the averaged gradient, in its own memory, and why."""
    expected = reference_step(numel, len(outcomes), dtype)
    for rank, outcome in enumerate(outcomes):
        problem = _contract_problem(rank, outcome, expected, dtype)
        if problem:
            return problem
    for rank, outcome in enumerate(outcomes):
        got = torch.tensor(outcome.param, dtype=dtype)
        if not _close(got, expected, dtype).all():
            return _wrong_values(rank, got, outcomes, numel, dtype)
    return None


def _contract_problem(rank: int, outcome: StepOutcome, expected: torch.Tensor, dtype: torch.dtype) -> str | None:
    """param must be updated in place: in its own memory, dtype and device, with its numel elements."""
    if not outcome.same_memory:
        now = "" if outcome.placement == outcome.came else \
            f" (it is now {outcome.placement}; it came as {outcome.came})"
        return (f"rank {rank}'s param was pointed at new memory (param.data = ... or param.set_(...)){now}: the step "
                "updates param in place, in its own memory, dtype and device, so that the model's parameter and "
                "every view of it see the update. Write into it: param.copy_(...), or into its slices.")
    if len(outcome.param) != expected.numel():
        return f"rank {rank} ended with {len(outcome.param)} elements in param instead of {expected.numel()}."
    got = torch.tensor(outcome.param, dtype=dtype)
    returned = torch.tensor(outcome.returned or [], dtype=dtype)
    if returned.shape == expected.shape and _close(returned, expected, dtype).all() \
            and not _close(got, expected, dtype).all():
        state = "unchanged" if torch.equal(got, step_inputs(0, expected.numel(), dtype)[0]) else _shown(got)
        return (f"rank {rank} returned the updated parameters in a new tensor, but its param is {state}: the step "
                "works in place, like an optimizer's step(), so that param itself holds the result. Write into "
                "param's slices (params[rank].sub_(...), params[r].copy_(...)) or finish with param.copy_(result).")
    return None


def _candidates(rank: int, numel: int, world_size: int, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """What a wrong step's elements often hold, each named for a message, in the order they are tried."""
    param, _ = step_inputs(0, numel, dtype)
    grads = [step_inputs(r, numel, dtype)[1] for r in range(world_size)]
    owner = torch.repeat_interleave(torch.arange(world_size), torch.tensor(shard_sizes(numel, world_size)))
    owners_own = torch.stack(grads)[owner, torch.arange(numel)] if numel else param
    return [
        ("right", reference_step(numel, world_size, dtype)),
        ("unchanged", param),
        ("summed", param - LR * sum(grads)),
        ("own", param - LR * grads[rank]),
        ("owner's own", param - LR * owners_own),
        ("gradient", sum(grads) / world_size),
    ]


def _categories(got: torch.Tensor, candidates: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> list[str]:
    """For each element of a rank's param: the first candidate it equals, or 'other'."""
    found = ["other"] * got.numel()
    for name, values in reversed(candidates):
        for i in torch.nonzero(_close(got, values, dtype)).flatten().tolist():
            found[i] = name
    return found


def _wrong_values(rank: int, got: torch.Tensor, outcomes: list[StepOutcome], numel: int, dtype: torch.dtype) -> str:
    """Why rank `rank`'s param is wrong: a mistake that explains every element, else the first wrong elements."""
    world_size = len(outcomes)
    sizes = shard_sizes(numel, world_size)
    start = sum(sizes[:rank])
    candidates = _candidates(rank, numel, world_size, dtype)
    found = _categories(got, candidates, dtype)
    mine = set(range(start, start + sizes[rank]))
    disagree = " After the step the ranks disagree." if len({tuple(o.param) for o in outcomes}) > 1 else ""
    if all(c == "unchanged" or (i in mine and c == "right") for i, c in enumerate(found)) and mine:
        return (f"rank {rank} updated its own slice ({_span(start, start + sizes[rank])}) but every other element "
                f"is unchanged.{disagree} The all-gather is missing: after the update, every rank sends its "
                "updated slice to all the others, so that every rank holds the whole updated vector again.")
    everywhere = {"unchanged": "its param is unchanged: the step must update param itself, in place.",
                  "summed": ("its param moved by lr x the sum of the gradients over the ranks: average them. The "
                             "reduce-scatter sums; divide your slice by N (dist.get_world_size()), as DDP does."),
                  "own": (f"it updated with its own gradient, not the average over the ranks.{disagree} "
                          "Reduce-scatter the gradients first, so that your slice holds their sum over the ranks, "
                          "then divide by N."),
                  "owner's own": ("every slice was updated with its owner's own gradient: the gradients were never "
                                  "summed over the ranks. Reduce-scatter them first (rank r receives the sum of slice "
                                  "r), then divide by N."),
                  "gradient": "its param holds the averaged gradient, not the updated parameters."}
    explains = next((name for name, values in candidates if name in everywhere
                     and _close(got, values, dtype).all()), None)
    if explains:
        return f"rank {rank}: {everywhere[explains]}"
    return _first_wrong_elements(rank, got, found, numel, world_size, dtype)


def _first_wrong_elements(rank: int, got: torch.Tensor, found: list[str], numel: int, world_size: int,
                          dtype: torch.dtype) -> str:
    """The first run of wrong elements of one kind, and whose slice they are in."""
    sizes = shard_sizes(numel, world_size)
    expected = reference_step(numel, world_size, dtype)
    first = next(i for i, c in enumerate(found) if c != "right")
    stop = next((i for i in range(first, numel) if found[i] != found[first]), numel)
    owner = next(r for r in range(world_size) if sum(sizes[:r + 1]) > first)
    owner_start = sum(sizes[:owner])
    one = stop - first == 1
    what = {"unchanged": "is unchanged" if one else "are unchanged",
            "summed": "moved by lr x the sum of the gradients, not their average",
            "own": "moved by this rank's own gradient", "owner's own": "moved by their owner's own gradient alone",
            "gradient": "holds the averaged gradient" if one else "hold the averaged gradient",
            }.get(found[first], f"{'holds' if one else 'hold'} {_shown(got[first:stop])}")
    uneven = "" if numel % world_size == 0 else (
        f" N = {world_size} does not divide {numel}: shard_sizes gives the first {numel % world_size} rank(s) one "
        "element more, and rank r's slice starts at sum(sizes[:r]); param.split(sizes) cuts exactly these slices.")
    return (f"on rank {rank}, {_span(first, stop)} {what} (expected {_shown(expected[first:stop])}). They are in "
            f"rank {owner}'s slice, {_span(owner_start, owner_start + sizes[owner])}. Every element belongs to "
            f"exactly one slice, updated once by its owner and then sent to every rank.{uneven}")


# ---- what is wrong with the traffic -----------------------------------------------------------------------

def step_traffic(outcomes: list[StepOutcome], numel: int, dtype: torch.dtype) -> str | None:
    """No all-reduce; each rank's bytes those of a reduce-scatter plus an all-gather; each rank's all-gather
    input its own updated slice (so that it updated only that)."""
    world_size = len(outcomes)
    element_size = torch.empty(0, dtype=dtype).element_size()
    for rank, outcome in enumerate(outcomes):
        reduced = [c for c in outcome.calls if c.kind == "all_reduce"]
        if reduced:
            return _all_reduce_message(rank, outcome, reduced[0], numel * element_size)
    bounds = step_nbytes_bounds(numel, world_size, element_size)
    for rank, outcome in enumerate(outcomes):
        sent = sum(c.sent_nbytes() for c in outcome.calls)
        if not bounds[rank][0] <= sent <= bounds[rank][1]:
            return _bytes_message(rank, outcome, sent, bounds[rank], numel * element_size)
    for rank, outcome in enumerate(outcomes):
        problem = _contribution_problem(rank, outcome, numel, world_size, dtype)
        if problem:
            return problem
    return None


def _all_reduce_message(rank: int, outcome: StepOutcome, reduced: Collective, nbytes: int) -> str:
    """An all-reduce: right values, but every rank receives the whole gradient."""
    what = "the whole gradient" if sum(reduced.chunk_nbytes) == nbytes else f"{sum(reduced.chunk_nbytes)} bytes"
    gathered = [c for c in outcome.calls if c.kind in ("all_gather", "broadcast")]
    sent = sum(c.sent_nbytes() for c in outcome.calls)
    if gathered:
        cost = (f"and then all-gathered the parameters too: {sent} bytes sent in all, 3(N-1)/N x S, 1.5 x ZeRO-1's "
                "2(N-1)/N x S.")
    else:
        cost = ("and updated the whole vector: the right values and DDP's traffic, but nothing is sharded: every "
                "rank holds the whole averaged gradient and would keep the optimizer state of every element.")
    return (f"rank {rank} all-reduced {what} (dist.all_reduce, {reduced.sent_nbytes()} bytes sent) {cost} "
            "Rank r needs only slice r of the averaged gradient: reduce-scatter it (dist.reduce_scatter(my_grad, "
            "list(grads)), (N-1)/N x S), update only that slice, then all-gather the updated slices.")


def _bytes_message(rank: int, outcome: StepOutcome, sent: int, bounds: tuple[int, int], nbytes: int) -> str:
    """Traffic that is not one reduce-scatter and one all-gather: the calls, and the rule."""
    calls = "; ".join(c.describe() for c in outcome.calls) or "no collective"
    whole = [c for c in outcome.calls if c.kind in ("all_gather", "broadcast") and max(c.chunk_nbytes) >= nbytes > 0]
    hint = (" One of its collectives carried a whole vector: send slices only, each owner's to the others, so "
            "that no rank receives more than the N-1 slices it does not own.") if whole else ""
    allowed = f"exactly {bounds[0]}" if bounds[0] == bounds[1] else \
        f"{bounds[0]} (the ring's exact bytes) to {bounds[1]} (every slice padded to the largest)"
    return (f"rank {rank} sent {sent} bytes in its collectives ({calls}). ZeRO-1's step is one reduce-scatter of "
            f"the gradient and one all-gather of the updated slices, each (N-1)/N x S in a ring: 2(N-1)/N x S per "
            f"rank, what DDP's all-reduce sends; {allowed} bytes from rank {rank} here.{hint}")


def _contribution_problem(rank: int, outcome: StepOutcome, numel: int, world_size: int,
                          dtype: torch.dtype) -> str | None:
    """What rank `rank` sent into the all-gather (or broadcast as the root) must be its updated slice: then it
    updated that slice, and no rank needed the others' gradients."""
    sizes = shard_sizes(numel, world_size)
    start, size = sum(sizes[:rank]), sizes[rank]
    sent = torch.tensor([x for c in outcome.calls if c.contribution is not None for x in c.contribution],
                        dtype=dtype)
    expected = reference_step(numel, world_size, dtype)[start:start + size]
    if sent.numel() >= size and sent.numel() <= max(sizes) and _close(sent[:size], expected, dtype).all():
        return None
    average = (sum(step_inputs(r, numel, dtype)[1] for r in range(world_size)) / world_size)[start:start + size]
    if sent.numel() >= size and _close(sent[:size], average, dtype).all():
        return (f"rank {rank} sent its slice of the averaged gradient into the all-gather, not its updated "
                "parameters: then every rank holds the whole averaged gradient and updates the whole vector. Right "
                "values and DDP's traffic, but not sharded: update only params[rank], then all-gather those.")
    return (f"rank {rank} sent {_shown(sent)} into the all-gather; its slice, {_span(start, start + size)} "
            f"(shard_sizes({numel}, {world_size})[{rank}] = {size}), updated, is {_shown(expected)}. Rank r owns "
            "slice r of shard_sizes, the first numel % N slices one element longer: another split (the last rank "
            "taking the rest, or chunks of ceil(numel / N)) gives the right values too, but not ShardedOptimizer's "
            "sharding, whose optimizer state for each element lives on that element's owner.")
