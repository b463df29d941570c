"""Waits on what the page shows, not on the clock: a fixed sleep long enough for a loaded 2-core machine is
seconds too long on most calls, and the browser tests made some 60 of them per run (make test's longest phase).

`wait_for_layout` returns once the notebook's layout has stopped moving and every plotly chart has caught up with
its box (plotly redraws a resized chart some 100 ms after the resize, then lays it out again); `wait_until_changed`
once a value read from the page differs from what it was."""

from playwright.sync_api import Page
from playwright.sync_api import TimeoutError as PageTimeout

QUIET_MS = 300  # the layout unchanged this long (some 18 frames), every chart at its box's width: settled
# At most as long as the longest fixed sleep these waits replace (0.8 to 1.5 s): never slower than they were. Notebook
# 05's page kept moving, or a chart stayed off its box's width, for 5 s after Run All (not found out yet).
LAYOUT_TIMEOUT_MS = 1_500

SETTLED = """async ([quietMs, timeoutMs]) => {
  const frame = () => new Promise(resolve => requestAnimationFrame(resolve));
  const sizes = () => JSON.stringify([...document.querySelectorAll(
      '.jp-NotebookPanel, .jp-OutputArea-output, .js-plotly-plot .main-svg')]
    .map(e => { const r = e.getBoundingClientRect(); return [Math.round(r.width), Math.round(r.height)]; }));
  // A chart of JupyterLab's plotly renderer (it resizes its charts) whose width plotly chose (none was given) has
  // redrawn at its box's width, and waits on no resize. Charts inside widgets: the quiet time alone.
  const chartsCaughtUp = () => [...document.querySelectorAll('.jp-RenderedPlotly.js-plotly-plot')].every(gd =>
    !gd._fullLayout || gd.offsetParent === null || (!gd._resolveResize
      && ((gd.layout && gd.layout.width) || Math.abs(gd._fullLayout.width - gd.clientWidth) <= 2)));
  const start = performance.now();
  let last = sizes(), since = start;
  while (performance.now() - start < timeoutMs) {
    await frame();
    const now = sizes();
    if (now !== last) { last = now; since = performance.now(); }
    else if (performance.now() - since >= quietMs && chartsCaughtUp()) return true;
  }
  return false;
}"""


def wait_for_layout(page: Page, quiet_ms: int = QUIET_MS, timeout_ms: int = LAYOUT_TIMEOUT_MS) -> None:
    """After the file browser opened or closed, or the window changed size: until nothing in the notebook has moved
    for `quiet_ms` and every chart has redrawn at its new width, at most `timeout_ms` (then the checks that follow
    measure what shows, as they did after a fixed sleep)."""
    page.evaluate(SETTLED, [quiet_ms, timeout_ms])


def wait_until(page: Page, condition: str, timeout_ms: int) -> bool:
    """Until `condition` (a JavaScript function of nothing) holds, at most `timeout_ms`: whether it held. For a
    wait that replaced a fixed sleep: what follows checks what shows either way, as after the sleep."""
    try:
        page.wait_for_function(condition, timeout=timeout_ms, polling=100)
        return True
    except PageTimeout:
        return False


def wait_until_changed(page: Page, element, read: str, before: str, timeout_ms: int = 10_000) -> str:
    """Until `read` (a JavaScript function of `element`, a locator: found again at each look, since a redrawn chart
    may be a new node) gives something other than `before`, at most `timeout_ms`; what it gives then (`before` again
    if it never changed: the caller's assert says what should have)."""
    deadline_ms = timeout_ms
    now = element.evaluate(read)
    while now == before and deadline_ms > 0:
        page.wait_for_timeout(100)
        deadline_ms -= 100
        now = element.evaluate(read)
    return now
