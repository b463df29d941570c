"""check_ring_step, notebook 17's grader: it accepts right steps written differently (on drawn blocks, then as ring
attention's step on 2, 3 and 4 real gloo ranks) and rejects every catalogued wrong one with the mistake named."""

import math
import re

import pytest
import torch
import torch.nn.functional as F

import labkit
from labkit.exercises import check_ring_step
from labkit.parallel.context import attend_and_merge, merge_partials

pytestmark = pytest.mark.numerics  # the grader compares floating-point results: make unit runs it on other kernels


def scores_of(q, k, diagonal, mask_when=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if diagonal if mask_when is None else mask_when:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return scores


# ---- right, written differently ----------------------------------------------------------------------------------

def explicit_max(out, lse, q, k, v, diagonal):
    """The running max, written out (the notebook's solution)."""
    scores = scores_of(q, k, diagonal)
    top = torch.maximum(lse, scores.amax(-1))
    weights = torch.exp(scores - top[..., None])
    total = torch.exp(lse - top) + weights.sum(-1)
    return (out * torch.exp(lse - top)[..., None] + weights @ v) / total[..., None], top + torch.log(total)


def logsumexp_of_both(out, lse, q, k, v, diagonal):
    """One logsumexp over the running lse and the block's scores, side by side."""
    scores = scores_of(q, k, diagonal)
    new = torch.logsumexp(torch.cat([lse[..., None], scores], -1), -1)
    return out * torch.exp(lse - new)[..., None] + torch.exp(scores - new[..., None]) @ v, new


def sdpa_and_logaddexp(out, lse, q, k, v, diagonal):
    """torch's own attention for the block, its lse apart, merged with torch.logaddexp, out updated in place."""
    n, m = q.shape[-2], k.shape[-2]
    mask = ~torch.ones(n, m, dtype=torch.bool).triu(1) if diagonal else None
    block = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    block_lse = torch.logsumexp(scores_of(q, k, diagonal), -1)
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new)[..., None]).add_(block * torch.exp(block_lse - new)[..., None])
    return out, new


# ---- wrong: the catalogue ----------------------------------------------------------------------------------------

def no_max_subtracted(out, lse, q, k, v, diagonal):
    weights = scores_of(q, k, diagonal).exp()
    total = lse.exp() + weights.sum(-1)
    return (out * lse.exp()[..., None] + weights @ v) / total[..., None], total.log()


def nan_from_the_empty_state(out, lse, q, k, v, diagonal):
    scores = scores_of(q, k, diagonal)
    block_lse = torch.logsumexp(scores, -1)
    new = lse + torch.log1p(torch.exp(block_lse - lse))  # -inf + inf on the first block
    return out * torch.exp(lse - new)[..., None] + torch.exp(scores - new[..., None]) @ v, new


def rescaled_by_the_max_only(out, lse, q, k, v, diagonal):
    scores = scores_of(q, k, diagonal)
    block_lse = torch.logsumexp(scores, -1)
    block = torch.exp(scores - block_lse[..., None]) @ v
    top = torch.maximum(lse, block_lse)
    new = top + torch.log(torch.exp(lse - top) + torch.exp(block_lse - top))
    return out * torch.exp(lse - top)[..., None] + block * torch.exp(block_lse - top)[..., None], new


def outputs_averaged(out, lse, q, k, v, diagonal):
    scores = scores_of(q, k, diagonal)
    block_lse = torch.logsumexp(scores, -1)
    block = torch.exp(scores - block_lse[..., None]) @ v
    new = torch.logaddexp(lse, block_lse)
    merged = torch.where(torch.isinf(lse)[..., None], block, (out + block) / 2)
    return merged, new


def lse_kept_as_the_max(out, lse, q, k, v, diagonal):
    merged, _ = explicit_max(out, lse, q, k, v, diagonal)
    return merged, torch.maximum(lse, torch.logsumexp(scores_of(q, k, diagonal), -1))


def lse_summed(out, lse, q, k, v, diagonal):
    merged, _ = explicit_max(out, lse, q, k, v, diagonal)
    block_lse = torch.logsumexp(scores_of(q, k, diagonal), -1)
    return merged, torch.where(torch.isinf(lse), block_lse, lse + block_lse)


def weighted_by_lse_as_probabilities(out, lse, q, k, v, diagonal):
    scores = scores_of(q, k, diagonal)
    block_lse = torch.logsumexp(scores, -1)
    block = torch.exp(scores - block_lse[..., None]) @ v
    linear = (out * lse[..., None] + block * block_lse[..., None]) / (lse + block_lse)[..., None]
    return torch.where(torch.isinf(lse)[..., None], block, linear), torch.logaddexp(lse, block_lse)


def no_causal_mask(out, lse, q, k, v, diagonal):
    return explicit_max(out, lse, q, k, v, False)


def every_block_masked(out, lse, q, k, v, diagonal):
    scores = scores_of(q, k, diagonal, mask_when=True)
    new = torch.logsumexp(torch.cat([lse[..., None], scores], -1), -1)
    return out * torch.exp(lse - new)[..., None] + torch.exp(scores - new[..., None]) @ v, new


def wrong_triangle(out, lse, q, k, v, diagonal):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if diagonal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).tril(-1), -math.inf)
    new = torch.logsumexp(torch.cat([lse[..., None], scores], -1), -1)
    return out * torch.exp(lse - new)[..., None] + torch.exp(scores - new[..., None]) @ v, new


def the_course_step(out, lse, q, k, v, diagonal):
    return attend_and_merge(out, lse, q, k, v, diagonal)


def the_course_merge(out, lse, q, k, v, diagonal):
    scores = scores_of(q, k, diagonal)
    block_lse = torch.logsumexp(scores, -1)
    return merge_partials(out, lse, torch.exp(scores - block_lse[..., None]) @ v, block_lse)


_first_keys = {}


def remembers_the_first_block(out, lse, q, k, v, diagonal):
    """Right on one call, but keeps the first keys it saw (a cache keyed on the shape)."""
    k = _first_keys.setdefault(tuple(k.shape), k)
    return explicit_max(out, lse, q, k, v, diagonal)


def returns_one_tensor(out, lse, q, k, v, diagonal):
    return explicit_max(out, lse, q, k, v, diagonal)[0]


CATALOGUE = [
    (no_max_subtracted, "scores in the thousands.*overflows"),
    (nan_from_the_empty_state, "lse is -inf everywhere.*nan"),
    (rescaled_by_the_max_only, "rescaled by exp\\(lse_i - max\\) and not divided"),
    (outputs_averaged, "your lse is right but your out is not: each partial output must be weighted"),
    (lse_kept_as_the_max, "your lse is the larger of the two"),
    (lse_summed, "sum of the two log-sum-exps"),
    (weighted_by_lse_as_probabilities, "weighted by the log-sum-exps themselves"),
    (no_causal_mask, "apply the causal mask when diagonal is True"),
    (every_block_masked, "is not the diagonal one.*Mask only when diagonal is True"),
    (wrong_triangle, "wrong triangle"),
    (the_course_step, "called labkit.parallel.context's partial_attention.*switched off"),
    (the_course_merge, "called labkit.parallel.context's merge_partials.*switched off"),
    (remembers_the_first_block, "differs from one process's attention|differs from the attention"),
    (returns_one_tensor, "return two tensors|return \\(out, lse\\)"),
]


@pytest.mark.parametrize("wrong,message", CATALOGUE, ids=[fn.__name__ for fn, _ in CATALOGUE])
def test_a_wrong_step_is_rejected_with_its_mistake_named(wrong, message):
    _first_keys.clear()
    verdict = check_ring_step(wrong, record=False)
    assert not verdict, verdict
    assert re.search(message, verdict.message, flags=re.IGNORECASE | re.DOTALL), verdict.message


@pytest.mark.parametrize("right", [explicit_max, logsumexp_of_both, sdpa_and_logaddexp], ids=lambda f: f.__name__)
def test_right_steps_written_differently_pass(right):
    verdict = check_ring_step(right, record=False)
    assert verdict, verdict.message
    assert "every rank's output equals one process's attention" in verdict.message


def test_not_a_function_is_told_what_to_pass():
    verdict = check_ring_step("ring_step", record=False)
    assert not verdict and "pass your function itself" in verdict.message


def test_the_graders_pools_are_its_own():
    """The grading leaves no pool of the student's behind: labkit.run in the notebook still starts its own."""
    check_ring_step(explicit_max, record=False)
    assert labkit.run(labkit.world_size, world_size=2) == [2, 2]


def own_key_hidden(out, lse, q, k, v, diagonal):
    """triu(0): each query's own key masked too, so query 0 of the diagonal block sees nothing."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if diagonal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(0), -math.inf)
    new = torch.logsumexp(torch.cat([lse[..., None], scores], -1), -1)
    return out * torch.exp(lse - new)[..., None] + torch.exp(scores - new[..., None]) @ v, new


def one_global_maximum(out, lse, q, k, v, diagonal):
    """One maximum over every query and key at once: the other queries' exponentials underflow at large scores."""
    scores = scores_of(q, k, diagonal)
    top = torch.maximum(lse.max(), scores.max())
    weights = torch.exp(scores - top)
    total = torch.exp(lse - top) + weights.sum(-1)
    return (out * torch.exp(lse - top)[..., None] + weights @ v) / total[..., None], top + torch.log(total)


def max_not_lined_up(out, lse, q, k, v, diagonal):
    """m without [..., None]: a shape error, or a silent broadcast where the sizes happen to fit."""
    scores = scores_of(q, k, diagonal)
    top = torch.maximum(lse, scores.amax(-1))
    weights = torch.exp(scores - top)
    total = torch.exp(lse - top) + weights.sum(-1)
    return (out * torch.exp(lse - top)[..., None] + weights @ v) / total[..., None], top + torch.log(total)


MORE = [(own_key_hidden, "hides each query's own key too"),
        (one_global_maximum, "one maximum taken over every query at once|differs"),
        (max_not_lined_up, r"\[\.\.\., None\]|differs")]


@pytest.mark.parametrize("wrong,message", MORE, ids=[fn.__name__ for fn, _ in MORE])
def test_more_mistakes_a_student_made_are_named(wrong, message):
    verdict = check_ring_step(wrong, record=False)
    assert not verdict, verdict
    assert re.search(message, verdict.message, flags=re.IGNORECASE | re.DOTALL), verdict.message


# ---- found by a helper trying to fool the grader ----------------------------------------------------------------

def modifies_q_in_place(out, lse, q, k, v, diagonal):
    q /= math.sqrt(q.shape[-1])
    scores = scores_of(q * math.sqrt(q.shape[-1]), k, diagonal)
    new = torch.logsumexp(torch.cat([lse[..., None], scores], -1), -1)
    return out * torch.exp(lse - new)[..., None] + torch.exp(scores - new[..., None]) @ v, new


def first_call_by_any_inf(out, lse, q, k, v, diagonal):
    """Treats the state as empty if any query's lse is -inf: drops the rows that had seen keys."""
    scores = scores_of(q, k, diagonal)
    block_lse = torch.logsumexp(scores, -1)
    block = torch.exp(scores - block_lse[..., None]) @ v
    if torch.isinf(lse).any():
        return block, block_lse
    new = torch.logaddexp(lse, block_lse)
    return out * torch.exp(lse - new)[..., None] + block * torch.exp(block_lse - new)[..., None], new


def finite_mask(out, lse, q, k, v, diagonal):
    """-1e4 for the masked scores, the idiom of some libraries' attention masks."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if diagonal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), -1e4)
    new = torch.logsumexp(torch.cat([lse[..., None], scores], -1), -1)
    return out * torch.exp(lse - new)[..., None] + torch.exp(scores - new[..., None]) @ v, new


def relative_to_the_block(out, lse, q, k, v, diagonal):
    """new = block_lse + log(exp(lse - block_lse) + 1): overflows when the state is far above the block."""
    scores = scores_of(q, k, diagonal)
    block_lse = torch.logsumexp(scores, -1)
    block = torch.exp(scores - block_lse[..., None]) @ v
    new = block_lse + torch.log(torch.exp(lse - block_lse) + 1)
    return out * torch.exp(lse - new)[..., None] + block * torch.exp(block_lse - new)[..., None], new


def in_float32(out, lse, q, k, v, diagonal):
    new_out, new_lse = explicit_max(out.float(), lse.float(), q.float(), k.float(), v.float(), diagonal)
    return new_out.double(), new_lse.double()


def returns_float32(out, lse, q, k, v, diagonal):
    new_out, new_lse = explicit_max(out, lse, q, k, v, diagonal)
    return new_out.float(), new_lse.float()


def divides_by_d(out, lse, q, k, v, diagonal):
    scores = scores_of(q, k, diagonal) / math.sqrt(q.shape[-1])
    new = torch.logsumexp(torch.cat([lse[..., None], scores], -1), -1)
    return out * torch.exp(lse - new)[..., None] + torch.exp(scores - new[..., None]) @ v, new


def returns_three(out, lse, q, k, v, diagonal):
    new_out, new_lse = explicit_max(out, lse, q, k, v, diagonal)
    return new_out, new_lse, new_lse.exp()


FOUND = [(modifies_q_in_place, "changed q in place"), (first_call_by_any_inf, "treated the whole state as empty"),
         (finite_mask, "finite stand-in for -inf|masked scores -inf"), (relative_to_the_block, "overflows|nan or inf"),
         (in_float32, "float32|float64"), (returns_float32, "is torch.float32, not float64"),
         (divides_by_d, "block's own attention.*sqrt\\(d\\)|differs"), (returns_three, "return two tensors")]


@pytest.mark.parametrize("wrong,message", FOUND, ids=[fn.__name__ for fn, _ in FOUND])
def test_what_a_helper_found_is_rejected(wrong, message):
    verdict = check_ring_step(wrong, record=False)
    assert not verdict, verdict
    assert re.search(message, verdict.message, flags=re.IGNORECASE | re.DOTALL), verdict.message


def test_a_compiled_step_gets_a_verdict_not_a_crash(monkeypatch):
    """A step labkit.run cannot pickle (a torch.compile'd function) is told so. Simulated by a step holding an
    unpicklable object, so the test does not spend minutes compiling."""
    import threading

    lock = threading.Lock()

    def holds_a_lock(out, lse, q, k, v, diagonal):
        assert lock is not None
        return explicit_max(out, lse, q, k, v, diagonal)

    verdict = check_ring_step(holds_a_lock, record=False)
    assert not verdict and "cannot be sent to the ranks" in verdict.message, verdict.message
