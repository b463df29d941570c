"""The review widgets give the feedback their graders and the quiz data say."""

from labkit.exercises import STACK_MAP
from labkit.quiz import Flashcard, load_flashcards, load_questions
from labkit.widgets import flashcards, quiz, stack_map_exercise


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


def test_quiz_scores_first_attempts_and_explains():
    questions = load_questions()[:2]
    app = quiz(questions)
    score, first, second = app.children
    _, choices, button, feedback = first.children
    choices.index = (questions[0].answer + 1) % 4
    button.click()
    assert "Not quite" in feedback.value and "Answer:" in feedback.value
    choices.index = questions[0].answer
    button.click()
    assert "Correct" in feedback.value and "0 of 1" in score.value
    _, choices, button, _ = second.children
    choices.index = questions[1].answer
    button.click()
    assert "1 of 2" in score.value


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
