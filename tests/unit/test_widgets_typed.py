"""Typed slider values (labkit.widgets.typed) and the earlier-session note of every widget app (labkit.widgets.app).

ipywidgets' own readout took "1e3" GPUs as 1, "-3" as the minimum and ignored "seventy", without a word; a
TypedSlider refuses what is no value its slider takes, says why, and keeps the last good value."""

import ipywidgets as widgets
import pytest
from IPython.core.interactiveshell import InteractiveShell
from IPython.display import display
from IPython.utils.capture import capture_output

from labkit.widgets import App, TypedSlider, planner, quiz
from labkit.widgets.app import PLAIN_NOTE, STALE_NOTE
from labkit.widgets.typed import read_typed, shown_value, typed

GPUS = dict(value=8, min=1, max=64, description="GPUs")


@pytest.mark.parametrize("text, value", [("16", 16), (" 64 ", 64), ("1e1", 10), ("8.0", 8)])
def test_whole_numbers_in_range_are_taken(text, value):
    assert read_typed(widgets.IntSlider(**GPUS), text) == value


def test_thousands_separators_are_ignored():
    examples = widgets.IntSlider(value=40_000, min=1_000, max=1_000_000, step=1_000)
    assert read_typed(examples, "45,500") == 45_500   # between the slider's steps: a value the plan takes


@pytest.mark.parametrize("text, reason", [
    ("1e3", "1e3 is 1000, above the most this slider takes, 64."),
    ("-3", "-3 is below the least this slider takes, 1."),
    ("0", "0 is below the least this slider takes, 1."),
    ("seventy", '"seventy" is not a number: type one such as 8.'),
    ("", '"nothing" is not a number'),
    ("nan", '"nan" is not a number'),
    ("inf", '"inf" is not a number'),
    ("2.5", "2.5 is not a whole number: type one such as 8."),
])
def test_what_is_no_value_of_an_integer_slider_is_refused_with_the_reason(text, reason):
    with pytest.raises(ValueError) as refused:
        read_typed(widgets.IntSlider(**GPUS), text)
    assert reason in str(refused.value)


def test_a_percentage_slider_takes_percent_and_fractions_and_writes_its_readout_format():
    hidden = widgets.FloatSlider(value=0.0, min=0, max=1, step=0.05, readout_format=".0%")
    assert read_typed(hidden, "50%") == pytest.approx(0.5) and read_typed(hidden, "0.25") == 0.25
    assert shown_value(hidden, 0.5) == "50%"
    with pytest.raises(ValueError, match="150% is 1.5, above the most this slider takes, 100%"):
        read_typed(hidden, "150%")


def test_a_log_slider_ranges_over_its_base_to_the_powers():
    bandwidth = widgets.FloatLogSlider(value=25, base=10, min=-1, max=3, step=0.05)
    assert read_typed(bandwidth, "400") == 400 and read_typed(bandwidth, "0.1") == pytest.approx(0.1)
    with pytest.raises(ValueError, match="above the most this slider takes, 1e"):
        read_typed(bandwidth, "2000")


def test_a_selection_slider_takes_its_options_labels_only():
    heads = widgets.SelectionSlider(options=[1, 2, 4, 8, 16, 32], value=8)
    assert read_typed(heads, "16") == 16
    with pytest.raises(ValueError, match=r'"3" is not one of this slider\'s values: 1, 2, 4, 8, 16, 32\.'):
        read_typed(heads, "3")
    sequence = widgets.SelectionSlider(options=[1024, 2048], value=2048)
    assert read_typed(sequence, "2,048") == 2048


def test_a_typed_slider_refuses_keeps_the_last_good_value_and_clears_the_refusal_once_a_good_one_comes():
    control = TypedSlider(widgets.IntSlider(**GPUS))
    seen = []
    control.slider.observe(lambda change: seen.append(change["new"]), "value")
    for text in ("1e3", "-3", "seventy"):
        control.text.value = text
        assert control.value == 8 and control.text.value == "8", text     # the last good value, shown again
        assert control.note.layout.display is None and "Still 8." in control.note.value
    assert seen == []                                                     # the slider never moved
    control.text.value = "16"
    assert control.value == 16 and seen == [16] and control.note.value == "" and control.note.layout.display == "none"
    control.slider.value = 32                                             # dragged: the box follows
    assert control.text.value == "32"


def test_a_typed_slider_reads_and_writes_like_its_slider_and_turns_its_readout_off():
    slider = widgets.IntSlider(**GPUS, layout=widgets.Layout(width="450px"))
    control = typed(slider)
    assert isinstance(control, TypedSlider) and control.description == "GPUs" and not slider.readout
    assert control.layout.width == "450px" and slider.layout.width == "auto"   # the pair keeps the slider's width
    control.value = 4
    assert slider.value == 4 and control.text.value == "4"
    dropdown = widgets.Dropdown(options=[1, 2])
    assert typed(dropdown) is dropdown


def test_the_planner_shows_its_sliders_with_typed_boxes_that_notebooks_can_still_find_by_description():
    app = planner()
    left = app.children[0].children[0]
    controls = {c.description: c for c in left.children if c.description}
    assert isinstance(controls["GPUs (data parallel)"], TypedSlider)
    controls["GPUs (data parallel)"].text.value = "1e3"
    assert controls["GPUs (data parallel)"].value == 8 and "of 8x" in app.children[0].children[1].value
    controls["GPUs (data parallel)"].text.value = "16"
    assert "of 16x" in app.children[0].children[1].value


def test_an_app_shows_the_earlier_session_note_then_itself():
    shell = InteractiveShell.instance()
    active = shell.display_formatter.active_types
    shell.display_formatter.active_types = [*active, "text/html"]   # a kernel's: the terminal shows text only
    try:
        with capture_output() as captured:
            display(App([widgets.IntSlider()]))
    finally:
        shell.display_formatter.active_types = active
    note, app = captured.outputs
    assert note.data["text/html"] == STALE_NOTE and "run this cell again" in STALE_NOTE.lower()
    assert "application/vnd.jupyter.widget-view+json" in app.data and app.data["text/plain"] == PLAIN_NOTE


def test_every_labkit_app_is_an_app():
    assert isinstance(planner(), App) and isinstance(quiz(), App)
