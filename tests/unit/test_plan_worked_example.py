"""The lesson's worked 7B example, Steps 1-6, recomputed; overrides; the printed table."""

import dataclasses
import math
from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

import labkit.plan
from labkit.plan import WorkedExample, worked_example

CONTRACT = ["effective_batch", "steps_per_epoch", "ring_allreduce_bytes", "naive_allreduce_bytes",
            "allreduce_seconds", "bus_bandwidth", "training_memory", "lora_params", "bubble_fraction", "scale_lr",
            "step_seconds", "worked_example", "data_parallel_speedup", "bandwidth_for_speedup", "transformer_params"]


def test_the_package_exports_the_contract():
    assert set(CONTRACT) <= set(labkit.plan.__all__)
    functions = [name for name in labkit.plan.__all__ if not name.isupper()]  # constants are named in capitals
    assert functions and all(callable(getattr(labkit.plan, name)) for name in functions)


def test_steps_one_and_two():
    example = worked_example()
    assert (example.baseline_batch, example.baseline_steps) == (16, 2_500)
    assert example.baseline_epoch_seconds == 2_500.0 and round(2_500 / 60, 1) == 41.7
    assert (example.parallel_batch, example.parallel_steps) == (128, 313)
    assert example.parallel_epoch_seconds_no_comm == 313.0 and round(313 / 60, 1) == 5.2
    assert example.speedup_no_comm == pytest.approx(2_500 / 313)


def test_step_three_traffic_and_the_slow_link():
    example = worked_example()
    assert example.gradient_bytes == 14.0e9
    assert example.ring_bytes_per_rank == pytest.approx(24.5e9)
    assert example.bandwidth_for_slow_link_speedup == pytest.approx(14.7e9)
    assert example.comm_seconds is example.parallel_step_seconds is example.speedup is None


def test_step_three_with_a_bandwidth():
    example = worked_example(bandwidth=14.7e9)
    assert example.comm_seconds == pytest.approx(5 / 3)               # 24.5 GB / 14.7 GB/s
    assert example.parallel_step_seconds == pytest.approx(8 / 3)
    assert example.parallel_epoch_seconds == pytest.approx(313 * 8 / 3)
    assert example.speedup == pytest.approx(2_500 / (313 * 8 / 3))  # 3x, less the rounding of 312.5 steps
    hidden = worked_example(bandwidth=49e9, overlap=0.5)              # 0.5 s of comm, half hidden
    assert hidden.parallel_step_seconds == pytest.approx(1.25)


def test_steps_four_to_six():
    example = worked_example()
    assert example.batch_growth == 8.0
    assert (example.lr_factor_linear, example.lr_factor_sqrt) == pytest.approx((8.0, math.sqrt(8)))
    assert (example.accumulation_alternative_steps, example.accumulation_alternative_batch) == (16, 128)
    # 16 micro-batches of 0.5 s each (a 1.0 s step holds 2), 313 steps per epoch
    assert example.accumulation_alternative_step_seconds == 8.0
    assert example.accumulation_alternative_epoch_seconds == 313 * 8.0
    assert example.accumulation_alternative_slowdown == pytest.approx(8.0)
    assert example.memory_bytes == 112e9


@given(batch=st.integers(1, 64), devices=st.integers(1, 64), accumulation=st.integers(1, 16))
def test_accumulation_reaches_the_data_parallel_batch(batch, devices, accumulation):
    example = worked_example(per_device_batch=batch, devices=devices, accumulation_steps=accumulation)
    assert example.accumulation_alternative_batch == example.parallel_batch == batch * devices * accumulation


def test_overrides_change_the_scenario():
    four = worked_example(devices=4, params=1e9)
    assert (four.parallel_batch, four.parallel_steps, four.gradient_bytes) == (64, 625, 2e9)
    assert four.ring_bytes_per_rank == pytest.approx(2 * 2e9 * 3 / 4)
    assert worked_example(devices=3).bandwidth_for_slow_link_speedup is None
    assert worked_example() == WorkedExample()


@pytest.mark.parametrize("overrides, match", [
    ({"gpus": 8}, "gpus: not a scenario field"),
    ({"devices": 0}, "devices=0"),
    ({"examples": 1.5}, "examples=1.5"),
    ({"params": -7e9}, "params=-7000000000.0"),
    ({"step_compute_seconds": 0}, "step_compute_seconds=0"),
    ({"bytes_per_param": math.nan}, "bytes_per_param=nan"),
    ({"bandwidth": 0}, "bandwidth=0"),
    ({"overlap": 2}, "overlap=2"),
    ({"params": 10**400}, r"params=10\*\*400 is too large to compute with \(over 1.8e308\)"),
    # the overflow names the scenario's fields, not ring_allreduce_bytes' nbytes
    ({"params": 1.7e308}, r"WorkedExample.gradient_bytes\(params=1.7e\+308, gradient_bytes_per_param=2.0\)"),
    ({"params": 6e307}, r"WorkedExample.ring_bytes_per_rank\(params=6e\+307, gradient_bytes_per_param=2.0, devices=8"),
    ({"devices": 10**308}, r"WorkedExample.parallel_batch\(per_device_batch=8, devices=10\*\*308"),
    ({"examples": 10**300, "step_compute_seconds": 1e10}, r"WorkedExample.baseline_epoch_seconds\(examples=10\*\*300"),
    ({"bandwidth": 5e-324}, r"WorkedExample.comm_seconds\(.*bandwidth=5e-324\)"),
    ({"step_compute_seconds": 5e-324}, r"WorkedExample.bandwidth_for_slow_link_speedup\(.*step_compute_seconds=5e-324"),
    ({"bytes_per_param": 1e299}, r"WorkedExample.memory_bytes\(params=7000000000.0, bytes_per_param=1e\+299\)"),
])
def test_bad_overrides(overrides, match):
    with pytest.raises(ValueError, match=match):
        worked_example(**overrides)


@pytest.mark.parametrize("overrides, match", [
    ({"devices": "8"}, "devices='8'"),
    ({"params": None}, "params=None"),
    ({"bandwidth": "fast"}, "bandwidth='fast'"),
])
def test_wrong_types(overrides, match):
    with pytest.raises(TypeError, match=match):
        worked_example(**overrides)


def test_fractions_and_decimals_are_stored_as_floats_and_print():
    exact = worked_example(params=Fraction(7 * 10**9), overlap=Fraction(1, 2), bandwidth=Decimal("14.7e9"))
    assert exact == worked_example(params=7e9, overlap=0.5, bandwidth=14.7e9)
    assert type(exact.params) is float and exact.table() == worked_example(overlap=0.5, bandwidth=14.7e9).table()


def test_it_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        worked_example().devices = 4


def test_the_table_shows_every_step_next_to_the_lesson():
    text = str(worked_example())
    assert text == worked_example().table()
    lines = text.splitlines()
    assert lines[0].split() == ["step", "quantity", "value", "lesson"]
    assert {line.split()[0] for line in lines[1:]} == {"1", "2", "3", "4", "5", "6"}
    for expected in ("2,500 s (41.7 min)", "313 s (5.2 min)", "24.5 GB", "14.7 GB/s", "112.0 GB", "2,504 s"):
        assert expected in text
    assert "with comm" not in text
    assert "speedup, with comm" in str(worked_example(bandwidth=14.7e9))


def test_the_table_layout_is_the_lessons():
    """labkit.tables.text_table, no rule under the header, no trailing spaces: notebook 08 shows these lines."""
    lines = worked_example().table().splitlines()
    assert lines[:3] == ["step  quantity                                value               lesson",
                         "1     effective batch, 1 GPU                  16                  8 x 1 x 2 = 16",
                         "1     steps per epoch                         2,500               40,000 / 16 = 2,500"]
    assert lines[-1] == "6     weights + grads + Adam state            112.0 GB            16 bytes/param ~ 112 GB"
    assert all(line == line.rstrip() for line in lines)
