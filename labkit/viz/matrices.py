"""Matrices drawn as matrices: Y = X W computed by several ranks, each rank's block of X, W and Y outlined in
its colour (Megatron-LM's column- and row-parallel linears, Shoeybi et al. 2019, section 3)."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

RANK_COLORS = ["#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666666"]
CELL_PX = 40  # one matrix element; 4 + 12 columns stay under 900 px
GAP_PX = 60  # between rows of matrices: room for a subplot title


def split_matmul(x, w, parts, total, split: str, title: str | None = None) -> go.Figure:
    """Y = X W split over len(parts) ranks, as heatmaps with the values written in the cells.

    split="column": rank r holds a block of W's columns and computes Y_r = X W_r (`parts[r]`), that block
    of Y's columns; `total` is Y after the AllGather, its blocks outlined by the rank that computed them.
    split="row": rank r holds a block of W's rows and the matching columns (features) of X, as
    torch.tensor_split cuts them, and computes a full-size partial sum X_r W_r (`parts[r]`), drawn one
    under the other; `total` is Y after the AllReduce, their sum.
    Matrices are nested lists or anything with .tolist() (tensors)."""
    if split not in ("column", "row"):
        raise ValueError(f"split={split!r}: use 'column' or 'row'.")
    x, w, total = _rows(x), _rows(w), _rows(total)
    parts = [_rows(p) for p in parts]
    ranks = len(parts)
    if split == "column":
        widths = [len(p[0]) for p in parts]
        if sum(widths) != len(w[0]):
            raise ValueError(f"the ranks' blocks have {sum(widths)} columns but W has {len(w[0])}.")
        w_blocks, x_blocks = _blocks(widths, True, len(w)), []
        gathered = "Y = X W after the AllGather: rank r's block is its X W_r"
        outputs = [(gathered, total, _blocks(widths, True, len(total)))]
    else:
        heights = _even(len(w), ranks)
        w_blocks, x_blocks = _blocks(heights, False, len(w[0])), _blocks(heights, True, len(x))
        whole = [(0, len(total[0]), 0, len(total), r) for r in range(ranks)]
        outputs = [(f"rank {r}: partial sum X_{r} W_{r}", part, [whole[r]]) for r, part in enumerate(parts)]
        outputs.append(("Y = X W: the partial sums added by the AllReduce", total, []))

    top = _largest(x + w) or 1
    low = _largest([row for _, m, _ in outputs for row in m]) or 1
    x_title = "X: every rank has all of it" if split == "column" else "X: rank r uses columns X_r"
    w_title = "W: rank r holds columns W_r" if split == "column" else "W: rank r holds rows W_r"
    rows = 1 + len(outputs)
    row_heights = [max(len(x), len(w))] + [len(m) for _, m, _ in outputs]
    plot_px = CELL_PX * sum(row_heights) + GAP_PX * (rows - 1)
    figure = make_subplots(rows=rows, cols=2, column_widths=[len(x[0]), len(w[0])], row_heights=row_heights,
                           horizontal_spacing=0.06, vertical_spacing=GAP_PX / plot_px,
                           subplot_titles=[x_title, w_title] + [t for name, _, _ in outputs for t in ("", name)])
    _matrix(figure, 1, 1, x, x_blocks, top, "X", row_heights[0])
    _matrix(figure, 1, 2, w, w_blocks, top, "W", row_heights[0])
    for i, (_, matrix, blocks) in enumerate(outputs):
        _matrix(figure, i + 2, 2, matrix, blocks, low, "Y", len(matrix))
        if split == "row" and i > 0:  # Y_0 + Y_1 + ... = Y, written in the empty left column
            cell = figure.get_subplot(i + 2, 2)
            y0, y1 = cell.yaxis.domain
            figure.add_annotation(text="=" if i == len(outputs) - 1 else "+", x=cell.xaxis.domain[0], xref="paper",
                                  xanchor="right", xshift=-12, y=(y0 + y1) / 2, yref="paper",
                                  showarrow=False, font={"size": 28})
    for r in range(ranks):  # legend entries for the outline colours
        figure.add_scatter(x=[None], y=[None], mode="markers", name=f"rank {r}", showlegend=True,
                           marker={"symbol": "square-open", "size": 14, "color": RANK_COLORS[r % len(RANK_COLORS)],
                                   "line": {"width": 3}})
    figure.update_xaxes(showticklabels=False, showgrid=False, zeroline=False)
    figure.update_yaxes(showticklabels=False, showgrid=False, zeroline=False)
    for i in range(2, rows + 1):  # the left column below X stays empty
        figure.update_xaxes(visible=False, row=i, col=1)
        figure.update_yaxes(visible=False, row=i, col=1)
    if title is None:
        title = ("Column split: each rank computes some of Y's columns" if split == "column"
                 else "Row split: each rank computes a full-size partial sum of Y")
    figure.update_layout(title={"text": title, "y": 1, "yref": "container", "yanchor": "top", "pad": {"t": 14}},
                         width=min(900, CELL_PX * (len(x[0]) + len(w[0])) + 240), height=plot_px + 120,
                         margin={"t": 100, "b": 20, "l": 20, "r": 20}, plot_bgcolor="white",
                         legend={"orientation": "h", "x": 0, "y": 1 - 42 / (plot_px + 120), "yref": "container",
                                 "yanchor": "top", "title": {"text": "outlined:"}})
    return figure


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
                                hovertext=hover, hoverinfo="text", zmin=-top, zmax=top, colorscale="RdBu",
                                showscale=False, xgap=1, ygap=1), row=row, col=col)
    figure.update_yaxes(range=[height - 0.5, -0.5], row=row, col=col)
    figure.update_xaxes(range=[-0.5, len(values[0]) - 0.5], row=row, col=col)
    for x0, x1, y0, y1, rank in blocks:
        figure.add_shape(type="rect", x0=x0 - 0.5, x1=x1 - 0.5, y0=y0 - 0.5, y1=y1 - 0.5, row=row, col=col,
                         line={"color": RANK_COLORS[rank % len(RANK_COLORS)], "width": 4})


def _blocks(sizes: list[int], columns: bool, span: int) -> list[tuple]:
    """(x0, x1, y0, y1, rank) of consecutive blocks of the given sizes: blocks of columns, each `span` rows
    tall, or blocks of rows, each `span` columns wide."""
    out, start = [], 0
    for rank, size in enumerate(sizes):
        out.append((start, start + size, 0, span, rank) if columns else (0, span, start, start + size, rank))
        start += size
    return out


def _even(n: int, parts: int) -> list[int]:
    """torch.tensor_split's sizes: n items in `parts` blocks, the first n % parts one longer."""
    return [n // parts + (1 if r < n % parts else 0) for r in range(parts)]


def _largest(rows: list) -> float:
    return max((abs(v) for row in rows for v in row), default=0)


def _rows(matrix) -> list[list[float]]:
    rows = matrix.tolist() if hasattr(matrix, "tolist") else [list(row) for row in matrix]
    if not rows or not all(isinstance(row, list) and len(row) == len(rows[0]) > 0 for row in rows):
        raise ValueError("a matrix is a non-empty list of equally long rows (or a 2-D tensor).")
    return rows
