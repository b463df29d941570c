"""Instructors run the course wider with papermill: every notebook takes a `world_size` parameter.

The same run checks the course's reference solutions: they are folded Markdown in the notebook (a student's Run
All never executes them, tests/notebooks/solutions.py), turned into code cells here, so each runs once, in its
place, after the student's untouched stub, and its grader must say it is correct.
"""

import glob
import json
import os

import nbformat
import papermill
import pytest
from solutions import is_solution, with_solutions_as_code

NOTEBOOKS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "notebooks", "*.ipynb")))


def printed(cell) -> str:
    """What a code cell showed: its streams' text and its results' plain text."""
    return "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in cell.outputs)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs_at_another_world_size(path, tmp_path):
    with open(path) as f:
        notebook = json.load(f)
    parameters = [c for c in notebook["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(parameters) == 1 and "world_size =" in "".join(parameters[0]["source"])

    source = tmp_path / f"with_solutions_{os.path.basename(path)}"
    source.write_text(json.dumps(with_solutions_as_code(notebook), indent=1, ensure_ascii=False) + "\n")
    out = tmp_path / os.path.basename(path)
    papermill.execute_notebook(str(source), str(out), parameters={"world_size": 2}, cwd=os.path.dirname(path),
                               progress_bar=False, execution_timeout=240)
    executed = nbformat.read(out, as_version=4).cells
    injected = [c for c in executed if "injected-parameters" in c.metadata.get("tags", [])]
    assert "world_size = 2" in injected[0].source
    text = "".join(printed(c) for c in executed if c.cell_type == "code")
    assert "[rank 1]" in text or "2 ranks" in text
    assert "[rank 2]" not in text and "labkit: 4 ranks" not in text

    solutions = [c for c in executed if is_solution(c)]
    assert len(solutions) == sum(is_solution(c) for c in notebook["cells"])
    for cell in solutions:
        assert cell.cell_type == "code" and printed(cell).startswith("Correct! "), printed(cell) or cell.source
