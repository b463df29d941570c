"""The course's figures share one palette and one kind of log axis.

Every colour a figure or widget uses comes from here: PALETTE (one colour per series, rank or stage, in order),
its named colours, the greys and white of frames and labels, and the colour scales of heatmaps. Rank r is
drawn in `rank_color(r)` in every figure.

Plotly labels a log axis's minor ticks when the data spans only a few decades ("8 9 1 2 3"), which reads
as a broken count. `log_axis` labels decades only, or 1, 2 and 5 of each decade over a short span, as bare
numbers (1k, 10k, 1M): the unit goes in the axis title, e.g. "message size (bytes)".
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["BLUE", "BROWN", "DARK_GREY", "DIVERGING", "GREEN", "GREY", "LIGHT_GREY", "ORANGE", "PALE_DIVERGING",
           "PALETTE", "PINK", "PURPLE", "RED", "SEQUENTIAL", "TEAL", "TOOLBAR_PIXELS", "WHITE", "clear_of_toolbar",
           "integer_colorbar", "log_axis", "log_ticks", "rank_color", "short_number", "tint"]

# Vega's "tableau10" order: colour-blind-friendlier than plotly's default and the same in every notebook.
PALETTE = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6", "#9d755d"]
BLUE, ORANGE, GREEN, RED, TEAL, PURPLE, PINK, BROWN = PALETTE
GREY = "#888888"  # reference lines: a limit, an ideal
LIGHT_GREY = "#cccccc"  # guides drawn behind the data
DARK_GREY = "#555555"  # small labels beside the data
WHITE = "#ffffff"

TOOLBAR_PIXELS = 28  # plotly's toolbar (the "modebar"): 2 px from the figure's top, buttons about 24 px tall
_TITLE_LINE_PIXELS = 22  # each further line of a title (a <sup> line, as the course's subtitles)
_MULTILINE_RISE = 12  # how much higher plotly.js hangs a title of several lines than one of one line
_TITLE_GAP = 10  # between a title's last line and the plot area
_SHORT_SPAN = 3  # fewer decades than this: label 1, 2 and 5 of each; otherwise decades only
_PAD = 0.04  # the range reaches this fraction of itself beyond the first and last ticks
_SI = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def log_axis(title: str, values: Iterable[float] = ()) -> dict:
    """Settings for a log axis: `figure.update_xaxes(**log_axis("message size (bytes)", sizes))`.

    With the data's `values`, ticks fall on 1-2-5 numbers (or on decades when the values span 3 decades or
    more) and the range reaches a little beyond the round numbers either side, so at least two ticks are
    labelled. Without values, plotly places the ticks but labels decades only (dtick=1). Gridlines fall on
    the labelled ticks only: plotly's minor grid on a log axis crowds into a hatch at some widths."""
    axis = {"type": "log", "title_text": title}
    positive = [v for v in values if v > 0]
    if not positive:
        return axis | {"dtick": 1}
    ticks = log_ticks(min(positive), max(positive))
    low, high = math.log10(ticks[0]), math.log10(ticks[-1])
    pad = _PAD * (high - low)  # a point on the first or last tick is not cut in half by the axis's edge
    return axis | {"tickvals": ticks, "ticktext": [short_number(t) for t in ticks], "range": [low - pad, high + pad]}


def log_ticks(low: float, high: float) -> list[float]:
    """Round numbers from the one at or below `low` to the one at or above `high` (at least two): 1, 2, 5 x 10^k
    when high/low is under 10^3, else 10^k only."""
    if not 0 < low <= high:
        raise ValueError(f"log_ticks needs 0 < low <= high, got low={low}, high={high}.")
    mantissas = (1, 2, 5) if math.log10(high / low) < _SHORT_SPAN else (1,)
    first, last = math.floor(math.log10(low)), math.ceil(math.log10(high))
    candidates = [float(f"{m}e{k}") for k in range(first, last + 2) for m in mantissas]
    below = max(t for t in candidates if t <= low * (1 + 1e-9))
    above = min(t for t in candidates if t >= high * (1 - 1e-9) and t > below)
    return [t for t in candidates if below <= t <= above]


def short_number(value: float) -> str:
    """A tick label: 1, 20, 500, 1k, 2M, 5G, 0.01, 1e-5 (SI prefixes from a thousand up)."""
    for size, prefix in _SI:
        if abs(value) >= size:
            return f"{value / size:g}{prefix}"
    return f"{value:g}".replace("e-0", "e-")


def clear_of_toolbar(figure):
    """`figure` with its title below the band plotly's toolbar takes at the top right when the pointer is over
    the figure, and the plot area below the title: in a narrow figure (a widget's, 500 px) a title runs under
    the toolbar, which then hides its end. Returns the figure.

    The title hangs from the figure's top (yanchor "top") TOOLBAR_PIXELS down. plotly.js draws a title of several
    lines (<br>) anchored so about _MULTILINE_RISE px higher than one of a single line, so its pad is that much
    more; the plot area starts _TITLE_GAP px under the title's last line. (Measured in Chromium, plotly 7's
    plotly.js at its default 17 px title font; tests/browser checks the toolbar and the title apart.)

    >>> import plotly.graph_objects as go
    >>> figure = clear_of_toolbar(go.Figure(layout_title_text="Memory<br><sup>per rank</sup>"))
    >>> figure.layout.title.pad.t, figure.layout.margin.t
    (40, 68)
    """
    title = figure.layout.title.text
    if not title:
        return figure
    lines = title.count("<br>") + 1
    if lines == 1:
        pad, last_line_bottom = TOOLBAR_PIXELS, TOOLBAR_PIXELS + 16
    else:
        pad = TOOLBAR_PIXELS + _MULTILINE_RISE
        last_line_bottom = pad + 18 + _TITLE_LINE_PIXELS * (lines - 2)
    figure.update_layout(title={"yref": "container", "y": 1, "yanchor": "top", "pad": {"t": pad}},
                         margin={"t": max(last_line_bottom + _TITLE_GAP, figure.layout.margin.t or 0)})
    return figure


def integer_colorbar(low: int, high: int, title: str) -> dict:
    """A colour bar for a whole-number count from `low` to `high`: ticks on integers only (at most 16), never
    the fractions plotly would pick for a continuous scale."""
    step = math.ceil((high - low + 1) / 16)
    return {"title": {"text": title}, "tickmode": "array", "tickvals": list(range(low, high + 1, step)),
            "ticktext": [str(v) for v in range(low, high + 1, step)]}


def rank_color(rank: int) -> str:
    """Rank `rank`'s colour, the same in every figure: PALETTE in order, again from its start after 8 ranks.

    >>> rank_color(0), rank_color(3), rank_color(8)
    ('#4c78a8', '#e45756', '#4c78a8')
    """
    return PALETTE[rank % len(PALETTE)]


def tint(color: str, share: float) -> str:
    """`color` ("#rrggbb") mixed with white, `share` of it kept: a pale version that other colours stand out on.

    >>> tint(BLUE, 0.4)
    '#b7c9dc'
    """
    channels = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{round(share * c + (1 - share) * 255):02x}" for c in channels)


# Heatmap scales. Values around zero: negative red, positive blue (ColorBrewer's RdBu). Pale: where rank outlines
# in PALETTE's colours go over the cells and must stay the strongest colour. Counts: light to dark blue.
DIVERGING = "RdBu"
PALE_DIVERGING = [[0.0, tint(RED, 0.4)], [0.5, WHITE], [1.0, tint(BLUE, 0.4)]]
SEQUENTIAL = "Blues"
