"""The course's reference solutions are folded Markdown, one per exercise, and no code cell grades one.

A student's Run All must not run them (their "Correct!" would sit under the student's own "Not yet" and sum up
the answer); test_papermill.py runs and grades them. This test reads the notebooks only: it is fast.
"""

import glob
import json
import os
import re

import pytest
from solutions import SUMMARY, is_solution, solution_code, source, with_solutions_as_code

import labkit.exercises

NOTEBOOKS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "notebooks", "*.ipynb")))
GRADERS = sorted(name for name in labkit.exercises.__all__ if name.startswith("check_"))
GRADER_CALL = re.compile(r"\b(" + "|".join(GRADERS) + r")\(([^\n]*)")


def cells(path) -> list[dict]:
    with open(path) as f:
        return json.load(f)["cells"]


def grader_calls(cell) -> list[tuple[str, str]]:
    """The (grader, arguments' line) of every call to a labkit.exercises grader in a cell."""
    return GRADER_CALL.findall(source(cell))


def test_the_graders_are_found():
    assert "check_average_gradients" in GRADERS and "check_sharded_step" in GRADERS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_every_exercise_has_one_folded_solution_that_no_code_cell_runs(path):
    notebook = cells(path)
    code = [c for c in notebook if c["cell_type"] == "code"]
    for cell in code:
        for grader, arguments in grader_calls(cell):
            assert "solution" not in arguments.lower() and "record=False" not in arguments, \
                f"a code cell runs the course's solution: {grader}({arguments}"
    exercises = [grader for cell in code for grader, _ in grader_calls(cell)]
    solutions = [c for c in notebook if is_solution(c)]
    assert sorted(exercises) == sorted(grader for c in solutions for grader, _ in grader_calls(c)), \
        "one solution cell per exercise, graded by the exercise's grader"
    for cell in solutions:
        assert cell["cell_type"] == "markdown" and source(cell).startswith(SUMMARY + "\n\n")
        assert source(cell).rstrip().endswith("</details>")
        assert len(grader_calls(cell)) == 1, "a solution cell grades its one exercise"
        code_text = solution_code(cell)
        compile(code_text, path, "exec")
        assert re.search(r"record=False\)", code_text), "the course's solution is not the student's progress"
        assert "assert verdict" in code_text


def test_solution_cells_become_code_cells_and_nothing_else_changes():
    notebook = {"cells": [{"cell_type": "markdown", "id": "a", "metadata": {}, "source": "text"},
                          {"cell_type": "markdown", "id": "b", "metadata": {"tags": ["solution"]},
                           "source": f"{SUMMARY}\n\n```python\nx = 1\nprint(x)\n```\n</details>"}]}
    converted = with_solutions_as_code(notebook)
    assert converted["cells"][0] == notebook["cells"][0]
    assert converted["cells"][1]["cell_type"] == "code" and converted["cells"][1]["source"] == "x = 1\nprint(x)"
    assert is_solution(converted["cells"][1]) and notebook["cells"][1]["cell_type"] == "markdown"


def test_a_solution_cell_without_one_python_block_is_refused():
    with pytest.raises(ValueError, match="2 ```python blocks"):
        solution_code({"source": "```python\na\n```\n```python\nb\n```\n"})


def exercises(notebook: list[dict]) -> list[int]:
    """The indices of the exercises' stub cells: code cells that call a grader."""
    return [i for i, c in enumerate(notebook) if c["cell_type"] == "code" and grader_calls(c)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_every_exercise_states_its_task_briefly_and_folds_three_hints_before_its_solution(path):
    notebook = cells(path)
    for stub in exercises(notebook):
        spec = next(source(c) for c in reversed(notebook[:stub]) if "Your turn" in source(c))
        task = re.sub(r"<details>.*?</details>", "", spec[spec.index("Your turn"):], flags=re.DOTALL)
        shown = [line for line in task.splitlines()[1:] if line.strip()]
        assert len(shown) <= 10, f"the task above cell {stub} is {len(shown)} lines: fold what the grader checks"
        solution = next(i for i in range(stub, len(notebook)) if is_solution(notebook[i]))
        between = "".join(source(c) for c in notebook[stub + 1:solution])
        summaries = re.findall(r"<details><summary>(Hint \d)</summary>", between)
        assert summaries == ["Hint 1", "Hint 2", "Hint 3"], f"the hints after cell {stub}: {summaries}"
