"""Every notebook, run in JupyterLab in a real browser, the way a student meets it.

For each notebook in notebooks/ (new ones are picked up by themselves): open it, run all cells, wait
until the kernel is idle, then check that no cell failed (except cells tagged `raises-exception`), that
no widget failed to display, that every plotly figure the notebook made is drawn, and that the page
threw no errors. At 1280 px with the file browser open, as a student first meets JupyterLab: no widget scrolls
sideways, no widget text is double-spaced. Animations must move when played; widgets must
change their figure when moved; the kernel is never sent a message for a widget it has closed ("No such comm",
which JupyterLab's log badge counts), and no news pop-up shows. Saved and reopened with a fresh kernel, every
widget that can no longer be drawn has labkit's note above it saying that the cell must run again, and the
progress table says when it was read. A screenshot of each notebook goes to test-artifacts/screenshots/.

What a student must see in one notebook in particular (the quiz's options all selectable, the planner's values
readable at 1280 px, ...) is checked by a `checks_*.py` module beside this file: it names its `NOTEBOOK` (or
several, as `NOTEBOOKS`) and defines `check(page, cells)`, called after the notebook ran and before its widgets are
moved.
"""

import importlib
import json
import re
import urllib.request
from pathlib import Path

import pytest
from playwright.sync_api import Page
from settle import wait_for_layout, wait_until, wait_until_changed
from widget_checks import check_widget_text

SCREENSHOTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "screenshots"
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

REOPENED = """() => [...document.querySelectorAll('.jp-OutputArea-child')].map(child => ({
  dead: (child.querySelector('.jp-OutputArea-output')?.innerText ?? '').includes('Error displaying widget'),
  note: [...child.querySelectorAll('.labkit-stale-note')].some(e => e.getClientRects().length > 0),
  text: child.innerText.slice(0, 80),
  cell: (child.closest('.jp-Cell')?.querySelector('.cm-content')?.innerText ?? '').slice(0, 80)}))"""

# Reopened, every widget output has stopped saying "Loading widget...": the widget manager has fetched the fresh
# kernel's widgets and shown an error for each model that kernel lacks (jupyterlab_widgets' renderer).
WIDGETS_RESOLVED = """() => ![...document.querySelectorAll('.jp-OutputArea-output')]
  .some(e => e.textContent.trim() === 'Loading widget...')"""

CELL_OUTPUTS = """() => window.jupyterapp.shell.currentWidget.content.widgets
  .filter(c => c.model.type === 'code')
  .map(c => ({tags: c.model.getMetadata('tags') || [], outputs: c.model.outputs.toJSON()}))"""


def open_notebook(page: Page, lab_url: str, name: str, workspace: str) -> None:
    """Open `name` in a fresh workspace (one notebook) and wait until its kernel is idle."""
    page.goto(f"{lab_url}/lab/workspaces/{workspace}/tree/{name}?reset")
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.started", timeout=60_000)
    page.wait_for_function(f"() => ({NOTEBOOK_STATE})()?.kernel === 'idle'", timeout=120_000)


def run_all(page: Page, lab_url: str, name: str) -> list[dict]:
    """Open `name`, run every cell, wait until all have run (or one failed: JupyterLab stops there) and the
    kernel is idle; the cells' tags and outputs."""
    open_notebook(page, lab_url, name, Path(name).stem)
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    page.wait_for_function(
        f"""() => {{ const s = ({NOTEBOOK_STATE})();
                  return s && s.kernel === 'idle' && s.running === 0 && (s.executed === s.total || s.failed); }}""",
        timeout=RUN_SECONDS * 1000, polling=200)
    return page.evaluate(CELL_OUTPUTS)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_in_jupyterlab(page: Page, lab_url: str, screenshots: Path, name: str):
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    unknown_comms = watch_for_unknown_comms(page)
    page.set_viewport_size({"width": 1280, "height": 900})
    cells = run_all(page, lab_url, name)
    assert page.evaluate(WIDER_THAN_THE_COLUMN) == 0, "a code cell scrolls sideways at 1280 px: wrap it"
    check_widgets(page)

    failed = [i for i, cell in enumerate(cells) if "raises-exception" not in cell["tags"]
              and any(o["output_type"] == "error" for o in cell["outputs"])]
    assert not failed, f"cells {failed} raised: " + "; ".join(
        f"{o['ename']}: {o['evalue']}" for i in failed for o in cells[i]["outputs"] if o["output_type"] == "error")

    made = sum(1 for cell in cells for o in cell["outputs"] if PLOTLY in o.get("data", {}))
    page.wait_for_function(f"() => document.querySelectorAll('.jp-RenderedPlotly .main-svg').length >= {made}",
                           timeout=30_000)
    drawn = page.evaluate("() => [...document.querySelectorAll('.jp-RenderedPlotly')]"
                          ".filter(e => !e.closest('.jupyter-widgets')).length")
    assert drawn == made  # the cells' figures; a widget's (labkit's FigureSlot) are inside it

    assert "Error displaying widget" not in page.locator(".jp-Notebook").first.inner_text()
    assert not WIDGET_REPR.search(" ".join(page.locator(".jp-OutputArea-output").all_inner_texts()))

    save_screenshot(page, screenshots / f"{Path(name).stem}.png")
    page.set_viewport_size({"width": 1280, "height": 900})
    for module in CHECKS:
        if name in getattr(module, "NOTEBOOKS", (getattr(module, "NOTEBOOK", None),)):
            module.check(page, cells)
    play_every_animation(page)
    move_every_slider(page)
    page.wait_for_timeout(1000)
    assert not unknown_comms, f"the kernel was sent {len(unknown_comms)} messages for widgets it had closed " \
                              f"(JupyterLab's log badge counts its warnings): {unknown_comms[:2]}"
    assert not page.locator(".Toastify__toast", has_text=re.compile("news|update", re.I)).count(), \
        "JupyterLab shows a news pop-up: jupyter/overrides.json sets fetchNews"
    assert not errors, errors
    check_reopened(page, lab_url, name)


def check_widgets(page: Page) -> None:
    """At 1280 px with the file browser open (as run_all leaves it): no widget box scrolls sideways (a part 100%
    wide plus its margins sticks out by 4 px), no wrapped widget text is double-spaced (ipywidgets' HTML inherits
    a 28 px line height), no earlier-session note shows while its widget is drawn."""
    page.evaluate("() => window.jupyterapp.shell.activateById('filebrowser')")
    wait_for_layout(page)
    check_widget_text(page, "after Run All, 1280 px, file browser open")
    notes = [c["text"] for c in page.evaluate(REOPENED) if c["note"]]
    assert not notes, f"the earlier-session note shows while its widget is drawn: {notes[:2]}"


def watch_for_unknown_comms(page: Page) -> list[str]:
    """The kernel's "No such comm" warnings as they reach the page (each a message on the kernel's websocket): the
    browser sent a message for a widget the kernel had closed (labkit's FigureSlot once closed a figure widget per
    redraw), or opened a comm the kernel has no target for (ipywidgets not yet imported: the course's kernel
    config loads it). One is left out: ipykernel 7's shell-channel thread looks up the comm of every comm_msg to
    route it, and JupyterLab's widget manager opens its "jupyter.widget.control" comm and messages it at once, so
    the look-up runs before the kernel's main thread has opened it and logs "No such comm" for it (ipykernel's
    kernelbase.py; harmless, ipywidgets' maintainers say: jupyter-widgets/ipywidgets#3525)."""
    found: list[str] = []
    control: set[str] = set()

    def sent(payload) -> None:
        text = payload.decode(errors="replace") if isinstance(payload, bytes) else payload
        if "jupyter.widget.control" in text and '"comm_open"' in text:
            control.update(re.findall(r'"comm_id":\s*"([^"]+)"', text))

    def received(payload) -> None:
        text = payload.decode(errors="replace") if isinstance(payload, bytes) else payload
        for warning in re.findall(r"No such comm[^\\\n\"]*", text):
            if not any(comm in warning for comm in control):
                found.append(warning)

    page.on("websocket", lambda socket: (socket.on("framesent", sent), socket.on("framereceived", received)))
    return found


def check_reopened(page: Page, lab_url: str, name: str) -> None:
    """Save the run notebook, stop its kernel, open it again (a fresh kernel, as a student the next day): every
    widget that cannot be drawn any more has labkit's note (labkit.widgets.App) in the output above it, no note
    shows above a widget that is drawn, and a saved progress table says when it was read."""
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    page.wait_for_function("() => !window.jupyterapp.shell.currentWidget.context.model.dirty", timeout=30_000)
    reopen_with_a_fresh_kernel(page, lab_url)
    wait_until(page, WIDGETS_RESOLVED, timeout_ms=10_000)  # the widget manager gives up on the old models
    wait_for_layout(page)
    children = page.evaluate(REOPENED)
    notes = page.locator(".labkit-stale-note")
    if notes.count():  # what a student sees the next day: the first widget's note, above its error
        notes.first.scroll_into_view_if_needed()
        page.screenshot(path=str(SCREENSHOTS / f"{Path(name).stem}_reopened.png"))
    unexplained = [f"the cell {c['cell']!r}" for i, c in enumerate(children)
                   if c["dead"] and not (i and children[i - 1]["note"])]
    assert not unexplained, f"reopened, {len(unexplained)} widgets show an error with no word that the cell must " \
                            f"run again (show them as a labkit.widgets.App): {unexplained[:3]}"
    astray = [c["text"] for i, c in enumerate(children) if c["note"] and not (i + 1 < len(children)
                                                                             and children[i + 1]["dead"])]
    assert not astray, f"the earlier-session note shows above no widget: {astray[:2]}"
    tables = page.locator(".jp-RenderedMarkdown", has_text="Your progress:")
    for i in range(tables.count()):
        assert "when this cell ran: run it again" in tables.nth(i).inner_text(), "a saved progress table says " \
            "nothing of when it was read"


# The run notebook's tab closed (saved: no dialog), then opened again in the same JupyterLab: a new document context,
# so a new widget manager that knows none of the old kernel's models, as after reloading the page (which loaded
# JupyterLab's 10 MB of scripts a second time per notebook: some 6 s of a loaded 2-core machine's CPU each).
CLOSE_ALL = """async () => { const app = window.jupyterapp;
  await app.commands.execute('application:close-all');
  app.shell.activateById('filebrowser'); }  // as a page reloaded with ?reset shows it"""
CLOSED = "() => ![...window.jupyterapp.shell.widgets('main')].some(w => w.sessionContext)"  # a launcher may show
OPEN = "(path) => { window.jupyterapp.commands.execute('docmanager:open', {path}); }"


def reopen_with_a_fresh_kernel(page: Page, lab_url: str) -> None:
    """Close the saved notebook, stop its kernel, open it again and wait until its new kernel is idle."""
    path = page.evaluate("() => window.jupyterapp.shell.currentWidget.context.path")
    page.evaluate(CLOSE_ALL)
    page.wait_for_function(CLOSED, timeout=30_000)
    shut_down_kernels_now(lab_url)
    page.evaluate(OPEN, path)
    page.wait_for_function(f"""() => {{ const s = ({NOTEBOOK_STATE})();
        return s && s.kernel === 'idle' && window.jupyterapp.shell.currentWidget.context.path === {path!r}; }}""",
                           timeout=120_000)


@pytest.fixture(autouse=True)
def shut_down_kernels(lab_url: str):
    """After each notebook, stop its kernel (and with it the kernel's ranks): the next one gets the CPU."""
    yield
    shut_down_kernels_now(lab_url)


def shut_down_kernels_now(lab_url: str) -> None:
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
    wait_for_layout(page)
    page.screenshot(path=str(path))


FRAME_STATE = "element => element.textContent"  # what a figure shows: every text drawn (title, slider, labels)


def frame_state(figure) -> str:
    """What a figure shows now: every text drawn in it (title, slider position, cell labels)."""
    return figure.evaluate(FRAME_STATE)


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
        after = wait_until_changed(page, figure, FRAME_STATE, before, timeout_ms=5_000)
        assert after != before, f"pressing Play did not change figure {i}"


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
        after = wait_until_changed(page, plot.first, "e => e.innerHTML", before, timeout_ms=5_000)
        assert after != before, f"moving the slider in output {i} did not change its figure"
