"""Notebook 10's monitored_barrier demo as a student sees it: free of error boxes. The cell succeeds by design
(rank 1 skips the barrier, and the cell prints the diagnostic it expected), so gloo's C++ log line, which the demo
captures, must not show as a stderr box there.
"""

from playwright.sync_api import Page

NOTEBOOK = "10_nccl_and_debugging.ipynb"
STDERR = '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'

BARRIER_CELL = """() => {
  const cells = window.jupyterapp.shell.currentWidget.content.widgets
    .filter(c => c.model.type === 'code' && c.model.sharedModel.getSource().includes('monitored_barrier('));
  return cells.map(c => ({stderr_boxes: c.node.querySelectorAll('STDERR').length,
                          text: c.outputArea.node.innerText}));
}""".replace("STDERR", STDERR.replace("'", "\\'"))


def check(page: Page, cells: list[dict]) -> None:
    """The barrier cell's output."""
    check_barrier_cell(page.evaluate(BARRIER_CELL))


def check_barrier_cell(found: list[dict]) -> None:
    """One monitored_barrier cell; gloo's log shows as the expected diagnostic, not as a stderr box."""
    assert len(found) == 1, f"expected one cell calling monitored_barrier, found {len(found)}"
    cell = found[0]
    assert cell["stderr_boxes"] == 0, f"the monitored_barrier cell shows a stderr box: {cell['text'][:300]}"
    assert "expected:" in cell["text"] and "failed to pass monitoredBarrier" in cell["text"], cell["text"][:300]
