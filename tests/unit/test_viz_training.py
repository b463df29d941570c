"""Figures of training runs: divergence, loss curves, the DDP timeline and the FSDP timeline."""

import pytest

from labkit.parallel.data import Event
from labkit.parallel.fsdp import UnitEvent
from labkit.viz import ddp_timeline, divergence_chart, fsdp_timeline, loss_curves
from labkit.viz.style import PALETTE


def test_divergence_chart_uses_a_log_axis_only_when_there_is_drift():
    assert divergence_chart({"rank 1": [1e-3, 1e-2]}).layout.yaxis.type == "log"
    flat = divergence_chart({"rank 1": [0.0, 0.0]})
    assert flat.layout.yaxis.type == "linear" and list(flat.data[0].x) == [1, 2]


def test_divergence_chart_labels_round_numbers_only():
    yaxis = divergence_chart({"rank 1": [0.0, 3e-8, 4e-6], "rank 2": [0.0, 2e-8, 9e-5]}).layout.yaxis
    assert list(yaxis.ticktext) == ["1e-8", "1e-7", "1e-6", "1e-5", "0.0001"]    # 3 decades or more: decades only


def test_ddp_timeline_names_its_unit_in_the_axis_title():
    events = [Event("grad", "w", 0, 0.001, 0.001, 4), Event("all_reduce", "bucket 0", 0, 0.001, 0.002, 4)]
    assert ddp_timeline(events).layout.xaxis.title.text.endswith("(ms)")


def test_loss_curves_draw_one_line_per_run():
    figure = loss_curves({"a": ([16, 32], [2.0, 1.5]), "b": ([32], [1.9])}, "t", "examples seen")
    assert [trace.name for trace in figure.data] == ["a", "b"] and list(figure.data[0].y) == [2.0, 1.5]


def test_ddp_timeline_has_ticks_for_gradients_and_bars_for_buckets_in_milliseconds():
    events = [Event("grad", "2.weight", 0, 0.001, 0.001, 400), Event("all_reduce", "bucket 0", 0, 0.0012, 0.004, 404),
              Event("grad", "0.weight", 1, 0.003, 0.003, 400), Event("finish", "finish", -1, 0.0035, 0.005, 0)]
    figure = ddp_timeline(events)
    ticks, *bars = figure.data
    assert list(ticks.x) == pytest.approx([1.0, 3.0])
    assert [bar.y[0] for bar in bars] == ["all_reduce bucket 0", "finish(): waiting"]
    assert bars[0].base[0] == pytest.approx(1.2) and bars[0].x[0] == pytest.approx(2.8)


def test_fsdp_timeline_puts_each_kind_in_its_lane_coloured_by_unit_in_milliseconds():
    events = [UnitEvent("all_gather", 0, "0", "forward", 0.0, 0.001, 400),
              UnitEvent("all_gather", 1, "2", "forward", 0.0012, 0.003, 200),   # prefetched while unit 0 computes
              UnitEvent("compute", 0, "0", "forward", 0.0011, 0.0025, 0),
              UnitEvent("compute", 1, "2", "backward", 0.004, 0.005, 0),
              UnitEvent("reduce_scatter", 1, "2", "backward", 0.005, 0.0065, 200)]
    figure = fsdp_timeline(events)
    assert [bar.y[0] for bar in figure.data] == ["all-gather", "all-gather", "compute", "compute", "reduce-scatter"]
    assert figure.data[1].base[0] == pytest.approx(1.2) and figure.data[1].x[0] == pytest.approx(1.8)
    assert [bar.marker.color for bar in figure.data] == [PALETTE[0], PALETTE[1], PALETTE[0], PALETTE[1], PALETTE[1]]
    assert [bar.showlegend for bar in figure.data] == [True, True, False, False, False]  # one legend entry per unit
    # units numbered 0, 1 (their modules, an nn.Sequential's "0" and "2", beside the number, never instead of it)
    assert [bar.name for bar in figure.data[:2]] == ["unit 0 (module '0')", "unit 1 (module '2')"]
    assert [bar.text[0] for bar in figure.data[:2]] == ["unit 0", "unit 1"]
    assert list(figure.layout.yaxis.categoryarray) == ["reduce-scatter", "compute", "all-gather"]  # top down
    (backward,) = figure.layout.shapes
    assert backward.x0 == pytest.approx(4.0) and figure.layout.xaxis.title.text.endswith("(ms)")


def test_fsdp_timeline_of_a_forward_alone_has_no_backward_line():
    figure = fsdp_timeline([UnitEvent("compute", 0, "0", "forward", 0.0, 0.001, 0)])
    assert not figure.layout.shapes
