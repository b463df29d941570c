"""The ring, animated: who sends which chunk to whom at every step, and what each rank then holds.

`ring_animation(events, world_size)` draws a trace of transfers (from `labkit.comm.traced()` on a
real run, or `labkit.comm.simulate`): ranks on a circle with arrows for the current step's
transfers and each rank's bytes sent so far, next to a grid of ranks x chunks coloured by how many
ranks' contributions each chunk holds. When every cell reaches N, the AllReduce is done. The figure
uses plotly frames, a play button and a step slider, so it works in JupyterLab and in static HTML.
"""

from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.comm.transport import Transfer

MAX_WORLD_SIZE = 16
_ADDS = {"reduce-scatter", "gather", "reduce"}  # phases whose receiver adds what arrives


def contributions_by_step(events: list[Transfer], world_size: int) -> list[list[list[int]]]:
    """counts[k][r][c]: how many ranks' data rank r's chunk c holds after k steps (k = 0: before any).

    A transfer of a whole tensor (chunk None) carries every chunk."""
    held = [[{r} for _ in range(world_size)] for r in range(world_size)]
    counts = [[[len(s) for s in row] for row in held]]
    for step in sorted({e.step for e in events}):
        before = [[set(s) for s in row] for row in held]
        for e in (e for e in events if e.step == step):
            chunks = range(world_size) if e.chunk is None else [e.chunk]
            for c in chunks:
                incoming = before[e.src][c]
                held[e.dst][c] = held[e.dst][c] | incoming if e.phase in _ADDS else set(incoming)
        counts.append([[len(s) for s in row] for row in held])
    return counts


def ring_animation(events: list[Transfer], world_size: int, title: str = "Ring AllReduce") -> go.Figure:
    """An animated figure of `events` on `world_size` ranks (2 to 16)."""
    if not 2 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"ring_animation draws 2 to {MAX_WORLD_SIZE} ranks, got world_size={world_size}.")
    if any(not 0 <= e.src < world_size or not 0 <= e.dst < world_size for e in events):
        raise ValueError(f"the events name ranks outside 0..{world_size - 1}: was world_size right?")
    steps = sorted({e.step for e in events})
    counts = contributions_by_step(events, world_size)
    xs, ys = _circle(world_size)
    figure = make_subplots(rows=1, cols=2, column_widths=[0.5, 0.5], horizontal_spacing=0.12,
                           subplot_titles=("who sends what", "contributions each chunk holds"))
    figure.add_trace(go.Scatter(x=xs + xs[:1], y=ys + ys[:1], mode="lines", line={"color": "#ccc", "width": 1},
                                hoverinfo="skip", showlegend=False), row=1, col=1)
    figure.add_trace(go.Scatter(x=xs, y=ys, mode="markers+text", marker={"size": 34, "color": "#4c78a8"},
                                text=[str(r) for r in range(world_size)], textfont={"color": "white", "size": 13},
                                hoverinfo="skip", showlegend=False), row=1, col=1)
    figure.add_trace(_sent_trace(xs, ys, [0] * world_size), row=1, col=1)
    figure.add_trace(_grid_trace(counts[0], world_size), row=1, col=2)
    frames = []
    for k in range(len(steps) + 1):
        current = [e for e in events if k and e.step == steps[k - 1]]
        sent = [sum(e.nbytes for e in events if e.src == r and k and e.step <= steps[k - 1]) for r in range(world_size)]
        frames.append(go.Frame(name=str(k), traces=[2, 3],
                               data=[_sent_trace(xs, ys, sent), _grid_trace(counts[k], world_size)],
                               layout={"annotations": _subplot_titles(figure) + _arrows(current, xs, ys),
                                       "title": {"text": _caption(title, current, k, len(steps))}}))
    figure.frames = frames
    figure.update_layout(
        title={"text": _caption(title, [], 0, len(steps))}, height=460, margin={"t": 80, "b": 90},
        plot_bgcolor="white",
        updatemenus=[_play_pause()], sliders=[_slider(len(steps))], showlegend=False,
    )
    figure.update_xaxes(visible=False, range=[-1.7, 1.7], row=1, col=1)
    figure.update_yaxes(visible=False, range=[-1.4, 1.4], scaleanchor="x", row=1, col=1)
    figure.update_xaxes(title_text="chunk", dtick=1, row=1, col=2)
    figure.update_yaxes(title_text="rank", dtick=1, autorange="reversed", row=1, col=2)
    return figure


def _circle(n: int) -> tuple[list[float], list[float]]:
    angles = [math.pi / 2 - 2 * math.pi * r / n for r in range(n)]  # rank 0 on top, clockwise
    return [math.cos(a) for a in angles], [math.sin(a) for a in angles]


def _sent_trace(xs, ys, sent_nbytes) -> go.Scatter:
    """Each rank's bytes sent so far, written beside its marker, away from the circle's centre."""
    positions = [("top center" if y > 0.5 else "bottom center" if y < -0.5 else
                  "middle right" if x > 0 else "middle left") for x, y in zip(xs, ys, strict=True)]
    return go.Scatter(x=xs, y=ys, mode="markers+text", marker={"size": 36, "opacity": 0},
                      text=[f"sent {_bytes(b)}" for b in sent_nbytes], textposition=positions,
                      textfont={"size": 10, "color": "#555"}, customdata=sent_nbytes, hoverinfo="skip",
                      showlegend=False)


def _grid_trace(counts, world_size: int) -> go.Heatmap:
    return go.Heatmap(z=counts, zmin=1, zmax=world_size, colorscale="Blues", xgap=2, ygap=2,
                      text=counts, texttemplate="%{text}", colorbar={"title": "ranks in it", "x": 1.02},
                      hovertemplate="rank %{y}, chunk %{x}: holds %{z} ranks' data<extra></extra>")


def _arrows(current: list[Transfer], xs, ys) -> list[dict]:
    arrows = []
    for e in current:
        label = "all" if e.chunk is None else str(e.chunk)
        arrows.append({"x": 0.8 * xs[e.dst], "y": 0.8 * ys[e.dst], "ax": 0.8 * xs[e.src], "ay": 0.8 * ys[e.src],
                       "xref": "x", "yref": "y", "axref": "x", "ayref": "y", "showarrow": True, "arrowhead": 3,
                       "arrowsize": 1.3, "arrowwidth": 2, "arrowcolor": "#e45756", "text": "", "standoff": 4})
        arrows.append({"x": 0.55 * (xs[e.src] + xs[e.dst]), "y": 0.55 * (ys[e.src] + ys[e.dst]), "xref": "x",
                       "yref": "y", "text": f"chunk {label}", "showarrow": False, "font": {"size": 10,
                                                                                         "color": "#e45756"}})
    return arrows


def _caption(title: str, current: list[Transfer], k: int, total: int) -> str:
    if not k:
        return f"{title}: before the first step (each rank holds only its own data)"
    phase = current[0].phase if current else ""
    nbytes = sum(e.nbytes for e in current)
    return f"{title}: step {k} of {total}, {phase}, {len(current)} transfers, {_bytes(nbytes)} in flight"


def _bytes(nbytes: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes:.0f} B"


def _subplot_titles(figure: go.Figure) -> list[dict]:
    return [a.to_plotly_json() for a in figure.layout.annotations]


def _play_pause() -> dict:
    return {"type": "buttons", "direction": "left", "x": 0.0, "y": -0.12, "xanchor": "left", "yanchor": "top",
            "buttons": [
                {"label": "Play", "method": "animate",
                 "args": [None, {"frame": {"duration": 900, "redraw": True}, "fromcurrent": True,
                                 "transition": {"duration": 0}}]},
                {"label": "Pause", "method": "animate",
                 "args": [[None], {"frame": {"duration": 0, "redraw": False}, "mode": "immediate"}]},
            ]}


def _slider(total_steps: int) -> dict:
    return {"active": 0, "x": 0.15, "y": -0.08, "len": 0.85, "currentvalue": {"prefix": "step "},
            "steps": [{"label": str(k), "method": "animate",
                       "args": [[str(k)], {"frame": {"duration": 0, "redraw": True}, "mode": "immediate"}]}
                      for k in range(total_steps + 1)]}
