"""The review's widgets: the stack-map matching exercise, the multiple-choice quiz, and flashcards, with feedback.

Only the interface lives here; the questions, cards, stack map and graders are course content, in
`labkit.exercises`."""

from __future__ import annotations

import html
import string

import ipywidgets as widgets

from labkit.exercises import STACK_MAP, Flashcard, Question, check_stack_map, load_flashcards, load_questions
from labkit.viz.style import GREY
from labkit.widgets.app import PROSE_STYLE, App, prose

__all__ = ["OptionRows", "flashcards", "quiz", "stack_map_exercise"]


def stack_map_exercise() -> App:
    """One drop-down per NVIDIA component; "Check" grades the matching with `check_stack_map`.

    Nothing in the widget gives the key away before the student answers: every drop-down starts at "?" and
    offers the same verbs in alphabetical order, so neither a value nor an option's position hints at the pairing.
    """
    verbs = sorted(STACK_MAP.values())
    choosers = {name: widgets.Dropdown(options=["?", *verbs], value="?", description=name,
                                       style={"description_width": "110px"}) for name in STACK_MAP}
    feedback = widgets.HTML()
    button = widgets.Button(description="Check", button_style="primary")

    def check(_=None) -> None:
        verdict = check_stack_map({name: c.value for name, c in choosers.items() if c.value != "?"})
        feedback.value = prose(verdict._repr_markdown_().replace("**", ""))

    button.on_click(check)
    return App([*choosers.values(), button, feedback])


def quiz(questions: list[Question] | None = None) -> App:
    """Every question with one row per option and a "Check" button: immediate feedback with the explanation, and
    a running score of first attempts.

    Each row is a letter button beside the option's text, the text wrapping inside its own row at any width.
    (ipywidgets' RadioButtons gives each label one line of fixed height: a long option spills over the next one
    and loses its radio button.) Every option looks the same until it is picked."""
    questions = questions if questions is not None else load_questions()
    first_tries: dict[str, bool] = {}
    score = widgets.HTML()

    def show_score() -> None:
        right = sum(first_tries.values())
        score.value = f"<b>Score: {right} of {len(first_tries)} answered right first time ({len(questions)} in all)</b>"

    def card(number: int, question: Question) -> widgets.VBox:
        choices = OptionRows([option.text for option in question.options])
        feedback = widgets.HTML(layout=widgets.Layout(width="auto"))  # the column less its margins, as below
        button = widgets.Button(description="Check")

        def check(_=None) -> None:
            if choices.picked is None:
                feedback.value = prose("Pick a letter first.")
                return
            correct, explanation = question.check(choices.picked)
            first_tries.setdefault(question.id, correct)
            mark = "✅ Correct." if correct else "❌ Not quite."
            feedback.value = prose(f"<b>{mark}</b> " + html.escape(explanation).replace("\n", "<br>"))
            show_score()

        button.on_click(check)
        # "auto", not "100%": an HTML widget has a 2 px margin each side, and 100% of the card plus the margins
        # stuck out of it by 4 px, which gave every card a horizontal scrollbar
        header = widgets.HTML(f"<div style='{PROSE_STYLE}; padding:4px 0'><b>{number}. "
                              f"{html.escape(question.question)}</b></div>",
                              layout=widgets.Layout(width="auto"))
        header.add_class("labkit-quiz-question")
        return widgets.VBox([header, choices, button, feedback], layout=widgets.Layout(width="100%"))

    show_score()
    return App([score, *(card(i + 1, q) for i, q in enumerate(questions))], layout=widgets.Layout(width="100%"))


class OptionRows(widgets.VBox):
    """Single choice among texts of any length: one full-width row per option, a letter toggle and the wrapped
    text. `picked` is the index of the pressed letter, or None; pressing a letter releases the others."""

    TEXT_STYLE = "white-space:normal;overflow-wrap:anywhere;line-height:1.4;padding:4px 0 4px 6px"  # wraps in its row

    def __init__(self, texts: list[str]):
        self.picked: int | None = None
        self.letters = [widgets.ToggleButton(description=letter, tooltip=f"pick {letter}",
                                             layout=widgets.Layout(width="40px", min_width="40px"))
                        for letter in string.ascii_uppercase[:len(texts)]]
        rows = []
        for i, (letter, text) in enumerate(zip(self.letters, texts, strict=True)):
            letter.observe(lambda change, i=i: self._press(i, change["new"]), names="value")
            label = widgets.HTML(f"<div style='{self.TEXT_STYLE}'>{html.escape(text)}</div>",
                                 layout=widgets.Layout(flex="1 1 0%", min_width="0", width="auto"))
            row = widgets.HBox([letter, label], layout=widgets.Layout(width="100%", align_items="center"))
            row.add_class("labkit-quiz-option")
            rows.append(row)
        super().__init__(rows, layout=widgets.Layout(width="100%"))

    def _press(self, index: int, pressed: bool) -> None:
        if pressed:
            self.picked = index
            for i, letter in enumerate(self.letters):
                letter.value = i == index
        elif self.picked == index:
            self.picked = None
        for i, letter in enumerate(self.letters):
            letter.button_style = "info" if i == self.picked else ""


def flashcards(cards: list[Flashcard] | None = None) -> App:
    """One card at a time: its prompt, "Flip" shows its back (the lesson's summary bullet and, set apart below it,
    the card's note where the bullet is imprecise; a course card's takeaway), "Next" moves on."""
    cards = cards if cards is not None else load_flashcards()
    state = {"card": 0, "back": False}
    face = widgets.HTML()
    flip, following = widgets.Button(description="Flip"), widgets.Button(description="Next")

    def draw() -> None:
        current = cards[state["card"]]
        text, side = (current.back, "back") if state["back"] else (current.front, "front")
        note = (f"<hr><small><b>More precisely</b> (a note, not the lesson's words): {html.escape(current.note)}"
                "</small>") if state["back"] and current.note else ""
        face.value = (f"<div style='{PROSE_STYLE}; border:1px solid {GREY};padding:12px;min-height:60px'><small>card "
                      f"{state['card'] + 1} of {len(cards)}, {side}</small><br>{html.escape(text)}{note}</div>")

    def on_flip(_=None) -> None:
        state["back"] = not state["back"]
        draw()

    def on_next(_=None) -> None:
        state["card"], state["back"] = (state["card"] + 1) % len(cards), False
        draw()

    flip.on_click(on_flip)
    following.on_click(on_next)
    draw()
    return App([face, widgets.HBox([flip, following])])
