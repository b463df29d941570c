"""`%%ranks N`: run a notebook cell on N ranks, each keeping its own variables across cells.

    %load_ext labkit

    %%ranks 4
    t = torch.tensor([float(labkit.rank())])
    dist.all_reduce(t)
    t                      # each rank's last expression is shown, prefixed [rank N]

Every rank starts with `torch`, `dist` (torch.distributed) and `labkit` imported. The cell is plain
Python: IPython's own `%` and `!` syntax does not reach the ranks.

Variables live in the ranks' processes, so each world size keeps its own: `%%ranks 3` does not see
what `%%ranks 2` defined, and `%%ranks 2` finds it again later. When a pool had to be restarted (a
rank died, it was stopped to make room for other ranks, a call failed), its variables are gone; the
next cell on that world size says so, once.
"""

from __future__ import annotations

import ast
import linecache
import sys
from typing import NamedTuple

from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

from labkit.checks import timeout_seconds
from labkit.launch.cells import run_cell
from labkit.launch.errors import CellSyntaxError, Interrupted
from labkit.launch.owner import OWNER, PoolKey, prestart, student_world_size

__all__ = ["RanksMagics", "assigned_names", "load_ipython_extension"]


class _PoolUsed(NamedTuple):
    """The pool a world size's cells last ran in: its key in OWNER, and its serial number then (a pool
    restarted since has another, and the variables of those cells are gone)."""

    key: PoolKey  # (world size, backend, whose)
    serial: int | None


@magics_class
class RanksMagics(Magics):
    def __init__(self, shell=None, **kwargs):
        super().__init__(shell, **kwargs)
        self._pools: dict[int, _PoolUsed] = {}  # world size -> the pool its cells last ran in
        self._names: dict[int, set[str]] = {}  # world size -> names its cells assigned, in that pool
        self._told_per_world_size = False

    @magic_arguments()
    @argument("world_size", type=int, help="number of ranks, e.g. 4")
    @argument("--timeout", type=float, default=60.0, help="seconds before the cell is stopped (default 60)")
    @argument("--backend", default="auto", help="auto (default), gloo or nccl")
    @cell_magic
    def ranks(self, line: str, cell: str):
        """Run this cell on N ranks: %%ranks N [--timeout SECONDS] [--backend auto|gloo|nccl]"""
        __tracebackhide__ = True  # IPython shows the cell's lines, not labkit's
        options = parse_argstring(self.ranks, line)
        world_size, timeout = student_world_size(options.world_size), timeout_seconds("timeout", options.timeout)
        filename = self._cell_filename()
        # Line numbers count the %%ranks line too, as the notebook shows them.
        shown = [f"%%ranks {line}\n", *cell.splitlines(True)]
        linecache.cache[filename] = (sum(map(len, shown)), None, shown, filename)
        tree = _parse("\n" + cell, filename, self._notebook_cell_filename() or filename)
        try:
            with OWNER.turn.held(f"a %%ranks {world_size} cell", timeout):  # the pool checked is the one used
                self._announce_losses(world_size, OWNER.pool_key(world_size, options.backend))
                values = OWNER.call(run_cell, ("\n" + cell, filename), {}, world_size, options.backend, timeout)
        except Interrupted:
            raise Interrupted(in_ranks_cell=True) from None  # the cell's lines ran on the ranks, none here
        self._names.setdefault(world_size, set()).update(assigned_names(tree))
        for rank, value in enumerate(values):
            if value is not None:
                self._show(rank, value)

    def _announce_losses(self, world_size: int, key: PoolKey) -> None:
        """Say once, before the cell runs, if the variables of earlier cells on `world_size` ranks
        are gone (their pool was restarted), or live in other world sizes' pools only."""
        serial = OWNER.serial(key)
        previous = self._pools.get(world_size)
        self._pools[world_size] = _PoolUsed(key, serial)
        if previous is not None and previous.serial != serial:
            why = OWNER.why_ended(previous.serial) or "it was replaced"
            print(f"labkit: the {world_size}-rank pool was restarted ({why}): variables from earlier "
                  f"%%ranks {world_size} cells are gone.", file=sys.stderr, flush=True)  # before the ranks' lines
            self._names.pop(world_size, None)
        if world_size in self._names or self._told_per_world_size:
            return
        others = [f"%%ranks {n}'s {_some(names)} {'is' if len(names) == 1 else 'are'} still there"
                  for n, names in sorted(self._names.items())
                  if names and OWNER.serial(self._pools[n].key) == self._pools[n].serial]
        if others:
            self._told_per_world_size = True
            # a note, not a warning: on stdout (stderr is a red box), flushed before any rank prints
            print(f"labkit: each world size keeps its own variables: %%ranks {world_size} starts empty; "
                  f"{'; '.join(others)}.", flush=True)

    def _cell_filename(self) -> str:
        """A name for this cell's code, unique even when the execution count repeats.

        The count is the one the notebook shows as In[N]: IPython has already compiled this cell under it
        (9.x counts up before running a cell, 8.x after, so `execution_count` alone is off by one on 9.x)."""
        compiled = getattr(self.shell.compile, "_filename_map", None) or {}
        count = max(compiled.values(), default=self.shell.execution_count)
        name, copy = f"<ranks-cell-{count}>", 1
        while name in linecache.cache:
            copy += 1
            name = f"<ranks-cell-{count}.{copy}>"
        return name

    def _notebook_cell_filename(self) -> str | None:
        """IPython's own name for this cell, which its tracebacks show as Cell In[N]."""
        compiled = getattr(self.shell.compile, "_filename_map", None) or {}
        return max(compiled, key=compiled.get, default=None)

    def _show(self, rank: int, value) -> None:
        data, _ = self.shell.display_formatter.format(value)
        if set(data) - {"text/plain"}:
            print(f"[rank {rank}]")
            display(value)
        else:
            print(f"[rank {rank}] {data.get('text/plain', repr(value))}")


def _parse(source: str, filename: str, shown_as: str) -> ast.Module:
    """Parse the cell here, before any rank: a syntax error then shows its line and caret, as in an
    ordinary cell (named `shown_as`), instead of coming back once per rank without them."""
    try:
        return ast.parse(source, filename)
    except SyntaxError as exc:
        error = exc
        error.filename = shown_as
    raise CellSyntaxError(error) from None


def assigned_names(tree: ast.Module) -> list[str]:
    """Names a cell binds at its top level (assignments, loops, imports, def, class), in order."""
    names: list[str] = []

    class Visitor(ast.NodeVisitor):
        def visit_Name(self, node):
            if isinstance(node.ctx, ast.Store):
                names.append(node.id)

        def visit_FunctionDef(self, node):  # its body has a scope of its own
            names.append(node.name)

        visit_AsyncFunctionDef = visit_ClassDef = visit_FunctionDef

        def visit_alias(self, node):
            names.append((node.asname or node.name).split(".")[0])

        def visit_Lambda(self, node):
            pass

        visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = visit_Lambda

    Visitor().visit(tree)
    return list(dict.fromkeys(names))


def _some(names: set[str], shown: int = 4) -> str:
    """'x', 'x, y', or 'a, b, c, d and 3 more': the first few names, sorted."""
    ordered = sorted(names)
    text = ", ".join(ordered[:shown])
    return text + (f" and {len(ordered) - shown} more" if len(ordered) > shown else "")


def load_ipython_extension(ipython) -> None:
    """`%load_ext labkit`: add %%ranks, and start the fork server (its `import torch`) in the background."""
    ipython.register_magics(RanksMagics)
    prestart()
