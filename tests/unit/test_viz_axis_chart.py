"""axis_traffic_bars and axis_link_seconds draw what they are given, an axis in its mesh_grid colour, in a readable
unit."""

import math

import pytest

from labkit.viz.axis_chart import AXIS_COLORS, axis_link_seconds, axis_traffic_bars, byte_unit
from labkit.viz.mesh_chart import GROUP_STYLE


@pytest.mark.parametrize("nbytes, unit", [(0, "bytes"), (999, "bytes"), (1e3, "kB"), (163_840, "kB"), (1e6, "MB"),
                                          (2.5e9, "GB"), (8e11, "GB")])
def test_byte_unit_is_the_largest_at_or_below(nbytes, unit):
    assert byte_unit(nbytes)[0] == unit


def test_traffic_bars_one_per_axis_that_moved_in_mesh_order_and_colours():
    traffic = {"rank 0": {"tp": 3e6, "dp": 1e6, "pp": 0}, "rank 1": {"tp": 2e6, "dp": 1e6, "pp": 0}}
    figure = axis_traffic_bars(traffic)
    assert [bar.name for bar in figure.data] == ["dp", "tp"]                 # pp moved nothing: no bar
    assert [list(bar.y) for bar in figure.data] == [[1.0, 1.0], [3.0, 2.0]]  # MB
    assert figure.layout.yaxis.title.text.endswith("MB")
    for bar in figure.data:
        assert bar.marker.color == AXIS_COLORS[bar.name]
    for axis in ("tp", "pp"):                                                # as mesh_grid outlines the groups
        assert AXIS_COLORS[axis] == GROUP_STYLE[axis]["line"]["color"]


def test_link_seconds_bars_per_axis_on_a_log_axis_with_the_compute_line():
    seconds = {"tp": {"NVLink": 1.8, "network": 16.2}, "pp": {"NVLink": 0.04, "network": 0.4}}
    figure = axis_link_seconds(seconds, compute_seconds=16.0)
    assert [(bar.name, list(bar.x), list(bar.y)) for bar in figure.data] == [
        ("NVLink", ["tp", "pp"], [1.8, 0.04]), ("network", ["tp", "pp"], [16.2, 0.4])]
    assert figure.layout.yaxis.type == "log"
    assert [shape.y0 for shape in figure.layout.shapes] == [16.0]
    note, = figure.layout.annotations
    assert "16 s" in note.text and note.y == math.log10(16.0)               # a log axis places annotations by exponent
    assert not axis_link_seconds(seconds).layout.shapes
