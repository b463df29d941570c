"""The grader of notebook 18's "your turn": expert parallelism's dispatch and combine, on real ranks.

The student writes two functions, run on every rank of an ep group of N ranks holding E experts, E/N each (rank r:
experts r E/N to (r + 1) E/N - 1):

    dispatch(x, expert, kept, experts) -> (rows, local_expert, state)
        x (tokens, d): this rank's tokens; expert (tokens, k): each token's chosen experts; kept (tokens, k): which
        choices fit their expert's capacity. Send each kept choice's token to the rank holding its expert, with
        dist.all_to_all_single, the split sizes exchanged first. Return the rows this rank received, the index
        (0 .. E/N - 1) of this rank's expert each row is for, and anything combine needs.
    combine(outputs, gate, state, tokens) -> (tokens, d)
        outputs: this rank's experts' results, one per received row, in the rows' order; gate (tokens, k) the
        router's probabilities. Send each result back to its token's rank and add gate x result into its token's
        row; a dropped choice adds nothing.

`check_expert_dispatch(dispatch, combine)` runs them through the graders' kit (labkit.exercises._kit._runner, one
`Spec`) on 2, 3 and 4 ranks, sizes drawn afresh (tokens per rank, width, experts per rank, top-1 or top-2, a
capacity factor that drops choices), the router's decision made by labkit.parallel.experts.route, the experts run by
the grader on the rows and labels dispatch returned. It passes when every rank's output equals one process's layer
with the same capacity rule (float64, within 1e-10), and names the mistake where it recognises it (the catalogue
of tests/distributed/test_exercise_token_dispatch.py): a row sent to the wrong rank or labelled for the wrong expert
(the order lost: rows not sorted by expert before the all-to-all, or labels not following the rows), a dropped
choice sent (capacity ignored), split sizes never exchanged (a rank assuming it receives what it sends), gates
left out or applied twice, a dropped choice's token given back something, results added to the wrong tokens.
While the functions run, every collective but all_to_all_single (and barrier) is off, and labkit's own dispatch
and combine refuse to run (labkit.parallel.experts.READY_MADE).
"""

from __future__ import annotations

import random

import torch

import labkit
from labkit.exercises._kit._guard import Guard
from labkit.exercises._kit._messages import failure_sentence, first_failure, hang_message
from labkit.exercises._kit._runner import Case, Spec, grade
from labkit.exercises.allreduce import TIMEOUT_SECONDS
from labkit.exercises.progress import graded
from labkit.exercises.verdict import Verdict
from labkit.parallel import experts as moe_kernels
from labkit.parallel.experts import READY_MADE

__all__ = ["TOLERANCE", "case_inputs", "check_expert_dispatch", "draw_cases"]

TOLERANCE = 1e-10  # float64: a right combine adds at most top_k terms per token in another order, ~1e-16 apart


def draw_cases(rng: random.Random | None = None) -> list[Case]:
    """2, 3 and 4 ranks: tokens per rank 4-9, width 2-5, 1-2 experts per rank, top-1 or top-2, a capacity factor
    of 0.5-1.0 (so choices are dropped), a seed; the last case top-2 with 2 experts per rank."""
    rng = rng or random.Random()
    cases = []
    for ep in (2, 3, 4):
        cases.append(Case(ep, {"tokens": rng.randint(4, 9), "width": rng.randint(2, 5), "local": rng.randint(1, 2),
                               "top_k": rng.choice((1, 2)), "factor": rng.choice((0.5, 0.75, 1.0)),
                               "seed": rng.randrange(10 ** 6)}))
    cases[-1] = Case(4, {**cases[-1].drawn, "top_k": 2, "local": 2})
    return cases


def case_inputs(case: Case):
    """The case's layer (MoE, float64, seeded) and every rank's tokens (ranks x tokens x width)."""
    experts = case["local"] * case.world_size
    top_k = min(case["top_k"], experts)
    moe = moe_kernels.MoE(case["width"], 2 * case["width"], experts, top_k, case["factor"], seed=case["seed"]).double()
    generator = torch.Generator().manual_seed(case["seed"] + 1)
    x = torch.randn(case.world_size, case["tokens"], case["width"], dtype=torch.float64, generator=generator)
    return moe, x


@graded("expert_dispatch")
def check_expert_dispatch(dispatch, combine, *, timeout_seconds: float = TIMEOUT_SECONDS) -> Verdict:
    """Grade `dispatch(x, expert, kept, experts)` and `combine(outputs, gate, state, tokens)` (module docstring)."""
    for name, fn in (("dispatch", dispatch), ("combine", combine)):
        if not callable(fn):
            return Verdict(False, f"pass your two functions themselves, check_expert_dispatch(dispatch, combine); "
                                  f"your {name} is {type(fn).__name__}.")
    rng = random.Random()
    spec = Spec(attempt=attempt, cases=lambda: draw_cases(rng), checks=(_rows_problem, _values_problem),
                describe=_describe, why_forbidden=_why_forbidden, on_hang=_hang_message, on_error=_error_message,
                passed=_passed, example="check_expert_dispatch(dispatch, combine)", ready_made=READY_MADE)
    return grade(spec, dispatch, combine, timeout_seconds=timeout_seconds)


class _DispatchGuard(Guard):
    """While the student's functions run: all_to_all_single (and barrier) on, every other collective off."""

    def install(self) -> None:
        self.switch_off_torch_distributed(allowed=("all_to_all_single", "alltoall_base", "barrier"))


def attempt(dispatch, combine, case: Case) -> dict:
    """On a rank: route this rank's tokens, the student's dispatch, the experts on what it returned, the student's
    combine; what came back, as lists."""
    rank, device = labkit.rank(), labkit.device()
    moe, everyone = case_inputs(case)
    moe = moe.to(device)
    x = everyone[rank].to(device)
    with torch.no_grad():
        routing = moe_kernels.route(moe.router(x), moe.top_k, moe.capacity(x.shape[0]))
        with _DispatchGuard():
            rows, local_expert, state = _three(dispatch(x.clone(), routing.expert.clone(), routing.kept.clone(),
                                                        len(moe.experts)))
        rows, local_expert = torch.as_tensor(rows), torch.as_tensor(local_expert).long()
        outputs = _run_experts(moe, rows, local_expert, rank, case["local"])
        with _DispatchGuard():
            combined = combine(outputs.clone(), routing.gate.clone(), state, x.shape[0])
    return {"rows": rows.cpu().tolist(), "labels": local_expert.cpu().tolist(),
            "out": torch.as_tensor(combined).cpu().tolist()}


def _three(returned):
    """dispatch's (rows, local_expert, state), or a ValueError saying what came back instead."""
    if not isinstance(returned, tuple | list) or len(returned) != 3:
        size = f" of {len(returned)}" if hasattr(returned, "__len__") else ""
        raise ValueError(f"dispatch must return three things, (rows, local_expert, state); it returned "
                         f"{type(returned).__name__}{size}.")
    return returned


def _run_experts(moe, rows: torch.Tensor, labels: torch.Tensor, rank: int, local: int) -> torch.Tensor:
    """This rank's experts on the rows, each row through the expert its label names (a label out of range: the
    row's output is nan, and the checks say which label)."""
    out = torch.full_like(rows, float("nan"))
    for e in range(local):
        index = (labels == e).nonzero().flatten()
        if index.numel():
            out[index] = moe.experts[rank * local + e](rows[index])
    return out


def _expected(case: Case):
    """What each rank should receive (rank -> sorted list of (row as tuple, label)) and one process's outputs."""
    moe, everyone = case_inputs(case)
    with torch.no_grad():
        out, _, routings = moe(everyone.reshape(-1, case["width"]), groups=case.world_size)
    receives: dict[int, list] = {r: [] for r in range(case.world_size)}
    for source, routing in enumerate(routings):
        for t, j in zip(*torch.nonzero(routing.kept, as_tuple=True), strict=True):
            e = int(routing.expert[t, j])
            receives[e // case["local"]].append((tuple(everyone[source, t].tolist()), e % case["local"]))
    return receives, out.view(case.world_size, case["tokens"], case["width"]), routings, everyone


def _rows_problem(outcomes, case: Case) -> str | None:
    """Rows received against the routing: each row once, at the rank of its expert, labelled for it."""
    receives, _, routings, everyone = _expected(case)
    dropped = {tuple(everyone[s, t].tolist()) for s, r in enumerate(routings)
               for t, j in zip(*torch.nonzero(~r.kept, as_tuple=True), strict=True)}
    for rank, outcome in enumerate(outcomes):
        got = sorted((tuple(row), label) for row, label in zip(outcome["rows"], outcome["labels"], strict=True))
        want = sorted(receives[rank])
        if got == want:
            continue
        extra = [g for g in got if g not in want]
        if len(got) > len(want) and extra and all(row in dropped for row, _ in extra):
            return (f"rank {rank} received {len(got)} rows where {len(want)} choices fit its experts' capacity: "
                    "choices with kept False were sent too. A dropped choice goes nowhere; send only "
                    "expert[kept] (and its token).")
        if sorted(r for r, _ in got) == sorted(r for r, _ in want):
            return (f"rank {rank} received the right tokens but labelled some for the wrong one of its experts: "
                    "the labels must follow the rows, in the order the all-to-all delivers them (by sending rank, "
                    "and within each, in the order that rank sorted them).")
        return (f"rank {rank} received {len(got)} rows, {len(want)} of which should be there, and not the same "
                f"ones: each kept choice's token must go to the rank holding its expert (expert // (E/N)), rows "
                "sorted by expert before the all-to-all so that input_split_sizes cut them at the right places.")
    return None


def _values_problem(outcomes, case: Case) -> str | None:
    """Each rank's output against one process's layer, with the likely mistake."""
    receives, want, routings, everyone = _expected(case)
    moe, _ = case_inputs(case)
    for rank, outcome in enumerate(outcomes):
        got = torch.tensor(outcome["out"], dtype=torch.float64)
        if got.shape != want[rank].shape:
            return (f"rank {rank}'s combine returned shape {tuple(got.shape)}, not (tokens, d) = "
                    f"{tuple(want[rank].shape)}: one row per token of this rank, in token order.")
        if (got - want[rank]).abs().max() <= TOLERANCE * max(1.0, want[rank].abs().max().item()):
            continue
        return _combine_mistake(rank, got, want[rank], routings[rank], moe, everyone[rank])
    return None


def _combine_mistake(rank, got, want, routing, moe, x) -> str:
    """Which combine mistake explains rank `rank`'s output."""
    def layer(gate, kept):
        out = torch.zeros_like(x)
        with torch.no_grad():
            for t, j in zip(*torch.nonzero(kept, as_tuple=True), strict=True):
                out[t] += gate[t, j] * moe.experts[int(routing.expert[t, j])](x[t])
        return out

    close = lambda a, b: (a - b).abs().max() <= 1e-9 * max(1.0, b.abs().max().item())  # noqa: E731
    ones = torch.ones_like(routing.gate)
    if close(got, layer(ones, routing.kept)):
        return (f"rank {rank}'s output is the sum of its tokens' expert results without the gates: multiply each "
                "by gate[token, choice], the router's probability.")
    if close(got, layer(routing.gate ** 2, routing.kept)):
        return f"rank {rank}'s output has every gate applied twice: multiply each result by its gate once."
    dropped = ~routing.kept
    if dropped.any() and close(got - want, x * dropped.sum(1, keepdim=True)):
        return (f"rank {rank}'s output gives each dropped choice its token back (x): a dropped choice adds "
                "nothing here; the transformer's residual carries the token past the layer.")
    if sorted(map(tuple, got.tolist())) == sorted(map(tuple, want.tolist())):
        return (f"rank {rank}'s outputs are the right rows in the wrong tokens' places: add each result into the "
                "row of the token it came from (index_add with the token indices, in the order you sent them).")
    gap = (got - want).abs().max().item()
    return (f"rank {rank}'s output differs from one process's layer by up to {gap:.3g}: each result must come back "
            "to the rank and token it was sent from (the all-to-all with the split sizes swapped), times its gate.")


def _describe(case: Case) -> str:
    experts = case["local"] * case.world_size
    return (f"On {case.world_size} ranks ({case['tokens']} tokens each, width {case['width']}, {experts} experts, "
            f"top-{min(case['top_k'], experts)}, capacity factor {case['factor']})")


def _why_forbidden(spelling: str, name: str) -> str:
    if "labkit.parallel.experts" in spelling:
        return "That is the course's own, which does the exercise for you: it is switched off here."
    return "This exercise allows dist.all_to_all_single only: other communication is switched off while it is graded."


def _hang_message(hang: labkit.RankTimeout, case: Case, timeout_seconds: float) -> str:
    return hang_message(hang, timeout_seconds, "a rank waited in an all_to_all_single the others did not join the "
                                               "same way: every rank makes the same all-to-alls, in the same order.")


def _error_message(error: labkit.RankError, attempts, case: Case) -> str:
    first, _ = first_failure(error)
    said = f"{failure_sentence(first)}."
    seen = " ".join(f"{f.summary} {' '.join(f.stderr_tail)}" for f in error.failures)  # gloo aborts a rank
    if any(word in seen for word in ("size", "Split", "split", "match")):
        said += (" The ranks disagreed on how many rows each sends the other: a rank cannot know what it receives "
                 "until the split sizes are exchanged (an all_to_all_single of the counts per expert first, then "
                 "output_split_sizes from what arrived).")
    return said


def _passed(cases) -> str:
    said = ", ".join(f"{c.world_size} ranks x {c['tokens']} tokens ({c['local'] * c.world_size} experts, top-"
                     f"{c['top_k']})" for c in cases)
    return (f"on {said}, with choices dropped by capacity, every rank received exactly the kept choices of its "
            "experts, labelled for the right one, and every rank's output equals one process's layer.")
