"""Figures of training runs: replicas drifting apart, loss curves side by side, DDP's backward timeline and one
FullyShardedDP step's timeline."""

from __future__ import annotations

import plotly.graph_objects as go

from labkit.viz.style import BLUE, GREY, PALETTE, RED, log_axis

__all__ = ["FSDP_LANES", "ddp_timeline", "divergence_chart", "fsdp_timeline", "loss_curves", "unit_label"]

FSDP_LANES = {"all_gather": "all-gather", "compute": "compute", "reduce_scatter": "reduce-scatter"}  # top down


def divergence_chart(differences: dict[str, list[float]], title: str = "How far each replica drifts from rank 0"
                     ) -> go.Figure:
    """One line per replica: its largest parameter difference from rank 0 after each step. Zeros (identical
    replicas) cannot go on a log axis, so the axis is linear when every value is zero; a log axis labels only
    round numbers (viz.style.log_axis)."""
    figure = go.Figure()
    for i, (name, values) in enumerate(differences.items()):
        figure.add_scatter(x=list(range(1, len(values) + 1)), y=values, name=name, mode="lines+markers",
                           line={"color": PALETTE[i % len(PALETTE)]})
    drifts = [v for values in differences.values() for v in values]
    figure.update_layout(title=title, xaxis_title="optimizer step", height=380)
    yaxis_title = "max |parameter - rank 0's|"
    if any(v > 0 for v in drifts):
        figure.update_yaxes(**log_axis(yaxis_title, drifts))
    else:
        figure.update_yaxes(type="linear", title_text=yaxis_title)
    return figure


def loss_curves(curves: dict[str, tuple[list[float], list[float]]], title: str, xaxis_title: str) -> go.Figure:
    """One line per run: `curves[name] = (x values, losses)`."""
    figure = go.Figure()
    for i, (name, (x, losses)) in enumerate(curves.items()):
        figure.add_scatter(x=x, y=losses, name=name, mode="lines", line={"color": PALETTE[i % len(PALETTE)]})
    figure.update_layout(title=title, xaxis_title=xaxis_title, yaxis_title="training loss", height=400)
    return figure


def ddp_timeline(events, title: str = "One backward pass: gradients ready, buckets all-reduced") -> go.Figure:
    """A Gantt chart of a BucketedDDP timeline (its `Event`s): a tick per gradient as the backward produces it,
    a bar per bucket's all_reduce from launch to completion, and the wait in finish(). Milliseconds."""
    figure = go.Figure()
    grads = [e for e in events if e.kind == "grad"]
    figure.add_scatter(x=[e.start * 1e3 for e in grads], y=["backward: gradient ready"] * len(grads),
                       mode="markers", marker={"symbol": "line-ns-open", "size": 18, "color": BLUE},
                       text=[e.name for e in grads], hovertemplate="%{text} at %{x:.2f} ms<extra></extra>",
                       name="gradient ready")
    for e in (e for e in events if e.kind != "grad"):
        row = "finish(): waiting" if e.kind == "finish" else f"all_reduce bucket {e.bucket}"
        figure.add_bar(base=[e.start * 1e3], x=[(e.end - e.start) * 1e3], y=[row], orientation="h",
                       marker_color=RED if e.kind == "finish" else PALETTE[(e.bucket + 1) % len(PALETTE)],
                       name=row, showlegend=False,
                       hovertemplate=f"{row}: from %{{base:.2f}} ms, %{{x:.2f}} ms long, {e.nbytes / 1e6:.2f} MB"
                                     "<extra></extra>")
    figure.update_layout(title=title, xaxis_title="time since the backward started (ms)", barmode="overlay",
                         height=200 + 30 * len({e.bucket for e in events}), yaxis={"autorange": "reversed"})
    return figure


def unit_label(unit: int, module: str) -> str:
    """How the timeline names FullyShardedDP's unit number `unit`, whose module is called `module` (its
    qualified name in the model, "(root)" for the root's own parameters).

    >>> unit_label(1, "2"), unit_label(4, "(root)")
    ("unit 1 (module '2')", 'unit 4 (the root module)')
    """
    return f"unit {unit} (the root module)" if module == "(root)" else f"unit {unit} (module {module!r})"


def fsdp_timeline(events, title: str = "One FullyShardedDP step: each all-gather prefetched under compute"
                  ) -> go.Figure:
    """A Gantt chart of a FullyShardedDP timeline (its `UnitEvent`s) in milliseconds: a lane for the all-gathers,
    one for compute and one for the reduce-scatters, one colour per unit, a dotted line where the backward
    begins. A prefetched all-gather is a bar in the top lane under the bar of the unit computing meanwhile. The
    root unit's compute bar spans the whole forward (and backward), drawn first so the layers' bars lie on it:
    where it shows, the root's own layers run, or nothing does. Units are numbered in order (0, 1, 2, ...), their
    modules named beside them (`unit_label`): an nn.Sequential's Linear layers between ReLUs are its modules 0,
    2, 4, 6, which alone would read as every other unit."""
    figure = go.Figure()
    seen = set()
    for e in events:
        name = unit_label(e.unit, e.name)
        figure.add_bar(base=[e.start * 1e3], x=[(e.end - e.start) * 1e3], y=[FSDP_LANES[e.kind]], orientation="h",
                       marker_color=PALETTE[e.unit % len(PALETTE)], name=name, legendgroup=name,
                       showlegend=name not in seen, text=[f"unit {e.unit}"], textposition="inside",
                       insidetextanchor="middle",
                       hovertemplate=f"{e.kind} {name} ({e.phase}): from %{{base:.2f}} ms, %{{x:.2f}} ms long"
                                     + (f", {e.nbytes / 1e6:.3f} MB" if e.nbytes else "") + "<extra></extra>")
        seen.add(name)
    backward = [e.start for e in events if e.phase == "backward"]
    if backward:
        figure.add_vline(x=min(backward) * 1e3, line_dash="dot", line_color=GREY, annotation_text="backward")
    figure.update_layout(title=title, xaxis_title="time since the forward started (ms)", barmode="overlay",
                         height=320, legend_title_text="unit (its module)",
                         yaxis={"categoryorder": "array", "categoryarray": list(FSDP_LANES.values())[::-1]})
    return figure
