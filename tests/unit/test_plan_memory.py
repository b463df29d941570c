"""Training memory with ZeRO, LoRA's trainable parameters, and a transformer's parameter count."""

import math
from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from labkit.plan import attention_lora_shapes, lora_params, memory_options, training_memory, transformer_params


def test_lesson_seven_b_needs_112_gb():
    memory = training_memory(7.0e9)
    assert memory == pytest.approx({"weights": 14e9, "grads": 14e9, "optimizer": 84e9, "total": 112e9})


@pytest.mark.parametrize("dp", [1, 2, 8, 64])
def test_zero_stages_per_parameter(dp):
    # Rajbhandari et al. 2020, figure 1: 16, 4 + 12/N, 2 + 14/N, 16/N bytes per parameter
    expected = {0: 16, 1: 4 + 12 / dp, 2: 2 + 14 / dp, 3: 16 / dp}
    assert {s: training_memory(1, zero_stage=s, dp=dp)["total"] for s in expected} == pytest.approx(expected)


def test_zero_shards_the_named_parts_only():
    stage2 = training_memory(1e9, zero_stage=2, dp=4)
    assert stage2 == pytest.approx({"weights": 2e9, "grads": 0.5e9, "optimizer": 3e9, "total": 5.5e9})


def test_other_conventions_are_other_byte_counts():
    assert training_memory(1, grad_bytes=4)["total"] == 18                # fp32 grads (Megatron-LM)
    assert training_memory(1, optimizer_bytes=16)["total"] == 20          # DeepSpeed's estimator


@given(params=st.floats(1e6, 1e12), dp=st.integers(1, 1024))
def test_zero3_times_dp_is_the_unsharded_total_and_stages_only_shrink(params, dp):
    totals = [training_memory(params, zero_stage=s, dp=dp)["total"] for s in range(4)]
    assert totals[3] * dp == pytest.approx(totals[0])
    assert all(later <= earlier * (1 + 1e-12) for earlier, later in zip(totals, totals[1:], strict=False))


def test_lora_counts_both_factors():
    assert lora_params([(4096, 4096)], rank=8) == 8 * 4096 + 8 * 4096
    assert lora_params([(10, 20), (30, 5)], rank=2) == (10 * 2 + 2 * 20) + (30 * 2 + 2 * 5)
    assert lora_params(((3, 3),), rank=3) == 18


@given(shapes=st.lists(st.tuples(st.integers(16, 4096), st.integers(16, 4096)), min_size=1, max_size=8),
       rank=st.integers(1, 16))
def test_lora_is_linear_in_rank_and_far_smaller_than_full(shapes, rank):
    assert lora_params(shapes, rank) == rank * lora_params(shapes, 1)
    assert lora_params(shapes, 1) <= sum(d_in * d_out for d_in, d_out in shapes)


def test_gpt2_small_and_medium_match_their_published_counts():
    # Hugging Face's gpt2 and gpt2-medium report these; nanoGPT prints 123.65M, leaving out the positions
    assert transformer_params(50257, 768, 12, 3072, context=1024) == 124_439_808
    assert transformer_params(50257, 768, 12, 3072) == 124_439_808 - 1024 * 768
    assert transformer_params(50257, 1024, 24, 4096, context=1024) == 354_823_168


def test_a_tiny_transformer_by_hand():
    # vocab 10, d 4, d_ff 8, one layer: embedding 40; layer: 2 norms 16, qkv 48 + 12, proj 16 + 4,
    # mlp 32 + 8 and 32 + 4; final norm 8
    assert transformer_params(10, 4, 1, 8) == 40 + (16 + 60 + 20 + 40 + 36) + 8
    assert transformer_params(10, 4, 1, 8, bias=False) == 40 + (16 + 48 + 16 + 32 + 32) + 8
    assert transformer_params(10, 4, 1, 8, context=3, tied_embeddings=False) == 220 + 12 + 40
    assert transformer_params(10, 4, 3, 8) - transformer_params(10, 4, 2, 8) == 172


@pytest.mark.parametrize("call, match", [
    (lambda: training_memory(-1), "params=-1"),
    (lambda: training_memory(math.inf), "params=inf"),
    (lambda: training_memory(1, weight_bytes=-2), "weight_bytes=-2"),
    (lambda: training_memory(1, grad_bytes=math.nan), "grad_bytes=nan"),
    (lambda: training_memory(1, optimizer_bytes=True), "optimizer_bytes=True"),
    (lambda: training_memory(1, zero_stage=4), "zero_stage=4"),
    (lambda: training_memory(1, zero_stage=-1), "zero_stage=-1"),
    (lambda: training_memory(1, zero_stage=1.0), "zero_stage=1.0"),
    (lambda: training_memory(1, dp=0), "dp=0"),
    (lambda: lora_params([(8, 8)], rank=0), "rank=0"),
    (lambda: lora_params([(8, 4)], rank=5), r"rank=5 exceeds min\(d_in, d_out\) = 4"),
    (lambda: lora_params([], rank=1), r"shapes=\[\]"),
    (lambda: lora_params([(1, 2, 3)], rank=1), r"shapes: \(1, 2, 3\)"),
    (lambda: lora_params([8], rank=1), "shapes: 8"),
    (lambda: lora_params([(0, 4)], rank=1), "shapes d_in=0"),
    (lambda: lora_params([(4, -4)], rank=1), "shapes d_out=-4"),
    (lambda: transformer_params(0, 4, 1, 8), "vocab=0"),
    (lambda: transformer_params(10, True, 1, 8), "d_model=True"),
    (lambda: transformer_params(10, 4, -1, 8), "layers=-1"),
    (lambda: transformer_params(10, 4, 1, 8.0), "d_ff=8.0"),
    (lambda: transformer_params(10, 4, 1, 8, context=0), "context=0"),
    (lambda: training_memory(10**400), r"params=10\*\*400 is too large to compute with \(over 1.8e308\)"),
    (lambda: training_memory(Decimal("1e400")), r"params=Decimal\('1E\+400'\) is too large"),
    (lambda: training_memory(1.7e308), r"training_memory\(params=1.7e\+308, weight_bytes=2, .*\) overflows"),
    (lambda: training_memory(1e300, optimizer_bytes=1e10), r"optimizer_bytes=10000000000.0, .* overflows"),
    (lambda: lora_params([(10**400, 8)], rank=1), r"shapes d_in=10\*\*400 is too large"),
    (lambda: lora_params([(8, 4)], rank=5), r"of \(8, 4\) in shapes"),
    (lambda: transformer_params(10**200, 10**200, 1, 8), r"transformer_params\(vocab=10\*\*200, .* overflows"),
    (lambda: attention_lora_shapes(4096, 10**6), "layers=1000000: pass at most 10,000"),
    (lambda: memory_options(7e9, 8, lora_rank=4097), "lora_rank=4097 exceeds d_model=4096"),
    (lambda: memory_options(7e9, 8, layers=10**300), r"layers=10\*\*300"),
    (lambda: memory_options(1e307, 8, lora_rank=8, optimizer_bytes=15),
     r"memory_options\(params=1e\+307, .* overflows"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("call, match", [
    (lambda: lora_params(0, rank=1), r"shapes=0: pass a list of \(d_in, d_out\) pairs, not an int"),
    (lambda: lora_params("(8, 8)", rank=1), r"shapes='\(8, 8\)'"),
    (lambda: lora_params({(8, 8)}, rank=1), r"shapes=\{\(8, 8\)\}: .* not a set"),
    (lambda: lora_params([(8, 8)], rank="2"), "rank='2'"),
    (lambda: training_memory(None), "params=None: pass a finite number >= 0, not a NoneType"),
    (lambda: training_memory("7B"), "params='7B'"),
    (lambda: training_memory(7e9, dp=[8]), r"dp=\[8\]"),
    (lambda: transformer_params(10, 4, 1, 8, tied_embeddings="yes"), "tied_embeddings='yes': pass True or False"),
    (lambda: transformer_params(10, 4, 1, 8, bias=1), "bias=1: pass True or False"),
])
def test_wrong_types(call, match):
    with pytest.raises(TypeError, match=match):
        call()


def test_fractions_and_decimals_are_numbers():
    assert training_memory(Fraction(7 * 10**9)) == training_memory(7e9)
    assert training_memory(Decimal("7e9"), weight_bytes=Fraction(1, 2))["weights"] == 3.5e9


def test_memory_options_on_a_model_narrower_than_the_default_lora_rank():
    options = memory_options(1e6, 2, d_model=8, layers=2)
    assert options["LoRA r=8"]["grads"] == 2 * 8 * (8 + 8) * 4 * 2    # r = d_model, not 16


def test_memory_options_are_the_lessons_ways_out():
    from labkit.plan import YOUR_CHOICE, memory_options

    options = memory_options(7e9, devices=8, lora_rank=16)
    adapters = 16 * (4096 + 4096) * 4 * 32  # rank x (d_in + d_out), q k v o, 32 layers
    assert options["replicated"]["total"] == 112e9
    assert options["ZeRO-2 over 8"]["total"] == pytest.approx((2 + 14 / 8) * 7e9)
    assert options["LoRA r=16"] == pytest.approx({"weights": 2 * (7e9 + adapters), "grads": 2 * adapters,
                                                  "optimizer": 12 * adapters, "total": 2 * 7e9 + 16 * adapters})
    assert options["TP x PP over 8"]["total"] == pytest.approx(14e9)
    assert options[YOUR_CHOICE] == options["LoRA r=16"]


def test_memory_options_your_choice_combines_zero_and_lora():
    from labkit.plan import YOUR_CHOICE, memory_options

    assert memory_options(1e9, 4, zero_stage=3)[YOUR_CHOICE]["total"] == pytest.approx(16e9 / 4)
    combined = memory_options(1e9, 4, lora_rank=8, zero_stage=3, d_model=1024, layers=4)[YOUR_CHOICE]
    adapters = 8 * 2048 * 4 * 4
    assert combined["total"] == pytest.approx((2e9 + 16 * adapters) / 4)
    with pytest.raises(ValueError, match="lora_rank"):
        memory_options(1e9, 4, lora_rank=-1)
