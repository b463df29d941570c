"""Predict, then run: the student's guess first, then the experiment, then the two side by side and why they differ.

Committing to a number before seeing the result is what makes a result stick, and a wrong guess is the most
useful one: the widget names the typical wrong guesses and says why each is wrong. (Predict-observe-explain:
White & Gunstone, "Probing Understanding", 1992.)

A notebook makes one `PredictThenRun` before its key experiment: a question, a control whose starting value is the
default prediction, and the experiment. Pressing the button runs the experiment once (a second press compares a
new prediction with the same measurement). A notebook run with nobody at the keyboard (nbval, papermill, Run All)
never presses it: the next cell asks for `.result`, which runs the experiment with the default prediction, and
asserts the measurement against theory. That comparison is shown folded, so a student who runs all cells first
can still predict before reading it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

import ipywidgets as widgets

from labkit.checks import number
from labkit.viz.style import BLUE, GREEN, GREY, ORANGE, RED
from labkit.widgets.app import App, prose
from labkit.widgets.typed import typed

__all__ = ["CONTROL_WIDTH", "PredictThenRun", "distinct_wrong_guesses"]

CONTROL_WIDTH = "440px"  # the control and the button side by side fit a 1280 px window with the file browser open
_BAR_PIXELS = 260  # the longest bar: with its label and value, well inside the narrowest notebook column
_WAITING = "<i>Set your prediction, then press the button.</i>"


class PredictThenRun(App):
    """A question, a control for the prediction (numeric; its starting value is the default), a button that runs
    `experiment()` (once) and compares `measure(result)` with the prediction.

    - `theory`, `formula`: the value theory gives and how it is written, shown beside the measurement;
    - `why`: why the measurement is what it is, always shown with the comparison;
    - `wrong_guesses`: (value, why that guess is wrong) pairs, or a dict, for the typical wrong predictions;
      the one within `tolerance` of the student's prediction is shown. Guesses that coincide at this size
      (with theory or with an earlier guess) are dropped: see `distinct_wrong_guesses`;
    - `show`: how a value is written ("1.5 x S", "27%"); `measured_label`: "measured" (a run measures it), or
      the name of what computes it, "labkit.plan", where the experiment reveals arithmetic rather than runs
      something: the verdict then reads "what labkit.plan gives", "labkit.plan's 4.04x".
    A prediction counts as right when it `agrees` with theory, where there is one (the question asks for it; a
    noisy measurement only scatters around it), else with the measurement: within `tolerance` (relative) plus
    `abs_tolerance`. That is the band a notebook asserts its measurement against theory with, so a right
    prediction is never told "not quite" by a measurement the notebook itself accepts.

    >>> app = PredictThenRun("2 + 2?", widgets.IntSlider(value=5, max=9), lambda: 4, wrong_guesses={5: "no"})
    >>> app.control.value = 3
    >>> app.button.click()
    >>> "3" in app.feedback.value and "4" in app.feedback.value
    True
    """

    def __init__(self, question: str, control: widgets.ValueWidget, experiment: Callable[[], object], *,
                 measure: Callable[[object], float] = lambda result: result, theory: float | None = None,
                 formula: str = "", why: str = "",
                 wrong_guesses: Mapping[float, str] | Iterable[tuple[float, str]] = (),
                 show: Callable[[float], str] = "{:g}".format, measured_label: str = "measured",
                 tolerance: float = 0.05, abs_tolerance: float = 0.0, button: str = "Run the experiment"):
        self.control, self.experiment, self.measure, self.show = control, experiment, measure, show
        self.theory, self.formula, self.why = theory, formula, why
        self.tolerance, self.abs_tolerance = number("tolerance", tolerance), number("abs_tolerance", abs_tolerance)
        self.wrong_guesses = distinct_wrong_guesses(wrong_guesses, theory, tolerance)
        self.measured_label = measured_label
        self.runs, self._result = 0, None
        self.button = widgets.Button(description=button, button_style="primary",
                                     layout=widgets.Layout(width="auto", min_width="180px"))
        self.feedback = widgets.HTML(_WAITING, layout=widgets.Layout(width="auto"))
        if "description_width" in control.style.keys:
            control.style.description_width = "initial"  # the whole description, never cut
        control.layout.width = control.layout.width or CONTROL_WIDTH
        self.button.on_click(lambda _: self._press())
        # the parts take the column's width less their margins ("auto"): 100% plus a margin would stick out
        header = widgets.HTML(f"<div style='line-height:1.4'><b>Predict first.</b> {question}</div>",
                              layout=widgets.Layout(width="auto"))
        # a slider's value can be typed too, and typed text that is no value the slider takes is refused with why
        row = widgets.HBox([typed(control), self.button],
                           layout=widgets.Layout(flex_flow="row wrap", width="auto", align_items="flex-start"))
        super().__init__([header, row, self.feedback], layout=widgets.Layout(width="100%"))

    @property
    def prediction(self) -> float:
        """The prediction set now: the control's value."""
        return self.control.value

    @property
    def result(self) -> object:
        """What the experiment returned. Asked before the button was pressed (a notebook run unattended), it runs
        the experiment and shows the comparison with the prediction set now, folded."""
        if not self.runs:
            self._run()
            self.feedback.value = self.comparison(folded=True)
        return self._result

    @property
    def measured(self) -> float:
        """The measured quantity: `measure` of the experiment's result (running it if it has not run)."""
        return self.measure(self.result)

    def _run(self) -> None:
        """Run the experiment, once."""
        self._result = self.experiment()
        self.runs += 1

    def _press(self) -> None:
        """The button: run the experiment if it has not run (saying so while it runs), then compare. A failing
        experiment is reported here, where the student is looking; the button stays usable."""
        if not self.runs:
            self.button.disabled, self.feedback.value = True, "<i>Running the experiment...</i>"
            try:
                self._run()
            except Exception as error:  # noqa: BLE001  (a callback's exception would vanish into the log)
                self.feedback.value = (f"<span style='color:{RED}'>The experiment failed: "
                                       f"{type(error).__name__}: {error}</span>")
                return
            finally:
                self.button.disabled = False
        self.feedback.value = self.comparison()

    def comparison(self, folded: bool = False) -> str:
        """The prediction next to the measurement (and theory) as HTML: bars, the verdict, why. `folded` puts it
        in a closed <details>, for a run nobody watched."""
        prediction, measured = self.prediction, self.measured
        rows = [("your prediction", prediction, ORANGE), (self.measured_label, measured, BLUE)]
        if self.theory is not None:
            rows.append((f"theory{': ' + self.formula if self.formula else ''}", self.theory, GREY))
        body = (f"{_bars(rows, self.show)}<div style='line-height:1.4; margin-top:6px'>"
                f"{self.verdict(prediction, measured)}</div>")
        if self.why:
            body += f"<div style='line-height:1.4; margin-top:6px'><b>Why.</b> {self.why}</div>"
        if not folded:
            return prose(body)
        return prose(f"<details><summary>The experiment ran without a press of the button (a later cell asked for "
                f"its result), compared with the prediction set then: {self.show(prediction)}. Expand to read "
                f"the comparison, or set your own prediction and press the button first.</summary>{body}</details>")

    def agrees(self, value: float, reference: float) -> bool:
        """Whether `value` is within this widget's band of `reference`: |value - reference| <= tolerance x
        |reference| + abs_tolerance. The verdict's test, and the one a notebook asserts its measurement against
        theory with."""
        return abs(value - reference) <= self.tolerance * abs(reference) + self.abs_tolerance + 1e-12

    def _measured_phrases(self, measured: float) -> tuple[str, str, str]:
        """How the verdict names the measured value: (what it is, it with its value, it in brackets), as
        ("what was measured", "the measured 1.5 x S", " (measured: 1.5 x S)") or, for a `measured_label` naming
        what computes it, ("what labkit.plan gives", "labkit.plan's 4.04x", " (labkit.plan: 4.04x)")."""
        label, value = self.measured_label, self.show(measured)
        if label == "measured":
            return "what was measured", f"the measured {value}", f" (measured: {value})"
        return f"what {label} gives", f"{label}'s {value}", f" ({label}: {value})"

    def verdict(self, prediction: float, measured: float) -> str:
        """Right (it agrees with theory, or without theory with the measurement), or what is wrong with this
        guess: a typical wrong guess's reason, else by how much it is off."""
        said, against, seen = self._measured_phrases(measured)
        if self.theory is not None:
            reference, against, said = self.theory, f"theory's {self.show(self.theory)}", "what theory gives"
        else:
            reference, seen = measured, ""
        if self.agrees(prediction, reference):
            return f"<b style='color:{GREEN}'>✅ Right</b>: {self.show(prediction)} is {said}{seen}."
        reason = next((why for guess, why in self.wrong_guesses.items()
                       if math.isclose(prediction, guess, rel_tol=self.tolerance, abs_tol=1e-12)), None)
        if reason is None:
            direction = "above" if prediction > reference else "below"
            reason = f"{self.show(prediction)} is {direction} {against}{seen}."
        return f"<b style='color:{RED}'>❌ Not quite</b>: {reason}"


def distinct_wrong_guesses(guesses: Mapping[float, str] | Iterable[tuple[float, str]], right: float | None,
                           tolerance: float = 0.05) -> dict[float, str]:
    """{value: why} from (value, why) pairs, first come first kept: a guess within `tolerance` of `right` or of
    a guess kept before is dropped. Why: typical wrong guesses are formulas in N, and at a small N two of them
    (or one and the answer) can be the same number; a dict literal would silently keep the later text, and a
    "wrong" guess that equals the answer would be explained as wrong.

    >>> distinct_wrong_guesses([(1, "the hub"), (1, "one tensor"), (0.5, "one phase"), (2, "hops")], right=1)
    {0.5: 'one phase', 2: 'hops'}
    """
    pairs = guesses.items() if isinstance(guesses, Mapping) else guesses
    kept: dict[float, str] = {}
    for value, why in pairs:
        taken = [*kept, right] if right is not None else list(kept)
        if not any(math.isclose(value, other, rel_tol=tolerance, abs_tol=1e-12) for other in taken):
            kept[value] = why
    return kept


def _bars(rows: list[tuple[str, float, str]], show: Callable[[float], str]) -> str:
    """Horizontal bars, one per (label, value, colour), scaled to the largest value: how far apart the numbers are,
    at a glance. Negative values are drawn as empty bars."""
    largest = max((value for _, value, _ in rows), default=0) or 1
    cells = "".join(
        f"<tr><td style='white-space:nowrap; padding-right:8px'>{label}</td>"
        f"<td style='width:{_BAR_PIXELS}px'><div style='background:{colour}; height:14px; "
        f"width:{max(value, 0) / largest * _BAR_PIXELS:.0f}px'></div></td>"
        f"<td style='white-space:nowrap; padding-left:8px'><b>{show(value)}</b></td></tr>"
        for label, value, colour in rows)
    return f"<table style='border-collapse:collapse; line-height:1.5'>{cells}</table>"
