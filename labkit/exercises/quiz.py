"""The review quiz and flashcards of the lesson, as data (labkit/exercises/quiz.json) a widget can show.

    load_questions()           Questions: the lesson's seven question phrasings and more, four options each
    load_flashcards()          Flashcards: a prompt in front, one of the lesson's summary bullets on the back,
                               and where the bullet is imprecise, a separate note saying what is precisely true
    load_flashcards(topic=..)  the course's own cards on a quiz topic past the lesson (zero bubble, context and
                               expert parallelism): a notebook's takeaways, in the course's words
    load_distractor_families() the families of wrong answers the options are tagged with, and what each means

A Question knows its answer: `question.check(i)` says whether option i is right and explains, and a wrong
option carries its distractor family (the lesson's traps: "model parallelism" offered beside its own members,
NCCL taken for a framework, gradient accumulation for a parallelism strategy, replicated data parallelism (DDP)
for a model too large, Broadcast vs Reduce vs AllReduce, the two meanings of checkpointing...) and why it is
wrong.

Every load checks the file: four distinct options, exactly one correct, an explanation, a known family and a
reason for every wrong option; a broken question raises ValueError naming its id.

Example::

    >>> from labkit.exercises import load_questions
    >>> question = next(q for q in load_questions() if q.phrasing == 1)
    >>> question.question
    'Which operation synchronizes gradients across GPUs in data-parallel training?'
    >>> [option.text for option in question.options]
    ['Broadcast', 'AllReduce', 'Reduce', 'Gradient accumulation']
    >>> question.check(1).correct, question.check(0).correct
    (True, False)
    >>> question.check(0).explanation.split(":")[0]              # a wrong pick: why it is wrong, then the answer
    "Broadcast copies one rank's tensor to every rank"
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from importlib.resources import files
from pathlib import Path
from typing import NamedTuple

from labkit.checks import shown, whole

__all__ = ["Feedback", "Flashcard", "Option", "Question", "load_distractor_families", "load_flashcards",
           "load_questions"]

PHRASINGS = 7  # the lesson's "Question phrasings"


@dataclass(frozen=True)
class Option:
    """One answer to choose. A wrong one names its distractor family and says why it is wrong."""
    text: str
    correct: bool
    distractor: str | None = None
    why: str = ""


class Feedback(NamedTuple):
    """What Question.check says: right or not, and the explanation to show."""
    correct: bool
    explanation: str


@dataclass(frozen=True)
class Question:
    """A multiple-choice question. `phrasing` is the number (1-7) of the lesson's question phrasing it
    reproduces word for word, or None."""
    id: str
    topic: str
    question: str
    options: tuple[Option, ...]
    explanation: str
    phrasing: int | None = None

    @property
    def answer(self) -> int:
        """The index of the correct option."""
        return next(i for i, option in enumerate(self.options) if option.correct)

    def check(self, choice: int) -> Feedback:
        """Is option `choice` (0-based) right? The explanation; for a wrong choice, why first, then the answer."""
        if whole("choice", choice, minimum=0) >= len(self.options):
            raise ValueError(f"choice={shown(choice)}: pass an option index from 0 to {len(self.options) - 1}.")
        if choice == self.answer:
            return Feedback(True, self.explanation)
        picked, right = self.options[choice], self.options[self.answer]
        return Feedback(False, f"{picked.why}\nAnswer: {right.text}. {self.explanation}")

    def shuffled(self, seed: int) -> Question:
        """The same question with its options in another order (the same for the same seed)."""
        options = list(self.options)
        random.Random(seed).shuffle(options)
        return replace(self, options=tuple(options))


@dataclass(frozen=True)
class Flashcard:
    """A prompt in front; on the back, one of the lesson's summary bullets, verbatim. Where the bullet is
    imprecise, `note` (not the lesson's words) says what is precisely true; empty otherwise. A course card has a
    `topic` (a quiz topic) and its back is the course's own words; a lesson card's topic is ""."""
    id: str
    front: str
    back: str
    note: str = ""
    topic: str = ""


def load_questions(path: str | Path | None = None) -> list[Question]:
    """The quiz's questions, checked; from labkit/exercises/quiz.json unless `path` names another file."""
    data = _load(path)
    families = data["distractor_families"]
    questions = [_question(raw, families) for raw in data["questions"]]
    _unique([q.id for q in questions], "question")
    _unique([q.phrasing for q in questions if q.phrasing is not None], "phrasing")
    return questions


def load_flashcards(path: str | Path | None = None, topic: str | None = None) -> list[Flashcard]:
    """The lesson's flashcards, or with `topic` the course's own cards on that quiz topic; checked (known fields,
    non-empty sides, a note that adds something, ids unique over both decks, a topic the quiz has)."""
    data = _load(path)
    lesson = [_flashcard(raw) for raw in data["flashcards"]]
    course = [_flashcard(raw, course=True) for raw in data.get("course_flashcards", [])]
    _unique([card.id for card in lesson + course], "flashcard")
    if topic is None:
        return lesson
    topics = sorted({raw.get("topic") for raw in data["questions"]} & {card.topic for card in course})
    if topic not in topics:
        raise ValueError(f"topic={shown(topic)}: the course's own flashcards cover {', '.join(topics)}; pass one of "
                         "them, or no topic for the lesson's.")
    return [card for card in course if card.topic == topic]


def load_distractor_families(path: str | Path | None = None) -> dict[str, str]:
    """Family tag -> what that kind of wrong answer gets wrong."""
    return dict(_load(path)["distractor_families"])


def _load(path) -> dict:
    """The quiz file's contents, with its three sections; the package's own file unless `path` names another."""
    source = files("labkit.exercises").joinpath("quiz.json") if path is None else Path(path)
    data = json.loads(source.read_text(encoding="utf-8"))
    missing = {"distractor_families", "questions", "flashcards"} - set(data)
    if missing:
        raise ValueError(f"{source}: no {', '.join(sorted(missing))} in the quiz file.")
    return data


def _question(raw: dict, families: dict) -> Question:
    """One question of the file, checked: its fields, its phrasing, its four options; ValueError naming its id."""
    name = raw.get("id")
    _check_fields(raw, name)
    phrasing = _phrasing(raw, name)
    options = _options(raw.get("options", []), name)
    for option in options:
        _check_option(option, families, name)
    return Question(raw["id"], raw["topic"], raw["question"], options, raw["explanation"], phrasing)


def _phrasing(raw: dict, name) -> int | None:
    """The question's lesson phrasing, 1 to PHRASINGS, or None. Anything else (a string or a bool included) is a
    broken file: ValueError naming the question, as for every other field here."""
    phrasing = raw.get("phrasing")
    try:
        usable = phrasing is None or whole("phrasing", phrasing) <= PHRASINGS
    except (TypeError, ValueError):  # a string, a bool, 0: refused below, naming the question and the range
        usable = False
    if not usable:
        raise _broken(name, f"phrasing={shown(phrasing)}: pass a whole number from 1 to {PHRASINGS}, or null.")
    return phrasing


def _broken(name, problem: str) -> ValueError:
    """The error for a broken question: its id, then what is wrong."""
    return ValueError(f"quiz question {name!r}: {problem}")


def _check_fields(raw: dict, name) -> None:
    """Only known fields, and id, topic, question and explanation as non-empty text."""
    unknown = set(raw) - {"id", "topic", "question", "options", "explanation", "phrasing"}
    if unknown:
        raise _broken(name, f"unknown fields {sorted(unknown)}.")
    for field in ("id", "topic", "question", "explanation"):
        if not isinstance(raw.get(field), str) or not raw[field].strip():
            raise _broken(name, f"{field} must be non-empty text.")


def _options(raw_options: list, name) -> tuple[Option, ...]:
    """The question's options: four, with known fields, distinct non-empty texts, exactly one correct."""
    try:
        options = tuple(Option(**option) for option in raw_options)
    except TypeError as exc:
        raise _broken(name, f"an option has wrong fields ({exc}).") from None
    if len(options) != 4:
        raise _broken(name, f"needs 4 options, has {len(options)}.")
    texts = [option.text.strip().lower() if isinstance(option.text, str) else "" for option in options]
    if not all(texts) or len(set(texts)) != 4:
        raise _broken(name, "its 4 options must be distinct, non-empty texts.")
    if not all(isinstance(option.correct, bool) for option in options):
        raise _broken(name, "every option's correct must be true or false.")
    if sum(option.correct for option in options) != 1:
        raise _broken(name, f"needs exactly one correct option, has {sum(option.correct for option in options)}.")
    return options


def _check_option(option: Option, families: dict, name) -> None:
    """The correct option carries no distractor; a wrong one names a known family and says why it is wrong."""
    if option.correct and (option.distractor or option.why):
        raise _broken(name, f"the correct option {option.text!r} has a distractor family or a why.")
    if not option.correct and option.distractor not in families:
        raise _broken(name, f"wrong option {option.text!r} has distractor {option.distractor!r}, "
                            f"not one of {sorted(families)}.")
    if not option.correct and not (isinstance(option.why, str) and option.why.strip()):
        raise _broken(name, f"wrong option {option.text!r} does not say why it is wrong.")


def _flashcard(raw: dict, course: bool = False) -> Flashcard:
    """One flashcard of the file, checked: known fields, a front and a back, a note that adds something; a
    `course` card's topic."""
    name = raw.get("id")
    unknown = set(raw) - {"id", "front", "back", "note", *(("topic",) if course else ())}
    if unknown:
        raise ValueError(f"flashcard {name!r}: unknown fields {sorted(unknown)}.")
    if not all(isinstance(raw.get(side), str) and raw[side].strip() for side in ("id", "front", "back")):
        raise ValueError(f"flashcard {name!r}: id, front and back must be non-empty text.")
    note = raw.get("note", "")
    if "note" in raw and not (isinstance(note, str) and note.strip() and note != raw["back"]):
        raise ValueError(f"flashcard {name!r}: a note must be non-empty text that is not the back again.")
    topic = raw.get("topic", "")
    if course and not (isinstance(topic, str) and topic.strip()):
        raise ValueError(f"flashcard {name!r}: a course card names its quiz topic.")
    return Flashcard(raw["id"], raw["front"], raw["back"], note, topic)


def _unique(values: list, what: str) -> None:
    """ValueError naming every value that appears more than once among the questions' or cards' `values`."""
    repeated = sorted({str(v) for v in values if values.count(v) > 1})
    if repeated:
        raise ValueError(f"quiz: {what} {', '.join(repeated)} appears more than once.")
