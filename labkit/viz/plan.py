"""Figures for the planning arithmetic: memory per GPU against the GPU's memory, and speedup against bandwidth."""

from __future__ import annotations

import plotly.graph_objects as go

from labkit.plan import GB, ring_allreduce_bytes
from labkit.plan.time import data_parallel_speedup

PARTS = {"weights": "#4c78a8", "grads": "#f58518", "optimizer": "#54a24b"}


def memory_bars(plans: dict[str, dict[str, float]], gpu_nbytes: float | None = None, figure=None) -> go.Figure:
    """One stacked bar per plan: bytes per GPU of weights, grads and optimizer state (`training_memory`'s dicts),
    with the GPU's memory as a dashed line. Pass a `go.FigureWidget` as `figure` to redraw it in place."""
    figure = figure if figure is not None else go.Figure()
    labels = list(plans)
    with figure.batch_update():
        figure.data = []
        for part, color in PARTS.items():
            figure.add_bar(x=labels, y=[plans[label][part] / GB for label in labels], name=part, marker_color=color,
                           hovertemplate="%{x}: %{y:.1f} GB<extra>" + part + "</extra>")
        _horizontal_line(figure, gpu_nbytes / GB if gpu_nbytes else None, f"GPU memory {(gpu_nbytes or 0) / GB:g} GB",
                         "#e45756")
        figure.update_layout(barmode="stack", title="Memory per GPU before activations", yaxis_title="GB (1e9 bytes)",
                             height=380, margin={"t": 50})
    return figure


def speedup_chart(devices: int, compute_seconds: float, gradient_nbytes: float, bandwidths, overlaps=(0.0, 0.9),
                  figure=None, marker_bandwidth: float | None = None) -> go.Figure:
    """Data-parallel speedup over one GPU against per-rank bandwidth (bytes/s), one line per overlap fraction:
    the ring AllReduce of `gradient_nbytes` on `devices` ranks costs ring_allreduce_bytes / bandwidth per step."""
    figure = figure if figure is not None else go.Figure()
    nbytes = ring_allreduce_bytes(gradient_nbytes, devices)
    rates = list(bandwidths)
    with figure.batch_update():
        figure.data = []
        for overlap in overlaps:
            speedups = [data_parallel_speedup(devices, compute_seconds, nbytes / b, overlap) for b in rates]
            figure.add_scatter(x=[b / GB for b in rates], y=speedups, mode="lines",
                               name=f"{overlap:.0%} of the AllReduce hidden behind backward")
        if marker_bandwidth:
            figure.add_scatter(x=[marker_bandwidth / GB], y=[data_parallel_speedup(
                devices, compute_seconds, nbytes / marker_bandwidth, overlaps[0])], mode="markers",
                name="your link", marker={"size": 12, "color": "#e45756"})
        _horizontal_line(figure, devices, f"{devices}x: communication for free", "#888888")
        figure.update_layout(title=f"Speedup of {devices} data-parallel GPUs over one", xaxis_type="log",
                             xaxis_title="per-rank bandwidth, GB/s (one direction)", yaxis_title="speedup",
                             yaxis_range=[0, devices * 1.08], height=380, margin={"t": 50})
    return figure


def _horizontal_line(figure, y: float | None, text: str, color: str) -> None:
    """Replace the figure's one labelled horizontal line (add_hline cannot run inside a FigureWidget's
    batch_update, and would pile up lines on every redraw)."""
    line = {"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": y, "y1": y,
            "line": {"dash": "dash", "color": color}}
    label = {"xref": "paper", "x": 1, "y": y, "text": text, "showarrow": False, "yanchor": "bottom", "xanchor": "right"}
    figure.layout.shapes = [] if y is None else [line]
    figure.layout.annotations = [] if y is None else [label]
