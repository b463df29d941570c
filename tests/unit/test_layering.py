"""labkit's layering, checked two ways: what a fresh interpreter loads, and the import graph read from the source.

1. Kernels run inside any process group, torchrun's too, so importing them must not load the launcher (its pool,
   fork server and worker): every module of labkit.parallel, comm, checkpoint, plan and models, and
   labkit.measure and labkit.groups, is imported in a fresh interpreter, and no `labkit.launch*` module may be
   loaded then. `labkit.rank`, `labkit.device` ... answer from labkit.groups; `labkit.run` still works, by loading
   the launcher on first use.
2. No import cycles among labkit's modules. The graph has an edge A -> B for EVERY import statement in A's file
   that names B: at module level, inside functions, under `if TYPE_CHECKING:`, and `importlib.import_module`
   with a literal name. Imports inside functions count because deferring an import is how a cycle hides: the four
   cycles this test was written against (issue 27) were all closed by one. `from P import x` names P.x when that
   is a module, else P; importing P.x is no edge to P's `__init__` (Python runs it, but every submodule would then
   depend on its package, which is no design fact). Source in strings that a module executes for a student (the
   %%ranks prelude, labkit.launch.cells.PRELUDE) is the student's code, not an import of the package.
3. DESIGN.md's rule, read from the same graph: no module of plan, viz, comm, parallel, checkpoint, models,
   measure or groups imports labkit.launch itself; and notebooks and commands import the launcher's names from
   the package labkit.launch, never from its modules.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "labkit"
BELOW_LAUNCH = ("labkit.plan", "labkit.viz", "labkit.comm", "labkit.parallel", "labkit.checkpoint",
                "labkit.models", "labkit.measure", "labkit.groups")
IMPORTED_WITHOUT_LAUNCH = ("labkit.parallel", "labkit.comm", "labkit.checkpoint", "labkit.measure", "labkit.plan",
                           "labkit.models", "labkit.groups")
KNOWN_CYCLES: dict[frozenset[str], str] = {}  # none left; a cycle kept on purpose would be listed with its reason


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The `modules` that `path` imports, wherever the statement stands (see the module docstring)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = resolve_relative(path, node) if node.level else node.module
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        elif isinstance(node, ast.Call) and _is_import_module(node.func) and node.args \
                and isinstance(node.args[0], ast.Constant):
            found.add(node.args[0].value)
    return found & modules


def _is_import_module(func: ast.AST) -> bool:
    """importlib.import_module, or import_module imported by name."""
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or \
        (isinstance(func, ast.Name) and func.id == "import_module")


def resolve_relative(path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a relative `from .x import y` names, from the importing file's place in its package."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    package = package[:len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, read from every .py file under `package`."""
    paths = {module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    return {name: imported_modules(path, set(paths)) - {name} for name, path in paths.items()}


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def find_cycle(graph: dict[str, set[str]], skip: frozenset = frozenset()) -> list[str]:
    """One cycle of `graph` as a path [a, b, ..., a], or [] if it has none (depth-first search, white-grey-black).
    Cycles whose modules are all in one of KNOWN_CYCLES' sets are skipped through `skip` (a set of such sets)."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str]:
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                cycle = stack[stack.index(target):] + [target]
                if not any(set(cycle) <= known for known in skip):
                    return cycle
            elif target not in state and (found := visit(target)):
                return found
        stack.pop()
        state[module] = "done"
        return []

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return []


def test_importing_the_kernels_loads_no_launcher(script):
    code = f"""
        import importlib, pkgutil, sys
        for name in {IMPORTED_WITHOUT_LAUNCH!r}:
            module = importlib.import_module(name)
            for sub in pkgutil.walk_packages(getattr(module, "__path__", []), name + "."):
                importlib.import_module(sub.name)
        import labkit
        assert labkit.rank.__module__ == labkit.device.__module__ == "labkit.groups"
        loaded = sorted(m for m in sys.modules if m.startswith("labkit."))
        print("loaded", len(loaded))
        print("launch", sorted(m for m in loaded if m.startswith("labkit.launch")))
        labkit.run  # the launcher's names still work: the first lookup imports it
        print("after run", "labkit.launch.owner" in sys.modules)
    """
    returncode, out, err = script(code)
    assert returncode == 0, err
    assert int(out.split("loaded ")[1].split()[0]) > 40  # the walk imported the packages' modules
    assert "launch []" in out, f"importing the kernels loaded the launcher: {out}"
    assert "after run True" in out


def test_labkit_serves_the_launchers_names_as_before(script):
    returncode, out, err = script("""
        import labkit
        from labkit import RankError, run
        import labkit.launch as launch
        names = ("run", "shutdown", "prestart", "RankError", "RankTimeout", "rank", "world_size", "device",
                 "local_rank", "MAX_WORLD_SIZE")
        assert all(getattr(labkit, n) is getattr(launch, n) for n in names)
        assert run is launch.run and RankError is launch.RankError and labkit.launch is launch
        assert set(labkit.__all__) <= set(dir(labkit))
        try:
            labkit.no_such_name
        except AttributeError as exc:
            print(exc)
    """)
    assert returncode == 0, err
    assert "module 'labkit' has no attribute 'no_such_name'" in out


def test_labkit_has_no_import_cycles():
    cycle = find_cycle(import_graph(), skip=frozenset(KNOWN_CYCLES))
    assert not cycle, "an import cycle among labkit's modules (imports inside functions count): " + " -> ".join(cycle)


def test_nothing_below_the_launcher_imports_it():
    graph = import_graph()
    below = [m for m in graph if any(m == top or m.startswith(top + ".") for top in BELOW_LAUNCH)]
    assert len(below) > 40
    reaching = sorted(f"{m} -> {t}" for m in below for t in graph[m] if t.startswith("labkit.launch"))
    assert not reaching, f"modules below labkit.launch import it (DESIGN.md: data flows one way): {reaching}"


def test_the_graph_sees_deferred_imports_and_the_search_finds_cycles(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("def f():\n    from pkg import c\n")
    (package / "c.py").write_text("import importlib\n\ndef g():\n    importlib.import_module('pkg')\n")
    graph = import_graph(package)
    assert graph == {"pkg": {"pkg.sub.b"}, "pkg.sub": set(), "pkg.sub.b": {"pkg.c"}, "pkg.c": {"pkg"}}
    assert find_cycle(graph) == ["pkg", "pkg.sub.b", "pkg.c", "pkg"]
    assert find_cycle(graph, skip=frozenset({frozenset({"pkg", "pkg.sub.b", "pkg.c"})})) == []
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_groups_is_a_leaf():
    """labkit.groups (who am I, groups) imports only torch and the standard library, like picotron's
    process_group_manager.py: everything else may read it, and it reads nothing of labkit."""
    path = PACKAGE / "groups.py"
    tops = {name.split(".")[0] for node in ast.walk(ast.parse(path.read_text()))
            for name in ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) else [])}
    assert "torch" in tops
    assert tops <= {"torch", *sys.stdlib_module_names}, f"labkit.groups imports {sorted(tops)}"


@pytest.mark.parametrize("module, partner", [("labkit.comm.simulator", "labkit.comm"),
                                             ("labkit.exercises._kit._guard", "labkit.exercises.average"),
                                             ("labkit.launch.cells", "labkit")])
def test_three_more_cycles_of_issue_27_stay_broken(module, partner):
    """Each module whose deferred import closed a cycle (with groups.py's, the four of issue 27) no longer
    reaches its old partner: simulator.py takes the kernels from their modules, the graders' base guard (once
    guard.py, now _kit/_guard.py) has its wait watcher in a module of its own (_kit/_wait_watch.py), and a
    %%ranks cell's `import labkit` is its prelude's."""
    graph = import_graph()
    assert partner in graph and module in graph
    assert partner not in reachable(graph, module), f"{module} reaches {partner} again"


LAUNCH_MODULE_IMPORT = re.compile(r"^\s*(?:from|import)\s+labkit\.launch\.\w+", re.MULTILINE)


def launch_module_imports(text: str) -> list[str]:
    """Lines of `text` importing one of labkit.launch's modules (labkit.launch.backend ...) instead of the package."""
    return [match.group(0).strip() for match in LAUNCH_MODULE_IMPORT.finditer(text)]


def test_notebooks_and_commands_import_the_launcher_by_its_package():
    """What notebooks and `labkit.commands` use of the launcher (run, the backend choice) comes from
    `labkit.launch` itself, so that its modules can move without breaking a course cell."""
    notebooks = sorted((PACKAGE.parent / "notebooks").glob("*.ipynb"))
    commands = sorted((PACKAGE / "commands").glob("*.py"))
    assert len(notebooks) > 10 and commands
    found = [f"{p.name}: {line}" for p in notebooks for cell in json.loads(p.read_text())["cells"]
             if cell["cell_type"] == "code" for line in launch_module_imports("".join(cell["source"]))]
    found += [f"{p.name}: {line}" for p in commands for line in launch_module_imports(p.read_text())]
    assert not found, f"import these from labkit.launch instead: {found}"
    assert launch_module_imports("x = 1\nfrom labkit.launch.backend import choose_backend\n") == \
        ["from labkit.launch.backend"]
