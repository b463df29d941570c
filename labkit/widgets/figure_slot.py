"""FigureSlot: a place in a widget app for one plotly figure, redrawn whole each time."""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go

__all__ = ["FigureSlot"]


class FigureSlot(widgets.Box):
    """A place for one plotly figure, shown as a new FigureWidget by every `draw(figure)`.

    Why not update one FigureWidget in place: its updates travel as deltas that plotly's widget code (a 5 MB
    script) applies only once loaded, so a busy browser can miss them and keep an empty chart. A new widget
    carries the whole figure in its first message.

    >>> slot = FigureSlot()
    >>> slot.draw(go.Figure(go.Bar(y=[1, 2])))
    >>> slot.figure.data[0].y
    (1, 2)
    """

    def draw(self, figure: go.Figure) -> None:
        """Show `figure` here, closing the widget it replaces."""
        old, self.children = self.children, (go.FigureWidget(figure),)
        for widget in old:
            widget.close()

    @property
    def figure(self) -> go.FigureWidget | None:
        """The figure shown now (None before the first draw)."""
        return self.children[0] if self.children else None
