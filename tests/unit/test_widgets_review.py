"""The review widgets give the feedback their graders and the quiz data say."""

from labkit.exercises import STACK_MAP
from labkit.quiz import load_questions
from labkit.widgets import flashcards, quiz, stack_map_exercise


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
