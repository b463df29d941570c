"""`%%ranks N`: run a notebook cell on N ranks, each keeping its own variables across cells.

    %load_ext labkit

    %%ranks 4
    t = torch.tensor([float(labkit.rank())])
    dist.all_reduce(t)
    t                      # each rank's last expression is shown, prefixed [rank N]

Every rank starts with `torch`, `dist` (torch.distributed) and `labkit` imported. The cell is plain
Python: IPython's own `%` and `!` syntax does not reach the ranks.
"""

from __future__ import annotations

import linecache

from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

from labkit.launch.owner import run
from labkit.launch.worker import run_cell


@magics_class
class RanksMagics(Magics):
    @magic_arguments()
    @argument("world_size", type=int, help="number of ranks, e.g. 4")
    @argument("--timeout", type=float, default=60.0, help="seconds before the cell is stopped (default 60)")
    @argument("--backend", default="auto", help="auto (default), gloo or nccl")
    @cell_magic
    def ranks(self, line: str, cell: str):
        """Run this cell on N ranks: %%ranks N [--timeout SECONDS] [--backend auto|gloo|nccl]"""
        options = parse_argstring(self.ranks, line)
        filename = self._cell_filename()
        # Line numbers count the %%ranks line too, as the notebook shows them.
        shown = [f"%%ranks {line}\n", *cell.splitlines(True)]
        linecache.cache[filename] = (sum(map(len, shown)), None, shown, filename)
        values = run(run_cell, "\n" + cell, filename, world_size=options.world_size,
                     backend=options.backend, timeout=options.timeout)
        for rank, value in enumerate(values):
            if value is not None:
                self._show(rank, value)

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

    def _show(self, rank: int, value) -> None:
        data, _ = self.shell.display_formatter.format(value)
        if set(data) - {"text/plain"}:
            print(f"[rank {rank}]")
            display(value)
        else:
            print(f"[rank {rank}] {data.get('text/plain', repr(value))}")


def load_ipython_extension(ipython) -> None:
    from labkit.launch.owner import prestart

    ipython.register_magics(RanksMagics)
    prestart()
