"""ipywidgets apps for the notebooks: controls on the left of a computation, its figures redrawn live."""

from labkit.widgets.planner import planner

__all__ = ["planner"]
