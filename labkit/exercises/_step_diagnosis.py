"""What check_sharded_step (labkit.exercises.sharded_step, notebook 11) knows about ZeRO-1's step: its inputs and
calls (`StepCase`, `step_inputs`), what a rank's step left (`StepOutcome`), the answer (`reference_step`), and what
is wrong with a wrong step's values (`wrong_step`) and traffic (`step_traffic`). Private: nothing here is API.

The answer is full SGD on the gradient averaged over the ranks, computed in one process; a rank's param must end
equal to it, in its own memory, dtype and device. A wrong param is compared with what wrong steps often leave
(unchanged, summed, its own gradient, ...), element by element, to say which mistake it is.

ZeRO-1's step (Rajbhandari et al., "ZeRO", SC 2020, section 7) moves what DDP's ring all-reduce moves: per rank,
the reduce-scatter sends every slice but the one it completes and the all-gather every slice but the one it
receives last (`ring_nbytes_per_rank`), 2(N-1)/N x S bytes when N divides the size; padding every slice to the
largest, for gloo's all_gather, allows up to 2(N-1) x the largest slice. No all-reduce, and what each rank sends
into the all-gather is its own updated slice, and what it sends into the reduce-scatter toward each rank is that
rank's slice of its own gradient (divided by N or not; padded with zeros or not): counting the messages is not
checking them. Each collective is the kit's `Call` (labkit.exercises._kit._record), with this grader's `facts`
(`step_facts`: each rank's chunk bytes, the element size, the rank and size of its group, a broadcast's root,
what this rank sent), read by `sent_nbytes` and `described_call`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from labkit.checks import whole
from labkit.exercises._kit._group_call import Kind
from labkit.exercises._kit._record import Call
from labkit.exercises.diagnosis import ring_nbytes_per_rank
from labkit.plan.counts import shard_sizes

__all__: list[str] = []

LR = 0.1  # the fixed cases' lr: not a power of two, so that a float32 buffer inside a float64 step shows
TOLERANCES = {torch.float32: 1e-6, torch.float64: 1e-12}  # relative; roundings of right solutions differ by ulps
# The step's word for each process-group method it may call (every other way to communicate is switched off)
COLLECTIVE = {Kind.REDUCE_SCATTER: "reduce_scatter", Kind.REDUCE_SCATTER_SINGLE: "reduce_scatter",
              Kind.REDUCE_SCATTER_BASE: "reduce_scatter", Kind.ALLGATHER: "all_gather",
              Kind.ALL_GATHER_SINGLE: "all_gather", Kind.ALLGATHER_BASE: "all_gather", Kind.BROADCAST: "broadcast",
              Kind.ALLREDUCE: "all_reduce", Kind.BARRIER: "barrier"}


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
class StepOutcome:
    """What one rank's step left behind: param's values, what fn returned, and every collective it made."""

    param: list[float]
    returned: list[float] | None  # a tensor fn returned other than param, as a list
    same_memory: bool  # param still uses the memory it came in
    placement: str  # "float32 on cpu": param's dtype and device after the step, ...
    came: str  # ... and before it
    calls: list[Call] = field(default_factory=list)


def step_facts(chunk_nbytes: list[int], element_size: int, rank: int, world_size: int, root: int | None = None,
               sent: list[float] | None = None, chunks: list[list[float]] | None = None) -> dict[str, object]:
    """A Call's facts for this grader: the bytes of every rank's chunk of the vector it covers (reduce_scatter,
    all_gather), or [the tensor's bytes] (all_reduce, broadcast); the element size; this rank and the size, in the
    group it was made on; a broadcast's root; `sent`, the values this rank put in (its all-gather input, or the
    tensor it broadcast as the root); `chunks`, a reduce_scatter's input: the values it sent toward each rank."""
    return {"chunk_nbytes": chunk_nbytes, "element_size": element_size, "rank": rank, "world_size": world_size,
            "root": root, "sent": sent, "chunks": chunks}


def collective(call: Call) -> str:
    """'reduce_scatter', 'all_gather', 'broadcast', 'all_reduce' or 'barrier': what the call is, in the step."""
    return COLLECTIVE[call.kind]


def sent_nbytes(call: Call) -> int:
    """The bytes this rank sends in the collective's ring algorithm (notebook 03's ring; Patarasuk & Yuan 2009): a
    reduce-scatter sends every chunk but the one it completes (its own), an all-gather every chunk but the one it
    receives last (its right neighbour's), a broadcast passes the tensor along a chain from the root (every rank
    but the one before the root sends it once), an all-reduce is both phases."""
    facts, kind = call.facts, collective(call)
    chunks, n, r = facts["chunk_nbytes"], facts["world_size"], facts["rank"]
    total = sum(chunks)
    if kind == "reduce_scatter":
        return total - chunks[r]
    if kind == "all_gather":
        return total - chunks[(r + 1) % n]
    if kind == "broadcast":
        return 0 if r == (facts["root"] - 1) % n else total
    if kind == "all_reduce":
        return ring_nbytes_per_rank(total // facts["element_size"], n, facts["element_size"])[r]
    return 0


def described_call(call: Call) -> str:
    """'an all_gather of 48 bytes in chunks of [12] (sends 36)', for a message."""
    kind, covered = collective(call), sum(call.facts["chunk_nbytes"])
    if kind in ("reduce_scatter", "all_gather"):
        article, chunks = "a" if kind == "reduce_scatter" else "an", sorted(set(call.facts["chunk_nbytes"]))[::-1]
        what = f"{article} {kind} of {covered} bytes in chunks of {chunks}"
    elif kind == "broadcast":
        what = f"a broadcast of {covered} bytes from rank {call.facts['root']}"
    else:
        what = f"an {kind} of {covered} bytes" if kind == "all_reduce" else "a barrier"
    return f"{what} (sends {sent_nbytes(call)})"


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


# ---- the traffic ------------------------------------------------------------------------------------


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
        reduced = [c for c in outcome.calls if collective(c) == "all_reduce"]
        if reduced:
            return _all_reduce_message(rank, outcome, reduced[0], numel * element_size)
    bounds = step_nbytes_bounds(numel, world_size, element_size)
    for rank, outcome in enumerate(outcomes):
        sent = sum(map(sent_nbytes, outcome.calls))
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
    for call in (c for c in outcome.calls if collective(c) == "reduce_scatter" and c.facts["chunks"] is not None):
        for owner, (sent, size) in enumerate(zip(call.facts["chunks"], sizes, strict=False)):
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


def _all_reduce_message(rank: int, outcome: StepOutcome, reduced: Call, nbytes: int) -> str:
    """An all-reduce: right values, but every rank receives the whole gradient."""
    covered = sum(reduced.facts["chunk_nbytes"])
    what = "the whole gradient" if covered == nbytes else f"{covered} bytes"
    gathered = [c for c in outcome.calls if collective(c) in ("all_gather", "broadcast")]
    sent = sum(map(sent_nbytes, outcome.calls))
    if gathered:
        cost = (f"and then all-gathered the parameters too: {sent} bytes sent in all, 3(N-1)/N x S, 1.5 x ZeRO-1's "
                "2(N-1)/N x S.")
    else:
        cost = ("and updated the whole vector: the right values and DDP's traffic, but nothing is sharded: every "
                "rank holds the whole averaged gradient and would keep the optimizer state of every element.")
    return (f"rank {rank} all-reduced {what} (dist.all_reduce, {sent_nbytes(reduced)} bytes sent) {cost} "
            "Rank r needs only slice r of the averaged gradient, and updates only that slice.")


def _bytes_message(rank: int, outcome: StepOutcome, sent: int, bounds: tuple[int, int], nbytes: int) -> str:
    """Traffic that is not one reduce-scatter and one all-gather: the calls, and the rule."""
    calls = "; ".join(described_call(c) for c in outcome.calls) or "no collective"
    whole = [c for c in outcome.calls
             if collective(c) in ("all_gather", "broadcast") and max(c.facts["chunk_nbytes"]) >= nbytes > 0]
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
    sent = torch.tensor([x for c in outcome.calls if c.facts["sent"] is not None for x in c.facts["sent"]],
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
