"""The shared figure style: log axes label round numbers only, colour bars of counts label integers only."""

import math

import plotly.graph_objects as go
import pytest

from labkit.viz.style import integer_colorbar, log_axis, log_ticks, short_number


@pytest.mark.parametrize(("low", "high", "ticks"), [
    (0.05, 0.9, [0.05, 0.1, 0.2, 0.5, 1.0]),  # under 3 decades: 1-2-5
    (1024, 64e6, [1e3, 1e4, 1e5, 1e6, 1e7, 1e8]),  # 3 decades or more: decades only
    (3, 4, [2.0, 5.0]),  # inside one 1-2-5 step: the round numbers either side
    (1000, 1000, [1000.0, 2000.0]),  # one value: still two ticks, a range plotly can draw
])
def test_log_ticks_are_round_numbers_around_the_data(low, high, ticks):
    assert log_ticks(low, high) == pytest.approx(ticks)


def test_log_ticks_reject_values_a_log_axis_cannot_show():
    with pytest.raises(ValueError, match="0 < low <= high"):
        log_ticks(0, 10)


def test_short_number_uses_si_prefixes_from_a_thousand_up():
    assert [short_number(v) for v in (0.01, 1e-5, 5, 500, 2000, 1e6, 5e9)] == \
        ["0.01", "1e-5", "5", "500", "2k", "1M", "5G"]


def test_log_axis_labels_only_its_round_ticks_and_spans_them():
    axis = log_axis("message size (bytes)", [1024, 0, 3e6])
    figure = go.Figure(go.Scatter(x=[1024, 3e6], y=[1, 2])).update_xaxes(**axis)
    assert figure.layout.xaxis.type == "log" and figure.layout.xaxis.title.text == "message size (bytes)"
    assert list(axis["ticktext"]) == ["1k", "10k", "100k", "1M", "10M"]
    low, high = axis["range"]
    assert low < math.log10(1024) and math.log10(3e6) < high    # the data ...
    assert axis["tickvals"][0] == 1e3 and axis["tickvals"][-1] == 1e7 and low < 3 and 7 < high   # ... and its end ticks


def test_log_axis_without_values_labels_decades():
    assert log_axis("loss")["dtick"] == 1


@pytest.mark.parametrize(("high", "ticks"), [(2, [1, 2]), (8, list(range(1, 9))), (16, list(range(1, 17)))])
def test_integer_colorbar_ticks_whole_counts(high, ticks):
    bar = integer_colorbar(1, high, "ranks in it")
    assert bar["tickvals"] == ticks and bar["ticktext"] == [str(t) for t in ticks]
