"""On a rank, while check_megatron_f_g grades notebook 05's exercise: the parallel MLP, the guard, and what the
student's f and g left behind.

Each rank builds the same full MLP, Z = GeLU(X A^T + b1) B^T + b2 (the case's `Sizes` and dtype, seeded the same
everywhere: `full_mlp`, once per call of the block with that call's seed),
keeps its share of it (A and b1 split by output features, B by input features, the whole b2: Shoeybi et al. 2019,
section 3) and runs it through the student's operators:

    X -> f -> GeLU(X A_r^T + b1_r) B_r^T -> g -> + b2 = Z,   loss = sum(Z * W)   (W: fixed weights, the same
                                                                                   on every rank)

While f and g run, forward and backward, a `MegatronGuard` is on: every all_reduce is recorded where the process
group receives it (ProcessGroup.allreduce), with the operator that made it (f or g: the guard is told around each
apply() and, by hooks on the autograd node that apply() made, around each backward), the direction, what it
carried and what it held when its operator returned; what each operator received and returned is kept beside.
Everything else that communicates raises `ForbiddenCall`, and so do the ready-made operators: labkit.parallel's
own f and g refuse to run themselves (READY_MADE, labkit._refusals: in any thread), and torch.distributed.nn.
functional's autograd collectives are found on the call stack.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

import labkit
from labkit._refusals import refusing
from labkit.exercises._kit._group_call import GroupCall, Kind, wrap_group_method
from labkit.exercises.average_guard import watch_waits
from labkit.exercises.guard import Guard

__all__ = ["READY_MADE", "AllReduceCall", "MegatronGuard", "MegatronOutcome", "Sizes", "Unlike", "attempt_megatron",
           "calls_of_last_attempt", "full_mlp", "ready_made_caller", "reference_mlp"]

_PARALLEL = Path(labkit.__file__).parent / "parallel"  # labkit's own f and g live here ...
_ALLOWED = {_PARALLEL / "counters.py", _PARALLEL / "_collectives.py"}  # ... but all_reduce_sum is allowed: it
# is only dist.all_reduce (SUM), made by _collectives.all_reduce
_TORCH_AUTOGRAD_COLLECTIVES = Path(torch.__file__).parent / "distributed" / "nn" / "functional.py"
READY_MADE = ("labkit.parallel's copy_to_tensor_parallel", "labkit.parallel's reduce_from_tensor_parallel",
              "labkit.parallel's CopyToTensorParallel.backward", "labkit.parallel's ReduceFromTensorParallel.forward")
# the ready-made f and g, refused where they run (labkit._refusals): in any thread, or a subprocess


@dataclass(frozen=True)
class Sizes:
    """What one case drew: tokens (batch), features (width) and hidden features, the dtype, and one seed per call
    of the block (each call runs f and g on other inputs: an operator that keeps a result across calls shows)."""

    batch: int
    width: int
    hidden: int
    dtype: torch.dtype
    seeds: tuple[int, ...]


def full_mlp(sizes: Sizes, seed: int, device=None, dtype=None) -> dict[str, torch.Tensor]:
    """The graded MLP in one process, the same on every rank (seeded): X (batch, width), A (hidden, width), b1,
    B (width, hidden), b2, and W, the weights of the loss sum(Z * W); in `dtype` (the case's by default)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {"x": (sizes.batch, sizes.width), "A": (sizes.hidden, sizes.width), "b1": (sizes.hidden,),
              "B": (sizes.width, sizes.hidden), "b2": (sizes.width,), "W": (sizes.batch, sizes.width)}
    return {name: torch.randn(shape, generator=generator, dtype=torch.float64).to(device, dtype or sizes.dtype)
            for name, shape in shapes.items()}


def reference_mlp(sizes: Sizes, seed: int) -> dict[str, torch.Tensor]:
    """One process, the whole MLP in float64: the output Z and the gradients of X, A, b1, B and b2."""
    tensors = {name: t.requires_grad_(name != "W") for name, t in full_mlp(sizes, seed, dtype=torch.float64).items()}
    z = F.linear(F.gelu(F.linear(tensors["x"], tensors["A"], tensors["b1"])), tensors["B"], tensors["b2"])
    (z * tensors["W"]).sum().backward()
    return {"output": z.detach(), **{name: tensors[name].grad for name in ("x", "A", "b1", "B", "b2")}}


@dataclass
class AllReduceCall:
    """One all_reduce made while the student's operators ran: in which call of the block (`round`), by which
    operator ("f", "g", or None when neither's forward or backward was running), in which direction ("forward" or
    "backward"), of how many elements; whether its work handle was waited (a blocking all_reduce waits itself),
    whether its future was taken (handle.get_future()), and whether that operator returned first; what this rank
    put in (`sent`) and what the tensor held when the operator returned (`result`), as float64 lists."""

    round: int
    operator: str | None
    direction: str
    numel: int
    waited: bool = True
    future: bool = False
    returned_before_wait: bool = False
    sent: list | None = None
    result: list | None = None


class MegatronGuard(Guard):
    """While the student's f and g run on a rank: all_reduce recorded (by operator and direction, with what it
    carried), everything else that communicates refused, and so are the ready-made operators."""

    def __init__(self):
        super().__init__()
        self.calls: list[AllReduceCall] = []
        self.direction = "forward"
        self.round = 0
        self.operator: str | None = None  # "f" or "g" while its forward or backward runs
        self._works: list[tuple[object, AllReduceCall]] = []
        self._tensors: list[tuple[torch.Tensor, AllReduceCall]] = []  # each all_reduce's tensor, read at return

    def running(self, name: str | None):
        """A hook that notes that `name` ("f", "g", or None: neither) runs now; for autograd's node hooks.
        When an operator's backward ends (None), its all_reduces left unwaited are noted (see `returned`)."""
        def note(*_):
            if name is None:
                self.returned()
            self.operator = name
        return note

    def returned(self) -> None:
        """The running operator returned: its all_reduces whose handle nobody waited for are marked, then waited
        for here, so that the ranks stay in step; what each all_reduce's tensor holds now is its `result`."""
        for work, call in self._works:
            if not call.waited and not call.returned_before_wait:
                call.returned_before_wait = True
                work.wait()
        for tensor, call in self._tensors:
            if call.result is None:
                call.result = _flat(tensor)

    def install(self) -> None:
        """Every collective but all_reduce off; each all_reduce recorded (refused for a ready-made operator or an
        op other than SUM) and its handle watched."""
        self.switch_off_torch_distributed(allowed=("all_reduce", "allreduce"), point_to_point=False)
        wrap_group_method(self, Kind.ALLREDUCE, self._recorded)
        watch_waits(self._works, self)

    def _recorded(self, made: GroupCall):
        """One all_reduce: refused if a ready-made operator made it or its op is not SUM, else recorded, made."""
        ready_made = ready_made_caller()
        if ready_made:
            self.refuse(ready_made)
        if made.reduce_op != "SUM":
            self.refuse(f"dist.all_reduce with ReduceOp.{made.reduce_op}")
        call = AllReduceCall(self.round, self.operator, self.direction, made.tensor.numel(),
                             waited=not made.asynchronous, sent=_flat(made.tensor))  # a blocking one waits itself
        self.calls.append(call)
        self._tensors.append((made.tensor, call))
        work = made.proceed()
        self._works.append((work, call))
        return work


def _flat(tensor: torch.Tensor) -> list:
    """A tensor's values now, flattened, as float64."""
    return tensor.detach().reshape(-1).to("cpu", torch.float64).tolist()


def ready_made_caller() -> str | None:
    """The ready-made operator on the call stack, as the student would spell it: labkit.parallel's (its
    outermost function there, e.g. copy_to_tensor_parallel or CopyToTensorParallel.backward) or
    torch.distributed.nn.functional's; None if there is none."""
    frame, found = sys._getframe(1), None
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path == _TORCH_AUTOGRAD_COLLECTIVES:
            found = f"torch.distributed.nn.functional's {frame.f_code.co_qualname}"
        elif path.parent == _PARALLEL and path not in _ALLOWED:
            found = f"labkit.parallel's {frame.f_code.co_qualname}"
        frame = frame.f_back
    return found


@dataclass
class MegatronOutcome:
    """What one rank's run left behind: the all_reduces (by call, operator and direction), what it called that is
    switched off, which operators changed their input in place without ctx.mark_dirty, an operator's forward that
    returned a tensor unlike its input (`unlike`: (operator, what differs), or None), and per call of the block:
    what each operator received and returned (`seen[round]["g forward"]`, float64 lists), and the values of the
    output and each gradient (this rank's share of A, b1, B), or None where no gradient arrived."""

    calls: list[AllReduceCall] = field(default_factory=list)
    forbidden: list[str] = field(default_factory=list)
    mutated: list[str] = field(default_factory=list)
    unlike: tuple[str, str] | None = None
    seen: list[dict[str, dict[str, list]]] = field(default_factory=list)
    values: list[dict[str, list | None]] = field(default_factory=list)


class Unlike(Exception):
    """An operator's forward returned a tensor of another dtype, shape or device than its input."""


_last_calls: list[AllReduceCall] = []  # on a rank: the all_reduces of the last graded run


def attempt_megatron(f, g, sizes: Sizes) -> MegatronOutcome:
    """On a rank: this rank's share of the MLP through f and g, forward then backward, once per seed of `sizes`
    (other inputs each time), under the guard, with the ready-made f and g refusing to run in any thread."""
    guard, outcome = MegatronGuard(), MegatronOutcome()
    try:
        with refusing(READY_MADE) as made, guard:
            for guard.round, seed in enumerate(sizes.seeds):
                outcome.seen.append({})
                outcome.values.append(_one_call(f, g, sizes, seed, guard, outcome))
    except Unlike as unlike:
        outcome.unlike = unlike.args
    finally:
        _last_calls[:] = guard.calls
    outcome.calls, outcome.forbidden = guard.calls, guard.forbidden + made
    return outcome


def _one_call(f, g, sizes: Sizes, seed: int, guard: MegatronGuard, outcome: MegatronOutcome) -> dict:
    """One call of the block on this rank's share of the MLP seeded `seed`: the output and the gradients."""
    device, rank, world_size = labkit.device(), labkit.rank(), labkit.world_size()
    full = full_mlp(sizes, seed, device)
    part = torch.arange(sizes.hidden).tensor_split(world_size)[rank].to(device)  # this rank's hidden features
    mine = {"x": full["x"], "A": full["A"][part], "b1": full["b1"][part], "B": full["B"][:, part], "b2": full["b2"]}
    mine = {name: t.clone().requires_grad_() for name, t in mine.items()}
    guard.direction = "forward"
    x_in = _apply("f", f, mine["x"], guard, outcome)
    partial = F.linear(F.gelu(F.linear(x_in, mine["A"], mine["b1"])), mine["B"])
    z = _apply("g", g, partial, guard, outcome) + mine["b2"]
    guard.direction = "backward"
    (z * full["W"]).sum().backward()
    return {"output": _flat(z), **{name: _listed(t.grad) for name, t in mine.items()}}


def _apply(name: str, operator, tensor: torch.Tensor, guard: MegatronGuard, outcome: MegatronOutcome):
    """operator.apply(tensor), with the guard told that `name` runs, now and when autograd runs its backward.
    Notes in `outcome` an input changed in place without ctx.mark_dirty (which returns the input itself), what
    the operator received and returned, both ways; raises Unlike for a result unlike its input."""
    before = tensor.detach().clone()
    guard.operator = name
    result = operator.apply(tensor)
    guard.returned()
    guard.operator = None
    if not isinstance(result, torch.Tensor):
        raise TypeError(f"your {name}'s forward returned {type(result).__name__}, not a tensor")
    differs = _how_unlike(result, tensor)
    if differs:
        raise Unlike(name, differs)
    if result is not tensor and not torch.equal(tensor.detach(), before):
        outcome.mutated.append(name)
    seen = outcome.seen[-1]
    seen[f"{name} forward"] = {"received": _flat(before), "returned": _flat(result)}
    if result.grad_fn is not None:  # its backward node: the student's backward runs between these hooks
        backward = seen[f"{name} backward"] = {}
        result.grad_fn.register_prehook(guard.running(name))
        result.grad_fn.register_prehook(functools.partial(_received, backward))
        result.grad_fn.register_hook(functools.partial(_returned, backward))
        result.grad_fn.register_hook(guard.running(None))
    return result


def _how_unlike(result: torch.Tensor, tensor: torch.Tensor) -> str | None:
    """How an operator's result differs from its input in dtype, shape or device, in words; None if it does not."""
    for what in ("dtype", "shape", "device"):
        got, want = getattr(result, what), getattr(tensor, what)
        if got != want:
            said = (lambda v: tuple(v)) if what == "shape" else str
            return f"a tensor of {what} {said(got)} for an input of {what} {said(want)}"
    return None


def _received(seen: dict, grad_outputs) -> None:
    """A node pre-hook: what the operator's backward receives (copied now: it may sum it in place)."""
    seen["received"] = _flat(grad_outputs[0]) if grad_outputs[0] is not None else None


def _returned(seen: dict, grad_inputs, grad_outputs) -> None:
    """A node post-hook: what the operator's backward returned (as autograd passes it on)."""
    seen["returned"] = _flat(grad_inputs[0]) if grad_inputs and grad_inputs[0] is not None else None


def _listed(tensor: torch.Tensor | None) -> list | None:
    return None if tensor is None else tensor.detach().cpu().tolist()


def calls_of_last_attempt() -> list[AllReduceCall]:
    """On a rank: the all_reduces of the last graded run, when it raised instead of returning them."""
    return list(_last_calls)
