"""Pipeline figures: a Gantt chart of stages over time, and measured bubbles over the formula's curve."""

from __future__ import annotations

import plotly.graph_objects as go

from labkit.plan import bubble_fraction

FORWARD, BACKWARD = "#4c78a8", "#f58518"


def pipeline_timeline(events, title: str = "Pipeline timeline", figure=None, unit_seconds: float = 1e-3,
                      unit: str = "ms") -> go.Figure:
    """One row per stage, a bar per action (forward blue, backward orange, labelled with its micro-batch);
    the white gaps are the bubble. `events` are PipelineEvents, measured (run_pipeline) or simulated
    (simulate_pipeline, whose times are in cost units: pass unit_seconds=1, unit="time units").
    Pass a go.FigureWidget as `figure` to redraw it in place."""
    figure = figure if figure is not None else go.Figure()
    stages = sorted({e.stage for e in events})
    with figure.batch_update():
        figure.data = []
        for kind, color, name in (("F", FORWARD, "forward"), ("B", BACKWARD, "backward")):
            chosen = [e for e in events if e.kind == kind]
            figure.add_bar(base=[e.start / unit_seconds for e in chosen], x=[e.seconds / unit_seconds for e in chosen],
                           y=[f"stage {e.stage}" for e in chosen], orientation="h", marker_color=color, name=name,
                           text=[str(e.microbatch) for e in chosen], textposition="inside", insidetextanchor="middle",
                           marker_line={"color": "white", "width": 1},
                           hovertemplate="%{y}: " + name + " of micro-batch %{text}<extra></extra>")
        figure.update_layout(title=title, barmode="overlay", xaxis_title=unit, height=140 + 45 * len(stages),
                             yaxis={"autorange": "reversed", "categoryorder": "array",
                                    "categoryarray": [f"stage {s}" for s in stages]}, margin={"t": 50})
    return figure


def bubble_chart(measured: dict[str, dict[int, float]], stages: int, most_microbatches: int = 32) -> go.Figure:
    """The bubble fraction (p-1)/(m+p-1) against micro-batches m, with measured points per schedule:
    `measured[name] = {m: bubble}`."""
    ms = list(range(1, most_microbatches + 1))
    figure = go.Figure(go.Scatter(x=ms, y=[bubble_fraction(stages, m) for m in ms], mode="lines",
                                  name=f"(p-1)/(m+p-1), p = {stages}"))
    for name, points in measured.items():
        figure.add_scatter(x=list(points), y=list(points.values()), mode="markers", name=f"measured, {name}",
                           marker={"size": 10})
    figure.update_layout(title=f"Pipeline bubble, {stages} stages", xaxis_title="micro-batches m", xaxis_type="log",
                         yaxis_title="idle share of the time", height=380)
    return figure
