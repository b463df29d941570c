"""The review quiz: every question well formed, every one of the lesson's question phrasings asked word for word
with the lesson's answer, every summary bullet a flashcard, the lesson's traps used as distractors, and a loader
that rejects a broken question by name."""

import collections
import copy
import doctest
import importlib
import itertools
import json
import re
from pathlib import Path

import pytest

import labkit
import labkit.exercises.quiz
from labkit.exercises import Feedback, load_distractor_families, load_flashcards, load_questions
from labkit.plan import (
    GPTShape,
    ParallelLayout,
    axis_traffic,
    axis_wire_bytes,
    ring_allreduce_bytes,
    worked_example,
    zero_memory_table,
    zero_traffic_bytes,
)
from labkit.plan.traffic import ring_reduce_scatter_bytes

ROOT = Path(labkit.__file__).parent
LESSON = (ROOT / "data" / "lesson.txt").read_text(encoding="utf-8")
QUIZ = ROOT / "exercises" / "quiz.json"


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



def test_neither_the_length_nor_the_place_of_an_option_gives_the_answer_away():
    """A test-wise student picks the longest option unread (or the shortest, or always the same letter): with
    four options, each cue should point at the answer about as often as chance, 1 in 4, and never in more than
    a third of the questions. A tie counts as pointing at the answer."""
    questions = load_questions()
    lengths = [[len(o.text) for o in q.options] for q in questions]
    longest = [q.id for q, n in zip(questions, lengths, strict=True) if n[q.answer] == max(n)]
    shortest = [q.id for q, n in zip(questions, lengths, strict=True) if n[q.answer] == min(n)]
    assert len(longest) <= len(questions) / 3, longest
    assert len(shortest) <= len(questions) / 3, shortest
    positions = collections.Counter(q.answer for q in questions)
    assert sorted(positions) == [0, 1, 2, 3], positions
    assert max(positions.values()) <= len(questions) / 3 and min(positions.values()) >= len(questions) / 8, positions
    assert max(len(list(run)) for _, run in itertools.groupby(q.answer for q in questions)) <= 3


def test_the_review_refers_to_nothing_outside_the_course():
    """No frequency tiers, curriculum or other courses' lesson codes ("12-05") that a student of this course never
    saw: in the quiz data and in notebook 16, where the quiz is taken. The exam's framing (issue 26: objectives 4.1
    and 4.4, the study guide's reading list naming NCCL, AllReduce and ring-allreduce) is in 16's opening cell
    alone, and names no other objective."""
    outside = re.compile(r"\b\d{2}-\d{2}\b|\bTier \d|curriculum", re.IGNORECASE)
    framing = re.compile(r"\bobjectives?\W+\d|study\s+guide", re.IGNORECASE)
    texts = every_text() + [(card.id, side) for card in load_flashcards() for side in (card.front, card.back)]
    notebook = json.loads((ROOT.parent / "notebooks" / "16_review.ipynb").read_text(encoding="utf-8"))
    cells = [(f"notebook 16 cell {i}", "".join(cell["source"])) for i, cell in enumerate(notebook["cells"])]
    (_, opening), rest = cells[0], cells[1:]
    found = [(where, match.group()) for where, text in texts + cells for match in [outside.search(text)] if match]
    found += [(where, match.group()) for where, text in texts + rest for match in [framing.search(text)] if match]
    assert not found, found
    assert framing.search(opening) and set(re.findall(r"\b\d\.\d\b", opening)) == {"4.1", "4.4"}
    assert all(term in opening for term in ("NCCL", "AllReduce", "ring-allreduce"))
    assert outside.search("Next in the curriculum (12-05)") and framing.search("objectives 4.1 and 4.4")


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
    assert {card.id for card in cards if card.note} == {"dp-never-fixes-too-large", "tp-node-pp-bubble", "ring-scales"}
    assert all(card.front.strip() and card.front != card.back for card in cards)
    assert len({card.id for card in cards}) == len(cards)


def test_the_accumulation_answer_agrees_with_the_worked_example():
    """16 passes per optimizer step, not 16x the time: 8 s against 1 s, 8x the 8-GPU epoch (notebook 08)."""
    example = worked_example()
    text = next(q for q in load_questions() if q.id == "accumulation-without-gpus").explanation
    for claim in (
        f"{example.per_device_batch} × 1 GPU × {example.accumulation_alternative_steps} accumulation steps = "
        f"{example.accumulation_alternative_batch}",
        f"{example.devices} GPUs with {example.accumulation_steps} accumulation steps each",
        f"runs {example.accumulation_alternative_steps} passes one after another where a step without accumulation "
        "runs 1",
        f"{example.accumulation_alternative_step_seconds:g} s per optimizer step against "
        f"{example.step_compute_seconds:g} s on {example.devices} GPUs",
        f"{example.accumulation_alternative_slowdown:g}× the {example.devices}-GPU epoch",
        f"single-GPU baseline at batch {example.baseline_batch}",
        f"all {example.examples:,} examples",
    ):
        assert claim in text, claim
    assert example.accumulation_alternative_batch == example.parallel_batch
    assert example.accumulation_alternative_epoch_seconds == pytest.approx(example.baseline_epoch_seconds, rel=0.01)
    # "16× the wall-clock" only as the lesson's words, never as the quiz's own claim
    assert "16×" not in text.replace('the lesson\'s "16× the wall-clock"', "")


def test_the_quiz_numbers_agree_with_the_worked_example():
    example, questions = worked_example(), {q.id: q for q in load_questions()}
    arithmetic = questions["effective-batch-arithmetic"].explanation
    assert f"= {example.parallel_batch} examples per step: about {example.parallel_steps} steps" in arithmetic
    assert f"against {example.baseline_steps:,} at the single-GPU effective batch of {example.baseline_batch}" \
        in arithmetic
    ring = questions["ring-traffic-7b"]
    assert ring.options[ring.answer].text == f"{example.ring_bytes_per_rank / 1e9:g} GB"
    assert f"{example.gradient_bytes / 1e9:.1f}e9 bytes" in ring.explanation
    one_phase = example.gradient_bytes * (example.devices - 1) / example.devices   # the scatter-reduce alone
    assert any(o.text == f"{one_phase / 1e9:g} GB" and "one phase" in o.why for o in ring.options if not o.correct)
    memory = questions["memory-16-bytes-per-parameter"]
    assert memory.options[memory.answer].text.startswith(f"About {example.memory_bytes / 1e9:.0f} GB")
    assert f"{example.memory_bytes / 1e9:.0f}e9 bytes" in memory.explanation
    assert any(f"{example.memory_bytes / 1e9 / example.devices:.0f} GB per GPU" in o.text for o in memory.options)
    scaling = questions["learning-rate-after-scaling-out"].question
    assert f"from {example.baseline_batch} to {example.parallel_batch}" in scaling


def test_the_sharding_questions_ask_what_plan_computes():
    questions = {q.id: q for q in load_questions()}
    sharding = [q for q in questions.values() if q.topic == "sharding"]
    assert len(sharding) >= 5
    used = {o.distractor for q in sharding for o in q.options if not o.correct}
    assert {"zero-stages", "sharding-as-model-parallelism", "sharding-cost", "dp-for-too-large"} <= used
    # the ZeRO paper's figure 1: 7.5B parameters on 64 ranks; every option one stage's total, the answer stage 2's
    table = zero_memory_table(7.5e9, dp=64)
    memory = questions["zero-memory-per-device"]
    assert [o.text for o in memory.options] == [f"About {table[s]['total'] / 1e9:.1f} GB" for s in (0, 1, 3, 2)]
    assert memory.options[memory.answer].text == f"About {table[2]['total'] / 1e9:.1f} GB"
    assert "120, 31.4, 16.6 and 1.9 GB" in memory.explanation and "zero_memory_table(7.5e9, dp=64)" in \
        memory.explanation
    for option in memory.options:  # each wrong total is explained by the stage (or replication) that gives it
        assert option.correct or option.why.startswith(option.text.removeprefix("About ").removesuffix(".0 GB"))
    # ZeRO-3's traffic: 1.5x DDP's AllReduce for the lesson's 7B model on 8 GPUs
    example, traffic = worked_example(), questions["zero3-traffic"]
    ddp, zero3 = zero_traffic_bytes(7e9, 8, zero_stage=0), zero_traffic_bytes(7e9, 8, zero_stage=3)
    assert ddp == example.ring_bytes_per_rank == ring_allreduce_bytes(14e9, 8) == zero_traffic_bytes(7e9, 8, 1)
    assert f"sends {ddp / 1e9:g} GB per rank per step" in traffic.question
    assert traffic.options[traffic.answer].text.startswith(f"{zero3 / 1e9:g} GB:")
    assert f"= {zero3 / 1e9:g} GB per rank, 1.5× DDP's {ddp / 1e9:g} GB" in traffic.explanation
    half = ring_reduce_scatter_bytes(14e9, 8)
    assert any(o.text.startswith(f"{half / 1e9:g} GB:") and not o.correct for o in traffic.options)
    assert any(o.text.startswith(f"{ddp / 1e9:g} GB:") and o.distractor == "sharding-cost" for o in traffic.options)
    stages = questions["zero-stages-what-is-sharded"]
    assert stages.options[stages.answer].text.startswith("The optimizer state and the gradients")
    assert sum(o.distractor == "zero-stages" for o in stages.options) == 2


def test_the_3d_questions_quote_what_plan_computes():
    """Notebook 13's GPT-3 175B as dp=8 x pp=8 x tp=8 on 512 GPUs: the busiest rank's tensor-parallel bytes on the
    wire, and their seconds over NVLink (450 GB/s each way) and InfiniBand NDR (400 Gb/s = 50 GB/s), are what the
    question and its options say; each link-speed slip gives one wrong option."""
    questions = {q.id: q for q in load_questions()}
    assert len([q for q in questions.values() if q.topic == "3d-parallelism"]) == 4
    shape = GPTShape(vocab=50257, d_model=12288, layers=96, heads=96, context=2048)
    layout = ParallelLayout(dp=8, pp=8, tp=8, microbatches=192)
    wires = [axis_wire_bytes(axis_traffic(shape, layout, 1536, rank, bytes_per_number=2), layout)
             for rank in range(64)]                                            # replica 0; the others send the same
    tp_wire, dp_wire = (max(wire[axis] for wire in wires) for axis in ("tp", "dp"))
    question = questions["3d-tp-seconds-on-links"]
    assert f"about {round(tp_wire / 1e9, -1):.0f} GB per step" in question.question
    texts = {o.text for o in question.options}
    assert question.options[question.answer].text == \
        f"About {tp_wire / 450e9:.0f} s over NVLink, about {tp_wire / 50e9:.0f} s over InfiniBand"
    assert f"About {tp_wire / 450e9:.0f} s over NVLink, about {tp_wire / 400e9:.1f} s over InfiniBand" in texts  # Gb
    assert f"About {tp_wire / 900e9:.0f} s over NVLink, about {tp_wire / 100e9:.0f} s over InfiniBand" in texts  # both
    # the forward's half of tp's collectives shows in the step (notebook 13: the busiest rank holds blocks only, 2 of
    # each block's 4 all-reduces in the forward); Megatron-LM runs the backward's during the weight-gradient GEMMs
    overlaps = question.options[3]
    assert not overlaps.correct and overlaps.text == "Little on either: it overlaps the compute"
    forward = tp_wire / 2
    assert f"about {forward / 450e9:.0f} s over NVLink and {forward / 50e9:.0f} s over InfiniBand" in overlaps.why
    assert "at least half of it adds to the step" in question.explanation and "upper bound" in question.explanation
    placement = questions["3d-axes-on-links"]
    assert placement.options[placement.answer].text.startswith("Tensor parallelism inside each node, pipeline stages "
                                                               "across nodes, data parallelism outermost")
    assert f"about {dp_wire / 50e9:.1f} s of a 13 s step over InfiniBand" in placement.explanation


def test_no_3d_text_says_the_gradient_all_reduce_hides_behind_the_backward():
    """With m micro-batches a rank's gradients are complete only after the last micro-batch's backward, so at most
    that backward overlaps data parallelism's all-reduce: the 3D items and their distractor family say so, and none
    says the all-reduce overlaps "the backward", hides behind it, or that the gradients overlap the compute."""
    texts = [(where, text) for where, text in every_text() if where.startswith(("3d-", "family 3d-"))]
    assert len(texts) > 20
    for where, text in texts:
        assert not re.search(r"overlap(pable|s)? (with )?the backward|hides? behind|as the gradients do", text), where
    family = load_distractor_families()["3d-axis-placement"]
    placement = next(q for q in load_questions() if q.id == "3d-axes-on-links")
    for text in (family, placement.explanation):
        assert "only the last micro-batch's backward" in text or "at most that backward" in text


def every_text() -> list[tuple[str, str]]:
    """(where, text) of every question, option, reason, explanation, family and flashcard note: all but the
    flashcard backs, which are the lesson's bullets verbatim."""
    texts = [(f"family {name}", text) for name, text in load_distractor_families().items()]
    for q in load_questions():
        texts += [(q.id, q.question), (q.id, q.explanation)]
        texts += [(q.id, text) for o in q.options for text in (o.text, o.why)]
    course = [(card.id, side) for topic in COURSE_TOPICS for card in load_flashcards(topic=topic)
              for side in (card.front, card.back)]
    return texts + [(card.id, card.note) for card in load_flashcards()] + course


def test_data_parallelism_is_said_to_pool_no_memory_only_when_replicated():
    cards = {card.id: card for card in load_flashcards()}
    note = cards["dp-never-fixes-too-large"].note
    assert "replicated data parallelism" in note and "ZeRO" in note and "FSDP" in note
    for where, text in every_text():
        if re.search(r"pools no memory|never solves a model-too-large", text):
            assert "DDP" in text and ("FSDP" in text or "ZeRO" in text), where
    family = load_distractor_families()["dp-for-too-large"]
    assert family.startswith("Replicated data parallelism (DDP)")


def test_the_ring_is_said_to_scale_in_bytes_not_in_latency():
    """'About 2 x S whatever N' is the ring's bytes; its 2(N-1) messages, each paying alpha, grow with N."""
    note = {card.id: card for card in load_flashcards()}["ring-scales"].note
    assert "2(N-1)/N × S" in note and "2(N-1)·α grows with N" in note and "tree" in note and "NCCL" in note


def test_tensor_parallel_traffic_is_bandwidth_heavy_and_its_arithmetic_is_right():
    cards = {card.id: card for card in load_flashcards()}
    question = next(q for q in load_questions() if q.id == "tensor-parallel-inside-a-node")
    for text in (cards["tp-node-pp-bubble"].note, question.explanation):
        found = re.search(r"([\d,]+) tokens × ([\d,]+) × (\d) bytes \(BF16\) = (\d+) MB", text)
        assert found, text
        tokens, hidden, nbytes, megabytes = (int(g.replace(",", "")) for g in found.groups())
        assert round(tokens * hidden * nbytes / 1e6) == megabytes == 67
        assert "critical path" in text and "NVLink" in text
    for where, text in every_text():  # the lesson's phrase is quoted as the lesson's, never claimed
        assert "latency-sensitive" not in text and "latency-bound" not in text.replace('"latency-bound"', ""), where


def test_check_says_right_or_wrong_and_explains():
    question = next(q for q in load_questions() if q.phrasing == 1)
    assert question.check(question.answer) == Feedback(True, question.explanation)
    wrong = next(i for i, o in enumerate(question.options) if not o.correct)
    correct, explanation = question.check(wrong)
    assert not correct
    assert explanation.startswith(question.options[wrong].why)
    assert f"Answer: {question.options[question.answer].text}." in explanation and question.explanation in explanation
    with pytest.raises(ValueError, match=r"^choice=4: pass an option index from 0 to 3\.$"):
        question.check(4)
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError, match=rf"^choice={bad!r}: pass a whole number >= 0"):
            question.check(bad)
    for bad in ("1", None):  # no number at all: TypeError, as everywhere in labkit (labkit.checks)
        with pytest.raises(TypeError, match=rf"^choice={bad!r}: pass a whole number >= 0"):
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
    "phrasing 8": (lambda q, d: q.update(phrasing=8), "phrasing=8: pass a whole number from 1 to 7, or null."),
    "phrasing 2.0": (lambda q, d: q.update(phrasing=2.0), "phrasing=2.0: pass a whole number from 1 to 7, or null."),
    "phrasing '2'": (lambda q, d: q.update(phrasing="2"), "phrasing='2': pass a whole number from 1 to 7, or null."),
    "phrasing true": (lambda q, d: q.update(phrasing=True), "phrasing=True: pass a whole number from 1 to 7, or null."),
    "a misspelt field": (lambda q, d: q.update(explantion="x"), "unknown fields ['explantion']"),
}


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_the_loader_rejects_a_broken_question_naming_it(tmp_path, breakage):
    change, message = BREAKAGES[breakage]
    with pytest.raises(ValueError, match=re.escape(f"quiz question 'allreduce-synchronizes-gradients': {message}")):
        load_questions(broken(tmp_path, change))


CARD_BREAKAGES = {  # name: (change to the first flashcard, what the error says after "flashcard '<id>': ")
    "an empty back": (lambda card: card.update(back=" "), "id, front and back must be non-empty text"),
    "no front": (lambda card: card.pop("front"), "id, front and back must be non-empty text"),
    "an empty note": (lambda card: card.update(note=""), "a note must be non-empty text that is not the back again"),
    "the back as a note": (lambda card: card.update(note=card["back"]), "a note must be non-empty text"),
    "a misspelt field": (lambda card: card.update(note_="x"), "unknown fields ['note_']"),
}


@pytest.mark.parametrize("breakage", CARD_BREAKAGES)
def test_the_loader_rejects_a_broken_flashcard_naming_it(tmp_path, breakage):
    change, message = CARD_BREAKAGES[breakage]
    with pytest.raises(ValueError, match=re.escape(f"flashcard 'three-constraints': {message}")):
        load_flashcards(broken(tmp_path, lambda question, data: change(data["flashcards"][0])))


def test_the_loader_rejects_a_repeated_id(tmp_path):
    def repeat(question, data):
        data["questions"].append(copy.deepcopy(question) | {"phrasing": None})
    with pytest.raises(ValueError, match="quiz: question allreduce-synchronizes-gradients appears more than once"):
        load_questions(broken(tmp_path, repeat))


def test_the_quiz_lives_with_the_other_exercises_and_nowhere_else():
    assert QUIZ.is_file() and not (ROOT / "data" / "quiz.json").exists()
    assert load_questions() == load_questions(QUIZ)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("labkit.quiz")


def test_the_quiz_ships_as_package_data():
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((ROOT.parent / "pyproject.toml").read_text(encoding="utf-8"))
    assert "exercises/*.json" in pyproject["tool"]["setuptools"]["package-data"]["labkit"]


def test_docstring_example():
    result = doctest.testmod(labkit.exercises.quiz)
    assert result.attempted > 0 and result.failed == 0


# the course's own cards: their topic -> the notebook that shows them
COURSE_TOPICS = {"pipeline": "06_pipeline_parallel", "context-parallelism": "17_context_parallel",
                 "expert-parallelism": "18_expert_parallel"}


def test_the_notebooks_past_the_lesson_show_their_own_flashcards():
    """Zero bubble (06), context (17) and expert parallelism (18) each have at least three cards of the course's own,
    none of them a lesson bullet, and their notebook shows them in the flashcards widget."""
    bullets = set(summary_bullets())
    for topic, name in COURSE_TOPICS.items():
        cards = load_flashcards(topic=topic)
        assert len(cards) >= 3 and all(card.topic == topic and card.back not in bullets for card in cards), topic
        notebook = json.loads((ROOT.parent / "notebooks" / f"{name}.ipynb").read_text(encoding="utf-8"))
        code = ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code"]
        assert any(f'flashcards(load_flashcards(topic="{topic}"))' in source for source in code), name
    assert all(card.topic == "" for card in load_flashcards())  # the lesson's deck is the lesson's alone


def test_a_course_card_names_a_topic_the_quiz_has(tmp_path):
    data = json.loads((ROOT / "exercises" / "quiz.json").read_text(encoding="utf-8"))
    with pytest.raises(ValueError, match="topic='zero-bubble': the course's own flashcards cover"):
        load_flashcards(topic="zero-bubble")
    untopical = dict(data, course_flashcards=[{"id": "x", "front": "a?", "back": "b."}])
    (tmp_path / "quiz.json").write_text(json.dumps(untopical), encoding="utf-8")
    with pytest.raises(ValueError, match="flashcard 'x': a course card names its quiz topic"):
        load_flashcards(tmp_path / "quiz.json")
    twice = dict(data, course_flashcards=[dict(data["course_flashcards"][0], id=data["flashcards"][0]["id"])])
    (tmp_path / "quiz.json").write_text(json.dumps(twice), encoding="utf-8")
    with pytest.raises(ValueError, match="flashcard"):
        load_flashcards(tmp_path / "quiz.json")
