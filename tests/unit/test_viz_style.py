"""The shared figure style: log axes label round numbers only, colour bars of counts label integers only."""

import ast
import math
import re
from pathlib import Path

import plotly.graph_objects as go
import pytest

import labkit
from labkit.viz.style import PALETTE, integer_colorbar, log_axis, log_ticks, rank_color, short_number, tint

PACKAGE = Path(labkit.__file__).parent
DRAWING = [p for folder in ("viz", "widgets") for p in sorted((PACKAGE / folder).glob("*.py")) if p.name != "style.py"]
HEX = re.compile(r"#[0-9a-fA-F]{3}(?:[0-9a-fA-F]{3})?\b")
NAMED = {"black", "blue", "gray", "green", "grey", "orange", "purple", "red", "white", "yellow"}
SCALES = {"blues", "greens", "greys", "rdbu", "reds", "viridis"}  # plotly's named colour scales, lower case


def colour_literals(path: Path) -> list[str]:
    """Colours written into `path`'s code rather than taken from viz.style: hex strings anywhere in a string
    (CSS in HTML too), and strings that are a colour's or a colour scale's name. Docstrings are left out."""
    module = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(module)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    found = [node for node in ast.walk(module) if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and id(node) not in docstrings and (HEX.search(node.value) or node.value.lower() in NAMED | SCALES)]
    return [f"{node.value!r} (line {node.lineno})" for node in sorted(found, key=lambda node: node.lineno)]


@pytest.mark.parametrize("path", DRAWING, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_figure_and_widget_takes_its_colours_from_style(path):
    assert not colour_literals(path), f"{path.name}: colours not from labkit.viz.style: {colour_literals(path)}"


def test_the_colour_check_finds_what_it_is_for(tmp_path):
    drawn = tmp_path / "drawn.py"
    drawn.write_text('"""#123456 in a docstring is prose."""\nA = "#e45756"\nB = {"color": "white"}\n'
                     'C = f"<div style=\'border:1px solid #999\'>"\nD = "RdBu"\n')
    assert colour_literals(drawn) == ["'#e45756' (line 2)", "'white' (line 3)",
                                      "\"<div style='border:1px solid #999'>\" (line 4)", "'RdBu' (line 5)"]


def test_ranks_take_the_palette_in_order_and_stay_distinct_up_to_its_length():
    assert [rank_color(r) for r in range(2 * len(PALETTE))] == PALETTE * 2
    assert len(set(PALETTE)) == len(PALETTE)


def test_tint_mixes_with_white():
    assert (tint("#000000", 0.0), tint("#4c78a8", 1.0), tint("#000000", 0.5)) == ("#ffffff", "#4c78a8", "#808080")


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
