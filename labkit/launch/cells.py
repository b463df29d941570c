"""The `%%ranks` cell executor: runs a cell's source on a rank, in that rank's own namespace.

magic.py sends `run_cell` to every rank with labkit.run. Each rank keeps one namespace for all its
cells, as a notebook's kernel does, so a variable defined in one cell is there in the next; it lives in
the rank's process, so each pool (each world size) has its own.
"""

from __future__ import annotations

import ast
import linecache

__all__ = ["PRELUDE", "run_cell"]

_namespace: dict = {"__name__": "__main__"}  # this rank's variables, across cells
# What every rank's namespace starts with, run there as a student's first cell would be (as IPython's exec_lines
# are). The student's code uses these modules; this executor only hands them over, so it imports none of them
# itself (its importing the package labkit, whose %load_ext loads magic.py, which sends this, was a cycle).
PRELUDE = "import torch\nimport torch.distributed as dist\nimport labkit\n"
_PRELUDE_CODE = compile(PRELUDE, "<%%ranks prelude>", "exec")


def run_cell(source: str, filename: str):
    """Execute a %%ranks cell in this rank's own namespace, IPython-style: the value of a final
    expression is returned (and shown by the owner). `filename` names the cell in tracebacks and
    stacks; its source goes into linecache under that name."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    _seed_namespace()
    tree = ast.parse(source, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), _namespace)
    if last is not None:
        return eval(compile(ast.Expression(last.value), filename, "eval"), _namespace)
    return None


def _seed_namespace() -> None:
    """Put back the prelude's names (torch, dist, labkit) that this rank's namespace lacks; a name the student
    bound to something else stays theirs."""
    seeded: dict = {}
    exec(_PRELUDE_CODE, seeded)
    for name in ("torch", "dist", "labkit"):
        _namespace.setdefault(name, seeded[name])
