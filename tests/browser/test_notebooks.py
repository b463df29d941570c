"""Every notebook, run in JupyterLab in a real browser, the way a student meets it.

For each notebook in notebooks/ (new ones are picked up by themselves): open it, run all cells, wait
until the kernel is idle, then check that no cell failed (except cells tagged `raises-exception`), that
no widget failed to display, that every plotly figure the notebook made is drawn, and that the page
threw no errors. Animations must move when played; widgets must change their figure when moved.
A screenshot of each notebook goes to test-artifacts/screenshots/.

What a student must see in one notebook in particular (the quiz's options all selectable, the planner's values
readable at 1280 px, ...) is checked by a `checks_*.py` module beside this file: it names its `NOTEBOOK` and
defines `check(page, cells)`, called after the notebook ran and before its widgets are moved.
"""

import importlib
import json
import re
import urllib.request
from pathlib import Path

import pytest
from playwright.sync_api import Page

NOTEBOOKS = sorted(p.name for p in (Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
CHECKS = [importlib.import_module(f"{__package__}.{p.stem}" if __package__ else p.stem)
          for p in sorted(Path(__file__).parent.glob("checks_*.py"))]
RUN_SECONDS = 300
PLOTLY = "application/vnd.plotly.v1+json"
WIDGET_REPR = re.compile(r"\b[A-Z][A-Za-z]*\((value|children|layout|description)=")

NOTEBOOK_STATE = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  if (!panel || !panel.content || !panel.sessionContext) return null;
  const cells = panel.content.widgets.filter(c => c.model.type === 'code');
  return {
    kernel: panel.sessionContext.session?.kernel?.status ?? 'none',
    running: cells.filter(c => (c.promptNode?.textContent ?? '').includes('*')).length,
    executed: cells.filter(c => c.model.executionCount !== null).length,
    total: cells.length,
    failed: cells.filter(c => !(c.model.getMetadata('tags') || []).includes('raises-exception')
                              && c.model.outputs.toJSON().some(o => o.output_type === 'error')).length,
  };
}"""

WIDER_THAN_THE_COLUMN = """() => [...document.querySelectorAll('.jp-CodeCell .cm-scroller')]
  .filter(e => e.scrollWidth > e.clientWidth + 1).length"""

CELL_OUTPUTS = """() => window.jupyterapp.shell.currentWidget.content.widgets
  .filter(c => c.model.type === 'code')
  .map(c => ({tags: c.model.getMetadata('tags') || [], outputs: c.model.outputs.toJSON()}))"""


def run_all(page: Page, lab_url: str, name: str) -> list[dict]:
    """Open `name`, run every cell, wait until all have run (or one failed: JupyterLab stops there) and the
    kernel is idle; the cells' tags and outputs."""
    page.goto(f"{lab_url}/lab/workspaces/{Path(name).stem}/tree/{name}?reset")  # a fresh workspace: one notebook
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.started", timeout=60_000)
    page.wait_for_function(f"() => ({NOTEBOOK_STATE})()?.kernel === 'idle'", timeout=120_000)
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    page.wait_for_function(
        f"""() => {{ const s = ({NOTEBOOK_STATE})();
                  return s && s.kernel === 'idle' && s.running === 0 && (s.executed === s.total || s.failed); }}""",
        timeout=RUN_SECONDS * 1000, polling=500)
    return page.evaluate(CELL_OUTPUTS)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_in_jupyterlab(page: Page, lab_url: str, screenshots: Path, name: str):
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.set_viewport_size({"width": 1280, "height": 900})
    cells = run_all(page, lab_url, name)
    assert page.evaluate(WIDER_THAN_THE_COLUMN) == 0, "a code cell scrolls sideways at 1280 px: wrap it"

    failed = [i for i, cell in enumerate(cells) if "raises-exception" not in cell["tags"]
              and any(o["output_type"] == "error" for o in cell["outputs"])]
    assert not failed, f"cells {failed} raised: " + "; ".join(
        f"{o['ename']}: {o['evalue']}" for i in failed for o in cells[i]["outputs"] if o["output_type"] == "error")

    made = sum(1 for cell in cells for o in cell["outputs"] if PLOTLY in o.get("data", {}))
    page.wait_for_function(f"() => document.querySelectorAll('.jp-RenderedPlotly .main-svg').length >= {made}",
                           timeout=30_000)
    assert page.locator(".jp-RenderedPlotly").count() == made

    assert "Error displaying widget" not in page.locator(".jp-Notebook").first.inner_text()
    assert not WIDGET_REPR.search(" ".join(page.locator(".jp-OutputArea-output").all_inner_texts()))

    save_screenshot(page, screenshots / f"{Path(name).stem}.png")
    page.set_viewport_size({"width": 1280, "height": 900})
    for module in CHECKS:
        if module.NOTEBOOK == name:
            module.check(page, cells)
    play_every_animation(page)
    move_every_slider(page)
    assert not errors, errors


@pytest.fixture(autouse=True)
def shut_down_kernels(lab_url: str):
    """After each notebook, stop its kernel (and with it the kernel's ranks): the next one gets the CPU."""
    yield
    with urllib.request.urlopen(f"{lab_url}/api/kernels") as response:
        kernels = json.load(response)
    for kernel in kernels:
        urllib.request.urlopen(urllib.request.Request(f"{lab_url}/api/kernels/{kernel['id']}", method="DELETE"))


def save_screenshot(page: Page, path: Path) -> None:
    """The whole notebook in one picture: hide the file browser, make the window as tall as the
    notebook's scrolling area, scroll to the top, then shoot."""
    scrollers = "document.querySelectorAll('.jp-NotebookPanel .jp-WindowedPanel-outer, .jp-NotebookPanel-notebook')"
    page.evaluate("() => window.jupyterapp.shell.collapseLeft()")
    height = page.evaluate(f"() => Math.max(...[...{scrollers}].map(e => e.scrollHeight))")
    page.set_viewport_size({"width": 1280, "height": min(int(height) + 250, 30_000)})
    page.evaluate(f"() => {scrollers}.forEach(e => e.scrollTop = 0)")
    page.wait_for_timeout(1500)
    page.screenshot(path=str(path))


def frame_state(figure) -> str:
    """What a figure shows now: every text drawn in it (title, slider position, cell labels)."""
    return figure.evaluate("element => element.textContent")


def play_every_animation(page: Page) -> None:
    """Every drawn plotly figure with a Play button must show another frame once played."""
    figures = page.locator(".jp-RenderedPlotly")
    for i in range(figures.count()):
        figure = figures.nth(i)
        if not figure.locator(".updatemenu-button").count():
            continue
        figure.scroll_into_view_if_needed()
        before = frame_state(figure)
        figure.locator(".updatemenu-button", has_text="Play").click()
        page.wait_for_timeout(2500)
        assert frame_state(figure) != before, f"pressing Play did not change figure {i}"


def move_every_slider(page: Page) -> None:
    """Every ipywidgets slider that shares an output with a figure must change that figure."""
    outputs = page.locator(".jp-OutputArea-child")
    for i in range(outputs.count()):
        output = outputs.nth(i)
        handle, plot = output.locator(".widget-slider .noUi-handle"), output.locator(".js-plotly-plot")
        if not (handle.count() and plot.count()):
            continue
        output.scroll_into_view_if_needed()
        before = plot.first.inner_html()
        handle.first.focus()
        handle.first.press("ArrowRight")
        handle.first.press("ArrowRight")
        page.wait_for_timeout(1500)
        assert plot.first.inner_html() != before, f"moving the slider in output {i} did not change its figure"
