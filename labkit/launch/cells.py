"""The `%%ranks` cell executor: runs a cell's source on a rank, in that rank's own namespace.

magic.py sends `run_cell` to every rank with labkit.run. Each rank keeps one namespace for all its
cells, as a notebook's kernel does, so a variable defined in one cell is there in the next; it lives in
the rank's process, so each pool (each world size) has its own.
"""

from __future__ import annotations

import ast
import linecache

__all__ = ["run_cell"]

_namespace: dict = {"__name__": "__main__"}  # this rank's variables, across cells


def run_cell(source: str, filename: str):
    """Execute a %%ranks cell in this rank's own namespace, IPython-style: the value of a final
    expression is returned (and shown by the owner). `filename` names the cell in tracebacks and
    stacks; its source goes into linecache under that name."""
    import torch
    import torch.distributed as dist

    import labkit

    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    _namespace.setdefault("torch", torch)
    _namespace.setdefault("dist", dist)
    _namespace.setdefault("labkit", labkit)
    tree = ast.parse(source, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), _namespace)
    if last is not None:
        return eval(compile(ast.Expression(last.value), filename, "eval"), _namespace)
    return None
