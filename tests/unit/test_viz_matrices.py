"""split_matmul draws X, W and Y as matrices, each rank's block outlined in its colour."""

import pytest
import torch

from labkit.viz.matrices import split_matmul
from labkit.viz.style import rank_color

X = torch.arange(6.0).reshape(2, 3) - 2
W = torch.arange(15.0).reshape(3, 5) - 7


def outlines(figure):
    """(rank colour, x0, x1, y0, y1) of every outline, in cell units."""
    return [(s.line.color, s.x0 + 0.5, s.x1 + 0.5, s.y0 + 0.5, s.y1 + 0.5) for s in figure.layout.shapes]


def test_column_split_outlines_each_ranks_columns_of_w_and_of_y():
    parts = [X @ block for block in W.tensor_split(2, dim=1)]        # 3 and 2 columns
    figure = split_matmul(X, W, parts, X @ W, "column")
    x, w, y = (trace for trace in figure.data if trace.type == "heatmap")
    assert [list(row) for row in w.z] == W.tolist() and [list(row) for row in y.z] == (X @ W).tolist()
    assert outlines(figure) == [(rank_color(0), 0, 3, 0, 3), (rank_color(1), 3, 5, 0, 3),     # W's columns
                                (rank_color(0), 0, 3, 0, 2), (rank_color(1), 3, 5, 0, 2)]     # Y's; X has none
    assert [t.name for t in figure.data if t.type == "scatter"] == ["rank 0", "rank 1"]
    assert figure.layout.width <= 900


def test_row_split_draws_every_partial_sum_and_their_total():
    xs, ws = X.tensor_split(2, dim=1), W.tensor_split(2, dim=0)      # 2 and 1 features/rows
    parts = [a @ b for a, b in zip(xs, ws, strict=True)]
    figure = split_matmul(X, W, parts, parts[0] + parts[1], "row")
    heatmaps = [trace for trace in figure.data if trace.type == "heatmap"]
    assert [[list(row) for row in h.z] for h in heatmaps[2:]] == [p.tolist() for p in parts] + [(X @ W).tolist()]
    assert outlines(figure)[:4] == [(rank_color(0), 0, 2, 0, 2), (rank_color(1), 2, 3, 0, 2),   # X's features
                                    (rank_color(0), 0, 5, 0, 2), (rank_color(1), 0, 5, 2, 3)]   # W's rows
    assert [a.text for a in figure.layout.annotations if a.text in "+="] == ["+", "="]
    assert "partial sum" in figure.layout.title.text


def test_values_are_written_in_the_cells_without_minus_zero():
    figure = split_matmul([[-0.0, 1.0]], [[1.0], [2.0]], [[[2.0]]], [[2.0]], "column")
    assert list(figure.data[0].text[0]) == ["0", "1"]


def test_bad_input_is_refused_with_a_reason():
    with pytest.raises(ValueError, match=r"^split='diagonal': use one of 'column', 'row'\.$"):
        split_matmul(X, W, [X @ W], X @ W, "diagonal")
    with pytest.raises(ValueError, match=r"^split=\['row'\]: use one of 'column', 'row'\.$"):  # once unhashable
        split_matmul(X, W, [X @ W], X @ W, ["row"])
    with pytest.raises(ValueError, match="columns"):
        split_matmul(X, W, [X @ W[:, :2]], X @ W, "column")
    with pytest.raises(ValueError, match="equally long rows"):
        split_matmul([[1.0], [1.0, 2.0]], W, [X @ W], X @ W, "column")
