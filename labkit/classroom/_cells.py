"""Which cells of a student's notebook the gradebook runs for an exercise: the setup, then the "your turn" cell.

A notebook's exercise is the code cell that calls its grader (`check_ring_allreduce(my_ring_allreduce)`); what that
cell needs is the notebook's setup: the `parameters` cell (world_size, as papermill sets it) and the import cell
after it, which imports the grader and the names the exercises use (dist, F, labkit, the data). Those cells and the
exercise's run in a fresh process, in order, as nbgrader's autograde would run the notebook, but without the
notebook's demonstrations between them (minutes of ranks that grade nothing). The course's solutions of all 11
graded exercises, put in the stubs (their imports kept), passed so on 2 cores (6 to 10 s each, 2 s for the two
without ranks); tests/distributed/test_gradebook.py grades three of them. A student who moved their function to a
cell of its own gets a NameError said in the verdict: the cell that calls the grader is the one that is graded,
with what it defines.
"""

from __future__ import annotations

import re

__all__: list[str] = []


def cell_source(cell: dict) -> str:
    """A cell's source as one string (nbformat keeps it as a list of lines or as one string)."""
    source = cell.get("source", "")
    return source if isinstance(source, str) else "".join(source)


def _code_cells(notebook: dict) -> list[tuple[int, str]]:
    """(index, source) of every code cell of `notebook` (nbformat's JSON as a dict)."""
    cells = notebook.get("cells") if isinstance(notebook, dict) else None
    if not isinstance(cells, list):
        raise ValueError("not a Jupyter notebook: it has no list of cells")
    return [(i, cell_source(c)) for i, c in enumerate(cells) if isinstance(c, dict) and c.get("cell_type") == "code"]


def setup_cells(notebook: dict) -> list[tuple[int, str]]:
    """The notebook's `parameters` cell and the first code cell after it that imports labkit (the import cell)."""
    cells = notebook["cells"]
    code = _code_cells(notebook)
    tagged = [i for i, _ in code if "parameters" in (cells[i].get("metadata") or {}).get("tags", [])]
    start = tagged[0] if tagged else -1
    chosen = [(i, s) for i, s in code if i == start]
    imports = [(i, s) for i, s in code if i > start and re.search(r"^\s*(import|from)\s+labkit\b", s, re.MULTILINE)]
    return chosen + imports[:1]


def graded_cells(notebook: dict, grader: str) -> list[tuple[int, str]]:
    """The code cells that call `grader` (the function's name), in the notebook's order: the exercise's cells. An
    import of it (`from labkit.exercises import check_x`) is no call: no parenthesis follows the name."""
    call = re.compile(rf"\b{re.escape(grader)}\s*\(")
    return [(i, s) for i, s in _code_cells(notebook) if call.search(s)]
