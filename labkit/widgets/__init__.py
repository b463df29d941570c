"""ipywidgets apps for the notebooks: controls on the left of a computation, its figures redrawn live."""

from labkit.widgets.app import App, prose
from labkit.widgets.figure_slot import FigureSlot
from labkit.widgets.layout_explorer import LayoutExplorer, suggested_layout
from labkit.widgets.planner import planner, what_is_running_out
from labkit.widgets.predict import PredictThenRun
from labkit.widgets.review import flashcards, quiz, stack_map_exercise
from labkit.widgets.typed import TypedSlider
from labkit.widgets.zoo_diagnosis import diagnosis_widget

__all__ = ["App", "FigureSlot", "LayoutExplorer", "PredictThenRun", "TypedSlider", "diagnosis_widget", "flashcards",
           "planner", "prose", "quiz", "stack_map_exercise", "suggested_layout", "what_is_running_out"]
