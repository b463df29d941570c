"""The course's reference solutions: Markdown cells tagged `solution`, each a folded ```python block.

A student's Run All never executes Markdown, so the reference solutions neither run nor print their verdict
under the student's own "Not yet". CI runs them: `with_solutions_as_code` gives a copy of a notebook in which
every solution cell is a code cell holding its block's code (still tagged `solution`), ready for papermill.
"""

from __future__ import annotations

import copy
import re

TAG = "solution"
SUMMARY = "<details><summary>Reference solution (open only after trying)</summary>"
FENCE = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def source(cell: dict) -> str:
    """A cell's source as one string (nbformat keeps it as a list of lines or as one string)."""
    return cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])


def is_solution(cell: dict) -> bool:
    """Whether a cell is tagged as one of the course's reference solutions."""
    return TAG in cell.get("metadata", {}).get("tags", [])


def solution_code(cell: dict) -> str:
    """The code of a solution cell: its one ```python block. ValueError when it has none or several, so that a
    solution cell CI could not run is reported, not skipped."""
    blocks = FENCE.findall(source(cell))
    if len(blocks) != 1:
        raise ValueError(f"a solution cell holds {len(blocks)} ```python blocks, not one: {source(cell)[:80]!r}")
    return blocks[0].rstrip("\n")


def with_solutions_as_code(notebook: dict) -> dict:
    """A copy of `notebook` (nbformat's JSON as a dict) in which every solution cell is a code cell with its
    block's code, tagged `solution`; every other cell as it was."""
    converted = copy.deepcopy(notebook)
    for i, cell in enumerate(converted["cells"]):
        if is_solution(cell):
            converted["cells"][i] = {"cell_type": "code", "execution_count": None, "id": cell.get("id", str(i)),
                                     "metadata": {"tags": [TAG]}, "outputs": [], "source": solution_code(cell)}
    return converted


def as_markdown(code: str) -> str:
    """A solution cell's Markdown: `code` in a ```python block, folded under the summary a student sees."""
    return f"{SUMMARY}\n\n```python\n{code.rstrip()}\n```\n</details>"
