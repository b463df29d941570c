"""What is wrong with the values a student's ZeRO-1 step left in param (notebook 11's grader, `check_sharded_step`).

The answer is full SGD on the gradient averaged over the ranks, computed in one process (`reference_step`); a
rank's param must end equal to it, in its own memory, dtype and device. A wrong param is compared with what wrong
steps often leave (unchanged, summed, its own gradient, ...), element by element, to say which mistake it is.
"""

from __future__ import annotations

import math

import torch

from labkit.exercises.step_guard import StepCase, StepOutcome
from labkit.plan.counts import shard_sizes

__all__ = ["TOLERANCES", "element_span", "reference_step", "shown_values", "values_close", "wrong_step"]

TOLERANCES = {torch.float32: 1e-6, torch.float64: 1e-12}  # relative; roundings of right solutions differ by ulps


def reference_step(case: StepCase) -> torch.Tensor:
    """The answer, in one process: torch.optim.SGD's step (param - lr x gradient) on the gradient averaged over
    the case's ranks.

    >>> reference_step(StepCase(world_size=2, numel=3))    # lr 0.1; the average gradient is 2.5 x [3, 2, 1]
    tensor([0.2500, 1.5000, 2.7500])
    """
    param = torch.nn.Parameter(case.inputs(0)[0])
    param.grad = torch.stack([case.inputs(r)[1] for r in range(case.world_size)]).mean(0)
    torch.optim.SGD([param], lr=case.lr).step()
    return param.detach()


def shown_values(values) -> str:
    """Values for a message: '[0.25, 1.5, 2.75]', six significant digits."""
    return "[" + ", ".join(f"{float(x):.6g}" for x in values) + "]"


def element_span(start: int, stop: int) -> str:
    """'element 9' or 'elements 6 to 7' for the elements start..stop-1."""
    return f"element {start}" if stop - start == 1 else f"elements {start} to {stop - 1}"


def values_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Elementwise: equal up to the roundings that right solutions may differ by."""
    return torch.isclose(got, expected, rtol=TOLERANCES[dtype], atol=TOLERANCES[dtype])


def wrong_step(outcomes: list[StepOutcome], case: StepCase) -> str | None:
    """The first rank whose param is not full SGD on the averaged gradient, in its own memory, and why."""
    expected = reference_step(case)
    for rank, outcome in enumerate(outcomes):
        problem = _contract_problem(rank, outcome, expected, case)
        if problem:
            return problem
    for rank, outcome in enumerate(outcomes):
        got = torch.tensor(outcome.param, dtype=case.dtype)
        if not values_close(got, expected, case.dtype).all():
            return _wrong_values(rank, got, outcomes, case)
    return None


def _contract_problem(rank: int, outcome: StepOutcome, expected: torch.Tensor, case: StepCase) -> str | None:
    """param must be updated in place: in its own memory, dtype and device, with its numel elements."""
    if not outcome.same_memory:
        now = "" if outcome.placement == outcome.came else \
            f" (it is now {outcome.placement}; it came as {outcome.came})"
        return (f"rank {rank}'s param was pointed at new memory (param.data = ... or param.set_(...)){now}: the step "
                "updates param in place, in its own memory, dtype and device, so that the model's parameter and "
                "every view of it see the update.")
    if len(outcome.param) != expected.numel():
        return f"rank {rank} ended with {len(outcome.param)} elements in param instead of {expected.numel()}."
    dtype = case.dtype
    got = torch.tensor(outcome.param, dtype=dtype)
    returned = torch.tensor(outcome.returned or [], dtype=dtype)
    if returned.shape == expected.shape and values_close(returned, expected, dtype).all() \
            and not values_close(got, expected, dtype).all():
        state = "unchanged" if torch.equal(got, case.inputs(0)[0]) else shown_values(got)
        return (f"rank {rank} returned the updated parameters in a new tensor, but its param is {state}: the step "
                "works in place, like an optimizer's step(), so that param itself holds the result.")
    return None


def _candidates(rank: int, case: StepCase) -> list[tuple[str, torch.Tensor]]:
    """What a wrong step's elements often hold, each named for a message, in the order they are tried."""
    numel, world_size, lr = case.numel, case.world_size, case.lr
    param, _ = case.inputs(0)
    grads = [case.inputs(r)[1] for r in range(world_size)]
    owner = torch.repeat_interleave(torch.arange(world_size), torch.tensor(shard_sizes(numel, world_size)))
    owners_own = torch.stack(grads)[owner, torch.arange(numel)] if numel else param
    return [
        ("right", reference_step(case)),
        ("unchanged", param),
        ("summed", param - lr * sum(grads)),
        ("own", param - lr * grads[rank]),
        ("owner's own", param - lr * owners_own),
        ("gradient", sum(grads) / world_size),
    ]


def _categories(got: torch.Tensor, candidates: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> list[str]:
    """For each element of a rank's param: the first candidate it equals, or 'other'."""
    found = ["other"] * got.numel()
    for name, values in reversed(candidates):
        for i in torch.nonzero(values_close(got, values, dtype)).flatten().tolist():
            found[i] = name
    return found


def _wrong_values(rank: int, got: torch.Tensor, outcomes: list[StepOutcome], case: StepCase) -> str:
    """Why rank `rank`'s param is wrong: a mistake that explains every element, else the first wrong elements."""
    numel, world_size, dtype = case.numel, case.world_size, case.dtype
    sizes = shard_sizes(numel, world_size)
    start = sum(sizes[:rank])
    candidates = _candidates(rank, case)
    found = _categories(got, candidates, dtype)
    mine = set(range(start, start + sizes[rank]))
    disagree = " After the step the ranks disagree." if len({tuple(o.param) for o in outcomes}) > 1 else ""
    if all(c == "unchanged" or (i in mine and c == "right") for i, c in enumerate(found)) \
            and any(found[i] == "right" for i in mine):
        return (f"rank {rank} updated its own slice ({element_span(start, start + sizes[rank])}) but every other "
                f"element is unchanged.{disagree} The reduce-scatter and the update worked; the all-gather is "
                "missing.")
    everywhere = {"unchanged": ("its param is unchanged: the step must update param itself, in place (a padded "
                                "copy's rows reach param only through unpad_into)."),
                  "summed": ("its param moved by lr x the sum of the gradients over the ranks, not their average: "
                             "the reduce-scatter sums, and nothing divided by N."),
                  "own": (f"it updated with its own gradient, not the average over the ranks.{disagree} No "
                          "gradient went through a reduce-scatter."),
                  "owner's own": ("every slice was updated with its owner's own gradient: the gradients were never "
                                  "summed over the ranks. The reduce-scatter is missing."),
                  "gradient": "its param holds the averaged gradient, not the updated parameters."}
    explains = next((name for name, values in candidates if name in everywhere
                     and values_close(got, values, dtype).all()), None)
    if explains:
        return f"rank {rank}: {everywhere[explains]}"
    return _other_lr(rank, got, case) or _float32_inside(rank, got, case) or \
        _first_wrong_elements(rank, got, found, case)


def _other_lr(rank: int, got: torch.Tensor, case: StepCase) -> str | None:
    """A param moved by the averaged gradient times one factor on every element, but not lr: a hard-coded lr, or
    one kept from an earlier call."""
    param = case.inputs(0)[0].double()
    average = sum(case.inputs(r)[1].double() for r in range(case.world_size)) / case.world_size
    if not case.numel or not average.abs().min() > 0:
        return None
    factors = (param - got.double()) / average
    factor = factors.mean().item()
    if not torch.allclose(factors, torch.full_like(factors, factor), rtol=1e-4, atol=1e-6) or \
            math.isclose(factor, case.lr, rel_tol=1e-4):
        return None
    return (f"rank {rank}: its param moved by {factor:.6g} x the averaged gradient, but lr is {case.lr:g} in this "
            "call: take lr from the step's argument (an lr written into the step, or kept from an earlier call?).")


def _float32_inside(rank: int, got: torch.Tensor, case: StepCase) -> str | None:
    """A float64 param right to float32's precision only: a float32 buffer inside the step."""
    if case.dtype != torch.float64 or not values_close(got, reference_step(case), torch.float32).all():
        return None
    return (f"rank {rank}: its float64 param is right only to float32's precision (about 7 digits): part of the "
            "step ran in a float32 buffer. Make every buffer like the tensor it holds a piece of (torch.empty_like, "
            "param.new_zeros), in its dtype and on its device.")


def _first_wrong_elements(rank: int, got: torch.Tensor, found: list[str], case: StepCase) -> str:
    """The first run of wrong elements of one kind, and whose slice they are in."""
    numel, world_size = case.numel, case.world_size
    sizes = shard_sizes(numel, world_size)
    expected = reference_step(case)
    first = next(i for i, c in enumerate(found) if c != "right")
    stop = next((i for i in range(first, numel) if found[i] != found[first]), numel)
    owner, last_owner = (next(r for r in range(world_size) if sum(sizes[:r + 1]) > i) for i in (first, stop - 1))
    owner_start = sum(sizes[:owner])
    where = f"They are in rank {owner}'s slice, {element_span(owner_start, owner_start + sizes[owner])}." \
        if owner == last_owner else f"They span the slices of ranks {owner} to {last_owner}."
    one = stop - first == 1
    what = {"unchanged": "is unchanged" if one else "are unchanged",
            "summed": "moved by lr x the sum of the gradients, not their average",
            "own": "moved by this rank's own gradient", "owner's own": "moved by their owner's own gradient alone",
            "gradient": "holds the averaged gradient" if one else "hold the averaged gradient",
            }.get(found[first], f"{'holds' if one else 'hold'} {shown_values(got[first:stop])}")
    uneven = "" if numel % world_size == 0 else (
        f" N = {world_size} does not divide {numel}: shard_sizes gives the first {numel % world_size} rank(s) one "
        "element more.")
    return (f"on rank {rank}, {element_span(first, stop)} {what} (expected {shown_values(expected[first:stop])}). "
            f"{where} Every element belongs to exactly one slice, updated once by its owner and then sent to every "
            f"rank.{uneven}")
