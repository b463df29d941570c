"""Pressing stop on a %%ranks cell, as a student does in notebook 00: every rank's prints arrive while the cell
runs, and the interrupt shows a short message in the student's terms, not labkit's and selectors' internals: the
pool's "labkit: interrupted; ..." line, then one line, no traceback through IPython's run_cell_magic (the cell's
own lines ran on the ranks). The cell runs on 2 ranks where notebook 00's ran on more: labkit's note that each world
size keeps its own variables is then the cell's first output, on stdout (stderr is a red box)."""

import re

from playwright.sync_api import Page

NOTEBOOK = "00_setup.ipynb"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
MAX_TRACEBACK_LINES = 12

ADD_AND_RUN = """async (source) => {
  const app = window.jupyterapp, notebook = app.shell.currentWidget.content;
  notebook.activeCellIndex = notebook.widgets.length - 1;
  await app.commands.execute('notebook:insert-cell-below');
  notebook.activeCell.model.sharedModel.setSource(source);
  app.commands.execute('notebook:run-cell');  // not awaited: it settles only when the cell ends
}"""

LAST_OUTPUTS = """() => { const cells = window.jupyterapp.shell.currentWidget.content.widgets;
  return cells[cells.length - 1].model.outputs.toJSON(); }"""


def text_of(outputs: list[dict]) -> str:
    parts = []
    for output in outputs:
        if output["output_type"] == "stream":
            parts.append(output["text"])
        elif output["output_type"] == "error":
            parts.append("\n".join(output["traceback"]))
    return ANSI.sub("", "".join(parts))


def check(page: Page, cells: list[dict]) -> None:
    page.evaluate(ADD_AND_RUN, "%%ranks 2 --timeout 600\nimport time\nprint('started', flush=True)\ntime.sleep(600)")
    page.wait_for_function(f"() => JSON.stringify(({LAST_OUTPUTS})()).includes('[rank 1] started')",
                           timeout=90_000, polling=200)  # rank 1 too, while the cell still runs
    page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.interrupt()")
    page.wait_for_function(f"() => ({LAST_OUTPUTS})().some(o => o.output_type === 'error')",
                           timeout=30_000, polling=200)
    outputs = page.evaluate(LAST_OUTPUTS)
    error = next(o for o in outputs if o["output_type"] == "error")
    traceback = ANSI.sub("", "\n".join(error["traceback"])).strip().splitlines()
    assert error["ename"] in ("KeyboardInterrupt", "Interrupted"), error["ename"]  # labkit's is a subclass
    assert "interrupted" in text_of(outputs)
    assert len(traceback) <= MAX_TRACEBACK_LINES, f"{len(traceback)} lines after an interrupt:\n" + "\n".join(traceback)
    print("after an interrupt, the student sees:", *traceback, sep="\n  ")
    assert not any(part in "\n".join(traceback) for part in ("selectors.py", "labkit/launch", "pool.py",
                                                             "run_cell_magic")), traceback
    assert len(traceback) == 1 and traceback[0].startswith("KeyboardInterrupt: the %%ranks cell was stopped"), traceback
    check_world_size_note(outputs)


def check_world_size_note(outputs: list[dict]) -> None:
    """labkit's note that each world size keeps its own variables, where it shows: first, on stdout."""
    noted = [i for i, o in enumerate(outputs) if "each world size keeps its own variables" in text_of([o])]
    if not noted:
        return
    assert noted == [0], f"the world-size note is output {noted}, after the ranks' lines: {outputs[:3]}"
    assert outputs[0]["name"] == "stdout", "the world-size note is a note, not a warning: on stdout, not in red"
