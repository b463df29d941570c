"""The stack map of notebook 10: each NVIDIA component's purpose in one clause, and its grader.

    >>> check_stack_map({"NCCL": "communicates"})
    Not yet. match every component; still open: TensorRT-LLM, Triton, NIM, NeMo, RAPIDS.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping

from labkit.exercises.progress import graded
from labkit.exercises.verdict import Verdict

__all__ = ["STACK_MAP", "check_stack_map"]

# The lesson's stack map: each NVIDIA component's purpose in one clause.
STACK_MAP = {"NCCL": "communicates", "TensorRT-LLM": "optimizes", "Triton": "serves", "NIM": "packages",
             "NeMo": "builds", "RAPIDS": "processes data"}


@graded("stack_map")
def check_stack_map(answers: Mapping[str, str]) -> Verdict:
    """Grade a matching of NVIDIA components to what they do, e.g. {"NCCL": "...", "NeMo": "...", ...}.

    Case, spaces, hyphens, underscores and dots in names ("tensorrt llm", "TensorRT_LLM") and case and spaces in
    answers do not count; anything else must be exact: every component once, each answer one of the choices, all
    of them right."""
    choices = sorted(STACK_MAP.values())
    if not isinstance(answers, Mapping):
        return Verdict(False, f"pass a dict that maps each component to what it does, like "
                              f"{{'NCCL': '...', 'NeMo': '...'}}; got {type(answers).__name__}.")
    components = {_name_key(name): name for name in STACK_MAP}
    given: dict[str, str] = {}
    for name, answer in answers.items():
        component = components.get(_name_key(name)) if isinstance(name, str) else None
        if component is None:
            return Verdict(False, f"{name!r} is not one of the components: {', '.join(STACK_MAP)}.")
        if component in given:
            return Verdict(False, f"{component} is answered twice; give each component one answer.")
        if answer is not None and not isinstance(answer, str):
            return Verdict(False, f"give {component}'s answer as text, one of: {', '.join(choices)}; "
                                  f"got {type(answer).__name__}.")
        given[component] = _normalized(answer or "")
    missing = [name for name in STACK_MAP if not given.get(name)]
    if missing:
        return Verdict(False, f"match every component; still open: {', '.join(missing)}.")
    unknown = [name for name in STACK_MAP if given[name] not in choices]
    if unknown:
        named = ", ".join(f"{given[name]!r} for {name}" for name in unknown)
        return Verdict(False, f"{named}: not one of the choices, which are {', '.join(choices)}.")
    wrong = [name for name, verb in STACK_MAP.items() if given[name] != verb]
    if not wrong:
        return Verdict(True, "NCCL communicates, TensorRT-LLM optimizes, Triton serves, NIM packages, NeMo builds, "
                             "RAPIDS processes data.")
    return Verdict(False, f"{len(STACK_MAP) - len(wrong)} of {len(STACK_MAP)} right; look again at "
                          f"{', '.join(wrong)}.{_shuffled(given, wrong, choices)}{_nccl_hint(given, wrong)}")


def _shuffled(given: dict[str, str], wrong: list[str], choices: list[str]) -> str:
    """When every answer is used once, the wrong ones hold each other's answers: say which, and how many are
    right, so that 4 of 6 right does not read as all six wrong."""
    if sorted(given.values()) != choices:
        return ""
    right = len(STACK_MAP) - len(wrong)
    if not right:
        return " Each answer is used once, but none is with its component."
    return (f" Each answer is used once: the {right} right ones stay as they are, and {', '.join(wrong)} "
            "hold each other's answers.")


def _nccl_hint(given: dict[str, str], wrong: list[str]) -> str:
    """For a wrong NCCL, say that the choice given is another component's, and where NCCL was met, without
    naming what it does (that is the answer)."""
    if "NCCL" not in wrong:
        return ""
    return (f" '{given['NCCL']}' is another component's job, not NCCL's: what does the backend of every GPU job "
            "in this course do while the job trains?")


def _normalized(text: str) -> str:
    """'  Processes   DATA ' -> 'processes data': case and spacing do not count."""
    return " ".join(unicodedata.normalize("NFKC", text).split()).casefold()


# What may separate the words of a component's name: how people spell it in code, docs and package names.
_NAME_SEPARATORS = str.maketrans("-_.", "   ")


def _name_key(name: str) -> str:
    """'tensorrt llm', 'TensorRT-LLM', 'TensorRT_LLM' and ' tensorrt.llm' all name the same component; the letters
    themselves must match, so 'TensorRT' or 'NeMo Guardrails' names none."""
    return "".join(_normalized(name).translate(_NAME_SEPARATORS).split())
