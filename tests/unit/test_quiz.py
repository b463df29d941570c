"""The review quiz: every question well formed, every one of the lesson's question phrasings asked word for word
with the lesson's answer, every summary bullet a flashcard, the lesson's traps used as distractors, and a loader
that rejects a broken question by name."""

import collections
import copy
import doctest
import json
import re
from pathlib import Path

import pytest

import labkit
import labkit.quiz
from labkit.quiz import Feedback, load_distractor_families, load_flashcards, load_questions

ROOT = Path(labkit.__file__).parent
LESSON = (ROOT / "data" / "lesson.txt").read_text(encoding="utf-8")
QUIZ = ROOT / "data" / "quiz.json"


def lesson_phrasings() -> list[tuple[str, str]]:
    """(question, answer) of each bullet under "Question phrasings:", up to "Distractor families:"."""
    section = LESSON.split("Question phrasings:", 1)[1].split("Distractor families:", 1)[0]
    found = [re.fullmatch(r'• "(.+)" — (.+)', line) for line in section.splitlines() if line.startswith('• "')]
    return [(m.group(1), m.group(2)) for m in found]


def summary_bullets() -> list[str]:
    """The bullets after "Distractor families:": the lesson's summary."""
    section = LESSON.split("Distractor families:", 1)[1]
    return [line[2:] for line in section.splitlines() if line.startswith("• ")]


# The words of the lesson's answer (after the dash) that the correct option must contain and no wrong one may.
KEYWORDS = {
    1: ["allreduce"],
    2: ["collective communication", "multi-gpu", "multi-node"],
    3: ["model parallelism", "tensor", "pipeline"],
    4: ["independent of the number of gpus", "links", "scales"],
    5: ["effective batch size", "increases proportionally"],
    6: ["gradient accumulation"],
    7: ["pipeline parallelism"],
}


def test_the_lesson_has_seven_phrasings_and_ten_summary_bullets():
    assert len(lesson_phrasings()) == 7 and sorted(KEYWORDS) == list(range(1, 8))
    assert len(summary_bullets()) == 10


@pytest.mark.parametrize("number", range(1, 8))
def test_each_question_phrasing_is_asked_verbatim_with_the_lessons_answer(number):
    phrasing, answer = lesson_phrasings()[number - 1]
    matches = [q for q in load_questions() if q.question == phrasing]
    assert len(matches) == 1, phrasing
    question = matches[0]
    assert question.phrasing == number
    right = question.options[question.answer].text.lower()
    wrong = [o.text.lower() for o in question.options if not o.correct]
    for keyword in KEYWORDS[number]:
        assert keyword in answer.lower(), (keyword, answer)  # the keyword is the lesson's own
        assert keyword in right, (keyword, right)
        assert not any(keyword in text for text in wrong), (keyword, wrong)


def test_every_question_has_four_distinct_options_one_correct_and_an_explanation():
    raw = json.loads(QUIZ.read_text(encoding="utf-8"))["questions"]
    questions = load_questions()
    assert len(questions) == len(raw) >= 20
    for data, question in zip(raw, questions, strict=True):
        assert len(data["options"]) == 4 and sum(o["correct"] is True for o in data["options"]) == 1, data["id"]
        assert len({o.text.strip().lower() for o in question.options}) == 4, question.id
        assert question.explanation.strip() and question.question.strip(), question.id
        for option in question.options:
            assert option.correct or (option.distractor and option.why.strip()), (question.id, option.text)
    assert len({q.id for q in questions}) == len(questions)
    # The right answer is not always in the same place.
    positions = collections.Counter(q.answer for q in questions)
    assert len(positions) == 4 and max(positions.values()) <= len(questions) // 2, positions


def test_the_lessons_traps_are_distractors():
    families = load_distractor_families()
    used = collections.Counter(o.distractor for q in load_questions() for o in q.options if not o.correct)
    assert set(used) <= set(families)
    for trap in ("umbrella", "nccl-role", "accumulation-as-parallelism", "dp-for-too-large", "collective-confusion",
                 "checkpointing", "stack-map", "dp-vs-tp"):
        assert used[trap] >= 1, trap


def test_the_umbrella_term_is_right_for_the_general_constraint_and_a_trap_for_a_specific_one():
    questions = {q.id: q for q in load_questions()}
    general = questions["too-large-for-one-gpu"]
    assert general.options[general.answer].text == "Model parallelism (tensor or pipeline parallelism)"
    assert {o.distractor for o in general.options if not o.correct} >= {"dp-for-too-large",
                                                                        "accumulation-as-parallelism"}
    specific = questions["one-layer-too-big"]
    assert specific.options[specific.answer].text == "Tensor parallelism"
    umbrella = [o for o in specific.options if o.distractor == "umbrella"]
    assert [o.text for o in umbrella] == ["Model parallelism"]
    assert "umbrella" in specific.explanation and "category and two of its members" in specific.explanation
    # the two meanings of checkpointing, each asked, each with the other as a distractor
    activation, durability = questions["activation-checkpointing"], questions["fault-tolerance-checkpointing"]
    assert "recomputes" in activation.options[activation.answer].text
    assert "RNG states and data position" in durability.options[durability.answer].text
    assert any(o.distractor == "checkpointing" and "resume" in o.text for o in activation.options)
    assert any(o.distractor == "checkpointing" and o.text.startswith("Activation") for o in durability.options)


def test_every_summary_bullet_is_a_flashcard():
    cards = load_flashcards()
    assert sorted(card.back for card in cards) == sorted(summary_bullets())
    assert all(card.front.strip() and card.front != card.back for card in cards)
    assert len({card.id for card in cards}) == len(cards)


def test_check_says_right_or_wrong_and_explains():
    question = next(q for q in load_questions() if q.phrasing == 1)
    assert question.check(question.answer) == Feedback(True, question.explanation)
    wrong = next(i for i, o in enumerate(question.options) if not o.correct)
    correct, explanation = question.check(wrong)
    assert not correct
    assert explanation.startswith(question.options[wrong].why)
    assert f"Answer: {question.options[question.answer].text}." in explanation and question.explanation in explanation
    for bad in (-1, 4, True, "1"):
        with pytest.raises(ValueError, match="choice must be an option index from 0 to 3"):
            question.check(bad)
    shuffled = question.shuffled(seed=3)
    assert shuffled.options[shuffled.answer] == question.options[question.answer]
    assert sorted(o.text for o in shuffled.options) == sorted(o.text for o in question.options)
    assert shuffled == question.shuffled(seed=3)


def broken(tmp_path, change):
    """A copy of the real quiz with `change` applied to its first question; returns the file."""
    data = json.loads(QUIZ.read_text(encoding="utf-8"))
    change(data["questions"][0], data)
    path = tmp_path / "quiz.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def first(question, correct: bool) -> dict:
    return next(o for o in question["options"] if o["correct"] is correct)


BREAKAGES = {  # name: (change to the first question, what the error says after "quiz question '<id>': ")
    "two correct answers": (lambda q, d: first(q, False).update(correct=True),
                            "needs exactly one correct option, has 2"),
    "no correct answer": (lambda q, d: first(q, True).update(correct=False), "needs exactly one correct option, has 0"),
    "three options": (lambda q, d: q["options"].pop(0), "needs 4 options, has 3"),
    "the same option twice": (lambda q, d: q["options"][2].update(text=q["options"][0]["text"].upper()),
                              "its 4 options must be distinct"),
    "an empty explanation": (lambda q, d: q.update(explanation="  "), "explanation must be non-empty text"),
    "an unknown distractor family": (lambda q, d: first(q, False).update(distractor="made-up"),
                                     "wrong option 'Broadcast' has distractor 'made-up', not one of"),
    "a wrong option without a reason": (lambda q, d: first(q, False).update(why=""),
                                        "wrong option 'Broadcast' does not say why it is wrong"),
    "phrasing 8": (lambda q, d: q.update(phrasing=8), "phrasing must be a number from 1 to 7 or null, got 8"),
    "a misspelt field": (lambda q, d: q.update(explantion="x"), "unknown fields ['explantion']"),
}


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_the_loader_rejects_a_broken_question_naming_it(tmp_path, breakage):
    change, message = BREAKAGES[breakage]
    with pytest.raises(ValueError, match=re.escape(f"quiz question 'allreduce-synchronizes-gradients': {message}")):
        load_questions(broken(tmp_path, change))


def test_the_loader_rejects_a_repeated_id(tmp_path):
    def repeat(question, data):
        data["questions"].append(copy.deepcopy(question) | {"phrasing": None})
    with pytest.raises(ValueError, match="quiz: question allreduce-synchronizes-gradients appears more than once"):
        load_questions(broken(tmp_path, repeat))


def test_the_quiz_ships_as_package_data():
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((ROOT.parent / "pyproject.toml").read_text(encoding="utf-8"))
    assert "data/*.json" in pyproject["tool"]["setuptools"]["package-data"]["labkit"]


def test_docstring_example():
    result = doctest.testmod(labkit.quiz)
    assert result.attempted > 0 and result.failed == 0
