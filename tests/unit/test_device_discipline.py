"""Every tensor that reaches a collective is created on labkit.device(): checked by reading the code (ast).

Under NCCL a CPU tensor handed to a collective does not fail: labkit's group is "cpu:gloo,cuda:nccl", so it
quietly goes over gloo instead, and a course that means to show NCCL shows gloo. The rule, checked inside
every function of labkit and every function and %%ranks cell of the notebooks:

    a tensor made by a factory (torch.tensor, zeros, ones, empty, full, arange, rand, randn, randint, linspace,
    eye) without `device=` must not reach, in the same function, a torch.distributed collective or
    point-to-point call, a labkit.comm kernel, one of labkit.parallel's counted collectives (_collectives.py,
    through which the package's parallelisms communicate), or a transport's send/recv.

What "reaches" means here, and nothing more: the factory's result is passed directly, or through names
assigned in order, and through method calls, indexing, arithmetic, lists and comprehensions and torch
functions taking it (torch.cat, torch.stack ...). `.to(device)` (any `.to` whose argument is not a dtype) and
`.cuda()` place a tensor; `*_like` factories, `.item()`, `.tolist()`, `.numel()` and the like end the trail.
`device="cpu"` is explicit and therefore allowed: a tensor meant for a gloo group. Flows through other
functions' return values are not followed.

Every file of the package and every notebook is checked; a violation fails the test with its place.
"""

from __future__ import annotations

import ast
import json
import pathlib
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[2]

FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint", "linspace", "eye"}
COLLECTIVES = {
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv", "isend",
    "irecv", "P2POp", "all_reduce_coalesced", "all_gather_coalesced",
}
COMM_KERNELS = {"ring_allreduce", "naive_allreduce", "ring_reduce_scatter", "ring_allgather", "broadcast", "reduce"}
COUNTED = {"all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_gather_by_broadcasts",
           "reduce_scatter_by_all_reduce", "all_gather_single", "reduce_scatter_single"}  # labkit.parallel._collectives
TRANSPORT_METHODS = {"isend", "irecv", "exchange", "send", "recv", "_post_send", "_post_recv"}
TENSOR_KEYWORDS = {"tensor", "tensor_list", "output", "input", "output_tensor_list", "input_tensor_list",
                   "scatter_list", "gather_list", "chunk", "output_tensor", "input_tensor"}
ENDS_TRAIL = {"item", "tolist", "numel", "size", "dim", "element_size", "nelement", "data_ptr", "is_contiguous",
              "stride", "equal", "allclose", "any", "all"}  # the result is no tensor headed for a collective
DTYPE_NAMES = {"float16", "half", "bfloat16", "float32", "float", "float64", "double", "int8", "uint8", "int16",
               "short", "int32", "int", "int64", "long", "bool", "complex64", "complex128"}


@dataclass(frozen=True)
class Violation:
    where: str  # "labkit/x.py:12" or "notebooks/n.ipynb:cell 8:line 2"
    factory: str  # the call that made the tensor
    sink: str  # what it reached, and where

    def __str__(self) -> str:
        return f"{self.where}: {self.factory} reaches {self.sink} without device="


def _dotted(node: ast.AST) -> str:
    """'torch.distributed.all_reduce' for an attribute chain of names, else ''."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _is_dtype(node: ast.AST) -> bool:
    name = _dotted(node)
    return name.split(".")[-1] in DTYPE_NAMES or name.endswith("dtype")


class _Scope:
    """One function body (or %%ranks cell), read statement by statement, in order."""

    def __init__(self, comm_names: set[str], line_of):
        self.tainted: dict[str, str] = {}  # name -> the factory call whose unplaced tensor it holds
        self.comm_names = comm_names  # labkit.comm kernels imported by bare name
        self.line_of = line_of
        self.found: list[Violation] = []

    def origin(self, node: ast.AST) -> str | None:
        """The unplaced factory call `node`'s value comes from, or None."""
        if isinstance(node, ast.Name):
            return self.tainted.get(node.id)
        if isinstance(node, ast.Call):
            name, func = _dotted(node.func), node.func
            if name.startswith("torch.") and name.split(".")[-1] in FACTORIES and name.count(".") == 1:
                if any(k.arg == "device" for k in node.keywords):
                    return None
                return f"{ast.unparse(node)[:60]} (line {self.line_of(node)})"
            if isinstance(func, ast.Attribute):
                if func.attr == "cuda" or (func.attr == "to" and any(
                        (k.arg == "device") or (k.arg is None) for k in node.keywords)):
                    return None
                if func.attr == "to" and node.args and not _is_dtype(node.args[0]):
                    return None
                if func.attr in ENDS_TRAIL or func.attr.endswith("_like"):
                    return None
                if not name.startswith("torch."):
                    return self.origin(func.value)  # a method of the tensor: same device
            return next((o for o in map(self.origin, [*node.args, *(k.value for k in node.keywords)]) if o), None) \
                if name.startswith("torch.") else None
        if isinstance(node, (ast.Subscript, ast.Starred)):
            return self.origin(node.value)
        if isinstance(node, ast.BinOp):
            return self.origin(node.left) or self.origin(node.right)
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            return next((o for o in map(self.origin, node.elts) if o), None)
        if isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
            return self.origin(node.elt)
        if isinstance(node, ast.IfExp):
            return self.origin(node.body) or self.origin(node.orelse)
        return None

    def assign(self, target: ast.AST, value: ast.AST | None, origin: str | None) -> None:
        if isinstance(target, ast.Name):
            if origin:
                self.tainted[target.id] = origin
            else:
                self.tainted.pop(target.id, None)
        elif isinstance(target, (ast.Tuple, ast.List)):
            values = value.elts if isinstance(value, (ast.Tuple, ast.List)) and \
                len(value.elts) == len(target.elts) else [None] * len(target.elts)
            for t, v in zip(target.elts, values, strict=True):
                self.assign(t, v, self.origin(v) if v is not None else origin)

    def sink(self, call: ast.Call) -> str | None:
        """What collective `call` is, if it is one."""
        name = _dotted(call.func)
        last = name.split(".")[-1] if name else getattr(call.func, "attr", "")
        if name.startswith(("dist.", "torch.distributed.")) and last in COLLECTIVES:
            return name
        if (name.startswith(("comm.", "labkit.comm.")) and last in COMM_KERNELS) or name in self.comm_names:
            return name
        if isinstance(call.func, ast.Attribute) and last in TRANSPORT_METHODS and not name.startswith("dist."):
            return ast.unparse(call.func)
        return None

    def check_calls(self, node: ast.AST) -> None:
        for call in [n for n in ast.walk(node) if isinstance(n, ast.Call)]:
            sink = self.sink(call)
            if sink is None:
                continue
            arguments = [*call.args, *(k.value for k in call.keywords if k.arg in TENSOR_KEYWORDS)]
            for argument in arguments:
                origin = self.origin(argument)
                if origin:
                    self.found.append(Violation("", origin, f"{sink} (line {self.line_of(call)})"))

    def run(self, body: list[ast.stmt]) -> None:
        for statement in body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue  # its own scope
            if isinstance(statement, ast.Assign):
                self.check_calls(statement.value)
                for target in statement.targets:
                    self.assign(target, statement.value, self.origin(statement.value))
            elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
                self.check_calls(statement.value)
                self.assign(statement.target, statement.value, self.origin(statement.value))
            elif isinstance(statement, ast.For):
                self.check_calls(statement.iter)
                self.assign(statement.target, None, self.origin(statement.iter))
                self.run(statement.body + statement.orelse)
            elif isinstance(statement, (ast.If, ast.While)):
                self.check_calls(statement.test)
                self.run(statement.body + statement.orelse)
            elif isinstance(statement, (ast.With, ast.AsyncWith)):
                for item in statement.items:
                    self.check_calls(item.context_expr)
                self.run(statement.body)
            elif isinstance(statement, ast.Try):
                self.run(statement.body + [s for h in statement.handlers for s in h.body] + statement.orelse
                         + statement.finalbody)
            else:
                self.check_calls(statement)


def _comm_names(tree: ast.AST) -> set[str]:
    """Kernels imported by bare name: `from labkit.comm import ring_allreduce`, and labkit.parallel's counted
    collectives: `from labkit.parallel._collectives import broadcast`."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = COMM_KERNELS if module.startswith("labkit.comm") else \
                COUNTED if module == "labkit.parallel._collectives" else set()
            found |= {alias.asname or alias.name for alias in node.names if alias.name in names}
    return found


def check_source(source: str, where, whole_body: bool = False, comm_names: set[str] | None = None) -> list[Violation]:
    """Violations in every function of `source` (and in its top level if `whole_body`, as for a %%ranks cell).
    `where(line)` names a line for the report."""
    tree = ast.parse(source)
    names = _comm_names(tree) | (comm_names or set())
    bodies = [node.body for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if whole_body:
        bodies.append(tree.body)
    found = []
    for body in bodies:
        scope = _Scope(names, lambda node: node.lineno)
        scope.run(body)
        found += [Violation(where(int(v.factory.rsplit("line ", 1)[1].rstrip(")"))), v.factory, v.sink)
                  for v in scope.found]
    return found


def check_package() -> list[Violation]:
    found = []
    for path in sorted((ROOT / "labkit").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        found += check_source(path.read_text(), lambda line, r=relative: f"{r}:{line}")
    return found


def cell_source(cell_text: str) -> tuple[str, bool]:
    """A code cell as Python: IPython magics and shell lines blanked (keeping line numbers); whether it is
    a %%ranks cell, whose whole body runs on the ranks."""
    lines = cell_text.splitlines()
    ranks = bool(lines) and lines[0].startswith("%%ranks")
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in lines), ranks


def check_notebook(cells: list[str | None], name: str) -> list[Violation]:
    """Violations in the functions and %%ranks cells of a notebook's code cells (None: a markdown cell), named
    by their 0-based index among all cells."""
    found = []
    imported: set[str] = set()
    for index, text in enumerate(cells):
        if text is None:
            continue
        source, ranks = cell_source(text)
        try:
            imported |= _comm_names(ast.parse(source))
        except SyntaxError:
            continue  # not Python (a cell of another language): nothing to check
        found += check_source(source, lambda line, i=index: f"{name}:cell {i}:line {line}", ranks, imported)
    return found


def check_notebooks() -> list[Violation]:
    found = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = ["".join(c["source"]) if c["cell_type"] == "code" else None
                 for c in json.loads(path.read_text())["cells"]]
        found += check_notebook(cells, path.relative_to(ROOT).as_posix())
    return found


# A notebook with every kind of violation the check looks for, and the placed versions it must accept.
PLANTED = [
    "import torch\nimport torch.distributed as dist\nfrom labkit import comm\nfrom labkit.comm import ring_allreduce",
    # cell 1: straight into a collective; through a clone; through a list comprehension into all_gather
    """def on_rank():
    t = torch.ones(3)
    dist.all_reduce(t)
    copy = t.clone() * 2
    dist.broadcast(copy, 0)
    parts = [torch.empty(3) for _ in range(2)]
    dist.all_gather(parts, torch.zeros(3, device=labkit.device()))""",
    # cell 2: a %%ranks cell, into labkit.comm kernels (as comm.x and by bare name), and a dtype-only .to
    """%%ranks 2
x = torch.arange(4).to(torch.float32)
comm.ring_allreduce(x)
ring_allreduce(torch.randn(4))""",
    # cell 3: placed, every way the rule accepts: nothing to report
    """def placed():
    device = labkit.device()
    a = torch.ones(3, device=device)
    b = torch.randint(-8, 9, (3,)).to(torch.float32).to(device)
    c = torch.zeros(3).cuda()
    d = [torch.empty_like(a) for _ in range(2)]
    e = torch.ones(3, device="cpu")
    f = torch.ones(3)
    f = f.to(device)
    dist.all_reduce(a)
    dist.all_reduce(b)
    dist.all_reduce(c)
    dist.all_gather(d, a)
    dist.all_reduce(e, group=gloo_group)
    dist.all_reduce(f)
    n = torch.ones(3).numel()
    dist.broadcast(a, n - 1)""",
    None,  # cell 4: markdown
    # cell 5: kernel side, no collective: not rank code, nothing to report
    "weights = torch.ones(3)\nprint(weights.sum())",
]


def test_the_check_catches_a_planted_example_and_accepts_placed_tensors():
    found = check_notebook(PLANTED, "planted.ipynb")
    assert [(v.where, v.sink.split(" (")[0]) for v in found] == [
        ("planted.ipynb:cell 1:line 2", "dist.all_reduce"),
        ("planted.ipynb:cell 1:line 2", "dist.broadcast"),
        ("planted.ipynb:cell 1:line 6", "dist.all_gather"),
        ("planted.ipynb:cell 2:line 2", "comm.ring_allreduce"),
        ("planted.ipynb:cell 2:line 4", "ring_allreduce"),
    ], "\n".join(map(str, found))
    assert "torch.ones(3) (line 2) reaches dist.all_reduce (line 3) without device=" in str(found[0])


def test_the_check_catches_a_planted_example_in_package_code():
    source = '''
def ring_step(transport, chunk):
    incoming = torch.empty(chunk.numel(), dtype=chunk.dtype)
    transport.irecv(incoming, transport.left, 0).wait()
    scratch = torch.empty(chunk.numel(), dtype=chunk.dtype, device=chunk.device)
    transport.irecv(scratch, transport.left, 0).wait()
'''
    found = check_source(source, lambda line: f"planted.py:{line}")
    assert [v.where for v in found] == ["planted.py:3"] and "transport.irecv" in found[0].sink


def test_the_check_sees_labkit_parallels_counted_collectives():
    source = '''
from labkit.parallel._collectives import all_gather, broadcast
def share(group):
    flat = torch.zeros(4)
    broadcast(flat, 0, group=group)
    out = torch.empty(8, device=labkit.device())
    all_gather(out, torch.ones(4), group=group)
'''
    found = check_source(source, lambda line: f"planted.py:{line}")
    assert [(v.where, v.sink.split(" (")[0]) for v in found] == [("planted.py:4", "broadcast"),
                                                                ("planted.py:7", "all_gather")], found


def _everything() -> list[Violation]:
    return check_package() + check_notebooks()


def test_every_communicated_tensor_is_on_the_rank_device():
    found = _everything()
    assert not found, f"{len(found)} tensors reach a collective without device=:\n" + "\n".join(map(str, found))
