"""labkit.plan.context and the local pieces of labkit.parallel.context, no processes: the layout against torch's own
head-tail load balancer, the work it evens out, and the log-sum-exp merge against attention over both blocks at
once (hypothesis draws the blocks, their scores as large as float64 allows exponentials of)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.parallel import context as cp_kernels
from labkit.plan import attention_work, context_attention_saved_nbytes, context_layout, context_parallel_nbytes

pytestmark = pytest.mark.numerics  # the merge compares floating-point results: make unit runs it on other kernels


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("per_chunk", [1, 3])
def test_zigzag_is_torchs_head_tail_order(cp, per_chunk):
    """Where 2 cp divides the length (the only lengths torch's balancer takes), the positions rank 0, 1, ... hold,
    end to end, are torch's _HeadTailLoadBalancer's indices (a private class of torch 2.13; its docstring shows the
    order)."""
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    length = 2 * cp * per_chunk
    ours = [p for chunks in context_layout(length, cp) for start, stop in chunks for p in range(start, stop)]
    theirs = _HeadTailLoadBalancer(length, cp, "cpu")._generate_indices().flatten().tolist()
    assert ours == theirs


@given(st.integers(1, 8), st.integers(0, 200), st.booleans())
def test_every_position_held_once_sizes_within_one(cp, extra, zigzag):
    length = (2 * cp if zigzag else cp) + extra
    layout = context_layout(length, cp, zigzag)
    positions = sorted(p for chunks in layout for start, stop in chunks for p in range(start, stop))
    assert positions == list(range(length))
    sizes = [stop - start for chunks in layout for start, stop in chunks]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_evens_causal_work_and_contiguous_does_not(cp):
    length = 64 * cp
    contiguous, zigzag = attention_work(length, cp, zigzag=False), attention_work(length, cp)
    assert contiguous == [(r + 1) * 64 * 64 for r in range(cp)]  # rank r sees r + 1 blocks of 64 x 64
    assert len(set(zigzag)) == 1
    # The step waits for the busiest rank: cp blocks of 64 x 64 against 2 cp + 1 pairs of 32-token chunks (the
    # diagonals computed whole, then masked, are smaller in the zig-zag's finer chunks).
    assert max(contiguous) / max(zigzag) == pytest.approx(4 * cp / (2 * cp + 1))


def test_too_short_a_sequence_is_refused():
    with pytest.raises(ValueError, match="cannot be cut into 8 chunks.*at least 8 tokens"):
        context_layout(7, 4)
    with pytest.raises(ValueError, match="variant"):
        context_parallel_nbytes(16, 2, 1, 4, 8, variant="ulysses")


def test_ring_and_allgather_send_alike_forward_but_save_differently():
    """Forward, both move each other rank's K and V once to every rank; saved, the ring 1/cp, the all-gather the
    whole K and V."""
    ring, gather = (context_parallel_nbytes(1024, 4, 8, 64, 2, variant) for variant in ("ring", "allgather"))
    assert ring["forward"] == gather["forward"] == [3 * 256 * 2 * 8 * 64 * 2] * 4
    one = context_attention_saved_nbytes(1024, 1, 8, 64, 2)[0]
    assert context_attention_saved_nbytes(1024, 4, 8, 64, 2) == [one // 4] * 4
    assert context_attention_saved_nbytes(1024, 4, 8, 64, 2, "allgather")[0] > one // 2


def attention_over(q, k, v):
    return cp_kernels.partial_attention(q, k, v)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 6), st.integers(1, 6), st.floats(0.01, 300.0), st.integers(0, 10 ** 6))
def test_merge_of_two_blocks_is_attention_over_both(queries, keys1, keys2, spread, seed):
    """Scores up to about 300 x 300 / 2 apart: exp() of them overflows float64 unless the larger is subtracted."""
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(queries if i == 0 else keys1 + keys2, 2, dtype=torch.float64, generator=generator)
               for i in range(3))
    q = q * spread
    want_out, want_lse = attention_over(q, k, v)
    out1, lse1 = attention_over(q, k[:keys1], v[:keys1])
    out2, lse2 = attention_over(q, k[keys1:], v[keys1:])
    out, lse = cp_kernels.merge_partials(out1, lse1, out2, lse2)
    assert torch.isfinite(out).all()
    scale = max(1.0, want_lse.abs().max().item())
    assert (out - want_out).abs().max().item() < 1e-12 * scale * math.sqrt(keys1 + keys2)
    assert (lse - want_lse).abs().max().item() < 1e-12 * scale
