"""ZeRO's memory per device by stage (the paper's figure 1) and its traffic per step against DDP's."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from labkit.plan import (
    ZERO_STAGES,
    ring_allreduce_bytes,
    training_memory,
    zero_collective_bytes_per_param,
    zero_memory_table,
    zero_redundancy_optimizer_bytes,
    zero_traffic_bytes,
)


def test_the_zero_papers_figure_1():
    # Rajbhandari et al. 2020, figure 1: 7.5B parameters, N_d = 64, K = 12: 120 GB -> 31.4 / 16.6 / 1.9 GB
    table = zero_memory_table(7.5e9, dp=64)
    assert list(table) == [0, 1, 2, 3] == list(ZERO_STAGES)
    assert [round(memory["total"] / 1e9, 1) for memory in table.values()] == [120.0, 31.4, 16.6, 1.9]
    assert table[1] == pytest.approx({"weights": 15e9, "grads": 15e9, "optimizer": 12 * 7.5e9 / 64,
                                      "total": 4 * 7.5e9 + 12 * 7.5e9 / 64})


def test_each_stage_is_training_memory_with_the_same_byte_counts():
    table = zero_memory_table(1e9, 8, weight_bytes=2, grad_bytes=4, optimizer_bytes=12)
    for stage, memory in table.items():
        assert memory == training_memory(1e9, 2, 4, 12, zero_stage=stage, dp=8)


def test_zero_1_and_2_move_what_ddp_moves_and_zero_3_half_as_much_again():
    ddp = ring_allreduce_bytes(7e9 * 2, 8)                   # the lesson's 24.5 GB of bf16 gradients
    traffic = [zero_traffic_bytes(7e9, 8, zero_stage=stage) for stage in range(4)]
    assert traffic == pytest.approx([ddp, ddp, ddp, 1.5 * ddp])


def test_torchs_zero_redundancy_optimizer_sends_half_as_much_again_as_ddp():
    # DDP's all-reduce, then every parameter broadcast from its owner: (N-1)/N of the weights per rank on a ring
    for world_size in (2, 4, 8, 64):
        ddp = zero_traffic_bytes(7e9, world_size, zero_stage=0)
        torch_zero1 = zero_redundancy_optimizer_bytes(7e9, world_size)
        assert torch_zero1 == pytest.approx(1.5 * ddp) == pytest.approx(zero_traffic_bytes(7e9, world_size, 3))
        assert torch_zero1 == pytest.approx(ddp + (world_size - 1) / world_size * 14e9)
        assert zero_traffic_bytes(7e9, world_size, zero_stage=1) == pytest.approx(ddp)   # the paper's ZeRO-1
    assert zero_redundancy_optimizer_bytes(7e9, 8) == pytest.approx(36.75e9)
    # fp32 gradients, bf16 weights: 2 x 4 + 2 bytes per parameter before the ring's (N-1)/N
    assert zero_redundancy_optimizer_bytes(1e9, 4, weight_bytes=2, grad_bytes=4) == pytest.approx(0.75 * 10e9)
    assert zero_redundancy_optimizer_bytes(1e9, 1) == 0.0


def test_what_each_collective_carries():
    # fp32 gradients with bf16 weights (Megatron-LM's distributed optimizer): ZeRO-1 moves less than DDP
    assert zero_collective_bytes_per_param(0, weight_bytes=2, grad_bytes=4) == 8
    assert zero_collective_bytes_per_param(1, weight_bytes=2, grad_bytes=4) == 6
    assert zero_collective_bytes_per_param(3, weight_bytes=2, grad_bytes=4) == 8
    assert zero_traffic_bytes(3, 3, zero_stage=2, weight_bytes=1, grad_bytes=1) == pytest.approx(2 / 3 * 3 * 2)


@given(params=st.floats(1e3, 1e12), world_size=st.integers(2, 1024), stage=st.integers(0, 3))
def test_traffic_stays_below_the_collectives_bytes_and_one_rank_sends_nothing(params, world_size, stage):
    carried = params * zero_collective_bytes_per_param(stage)
    assert zero_traffic_bytes(params, world_size, stage) < carried
    assert zero_traffic_bytes(params, 1, stage) == 0


@pytest.mark.parametrize("call, match", [
    (lambda: zero_memory_table(7e9, dp=0), "dp=0"),
    (lambda: zero_memory_table(-1, dp=8), "params=-1"),
    (lambda: zero_memory_table(7e9, 8, optimizer_bytes=math.nan), "optimizer_bytes=nan"),
    (lambda: zero_collective_bytes_per_param(4), r"zero_stage=4: pass 0 \(no sharding\), 1, 2 or 3"),
    (lambda: zero_collective_bytes_per_param(-1), "zero_stage=-1"),
    (lambda: zero_collective_bytes_per_param(1, weight_bytes=-2), "weight_bytes=-2"),
    (lambda: zero_traffic_bytes(7e9, 0), "world_size=0"),
    (lambda: zero_traffic_bytes(1e308, 4, zero_stage=3), r"zero_traffic_bytes\(params=1e\+308, .* overflows"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("call, match", [
    (lambda: zero_memory_table("7B", 8), "params='7B'"),
    (lambda: zero_collective_bytes_per_param("3"), "zero_stage='3'"),
    (lambda: zero_traffic_bytes(7e9, 8, zero_stage=None), "zero_stage=None"),
])
def test_wrong_types(call, match):
    with pytest.raises(TypeError, match=match):
        call()
