"""PredictThenRun, driven as a student drives it (set a prediction, press the button) and as a notebook run with
nobody at the keyboard drives it (a later cell asks for the result): the shown comparison states the prediction,
the measurement, theory and the explanation, and the experiment runs once."""

import math

import ipywidgets as widgets
import pytest

from labkit.widgets import PredictThenRun
from labkit.widgets.app import PROSE_STYLE
from labkit.widgets.predict import CONTROL_WIDTH, distinct_wrong_guesses
from labkit.widgets.typed import TypedSlider


def ring_bytes_app(default: float = 3.0, experiment=None) -> PredictThenRun:
    """Notebook 03's question in small: each rank's ring AllReduce bytes on 4 ranks, in units of S."""
    calls = []

    def count():
        calls.append(1)
        return {"ring": 1.5, "hub": 3.0}

    app = PredictThenRun(
        "On 4 ranks, how many bytes does each rank send?",
        widgets.FloatSlider(value=default, min=0, max=4, step=0.25, description="bytes per rank (x S)"),
        experiment or count, measure=lambda counted: counted["ring"], theory=1.5, formula="2(N-1)/N",
        why="every chunk travels N-1 hops twice", wrong_guesses={3.0: "that is the hub's rank 0", 2.0: "almost"},
        show=lambda v: f"{v:g} x S")
    app.calls = calls
    return app


def test_a_pressed_prediction_is_compared_with_the_measurement_and_explained():
    app = ring_bytes_app()
    assert "press the button" in app.feedback.value and not app.calls       # nothing runs before the press
    app.control.value = 2.0
    app.button.click()
    shown = app.feedback.value
    assert "2 x S" in shown and "1.5 x S" in shown and "2(N-1)/N" in shown   # prediction, measured, theory
    assert "Not quite" in shown and "almost" in shown                       # the typical guess's reason
    assert "every chunk travels N-1 hops twice" in shown and "<details>" not in shown
    assert app.runs == 1 and len(app.calls) == 1


def test_pressing_again_with_another_prediction_updates_without_rerunning():
    app = ring_bytes_app()
    app.button.click()
    assert "hub's rank 0" in app.feedback.value                             # the default, 3 x S
    app.control.value = 1.5
    app.button.click()
    assert "Right" in app.feedback.value and "hub" not in app.feedback.value
    app.control.value = 0.5                                                 # no typical guess: how far off
    app.button.click()
    assert "0.5 x S is below theory's 1.5 x S (measured: 1.5 x S)" in app.feedback.value
    assert len(app.calls) == 1


def test_an_unattended_run_compares_the_default_prediction_folded():
    """nbval and papermill never press the button: the next cell's `.result` runs the experiment, and the
    comparison with the default is shown, folded so that a student can still predict first."""
    app = ring_bytes_app(default=3.0)
    assert app.result == {"ring": 1.5, "hub": 3.0} and app.measured == 1.5
    shown = app.feedback.value
    assert shown.startswith(f"<div style='{PROSE_STYLE}'><details>")   # folded, and single-spaced
    assert "prediction set then: 3 x S" in shown
    assert "hub's rank 0" in shown and "1.5 x S" in shown and "every chunk" in shown
    app.button.click()                                                      # the student presses afterwards
    assert "<details>" not in app.feedback.value and len(app.calls) == 1


def test_a_failing_experiment_is_reported_and_the_button_stays_usable():
    def broken():
        raise RuntimeError("rank 2 hung")

    app = ring_bytes_app(experiment=broken)
    app.button.click()
    assert "The experiment failed: RuntimeError: rank 2 hung" in app.feedback.value
    assert not app.button.disabled and app.runs == 0
    with pytest.raises(RuntimeError, match="rank 2 hung"):                   # a later cell sees it raised
        _ = app.result


def test_the_control_keeps_its_whole_description_within_a_narrow_column():
    app = ring_bytes_app()
    header, row, feedback = app.children
    shown, button = row.children            # a slider is shown with a text box for typed values (TypedSlider)
    assert isinstance(shown, TypedSlider) and shown.slider is app.control and button is app.button
    assert "Predict first" in header.value
    assert app.control.style.description_width == "initial" and shown.layout.width == CONTROL_WIDTH
    assert not app.control.readout            # ipywidgets' readout took "1e3" as 1, silently
    dropdown = widgets.Dropdown(options=[("1 model", 1), ("4 models", 4)], value=1,
                                layout=widgets.Layout(width="300px"))
    assert PredictThenRun("How many?", dropdown, lambda: 4).control.layout.width == "300px"   # its own width kept


def test_without_theory_or_typical_guesses_the_comparison_still_reads():
    app = PredictThenRun("Speedup?", widgets.FloatSlider(value=8, min=1, max=8), lambda: 4.04,
                         show=lambda v: f"{v:.2f}x", measured_label="labkit.plan", tolerance=0.1)
    app.button.click()
    assert "8.00x is above labkit.plan's 4.04x." in app.feedback.value and "theory" not in app.feedback.value
    app.control.value = 4.2                                                 # within 10%
    app.button.click()
    assert "Right</b>: 4.20x is what labkit.plan gives." in app.feedback.value   # not "what was labkit.plan"


def test_wrong_guesses_that_coincide_at_a_small_size_are_kept_once_and_never_equal_the_answer():
    """Notebook 03 at N = 2: the hub's (N-1) x S and 'one tensor, S' both equal the ring's 2(N-1)/N = 1, and
    2(N-1) hops equals the large-N limit 2. The first text for a value is kept; the answer is never 'wrong'."""
    n = 2
    guesses = [(n - 1, "the hub"), ((n - 1) / n, "one phase"), (2 * (n - 1), "hops"), (1, "once"), (2, "limit")]
    assert distinct_wrong_guesses(guesses, right=2 * (n - 1) / n) == {0.5: "one phase", 2: "hops"}
    assert distinct_wrong_guesses({1.0: "a", 1.02: "b", 3: "c"}, right=None) == {1.0: "a", 3: "c"}  # 5 %
    app = PredictThenRun("Bytes?", widgets.FloatSlider(value=2, min=0, max=2), lambda: 1.0, theory=1.0,
                         wrong_guesses=guesses)
    app.button.click()
    assert "hops" in app.feedback.value and "limit" not in app.feedback.value
    app.control.value = 1.0                                                 # the hub's value is the answer here
    app.button.click()
    assert "Right" in app.feedback.value and "hub" not in app.feedback.value


def bubble_app(measured: float) -> PredictThenRun:
    """Notebook 06's question: GPipe's bubble on 4 stages with 8 micro-batches, theory 3/11, measured on a busy
    machine above it; the notebook accepts a measurement within 15 % of theory plus 0.02."""
    return PredictThenRun("Idle share?", widgets.FloatSlider(value=0.75, min=0, max=1, step=0.01), lambda: measured,
                          theory=3 / 11, formula="(p-1)/(m+p-1)", wrong_guesses={0.75: "one micro-batch's"},
                          show=lambda v: f"{v:.1%}", tolerance=0.15, abs_tolerance=0.02)


def test_a_right_prediction_is_right_whatever_the_noise_the_notebook_accepts():
    """Item 15 of issue 25: 3/11 = 27.3 % predicted, 33 % measured (within the notebook's band of theory,
    0.15 x 27.3 % + 2 % = 6.1 %, but 17 % off the prediction, which the old test, within 15 % of the
    measurement, called not quite): the prediction is right."""
    app = bubble_app(measured=0.33)
    assert app.agrees(app.measured, app.theory) and not math.isclose(3 / 11, 0.33, rel_tol=0.15)
    app.control.value = 3 / 11
    app.button.click()
    assert "Right" in app.feedback.value and "Not quite" not in app.feedback.value
    assert "27.3% is what theory gives (measured: 33.0%)" in app.feedback.value
    app.control.value = 0.30                                                # inside the band: right too
    app.button.click()
    assert "Right" in app.feedback.value


def test_a_wrong_prediction_is_told_not_quite_even_near_the_noisy_measurement():
    app = bubble_app(measured=0.33)
    app.control.value = 0.36                                                # 9 % from what was measured
    app.button.click()
    assert "Not quite" in app.feedback.value
    assert "36.0% is above theory's 27.3% (measured: 33.0%)" in app.feedback.value
    app.control.value = 0.75                                                # the typical guess and its reason
    app.button.click()
    assert "Not quite" in app.feedback.value and "one micro-batch's" in app.feedback.value


def test_the_band_is_relative_to_the_reference_plus_an_absolute_margin():
    app = bubble_app(measured=0.3)
    assert app.agrees(0.1 * 1.15 + 0.02, 0.1) and not app.agrees(0.1 * 1.15 + 0.021, 0.1)
    assert app.agrees(0.1 * 0.85 - 0.02, 0.1) and not app.agrees(0.1 * 0.85 - 0.021, 0.1)
    with pytest.raises(ValueError, match="abs_tolerance=-0.01"):
        PredictThenRun("?", widgets.FloatSlider(), lambda: 1.0, abs_tolerance=-0.01)
