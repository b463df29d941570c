"""Pipeline figures draw a simulated timeline and the bubble curve."""

import pytest

from labkit.parallel import simulate_pipeline
from labkit.viz import bubble_chart, pipeline_timeline


def test_timeline_has_a_bar_per_action_coloured_by_kind():
    events = simulate_pipeline("1f1b", 3, 4, 1.0, 2.0)
    figure = pipeline_timeline(events, unit_seconds=1, unit="time units")
    forward, backward = figure.data
    assert len(forward.x) == len(backward.x) == 3 * 4
    assert list(forward.x) == [1.0] * 12 and list(backward.x) == [2.0] * 12
    assert list(figure.layout.yaxis.categoryarray) == ["stage 0", "stage 1", "stage 2"]
    assert figure.layout.xaxis.title.text == "time, time units"


def test_timeline_hides_the_labels_of_bars_too_narrow_to_read():
    figure = pipeline_timeline(simulate_pipeline("gpipe", 4, 12, 1.0, 2.0), unit_seconds=1, unit="time units")
    assert figure.layout.uniformtext.mode == "hide" and figure.layout.uniformtext.minsize >= 10
    assert list(figure.data[0].text) == [str(i) for i in range(12)] * 4  # the labels are there where they fit


def test_bubble_chart_puts_measured_points_over_the_formula():
    figure = bubble_chart({"gpipe": {1: 0.74, 4: 0.44}}, stages=4, most_microbatches=8)
    curve, points = figure.data
    assert curve.y[0] == pytest.approx(0.75) and curve.y[3] == pytest.approx(3 / 7)
    assert list(points.x) == [1, 4]


def test_bubble_chart_draws_simulated_lines_between_the_formula_and_the_measured_points():
    figure = bubble_chart({"gpipe": {1: 0.76, 4: 0.45}}, stages=4, most_microbatches=8,
                          simulated={"gpipe": {1: 0.755, 4: 0.44}, "1f1b": {1: 0.755, 4: 0.441}})
    curve, gpipe, one_f_one_b, points = figure.data
    assert (gpipe.name, gpipe.mode, list(gpipe.y)) == ("simulated, gpipe", "lines", [0.755, 0.44])
    assert gpipe.line.dash != one_f_one_b.line.dash and points.name == "measured, gpipe"


def test_coinciding_schedules_stay_visible_and_the_log_axis_labels_powers_of_two():
    same = {1: 0.75, 2: 0.6, 4: 0.43, 8: 0.27}
    figure = bubble_chart({"gpipe": same, "1f1b": same}, stages=4, most_microbatches=32)
    gpipe, one_f_one_b = figure.data[1:]
    assert gpipe.marker.symbol != one_f_one_b.marker.symbol and gpipe.marker.size > one_f_one_b.marker.size
    assert gpipe.marker.symbol.endswith("-open")  # a ring: the smaller marker shows through it
    assert list(figure.layout.xaxis.tickvals) == [1, 2, 4, 8, 16, 32]
    assert figure.layout.yaxis.tickformat == ".0%"


def test_an_interleaved_timeline_labels_each_bar_with_its_micro_batch_and_chunk():
    figure = pipeline_timeline(simulate_pipeline("interleaved", 2, 2, 1.0, 2.0, chunks=2), unit_seconds=1,
                               unit="time units")
    forward, backward = figure.data
    assert list(forward.text[:4]) == ["0.0", "1.0", "0.1", "1.1"]  # stage 0: both chunks' forwards of 0 and 1
    assert list(forward.x) == [0.5] * 8 and list(backward.x) == [1.0] * 8  # each chunk: half the stage's cost
    assert "micro-batch.chunk" in forward.hovertemplate
    assert list(pipeline_timeline(simulate_pipeline("1f1b", 2, 2)).data[0].text) == ["0", "1"] * 2


def test_bubble_chart_draws_one_curve_per_chunk_count():
    figure = bubble_chart({"interleaved": {4: 0.16}}, stages=4, most_microbatches=8, chunks=(1, 2))
    one, two, points = figure.data
    assert one.y[7] == pytest.approx(3 / 11) and two.y[7] == pytest.approx(3 / 19)  # m = 8
    assert two.name == "(p-1)/(2m+p-1), 2 chunks" and list(points.x) == [4]
    with pytest.raises(TypeError, match="chunks=2: pass a tuple of chunk counts"):
        bubble_chart({}, stages=4, chunks=2)
