"""The stack-map grader: strict about what it accepts, forgiving about case and spacing, and it never gives the
answer away in a failing verdict."""

import pytest

from labkit.exercises import STACK_MAP, check_stack_map


def assert_rejected(answers, phrase):
    verdict = check_stack_map(answers)
    assert not verdict and phrase in verdict.message, verdict
    leaked = [f"{name} {verb}" for name, verb in STACK_MAP.items() if f"{name} {verb}" in verdict.message]
    assert not leaked, f"a failing verdict gives away {leaked}: {verdict.message}"


def test_the_lesson_s_map_passes_with_any_case_and_spacing():
    assert check_stack_map(dict(STACK_MAP))
    assert check_stack_map({name: f" {verb.upper()} " for name, verb in STACK_MAP.items()})
    assert check_stack_map({**STACK_MAP, "RAPIDS": "Processes   Data"})
    renamed = {" nccl": "communicates", "tensorrt llm": "optimizes", "TRITON ": "serves", "nim": "packages",
               "Nemo": "builds", "rapids": "processes data"}
    assert check_stack_map(renamed)


@pytest.mark.parametrize("spelling", ["TensorRT_LLM", "tensorrt.llm", "TENSORRT-llm", "Tensor RT LLM", "TensorRTLLM",
                                      "tensorrt_llm "])
def test_a_component_spelled_as_in_code_or_package_names_passes(spelling):
    """Issue 27 (right refused): underscores and dots separate words as hyphens and spaces do."""
    others = {name: verb for name, verb in STACK_MAP.items() if name not in ("TensorRT-LLM", "NeMo")}
    assert check_stack_map({**others, spelling: "optimizes", "ne.mo": "builds"})


@pytest.mark.parametrize(("spelling", "phrase"), [
    ("TensorRT", "'TensorRT' is not one of the components"),  # a word short: another product
    ("TensorRT_LLM_X", "'TensorRT_LLM_X' is not one of the components"),
    ("Triton_Inference_Server", "'Triton_Inference_Server' is not one of the components"),
    ("N_I_M_S", "'N_I_M_S' is not one of the components"),
    ("rapids.ai", "'rapids.ai' is not one of the components"),
])
def test_separators_do_not_make_a_wrong_name_right(spelling, phrase):
    """Issue 27: forgiving separators must not forgive letters."""
    assert_rejected({**STACK_MAP, spelling: "optimizes"}, phrase)


def test_two_spellings_of_one_component_are_answered_twice():
    assert_rejected({**STACK_MAP, "tensorrt_llm": "optimizes"}, "TensorRT-LLM is answered twice")


def test_wrong_answers_are_named_without_the_right_ones():
    verdict = check_stack_map({**STACK_MAP, "NCCL": "builds", "NeMo": "communicates"})
    assert not verdict and "4 of 6 right" in verdict.message and "NCCL, NeMo" in verdict.message
    assert "'builds' is another component's job" in verdict.message  # the NCCL hint names the choice given
    assert "communicat" not in verdict.message.lower()  # ... and not NCCL's own answer (issue 26)
    assert_rejected({**STACK_MAP, "NCCL": "builds", "NeMo": "communicates"}, "look again at NCCL, NeMo")


def test_a_shuffled_map_is_rejected_and_called_shuffled():
    names, verbs = list(STACK_MAP), list(STACK_MAP.values())
    shuffled = dict(zip(names, verbs[1:] + verbs[:1], strict=True))  # every answer used once, each one off
    assert_rejected(shuffled, "0 of 6 right")
    assert_rejected(shuffled, "Each answer is used once, but none is with its component.")


def test_two_swapped_answers_say_how_many_are_right_and_which_are_not():
    swapped = {**STACK_MAP, "NCCL": "packages", "NIM": "communicates"}  # a reviewer's probe
    assert_rejected(swapped, "4 of 6 right; look again at NCCL, NIM.")
    assert_rejected(swapped, "the 4 right ones stay as they are, and NCCL, NIM hold each other's answers")
    assert_rejected(swapped, "'packages' is another component's job")
    assert "scheduler" not in check_stack_map(swapped).message  # the hint names only the choices


@pytest.mark.parametrize(("answers", "phrase"), [
    ({k: v for k, v in STACK_MAP.items() if k != "RAPIDS"}, "still open: RAPIDS"),
    ({}, "still open: NCCL, TensorRT-LLM, Triton, NIM, NeMo, RAPIDS"),
    ({**STACK_MAP, "Triton": "  "}, "still open: Triton"),
    ({**STACK_MAP, "Triton": None}, "still open: Triton"),
    (list(STACK_MAP.items()), "pass a dict that maps each component to what it does"),
    ("NCCL communicates", "pass a dict"),
    (None, "got NoneType"),
    ({**STACK_MAP, "CUDA": "computes"}, "'CUDA' is not one of the components"),
    ({**STACK_MAP, 7: "serves"}, "7 is not one of the components"),
    ({**STACK_MAP, "nccl": "communicates"}, "NCCL is answered twice"),
    ({**STACK_MAP, "NIM": 3}, "give NIM's answer as text"),
    ({**STACK_MAP, "NeMo": "trains"}, "'trains' for NeMo: not one of the choices"),
])
def test_partial_malformed_or_unknown_answers_are_rejected_with_what_is_wrong(answers, phrase):
    assert_rejected(answers, phrase)
