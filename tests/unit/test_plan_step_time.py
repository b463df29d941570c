"""Step time, data-parallel speedup, and the bandwidth where the lesson's "8x becomes 3x", with one model of
overlap: the AllReduce hides behind the last micro-batch's backward only (2/3 of its compute)."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from labkit.plan import (
    bandwidth_for_speedup,
    data_parallel_speedup,
    hideable_seconds,
    step_seconds,
    tokens_to_hide_allreduce,
)

LESSON_TRAFFIC = 24.5e9  # bytes per rank per step: 7e9 BF16 gradients on 8 ranks


def test_step_seconds_adds_the_exposed_communication():
    assert step_seconds(1.0, 0.5) == 1.5
    assert step_seconds(1.0, 0.5, overlap=0.8) == pytest.approx(1.1)
    assert step_seconds(1.0, 0.5, overlap=1.0) == 1.0
    assert step_seconds(2.0, 0.0) == 2.0


def test_only_the_last_micro_batchs_backward_hides_communication():
    assert hideable_seconds(1.0) == pytest.approx(2 / 3)                       # backward: 4 of 6 FLOPs
    assert hideable_seconds(1.0, accumulation_steps=2) == pytest.approx(1 / 3)  # the lesson's step: 2 micro-batches
    # 0.8 x 4 s would hide 3.2 s: only the 2/3 s of backward can hide it, the forward cannot
    assert step_seconds(1.0, 4.0, overlap=0.8) == pytest.approx(1.0 + 4.0 - 2 / 3)
    assert step_seconds(1.0, 4.0, overlap=0.0) == 5.0
    assert step_seconds(1.0, 2.0, overlap=1.0, accumulation_steps=2) == pytest.approx(1.0 + 2.0 - 1 / 3)
    assert step_seconds(1.0, 0.2, overlap=1.0, accumulation_steps=2) == 1.0    # 0.2 s fits in the last 1/3 s


def test_a_pipeline_stage_reduces_during_the_drain():
    # stage r of 1F1B idles r backwards of the last micro-batch after its own: the AllReduce's rest runs there
    backward = hideable_seconds(13.0, accumulation_steps=192)                  # one micro-batch's backward
    stage_0 = step_seconds(13.0, 0.2, overlap=1.0, accumulation_steps=192)
    stage_7 = step_seconds(13.0, 0.2, overlap=1.0, accumulation_steps=192, drain_seconds=7 * backward)
    assert stage_0 == pytest.approx(13.0 + 0.2 - backward) and stage_7 == 13.0
    # the drain hides what is left after the overlapped part, not more
    assert step_seconds(1.0, 1.0, overlap=0.5, drain_seconds=0.25) == pytest.approx(1.0 + 1.0 - 0.5 - 0.25)


def test_speedup_without_and_with_communication():
    assert data_parallel_speedup(8, 1.0, 0.0) == 8.0
    assert data_parallel_speedup(8, 1.0, 1.0) == 4.0
    assert data_parallel_speedup(8, 1.0, 1.0, overlap=0.5) == pytest.approx(8 / 1.5)


def test_lesson_eight_x_becomes_three_x_at_14_7_gb_per_s():
    bandwidth = bandwidth_for_speedup(3, 8, 1.0, LESSON_TRAFFIC)
    assert bandwidth == pytest.approx(24.5e9 / (8 / 3 - 1)) and bandwidth == pytest.approx(14.7e9)
    assert data_parallel_speedup(8, 1.0, LESSON_TRAFFIC / 14.7e9) == pytest.approx(3.0)


def test_overlap_lowers_the_bandwidth_needed():
    # allowed step 8/3 s: exposed 5/3 s; with 20 % hidden comm may last 5/3 / 0.8 s (0.42 s hidden < 2/3 s)
    assert bandwidth_for_speedup(3, 8, 1.0, LESSON_TRAFFIC, overlap=0.2) == pytest.approx(24.5e9 * 0.8 / (5 / 3))
    # with half hidden, 10/3 s of comm would hide 5/3 s: more than the 2/3 s of backward, so comm = 5/3 + 2/3 s
    assert bandwidth_for_speedup(3, 8, 1.0, LESSON_TRAFFIC, overlap=0.5) == pytest.approx(24.5e9 / (7 / 3))


def test_the_lessons_numbers_with_accumulation_two():
    # issue 25: with 2 micro-batches only the last one's backward, 1/3 s, can hide the AllReduce
    needs = {target: bandwidth_for_speedup(target, 8, 1.0, LESSON_TRAFFIC, overlap=1.0, accumulation_steps=2)
             for target in (3, 6, 8)}
    assert needs[3] == pytest.approx(12.25e9) and needs[6] == pytest.approx(36.75e9)   # 24.5 / 2 s, 24.5 / (2/3) s
    assert needs[8] == pytest.approx(73.5e9)                                             # all of it in 1/3 s
    assert bandwidth_for_speedup(3, 8, 1.0, LESSON_TRAFFIC, accumulation_steps=2) == pytest.approx(14.7e9)
    assert bandwidth_for_speedup(6, 8, 1.0, LESSON_TRAFFIC) == pytest.approx(73.5e9)   # nothing hidden: 1/3 s exposed


def test_the_full_speedup_needs_an_infinite_link_unless_all_is_hidden():
    assert bandwidth_for_speedup(8, 8, 1.0, LESSON_TRAFFIC) == math.inf
    assert bandwidth_for_speedup(8, 8, 1.0, LESSON_TRAFFIC, overlap=0.9) == math.inf   # the last 10 % shows
    assert bandwidth_for_speedup(8, 8, 1.0, LESSON_TRAFFIC, overlap=1.0) == pytest.approx(LESSON_TRAFFIC / (2 / 3))
    assert bandwidth_for_speedup(8, 8, 1.0, 0.0) == 0.0


@given(devices=st.integers(2, 1024), share=st.floats(0.05, 0.95), compute=st.floats(0.01, 100),
       nbytes=st.floats(1e3, 1e12), overlap=st.floats(0, 1), accumulation=st.integers(1, 64))
def test_the_bandwidth_found_gives_the_target_back(devices, share, compute, nbytes, overlap, accumulation):
    target = share * devices
    bandwidth = bandwidth_for_speedup(target, devices, compute, nbytes, overlap, accumulation)
    speedup = data_parallel_speedup(devices, compute, nbytes / bandwidth, overlap, accumulation)
    assert speedup == pytest.approx(target, rel=1e-9)


@given(compute=st.floats(0.01, 100), nbytes=st.floats(1e3, 1e12), bandwidth=st.floats(1e6, 1e12),
       faster=st.floats(1.01, 100), overlap=st.floats(0, 1), accumulation=st.integers(1, 64))
def test_more_bandwidth_never_slows_a_step(compute, nbytes, bandwidth, faster, overlap, accumulation):
    slow = step_seconds(compute, nbytes / bandwidth, overlap, accumulation)
    fast = step_seconds(compute, nbytes / (bandwidth * faster), overlap, accumulation)
    assert fast <= slow
    # never below the compute, nor below the communication that the backward cannot hide
    comm = nbytes / (bandwidth * faster)
    assert compute <= fast and comm + compute - hideable_seconds(compute, accumulation) <= fast * (1 + 1e-12)


@given(flops=st.floats(1e12, 1e16), bandwidth=st.floats(1e9, 1e12), devices=st.integers(2, 1024),
       accumulation=st.integers(1, 64), params=st.floats(1e6, 1e12))
def test_the_token_condition_is_the_time_condition(flops, bandwidth, devices, accumulation, params):
    # at exactly that many tokens per GPU per step, the AllReduce lasts as long as the last micro-batch's backward
    tokens = tokens_to_hide_allreduce(flops, bandwidth, devices, accumulation)
    compute = 6 * params * tokens / flops                                    # forward + backward of the step
    comm = 2 * (devices - 1) / devices * 2 * params / bandwidth               # BF16 gradients, ring
    assert comm == pytest.approx(hideable_seconds(compute, accumulation), rel=1e-9)
    assert step_seconds(compute, comm, overlap=1.0, accumulation_steps=accumulation) == pytest.approx(compute)


def test_the_token_condition_in_numbers():
    assert tokens_to_hide_allreduce(500e12, 50e9, 8) == pytest.approx(10_000 * 7 / 8)
    assert tokens_to_hide_allreduce(500e12, 50e9, 8, accumulation_steps=2) == pytest.approx(2 * 10_000 * 7 / 8)
    assert tokens_to_hide_allreduce(500e12, 50e9, 8, gradient_bytes_per_param=4) == pytest.approx(2 * 8750)


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
    (lambda: step_seconds(1.0, 0.5, accumulation_steps=0), "accumulation_steps=0"),
    (lambda: step_seconds(1.0, 0.5, drain_seconds=-1.0), "drain_seconds=-1.0"),
    (lambda: bandwidth_for_speedup(3, 8, 1.0, 1e9, accumulation_steps=1.5), "accumulation_steps=1.5"),
    (lambda: tokens_to_hide_allreduce(0.0, 50e9, 8), "flops_per_second=0.0"),
    (lambda: tokens_to_hide_allreduce(1e15, 50e9, 0), "devices=0"),
    (lambda: step_seconds(1.7e308, 1.7e308), r"step_seconds\(compute_seconds=1.7e\+308, comm_seconds=1.7e\+308\)"),
    (lambda: data_parallel_speedup(8, 1.0, 10**400), r"comm_seconds=10\*\*400 is too large"),
    # 1e308 s of compute: the AllReduce's allowed 5/3 x 1e308 + 2/3 x 1e308 s overflow (it used to give 0.0 bytes/s)
    (lambda: bandwidth_for_speedup(3, 8, 1e308, 1e9, overlap=0.5),
     r"bandwidth_for_speedup\(.*compute_seconds=1e\+308"),
    (lambda: bandwidth_for_speedup(2, 8, 1e308, 1e9), r"bandwidth_for_speedup\(.*compute_seconds=1e\+308"),
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
