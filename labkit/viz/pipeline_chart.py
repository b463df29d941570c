"""Pipeline figures: a Gantt chart of stages over time, and measured bubbles over the formula's curve."""

from __future__ import annotations

import plotly.graph_objects as go

from labkit.checks import items
from labkit.plan import bubble_fraction
from labkit.viz.style import BLUE, GREEN, ORANGE, WHITE, tint

__all__ = ["bubble_chart", "pipeline_timeline"]

FORWARD, BACKWARD, WEIGHT = BLUE, ORANGE, GREEN
# one look per measured schedule, so that equal bubbles (GPipe's and 1F1B's are) show both: a ring around a cross
MARKERS = ({"symbol": "circle-open", "size": 16, "line": {"width": 2}}, {"symbol": "x", "size": 8},
           {"symbol": "diamond-open", "size": 12, "line": {"width": 2}})


def pipeline_timeline(events, title: str = "Pipeline timeline", unit_seconds: float = 1e-3,
                      unit: str = "ms") -> go.Figure:
    """One row per stage, a bar per action (forward blue, backward orange, labelled with its micro-batch where
    the bar is wide enough to read it, and its chunk after a dot when the schedule has several: "3.1", the odd
    chunks' bars paler; hovering tells each bar's duration and start; where
    the backward is split (zero bubble), its input-gradient half B orange, its weight-gradient half W green, and a
    whole backward in such a schedule, BW, hatched orange);
    the white gaps are the bubble. `events` are PipelineEvents, measured (run_pipeline) or simulated
    (simulate_pipeline, whose times are in cost units: pass unit_seconds=1, unit="time units")."""
    stages = sorted({e.stage for e in events})
    chunked = any(e.chunk for e in events)
    split = any(e.kind == "W" for e in events)
    figure = go.Figure()
    kinds = [("F", FORWARD, "forward"), ("B", BACKWARD, "backward B (input gradient)" if split else "backward")]
    kinds += [("W", WEIGHT, "backward W (weight gradient)")] if split else []
    kinds += [("BW", BACKWARD, "backward, whole (B and W)")] if any(e.kind == "BW" for e in events) else []
    for kind, color, name in kinds:
        chosen = [e for e in events if e.kind == kind]
        figure.add_bar(base=[e.start / unit_seconds for e in chosen], x=[e.seconds / unit_seconds for e in chosen],
                       y=[f"stage {e.stage}" for e in chosen], orientation="h", name=name,
                       marker_color=[tint(color, 0.55) if e.chunk % 2 else color for e in chosen],
                       customdata=[[e.seconds / unit_seconds, e.start / unit_seconds] for e in chosen],
                       text=[f"{e.microbatch}.{e.chunk}" if chunked else str(e.microbatch) for e in chosen],
                       textposition="inside", insidetextanchor="middle",
                       marker_line={"color": WHITE, "width": 1},
                       marker_pattern_shape="/" if kind == "BW" else "",  # a whole backward: hatched orange
                       hovertemplate="%{y}: " + name + " of micro-batch" + (".chunk" if chunked else "") +
                       " %{text}: %{customdata[0]:.3g} " + unit + ", from %{customdata[1]:.3g}<extra></extra>")
    figure.update_layout(title=title, barmode="overlay", xaxis_title=f"time, {unit}", height=140 + 45 * len(stages),
                         uniformtext={"minsize": 10, "mode": "hide"},  # no label squeezed below 10 px: hidden
                         yaxis={"autorange": "reversed", "categoryorder": "array",
                                "categoryarray": [f"stage {s}" for s in stages]}, margin={"t": 50})
    return figure


def bubble_chart(measured: dict[str, dict[int, float]], stages: int, most_microbatches: int = 32,
                 chunks: tuple[int, ...] = (1,), simulated: dict[str, dict[int, float]] | None = None) -> go.Figure:
    """The bubble fraction (p-1)/(m+p-1) against micro-batches m, with measured points per schedule:
    `measured[name] = {m: bubble}`, each schedule in its own marker so that coinciding points stay visible;
    one curve per number of chunks v in `chunks` ((p-1)/(v m+p-1): interleaved 1F1B with v chunks per stage);
    `simulated[name] = {m: bubble}` (simulate_pipeline with priced hand-overs), a dotted line per schedule.
    The log axis is labelled at powers of two, the m one usually tries."""
    ms = list(range(1, most_microbatches + 1))
    figure = go.Figure()
    for v in items("chunks", chunks, "a tuple of chunk counts, as (1, 2)"):
        figure.add_scatter(x=ms, y=[bubble_fraction(stages, m, v) for m in ms], mode="lines",
                           name=f"(p-1)/(m+p-1), p = {stages}" if v == 1 else f"(p-1)/({v}m+p-1), {v} chunks")
    for i, (name, points) in enumerate((simulated or {}).items()):
        figure.add_scatter(x=list(points), y=list(points.values()), mode="lines", name=f"simulated, {name}",
                           line={"dash": "dot" if i % 2 == 0 else "dash"})
    for i, (name, points) in enumerate(measured.items()):
        figure.add_scatter(x=list(points), y=list(points.values()), mode="markers", name=f"measured, {name}",
                           marker=MARKERS[i % len(MARKERS)])
    twos = [2**k for k in range(most_microbatches.bit_length()) if 2**k <= most_microbatches]
    figure.update_layout(title=f"Pipeline bubble, {stages} stages",
                         xaxis={"type": "log", "title": "micro-batches m", "tickvals": twos,
                                "ticktext": [str(m) for m in twos]},
                         yaxis={"title": "bubble: idle share of the stages' time", "tickformat": ".0%",
                                "rangemode": "tozero"}, height=380)
    return figure
