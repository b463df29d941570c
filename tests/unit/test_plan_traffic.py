"""The traffic and cost formulas, and the lesson's numbers they reproduce."""

import math
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from labkit.plan.traffic import (
    GB,
    allreduce_seconds,
    bus_bandwidth,
    busbw_factor,
    ddp_bucket_count,
    fit_alpha_beta,
    fit_point_to_point,
    naive_allreduce_bytes,
    ring_allreduce_bytes,
    ring_reduce_scatter_bytes,
    tree_beats_ring_below_nbytes,
)

sizes = st.floats(1.0, 1e12)
ranks = st.integers(2, 4096)


def test_lesson_seven_b_gradients_on_eight_gpus():
    # 7.0e9 parameters x 2 bytes (BF16) = 14.0e9 bytes; 2 x 14.0e9 x 7/8 = 24.5e9 bytes per rank
    assert ring_allreduce_bytes(7.0e9 * 2, 8) == pytest.approx(24.5e9)


def test_hub_grows_linearly_and_reduce_scatter_is_half_the_ring():
    s = 1e9
    assert [naive_allreduce_bytes(s, n) for n in (1, 2, 4, 8)] == [0, s, 3 * s, 7 * s]
    assert ring_reduce_scatter_bytes(s, 4) == 0.75 * s
    assert ring_allreduce_bytes(s, 4) == 1.5 * s
    assert ring_allreduce_bytes(s, 1) == 0.0


@given(nbytes=sizes, world_size=ranks)
def test_ring_stays_below_twice_the_tensor_and_approaches_it(nbytes, world_size):
    per_rank = ring_allreduce_bytes(nbytes, world_size)
    assert per_rank < 2 * nbytes
    assert 2 * nbytes - per_rank == pytest.approx(2 * nbytes / world_size)  # the gap closes as 1/N
    assert ring_allreduce_bytes(nbytes, world_size + 1) >= per_rank


def test_alpha_beta_costs_by_hand():
    alpha, bandwidth, n, rd = 1e-5, 1e9, 8e6, "recursive_doubling"
    assert allreduce_seconds(n, 4, bandwidth, alpha) == pytest.approx(6 * alpha + 1.5 * n / bandwidth)
    assert allreduce_seconds(n, 4, bandwidth, alpha, "naive") == pytest.approx(6 * (alpha + n / bandwidth))
    assert allreduce_seconds(n, 16, bandwidth, alpha, rd) == pytest.approx(4 * (alpha + n / bandwidth))
    assert allreduce_seconds(n, 5, bandwidth, alpha, rd) == pytest.approx(3 * (alpha + n / bandwidth))
    assert allreduce_seconds(n, 1, bandwidth, alpha, rd) == 0.0


def test_the_reduction_cost_adds_per_byte():
    n, gamma = 8e6, 1e-10
    extra = {"ring": 0.75 * n * gamma, "naive": 3 * n * gamma, "recursive_doubling": 2 * n * gamma}
    for algorithm, cost in extra.items():
        with_gamma = allreduce_seconds(n, 4, 1e9, algorithm=algorithm, gamma_seconds_per_byte=gamma)
        assert with_gamma - allreduce_seconds(n, 4, 1e9, algorithm=algorithm) == pytest.approx(cost)


def test_lesson_allreduce_takes_a_second_at_the_traffic_per_second():
    assert allreduce_seconds(14.0e9, 8, bandwidth=24.5e9) == pytest.approx(1.0)


def test_the_tree_is_a_reduce_then_a_broadcast_of_the_whole_tensor():
    alpha, bandwidth, n, gamma = 1e-5, 1e9, 8e6, 1e-10
    for p, steps in ((2, 1), (4, 2), (5, 3), (8, 3), (9, 4), (1000, 10)):
        expected = 2 * steps * (alpha + n / bandwidth) + steps * n * gamma
        tree = allreduce_seconds(n, p, bandwidth, alpha, "tree", gamma_seconds_per_byte=gamma)
        assert tree == pytest.approx(expected)
    assert allreduce_seconds(n, 1, bandwidth, alpha, "tree") == 0.0


@pytest.mark.parametrize("world_size", [4, 5, 8, 16, 64, 1000])
def test_the_tree_beats_the_ring_exactly_below_the_crossover(world_size):
    alpha, bandwidth = 2e-5, 1e10
    crossover = tree_beats_ring_below_nbytes(world_size, bandwidth, alpha)
    ring, tree = (lambda nbytes, a=a: allreduce_seconds(nbytes, world_size, bandwidth, alpha, a)
                  for a in ("ring", "tree"))
    assert crossover > 0 and ring(crossover) == pytest.approx(tree(crossover), rel=1e-12)
    assert tree(0.99 * crossover) < ring(0.99 * crossover) and tree(1.01 * crossover) > ring(1.01 * crossover)


def test_the_crossover_grows_with_the_ranks_and_is_zero_where_the_ring_never_loses():
    sizes = [tree_beats_ring_below_nbytes(p, 1e10, 2e-5) for p in (4, 8, 64, 512, 4096)]
    assert sizes == sorted(sizes) and sizes[-1] > 100 * sizes[0]
    assert [tree_beats_ring_below_nbytes(p, 1e10, 2e-5) for p in (1, 2, 3)] == [0.0, 0.0, 0.0]
    assert tree_beats_ring_below_nbytes(8, 1e10, 0.0) == 0.0      # no latency: the ring's bytes always win


def test_recursive_doubling_wins_small_messages_and_the_ring_large_ones():
    alpha, bandwidth = 1e-5, 1e9
    small = {a: allreduce_seconds(1e3, 16, bandwidth, alpha, a) for a in ("ring", "recursive_doubling")}
    large = {a: allreduce_seconds(1e9, 16, bandwidth, alpha, a) for a in ("ring", "recursive_doubling")}
    assert small["recursive_doubling"] < small["ring"] and large["recursive_doubling"] > large["ring"]


@given(nbytes=sizes, world_size=ranks, bandwidth=st.floats(1e6, 1e12), faster=st.floats(1.01, 100),
       algorithm=st.sampled_from(["ring", "naive", "recursive_doubling", "tree"]))
def test_more_bandwidth_takes_less_time(nbytes, world_size, bandwidth, faster, algorithm):
    slow = allreduce_seconds(nbytes, world_size, bandwidth, 1e-6, algorithm)
    assert allreduce_seconds(nbytes, world_size, bandwidth * faster, 1e-6, algorithm) < slow


def test_bus_bandwidth_follows_nccl_tests():
    # 2 GB in 1 s on 4 ranks: algbw 2 GB/s; factors 2(n-1)/n = 1.5, (n-1)/n = 0.75, 1
    expected = {"allreduce": 3e9, "reduce_scatter": 1.5e9, "allgather": 1.5e9, "alltoall": 1.5e9,
                "broadcast": 2e9, "reduce": 2e9}
    assert {c: bus_bandwidth(c, 2e9, 1.0, 4) for c in expected} == pytest.approx(expected)
    assert bus_bandwidth("allreduce", 2e9, 1.0, 2) / GB == 2.0
    assert busbw_factor("allreduce", 8) == 1.75


def test_fit_recovers_the_parameters_it_was_made_with():
    alpha, beta, n = 3e-4, 2e-9, 4
    sizes_ = [2.0 ** k for k in range(10, 27, 2)]
    times = [2 * (n - 1) * alpha + 2 * (n - 1) / n * s * beta for s in sizes_]
    assert fit_alpha_beta(sizes_, times, n) == pytest.approx((alpha, beta), rel=1e-6)
    model = [allreduce_seconds(s, n, bandwidth=1 / beta, latency=alpha) for s in sizes_]
    assert model == pytest.approx(times)


def test_fit_never_returns_a_negative_latency():
    assert fit_alpha_beta([1e3, 1e6], [0.0, 1.0], 2)[0] == 0.0


def test_fit_takes_tuples_and_arrays():
    sizes, times = [1e6, 4e6, 16e6], [0.00135, 0.0036, 0.0126]
    expected = fit_alpha_beta(sizes, times, 4)
    assert expected == pytest.approx((1e-4, 5e-10))
    assert fit_alpha_beta(tuple(sizes), np.array(times), 4) == pytest.approx(expected)


def test_point_to_point_fit_recovers_one_messages_alpha_and_beta():
    alpha, beta = 4e-4, 1.5e-9
    sizes_ = [2.0 ** k for k in range(8, 21, 2)]
    assert fit_point_to_point(sizes_, [alpha + s * beta for s in sizes_]) == pytest.approx((alpha, beta), rel=1e-6)
    noisy = [alpha + s * beta + (2e-5 if k % 2 else -2e-5) for k, s in enumerate(sizes_)]  # noise either way
    fitted = fit_point_to_point(sizes_, noisy)
    assert fitted[0] == pytest.approx(alpha, rel=0.1) and fitted[1] == pytest.approx(beta, rel=0.1)
    assert fit_point_to_point([1e3, 1e6], [0.0, 1e-3])[0] == 0.0  # never a negative latency
    with pytest.raises(ValueError, match=r"seconds=\[0.001, 0.001\] do not grow with nbytes"):
        fit_point_to_point([1e3, 1e6], [1e-3, 1e-3])
    with pytest.raises(ValueError, match="fit_point_to_point needs at least two"):
        fit_point_to_point([1e3], [1e-3])


def test_fit_refuses_times_that_give_no_bandwidth():
    with pytest.raises(ValueError, match=r"seconds=\[0.003, 0.002, 0.001\] do not grow with nbytes"):
        fit_alpha_beta([1e6, 2e6, 4e6], [3e-3, 2e-3, 1e-3], 4)              # falling: beta < 0
    with pytest.raises(ValueError, match="do not grow with nbytes"):
        fit_alpha_beta([1e6, 2e6], [1e-3, 1e-3], 4)                         # flat: beta = 0
    with pytest.raises(ValueError, match="do not grow with nbytes"):
        fit_alpha_beta([1e6, 2e6], [0.0, 0.0], 4)


def test_sizes_past_the_largest_float_are_named():
    assert ring_allreduce_bytes(Fraction(14 * 10**9), 8) == ring_allreduce_bytes(Decimal("14e9"), 8) == 24.5e9
    with pytest.raises(ValueError, match=r"nbytes=10\*\*400 is too large to compute with \(over 1.8e308\)"):
        ring_allreduce_bytes(10**400, 8)
    with pytest.raises(ValueError, match=r"world_size=10\*\*5000 is too large"):
        allreduce_seconds(1.0, 10**5000, 1e9)
    with pytest.raises(ValueError, match=r"ring_allreduce_bytes\(nbytes=1.7e\+308, world_size=8\) overflows"):
        ring_allreduce_bytes(1.7e308, 8)
    with pytest.raises(ValueError, match=r"allreduce_seconds\(.*bandwidth=5e-324.*\) overflows"):
        allreduce_seconds(1e9, 8, 5e-324)
    with pytest.raises(ValueError, match=r"world_size=10\*\*308.* overflows"):   # 2(p-1) alpha past 1.8e308
        allreduce_seconds(1.0, 10**308, 1e9, latency=1e-6)
    with pytest.raises(ValueError, match=r"bus_bandwidth\(nbytes=1e\+300, seconds=1e-10\) overflows"):
        bus_bandwidth("allreduce", 1e300, 1e-10, 2)
    with pytest.raises(ValueError, match=r"ddp_bucket_count\(.*bucket_mb=1e\+303\) overflows"):  # not 0 buckets
        ddp_bucket_count(1e9, bucket_mb=1e303)
    with pytest.raises(ValueError, match=r"fit_alpha_beta\(nbytes=\[1000000.0, 1e\+300\].* overflows"):
        fit_alpha_beta([1e6, 1e300], [1e-3, 1.0], 2)


@pytest.mark.parametrize("call, match", [
    (lambda: ring_allreduce_bytes(1.0, 0), "world_size=0"),
    (lambda: ring_allreduce_bytes(1.0, True), "world_size=True"),
    (lambda: ring_allreduce_bytes(1.0, 2.0), "world_size=2.0"),
    (lambda: ring_allreduce_bytes(-1.0, 2), "nbytes=-1.0"),
    (lambda: ring_reduce_scatter_bytes(math.nan, 2), "nbytes=nan"),
    (lambda: naive_allreduce_bytes(1.0, -3), "world_size=-3"),
    (lambda: allreduce_seconds(1.0, 2, 0.0), "bandwidth=0.0"),
    (lambda: allreduce_seconds(1.0, 2, -1e9), "bandwidth=-1000000000.0"),
    (lambda: allreduce_seconds(1.0, 2, math.inf), "bandwidth=inf"),
    (lambda: allreduce_seconds(1.0, 2, 1e9, latency=-1e-6), "latency=-1e-06"),
    (lambda: allreduce_seconds(1.0, 2, 1e9, algorithm="butterfly"), "algorithm='butterfly'"),
    (lambda: allreduce_seconds(1.0, 2, 1e9, gamma_seconds_per_byte=-1.0), "gamma_seconds_per_byte"),
    (lambda: allreduce_seconds(1.0, 0, 1e9), "world_size"),
    (lambda: bus_bandwidth("all_reduce", 1.0, 1.0, 2), "collective='all_reduce'"),
    (lambda: bus_bandwidth("gather", 1.0, 1.0, 2), "collective='gather'"),
    (lambda: bus_bandwidth("allreduce", 1.0, 0.0, 2), "seconds=0.0"),
    (lambda: bus_bandwidth("allreduce", -1.0, 1.0, 2), "nbytes"),
    (lambda: bus_bandwidth("allreduce", 1.0, 1.0, 0), "world_size"),
    (lambda: fit_alpha_beta([1.0], [1.0], 2), "at least two"),
    (lambda: fit_alpha_beta([1, 1], [1, 2], 2), "more than one size"),
    (lambda: fit_alpha_beta([1, 2], [1, 2], 1), "world_size=1"),
    (lambda: fit_alpha_beta([1e6, 2e6], [1e-3, math.nan], 2), r"seconds\[1\]=nan"),
    (lambda: fit_alpha_beta([1e6, math.inf], [1e-3, 2e-3], 2), r"nbytes\[1\]=inf"),
    (lambda: fit_alpha_beta([1e6, 2e6], [-1e-3, 2e-3], 2), r"seconds\[0\]=-0.001"),
    (lambda: fit_alpha_beta([0, 2e6], [1e-3, 2e-3], 2), r"nbytes\[0\]=0: pass a finite number > 0"),
    (lambda: fit_alpha_beta([1e6, 2e6], [True, 2e-3], 2), r"seconds\[0\]=True"),
    (lambda: fit_alpha_beta([1e6, 1e6, 1e6], [1e-3, 2e-3, 3e-3], 2), "more than one size"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("call, match", [
    (lambda: fit_alpha_beta(5, [1.0], 2), "nbytes=5: pass a list of numbers, not an int"),
    (lambda: fit_alpha_beta("12", [1.0, 2.0], 2), "nbytes='12'"),
    (lambda: fit_alpha_beta([1e6, 2e6], {1e-3: 1, 2e-3: 2}, 2), "seconds=.* not a dict"),
    (lambda: fit_alpha_beta([1e6, None], [1e-3, 2e-3], 2), r"nbytes\[1\]=None"),
    (lambda: ring_allreduce_bytes("14e9", 8), "nbytes='14e9'"),
    (lambda: allreduce_seconds(1.0, 2, None), "bandwidth=None"),
    (lambda: allreduce_seconds(1.0, "8", 1e9), "world_size='8'"),
])
def test_wrong_types(call, match):
    with pytest.raises(TypeError, match=match):
        call()


@pytest.mark.parametrize("tensors, numel, cap_numel, buckets",
                         [(12, 1000, 4000, 3), (10, 1000, 3500, 3), (7, 300, 1000, 2), (5, 64, 64, 5)])
def test_ddp_bucket_count_against_the_buckets_ddp_builds(tensors, numel, cap_numel, buckets):
    # torch DDP (and labkit's BucketedDDP) never split a tensor and close a bucket with the tensor that takes it
    # to the cap or past it (10 x 1000 in 3500: 4 per bucket, 3 buckets), so every bucket but the last holds at
    # least the cap: the formula's ceil(S / cap) is an upper bound, reached when the tensor size divides the cap
    import torch

    from labkit.parallel.data import pack_buckets
    params = [(str(i), torch.nn.Parameter(torch.zeros(numel))) for i in range(tensors)]
    cap = cap_numel * 4
    built = len(pack_buckets(params, cap, cap))
    formula = ddp_bucket_count(tensors * numel * 4, bucket_mb=cap / 2**20)
    assert built == buckets and built <= formula
    assert formula == built or cap_numel % numel != 0


def test_ddp_bucket_count_is_no_bound_with_a_small_first_bucket():
    # torch's defaults cap one bucket at 1 MiB and the rest at 25 MiB: the count can then be one more than
    # ceil(S / cap), here 10 tensors of 100 numbers, a first bucket of 100 and then 500 (3 buckets, not 2)
    import torch

    from labkit.parallel.data import pack_buckets
    params = [(str(i), torch.nn.Parameter(torch.zeros(100))) for i in range(10)]
    built = len(pack_buckets(params, 500 * 4, 100 * 4))
    assert built == 3 == ddp_bucket_count(1000 * 4, bucket_mb=500 * 4 / 2**20) + 1
    first, rest = 2**20, 25 * 2**20                                  # the 7B's 14 GB under torch's defaults
    assert ddp_bucket_count(14e9) == 535 and 1 + math.ceil((14e9 - first) / rest) == 536


@pytest.mark.parametrize("numels, cap_numel, first_cap_numel", [
    ([150] * 5, 250, 250), ([150] * 5, 250, 150), ([150] * 5, 250, 125), ([150] * 5, 250, 300),
    ([10, 500, 20, 30, 40, 700, 5, 5, 5], 100, 30), ([64] * 9, 64, 64), ([1000, 1, 1, 1000, 1], 500, 1)])
def test_the_buckets_are_torch_ddps(numels, cap_numel, first_cap_numel):
    # the same tensors, in the same order, bucketed by torch's own function (the one DDP calls, torch 2.13)
    import torch
    import torch.distributed as dist

    from labkit.parallel.data import pack_buckets
    tensors = [torch.zeros(n) for n in numels]
    theirs, _ = dist._compute_bucket_assignment_by_size(tensors, [first_cap_numel * 4, cap_numel * 4])
    ours = pack_buckets([(str(i), torch.nn.Parameter(t)) for i, t in enumerate(tensors)], cap_numel * 4,
                        first_cap_numel * 4)
    assert [[int(name) for name in bucket.names] for bucket in ours] == theirs


def test_the_buckets_are_torch_ddps_with_two_dtypes():
    # one bucket sequence per dtype, each with its own small first bucket, in the order their first tensors come
    import torch
    import torch.distributed as dist

    from labkit.parallel.data import pack_buckets
    dtypes = [torch.float32, torch.float64, torch.float32, torch.float64, torch.float32, torch.float32, torch.float64]
    tensors = [torch.zeros(100, dtype=dtype) for dtype in dtypes]
    theirs, _ = dist._compute_bucket_assignment_by_size(tensors, [500, 900])
    ours = pack_buckets([(str(i), torch.nn.Parameter(t)) for i, t in enumerate(tensors)], 900, 500)
    assert [[int(name) for name in bucket.names] for bucket in ours] == theirs == [[0, 2], [1], [3, 6], [4, 5]]


def test_ddp_bucket_count_rejects_an_empty_bucket():
    assert ddp_bucket_count(0) == 0
    with pytest.raises(ValueError, match="bucket_mb"):
        ddp_bucket_count(1e9, bucket_mb=0)
