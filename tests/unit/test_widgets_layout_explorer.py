"""The layout explorer shows labkit.plan's numbers for the layout its controls hold, rank by rank; a layout whose
product is not the world, or that the model cannot split, is explained and leaves the last good one shown."""

import pytest

from labkit.plan import GPTShape, ParallelLayout, axis_traffic, axis_wire_bytes, rank_params, training_memory
from labkit.widgets import LayoutExplorer, suggested_layout
from labkit.widgets.layout_explorer import AXIS_WHEN, plan_layout

SHAPE = GPTShape(vocab=82, d_model=32, layers=2, heads=4, context=32)  # TinyGPT(82, tied=False)'s sizes
BATCH, NUMBER_NBYTES = 16, 8  # float64, as notebooks 13 and 14 train


def explorer(world_size=8):
    return LayoutExplorer(SHAPE, world_size, BATCH, bytes_per_number=NUMBER_NBYTES)


def test_it_starts_at_the_suggested_layout_with_plans_numbers_for_every_rank():
    app = explorer()
    layout = ParallelLayout(dp=2, pp=2, tp=2, microbatches=2)
    assert app.problem is None and app.planned.layout == layout
    for rank in range(8):
        traffic = axis_traffic(SHAPE, layout, BATCH, rank, bytes_per_number=NUMBER_NBYTES)
        assert app.planned.traffic[rank] == traffic
        assert app.planned.wire[rank] == axis_wire_bytes(traffic, layout)
        n = NUMBER_NBYTES
        assert app.planned.memory[rank] == training_memory(rank_params(SHAPE, layout, rank), n, n, 2 * n)
    assert "dp=2 x pp=2 x tp=2 = 8 ranks" in app.summary.value and "33.3%" in app.summary.value


def test_the_charts_show_replica_0s_ranks_bytes_per_axis_and_memory():
    app = explorer()
    bars = {bar.name: bar for bar in app.traffic_chart.figure.data}
    assert list(bars) == ["dp", "pp", "tp"] and len(bars["tp"].x) == 4          # ranks 0-3: pp x tp
    unit = {"kB": 1e3, "MB": 1e6}[app.traffic_chart.figure.layout.yaxis.title.text.split(", ")[-1]]
    for axis, bar in bars.items():
        assert list(bar.y) == [app.planned.axis_nbytes(rank)[axis] / unit for rank in range(4)]
    memory = {bar.name: list(bar.y) for bar in app.memory_chart.figure.data}
    assert memory["weights"] == [app.planned.memory[rank]["weights"] / 1e6 for rank in range(4)]


def test_a_product_other_than_the_world_is_explained_and_the_last_layout_stays():
    app = explorer()
    shown, figure = app.planned, app.traffic_chart.figure
    app.controls["tp"].value = 4
    assert app.problem == ("dp=2 x pp=2 x tp=4 = 16 ranks, but the world has 8: pick sizes whose product is 8 "
                           "(pp=2 x tp=4 leaves dp=1).")
    assert "Still showing dp=2 x pp=2 x tp=2" in app.summary.value
    assert app.planned is shown and app.traffic_chart.figure is figure
    app.set_layout(pp=1, tp=1, dp=8)
    assert app.problem is None and (app.planned.layout.dp, app.planned.layout.pp, app.planned.layout.tp) == (8, 1, 1)
    app.set_layout(dp=8, pp=2, tp=2)
    assert "pp=2 x tp=2 leaves dp=2" in app.problem


@pytest.mark.parametrize("values, reason", [
    ({"dp": 1, "pp": 1, "tp": 8}, "tp=8: 4 heads do not split over 8 tensor-parallel ranks"),
    ({"microbatches": 3}, "batch=16: the batch is cut over dp=2 replicas x microbatches=3"),
])
def test_a_layout_the_model_or_batch_cannot_take_is_refused_with_plans_reason(values, reason):
    app = explorer()
    app.set_layout(**values)
    assert app.problem.startswith(reason) and reason in app.summary.value
    assert app.planned.layout == ParallelLayout(dp=2, pp=2, tp=2, microbatches=2)


def test_micro_batches_and_chunks_change_the_bubble_not_the_bytes_per_step():
    app = explorer()
    before = [app.planned.axis_nbytes(rank) for rank in range(8)]
    title = app.traffic_chart.figure.layout.title.text
    app.controls["microbatches"].value = 4
    assert [app.planned.axis_nbytes(rank) for rank in range(8)] == before
    assert "1/5 = <b>20.0%</b>" in app.summary.value and app.traffic_chart.figure.layout.title.text != title
    app.controls["chunks"].value = 2                                   # interleaved: (p-1)/(v m + p-1) = 1/9
    assert "1/9 = <b>11.1%</b>" in app.summary.value and app.planned.layout.chunks == 2


def test_sequence_parallelism_turns_tps_all_reduces_into_reduce_scatters_and_all_gathers():
    app = explorer()
    app.controls["sequence_parallel"].value = True
    assert app.planned.layout.sequence_parallel and "sequence parallel" in app.summary.value
    assert {"reduce_scatter", "all_gather"} <= set(app.planned.traffic[0]["tp"])


def test_plan_layout_refuses_what_check_fit_refuses():
    with pytest.raises(ValueError, match="tp=3: 4 heads"):
        plan_layout(SHAPE, ParallelLayout(tp=3), BATCH)


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="pass a labkit.plan.GPTShape"):
        LayoutExplorer("TinyGPT", 8, BATCH)
    with pytest.raises(ValueError, match="world_size=17"):
        LayoutExplorer(SHAPE, 17, BATCH)
    with pytest.raises(ValueError, match=r"set_layout: \['pipeline'\] are no controls"):
        explorer().set_layout(pipeline=2)
    with pytest.raises(ValueError, match="LayoutExplorer: batch=15"):
        LayoutExplorer(SHAPE, 8, 15)


@pytest.mark.parametrize("world_size", range(1, 17))
def test_the_suggested_layout_fills_the_world_with_tp_innermost(world_size):
    dp, pp, tp = suggested_layout(world_size)
    assert dp * pp * tp == world_size and tp == (2 if world_size % 2 == 0 else 1) and pp <= tp


def test_the_bytes_between_nodes_are_the_wire_bytes_of_the_axes_whose_groups_span_nodes():
    planned = plan_layout(SHAPE, ParallelLayout(dp=2, pp=2, tp=2, microbatches=2), BATCH,
                          bytes_per_number=NUMBER_NBYTES)
    for rank in range(8):
        wire = planned.wire[rank]
        assert planned.network_nbytes(rank, 1) == wire                     # a rank per node: everything crosses
        assert planned.network_nbytes(rank, 2) == {"dp": wire["dp"], "pp": wire["pp"], "tp": 0.0}  # tp pairs
        assert planned.network_nbytes(rank, 4) == {"dp": wire["dp"], "pp": 0.0, "tp": 0.0}        # a replica
        assert planned.network_nbytes(rank, 8) == {"dp": 0.0, "pp": 0.0, "tp": 0.0}               # one node
    wide = plan_layout(SHAPE, ParallelLayout(dp=2, pp=1, tp=4, microbatches=2), BATCH, bytes_per_number=NUMBER_NBYTES)
    assert wide.network_nbytes(0, 2)["tp"] == wide.wire[0]["tp"] > 0      # tp over 4 ranks spans two nodes of 2
    assert wide.network_nbytes(0, 4)["tp"] == 0.0
    with pytest.raises(ValueError, match="ranks_per_node=0"):
        planned.network_nbytes(0, 0)
    with pytest.raises(ValueError, match="rank=8"):
        planned.network_nbytes(8, 2)


def test_the_summary_says_dp_waits_for_the_last_micro_batch_and_does_not_hide_behind_the_backward():
    assert "last micro-batch's backward" in AXIS_WHEN["dp"] and "overlap the backward" not in AXIS_WHEN["dp"]
    assert AXIS_WHEN["dp"] in explorer().summary.value


def test_cp_splits_every_sequence_adds_its_axis_and_divides_the_activations():
    """cp = 2 on 8 ranks (dp=2 x cp=2 x tp=2): plan's traffic with a cp axis for every rank, the ring and its
    gradients' all-reduce in the cp row, the charts' ranks pp x cp x tp of replica 0 with cp in their labels, and
    the busiest rank's activations half those of the same layout without cp on 4 ranks (16 of 32 positions each:
    exactly half)."""
    app = explorer()
    app.set_layout(dp=2, pp=1, cp=2, tp=2)
    layout = ParallelLayout(dp=2, tp=2, cp=2, microbatches=2)
    assert app.problem is None and app.planned.layout == layout
    for rank in range(8):
        assert app.planned.traffic[rank] == axis_traffic(SHAPE, layout, BATCH, rank, bytes_per_number=NUMBER_NBYTES)
        assert set(app.planned.traffic[rank]["cp"]) == {"send", "all_reduce"}
    without_cp = plan_layout(SHAPE, ParallelLayout(dp=2, tp=2, microbatches=2), BATCH, bytes_per_number=NUMBER_NBYTES)
    assert max(app.planned.activations) == max(without_cp.activations) / 2 > 0
    assert "dp=2 x pp=1 x cp=2 x tp=2 = 8 ranks" in app.summary.value and "<b>cp</b>" in app.summary.value
    assert AXIS_WHEN["cp"] in app.summary.value and "1/cp of each sequence" in app.summary.value
    bars = {bar.name: bar for bar in app.traffic_chart.figure.data}
    assert list(bars) == ["dp", "cp", "tp"] and list(bars["cp"].x)[1] == "rank 1<br>pp0 cp0 tp1"
    app.set_layout(cp=4)
    assert app.problem == ("dp=2 x pp=1 x cp=4 x tp=2 = 16 ranks, but the world has 8: pick sizes whose product is 8 "
                           "(pp=1 x cp=4 x tp=2 leaves dp=1).")


def test_cp_with_sequence_parallelism_is_refused_with_why():
    app = explorer()
    app.set_layout(dp=2, pp=1, cp=2, tp=2, sequence_parallel=True)
    assert "cp=2 with sequence_parallel: both cut the sequence" in app.problem
    assert app.problem.endswith("untick sequence parallelism (tp).")   # the widget's words, not the API's


def test_ep_splits_each_blocks_experts_adds_its_axis_and_its_all_to_alls():
    """8 experts per block, k = 2, on dp=2 x pp=2 x ep=2: plan's traffic for every rank with an ep axis (the
    all-to-alls, the routing counts, the replicated gradients' all-reduce), an ep row and an experts line saying what
    each rank holds and that routing is taken balanced, the charts' ranks pp x ep of replica 0 with ep in their
    labels, and each rank's training state below the dense model's with 8 experts' worth of MLPs whole."""
    app = explorer()
    app.set_layout(experts=8, top_k=2, tp=1, ep=2)
    shape = GPTShape(vocab=82, d_model=32, layers=2, heads=4, context=32, experts=8, top_k=2)
    layout = ParallelLayout(dp=2, pp=2, ep=2, microbatches=2)
    assert app.problem is None and app.planned.layout == layout and app.planned.shape == shape
    for rank in range(8):
        assert app.planned.traffic[rank] == axis_traffic(shape, layout, BATCH, rank, bytes_per_number=NUMBER_NBYTES)
        assert set(app.planned.traffic[rank]["ep"]) == {"all_to_all", "all_to_all_sizes", "all_reduce"}
    whole_experts = plan_layout(shape, ParallelLayout(dp=4, pp=2, microbatches=2), BATCH, bytes_per_number=8)
    assert max(m["total"] for m in app.planned.memory) < min(m["total"] for m in whole_experts.memory)
    assert "<b>ep</b>" in app.summary.value and AXIS_WHEN["ep"] in app.summary.value
    assert "each rank holds <b>4</b> of each block's" in app.summary.value and "balanced routing" in app.summary.value
    assert "as if each block were dense" in app.summary.value
    bars = {bar.name: bar for bar in app.traffic_chart.figure.data}
    assert list(bars) == ["dp", "pp", "ep"] and list(bars["ep"].x)[1] == "rank 1<br>pp0 ep1 tp0"


def test_ep_needs_experts_tp_one_and_top_k_is_off_for_a_dense_model():
    app = explorer()
    assert app.controls["top_k"].disabled and app.controls["experts"].value == 0
    app.set_layout(tp=1, ep=2)
    assert app.problem.startswith("ep=2: expert parallelism splits a block's experts over ranks")
    assert "pick experts per block, or ep=1" in app.summary.value
    app.set_layout(experts=4)
    assert app.problem is None and not app.controls["top_k"].disabled and app.planned.shape.experts == 4
    app.set_layout(tp=2, ep=1)
    assert app.problem.startswith("tp=2 with experts=4: labkit plans a mixture of experts on dp x pp x ep")
    app.set_layout(experts=0)
    assert app.problem is None and app.controls["top_k"].disabled and app.planned.shape.top_k == 1


@pytest.mark.parametrize("world_size, start", [(8, (2, 2, 2, 1)), (4, (1, 2, 2, 1)), (2, (1, 1, 2, 1)),
                                               (1, (1, 1, 1, 1))])
def test_a_model_with_experts_starts_with_tp_ranks_on_ep(world_size, start):
    """Experts are planned with tp = 1: an explorer of a MoE starts where suggested_layout puts tp's ranks on ep
    instead (dp, pp, ep, tp), and offers the shape's own top_k."""
    moe = GPTShape(vocab=82, d_model=32, layers=2, heads=4, context=32, experts=8, top_k=4)
    app = LayoutExplorer(moe, world_size, BATCH, bytes_per_number=NUMBER_NBYTES)
    layout = app.planned.layout
    assert app.problem is None and (layout.dp, layout.pp, layout.ep, layout.tp) == start
    assert app.planned.shape == moe and 4 in app.controls["top_k"].options and not app.controls["top_k"].disabled
