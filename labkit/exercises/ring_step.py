"""The grader of notebook 17's "your turn": one step of ring attention, a block attended to and merged in.

The student writes `fn(out, lse, q, k, v, diagonal) -> (out, lse)`: given the running attention of queries q over
the keys seen so far (`out`, and `lse`, the log-sum-exp of their scores, -inf where nothing is seen yet), the
attention over one more block of keys and values (k, v), merged in. `diagonal` says the block holds the queries'
own positions, where the causal mask applies (query i sees keys 0..i of it); any other block the ring hands over
is wholly visible. Scores are q k^T / sqrt(d). The merge is the log-sum-exp rule (Milakov & Gimelshein 2018,
"Online normalizer calculation for softmax"; Dao et al. 2022, "FlashAttention", section 3.1):

    l = max(l1, l2) + log(exp(l1 - max) + exp(l2 - max)),    out = out1 exp(l1 - l) + out2 exp(l2 - l)

`check_ring_step(fn)` grades in two parts.

1. In this process, on blocks drawn afresh at each grading (rows, queries, keys and head width, and values): the
   first block into an empty state, a visible block merged into a state, the diagonal block after others, the same
   with scores in the thousands (exp of them overflows float64 unless the larger is subtracted first), a state in
   which some queries have seen keys and others not, visible scores far below zero (where a finite stand-in for
   -inf fails), a state far above the block, and q, k, v left as they were. The first that is wrong is named with
   the mistake where the grader recognises it (the catalogue
   of tests/distributed/test_exercise_ring_step.py): no max subtracted, the empty state's -inf turned into nan,
   the output not rescaled (or by the max, not by the new log-sum-exp), the log-sum-exp replaced by the max or a
   sum, the outputs weighted by the log-sum-exps themselves (probabilities merged as if they were logits), the mask
   left off the diagonal, put on a block that is not the diagonal, or the wrong triangle masked.
2. On 2, 3 and 4 real ranks, through the graders' kit (labkit.exercises._kit._runner, one `Spec`): ring attention
   (labkit.parallel.context.ring_attention) with the student's step in place of its own, for sequence lengths no
   world size divides, zig-zag and causal, and one case without the mask; every rank's output equal to one
   process's attention over the whole sequence (float64, within 1e-10). While the step runs, communication is off
   (the ring passes K and V between steps itself) and labkit's own partial_attention and merge_partials refuse to
   run (READY_MADE).
"""

from __future__ import annotations

import math
import random

import torch

import labkit
from labkit._refusals import refusing
from labkit.exercises._kit._guard import Guard
from labkit.exercises._kit._messages import failure_sentence, first_failure, hang_message
from labkit.exercises._kit._runner import Case, Spec, grade
from labkit.exercises.allreduce import TIMEOUT_SECONDS
from labkit.exercises.progress import graded
from labkit.exercises.verdict import Verdict
from labkit.parallel import context
from labkit.parallel.context import READY_MADE

__all__ = ["TOLERANCE", "check_ring_step", "draw_blocks", "ring_cases"]

TOLERANCE = 1e-10  # float64: a right step's merges differ from one softmax by ~1e-15 x the scores' size
LARGE = 3000.0  # the scale of the large-score probe's queries: scores in the thousands, exp() overflows at 709.8
FAR_BELOW = "the diagonal block with the first query's only visible score far below zero (-10^6)"
PARTLY_SEEN = "a state in which every other query has seen nothing yet (its lse -inf, the others' finite)"


def draw_blocks(rng: random.Random) -> dict:
    """The local probes' sizes and values, drawn: rows (batch x heads) 1-3, queries 2-5, keys of each block 1-5,
    head width 2-6, and a seed."""
    return {"rows": rng.randint(1, 3), "queries": rng.randint(2, 5), "keys": rng.randint(1, 5),
            "earlier": rng.randint(1, 5), "width": rng.randint(2, 6), "seed": rng.randrange(10 ** 6)}


def ring_cases(rng: random.Random) -> list[Case]:
    """2, 3 and 4 ranks with lengths no world size divides (zig-zag needs 2 cp chunks of a token at least), causal;
    the last also without the mask."""
    cases = []
    for cp in (2, 3, 4):
        length = rng.choice([n for n in range(2 * cp + 1, 6 * cp) if n % cp])
        cases.append(Case(cp, {"length": length, "rows": rng.randint(1, 3), "width": rng.randint(2, 5),
                               "seed": rng.randrange(10 ** 6), "causal": True}))
    last = cases[-1]
    cases.append(Case(last.world_size, {**last.drawn, "causal": False, "seed": rng.randrange(10 ** 6)}))
    return cases


@graded("ring_step")
def check_ring_step(fn, *, timeout_seconds: float = TIMEOUT_SECONDS) -> Verdict:
    """Grade `fn(out, lse, q, k, v, diagonal) -> (out, lse)`, one step of ring attention (module docstring).

    >>> def forgets_the_max(out, lse, q, k, v, diagonal):
    ...     scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    ...     if diagonal:
    ...         scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    ...     weights = scores.exp()
    ...     total = lse.exp() + weights.sum(-1)
    ...     return ((out * lse.exp().unsqueeze(-1) + weights @ v) / total.unsqueeze(-1), total.log())
    >>> check_ring_step(forgets_the_max)
    Not yet. With scores in the thousands ...
    """
    if not callable(fn):
        return Verdict(False, "pass your function itself, e.g. check_ring_step(ring_step), not "
                              f"{type(fn).__name__}.")
    rng = random.Random()
    with refusing(READY_MADE) as made:
        problem = _local_problem(fn, draw_blocks(rng))
    if made:
        return Verdict(False, f"your step called {made[0]}. {_why_forbidden(made[0], '')}")
    if problem:
        return Verdict(False, problem)
    spec = Spec(attempt=attempt, cases=lambda: ring_cases(rng), checks=(_values_problem,), describe=_describe,
                why_forbidden=_why_forbidden, on_hang=_hang_message, on_error=_error_message, passed=_passed,
                example="check_ring_step(ring_step)", ready_made=READY_MADE)
    try:
        return grade(spec, fn, timeout_seconds=timeout_seconds)
    except TypeError as error:  # labkit.run could not send the step to the ranks
        if "pickle" not in str(error):
            raise
        return Verdict(False, "your step is right on the grader's blocks, but it cannot be sent to the ranks "
                              f"({error}). A torch.compile'd function does not pickle: grade the plain function.")


# ==== part 1: probes in this process ==============================================================================

def _tensors(drawn: dict, scale: float = 1.0):
    """q (rows, queries, width) x scale, an earlier block's and this block's k and v, float64."""
    generator = torch.Generator().manual_seed(drawn["seed"])
    rows, width = drawn["rows"], drawn["width"]

    def randn(n):
        return torch.randn(rows, n, width, dtype=torch.float64, generator=generator)

    q = randn(drawn["queries"]) * scale
    return q, randn(drawn["earlier"]), randn(drawn["earlier"]), randn(drawn["keys"]), randn(drawn["keys"])


def _attention(q, k, v, mask=None):
    """softmax(q k^T / sqrt(d)) v and its log-sum-exp, `mask` True where a key is hidden: the grader's own."""
    scores = q.matmul(k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return torch.exp(scores - lse.unsqueeze(-1)).matmul(v), lse


def _causal(n: int, m: int | None = None) -> torch.Tensor:
    return torch.ones(n, n if m is None else m, dtype=torch.bool).triu(1)


def _local_problem(fn, drawn: dict) -> str | None:
    """The first probe that goes wrong, with the mistake named (module docstring), or None."""
    rows, n = drawn["rows"], drawn["queries"]
    empty = (torch.zeros(rows, n, drawn["width"], dtype=torch.float64),
             torch.full((rows, n), float("-inf"), dtype=torch.float64))
    for scale in (1.0, LARGE):
        q, k0, v0, k1, v1 = _tensors(drawn, scale)
        said = f"With scores in the thousands (q {LARGE:g} times larger), " if scale > 1 else ""
        # The diagonal block: the queries' own positions, so keys and queries have one length; take k, v of it.
        own_k, own_v = _own_block(drawn, scale)
        state = _attention(q, k1, v1)  # a visible block seen before the diagonal one (zig-zag's late chunk)
        probes = [
            ("the first block, the diagonal one, into an empty state (out zeros, lse -inf)", empty, own_k, own_v,
             True, _attention(q, own_k, own_v, _causal(n))),
            ("a visible block (diagonal=False) merged into a state", _attention(q, k0, v0), k1, v1, False,
             _attention(q, torch.cat([k0, k1], 1), torch.cat([v0, v1], 1))),
            ("a visible block as long as the queries' own (diagonal=False) merged into a state", state, own_v, own_k,
             False, _attention(q, torch.cat([k1, own_v], 1), torch.cat([v1, own_k], 1))),
            ("the diagonal block after a visible one", state, own_k, own_v, True,
             _attention(q, torch.cat([k1, own_k], 1), torch.cat([v1, own_v], 1),
                        torch.cat([torch.zeros(n, k1.shape[1], dtype=torch.bool), _causal(n)], 1))),
        ]
        problem = _first_problem(fn, probes, q, empty, scale > 1, said)
        if problem:
            return problem
    # After both scales, so that the catalogue's mistakes are named by the probes above first.
    q, k0, v0, k1, v1 = _tensors(drawn)
    return _first_problem(fn, _harder_probes(q, k0, v0, k1, v1, _own_block(drawn, 1.0)[1], n), q, empty, False, "")


def _first_problem(fn, probes, q, empty, large: bool, said: str) -> str | None:
    """The first of `probes` (what, state or None for empty, k, v, diagonal, want) that fn gets wrong, worded."""
    for what, state_given, k, v, diagonal, want in probes:
        out, lse = empty if state_given is None else state_given
        problem = _probe_problem(fn, out, lse, q, k, v, diagonal, want, large, what)
        if problem:
            return f"{said}{what[0].upper() if not said else what[0]}{what[1:]}: {problem}"
    return None


def _harder_probes(q, k0, v0, k1, v1, own_v, n: int) -> list[tuple]:
    """Three more probes: a state in which some queries have seen keys and others not (lse -inf on those rows
    only); the diagonal block with the first query's only visible score far below zero (k = -10^4 q: a finite
    stand-in for -inf, such as -1e4, then outweighs it); a state whose lse is far above the block's (exp(lse -
    block's) overflows unless the larger is subtracted)."""
    partial_out, partial_lse = _attention(q, k1, v1)
    unseen = torch.arange(n) % 2 == 1  # every other query has seen nothing yet
    partial_out, partial_lse = partial_out.clone(), partial_lse.clone()
    partial_out[:, unseen], partial_lse[:, unseen] = 0.0, float("-inf")
    block = _attention(q, k0, v0)
    # each position's key -q / |q|^2 x 1e6 sqrt(d): query i's score with its own key exactly -1e6
    far_below = -q / (q * q).sum(-1, keepdim=True) * 1e6 * q.shape[-1] ** 0.5
    high_state = _attention(q * 1000, k1, v1)
    low_k = k0 * 1e-3
    return [
        (PARTLY_SEEN,
         (partial_out, partial_lse), k0, v0, False, _merged(partial_out, partial_lse, *block)),
        (FAR_BELOW, None, far_below, own_v,
         True, _attention(q, far_below, own_v, _causal(n))),
        ("a state whose lse is far above the block's", high_state, low_k, v0, False,
         _merged(*high_state, *_attention(q, low_k, v0))),
    ]


def _own_block(drawn: dict, scale: float):
    """K and V of the queries' own positions (as many as there are queries), drawn from the case's seed."""
    generator = torch.Generator().manual_seed(drawn["seed"] + 1)
    shape = (drawn["rows"], drawn["queries"], drawn["width"])
    return (torch.randn(*shape, dtype=torch.float64, generator=generator),
            torch.randn(*shape, dtype=torch.float64, generator=generator))


def _probe_problem(fn, out, lse, q, k, v, diagonal, want, large: bool, what: str = "") -> str | None:
    """What is wrong with fn on one probe, or None."""
    given = [t.clone() for t in (out, lse, q, k, v)]
    handed = [t.clone() for t in given]
    try:
        returned = fn(*handed, diagonal)
    except Exception as error:  # noqa: BLE001 - the student's error, reported with the call that raised it
        return _raised(error, given, diagonal)
    problem = _returned_problem(returned, given, handed, out, lse)
    if problem:
        return problem
    got_out, got_lse = returned
    want_out, want_lse = want
    out_ok, lse_ok = _close(got_out, want_out), _close(got_lse, want_lse)
    if out_ok and lse_ok:
        return None
    finite = bool(torch.isfinite(got_out).all() and torch.isfinite(got_lse).all())
    if not finite:
        if not large and what != FAR_BELOW and diagonal and bool(torch.isinf(lse).all()) and \
                not bool(torch.isfinite(got_out[:, 0]).all()) and bool(torch.isfinite(got_out[:, 1:]).all()):
            return ("query 0's output is nan and the others' are not: your mask hides each query's own key too, so "
                    "the first query sees nothing. Query i sees keys 0..i of its own block, itself included: hide "
                    "the keys above the diagonal only (triu(1), not triu(0)).")
        return _not_finite(lse, large)
    if what == PARTLY_SEEN and _close(got_out, _attention(q, k, v)[0]):
        return ("your step treated the whole state as empty because some queries' lse is -inf: each query has its "
                "own state; handle -inf row by row (the maximum with the block's own maximum does it).")
    if what == FAR_BELOW:
        return ("with the first query's only visible score far below zero, your masked keys outweighed it: a "
                "finite stand-in for -inf (such as -1e4) is not small enough here. Fill masked scores with "
                "float('-inf').")
    return _named_mistake(got_out, got_lse, out, lse, q, k, v, diagonal, out_ok, lse_ok)


def _returned_problem(returned, given: list, handed: list, out, lse) -> str | None:
    """What is wrong with what fn returned, or with what it did to its inputs, before any value is compared."""
    if not isinstance(returned, tuple | list) or len(returned) != 2:
        what = f"a {type(returned).__name__}" + (f" of {len(returned)}" if isinstance(returned, tuple | list) else "")
        return f"return two tensors, (out, lse); your function returned {what}."
    got_out, got_lse = returned
    changed = [name for name, before, after in zip(("q", "k", "v"), given[2:], handed[2:], strict=True)
               if not torch.equal(before, after)]
    if changed:
        return (f"your step changed {', '.join(changed)} in place: the ring passes k and v on to the next rank and "
                "uses q again at every step, so they must stay as they were (compute on new tensors: q / scale, "
                "not q /= scale).")
    for name, got in (("out", got_out), ("lse", got_lse)):
        if isinstance(got, torch.Tensor) and got.dtype != torch.float64:
            return (f"your {name} is {got.dtype}, not float64 as it was given: keep the inputs' dtype (the grader "
                    "compares with one process to 1e-10, which float32 cannot reach).")
    for name, got, like in (("out", got_out, out), ("lse", got_lse, lse)):
        if not isinstance(got, torch.Tensor) or got.shape != like.shape:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            return f"return (out, lse) shaped like the ones given; your {name} is {shape}, not {tuple(like.shape)}."
    return None


def _raised(error: Exception, given: list, diagonal: bool) -> str:
    """The student's exception, with the probe's shapes, and the broadcasting hint where it is a shape error."""
    shapes = ", ".join(f"{name} {tuple(t.shape)}" for name, t in zip(("out", "lse", "q", "k", "v"), given,
                                                                      strict=True))
    said = f"your function raised {type(error).__name__}: {error} (it was given {shapes}, diagonal={diagonal})"
    if any(word in str(error) for word in ("size of tensor", "must match", "broadcast")):
        said += ("; lse and a per-query maximum are (rows, queries): add [..., None] to line them up with "
                 "(rows, queries, keys) scores or (rows, queries, d) outputs")
    return said + "."


def _not_finite(lse, large: bool) -> str:
    if not large and bool(torch.isinf(lse).all()):
        return ("your result holds nan or inf. Here lse is -inf everywhere (nothing seen yet): exp(lse - lse) is "
                "exp(-inf + inf) = nan. Take the maximum of the running lse and the block's, and subtract that: "
                "exp(-inf - m) is 0, as it should be. (A mask built by multiplying gives nan too: 0 x -inf; use "
                "masked_fill or torch.where.)")
    return ("your result holds nan or inf: exp() of scores this large overflows (float64 stops at exp(709.8)), "
            "or, with one maximum taken over every query at once, underflows to 0 for the others. Subtract each "
            "query's own maximum (scores.amax(-1), and the running lse) before exponentiating, then add it back "
            "to lse.")


def _named_mistake(got_out, got_lse, out, lse, q, k, v, diagonal, out_ok, lse_ok) -> str:
    """Which catalogued mistake explains the result (module docstring), else what is off."""
    block = _attention(q, k, v, _causal(q.shape[1]) if diagonal else None)
    mistake = (None if out_ok else _mask_mistake(got_out, out, lse, q, k, v, diagonal, block)) or (
        _out_mistake(got_out, out, lse, *block) if lse_ok else _lse_mistake(got_lse, lse, block[1], out_ok))
    if mistake:
        return mistake
    gap = (got_out - _merged(out, lse, *block)[0]).abs().max().item()
    if gap < 1e-5:
        return (f"your out is off by {gap:.2g}: close, but not float64's 1e-10. Did you compute in float32 "
                "somewhere (a .float(), a float32 tensor you made)? Keep float64 throughout.")
    if bool(torch.isinf(lse).all()):
        return (f"your out differs from the block's own attention by up to {gap:.3g} (with nothing seen before, "
                "there is nothing to merge): check the block's attention itself, scores q k^T / sqrt(d) with d the "
                "head width, masked scores -inf (not 0), softmax over the keys, then times v.")
    return (f"your out differs from the attention over all the keys seen by up to {gap:.3g}, and so does "
            "your lse: compute the block's partial attention (its output and lse), then merge the two with the "
            "log-sum-exp rule.")


def _mask_mistake(got_out, out, lse, q, k, v, diagonal, block) -> str | None:
    """The mask left off the diagonal block, the wrong triangle masked, or a visible block masked: a mask that
    explains the output, where it changes the attention (a 5 x 1 block's triu(1) hides nothing)."""
    right = _merged(out, lse, *block)[0]
    n, m = q.shape[1], k.shape[1]
    hidden_after, hidden_before = (torch.ones(n, m, dtype=torch.bool).triu(1),
                                   torch.ones(n, m, dtype=torch.bool).tril(-1))
    wrong_masks = ((None, "on the diagonal block every query saw every key of it, later ones too: apply the causal "
                          "mask when diagonal is True (scores of keys after the query set to -inf)."),
                   (hidden_before, "you masked the wrong triangle: query i must see keys 0..i of its own block and "
                                   "hide the keys after it (triu(1), above the diagonal), not the ones before it.")
                   ) if diagonal else (
                   (hidden_after, "this block is not the diagonal one (diagonal is False), but your step masked "
                                  "it: every key of an earlier block comes before every query, so the whole block "
                                  "is visible. Mask only when diagonal is True."),)
    for mask, message in wrong_masks:
        wrong = _merged(out, lse, *_attention(q, k, v, mask))[0]
        if not _close(wrong, right) and _close(got_out, wrong):
            return message
    return None


def _out_mistake(got_out, out, lse, block_out, block_lse) -> str:
    """With lse right: the outputs rescaled by the max only, weighted by the lse themselves, or otherwise."""
    top = torch.maximum(lse, block_lse)
    by_max = out * torch.exp(lse - top).unsqueeze(-1) + block_out * torch.exp(block_lse - top).unsqueeze(-1)
    if _close(got_out, by_max):
        return ("your lse is right but your out is not: the outputs were rescaled by exp(lse_i - max) and not "
                "divided by the total. Weight each by exp(lse_i - lse_new), with the new lse.")
    linear = (out * lse.unsqueeze(-1) + block_out * block_lse.unsqueeze(-1)) / (lse + block_lse).unsqueeze(-1)
    if not torch.isinf(lse).all() and _close(got_out, linear):
        return ("your outputs are weighted by the log-sum-exps themselves: those are logarithms of the blocks' "
                "totals, not probabilities. Weight by exp(lse_i - lse_new).")
    return ("your lse is right but your out is not: each partial output must be weighted by exp(lse_i - "
            "lse_new), the share of the softmax's total that its block holds.")


def _lse_mistake(got_lse, lse, block_lse, out_ok: bool) -> str | None:
    """The lse kept as the max, summed, or wrong while out is right; None when out is wrong too."""
    if _close(got_lse, torch.maximum(lse, block_lse)):
        return ("your lse is the larger of the two, not the log of the sum of both blocks' exp(scores): lse = m + "
                "log(exp(lse1 - m) + exp(lse2 - m)), m the larger.")
    if _close(got_lse, torch.where(torch.isinf(lse), torch.zeros_like(lse), lse) + block_lse):
        return ("your lse is the sum of the two log-sum-exps: that multiplies the totals. Add the totals "
                "instead, in log space: m + log(exp(lse1 - m) + exp(lse2 - m)).")
    if out_ok:
        return "your out is right but your lse is not: lse = m + log(exp(lse1 - m) + exp(lse2 - m)), m the larger."
    return None


def _merged(out, lse, block_out, block_lse):
    """The grader's own merge (the module docstring's rule)."""
    top = torch.maximum(lse, block_lse)
    new = top + torch.log(torch.exp(lse - top) + torch.exp(block_lse - top))
    return out * torch.exp(lse - new).unsqueeze(-1) + block_out * torch.exp(block_lse - new).unsqueeze(-1), new


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal within TOLERANCE relative to the values' size beyond 1 (lse grows with the scores)."""
    if got.shape != want.shape or not torch.isfinite(got).all():
        return False
    scale = max(1.0, want.abs().max().item())
    return (got.double() - want).abs().max().item() <= TOLERANCE * scale


# ==== part 2: ring attention on real ranks, through the kit =======================================================

class _StepGuard(Guard):
    """While the student's step runs: no communication at all (the ring passes K and V itself)."""


def attempt(fn, case: Case) -> list[list[float]]:
    """On a rank: ring attention over the case's sequence with `fn` as each step; this rank's output, as lists."""
    cp, rank = labkit.world_size(), labkit.rank()
    generator = torch.Generator().manual_seed(case["seed"])
    q, k, v = (torch.randn(case["rows"], case["length"], case["width"], dtype=torch.float64, generator=generator)
               for _ in range(3))
    parts = [context.shard_sequence(t, cp, rank).to(labkit.device()) for t in (q, k, v)]

    def guarded(*args):
        with _StepGuard():
            return fn(*args)

    with torch.no_grad():
        out = context.ring_attention(*parts, case["length"], causal=case["causal"], update=guarded)
    return out.cpu().tolist()


def _values_problem(outcomes, case: Case) -> str | None:
    """Every rank's output against one process's attention over the whole sequence."""
    generator = torch.Generator().manual_seed(case["seed"])
    q, k, v = (torch.randn(case["rows"], case["length"], case["width"], dtype=torch.float64, generator=generator)
               for _ in range(3))
    want = _attention(q, k, v, _causal(case["length"]) if case["causal"] else None)[0]
    for rank, got in enumerate(outcomes):
        mine = context.shard_sequence(want, case.world_size, rank)
        got = torch.tensor(got, dtype=torch.float64)
        if not _close(got, mine):
            gap = (got - mine).abs().max().item() if got.shape == mine.shape else float("inf")
            positions = context.context_positions(case["length"], case.world_size, rank).tolist()
            return (f"rank {rank}'s output (positions {positions}) differs from one process's attention by up to "
                    f"{gap:.3g}: your step is right on the grader's single blocks but not as the ring calls it, "
                    "block after block, in any order, on chunks of unequal lengths.")
    return None


def _describe(case: Case) -> str:
    mask = "causal, zig-zag" if case["causal"] else "no mask"
    rows = f"{case['rows']} row{'s' * (case['rows'] > 1)}"
    return f"On {case.world_size} ranks ({case['length']} positions, {mask}, {rows} of {case['width']}-wide heads)"


def _why_forbidden(spelling: str, name: str) -> str:
    if "labkit.parallel.context" in spelling:
        return "That is the course's own step, which does the exercise for you: it is switched off here."
    return "A step computes on what it is given: the ring passes K and V between steps, so communication is off."


def _hang_message(hang: labkit.RankTimeout, case: Case, timeout_seconds: float) -> str:
    return hang_message(hang, timeout_seconds, "a rank's step never returned.")


def _error_message(error: labkit.RankError, attempts, case: Case) -> str:
    first, _ = first_failure(error)
    said = f"{failure_sentence(first)}."
    if "Can't get attribute" in first.summary:
        said += (" Your step uses a helper the ranks cannot find: a function wrapped by a decorator such as "
                 "functools.lru_cache is sent by its name, and the ranks have no notebook to find it in. Define the "
                 "helper without the decorator, or inside your step.")
    return said


def _passed(cases) -> str:
    said = ", ".join(f"{case.world_size} ranks x {case['length']} positions" for case in cases[:-1])
    return ("your step equals attention over every key seen so far on drawn blocks (the first into an empty state, "
            "a visible block, the diagonal after others, and scores in the thousands), and, as ring attention's "
            f"step on {said} (causal, zig-zag) and once without the mask, every rank's output equals one "
            "process's attention over the whole sequence.")
