"""The traffic and cost formulas, and the lesson's numbers they reproduce."""

import pytest

from labkit.plan.traffic import (
    busbw_factor,
    busbw_gbps,
    fit_alpha_beta,
    naive_allreduce_hub_nbytes,
    naive_allreduce_seconds,
    recursive_doubling_allreduce_seconds,
    ring_allreduce_nbytes_per_rank,
    ring_allreduce_seconds,
    ring_reduce_scatter_nbytes_per_rank,
)


def test_lesson_seven_b_gradients_on_eight_gpus():
    # 7.0e9 parameters x 2 bytes (BF16) = 14.0e9 bytes; 2 x 14.0e9 x 7/8 = 24.5e9 bytes per rank
    assert ring_allreduce_nbytes_per_rank(14.0e9, 8) == pytest.approx(24.5e9)


def test_ring_traffic_tends_to_twice_the_tensor_and_the_hub_grows_linearly():
    s = 1e9
    per_rank = [ring_allreduce_nbytes_per_rank(s, n) for n in (2, 4, 8, 64, 1024)]
    assert per_rank == sorted(per_rank) and per_rank[-1] < 2 * s and per_rank[-1] > 1.99 * s
    assert [naive_allreduce_hub_nbytes(s, n) for n in (2, 4, 8)] == [s, 3 * s, 7 * s]
    assert ring_reduce_scatter_nbytes_per_rank(s, 4) * 2 == ring_allreduce_nbytes_per_rank(s, 4)


def test_busbw_factors_follow_nccl_tests():
    assert busbw_factor("all_reduce", 4) == 1.5
    assert busbw_factor("all_gather", 4) == busbw_factor("reduce_scatter", 4) == 0.75
    assert busbw_factor("broadcast", 8) == 1.0
    assert busbw_gbps("all_reduce", 2e9, 1.0, 2) == 2.0
    with pytest.raises(ValueError, match="collective='gather'"):
        busbw_factor("gather", 2)


def test_alpha_beta_costs():
    alpha, beta = 1e-5, 1e-9
    assert ring_allreduce_seconds(8e6, 4, alpha, beta) == pytest.approx(6 * alpha + 1.5 * 8e6 * beta)
    assert naive_allreduce_seconds(8e6, 4, alpha, beta) == pytest.approx(6 * (alpha + 8e6 * beta))
    # recursive doubling wins for small messages, the ring for large ones
    assert recursive_doubling_allreduce_seconds(1e3, 16, alpha, beta) < ring_allreduce_seconds(1e3, 16, alpha, beta)
    assert recursive_doubling_allreduce_seconds(1e9, 16, alpha, beta) > ring_allreduce_seconds(1e9, 16, alpha, beta)


def test_fit_recovers_the_parameters_it_was_made_with():
    alpha, beta, n = 3e-4, 2e-9, 4
    sizes = [2.0 ** k for k in range(10, 27, 2)]
    times = [ring_allreduce_seconds(s, n, alpha, beta) for s in sizes]
    fitted = fit_alpha_beta(sizes, times, n)
    assert fitted == pytest.approx((alpha, beta), rel=1e-6)


def test_fit_never_returns_a_negative_latency():
    assert fit_alpha_beta([1e3, 1e6], [0.0, 1.0], 2)[0] == 0.0


@pytest.mark.parametrize("call", [lambda: fit_alpha_beta([1.0], [1.0], 2), lambda: fit_alpha_beta([1, 1], [1, 2], 2),
                                  lambda: ring_allreduce_nbytes_per_rank(1.0, 0)])
def test_bad_input(call):
    with pytest.raises(ValueError):
        call()
