"""labkit.parallel communicates through one module: read with ast, no file of labkit/parallel/ but _collectives.py
names a torch.distributed collective (calls it, takes it as a value, imports it or looks it up with getattr),
except the one the 3D step leaves uncounted on purpose. So every collective the parallelisms make is counted, in
_collectives.py, and counted-equals-planned checks cannot miss one. (The pipeline's sends go through labkit.comm's
transport, not torch.distributed: stage_run.py counts each where it posts it.)

A barrier carries no data and neither counter counts one (counters.py, torch_counters.py): barriers are not
collectives here. A ProcessGroup's own methods (group.allreduce([t])) cannot be told apart by reading; labkit
does not use them.
"""

from __future__ import annotations

import ast
from pathlib import Path

PARALLEL = Path(__file__).resolve().parents[2] / "labkit" / "parallel"
THE_MODULE = PARALLEL / "_collectives.py"
COLLECTIVES = {  # torch.distributed's functions that move data between ranks
    "all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list", "send_object_list",
    "recv_object_list",
}
# (file, function, collective): ThreeDGPT's loss report, an all_reduce of one number outside the step's traffic
UNCOUNTED_ON_PURPOSE = {("three_d.py", "ThreeDGPT._batch_loss", "all_reduce"),
                        ("context_gpt.py", "ContextParallelGPT.train_step", "all_reduce"),  # the loss, printed
                        ("experts_gpt.py", "ExpertParallelGPT.train_step", "all_reduce")}  # the loss, printed


def _dotted(node: ast.AST) -> str:
    """'torch.distributed' for an attribute chain of names, else ''."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return ""


def _distributed_names(tree: ast.Module) -> set[str]:
    """The dotted names under which `tree` reaches torch.distributed or a module of it: `dist` after `import
    torch.distributed as dist`, `torch.distributed` after `import torch`, `c10d` after `from torch.distributed
    import distributed_c10d as c10d` (any name imported from it, which can only match a collective's module)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch":
                    names.add(f"{alias.asname or 'torch'}.distributed")
                elif alias.name.startswith("torch.distributed"):
                    names.add(alias.asname or "torch.distributed")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            names |= {alias.asname or alias.name for alias in node.names if alias.name == "distributed"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            names |= {alias.asname or alias.name for alias in node.names if alias.name not in COLLECTIVES}
    return names


def _is_distributed(node: ast.AST, names: set[str]) -> bool:
    """Whether `node` is torch.distributed, or a module under it (dist.distributed_c10d)."""
    dotted = _dotted(node)
    return any(dotted == name or dotted.startswith(name + ".") for name in names)


class _Finder(ast.NodeVisitor):
    """Every place a torch.distributed collective is named, as (function's qualified name, collective, line)."""

    def __init__(self, names: set[str]):
        self.names, self.scope, self.found = names, [], []

    def _add(self, collective: str, node: ast.AST) -> None:
        self.found.append((".".join(self.scope) or "<module>", collective, node.lineno))

    def _scoped(self, node) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in COLLECTIVES and _is_distributed(node.value, self.names):
            self._add(node.attr, node)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:  # getattr(dist, "all_gather_single", None)
        if isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) >= 2 and \
                _is_distributed(node.args[0], self.names) and isinstance(node.args[1], ast.Constant) and \
                node.args[1].value in COLLECTIVES:
            self._add(node.args[1].value, node)
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:  # from torch.distributed import all_reduce
        if (node.module or "").startswith("torch.distributed"):
            for alias in node.names:
                if alias.name in COLLECTIVES:
                    self._add(alias.name, node)


def collectives_named(source: str) -> list[tuple[str, str, int]]:
    """(function, collective, line) for each torch.distributed collective `source` names."""
    tree = ast.parse(source)
    finder = _Finder(_distributed_names(tree))
    finder.visit(tree)
    return finder.found


def raw_collectives() -> set[tuple[str, str, str]]:
    """(file under labkit/parallel, function, collective) for each one named outside _collectives.py."""
    return {(path.relative_to(PARALLEL).as_posix(), function, collective)
            for path in sorted(PARALLEL.rglob("*.py")) if path != THE_MODULE
            for function, collective, _ in collectives_named(path.read_text())}


def test_parallel_names_no_collective_outside_its_module_but_the_uncounted_one():
    assert raw_collectives() == UNCOUNTED_ON_PURPOSE, \
        "labkit/parallel/ communicates through _collectives.py (counted there); found instead: " \
        f"{sorted(raw_collectives() - UNCOUNTED_ON_PURPOSE)}; gone: {sorted(UNCOUNTED_ON_PURPOSE - raw_collectives())}"


def test_the_module_makes_the_collectives():
    named = {collective for _, collective, _ in collectives_named(THE_MODULE.read_text())}
    assert {"all_reduce", "broadcast", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
            "reduce_scatter_tensor"} <= named


def test_the_finder_sees_every_way_of_naming_a_collective():
    source = '''
import torch
import torch.distributed as dist
from torch import distributed as d2
from torch.distributed import all_to_all
from torch.distributed import distributed_c10d as c10d

def a(t):
    dist.all_reduce(t)
    torch.distributed.broadcast(t, 0)
    d2.reduce_scatter_tensor(t, t)

class B:
    def c(self, t):
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        dist.distributed_c10d.send(t, 1)
        c10d.recv(t, 0)
        dist.barrier()
        dist.get_backend()
        self.broadcast(t)
'''
    assert collectives_named(source) == [
        ("<module>", "all_to_all", 5), ("a", "all_reduce", 9), ("a", "broadcast", 10),
        ("a", "reduce_scatter_tensor", 11), ("B.c", "all_gather_single", 15), ("B.c", "all_gather_into_tensor", 15),
        ("B.c", "send", 16), ("B.c", "recv", 17)]
