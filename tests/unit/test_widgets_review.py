"""The review widgets give the feedback their graders and the quiz data say."""

import html

from labkit.exercises import STACK_MAP, Flashcard, load_flashcards, load_questions
from labkit.widgets import flashcards, quiz, stack_map_exercise
from labkit.widgets.app import prose


def test_stack_map_exercise_gives_nothing_away_before_the_student_answers():
    *choosers, button, feedback = stack_map_exercise().children
    assert [c.description for c in choosers] == list(STACK_MAP) and feedback.value == ""
    assert all(c.value == "?" for c in choosers)                      # nothing pre-filled
    options = {c.options for c in choosers}
    assert options == {("?", *sorted(STACK_MAP.values()))}            # the same list for all, in alphabetical order


def test_stack_map_exercise_grades_the_matching():
    app = stack_map_exercise()
    *choosers, button, feedback = app.children
    for chooser in choosers:
        chooser.value = STACK_MAP[chooser.description]
    button.click()
    assert "Correct" in feedback.value
    choosers[0].value = "serves"
    button.click()
    assert "Not yet" in feedback.value and "NCCL" in feedback.value


def pick(card, index: int) -> None:
    """Press the letter of option `index` in one question's card."""
    _, options, _, _ = card.children
    options.children[index].children[0].value = True


def test_quiz_scores_first_attempts_and_explains():
    questions = load_questions()[:2]
    app = quiz(questions)
    score, first, second = app.children
    *_, button, feedback = first.children
    button.click()
    assert feedback.value == prose("Pick a letter first.") and "0 of 0" in score.value
    pick(first, (questions[0].answer + 1) % 4)
    button.click()
    assert "Not quite" in feedback.value and "Answer:" in feedback.value
    pick(first, questions[0].answer)
    button.click()
    assert "Correct" in feedback.value and "0 of 1" in score.value
    pick(second, questions[1].answer)
    second.children[2].click()
    assert "1 of 2" in score.value


def test_every_option_is_a_row_of_its_own_alike_until_picked():
    """One row per option, a letter button beside the whole text, set to wrap: nothing in how the rows are
    drawn tells the right one from the others (RadioButtons drew long labels over the next option)."""
    for question in load_questions():
        header, options, _, _ = quiz([question]).children[1].children
        assert html.escape(question.question) in header.value
        rows = options.children
        assert len(rows) == len(question.options)
        looks = set()
        for letter_name, row, option in zip("ABCD", rows, question.options, strict=True):
            letter, text = row.children
            assert letter.description == letter_name and "labkit-quiz-option" in row._dom_classes
            assert html.escape(option.text) in text.value and "white-space:normal" in text.value
            looks.add((letter.value, letter.button_style, letter.layout.width, row.layout.width,
                       text.value.replace(html.escape(option.text), "")))
        assert len(looks) == 1, (question.id, looks)


def test_pressing_a_letter_releases_the_others():
    app = quiz(load_questions()[:1])
    _, options, _, _ = app.children[1].children
    letters = [row.children[0] for row in options.children]
    letters[2].value = True
    letters[0].value = True
    assert [letter.value for letter in letters] == [True, False, False, False] and options.picked == 0
    assert [letter.button_style for letter in letters] == ["info", "", "", ""]
    letters[0].value = False
    assert options.picked is None and not any(letter.value or letter.button_style for letter in letters)


def test_flashcards_flip_to_the_lesson_s_bullet_and_move_on():
    app = flashcards()
    face, (flip, following) = app.children[0], app.children[1].children
    assert "card 1 of 10, front" in face.value
    flip.click()
    assert "back" in face.value
    following.click()
    assert "card 2 of 10, front" in face.value


def test_a_flashcard_s_note_shows_on_the_back_set_apart_from_the_lesson_s_bullet():
    noted = next(card for card in load_flashcards() if card.note)
    app = flashcards([noted, Flashcard("plain", "front?", "back.")])
    face, (flip, following) = app.children[0], app.children[1].children
    assert "More precisely" not in face.value and noted.note[:40] not in face.value   # the front: prompt only
    flip.click()
    bullet, note = face.value.split("<hr>")
    assert noted.back[:40] in bullet and "More precisely" in note and "not the lesson's words" in note
    following.click()
    flip.click()
    assert "back." in face.value and "More precisely" not in face.value and "<hr>" not in face.value
