"""What every labkit widget app shares: a note for when its notebook is reopened, and text set as prose.

    App([...])          a VBox shown with a note that appears only once its kernel is gone
    prose(html)         HTML in a widget at a reading line height (ipywidgets sets 28 px: double spacing)

A notebook saved with a widget's output and opened again later (a new kernel, or none) cannot draw the widget:
its model lived in the old kernel. JupyterLab then shows "Error displaying widget: model not found" in its place,
and nothing says what to do. An App is displayed as two outputs: a note saying that this output is from an earlier
session and the cell must run again, then the widget. A CSS rule in the note hides it while the next output holds
a drawn widget (JupyterLab's widget renderer puts the widget's view inside the output; a missing model leaves a
bare text), so a student sees the note only when the widget is gone. Where JupyterLab does not trust the notebook,
or another frontend opens it, the note shows too, beside the widget's plain-text stand-in: it is true there as well.
"""

from __future__ import annotations

import ipywidgets as widgets
from IPython.display import HTML, display

from labkit.viz.style import RED, tint

__all__ = ["PROSE_STYLE", "STALE_NOTE", "App", "prose"]

PROSE_STYLE = "line-height:1.4; white-space:normal"  # wrapped lines of text, single-spaced
NOTE_CLASS = "labkit-stale-note"
STALE_NOTE = (
    # hidden while the output after this one holds a widget's view (.jupyter-widgets inside the output); a missing
    # model leaves the output itself marked .jupyter-widgets, holding only the error's text
    f"<style>.jp-OutputArea-child:has(+ .jp-OutputArea-child .jp-OutputArea-output > .jupyter-widgets) "
    f".{NOTE_CLASS} {{display: none}}</style>"
    f"<div class='{NOTE_CLASS}' style='{PROSE_STYLE}; padding:4px 8px; border-left:3px solid {RED}; "
    f"background:{tint(RED, 0.08)}'><b>This output is from an earlier session:</b> the widget below lived in a "
    "kernel that has stopped. Run this cell again (or Run All) to use it.</div>")
PLAIN_NOTE = "(a widget from an earlier session: run this cell again to use it)"


def prose(html: str) -> str:
    """`html` in a block that wraps its lines single-spaced: inside an ipywidgets HTML widget, text inherits the
    controls' 28 px line height, and a wrapped sentence reads double-spaced."""
    return f"<div style='{PROSE_STYLE}'>{html}</div>"


class App(widgets.VBox):
    """A VBox that a notebook shows with the note for a later session (STALE_NOTE) above it: every labkit widget
    app is one. `display(app)`, or an app as a cell's last expression, shows the note, then the widget."""

    def _ipython_display_(self) -> None:
        display(HTML(STALE_NOTE))
        bundle = self._repr_mimebundle_()
        bundle["text/plain"] = PLAIN_NOTE  # what shows where the widget cannot: not the widget's repr
        display(bundle, raw=True)
