"""Training memory with ZeRO, LoRA's trainable parameters, and a transformer's parameter count."""

import math
from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from labkit.plan import (
    activation_nbytes,
    attention_lora_shapes,
    lora_params,
    memory_options,
    tp_in_node,
    training_memory,
    transformer_params,
)


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


# Activations (Korthikanti et al. 2022): s tokens, b sequences, width h, a heads, L layers, 16-bit values
LLAMA_7B = {"layers": 32, "d_model": 4096, "heads": 32}


def test_the_7b_micro_batch_of_8_by_2048_keeps_73_gb_without_recomputation_and_4_3_with_full():
    sbhl = 2048 * 8 * 4096 * 32
    assert activation_nbytes(**LLAMA_7B, sequence=2048, micro_batch=8) == 34 * sbhl == 73_014_444_032
    assert activation_nbytes(**LLAMA_7B, sequence=2048, micro_batch=8, recompute="full") == 2 * sbhl
    # without flash attention the scores come back: sbh(34 + 5as/h), 5 x 32 x 2048 / 4096 = 80 more
    assert activation_nbytes(**LLAMA_7B, sequence=2048, micro_batch=8, flash_attention=False) == (34 + 80) * sbhl


shapes = st.fixed_dictionaries({"layers": st.integers(1, 96), "heads": st.sampled_from([1, 2, 4, 8, 16, 32, 64]),
                                "head_dim": st.sampled_from([16, 64, 128]), "sequence_per_rank": st.integers(1, 512),
                                "micro_batch": st.integers(1, 16), "t": st.sampled_from([1, 2, 4, 8])})


@given(shape=shapes)
def test_activations_follow_the_papers_equations_1_to_3_and_table_2(shape):
    t, L, a, b = shape["t"], shape["layers"], shape["heads"] * shape["t"], shape["micro_batch"]
    h, s = a * shape["head_dim"], shape["sequence_per_rank"] * shape["t"]
    sbh = s * b * h

    def kept(**kw):
        return activation_nbytes(L, h, a, s, b, flash_attention=False, **kw)
    # relative 1e-12: the formula and the check add the same terms in another order, in float64
    assert kept() == pytest.approx(L * sbh * (34 + 5 * a * s / h), rel=1e-12)                       # equation 1
    assert kept(tp=t) == pytest.approx(L * sbh * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-12)     # equation 2
    assert kept(tp=t, sequence_parallel=True) == pytest.approx(L * sbh * (34 / t + 5 * a * s / (h * t)), rel=1e-12)
    assert kept(tp=t, recompute="selective") == pytest.approx(L * sbh * (10 + 24 / t), rel=1e-12)    # Table 2
    assert kept(tp=t, recompute="selective", sequence_parallel=True) == pytest.approx(L * sbh * 34 / t, rel=1e-12)
    assert kept(tp=t, recompute="full") == 2 * sbh * L
    assert activation_nbytes(L, h, a, s, b, tp=t) == kept(tp=t, recompute="selective")   # flash keeps no scores


@given(shape=shapes, sequence_parallel=st.booleans(), flash=st.booleans())
def test_recomputation_and_sequence_parallelism_only_shrink_and_everything_scales_with_batch_and_depth(
        shape, sequence_parallel, flash):
    t, L, a, b = shape["t"], shape["layers"], shape["heads"] * shape["t"], shape["micro_batch"]
    h, s = a * shape["head_dim"], shape["sequence_per_rank"] * shape["t"]

    def kept(recompute="none", layers=L, micro_batch=b, split=sequence_parallel):
        return activation_nbytes(layers, h, a, s, micro_batch, recompute, t, split, flash)
    assert kept("full") <= kept("selective") <= kept("none")
    assert kept(split=True) <= kept(split=False)
    assert kept(layers=2 * L) == pytest.approx(2 * kept(), rel=1e-12)
    assert kept(micro_batch=3 * b) == pytest.approx(3 * kept(), rel=1e-12)


def test_other_layouts_are_other_byte_counts():
    # float32 values without dropout: the 16 sbh numbers each block keeps, at 4 bytes (notebook 09 measures them),
    # and without flash attention the softmax output, a s^2 b numbers, once
    s, b, h, a = 32, 8, 64, 4
    assert activation_nbytes(2, h, a, s, b, bytes_per_value=4, dropout=False) == 2 * 16 * 4 * s * b * h
    assert activation_nbytes(2, h, a, s, b, bytes_per_value=4, dropout=False, flash_attention=False) == \
        2 * 4 * (16 * s * b * h + a * s * s * b)
    assert activation_nbytes(2, h, a, s, b, recompute="full", bytes_per_value=4) == 2 * 4 * s * b * h


def test_training_memory_counts_activations_only_when_given():
    assert set(training_memory(7e9)) == {"weights", "grads", "optimizer", "total"}
    memory = training_memory(7e9, zero_stage=1, dp=8, activations_nbytes=73e9)
    assert memory == pytest.approx({"weights": 14e9, "grads": 14e9, "optimizer": 10.5e9, "activations": 73e9,
                                    "total": 111.5e9})
    assert training_memory(7e9, activations_nbytes=0)["total"] == 112e9


def test_memory_options_add_each_ways_activations_to_its_total():
    before = memory_options(7e9, 8, lora_rank=16)
    after = memory_options(7e9, 8, lora_rank=16, sequence=2048, micro_batch=8, accumulation_steps=2)
    assert all("activations" not in option for option in before.values()) and list(after) == list(before)
    per_replica = activation_nbytes(**LLAMA_7B, sequence=2048, micro_batch=8)
    for name, option in after.items():
        assert option["total"] == pytest.approx(before[name]["total"] + option["activations"], rel=1e-12)
        if name != "TP x PP over 8":
            assert option["activations"] == per_replica      # ZeRO shards no activations
    # TP 8 x PP 1 inside one node: equation 2's sbh(10 + 24/8) per layer; with sequence parallelism 34/8
    sbhl = 2048 * 8 * 4096 * 32
    assert after["TP x PP over 8"]["activations"] == 13 * sbhl
    split = memory_options(7e9, 8, sequence=2048, micro_batch=8, sequence_parallel=True)
    assert split["TP x PP over 8"]["activations"] == 34 / 8 * sbhl
    assert split["ZeRO-1 over 8"] == after["ZeRO-1 over 8"]          # no tensor parallelism there: nothing to split
    full = memory_options(7e9, 8, sequence=2048, micro_batch=8, recompute="full")
    assert round(full["ZeRO-1 over 8"]["total"] / 1e9, 2) == 42.79 and full["replicated"]["total"] > 112e9


def test_a_pipelines_first_stage_holds_its_layers_for_each_micro_batch_in_flight():
    # 64 GPUs: TP 8 inside a node, PP 8; 32 layers, 4 per stage; 1F1B keeps min(pp, m) micro-batches in flight
    per_layer = activation_nbytes(1, 4096, 32, 2048, 1, tp=8)
    for m, in_flight in ((1, 1), (2, 2), (8, 8), (16, 8)):
        option = memory_options(7e9, 64, sequence=2048, accumulation_steps=m)["TP x PP over 64"]
        assert option["activations"] == pytest.approx(in_flight * 4 * per_layer, rel=1e-12)


def test_tensor_parallelism_stays_inside_a_node_with_whole_heads():
    assert [tp_in_node(n, 32) for n in (1, 2, 6, 8, 12, 16, 64)] == [1, 2, 2, 8, 4, 8, 8]
    assert tp_in_node(8, 12) == 4 and tp_in_node(8, 7) == 1 and tp_in_node(16, 32, gpus_per_node=16) == 16


@pytest.mark.parametrize("call, match", [
    (lambda: activation_nbytes(32, 4096, 32, 2048, 8, recompute="some"), "recompute='some': use one of 'none'"),
    (lambda: activation_nbytes(32, 4096, 32, 2048, 8, tp=3), "tp=3: 32 heads do not split over 3"),
    (lambda: activation_nbytes(32, 4096, 32, 2050, 8, tp=4, sequence_parallel=True), "sequence=2050: .* tp=4"),
    (lambda: activation_nbytes(0, 4096, 32, 2048, 8), "layers=0"),
    (lambda: activation_nbytes(32, 4096, 32, 2048, 8, bytes_per_value=-2), "bytes_per_value=-2"),
    (lambda: training_memory(7e9, activations_nbytes=-1), "activations_nbytes=-1"),
    (lambda: memory_options(7e9, 8, sequence=2048, recompute="partial"), "recompute='partial'"),
    (lambda: memory_options(7e9, 8, sequence=0), "sequence=0"),
    (lambda: memory_options(7e9, 8, sequence=2048, accumulation_steps=0), "accumulation_steps=0"),
])
def test_bad_activation_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_activation_flags_are_flags():
    with pytest.raises(TypeError, match="sequence_parallel=1: pass True or False"):
        activation_nbytes(32, 4096, 32, 2048, 8, sequence_parallel=1)
    with pytest.raises(TypeError, match="flash_attention='yes'"):
        memory_options(7e9, 8, sequence=2048, flash_attention="yes")
