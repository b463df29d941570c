"""The grader of notebook 05's "your turn": Megatron's f and g, two autograd functions, run on real ranks.

`check_megatron_f_g(f, g)` takes two torch.autograd.Function subclasses, each with forward(ctx, x) and
backward(ctx, grad), and plugs them into Megatron's MLP block on 2 and 3 ranks (Shoeybi et al. 2019,
"Megatron-LM", section 3 and figure 3): X enters through f, each rank computes GeLU(X A_r^T + b1_r) B_r^T with
its shard of A (split by output features, a column-parallel linear) and of B (split by input features, a
row-parallel linear), and the partial sums leave through g (labkit.exercises.megatron_guard). Megatron's
conjugate operators are

    f: forward the identity (every rank already has the whole X);   backward an all_reduce (SUM) of dX
    g: forward an all_reduce (SUM) of the partial sums;             backward the identity

A solution passes only if, on 2 and 3 ranks, on every rank:

- it communicated through dist.all_reduce (SUM) only: exactly one in the forward, in g, and one in the backward,
  in f, each waited for before its operator returned (async_op=True needs handle.wait(), a loop on
  handle.is_completed(), or its future's wait(): handle.get_future() alone does not wait, nor does a loop on
  its done()); labkit.parallel's
  own f and g and torch.distributed.nn.functional's autograd collectives do the exercise for you and are
  switched off;
- neither operator changed its input in place without telling autograd (torch.autograd.Function's rule: an
  input modified in forward must be passed to ctx.mark_dirty);
- the output and the gradients of X, of this rank's shards of A, b1 and B, and of b2 equal one process's whole
  MLP (float64, within 1e-9).
"""

from __future__ import annotations

from collections import Counter

import torch

import labkit
from labkit.checks import timeout_seconds as checked_timeout
from labkit.exercises.allreduce import TIMEOUT_SECONDS
from labkit.exercises.average_guard import FUTURE_POLLS
from labkit.exercises.guard import first_failure, forbidden_message, stop_pool, where_ranks_waited
from labkit.exercises.megatron_guard import HIDDEN, attempt_megatron, calls_of_last_attempt, reference_mlp
from labkit.exercises.progress import graded
from labkit.exercises.verdict import Verdict
from labkit.launch.errors import NoReply

__all__ = ["MEGATRON_CASES", "TOLERANCE", "check_megatron_f_g"]

MEGATRON_CASES = (2, 3)  # tensor-parallel degrees: 12 hidden features, 6 or 4 per rank
TOLERANCE = 1e-9  # float64: a right block is within 1e-15 of one process; every mistake is off by far more
_NAMES = {"output": "the output Z", "x": "X's gradient", "A": "the gradient of its shard of A",
          "b1": "the gradient of its shard of b1", "B": "the gradient of its shard of B", "b2": "b2's gradient"}
_EXPECTED = Counter({("g", "forward"): 1, ("f", "backward"): 1})


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
        Not yet. On 2 ranks (...), rank 0: your g's forward made no all_reduce: ...
    """
    timeout_seconds = checked_timeout("timeout_seconds", timeout_seconds)
    for name, operator in (("f", f), ("g", g)):
        if not (isinstance(operator, type) and issubclass(operator, torch.autograd.Function)):
            return Verdict(False, f"pass your two classes themselves, check_megatron_f_g(F, G); your {name} is "
                                  f"{operator!r}, not a subclass of torch.autograd.Function.")
    reference = reference_mlp()
    for world_size in MEGATRON_CASES:
        problem = _case_problem(f, g, world_size, reference, timeout_seconds)
        if problem:
            return Verdict(False, f"On {world_size} ranks (the MLP's {HIDDEN} hidden features split "
                                  f"{HIDDEN // world_size} per rank), {problem}")
    return Verdict(True, "on 2 and 3 ranks the block's output and the gradients of X, of every rank's shards of A, "
                         "b1 and B, and of b2 equal one process's whole MLP (float64), with one all_reduce in the "
                         "forward (your g) and one in the backward (your f). That is Megatron's MLP block: "
                         "f and g are each other's transpose, and the block communicates once each way.")


def _case_problem(f, g, world_size: int, reference, timeout_seconds: float) -> str | None:
    """What is wrong with f and g on `world_size` ranks, or None. A run that left all_reduces unmatched stops
    the pool, or the next case's collectives would meet them."""
    try:
        outcomes = labkit.run(attempt_megatron, f, g, world_size=world_size, timeout=timeout_seconds)
    except labkit.RankTimeout as hang:  # labkit stops a pool whose call timed out
        return _hang_message(hang, timeout_seconds)
    except labkit.RankError as error:
        if not (error.pool_stopped or any(x.kind == NoReply.DIED for x in error.failures)):
            try:
                _stop_pool_if_out_of_step(world_size, labkit.run(calls_of_last_attempt, world_size=world_size))
            except labkit.RankError:
                pass  # then labkit has stopped the pool itself
        return _error_message(error)
    _stop_pool_if_out_of_step(world_size, [o.calls for o in outcomes])
    return _calls_problem(outcomes, world_size) or _values_problem(outcomes, reference)


def _stop_pool_if_out_of_step(world_size: int, calls: list[list]) -> None:
    if any(len(c) != len(calls[0]) for c in calls):
        stop_pool(world_size)


def _calls_problem(outcomes, world_size: int) -> str | None:
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
        counts = Counter((c.operator, c.direction) for c in outcome.calls)
        if counts != _EXPECTED:
            return f"rank {rank}: {_counts_message(counts, world_size)}"
    return None


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


def _values_problem(outcomes, reference) -> str | None:
    """The output and every gradient against one process's whole MLP, rank by rank."""
    world_size = len(outcomes)
    for rank, outcome in enumerate(outcomes):
        part = torch.arange(HIDDEN).tensor_split(world_size)[rank]
        wanted = {"output": reference["output"], "x": reference["x"], "A": reference["A"][part],
                  "b1": reference["b1"][part], "B": reference["B"][:, part], "b2": reference["b2"]}
        missing = next((name for name in ("B", "x") if outcome.values[name] is None), None)
        if missing:
            return _no_gradient_message(rank, missing)
        for name, want in wanted.items():
            got = torch.tensor(outcome.values[name], dtype=torch.float64)
            if name == "output":  # b2 is added after g: compare what g returned
                got, want = got - reference["b2"], want - reference["b2"]
            gap = (got - want).abs().max().item()
            if gap > TOLERANCE:
                return _value_message(rank, name, got, want, gap, world_size)
    return None


def _no_gradient_message(rank: int, name: str) -> str:
    """No gradient arrived at `name`: which backward returned None (B has none when g's did, X when f's did; a
    None from g reaches f as zeros, autograd's materialized gradient)."""
    if name == "x":
        return (f"rank {rank}: X got no gradient: your f's backward returned None, where autograd takes one "
                "tensor for the one input of forward.")
    return (f"rank {rank}: {_NAMES[name]} is missing: nothing flowed back through your g, whose backward "
            "returned None.")


def _value_message(rank: int, name: str, got: torch.Tensor, want: torch.Tensor, gap: float,
                   world_size: int) -> str:
    """How `name` (the output, or a gradient) differs from one process's: by a factor of N, or otherwise."""
    scale = (got * want).sum().item() / (want * want).sum().item()
    exact = (got - scale * want).abs().max().item() <= TOLERANCE * world_size
    what = f"rank {rank}: {_NAMES[name]}"
    if exact and abs(scale * world_size - 1) < 1e-6:
        return (f"{what} is the right one divided by N = {world_size}: an average over the ranks, not their "
                "sum. f and g add (dist.all_reduce with ReduceOp.SUM); nothing is divided by N.")
    if exact and abs(scale - world_size) < 1e-6:
        return f"{what} is N = {world_size} times the right one: something already whole was summed over the ranks."
    return f"{what} differs from one process's whole MLP by {gap:.3g}, by no factor of N."


def _mutated_message(rank: int, name: str) -> str:
    """`name`'s forward changed its input in place and returned another tensor, without ctx.mark_dirty."""
    return (f"rank {rank}: your {name}'s forward changed its input in place (an in-place all_reduce?) without "
            "telling autograd: the caller's tensor, this rank's own "
            f"{'partial sum' if name == 'g' else 'X'}, now silently holds something else, while autograd still "
            "takes it for the original (an op that saved it for its backward would compute a wrong gradient). "
            "torch.autograd.Function requires every input modified in forward to be passed to ctx.mark_dirty "
            "(and returned).")


def _hang_message(hang: labkit.RankTimeout, timeout_seconds: float) -> str:
    """A run that never finished: where the first ranks waited, and why all_reduce waits."""
    return (f"it never finished (stopped after {timeout_seconds:g} s): a rank waited in an all_reduce that the "
            f"others did not join. {where_ranks_waited(hang)}. Every rank must make the same all_reduces, "
            "whatever its rank: one in g's forward, one in f's backward.")


def _error_message(error: labkit.RankError) -> str:
    """A run that raised: the first switched-off call, else the first rank's own error."""
    first, spelling = first_failure(error)
    if spelling is not None:
        return forbidden_message(first.rank, spelling, False, _why_forbidden)
    message = f"rank {first.rank} raised {first.summary.strip().removesuffix('.')}."
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
