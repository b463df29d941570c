"""Causal attention's work shared out by context parallelism: the (query, key) pairs each rank computes, drawn as
the mask itself, for the contiguous split and for the zig-zag (head-tail) one, side by side (labkit.plan.
context_parallel.context_layout; Liu et al. 2023, ring attention; torch's _HeadTailLoadBalancer)."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.plan.context_parallel import attention_work, context_layout
from labkit.viz.style import DARK_GREY, WHITE, clear_of_toolbar, rank_color, tint

__all__ = ["causal_work_map"]


def _owners(length: int, cp: int, zigzag: bool) -> list[int]:
    """The rank that holds each position."""
    owner = [0] * length
    for rank, chunks in enumerate(context_layout(length, cp, zigzag)):
        for start, stop in chunks:
            owner[start:stop] = [rank] * (stop - start)
    return owner


def _mask_by_rank(length: int, cp: int, zigzag: bool) -> list[list[int | None]]:
    """z[query][key]: the rank computing the pair, r where the causal mask keeps it (key <= query), r + cp where it
    is computed with its chunk and then masked (a diagonal chunk's upper half), else None."""
    owner, chunk = _owners(length, cp, zigzag), _chunks(length, cp, zigzag)
    return [[owner[q] if k <= q else owner[q] + cp if chunk[k] == chunk[q] else None for k in range(length)]
            for q in range(length)]


def _chunks(length: int, cp: int, zigzag: bool) -> list[int]:
    """The chunk each position belongs to (numbered in sequence order)."""
    starts = sorted(start for chunks in context_layout(length, cp, zigzag) for start, _ in chunks)
    return [sum(start <= p for start in starts) - 1 for p in range(length)]


def causal_work_map(length: int, cp: int) -> go.Figure:
    """Two heatmaps of the causal mask of a `length`-token sequence on `cp` ranks: each visible (query, key) pair in
    the colour of the rank holding the query, which computes it; contiguous on the left, zig-zag on the right, each
    titled with the busiest rank's share of the score elements computed (attention_work: a diagonal chunk's pairs
    whole). The masked half of a diagonal chunk, computed and then masked, is drawn pale."""
    titles = []
    for zigzag, name in ((False, "contiguous"), (True, "zig-zag")):
        work = attention_work(length, cp, zigzag)
        titles.append(f"{name}: busiest rank {max(work) / (sum(work) / cp):.2f}x the mean")
    figure = make_subplots(rows=1, cols=2, subplot_titles=titles, horizontal_spacing=0.08)
    colours = [rank_color(r) for r in range(cp)] + [tint(rank_color(r), 0.3) for r in range(cp)]
    top = 2 * cp - 1
    scale = [[edge, colour] for i, colour in enumerate(colours) for edge in (i / (top + 1), (i + 1) / (top + 1))]
    for col, zigzag in ((1, False), (2, True)):
        figure.add_trace(go.Heatmap(z=_mask_by_rank(length, cp, zigzag), zmin=-0.5, zmax=top + 0.5,
                                    colorscale=scale, showscale=False, xgap=1, ygap=1,
                                    hovertemplate="query %{y}, key %{x}<extra></extra>"),
                         row=1, col=col)
        figure.update_xaxes(title_text="key position", row=1, col=col, constrain="domain")
        figure.update_yaxes(title_text="query position" if col == 1 else None, autorange="reversed", row=1,
                            col=col, scaleanchor=f"x{'' if col == 1 else col}", constrain="domain")
    for rank in range(cp):  # the legend: one marker per rank
        figure.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=f"rank {rank}",
                                    marker={"color": rank_color(rank), "size": 10, "symbol": "square"}))
    figure.update_layout(title_text=f"Who computes which scores: causal attention over {length} tokens on {cp} ranks"
                                    "<br><sup>each (query, key) pair in the colour of the rank holding the query; "
                                    "pale: computed with its chunk, then masked</sup>",
                         width=820, height=520, plot_bgcolor=WHITE, font={"color": DARK_GREY},
                         legend={"orientation": "h", "y": -0.15})
    clear_of_toolbar(figure)
    figure.update_layout(margin={"t": figure.layout.margin.t + 30})  # the subplot titles below the subtitle
    return figure
