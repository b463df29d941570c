"""The ring, animated: who sends which chunk to whom at every hop, and what each rank then holds.

`ring_animation(events, world_size)` draws a trace of transfers (from `labkit.comm.traced()` on a
real run, or `labkit.comm.simulate`): ranks on a circle with arrows for the current hop's
transfers and each rank's bytes sent so far, next to a grid of ranks x chunks coloured by how many
ranks' contributions each chunk holds. When every cell reaches N, the AllReduce is done. The figure
uses plotly frames, a play button and a hop slider, so it works in JupyterLab and in static HTML.

A *hop* is one round of the ring in which every rank sends one chunk to its neighbour (`Transfer.step`
in labkit.comm); a ring AllReduce on N ranks takes 2(N-1) hops. The word "step" is kept for optimizer steps.
"""

from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.checks import MAX_WORLD_SIZE, shown, whole
from labkit.comm.transport import Transfer
from labkit.viz.style import BLUE, DARK_GREY, LIGHT_GREY, RED, SEQUENTIAL, WHITE, integer_colorbar

__all__ = ["contributions_by_hop", "ring_animation"]

_ADDS = {"reduce-scatter", "gather", "reduce"}  # phases whose receiver adds what arrives
_MARKER_PX = 34  # a rank's marker; ranks sit on a circle of radius 1
_ARROW_SHIFT = 0.04  # an arrow runs this far to the right of the line between its ranks
_LABEL_SHIFT = 0.08  # and its chunk label starts this far to the right: inside the ring, clear of the line
_RANGE = {"x": [-1.75, 1.75], "y": [-1.55, 1.55]}  # room for the "sent" labels outside the circle


def contributions_by_hop(events: list[Transfer], world_size: int) -> list[list[list[int]]]:
    """counts[k][r][c]: how many ranks' data rank r's chunk c holds after k hops (k = 0: before any).

    A transfer of a whole tensor (chunk None) carries every chunk."""
    held = [[{r} for _ in range(world_size)] for r in range(world_size)]
    counts = [[[len(s) for s in row] for row in held]]
    for hop in sorted({e.step for e in events}):
        before = [[set(s) for s in row] for row in held]
        for e in (e for e in events if e.step == hop):
            chunks = range(world_size) if e.chunk is None else [e.chunk]
            for c in chunks:
                incoming = before[e.src][c]
                held[e.dst][c] = held[e.dst][c] | incoming if e.phase in _ADDS else set(incoming)
        counts.append([[len(s) for s in row] for row in held])
    return counts


def ring_animation(events: list[Transfer], world_size: int, title: str = "Ring AllReduce") -> go.Figure:
    """An animated figure of `events` on `world_size` ranks (2 to labkit.MAX_WORLD_SIZE): one frame per hop."""
    if whole("world_size", world_size, minimum=2) > MAX_WORLD_SIZE:
        raise ValueError(f"world_size={shown(world_size)}: ring_animation draws 2 to {MAX_WORLD_SIZE} ranks; pass "
                         "fewer.")
    if any(not 0 <= e.src < world_size or not 0 <= e.dst < world_size for e in events):
        raise ValueError(f"the events name ranks outside 0..{world_size - 1}: was world_size right?")
    hops = sorted({e.step for e in events})
    counts = contributions_by_hop(events, world_size)
    xs, ys = _circle(world_size)
    figure = make_subplots(rows=1, cols=2, column_widths=[0.55, 0.45], horizontal_spacing=0.1,
                           subplot_titles=("who sends which chunk this hop", "how many ranks' data each chunk holds"))
    figure.add_trace(go.Scatter(x=xs + xs[:1], y=ys + ys[:1], mode="lines", line={"color": LIGHT_GREY, "width": 1},
                                hoverinfo="skip", showlegend=False), row=1, col=1)
    figure.add_trace(go.Scatter(x=xs, y=ys, mode="markers+text", marker={"size": _MARKER_PX, "color": BLUE},
                                text=[str(r) for r in range(world_size)], textfont={"color": WHITE, "size": 13},
                                hoverinfo="skip", showlegend=False), row=1, col=1)
    figure.add_trace(_sent_trace(xs, ys, [0] * world_size), row=1, col=1)
    figure.add_trace(_grid_trace(counts[0], world_size), row=1, col=2)
    frames = []
    for k in range(len(hops) + 1):
        current = [e for e in events if k and e.step == hops[k - 1]]
        sent = [sum(e.nbytes for e in events if e.src == r and k and e.step <= hops[k - 1]) for r in range(world_size)]
        frames.append(go.Frame(name=str(k), traces=[2, 3],
                               data=[_sent_trace(xs, ys, sent), _grid_trace(counts[k], world_size)],
                               layout={"annotations": _subplot_titles(figure) + _arrows(current, xs, ys),
                                       "title": {"text": _caption(title, current, k, len(hops))}}))
    figure.frames = frames
    figure.update_layout(
        title={"text": _caption(title, [], 0, len(hops))}, height=540, margin={"t": 80, "b": 110, "l": 20},
        plot_bgcolor=WHITE, updatemenus=[_play_pause()], sliders=[_slider(len(hops))], showlegend=False,
    )
    figure.update_xaxes(visible=False, range=_RANGE["x"], row=1, col=1)
    figure.update_yaxes(visible=False, range=_RANGE["y"], scaleanchor="x", row=1, col=1)
    figure.update_xaxes(title_text="chunk", dtick=1, row=1, col=2)
    figure.update_yaxes(title_text="rank", dtick=1, autorange="reversed", row=1, col=2)
    return figure


def _circle(n: int) -> tuple[list[float], list[float]]:
    angles = [math.pi / 2 - 2 * math.pi * r / n for r in range(n)]  # rank 0 on top, clockwise
    return [math.cos(a) for a in angles], [math.sin(a) for a in angles]


def _outward(x: float, y: float) -> str:
    """The textposition that puts a label on the far side of a rank from the centre: one of 8 compass
    directions, so that neighbours' labels on a ring of 8 point different ways."""
    octant = round(math.degrees(math.atan2(y, x)) / 45) % 8
    return ["middle right", "top right", "top center", "top left", "middle left", "bottom left", "bottom center",
            "bottom right"][octant]


def _sent_trace(xs, ys, sent_nbytes) -> go.Scatter:
    """Each rank's bytes sent so far, written outside the circle beside its marker. Not clipped at the axes:
    the labels may run into the margin rather than be cut."""
    return go.Scatter(x=xs, y=ys, mode="markers+text", marker={"size": _MARKER_PX + 2, "opacity": 0},
                      text=[f"sent<br>{_bytes(b)}" for b in sent_nbytes],
                      textposition=[_outward(x, y) for x, y in zip(xs, ys, strict=True)],
                      textfont={"size": 10, "color": DARK_GREY}, customdata=sent_nbytes, hoverinfo="skip",
                      cliponaxis=False, showlegend=False)


def _grid_trace(counts, world_size: int) -> go.Heatmap:
    return go.Heatmap(z=counts, zmin=1, zmax=world_size, colorscale=SEQUENTIAL, xgap=2, ygap=2,
                      text=counts, texttemplate="%{text}",
                      colorbar=integer_colorbar(1, world_size, "ranks' data") | {"x": 1.02},
                      hovertemplate="rank %{y}, chunk %{x}: holds %{z} ranks' data<extra></extra>")


def _arrows(current: list[Transfer], xs, ys) -> list[dict]:
    """An arrow per transfer from rank to rank (stopping at the markers), shifted a little to the right of its
    direction of travel so that the two arrows between a pair of ranks (a ring of 2) lie side by side. Its chunk
    label hangs further to the right: on a clockwise ring, inside the circle, clear of the "sent" labels."""
    arrows = []
    for e in current:
        x0, y0, x1, y1 = xs[e.src], ys[e.src], xs[e.dst], ys[e.dst]
        length = math.hypot(x1 - x0, y1 - y0) or 1.0
        nx, ny = (y1 - y0) / length, (x0 - x1) / length  # unit normal, to the right of travel
        arrows.append({"x": x1 + _ARROW_SHIFT * nx, "y": y1 + _ARROW_SHIFT * ny, "ax": x0 + _ARROW_SHIFT * nx,
                       "ay": y0 + _ARROW_SHIFT * ny, "xref": "x", "yref": "y", "axref": "x", "ayref": "y",
                       "showarrow": True, "arrowhead": 3, "arrowsize": 1.2, "arrowwidth": 2, "arrowcolor": RED,
                       "text": "", "standoff": _MARKER_PX / 2 + 2, "startstandoff": _MARKER_PX / 2 + 2})
        label = "all" if e.chunk is None else str(e.chunk)
        arrows.append({"x": (x0 + x1) / 2 + _LABEL_SHIFT * nx, "y": (y0 + y1) / 2 + _LABEL_SHIFT * ny,
                       "xref": "x", "yref": "y", "text": f"chunk {label}", "showarrow": False,
                       **_anchor_towards(nx, ny), "font": {"size": 10, "color": RED}})
    return arrows


def _anchor_towards(nx: float, ny: float) -> dict:
    """Anchors that make a label grow from its point in the direction (nx, ny), mostly up/down or left/right."""
    if abs(ny) >= abs(nx):
        return {"xanchor": "center", "yanchor": "bottom" if ny > 0 else "top"}
    return {"xanchor": "left" if nx > 0 else "right", "yanchor": "middle"}


def _caption(title: str, current: list[Transfer], k: int, total: int) -> str:
    if not k:
        return f"{title}: before the first hop (each rank holds only its own data)"
    phase = current[0].phase if current else ""
    nbytes = sum(e.nbytes for e in current)
    return f"{title}: hop {k} of {total}, {phase}, {len(current)} transfers, {_bytes(nbytes)} in flight"


def _bytes(nbytes: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes:.0f} B"


def _subplot_titles(figure: go.Figure) -> list[dict]:
    return [a.to_plotly_json() for a in figure.layout.annotations]


def _play_pause() -> dict:
    """Play and Pause, left of the slider's rail: the slider's "hop N" label sits at its right end, clear of them."""
    return {"type": "buttons", "direction": "left", "x": 0.0, "y": -0.1, "xanchor": "left", "yanchor": "top",
            "pad": {"t": 38}, "buttons": [
                {"label": "Play", "method": "animate",
                 "args": [None, {"frame": {"duration": 900, "redraw": True}, "fromcurrent": True,
                                 "transition": {"duration": 0}}]},
                {"label": "Pause", "method": "animate",
                 "args": [[None], {"frame": {"duration": 0, "redraw": False}, "mode": "immediate"}]},
            ]}


def _slider(total_hops: int) -> dict:
    return {"active": 0, "x": 0.2, "y": -0.1, "len": 0.8, "xanchor": "left", "yanchor": "top",
            "currentvalue": {"prefix": "hop ", "xanchor": "right", "font": {"size": 13}},
            "steps": [{"label": str(k), "method": "animate",
                       "args": [[str(k)], {"frame": {"duration": 0, "redraw": True}, "mode": "immediate"}]}
                      for k in range(total_hops + 1)]}
