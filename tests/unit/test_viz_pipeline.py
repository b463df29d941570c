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


def test_bubble_chart_puts_measured_points_over_the_formula():
    figure = bubble_chart({"gpipe": {1: 0.74, 4: 0.44}}, stages=4, most_microbatches=8)
    curve, points = figure.data
    assert curve.y[0] == pytest.approx(0.75) and curve.y[3] == pytest.approx(3 / 7)
    assert list(points.x) == [1, 4]
