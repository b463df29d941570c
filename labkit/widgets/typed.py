"""TypedSlider: a slider whose value can also be typed, and typed text is checked as the planner's parameters box
checks it: taken when it reads as a value the slider allows, else refused with the reason, the last good value kept.

ipywidgets' own readout takes typed text without a word: an IntSlider reads "1e3" as 1 (parseInt stops at the
"e"), "-3" as its minimum and ignores "seventy", and the kernel only ever sees the value it made of them. So the
slider's readout is turned off and a text box beside it shows the value and takes what is typed.

    read_typed(slider, text)    the value `text` stands for on `slider`, or ValueError saying why not
    TypedSlider(slider)         the slider, a text box beside it and a line under them for a refusal
    typed(control)              a TypedSlider for a slider, any other control as it is
"""

from __future__ import annotations

import html
import math

import ipywidgets as widgets

from labkit.viz.style import RED
from labkit.widgets.app import prose

__all__ = ["SLIDERS", "TEXT_PIXELS", "TypedSlider", "read_typed", "shown_value", "typed"]

TEXT_PIXELS = 76  # the text box beside the slider: "1,000,000" and "100%" whole
SLIDERS = (widgets.IntSlider, widgets.FloatSlider, widgets.FloatLogSlider, widgets.SelectionSlider)
_SELECTION = (widgets.SelectionSlider,)
_WHOLE = (widgets.IntSlider,)


def shown_value(slider: widgets.Widget, value=None) -> str:
    """`value` (default: the slider's) as the slider's readout would write it: its readout_format ("d", ".2f",
    ".0%", ".3g"), or an option's label for a SelectionSlider."""
    if isinstance(slider, _SELECTION):
        if value is None:
            return slider.label
        return next(label for label, option in _options(slider) if option == value)
    value = slider.value if value is None else value
    try:
        return format(value, slider.readout_format)
    except (ValueError, TypeError):  # a d3 format Python does not read ("~s")
        return f"{value:g}"


def read_typed(slider: widgets.Widget, text: str):
    """The value that typed `text` stands for on `slider`; ValueError with the reason when it stands for none:
    not a number, not whole on an integer slider, outside the slider's range, not one of a selection's options.
    Thousands separators and spaces are ignored ("40,000"); a percentage slider takes "50%" as well as 0.5.

    >>> gpus = widgets.IntSlider(value=8, min=1, max=64)
    >>> read_typed(gpus, " 16 "), read_typed(gpus, "1e1")
    (16, 10)
    >>> for typed in ("1e3", "-3", "seventy", "2.5"):
    ...     try:
    ...         read_typed(gpus, typed)
    ...     except ValueError as error:
    ...         print(error)
    1e3 is 1000, above the most this slider takes, 64.
    -3 is below the least this slider takes, 1.
    "seventy" is not a number: type one such as 8.
    2.5 is not a whole number: type one such as 8.
    """
    typed = str(text).strip()
    if isinstance(slider, _SELECTION):
        return _read_option(slider, typed)
    number = _read_number(slider, typed)
    if isinstance(slider, _WHOLE):
        if number != math.floor(number):
            raise ValueError(f"{typed} is not a whole number: type one such as {shown_value(slider)}.")
        number = int(number)
    low, high = _range(slider)
    if not low <= number <= high:
        reads = "is" if typed == f"{number:g}" else f"is {number:g},"   # "1e3 is 1000, above ..."
        where = f"below the least this slider takes, {shown_value(slider, low)}" if number < low else \
            f"above the most this slider takes, {shown_value(slider, high)}"
        raise ValueError(f"{typed} {reads} {where}.")
    return number


def _read_number(slider: widgets.Widget, typed: str) -> float:
    """`typed` as a finite number (a trailing % on a percentage slider divides by 100); ValueError otherwise."""
    cleaned = typed.replace(",", "").replace("_", "").replace(" ", "")
    percent = cleaned.endswith("%") and str(getattr(slider, "readout_format", "")).endswith("%")
    try:
        number = float(cleaned[:-1]) / 100 if percent else float(cleaned)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        shown = html.unescape(typed) or "nothing"
        raise ValueError(f"\"{shown}\" is not a number: type one such as {shown_value(slider)}.")
    return number


def _range(slider: widgets.Widget) -> tuple[float, float]:
    """The least and the most value the slider takes (a FloatLogSlider's are base ** its min and max)."""
    if isinstance(slider, widgets.FloatLogSlider):
        return slider.base ** slider.min, slider.base ** slider.max
    return slider.min, slider.max


def _options(slider: widgets.SelectionSlider) -> list[tuple[str, object]]:
    """(label, value) for each of a selection slider's options."""
    return list(zip(slider._options_labels, slider._options_values, strict=True))


def _read_option(slider: widgets.SelectionSlider, typed: str):
    """The option whose label is `typed` (thousands separators ignored); ValueError listing the options."""
    options = _options(slider)
    wanted = typed.replace(",", "").replace(" ", "")
    for label, value in options:
        if label.replace(",", "").replace(" ", "") == wanted:
            return value
    labels = ", ".join(label for label, _ in options)
    raise ValueError(f"\"{typed}\" is not one of this slider's values: {labels}.")


class TypedSlider(widgets.VBox):
    """`slider` without its own readout, a text box beside it showing its value, and under them a line that
    appears only to refuse typed text: why it was refused, and that the last good value stays.

    Reads and writes like the slider itself where a notebook looks (`description`, `value`), so a dict of a
    panel's controls by description still finds it, and `.value = 2048` moves the slider.

    >>> layers = TypedSlider(widgets.IntSlider(value=32, min=1, max=128, description="layers"))
    >>> layers.text.value = "1e3"
    >>> layers.value, layers.text.value, "above the most" in layers.note.value
    (32, '32', True)
    >>> layers.text.value = "64"
    >>> layers.value, layers.note.value
    (64, '')
    """

    def __init__(self, slider: widgets.Widget):
        self.slider = slider
        width = slider.layout.width  # the slider's width is the pair's: the text box takes its part of it
        slider.readout = False
        slider.layout.width, slider.layout.flex = "auto", "1 1 auto"
        self.text = widgets.Text(value=shown_value(slider), continuous_update=False,
                                 layout=widgets.Layout(width=f"{TEXT_PIXELS}px", flex="0 0 auto"))
        self.note = widgets.HTML(layout=widgets.Layout(width="auto", display="none"))
        self._showing = False  # the text box being set to the slider's value: not something typed
        slider.observe(lambda _: self._show_value(), "value")
        self.text.observe(lambda change: self._typed(change["new"]), "value")
        row = widgets.HBox([slider, self.text], layout=widgets.Layout(width="100%", align_items="center"))
        super().__init__([row, self.note], layout=widgets.Layout(width=width))

    @property
    def description(self) -> str:
        return self.slider.description

    @property
    def value(self):
        return self.slider.value

    @value.setter
    def value(self, value) -> None:
        self.slider.value = value

    def _show_value(self) -> None:
        self._showing = True
        try:
            self.text.value = shown_value(self.slider)
        finally:
            self._showing = False

    def _typed(self, text: str) -> None:
        """Take typed `text` into the slider, or refuse it with the reason and show the slider's value again."""
        if self._showing:
            return
        try:
            value = read_typed(self.slider, text)
        except ValueError as error:
            self.note.value = prose(f"<span style='color:{RED}'>{html.escape(str(error))}</span> "
                                    f"Still {html.escape(shown_value(self.slider))}.")
            self.note.layout.display = None
            self._show_value()
            return
        self.note.value, self.note.layout.display = "", "none"
        if value == self.slider.value:
            self._show_value()  # "8.0" typed for 8: written as the slider writes it
        else:
            self.slider.value = value


def typed(control: widgets.Widget) -> widgets.Widget:
    """`control` as a panel shows it: a slider (SLIDERS) in a TypedSlider, anything else as it is."""
    return TypedSlider(control) if isinstance(control, SLIDERS) else control
