"""Effective batch, steps per epoch and learning-rate scaling, with the lesson's numbers."""

import math
from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from labkit.plan import effective_batch, scale_lr, steps_per_epoch

counts = st.integers(1, 512)


def test_lesson_batches_and_steps():
    assert effective_batch(8, 1, 2) == 16 and steps_per_epoch(40_000, 16) == 2_500          # Step 1
    assert effective_batch(8, 8, 2) == 128 and steps_per_epoch(40_000, 128) == 313         # Step 2: 312.5 up
    assert effective_batch(8, 1, 16) == 128                                                  # Step 5: 8 x 1 x 16


def test_accumulation_defaults_to_one_and_steps_round_up():
    assert effective_batch(32, 4) == 128
    assert [steps_per_epoch(e, 5) for e in (1, 5, 6, 10, 11)] == [1, 1, 2, 2, 3]


@given(batch=counts, devices=counts, accumulation=counts)
def test_accumulation_and_devices_are_interchangeable(batch, devices, accumulation):
    assert effective_batch(batch, devices * accumulation, 1) == effective_batch(batch, devices, accumulation)
    assert effective_batch(batch, devices, accumulation) == batch * devices * accumulation


@given(examples=st.integers(1, 10**9), batch=st.integers(1, 10**6))
def test_steps_cover_the_epoch_once(examples, batch):
    steps = steps_per_epoch(examples, batch)
    assert (steps - 1) * batch < examples <= steps * batch


def test_learning_rate_rules():
    assert scale_lr(0.1, 256, 8192) == pytest.approx(3.2)                 # Goyal et al.: 0.1 x kn / 256
    assert scale_lr(1e-4, 16, 128, rule="linear") == pytest.approx(8e-4)  # the lesson's 8x batch
    assert scale_lr(1e-4, 16, 128, rule="sqrt") == pytest.approx(1e-4 * 2 * math.sqrt(2))
    assert scale_lr(1e-3, 128, 32, rule="sqrt") == pytest.approx(5e-4)    # shrinking the batch too


@given(lr=st.floats(1e-6, 1.0), old=counts, new=counts)
def test_sqrt_rule_is_the_geometric_mean_of_keeping_and_linear(lr, old, new):
    assert scale_lr(lr, old, new, "sqrt") ** 2 == pytest.approx(lr * scale_lr(lr, old, new, "linear"))
    assert scale_lr(scale_lr(lr, old, new), new, old) == pytest.approx(lr)


@pytest.mark.parametrize("call, match", [
    (lambda: effective_batch(0, 8), "per_device_batch=0"),
    (lambda: effective_batch(8, 0), "devices=0"),
    (lambda: effective_batch(8, True), "devices=True"),
    (lambda: effective_batch(8, 2.0), "devices=2.0"),
    (lambda: effective_batch(8, 8, -1), "accumulation_steps=-1"),
    (lambda: steps_per_epoch(0, 16), "examples=0"),
    (lambda: steps_per_epoch(100, 0), "effective_batch=0"),
    (lambda: scale_lr(0.0, 16, 128), "lr=0.0"),
    (lambda: scale_lr(-1e-3, 16, 128), "lr=-0.001"),
    (lambda: scale_lr(1e-3, 0, 128), "old_batch=0"),
    (lambda: scale_lr(1e-3, 16, math.nan), "new_batch=nan"),
    (lambda: scale_lr(1e-3, 16, 128, rule="cubic"), "rule='cubic'"),
    (lambda: scale_lr(1e-3, 16, 128, rule=None), "rule=None"),
    (lambda: effective_batch(8, 10**400), r"devices=10\*\*400 is too large to compute with \(over 1.8e308\)"),
    (lambda: effective_batch(10**200, 10**200), r"effective_batch\(per_device_batch=10\*\*200, devices=10\*\*200"),
    (lambda: steps_per_epoch(-(10**400), 16), r"examples=-10\*\*400: pass a whole number >= 1"),
    (lambda: scale_lr(1e-4, 5e-324, 1e308), r"scale_lr\(lr=0.0001, old_batch=5e-324, new_batch=1e\+308\) overflows"),
    (lambda: scale_lr(1e-3, 16, 128, rule=["sqrt"]), r"rule=\['sqrt'\]"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("call, match", [
    (lambda: effective_batch("8", 8), "per_device_batch='8': pass a whole number >= 1 .*not a str"),
    (lambda: steps_per_epoch(None, 16), "examples=None"),
    (lambda: scale_lr(1e-3, [16], 128), r"old_batch=\[16\]"),
])
def test_wrong_types(call, match):
    with pytest.raises(TypeError, match=match):
        call()


def test_fractions_and_decimals_are_numbers():
    assert scale_lr(Fraction(1, 10_000), Decimal(16), 128) == pytest.approx(8e-4)
    with pytest.raises(ValueError, match=r"devices=Fraction\(8, 1\): pass a whole number"):
        effective_batch(8, Fraction(8))
