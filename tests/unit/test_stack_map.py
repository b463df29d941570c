"""The stack-map grader: NCCL communicates, TensorRT-LLM optimizes, ..."""

from labkit.exercises import STACK_MAP, check_stack_map


def test_stack_map_grader_accepts_the_lesson_s_map_and_names_what_is_wrong():
    assert check_stack_map(dict(STACK_MAP))
    assert check_stack_map({name: f" {verb.upper()} " for name, verb in STACK_MAP.items()})  # case, spaces
    swapped = {**STACK_MAP, "NCCL": "builds", "NeMo": "communicates"}
    verdict = check_stack_map(swapped)
    assert not verdict and "NCCL, NeMo" in verdict.message and "not a training framework" in verdict.message
    assert "still open: RAPIDS" in check_stack_map({k: v for k, v in STACK_MAP.items() if k != "RAPIDS"}).message
