"""What is wrong with the traffic of a student's ZeRO-1 step (notebook 11's grader, `check_sharded_step`).

ZeRO-1's step (Rajbhandari et al., "ZeRO", SC 2020, section 7) moves what DDP's ring all-reduce moves: per rank,
the reduce-scatter sends every slice but the one it completes and the all-gather every slice but the one it
receives last (`ring_nbytes_per_rank`), 2(N-1)/N x S bytes when N divides the size; padding every slice to the
largest, for gloo's all_gather, allows up to 2(N-1) x the largest slice. No all-reduce, and what each rank sends
into the all-gather is its own updated slice, and what it sends into the reduce-scatter toward each rank is that
rank's slice of its own gradient (divided by N or not; padded with zeros or not): counting the messages is not
checking them.
"""

from __future__ import annotations

import torch

from labkit.checks import whole
from labkit.exercises.diagnosis import ring_nbytes_per_rank
from labkit.exercises.step_guard import Collective, StepCase, StepOutcome
from labkit.exercises.step_values import element_span, reference_step, shown_values, values_close
from labkit.plan.counts import shard_sizes

__all__ = ["step_nbytes_bounds", "step_traffic"]

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


def step_traffic(outcomes: list[StepOutcome], case: StepCase) -> str | None:
    """No all-reduce; each rank's bytes those of a reduce-scatter plus an all-gather; each rank's reduce-scatter
    input its own gradient, and its all-gather input its own updated slice (so that it updated only that)."""
    numel, world_size, dtype = case.numel, case.world_size, case.dtype
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
    for find in (_contribution_problem, _scattered_problem):  # another split is best told by the all-gather's
        problem = next((p for rank, outcome in enumerate(outcomes) if (p := find(rank, outcome, case))), None)
        if problem:
            return problem
    return None


def _scattered_problem(rank: int, outcome: StepOutcome, case: StepCase) -> str | None:
    """What rank `rank` sent into its reduce-scatter toward each rank d must be slice d of its own gradient (or
    that divided by N, for AVG done by hand), then zeros if padded: the sum the owner receives is then the sum of
    the ranks' gradients, made by this collective, not values obtained elsewhere."""
    sizes, dtype = shard_sizes(case.numel, case.world_size), case.dtype
    grad = case.inputs(rank)[1]
    for call in (c for c in outcome.calls if c.kind == "reduce_scatter" and c.chunks is not None):
        for owner, (sent, size) in enumerate(zip(call.chunks, sizes, strict=False)):
            start = sum(sizes[:owner])
            piece, sent = grad[start:start + size], torch.tensor(sent, dtype=dtype)
            if sent.numel() >= size and not sent[size:].any() and any(
                    values_close(sent[:size], want, dtype).all() for want in (piece, piece / case.world_size)):
                continue
            return (f"rank {rank} sent {shown_values(sent)} into its reduce-scatter toward rank {owner}, whose slice "
                    f"of rank {rank}'s gradient, {element_span(start, start + size)}, is {shown_values(piece)}. "
                    "The reduce-scatter is what sums the gradients over the ranks: each rank sends every owner that "
                    "owner's slice of its own gradient (padded with zeros or divided by N if you like), and the "
                    "owner receives their sum.")
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
            "Rank r needs only slice r of the averaged gradient, and updates only that slice.")


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


def _contribution_problem(rank: int, outcome: StepOutcome, case: StepCase) -> str | None:
    """What rank `rank` sent into the all-gather (or broadcast as the root) must be its updated slice: then it
    updated that slice, and no rank needed the others' gradients."""
    numel, world_size, dtype = case.numel, case.world_size, case.dtype
    sizes = shard_sizes(numel, world_size)
    start, size = sum(sizes[:rank]), sizes[rank]
    sent = torch.tensor([x for c in outcome.calls if c.contribution is not None for x in c.contribution],
                        dtype=dtype)
    expected = reference_step(case)[start:start + size]
    if sent.numel() >= size and sent.numel() <= max(sizes) and values_close(sent[:size], expected, dtype).all():
        return None
    average = (sum(case.inputs(r)[1] for r in range(world_size)) / world_size)[start:start + size]
    if sent.numel() >= size and values_close(sent[:size], average, dtype).all():
        return (f"rank {rank} sent its slice of the averaged gradient into the all-gather, not its updated "
                "parameters: then every rank holds the whole averaged gradient and updates the whole vector. Right "
                "values and DDP's traffic, but not sharded.")
    return (f"rank {rank} sent {shown_values(sent)} into the all-gather; its slice, "
            f"{element_span(start, start + size)} (shard_sizes({numel}, {world_size})[{rank}] = {size}), updated, is "
            f"{shown_values(expected)}. Rank r owns slice r of shard_sizes, the first numel % N slices one element "
            "longer: another split (the last rank taking the rest, or chunks of ceil(numel / N)) gives the right "
            "values too, but not ShardedOptimizer's sharding, whose optimizer state for each element lives on that "
            "element's owner.")
