"""The pipeline bubble (labkit.plan.bubble), GPipe's and the interleaved schedule's."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from labkit.plan import bubble_fraction

stages, micro, chunks = st.integers(1, 64), st.integers(1, 4096), st.integers(1, 8)


def test_gpipe_by_hand():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(8, 32) == pytest.approx(7 / 39)
    assert bubble_fraction(2, 1) == pytest.approx(1 / 2)   # one micro-batch: each stage idles half the time
    assert bubble_fraction(1, 5) == 0.0


def test_interleaving_divides_the_bubble_over_ideal_by_the_chunks():
    # bubble / ideal = (p-1)/(v m) = 3/16, so bubble / total = (3/16) / (1 + 3/16) = 3/19
    assert bubble_fraction(4, 8, chunks=2) == pytest.approx(3 / 19)


@given(p=stages, m=micro, v=chunks)
def test_share_of_total_matches_narayanans_ratio_to_ideal(p, m, v):
    over_ideal = (p - 1) / (v * m)
    assert bubble_fraction(p, m, v) == pytest.approx(over_ideal / (1 + over_ideal))
    assert 0 <= bubble_fraction(p, m, v) < 1


@given(p=st.integers(2, 64), m=micro, v=chunks)
def test_more_microbatches_or_chunks_shrink_the_bubble(p, m, v):
    assert bubble_fraction(p, m + 1, v) < bubble_fraction(p, m, v)
    assert bubble_fraction(p, m, v + 1) < bubble_fraction(p, m, v)
    assert bubble_fraction(p + 1, m, v) > bubble_fraction(p, m, v)


@given(p=stages)
def test_the_bubble_vanishes_with_many_microbatches(p):
    assert bubble_fraction(p, 10**9) < p * 1e-9


@pytest.mark.parametrize("call, match", [
    (lambda: bubble_fraction(0, 8), "stages=0"),
    (lambda: bubble_fraction(2.5, 8), "stages=2.5"),
    (lambda: bubble_fraction(4, 0), "microbatches=0"),
    (lambda: bubble_fraction(4, True), "microbatches=True"),
    (lambda: bubble_fraction(4, 8, chunks=0), "chunks=0"),
    (lambda: bubble_fraction(10**400, 8), r"stages=10\*\*400 is too large to compute with"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_huge_counts_still_give_a_share():
    assert bubble_fraction(10**300, 10**300) == pytest.approx(0.5)


@pytest.mark.parametrize("call, match", [
    (lambda: bubble_fraction("4", 8), "stages='4'"),
    (lambda: bubble_fraction(4, None), "microbatches=None"),
])
def test_wrong_types(call, match):
    with pytest.raises(TypeError, match=match):
        call()
