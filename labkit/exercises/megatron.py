"""The grader of notebook 05's "your turn": Megatron's f and g, two autograd functions, run on real ranks.

`check_megatron_f_g(f, g)` takes two torch.autograd.Function subclasses, each with forward(ctx, x) and
backward(ctx, grad), and plugs them into Megatron's MLP block (Shoeybi et al. 2019, "Megatron-LM", section 3 and
figure 3): X enters through f, each rank computes GeLU(X A_r^T + b1_r) B_r^T with its shard of A (split by output
features, a column-parallel linear) and of B (split by input features, a row-parallel linear), and the partial
sums leave through g. Megatron's conjugate operators are

    f: forward the identity (every rank already has the whole X);   backward an all_reduce (SUM) of dX
    g: forward an all_reduce (SUM) of the partial sums;             backward the identity

What a right f and g must not depend on is drawn afresh for each grading (`draw_cases`): two cases on two
different world sizes of 2, 3 and 4 ranks, one in float32 and one in float64, with different token counts, any
widths and hidden sizes (split evenly or not); each case calls the block CALLS times on other inputs, so that an
operator that keeps a result between calls shows. A solution passes only if, in both cases, on every rank:

- it communicated through dist.all_reduce (SUM) only: exactly one in the forward, in g, and one in the backward,
  in f, in every call, each waited for before its operator returned (async_op=True needs handle.wait(), a loop
  on handle.is_completed(), or its future's wait(): handle.get_future() alone does not wait, nor does a loop on
  its done()); labkit.parallel's own f and g (which refuse to run while graded, in any thread: labkit._refusals)
  and torch.distributed.nn.functional's autograd collectives do the exercise for you and are switched off;
- each all_reduce summed what its operator received (g: its partial sum; f: its gradient), not a buffer filled
  later or another tensor, and the operator returned the sum, not its own input;
- neither operator changed its input in place without telling autograd (torch.autograd.Function's rule: an
  input modified in forward must be passed to ctx.mark_dirty), nor returned another dtype, shape or device;
- the output and the gradients of X, of this rank's shards of A, b1 and B, and of b2 equal one process's whole
  MLP in float64 (within TOLERANCES: 1e-9 in float64, 1e-4 in float32).

The grading is the kit's runner driven by `SPEC` (labkit.exercises._kit._runner): the cases, the rank-side
attempt, the ready-made operators it refuses, the ordered checks and the messages. On a rank (`attempt`):

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
import random
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

import labkit
from labkit.exercises._kit import _store
from labkit.exercises._kit._group_call import GroupCall, Kind, wrap_group_method
from labkit.exercises._kit._guard import Guard
from labkit.exercises._kit._messages import failure_sentence, first_failure, forbidden_message, hang_message
from labkit.exercises._kit._record import Call
from labkit.exercises._kit._runner import Case, Spec, grade
from labkit.exercises._kit._wait_watch import FUTURE_POLLS, watch_waits
from labkit.exercises.allreduce import TIMEOUT_SECONDS
from labkit.exercises.progress import graded
from labkit.exercises.verdict import Verdict

__all__ = ["WORLD_SIZES", "check_megatron_f_g", "draw_cases"]

WORLD_SIZES = (2, 3, 4)  # tensor-parallel degrees a grading draws two of
CALLS = 2  # calls of the block per case, on other inputs each: an operator that keeps a result across calls shows
TOLERANCES = {torch.float64: 1e-9, torch.float32: 1e-4}  # a right block is within 1e-15 (float64) or 1e-6
# (float32) of one process in float64; every mistake is off by far more
_NAMES = {"output": "the output Z", "x": "X's gradient", "A": "the gradient of its shard of A",
          "b1": "the gradient of its shard of b1", "B": "the gradient of its shard of B", "b2": "b2's gradient"}
_EXPECTED = Counter({("g", "forward"): 1, ("f", "backward"): 1})
_SIZE_ERRORS = ("size of tensor", "shape '[", "broadcast shape")  # in torch's errors for mismatched sizes


def draw_cases(rng: random.Random | None = None) -> list[Case]:
    """Two cases, drawn afresh for each grading, so that a solution that depends on what it should not fails one
    of them: two different world sizes, one case in float32 and one in float64, different token counts, any
    widths, hidden sizes that split evenly or not, and CALLS seeds each."""
    rng = rng or random.Random()
    world_sizes, dtypes = rng.sample(WORLD_SIZES, 2), rng.sample([torch.float32, torch.float64], 2)
    batches = rng.sample(range(2, 9), 2)
    return [Case(n, {"sizes": Sizes(batch, rng.randint(3, 8), n * rng.randint(2, 3) + rng.randrange(n), dtype,
                                    tuple(rng.sample(range(1, 10**6), CALLS)))})
            for n, dtype, batch in zip(world_sizes, dtypes, batches, strict=True)]


@graded("megatron_f_g")
def check_megatron_f_g(f, g, *, timeout_seconds: float = TIMEOUT_SECONDS) -> Verdict:
    """Grade `f` and `g`, torch.autograd.Function subclasses: Megatron's f (identity forward, all_reduce
    backward) and g (all_reduce forward, identity backward) in a tensor-parallel MLP (module docstring).

    Example::

        >>> import torch, torch.distributed as dist
        >>> class Identity(torch.autograd.Function):          # no communication at all
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         return x.clone()
        ...     @staticmethod
        ...     def backward(ctx, grad):
        ...         return grad
        >>> check_megatron_f_g(Identity, Identity)
        Not yet. On ... ranks (...), rank 0: your g's forward made no all_reduce: ...
    """
    for name, operator in (("f", f), ("g", g)):
        if not (isinstance(operator, type) and issubclass(operator, torch.autograd.Function)):
            return Verdict(False, f"pass your two classes themselves, check_megatron_f_g(F, G); your {name} is "
                                  f"{operator!r}, not a subclass of torch.autograd.Function.")
    return grade(SPEC, f, g, timeout_seconds=timeout_seconds)


def _passed(cases) -> str:
    """The verdict of a pass: what was checked, on which cases."""
    said = " and ".join(f"{case.world_size} ranks ({_dtype(case['sizes'].dtype)})" for case in cases)
    return (f"on {said}, {CALLS} calls each on other inputs, the block's output and the gradients of X, of every "
            "rank's shards of A, b1 and B, and of b2 equal one process's whole MLP, with one all_reduce in the "
            "forward (your g) and one in the backward (your f), each of what its operator received. That is "
            "Megatron's MLP block: f and g are each other's transpose, and the block communicates once each way.")


def _described(case: Case) -> str:
    """How a case starts its verdict: the ranks, the hidden features' split, the dtype and the sizes."""
    world_size, sizes = case.world_size, case["sizes"]
    split = "+".join(str(len(p)) for p in torch.arange(sizes.hidden).tensor_split(world_size))
    return (f"On {world_size} ranks (the MLP's {sizes.hidden} hidden features split {split}; {_dtype(sizes.dtype)}, "
            f"{sizes.batch} tokens of {sizes.width} features)")


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _calls_problem(outcomes, case: Case) -> str | None:
    """A refused call, an input changed in place, or all_reduces other than one in g's forward and one in f's
    backward; else None."""
    for rank, outcome in enumerate(outcomes):
        if outcome.forbidden:
            return forbidden_message(rank, outcome.forbidden[0], True, _why_forbidden)
    for rank, outcome in enumerate(outcomes):
        if outcome.mutated:
            return _mutated_message(rank, outcome.mutated[0])
        late = next((c for c in outcome.calls if c.returned_before_wait), None)
        if late:
            return _late_message(rank, late)
        if outcome.unlike:
            return _unlike_message(rank, *outcome.unlike)
        for call in range(CALLS):
            counts = Counter((c.operator, c.direction) for c in outcome.calls if c.round == call)
            if counts == _EXPECTED:
                continue
            dropped = next((key for key in _EXPECTED if call and not counts[key]), None)
            if dropped and Counter((c.operator, c.direction) for c in outcome.calls if c.round == 0) == _EXPECTED:
                return f"rank {rank}: {_dropped_message(*dropped, call)}"
            return f"rank {rank}: {_counts_message(counts, case.world_size)}"
    return None


def _dropped_message(operator: str, direction: str, call: int) -> str:
    """An operator that all-reduced in the block's first call and not in a later one: a result kept."""
    return (f"your {operator}'s {direction} made no all_reduce in call {call + 1} of the block, where call 1 made "
            "one: it kept a result from an earlier call (on the class, on ctx, or in a global) and returned it "
            "again, though the inputs were other ones. Each call must sum its own input: keep nothing between "
            "calls.")


def _unlike_message(rank: int, name: str, differs: str) -> str:
    """An operator's forward returned a tensor of another dtype, shape or device than its input."""
    return (f"rank {rank}: your {name}'s forward returned {differs}: a buffer made with a fixed dtype or fixed "
            "sizes (torch.zeros(5, 6, dtype=torch.float64), say)? f and g change no dtype, shape or device: make "
            "buffers like the tensor they hold (x.clone(), torch.empty_like(x), torch.zeros_like(x)), so that the "
            "block works for every model, in every precision.")


def _contents_problem(outcomes, case: Case) -> str | None:
    """Whether each operator's one all_reduce summed what that operator received, and whether it returned the
    sum and not its own input: an all_reduce made is not yet an all_reduce of the right tensor."""
    for rank, outcome in enumerate(outcomes):
        for call in outcome.calls:
            where = f"{call.operator} {call.direction}"
            seen = outcome.seen[call.round].get(where, {})
            received, returned = seen.get("received"), seen.get("returned")
            if received is None:
                continue
            said = f"rank {rank}: your {call.operator}'s {call.direction} all-reduced"
            if not _close(call.sent, received):
                if not any(call.sent):
                    return (f"{said} a tensor of zeros, not the {_input(call)} it received: was the buffer "
                            "filled after the all_reduce? Sum what the operator received (a copy of it filled "
                            "first, or the tensor itself).")
                return (f"{said} something other than the {_input(call)} it received: the all_reduce was made, "
                        "but of another tensor, so what the ranks summed is not the block's.")
            if returned is not None and _close(returned, received) and not _close(call.result, received):
                return (f"{said} a copy of the {_input(call)} it received, but returned the {_input(call)} "
                        "itself, not the sum: return the tensor the all_reduce summed.")
    return None


def _input(call) -> str:
    """What an operator receives, in words."""
    return "partial sum" if call.direction == "forward" else "gradient"


def _close(got, want) -> bool:
    """Two flat float lists equal to float32's precision (what this compares was copied, not computed)."""
    return len(got) == len(want) and all(abs(a - b) <= 1e-6 * (1 + abs(b)) for a, b in zip(got, want, strict=True))


def _late_message(rank: int, late) -> str:
    """An operator that returned before its async all_reduce was waited for: through the handle or its future."""
    started = f"rank {rank}: your {late.operator}'s {late.direction} started an all_reduce with async_op=True"
    if late.future:
        return (f"{started}, took its future (handle.get_future()) and returned without waiting for it: "
                "get_future() does not wait, so what it returned was read before the sum arrived (right, if at "
                f"all, by luck of timing). {FUTURE_POLLS}")
    return (f"{started} and returned without calling wait() on its handle: what it returned was read before the "
            "sum arrived (right, if at all, by luck of timing).")


def _counts_message(counts: Counter, world_size: int) -> str:
    """What the all_reduces made by f and g, forward and backward, say is wrong."""
    f_forward, g_forward, f_backward, g_backward = (counts[key] for key in (
        ("f", "forward"), ("g", "forward"), ("f", "backward"), ("g", "backward")))
    if counts[(None, "forward")] or counts[(None, "backward")]:
        return ("made an all_reduce outside your f's and g's forward and backward: all the communication of the "
                "block belongs in them, one all_reduce in g's forward and one in f's backward.")
    if f_forward and g_backward and not (g_forward or f_backward):
        return ("your f and g are swapped: f all-reduced in the forward and g in the backward. f is where X "
                "enters the block: identity forward (every rank already has the whole X), all_reduce backward. "
                "g is where the partial sums leave: all_reduce forward, identity backward.")
    if f_forward and g_backward:
        return ("your f and g both all-reduce in both directions: 4 all_reduces where the block needs 2. f's "
                "forward and g's backward are the identity: their input is already the same on every rank, so "
                f"summing it over the ranks multiplies it by N = {world_size}.")
    if f_forward:
        return ("your f all-reduced in the forward: X is already the same on every rank, so the sum is N x X "
                f"(N = {world_size}). f's forward is the identity; its backward all-reduces dX.")
    if g_backward:
        return ("your g's backward all-reduced the gradient: dZ is already the whole gradient on every rank, so "
                f"the sum is N x dZ, and every gradient upstream came out N = {world_size} times too large.")
    return _missing_message(g_forward, f_backward)


def _missing_message(g_forward: int, f_backward: int) -> str:
    """A missing or repeated all_reduce in g's forward or f's backward."""
    if not g_forward:
        return ("your g's forward made no all_reduce: each rank returned its own partial sum GeLU(X A_r) B_r, only "
                "its hidden features' share of Z, so the block's output is not the whole MLP's.")
    if not f_backward:
        return ("your f's backward made no all_reduce: each rank's dX comes only from its own hidden features "
                "(its shard of A), a partial sum, so X's gradient is not the whole MLP's.")
    return (f"your g's forward made {g_forward} all_reduce(s) and your f's backward {f_backward}: the block needs "
            "exactly one each, a second one sums what is already the same on every rank.")


def _values_problem(outcomes, case: Case) -> str | None:
    """The output and every gradient against one process's whole MLP, call by call, rank by rank."""
    sizes = case["sizes"]
    references = [reference_mlp(sizes, seed) for seed in sizes.seeds]
    biases = [full_mlp(sizes, seed, dtype=torch.float64)["b2"] for seed in sizes.seeds]
    references = [{**r, "output": r["output"] - b2} for r, b2 in zip(references, biases, strict=True)]  # b2 is
    # added after g: compare what g returned
    for call, reference in enumerate(references):
        for rank, outcome in enumerate(outcomes):
            previous = _as_returned(outcome.values[call - 1], biases[call - 1]) if call else None
            problem = _rank_values_problem(rank, outcome.values[call], reference, biases[call], sizes,
                                           len(outcomes), previous)
            if problem:
                return f"in call {call + 1} of {CALLS} of the block (other inputs each time), {problem}" \
                    if call else problem
    return None


def _as_returned(values: dict, b2: torch.Tensor) -> dict:
    """A rank's values of one call as tensors, the output without that call's b2 (what g returned)."""
    tensors = {name: None if v is None else torch.tensor(v, dtype=torch.float64) for name, v in values.items()}
    tensors["output"] = tensors["output"].reshape(-1, len(b2)) - b2
    return tensors


def _rank_values_problem(rank: int, values: dict, reference: dict, b2: torch.Tensor, sizes: Sizes,
                         world_size: int, previous: dict | None) -> str | None:
    """One rank's output and gradients in one call against one process's (`previous`: what this rank had in the
    call before, `_as_returned`)."""
    part = torch.arange(sizes.hidden).tensor_split(world_size)[rank]
    shares = {"output": lambda t: t, "x": lambda t: t, "A": lambda t: t[part],
              "b1": lambda t: t[part], "B": lambda t: t[:, part], "b2": lambda t: t}
    missing = next((name for name in ("B", "x") if values[name] is None), None)
    if missing:
        return _no_gradient_message(rank, missing)
    tolerance = TOLERANCES[sizes.dtype]
    for name, share in shares.items():
        want = share(reference[name])
        got = torch.tensor(values[name], dtype=torch.float64).reshape(want.shape)
        got = got - b2 if name == "output" else got
        gap = (got - want).abs().max().item()
        if gap <= tolerance:
            continue
        kept = None if previous is None or previous[name] is None else previous[name].reshape(got.shape)
        if kept is not None and (got - kept).abs().max().item() <= tolerance:
            return _kept_message(rank, name)
        return _value_message(rank, name, got, want, gap, world_size, sizes.dtype)
    return None


def _kept_message(rank: int, name: str) -> str:
    """`name` in a later call of the block equals the call before's: a result kept across calls."""
    return (f"rank {rank}: {_NAMES[name]} is the previous call's, computed from other inputs: your f or g kept a "
            "result from an earlier call (on the class, on ctx's class, or in a global) and returned it again. "
            "Each call must compute from its own input: keep nothing between calls.")


def _no_gradient_message(rank: int, name: str) -> str:
    """No gradient arrived at `name`: which backward returned None (B has none when g's did, X when f's did; a
    None from g reaches f as zeros, autograd's materialized gradient)."""
    if name == "x":
        return (f"rank {rank}: X got no gradient: your f's backward returned None, where autograd takes one "
                "tensor for the one input of forward.")
    return (f"rank {rank}: {_NAMES[name]} is missing: nothing flowed back through your g, whose backward "
            "returned None.")


def _value_message(rank: int, name: str, got: torch.Tensor, want: torch.Tensor, gap: float,
                   world_size: int, dtype: torch.dtype) -> str:
    """How `name` (the output, or a gradient) differs from one process's: by a factor of N, by float32's
    precision in a float64 case, or otherwise."""
    scale = (got * want).sum().item() / (want * want).sum().item()
    exact = (got - scale * want).abs().max().item() <= TOLERANCES[dtype] * world_size
    what = f"rank {rank}: {_NAMES[name]}"
    if exact and abs(scale * world_size - 1) < 1e-6:
        return (f"{what} is the right one divided by N = {world_size}: an average over the ranks, not their "
                "sum. f and g add (dist.all_reduce with ReduceOp.SUM); nothing is divided by N.")
    if exact and abs(scale - world_size) < 1e-6:
        return f"{what} is N = {world_size} times the right one: something already whole was summed over the ranks."
    if dtype == torch.float64 and gap <= TOLERANCES[torch.float32] * (1 + want.abs().max().item()):
        return (f"{what} differs from one process's whole MLP by {gap:.3g}, float32's precision, in a float64 "
                "case: a buffer in float32 (torch.zeros's default dtype) held it on the way? Make buffers like the "
                "tensor they hold (torch.zeros_like(grad), grad.clone()), so that nothing is rounded.")
    return f"{what} differs from one process's whole MLP by {gap:.3g}, by no factor of N."


def _mutated_message(rank: int, name: str) -> str:
    """`name`'s forward changed its input in place and returned another tensor, without ctx.mark_dirty."""
    return (f"rank {rank}: your {name}'s forward changed its input in place (an in-place all_reduce?) without "
            "telling autograd: the caller's tensor, this rank's own "
            f"{'partial sum' if name == 'g' else 'X'}, now silently holds something else, while autograd still "
            "takes it for the original (an op that saved it for its backward would compute a wrong gradient). "
            "torch.autograd.Function requires every input modified in forward to be passed to ctx.mark_dirty "
            "(and returned).")


def _hang_message(hang: labkit.RankTimeout, case: Case, timeout_seconds: float) -> str:
    """A run that never finished: where the first ranks waited, and why all_reduce waits."""
    return hang_message(hang, timeout_seconds, "a rank waited in an all_reduce that the others did not join. "
                        "Every rank must make the same all_reduces, whatever its rank: one in g's forward, one in "
                        "f's backward.")


def _error_message(error: labkit.RankError, attempts, case: Case) -> str:
    """A run that raised (a refused call the runner has told already): the first rank's own error."""
    first = first_failure(error)[0]
    message = f"{failure_sentence(first)}."
    if first.raised(RuntimeError) and any(word in first.summary for word in _SIZE_ERRORS):
        message += (" The grader draws new sizes for each case: a buffer of "
                    "fixed sizes (torch.zeros(5, 6))? Make buffers like the tensor they hold (torch.zeros_like(x), "
                    "x.clone()).")
    if "your turn" in first.summary:
        message += (" Part of your f or g is still the stub (raise NotImplementedError): write both forward "
                    "and backward of both.")
    return message


def _why_forbidden(spelling: str, name: str) -> str:
    """Why the call `spelling` is switched off while f and g are graded, and what to use instead."""
    if spelling.startswith("labkit.parallel"):
        return "That is the course's own f or g, which does the exercise for you: it is switched off here."
    if spelling.startswith("torch.distributed.nn.functional"):
        return ("That is a ready-made autograd collective: its backward all-reduces the gradient again, so it is "
                "neither f nor g.")
    if "ReduceOp.AVG" in spelling:
        return "AVG divides the sum by N: f and g add the partial sums, with ReduceOp.SUM (the default)."
    if "ReduceOp" in spelling:
        return "f and g add the partial sums over the ranks: this op does something else."
    return ("This exercise needs one collective only, dist.all_reduce (SUM): other communication is switched "
            "off while it is graded.")


# ---- on a rank: the parallel MLP, the guard, and what the student's f and g left behind ----------------

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
        _store.add(Call.of(made))  # for the runner's rule after a RankError: did the ranks make the same calls?
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


def attempt(f, g, case: Case) -> MegatronOutcome:
    """On a rank: this rank's share of the MLP through f and g, forward then backward, once per seed of the case's
    `Sizes` (other inputs each time), under the guard (the runner has the ready-made f and g refusing)."""
    guard, outcome = MegatronGuard(), MegatronOutcome()
    try:
        with guard:
            for guard.round, seed in enumerate(case["sizes"].seeds):
                outcome.seen.append({})
                outcome.values.append(_one_call(f, g, case["sizes"], seed, guard, outcome))
    except Unlike as unlike:
        outcome.unlike = unlike.args
    outcome.calls, outcome.forbidden = guard.calls, guard.forbidden
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


SPEC = Spec(attempt=attempt, cases=draw_cases, checks=(_calls_problem, _contents_problem, _values_problem),
            describe=_described, why_forbidden=_why_forbidden, on_hang=_hang_message, on_error=_error_message,
            passed=_passed, example="check_megatron_f_g(F, G)", ready_made=READY_MADE)
