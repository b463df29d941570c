"""3D parallelism's traffic as bars, one colour per mesh axis (as mesh_grid draws the axes' groups: tp orange, pp
green, dp purple): the bytes each rank hands to each axis's collectives in a step, and the seconds an axis's
traffic would take on each kind of link.

    axis_traffic_bars(traffic)        bytes per step, one group of bars per rank, a bar per axis
    axis_link_seconds(seconds)        seconds per step, one group of bars per axis, a bar per link
"""

from __future__ import annotations

import math

import plotly.graph_objects as go

from labkit.viz.style import BLUE, BROWN, DARK_GREY, GREEN, GREY, ORANGE, PURPLE, RED, TEAL, WHITE, log_axis

__all__ = ["AXIS_COLORS", "axis_link_seconds", "axis_traffic_bars", "byte_unit"]

# mesh_grid's colours for each axis's group; ep's brown, an axis mesh_grid does not draw
AXIS_COLORS = {"dp": PURPLE, "pp": GREEN, "cp": TEAL, "ep": BROWN, "tp": ORANGE}
LINK_COLORS = [BLUE, RED, GREY]  # the links' bars, in the order given: the fast one first
_BYTE_UNITS = (("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("bytes", 1.0))


def byte_unit(largest_nbytes: float) -> tuple[str, float]:
    """The unit to write `largest_nbytes` (and smaller amounts beside it) in: ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)
    or ("bytes", 1), the largest at or below it (decimal units, GB = 1e9 bytes, as the whole course).

    >>> byte_unit(163_840), byte_unit(2.5e9), byte_unit(0)
    (('kB', 1000.0), ('GB', 1000000000.0), ('bytes', 1.0))
    """
    return next(((name, size) for name, size in _BYTE_UNITS if largest_nbytes >= size), _BYTE_UNITS[-1])


def axis_traffic_bars(traffic: dict[str, dict[str, float]], title: str = "Bytes each rank hands to each axis per step"
                      ) -> go.Figure:
    """Grouped bars: for each rank (`traffic`'s keys, its labels on the x axis) a bar per axis, its height the
    bytes that rank hands to that axis's collectives in one step (`traffic[label][axis]`, e.g. the totals of
    labkit.plan.axis_traffic per axis); an axis that moves nothing on any rank gets no bar. Heights in the unit
    byte_unit picks for the largest.

    >>> figure = axis_traffic_bars({"rank 0": {"dp": 2e3, "pp": 1e3, "tp": 0}, "rank 1": {"dp": 2e3, "pp": 1e3}})
    >>> [(bar.name, bar.y) for bar in figure.data], figure.layout.yaxis.title.text
    ([('dp', (2.0, 2.0)), ('pp', (1.0, 1.0))], 'bytes per rank per step, kB')
    """
    labels = list(traffic)
    axes = [axis for axis in AXIS_COLORS if any(traffic[label].get(axis, 0) for label in labels)]
    unit, size = byte_unit(max((traffic[label].get(axis, 0) for label in labels for axis in axes), default=0))
    figure = go.Figure([go.Bar(x=labels, y=[traffic[label].get(axis, 0) / size for label in labels], name=axis,
                               marker_color=AXIS_COLORS[axis],
                               hovertemplate=f"%{{x}}: %{{y:.3g}} {unit} to {axis}<extra></extra>")
                        for axis in axes])
    figure.update_layout(barmode="group", title=title, height=380, margin={"t": 60}, legend_title_text="axis",
                         yaxis_title=f"bytes per rank per step, {unit}")
    return figure


def axis_link_seconds(seconds: dict[str, dict[str, float]], compute_seconds: float | None = None,
                      title: str = "Seconds per step each axis's traffic takes, by link") -> go.Figure:
    """Grouped bars on a log axis: for each axis (`seconds`' keys) a bar per link (`seconds[axis][link]`, the
    seconds one step's traffic of that axis takes on that link), the links in the order of the first axis's dict;
    `compute_seconds`, if given, a dashed line: the step's compute, the scale against which each axis's seconds
    are large or small (only traffic that can run beside the compute, such as dp's reduce during the last
    micro-batch's backward, hides behind it).

    >>> figure = axis_link_seconds({"tp": {"NVLink": 1.0, "network": 9.0}, "dp": {"NVLink": 0.1, "network": 0.9}})
    >>> [(bar.name, bar.x, bar.y) for bar in figure.data]
    [('NVLink', ('tp', 'dp'), (1.0, 0.1)), ('network', ('tp', 'dp'), (9.0, 0.9))]
    """
    axes = list(seconds)
    links = list(seconds[axes[0]]) if axes else []
    figure = go.Figure([go.Bar(x=axes, y=[seconds[axis][link] for axis in axes], name=link,
                               marker_color=LINK_COLORS[i % len(LINK_COLORS)],
                               hovertemplate=f"%{{x}} on {link}: %{{y:.3g}} s<extra></extra>")
                        for i, link in enumerate(links)])
    shown = [seconds[axis][link] for axis in axes for link in links]
    if compute_seconds:
        figure.add_hline(y=compute_seconds, line={"dash": "dash", "color": GREY})
        # on a log axis an annotation's y is the exponent (plotly.js); add_hline's own annotation would put it at
        # 10^compute_seconds, off the chart
        figure.add_annotation(x=1, xref="paper", y=math.log10(compute_seconds), yref="y", xanchor="right",
                              yanchor="bottom", showarrow=False, text=f"compute per step: {compute_seconds:.3g} s",
                              font={"color": DARK_GREY}, bgcolor=WHITE)
        shown.append(compute_seconds)
    figure.update_yaxes(**log_axis("seconds per step (log scale)", shown))
    figure.update_layout(barmode="group", title=title, height=400, margin={"t": 60}, legend_title_text="link",
                         xaxis_title="axis of the mesh")
    return figure
