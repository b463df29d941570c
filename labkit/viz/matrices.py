"""Matrices drawn as matrices: Y = X W computed by several ranks, each rank's block of X, W and Y outlined in
its colour (Megatron-LM's column- and row-parallel linears, Shoeybi et al. 2019, section 3)."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.checks import choice
from labkit.plan.counts import shard_sizes
from labkit.viz.style import PALE_DIVERGING, WHITE, rank_color

__all__ = ["split_matmul"]

CELL_PX = 40  # one matrix element; 4 + 12 columns stay under 900 px
GAP_PX = 60  # between rows of matrices: room for a subplot title
TITLES = {"column": ("Column split: each rank computes some of Y's columns", "X: every rank has all of it",
                     "W: rank r holds columns W_r"),
          "row": ("Row split: each rank computes a full-size partial sum of Y", "X: rank r uses columns X_r",
                  "W: rank r holds rows W_r")}


def split_matmul(x, w, parts, total, split: str, title: str | None = None) -> go.Figure:
    """Y = X W split over len(parts) ranks, as heatmaps with the values written in the cells.

    split="column": rank r holds a block of W's columns and computes Y_r = X W_r (`parts[r]`), that block
    of Y's columns; `total` is Y after the AllGather, its blocks outlined by the rank that computed them.
    split="row": rank r holds a block of W's rows and the matching columns (features) of X, as
    torch.tensor_split cuts them (labkit.plan.counts.shard_sizes), and computes a full-size partial sum
    X_r W_r (`parts[r]`), drawn one under the other; `total` is Y after the AllReduce, their sum.
    Matrices are nested lists or anything with .tolist() (tensors). Rank r's outline is `rank_color(r)`.

    >>> figure = split_matmul([[1, 2]], [[1, 0], [0, 1]], [[[1]], [[2]]], [[1, 2]], "column")
    >>> [shape.line.color for shape in figure.layout.shapes]
    ['#4c78a8', '#f58518', '#4c78a8', '#f58518']
    """
    choice("split", split, TITLES)
    x, w, total = _rows(x), _rows(w), _rows(total)
    parts = [_rows(p) for p in parts]
    layout = _column_layout if split == "column" else _row_layout
    x_blocks, w_blocks, outputs = layout(x, w, parts, total)
    figure, plot_px = _grid(x, w, outputs, TITLES[split][1:])
    top = _largest(x + w) or 1
    _matrix(figure, 1, 1, x, x_blocks, top, "X", max(len(x), len(w)))
    _matrix(figure, 1, 2, w, w_blocks, top, "W", max(len(x), len(w)))
    _draw_outputs(figure, outputs, with_signs=split == "row")
    _legend_of_ranks(figure, len(parts))
    _finish(figure, TITLES[split][0] if title is None else title, plot_px, width_cells=len(x[0]) + len(w[0]))
    return figure


def _column_layout(x: list, w: list, parts: list, total: list) -> tuple[list, list, list]:
    """Outlines of X (none) and W (rank r's columns), and the one output: Y, each rank's columns outlined."""
    widths = [len(p[0]) for p in parts]
    if sum(widths) != len(w[0]):
        raise ValueError(f"the ranks' blocks have {sum(widths)} columns but W has {len(w[0])}.")
    gathered = "Y = X W after the AllGather: rank r's block is its X W_r"
    return [], _blocks(widths, True, len(w)), [(gathered, total, _blocks(widths, True, len(total)))]


def _row_layout(x: list, w: list, parts: list, total: list) -> tuple[list, list, list]:
    """Outlines of X (rank r's features) and W (rank r's rows), and the outputs: each rank's partial sum,
    outlined whole in its colour, then their sum."""
    heights = shard_sizes(len(w), len(parts))
    whole = [(0, len(total[0]), 0, len(total), r) for r in range(len(parts))]
    outputs = [(f"rank {r}: partial sum X_{r} W_{r}", part, [whole[r]]) for r, part in enumerate(parts)]
    outputs.append(("Y = X W: the partial sums added by the AllReduce", total, []))
    return _blocks(heights, True, len(x)), _blocks(heights, False, len(w[0])), outputs


def _grid(x: list, w: list, outputs: list, titles: tuple[str, str]) -> tuple[go.Figure, int]:
    """The subplots: X and W side by side on top, then one row per output in the right column; each row as
    tall as its matrix. Returns the figure and the height of the plotting area in pixels."""
    rows = 1 + len(outputs)
    row_heights = [max(len(x), len(w))] + [len(m) for _, m, _ in outputs]
    plot_px = CELL_PX * sum(row_heights) + GAP_PX * (rows - 1)
    figure = make_subplots(rows=rows, cols=2, column_widths=[len(x[0]), len(w[0])], row_heights=row_heights,
                           horizontal_spacing=0.06, vertical_spacing=GAP_PX / plot_px,
                           subplot_titles=[*titles] + [t for name, _, _ in outputs for t in ("", name)])
    for i in range(2, rows + 1):  # the left column below X stays empty
        figure.update_xaxes(visible=False, row=i, col=1)
        figure.update_yaxes(visible=False, row=i, col=1)
    return figure, plot_px


def _draw_outputs(figure: go.Figure, outputs: list, with_signs: bool) -> None:
    """The output matrices, one per row from row 2; `with_signs` writes "+" before each partial sum after the
    first and "=" before the total, in the empty left column (Y_0 + Y_1 + ... = Y)."""
    low = _largest([row for _, m, _ in outputs for row in m]) or 1
    for i, (_, matrix, blocks) in enumerate(outputs):
        _matrix(figure, i + 2, 2, matrix, blocks, low, "Y", len(matrix))
        if with_signs and i > 0:
            cell = figure.get_subplot(i + 2, 2)
            y0, y1 = cell.yaxis.domain
            figure.add_annotation(text="=" if i == len(outputs) - 1 else "+", x=cell.xaxis.domain[0], xref="paper",
                                  xanchor="right", xshift=-12, y=(y0 + y1) / 2, yref="paper",
                                  showarrow=False, font={"size": 28})


def _legend_of_ranks(figure: go.Figure, ranks: int) -> None:
    """A legend entry per rank: an open square in its outline colour."""
    for r in range(ranks):
        figure.add_scatter(x=[None], y=[None], mode="markers", name=f"rank {r}", showlegend=True,
                           marker={"symbol": "square-open", "size": 14, "color": rank_color(r), "line": {"width": 3}})


def _finish(figure: go.Figure, title: str, plot_px: int, width_cells: int) -> None:
    """Axes without ticks or grid, the title on top, the legend of outlines under it, the size from the cells."""
    figure.update_xaxes(showticklabels=False, showgrid=False, zeroline=False)
    figure.update_yaxes(showticklabels=False, showgrid=False, zeroline=False)
    figure.update_layout(title={"text": title, "y": 1, "yref": "container", "yanchor": "top", "pad": {"t": 14}},
                         width=min(900, CELL_PX * width_cells + 240), height=plot_px + 120,
                         margin={"t": 100, "b": 20, "l": 20, "r": 20}, plot_bgcolor=WHITE,
                         legend={"orientation": "h", "x": 0, "y": 1 - 42 / (plot_px + 120), "yref": "container",
                                 "yanchor": "top", "title": {"text": "outlined:"}})


def _matrix(figure, row: int, col: int, values: list, blocks: list, top: float, name: str, height: int) -> None:
    """One heatmap, row 0 at the top, with each (x0, x1, y0, y1, rank) block outlined in its rank's colour."""
    owner = [[None] * len(values[0]) for _ in values]
    for x0, x1, y0, y1, rank in blocks:
        for i in range(y0, y1):
            for j in range(x0, x1):
                owner[i][j] = rank
    values = [[v + 0.0 for v in row] for row in values]  # -0.0 reads 0
    hover = [[f"{name}[{i}, {j}] = {v:g}" + ("" if owner[i][j] is None else f", rank {owner[i][j]}'s")
              for j, v in enumerate(row)] for i, row in enumerate(values)]
    figure.add_trace(go.Heatmap(z=values, text=[[f"{v:g}" for v in row] for row in values], texttemplate="%{text}",
                                hovertext=hover, hoverinfo="text", zmin=-top, zmax=top, colorscale=PALE_DIVERGING,
                                showscale=False, xgap=1, ygap=1), row=row, col=col)
    figure.update_yaxes(range=[height - 0.5, -0.5], row=row, col=col)
    figure.update_xaxes(range=[-0.5, len(values[0]) - 0.5], row=row, col=col)
    for x0, x1, y0, y1, rank in blocks:
        figure.add_shape(type="rect", x0=x0 - 0.5, x1=x1 - 0.5, y0=y0 - 0.5, y1=y1 - 0.5, row=row, col=col,
                         line={"color": rank_color(rank), "width": 4})


def _blocks(sizes: list[int], columns: bool, span: int) -> list[tuple]:
    """(x0, x1, y0, y1, rank) of consecutive blocks of the given sizes: blocks of columns, each `span` rows
    tall, or blocks of rows, each `span` columns wide."""
    out, start = [], 0
    for rank, size in enumerate(sizes):
        out.append((start, start + size, 0, span, rank) if columns else (0, span, start, start + size, rank))
        start += size
    return out


def _largest(rows: list) -> float:
    return max((abs(v) for row in rows for v in row), default=0)


def _rows(matrix) -> list[list[float]]:
    rows = matrix.tolist() if hasattr(matrix, "tolist") else [list(row) for row in matrix]
    if not rows or not all(isinstance(row, list) and len(row) == len(rows[0]) > 0 for row in rows):
        raise ValueError("a matrix is a non-empty list of equally long rows (or a 2-D tensor).")
    return rows
