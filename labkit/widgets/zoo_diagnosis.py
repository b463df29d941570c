"""Notebook 15's diagnosis widget: one card per broken run, a drop-down of causes, "Check", and why.

Only the interface lives here; the runs, their causes and the answers are course content, in
`labkit.exercises.bug_zoo`. Each card offers the six causes and two distractors chosen for its run, sorted by
their text, so neither a position nor a default gives the answer away. A card keeps its last verdict; the line
at the top counts the runs diagnosed right, and every "Check" is recorded in the student's progress file
(exercise "bug_zoo_diagnoses"), passed once all six are right at the same time. A card may confirm a right
diagnosis with a measurement (`confirm`), shown only once the student has chosen that cause, so that no cell
names a cause before the student does.
"""

from __future__ import annotations

import html
from collections.abc import Callable

import ipywidgets as widgets

from labkit.exercises.bug_zoo import ANSWERS, CAUSES, DISTRACTORS
from labkit.exercises.progress import record_attempt
from labkit.widgets.app import App, prose

__all__ = ["DiagnosisCard", "diagnosis_widget"]

PROMPT = "choose a cause"  # the value "": a browser shows no text for a drop-down whose value is None


class DiagnosisCard(widgets.VBox):
    """Run `letter`'s question: its causes in a drop-down, a "Check" button, and the feedback, kept."""

    def __init__(self, letter: str, on_check, confirm: Callable[[], str] | None = None):
        self.letter, self.right, self._confirm = letter, None, confirm
        keys = sorted({*ANSWERS.values(), *DISTRACTORS[letter]}, key=lambda key: CAUSES[key].label)
        self.dropdown = widgets.Dropdown(options=[(PROMPT, ""), *((CAUSES[k].label, k) for k in keys)],
                                         value="", layout=widgets.Layout(width="100%", max_width="640px"))
        self.button = widgets.Button(description="Check", button_style="primary")
        # "auto", not "100%": the HTML widget's 2 px margins made 100% stick out of the card by 4 px (a scrollbar)
        self.feedback = widgets.HTML(layout=widgets.Layout(width="auto"))
        self._on_check = on_check
        self.button.on_click(lambda _: self.check())
        title = widgets.HTML(f"<b>Run {letter}</b>: what went wrong?")
        super().__init__([title, widgets.HBox([self.dropdown, self.button]), self.feedback],
                         layout=widgets.Layout(width="100%", margin="0 0 10px 0"))
        self.add_class("labkit-diagnosis")

    def choose(self, key: str) -> None:
        """Pick cause `key` and press "Check" (what a student does with the mouse)."""
        self.dropdown.value = key
        self.check()

    def check(self) -> None:
        """Grade the chosen cause: say why it is right, or what it would have shown instead."""
        key = self.dropdown.value
        if not key:
            self.feedback.value = prose("Choose a cause in the list first.")
            return
        self.right = key == ANSWERS[self.letter]
        cause = CAUSES[key]
        if self.right:
            text = f"<b>✅ Right.</b> This run shows {html.escape(cause.shows)}."
            if self._confirm is not None:
                text += " " + html.escape(self._confirm())
        else:
            text = (f"<b>❌ Not this one.</b> {html.escape(cause.label.capitalize())} would show "
                    f"{html.escape(cause.shows)}. Look again at run {self.letter}'s symptoms above.")
        self.feedback.value = prose(text)
        self._on_check()


def diagnosis_widget(confirm: dict[str, Callable[[], str]] | None = None) -> App:
    """The six runs' cards under a line that counts those diagnosed right. `confirm` maps a run's letter to a
    function giving the sentence of a measurement that confirms its cause, added once that run is diagnosed
    right (labkit.exercises.bug_zoo.confirmation)."""
    score = widgets.HTML()
    cards: list[DiagnosisCard] = []

    def on_check() -> None:
        right = sum(bool(card.right) for card in cards)
        score.value = f"<b>{right} of {len(cards)} runs diagnosed right</b>"
        record_attempt("bug_zoo_diagnoses", right == len(cards))

    cards.extend(DiagnosisCard(letter, on_check, (confirm or {}).get(letter)) for letter in ANSWERS)
    score.value = f"<b>0 of {len(cards)} runs diagnosed right</b>"
    return App([score, *cards], layout=widgets.Layout(width="100%"))
