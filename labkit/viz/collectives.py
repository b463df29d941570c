"""What a collective did: every rank's tensor before and after, side by side."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.viz.style import DIVERGING

__all__ = ["before_after"]


def before_after(name: str, before: list, after: list) -> go.Figure:
    """Two grids, rows = ranks: each rank's values before and after `name`. Values are lists of numbers
    (tensors: call .tolist() first); ranks may hold different lengths."""
    if len(before) != len(after):
        raise ValueError(f"before has {len(before)} ranks but after has {len(after)}.")
    figure = make_subplots(rows=1, cols=2, subplot_titles=("before", "after"), horizontal_spacing=0.08)
    top = max((abs(v) for row in before + after for v in _flat(row)), default=1) or 1
    for col, rows in ((1, before), (2, after)):
        values = [_flat(row) for row in rows]
        width = max((len(v) for v in values), default=0)
        z = [v + [None] * (width - len(v)) for v in values]
        figure.add_trace(go.Heatmap(z=z, text=[[("" if x is None else f"{x:g}") for x in row] for row in z],
                                    texttemplate="%{text}", zmin=-top, zmax=top, colorscale=DIVERGING,
                                    showscale=False, xgap=2, ygap=2,
                                    hovertemplate="rank %{y}, element %{x}: %{z}<extra></extra>"), row=1, col=col)
    figure.update_yaxes(title_text="rank", dtick=1, autorange="reversed")
    figure.update_xaxes(title_text="element", dtick=1)
    figure.update_layout(title=name, height=150 + 40 * len(before), margin={"t": 70})
    return figure


def _flat(row) -> list:
    if isinstance(row, (int, float)):
        return [row]
    out = []
    for item in row:
        out.extend(_flat(item))
    return out
