"""FigureSlot: a place in a widget app for one plotly figure, redrawn whole each time."""

from __future__ import annotations

import json
import re

import ipywidgets as widgets
import plotly.graph_objects as go
import plotly.io as pio

from labkit.viz.style import clear_of_toolbar

__all__ = ["PLOTLY_MIME", "FigureSlot"]

PLOTLY_MIME = "application/vnd.plotly.v1+json"  # what JupyterLab's plotly renderer draws, as for a cell's figure
ROW_MIN_PIXELS = 460  # a chart narrower than this crowds its bars' labels; 2 x 460 fit 1280 px without the file browser
CONFIG = {"displaylogo": False, "responsive": True}  # the toolbar without plotly's logo; the figure follows its box


class FigureSlot(widgets.Output):
    """A place for one plotly figure, drawn whole by every `draw(figure)`: the slot's one output becomes the figure's
    plotly document, which JupyterLab's plotly renderer draws as it draws a cell's figure.

    Why not a plotly FigureWidget: updating one in place sends deltas that plotly's widget code (a 5 MB script)
    applies only once loaded, so a busy browser can miss them and keep an empty chart; and a new FigureWidget per
    redraw, the old one closed, leaves the browser's view of the old one reporting its first render to a closed
    widget: the kernel logs "No such comm" for each, and JupyterLab's log badge counts them. Here nothing talks
    back: one message carries the whole figure, and the slot stays the same widget.

    A figure without a width follows the slot's (the slot's `layout` sets it, e.g. flex="1 1 460px"); its title is
    moved below the toolbar plotly shows over the figure's top right (viz.style.clear_of_toolbar).

    >>> slot = FigureSlot()
    >>> slot.draw(go.Figure(go.Bar(y=[1, 2])))
    >>> slot.figure.data[0].y, PLOTLY_MIME in slot.outputs[0]["data"]
    ((1, 2), True)
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._figure: go.Figure | None = None

    @classmethod
    def in_row(cls) -> FigureSlot:
        """A slot for a row that wraps (an HBox with flex_flow="row wrap"): ROW_MIN_PIXELS wide at least, the row's
        width shared with the slots beside it; a row too narrow for two puts each on a line of its own, the row's
        whole width (not half of it, as a fixed 500 px figure took)."""
        return cls(layout=widgets.Layout(flex=f"1 1 {ROW_MIN_PIXELS}px", min_width="0"))

    def draw(self, figure: go.Figure) -> None:
        """Show `figure` here, in place of the one shown before."""
        self._figure = clear_of_toolbar(go.Figure(figure))
        document = json.loads(pio.to_json(self._figure, validate=False))  # numpy arrays as lists, as plotly writes
        bundle = {PLOTLY_MIME: {**document, "config": CONFIG}, "text/plain": _title(self._figure)}
        self.outputs = ({"output_type": "display_data", "data": bundle, "metadata": {}},)

    @property
    def figure(self) -> go.Figure | None:
        """The figure shown now (None before the first draw)."""
        return self._figure


def _title(figure: go.Figure) -> str:
    """A line for a frontend that cannot draw plotly: what the figure is."""
    title = re.sub(r"\s*<[^>]+>\s*", " ", figure.layout.title.text or "untitled").strip()
    return f"(a plotly figure: {title})"
