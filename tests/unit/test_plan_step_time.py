"""Step time, data-parallel speedup, and the bandwidth where the lesson's "8x becomes 3x"."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from labkit.plan import bandwidth_for_speedup, data_parallel_speedup, step_seconds

LESSON_TRAFFIC = 24.5e9  # bytes per rank per step: 7e9 BF16 gradients on 8 ranks


def test_step_seconds_adds_the_exposed_communication():
    assert step_seconds(1.0, 0.5) == 1.5
    assert step_seconds(1.0, 0.5, overlap=0.8) == pytest.approx(1.1)
    assert step_seconds(1.0, 0.5, overlap=1.0) == 1.0
    assert step_seconds(2.0, 0.0) == 2.0


def test_a_step_never_beats_its_communication():
    # 0.8 x 4 s would hide 3.2 s behind 1 s of compute: impossible, the link sets the pace
    assert step_seconds(1.0, 4.0, overlap=0.8) == 4.0
    assert step_seconds(1.0, 4.0, overlap=0.0) == 5.0


def test_speedup_without_and_with_communication():
    assert data_parallel_speedup(8, 1.0, 0.0) == 8.0
    assert data_parallel_speedup(8, 1.0, 1.0) == 4.0
    assert data_parallel_speedup(8, 1.0, 1.0, overlap=0.5) == pytest.approx(8 / 1.5)


def test_lesson_eight_x_becomes_three_x_at_14_7_gb_per_s():
    bandwidth = bandwidth_for_speedup(3, 8, 1.0, LESSON_TRAFFIC)
    assert bandwidth == pytest.approx(24.5e9 / (8 / 3 - 1)) and bandwidth == pytest.approx(14.7e9)
    assert data_parallel_speedup(8, 1.0, LESSON_TRAFFIC / 14.7e9) == pytest.approx(3.0)


def test_overlap_lowers_the_bandwidth_needed():
    # allowed step 8/3 s: exposed 5/3 s; with 20 % hidden comm may last 5/3 / 0.8 s
    assert bandwidth_for_speedup(3, 8, 1.0, LESSON_TRAFFIC, overlap=0.2) == pytest.approx(24.5e9 * 0.8 / (5 / 3))
    # with half hidden, 10/3 s of comm would outlast the 8/3 s step, so the step's length is the limit
    assert bandwidth_for_speedup(3, 8, 1.0, LESSON_TRAFFIC, overlap=0.5) == pytest.approx(24.5e9 * 3 / 8)


def test_the_full_speedup_needs_an_infinite_link_unless_all_is_hidden():
    assert bandwidth_for_speedup(8, 8, 1.0, LESSON_TRAFFIC) == math.inf
    assert bandwidth_for_speedup(8, 8, 1.0, LESSON_TRAFFIC, overlap=1.0) == pytest.approx(LESSON_TRAFFIC / 1.0)
    assert bandwidth_for_speedup(8, 8, 1.0, 0.0) == 0.0


@given(devices=st.integers(2, 1024), share=st.floats(0.05, 0.95), compute=st.floats(0.01, 100),
       nbytes=st.floats(1e3, 1e12), overlap=st.floats(0, 1))
def test_the_bandwidth_found_gives_the_target_back(devices, share, compute, nbytes, overlap):
    target = share * devices
    bandwidth = bandwidth_for_speedup(target, devices, compute, nbytes, overlap)
    assert data_parallel_speedup(devices, compute, nbytes / bandwidth, overlap) == pytest.approx(target, rel=1e-9)


@given(compute=st.floats(0.01, 100), nbytes=st.floats(1e3, 1e12), bandwidth=st.floats(1e6, 1e12),
       faster=st.floats(1.01, 100), overlap=st.floats(0, 1))
def test_more_bandwidth_never_slows_a_step(compute, nbytes, bandwidth, faster, overlap):
    slow = step_seconds(compute, nbytes / bandwidth, overlap)
    fast = step_seconds(compute, nbytes / (bandwidth * faster), overlap)
    assert fast <= slow
    assert compute <= fast and nbytes / (bandwidth * faster) <= fast


@pytest.mark.parametrize("call, match", [
    (lambda: step_seconds(-1.0, 0.5), "compute_seconds=-1.0"),
    (lambda: step_seconds(1.0, -0.5), "comm_seconds=-0.5"),
    (lambda: step_seconds(1.0, 0.5, overlap=1.5), "overlap=1.5"),
    (lambda: step_seconds(1.0, 0.5, overlap=-0.1), "overlap=-0.1"),
    (lambda: step_seconds(1.0, 0.5, overlap=True), "overlap=True"),
    (lambda: data_parallel_speedup(0, 1.0, 0.5), "devices=0"),
    (lambda: data_parallel_speedup(8, 0.0, 0.5), "compute_seconds=0.0"),
    (lambda: data_parallel_speedup(8, 1.0, math.nan), "comm_seconds=nan"),
    (lambda: bandwidth_for_speedup(9, 8, 1.0, 1e9), "target_speedup=9 exceeds devices=8"),
    (lambda: bandwidth_for_speedup(0, 8, 1.0, 1e9), "target_speedup=0"),
    (lambda: bandwidth_for_speedup(3, 0, 1.0, 1e9), "devices=0"),
    (lambda: bandwidth_for_speedup(3, 8, 0.0, 1e9), "compute_seconds=0.0"),
    (lambda: bandwidth_for_speedup(3, 8, 1.0, -1.0), "nbytes_per_rank=-1.0"),
    (lambda: bandwidth_for_speedup(3, 8, 1.0, 1e9, overlap=2), "overlap=2"),
    (lambda: step_seconds(1.7e308, 1.7e308), r"step_seconds\(compute_seconds=1.7e\+308, comm_seconds=1.7e\+308\)"),
    (lambda: data_parallel_speedup(8, 1.0, 10**400), r"comm_seconds=10\*\*400 is too large"),
    # 8 x 1e308 / 3 s per step: the allowed step overflows (it used to give 0.0 bytes/s)
    (lambda: bandwidth_for_speedup(3, 8, 1e308, 1e9), r"bandwidth_for_speedup\(.*compute_seconds=1e\+308"),
    (lambda: bandwidth_for_speedup(3, 8, 1e-10, 1e308), r"nbytes_per_rank=1e\+308.* overflows"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_huge_but_computable_inputs_give_finite_answers():
    assert data_parallel_speedup(10**300, 1.0, 0.0) == pytest.approx(1e300)
    assert data_parallel_speedup(8, 1e300, 1e300) == pytest.approx(4.0)


@pytest.mark.parametrize("call, match", [
    (lambda: step_seconds(None, 0.5), "compute_seconds=None"),
    (lambda: step_seconds(1.0, 0.5, overlap="half"), "overlap='half'"),
    (lambda: data_parallel_speedup([8], 1.0, 0.5), r"devices=\[8\]"),
    (lambda: bandwidth_for_speedup(3j, 8, 1.0, 1e9), "target_speedup=3j.*not a complex"),
])
def test_wrong_types(call, match):
    with pytest.raises(TypeError, match=match):
        call()
