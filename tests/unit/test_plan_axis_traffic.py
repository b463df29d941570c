"""labkit.plan.axis_traffic without processes: the layers and parameters each rank of a dp x pp x tp layout holds
(the pipeline's cut, transformer_params' count), the bytes per axis worked out by hand for a small GPT (plain
tensor parallelism, sequence parallelism, interleaving), the ring's wire bytes, and the layouts refused.
tests/distributed/test_three_d.py checks the same predictions against bytes counted on real ranks."""

import math
import re
from collections import Counter

import pytest

from labkit.parallel import mesh_layout, stage_layers
from labkit.plan import (
    GPTShape,
    ParallelLayout,
    axis_traffic,
    axis_wire_bytes,
    check_fit,
    rank_layers,
    rank_params,
    transformer_params,
)
from labkit.plan.axis_traffic import LOSS_BYTES_PER_NUMBER

SMALL = GPTShape(vocab=10, d_model=4, layers=2, heads=2, context=8)  # d_ff 16
TINY_GPT = GPTShape(vocab=82, d_model=32, layers=2, heads=4, context=32)  # labkit.models.TinyGPT, untied


@pytest.mark.parametrize("layers, pp, chunks", [(2, 1, 1), (2, 2, 1), (2, 4, 1), (3, 2, 1), (5, 3, 1), (2, 2, 2),
                                                (6, 2, 2), (7, 2, 3)])
def test_each_stage_holds_the_layers_the_pipeline_runs(layers, pp, chunks):
    shape = GPTShape(vocab=10, d_model=4, layers=layers, heads=2, context=8)
    layout = ParallelLayout(pp=pp, chunks=chunks, tp=2)
    pieces = stage_layers(layers + 2, pp, chunks)  # what run_pipeline runs on each stage
    for rank in range(layout.world_size):
        stage = layout.place(rank)["pp"]
        assert rank_layers(shape, layout, rank) == [pieces[c * pp + stage] for c in range(chunks)]


@pytest.mark.parametrize("dp, pp, tp", [(1, 1, 1), (2, 2, 2), (1, 4, 1), (3, 1, 4), (1, 2, 8)])
def test_a_rank_sits_where_the_mesh_puts_it(dp, pp, tp):
    layout = ParallelLayout(dp=dp, pp=pp, tp=tp)
    assert [layout.place(rank) for rank in range(layout.world_size)] == \
        [place.coordinate for place in mesh_layout(dp * pp * tp, dp, pp, tp)]


def replicated(shape, layers_held):
    """Parameters every tp rank holds whole, for the layers given: LayerNorms, row-parallel biases, positions."""
    h = shape.d_model
    kinds = ["embeddings" if i == 0 else "head" if i == shape.layers + 1 else "block" for i in layers_held]
    return sum({"embeddings": shape.context * h, "block": 6 * h, "head": 2 * h}[kind] for kind in kinds)


SHAPES = [TINY_GPT, GPTShape(vocab=82, d_model=32, layers=3, heads=4, context=32, d_ff=130),
          GPTShape(vocab=82, d_model=32, layers=2, heads=4, context=32, tied=True)]


@pytest.mark.parametrize("shape, pp, tp", [(shape, pp, tp) for shape in SHAPES
                                           for pp, tp in [(1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 4)]
                                           if pp == 1 or not shape.tied])  # a tied head: on the embedding's stage
def test_the_ranks_of_one_replica_hold_the_model_once_and_the_replicated_parts_tp_times(shape, pp, tp):
    """82 characters over 4 ranks: 21, 21, 20, 20 rows; d_ff 130 over 4: 33, 33, 32, 32."""
    layout = ParallelLayout(pp=pp, tp=tp)
    whole_model = transformer_params(shape.vocab, shape.d_model, shape.layers, shape.d_ff, shape.context,
                                     tied_embeddings=shape.tied)
    held = sum(rank_params(shape, layout, rank) for rank in range(layout.world_size))
    assert held == whole_model + (tp - 1) * replicated(shape, range(shape.layers + 2))
    dp = ParallelLayout(dp=2, pp=pp, tp=tp)  # a second replica holds the same again
    assert [rank_params(shape, dp, rank) for rank in range(dp.world_size)] == \
        [rank_params(shape, layout, rank) for rank in range(layout.world_size)] * 2


def test_plain_tensor_parallelism_by_hand():
    """SMALL on dp=2 x pp=2 x tp=2, 2 micro-batches of b=2 sequences of s=8: a = b s h = 64 numbers, 4 bytes."""
    layout, a = ParallelLayout(dp=2, pp=2, tp=2, microbatches=2), 2 * 8 * 4
    first, last = axis_traffic(SMALL, layout, batch=8, rank=0), axis_traffic(SMALL, layout, batch=8, rank=3)
    # stage 0, embeddings and block 1: 1 + 4 all-reduces of a per micro-batch; activations forward
    assert first["tp"] == {"all_reduce": 2 * (1 + 4) * a * 4}
    assert first["pp"] == {"send": 2 * a * 4}
    # stage 1, block 2 and the head: 4 + 1 all-reduces, the logits' 5 of 10 columns gathered; gradients back
    assert last["tp"] == {"all_reduce": 2 * (4 + 1) * a * 4, "all_gather": 2 * 2 * 8 * 5 * 4}
    assert last["pp"] == {"send": 2 * a * 4}
    # dp: the stage's gradients and one flag per parameter tensor (embeddings 2, a block 12, the head 3)
    assert first["dp"] == {"all_reduce": (rank_params(SMALL, layout, 0) + 2 + 12) * 4}
    assert last["dp"] == {"all_reduce": (rank_params(SMALL, layout, 3) + 12 + 3) * 4}


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_zero_on_the_dp_axis_by_hand(zero_stage):
    """ShardedOptimizer's one bucket of the stage's P numbers: a reduce-scatter of dp x ceil(P / dp), padded so that
    each slice travels at the largest's size, and an all-gather of ceil(P / dp); no flags. The other axes as
    without ZeRO, and a size-1 dp axis moves nothing."""
    for dp in (2, 4):  # SMALL's stages hold 186 and 162 numbers: 4 ranks get 47, 47, 46, 46 and 41, 41, 40, 40
        plain = ParallelLayout(dp=dp, pp=2, tp=2, microbatches=2)
        zero = ParallelLayout(dp=dp, pp=2, tp=2, microbatches=2, zero_stage=zero_stage)
        for rank in (0, 3):
            params = rank_params(SMALL, zero, rank)
            piece = math.ceil(params / dp)
            traffic = axis_traffic(SMALL, zero, batch=dp * 4, rank=rank)
            assert traffic["dp"] == {"reduce_scatter": dp * piece * 4, "all_gather": piece * 4}, (dp, rank)
            assert {axis: traffic[axis] for axis in ("pp", "tp")} == \
                {axis: axis_traffic(SMALL, plain, batch=dp * 4, rank=rank)[axis] for axis in ("pp", "tp")}
    assert params % 4 and piece * 4 > params  # the uneven case pads
    one = ParallelLayout(pp=2, tp=2, microbatches=2, zero_stage=zero_stage)
    assert axis_traffic(SMALL, one, batch=4, rank=0)["dp"] == {}


def test_zero_sends_what_the_all_reduce_sends_up_to_the_padding_and_flags():
    """On the wire a reduce-scatter and an all-gather are an all-reduce (Rajbhandari et al. 2020, section 7.2.1):
    ZeRO's dp bytes are BucketedDDP's less its flags, plus at most dp - 1 padding numbers per collective."""
    for dp in (2, 4):
        plain = ParallelLayout(dp=dp, pp=2, tp=2, microbatches=2)
        zero = ParallelLayout(dp=dp, pp=2, tp=2, microbatches=2, zero_stage=1)
        for rank in range(0, dp * 4, 3):
            params, tensors = rank_params(TINY_GPT, zero, rank), 14 if rank % 4 < 2 else 15
            ddp = axis_wire_bytes(axis_traffic(TINY_GPT, plain, 16, rank), plain)["dp"]
            ours = axis_wire_bytes(axis_traffic(TINY_GPT, zero, 16, rank), zero)["dp"]
            flags = 2 * (dp - 1) / dp * tensors * 4
            assert ddp - flags <= ours <= ddp - flags + 2 * (dp - 1) * 4, (dp, rank, params)


def test_sequence_parallelism_by_hand():
    """The same with sequence parallelism: a / t = 32 numbers per rank's part of the sequence."""
    layout, a = ParallelLayout(dp=2, pp=2, tp=2, microbatches=2, sequence_parallel=True), 2 * 8 * 4
    first, last = axis_traffic(SMALL, layout, batch=8, rank=0), axis_traffic(SMALL, layout, batch=8, rank=3)
    h, part, logits = 4, a // 2, 2 * 8 * 5
    assert first["tp"] == {"reduce_scatter": 2 * (1 + 4) * a * 4, "all_gather": 2 * (1 + 6) * part * 4,
                           "all_reduce": (8 * h + 6 * h) * 4}  # once a step: positions and block 1's 6 h
    assert last["tp"] == {"reduce_scatter": 2 * (4 + 1) * a * 4, "all_gather": 2 * (6 * part + 2 * part + logits) * 4,
                          "all_reduce": (6 * h + 2 * h) * 4}
    assert first["pp"] == last["pp"] == {"send": 2 * part * 4}  # each tp rank sends its part only


def test_megatrons_scatter_gather_sends_a_tth_across_the_boundary_by_hand():
    """Narayanan et al. 2021, section 4.1: each tp rank sends a / t, and the receiver's tp group all-gathers the
    parts; labkit's executor sends the whole a from every tp rank (the default)."""
    plain = ParallelLayout(dp=2, pp=2, tp=2, microbatches=2)
    scattered = ParallelLayout(dp=2, pp=2, tp=2, microbatches=2, scatter_gather=True)
    a = 2 * 8 * 4
    for rank in (0, 3):
        ours, theirs = axis_traffic(SMALL, plain, 8, rank), axis_traffic(SMALL, scattered, 8, rank)
        assert ours["pp"] == {"send": 2 * a * 4} and theirs["pp"] == {"send": 2 * (a // 2) * 4}
        # one message received per micro-batch: its two halves all-gathered over tp
        assert theirs["tp"] == dict(Counter(ours["tp"]) + Counter({"all_gather": 2 * (a // 2) * 4})), rank
        assert theirs["dp"] == ours["dp"]
        wire_ours, wire_theirs = axis_wire_bytes(ours, plain), axis_wire_bytes(theirs, scattered)
        assert wire_theirs["pp"] == wire_ours["pp"] / 2          # t = 2: half the bytes across the boundary
        assert wire_theirs["tp"] - wire_ours["tp"] == 2 * (a // 2) * 4   # the gathers, on the node's links
    # interleaved: three messages per micro-batch on each stage, each gathered
    chunks = ParallelLayout(pp=2, tp=2, microbatches=4, chunks=2, scatter_gather=True)
    assert axis_traffic(SMALL, chunks, 8, 0)["tp"]["all_gather"] == 3 * 4 * (2 * 8 * 4 // 2) * 4
    # under sequence parallelism the activation is already split: scatter/gather changes nothing
    sequence = ParallelLayout(dp=2, pp=2, tp=2, microbatches=2, sequence_parallel=True)
    both = ParallelLayout(dp=2, pp=2, tp=2, microbatches=2, sequence_parallel=True, scatter_gather=True)
    assert all(axis_traffic(SMALL, sequence, 8, r) == axis_traffic(SMALL, both, 8, r) for r in range(8))
    # one stage, or one tp rank: nothing to scatter
    assert axis_traffic(SMALL, ParallelLayout(tp=2, scatter_gather=True), 8, 0) == \
        axis_traffic(SMALL, ParallelLayout(tp=2), 8, 0)
    assert axis_traffic(SMALL, ParallelLayout(pp=2, scatter_gather=True), 8, 0) == \
        axis_traffic(SMALL, ParallelLayout(pp=2), 8, 0)


def test_megatrons_vocabulary_parallel_loss_moves_b_s_numbers_by_hand():
    """Shoeybi et al. 2019, section 3: the head's logits stay split by vocabulary, and the loss all-reduces three
    numbers per token (max, target logit, sum of exponentials) instead of all-gathering ceil(V / t) per token."""
    for sequence_parallel in (False, True):
        gathered = ParallelLayout(dp=2, pp=2, tp=2, microbatches=2, sequence_parallel=sequence_parallel)
        split = ParallelLayout(dp=2, pp=2, tp=2, microbatches=2, sequence_parallel=sequence_parallel,
                               vocab_parallel_loss=True)
        tokens, logits = 2 * 8, 2 * 8 * 5                   # b s per micro-batch; 5 of SMALL's 10 columns each
        last, last_split = axis_traffic(SMALL, gathered, 8, 3)["tp"], axis_traffic(SMALL, split, 8, 3)["tp"]
        assert last["all_gather"] - last_split.get("all_gather", 0) == 2 * logits * 4
        assert last_split["all_reduce"] - last.get("all_reduce", 0) == 2 * 3 * tokens * 4
        assert axis_traffic(SMALL, gathered, 8, 0) == axis_traffic(SMALL, split, 8, 0)   # no head on stage 0
    assert "all_gather" not in axis_traffic(SMALL, ParallelLayout(tp=2, vocab_parallel_loss=True), 8, 0)["tp"]
    # the loss's numbers are FP32 whatever the model's (Megatron's VocabParallelCrossEntropy: logits.float())
    tokens = 8 * 8                                         # one micro-batch of all 8 sequences, 8 tokens each
    for nbytes in (2, 4, 8):
        split_tp = axis_traffic(SMALL, ParallelLayout(tp=2, vocab_parallel_loss=True), 8, 0, bytes_per_number=nbytes)
        plain_tp = axis_traffic(SMALL, ParallelLayout(tp=2), 8, 0, bytes_per_number=nbytes)
        assert split_tp["tp"]["all_reduce"] - plain_tp["tp"]["all_reduce"] == 3 * tokens * LOSS_BYTES_PER_NUMBER == 768


def test_interleaving_sends_between_more_pieces():
    """pp=2 x 2 chunks: 4 pieces of one layer; stage 0 holds pieces 0 and 2, stage 1 pieces 1 and 3. Forward:
    every piece but 3; backward: every piece but 0. Three messages per micro-batch on each stage."""
    layout = ParallelLayout(pp=2, microbatches=4, chunks=2)
    sends = [axis_traffic(SMALL, layout, batch=8, rank=rank)["pp"] for rank in range(2)]
    assert sends == [{"send": 3 * 4 * 2 * 8 * 4 * 4}] * 2
    assert rank_layers(SMALL, layout, 0) == [range(0, 1), range(2, 3)]


def test_a_size_one_axis_moves_nothing():
    traffic = axis_traffic(TINY_GPT, ParallelLayout(microbatches=4), batch=16, rank=0)
    assert traffic == {"dp": {}, "pp": {}, "tp": {}}
    assert axis_wire_bytes(traffic, ParallelLayout()) == {"dp": 0.0, "pp": 0.0, "tp": 0.0}


def test_the_step_scales_with_the_batch_and_the_number_size():
    layout = ParallelLayout(dp=2, pp=2, tp=2, microbatches=2)
    small = axis_traffic(TINY_GPT, layout, batch=16, rank=2, bytes_per_number=4)
    double = axis_traffic(TINY_GPT, layout, batch=32, rank=2, bytes_per_number=8)
    assert double["dp"] == {"all_reduce": 2 * small["dp"]["all_reduce"]}  # gradients: the numbers' size only
    assert double["pp"] == {"send": 4 * small["pp"]["send"]}
    assert double["tp"] == {kind: 4 * n for kind, n in small["tp"].items()}


def test_wire_bytes_are_the_rings():
    layout = ParallelLayout(dp=4, pp=2, tp=8)
    traffic = {"dp": {"all_reduce": 800.0}, "pp": {"send": 300.0},
               "tp": {"all_reduce": 80.0, "reduce_scatter": 80.0, "all_gather": 10.0}}
    assert axis_wire_bytes(traffic, layout) == {"dp": 2 * 3 / 4 * 800, "pp": 300.0,
                                                "tp": 2 * 7 / 8 * 80 + 7 / 8 * 80 + 7 * 10}


def test_sequence_parallelism_moves_the_gathers_again_on_the_wire():
    """On the wire an all-reduce is a reduce-scatter and an all-gather (Korthikanti et al. 2022), so sequence
    parallelism's tp bytes are plain tensor parallelism's, plus the inputs gathered again in the backward (2 per
    block, 1 for the head), plus the step's all-reduce of the sequence-sharded gradients."""
    plain = ParallelLayout(tp=4, microbatches=2)
    sp = ParallelLayout(tp=4, microbatches=2, sequence_parallel=True)
    wire = {layout.sequence_parallel: axis_wire_bytes(axis_traffic(TINY_GPT, layout, 8, 0), layout)["tp"]
            for layout in (plain, sp)}
    part = (8 // 2) * (32 // 4) * 32 * 4  # a micro-batch's (b, s / t, h) in float32 bytes: b = 8 / 2 micro-batches
    again = 2 * (2 * TINY_GPT.layers + 1) * 3 * part  # micro-batches x gathers x (N-1) parts
    gradients = (32 * 32 + 6 * 32 * TINY_GPT.layers + 2 * 32) * 4 * 2 * 3 / 4
    assert math.isclose(wire[True], wire[False] + again + gradients)


@pytest.mark.parametrize("layout, batch, sequence, message", [
    (ParallelLayout(tp=3), None, None, "tp=3: 4 heads do not split over 3 tensor-parallel ranks"),
    (ParallelLayout(pp=5), None, None, "pp=5 x chunks=1: 5 pipeline pieces, but the model has 4 layers"),
    (ParallelLayout(pp=2, chunks=3), None, None, "6 pipeline pieces"),
    (ParallelLayout(dp=2, microbatches=3), 8, None, "batch=8: the batch is cut over dp=2 replicas x microbatches=3"),
    (ParallelLayout(tp=4, sequence_parallel=True), 4, 30, "sequence=30: sequence parallelism cuts each sequence"),
    (ParallelLayout(), 4, 33, "sequence=33: the model has 32 positions"),
])
def test_layouts_that_do_not_fit_are_refused_saying_what_to_change(layout, batch, sequence, message):
    with pytest.raises(ValueError, match=message):
        check_fit(TINY_GPT, layout, batch, sequence)


def test_a_tied_head_needs_the_embeddings_piece_and_vocabulary_rows_need_ranks():
    tied = GPTShape(vocab=82, d_model=32, layers=2, heads=4, context=32, tied=True)
    check_fit(tied, ParallelLayout(dp=2, tp=2))  # one piece: tensor_parallel_gpt shares the rows
    with pytest.raises(ValueError, match="use an untied model"):
        check_fit(tied, ParallelLayout(pp=2))
    with pytest.raises(ValueError, match="a vocabulary of 3 cannot give each of 4 ranks a row"):
        check_fit(GPTShape(vocab=3, d_model=8, layers=1, heads=4, context=8), ParallelLayout(tp=4))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="zero_stage=3: pass 0 .*, 1 .* or 2"):
        ParallelLayout(dp=2, zero_stage=3)
    with pytest.raises(ValueError, match="zero_stage=True"):
        ParallelLayout(dp=2, zero_stage=True)
    with pytest.raises(ValueError, match="d_model=30 must be a multiple of heads=4"):
        GPTShape(vocab=82, d_model=30, layers=2, heads=4, context=32)
    with pytest.raises(ValueError, match="rank=8: this layout has 8 ranks"):
        rank_params(TINY_GPT, ParallelLayout(dp=2, pp=2, tp=2), 8)
    with pytest.raises(TypeError, match="shape=.*pass a labkit.plan.GPTShape"):
        axis_traffic({"vocab": 82}, ParallelLayout(), 16, 0)
    with pytest.raises(ValueError, match="traffic=.*its axes among dp, pp, cp, ep, tp"):
        axis_wire_bytes({"sp": {"all_reduce": 1}}, ParallelLayout())
    with pytest.raises(ValueError, match=r"traffic\['dp'\] collective='gather'"):
        axis_wire_bytes({"dp": {"gather": 1}}, ParallelLayout())


MOE = GPTShape(vocab=82, d_model=16, layers=2, heads=2, context=32, d_ff=32, experts=4, top_k=2)  # MoEGPT's default


def test_a_moe_ranks_parameters_are_the_models_and_ep_splits_only_the_experts():
    """On one rank, rank_params counts MoEGPT's parameters (torch's numel); with ep ranks, each rank holds
    experts/ep of every block's experts (one expert: fc1 and fc2 with their biases) and everything else whole."""
    from labkit.parallel.experts_gpt import MoEGPT, moe_gpt_shape

    model = MoEGPT(82, d_model=16, layers=2, heads=2, experts=4, top_k=2)
    assert moe_gpt_shape(model) == MOE
    assert rank_params(MOE, ParallelLayout(), 0) == sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for p in model.gpt.blocks[0].mlp.experts[0].parameters())
    for ep in (2, 4):
        layout = ParallelLayout(ep=ep)
        held = [rank_params(MOE, layout, rank) for rank in range(ep)]
        assert held == [rank_params(MOE, ParallelLayout(), 0) - 2 * (4 - 4 // ep) * expert] * ep


def test_the_ep_axis_by_hand():
    """dp=2 x ep=2, 2 micro-batches, a batch of 16 sequences of 12 tokens: b = 16 / (2 x 2 x 2) = 2 sequences per
    micro-batch, T = 24 tokens. Per block per micro-batch, 4 all-to-alls of T k = 48 rows of 16 numbers and the 4
    routing counts (8 bytes each); once a step the replicated gradients over ep, all of them over dp (no flags:
    ExpertParallelGPT's all_reduce_sum, not BucketedDDP)."""
    layout = ParallelLayout(dp=2, ep=2, microbatches=2)
    assert [layout.place(r) for r in (1, 2)] == [{"dp": 0, "pp": 0, "ep": 1, "tp": 0}, {"dp": 1, "pp": 0, "ep": 0,
                                                                                           "tp": 0}]
    expert = 32 * 17 + 16 * 32 + 16
    held = rank_params(MOE, layout, 0)
    traffic = axis_traffic(MOE, layout, batch=16, rank=0, sequence=12, bytes_per_number=8)
    assert traffic == {"dp": {"all_reduce": 8 * held}, "pp": {},  # all_reduce_sum's: no flag per tensor
                       "ep": {"all_to_all": 2 * 2 * 4 * 48 * 16 * 8, "all_to_all_sizes": 2 * 2 * 4 * 8,
                              "all_reduce": 8 * (held - 2 * 2 * expert)}, "tp": {}}
    wire = axis_wire_bytes(traffic, layout)["ep"]  # balanced all-to-alls send half on 2 ranks
    assert wire == traffic["ep"]["all_to_all"] / 2 + traffic["ep"]["all_to_all_sizes"] / 2 + traffic["ep"]["all_reduce"]


def test_the_ep_all_to_alls_are_the_balanced_estimate_of_moe_all_to_all_nbytes():
    """What a rank hands its dispatch, (N-1)/N of it on the wire, is moe_all_to_all_nbytes' balanced send, for every
    ep and top_k: the two formulas are one count."""
    from labkit.plan import moe_all_to_all_nbytes

    for ep, top_k in ((2, 1), (4, 2), (8, 2)):
        shape = GPTShape(vocab=82, d_model=16, layers=1, heads=2, context=32, experts=8, top_k=top_k)
        layout = ParallelLayout(ep=ep)
        handed = axis_traffic(shape, layout, batch=ep, rank=0, sequence=32, bytes_per_number=2)["ep"]["all_to_all"]
        wire = axis_wire_bytes({"ep": {"all_to_all": handed}}, layout)["ep"]
        balanced = moe_all_to_all_nbytes(32, 16, top_k, ep, bytes_per_element=2)["balanced"]
        assert wire == 4 * balanced  # dispatch and combine, forward and backward


@pytest.mark.parametrize("shape, layout, batch, message", [
    (TINY_GPT, ParallelLayout(ep=2), 16, "ep=2: expert parallelism splits a block's experts over ranks, but this "
                                         "model's blocks are dense"),
    (MOE, ParallelLayout(ep=8), 16, "ep=8: 4 experts do not split over 8 ranks"),
    (MOE, ParallelLayout(tp=2), 16, "tp=2 with experts=4: labkit plans a mixture of experts on dp x pp x ep"),
    (MOE, ParallelLayout(cp=2), 16, "cp=2 with experts=4"),
    (MOE, ParallelLayout(dp=2, ep=2, zero_stage=1), 16, "zero_stage=1 with experts=4: labkit plans a mixture of "
                                                        "experts with its state replicated over dp"),
    (MOE, ParallelLayout(dp=2, ep=2, microbatches=2), 12, "batch=12: the batch is cut over dp=2 replicas x ep=2 x "
                                                           "microbatches=2, 8 equal parts"),
])
def test_expert_layouts_that_do_not_fit_are_refused_saying_what_to_change(shape, layout, batch, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_fit(shape, layout, batch)


def test_a_moe_shape_needs_top_k_within_its_experts_and_reads_as_before_when_dense():
    with pytest.raises(ValueError, match=r"top_k=3 experts per token, but a block has experts=2"):
        GPTShape(vocab=82, d_model=16, layers=2, heads=2, context=32, experts=2, top_k=3)
    with pytest.raises(ValueError, match=r"top_k=2 .* experts=0"):
        GPTShape(vocab=82, d_model=16, layers=2, heads=2, context=32, top_k=2)
    assert repr(TINY_GPT) == "GPTShape(vocab=82, d_model=32, layers=2, heads=4, context=32, d_ff=128, tied=False)"
    assert "experts=4, top_k=2)" in repr(MOE)
