"""Notebook 03's ring animations, as a student sees them at 1280 px: the slider's "hop N" label is not covered
by the Play/Pause buttons, and every rank's "sent" label lies inside the figure, uncut by the axes' clipping and
apart from the others, both before the first hop and after the last (the longest labels)."""

from playwright.sync_api import Page
from settle import wait_for_layout, wait_until_changed

NOTEBOOK = "03_ring_allreduce.ipynb"

BOXES = """figure => {
  const box = e => { const b = e.getBoundingClientRect();
                     return {x0: b.left, y0: b.top, x1: b.right, y1: b.bottom, text: e.textContent, clip: clip(e)}; };
  const clip = e => {  // the area a clip-path (plotly clips traces at their axes) leaves visible, on screen
    const group = e.closest('[clip-path]'), id = group && group.getAttribute('clip-path').match(/#([^)"']+)/);
    const rect = id && document.getElementById(id[1])?.querySelector('rect');
    if (!rect) return null;
    const m = group.getScreenCTM(), x = rect.x.baseVal.value, y = rect.y.baseVal.value;
    return {x0: m.e + m.a * x, y0: m.f + m.d * y,
            x1: m.e + m.a * (x + rect.width.baseVal.value), y1: m.f + m.d * (y + rect.height.baseVal.value)};
  };
  return {
    figure: box(figure.querySelector('.main-svg')),
    buttons: [...figure.querySelectorAll('.updatemenu-button')].map(box),
    hop: [...figure.querySelectorAll('.slider-label')].filter(e => e.textContent.startsWith('hop ')).map(box),
    sent: [...figure.querySelectorAll('.textpoint text')].filter(e => e.textContent.startsWith('sent')).map(box),
  };
}"""

# The slider's "hop N" label: which frame of the ring the figure shows.
HOP_LABEL = """figure => [...figure.querySelectorAll('.slider-label')].map(e => e.textContent)
  .find(text => text.startsWith('hop ')) ?? ''"""


def overlap(a: dict, b: dict) -> bool:
    return a["x0"] < b["x1"] and b["x0"] < a["x1"] and a["y0"] < b["y1"] and b["y0"] < a["y1"]


def inside(a: dict, outer: dict) -> bool:
    return outer["x0"] <= a["x0"] and a["x1"] <= outer["x1"] and outer["y0"] <= a["y0"] and a["y1"] <= outer["y1"]


def check_labels(boxes: dict, where: str) -> None:
    assert len(boxes["hop"]) == 1, f"{where}: no slider label 'hop N' (found {boxes['hop']})"
    covered = [b["text"] for b in boxes["buttons"] if overlap(b, boxes["hop"][0])]
    assert not covered, f"{where}: the {covered} button(s) cover the label {boxes['hop'][0]['text']!r}"
    assert boxes["sent"], f"{where}: no 'sent' labels"
    outside = [s["text"] for s in boxes["sent"] if not inside(s, boxes["figure"])]
    assert not outside, f"{where}: 'sent' labels cut off at the figure's edge: {outside}"
    clipped = [s["text"] for s in boxes["sent"] if s["clip"] and not inside(s, s["clip"])]
    assert not clipped, f"{where}: 'sent' labels cut off at the axes' edge: {clipped}"
    sent = boxes["sent"]
    crowded = [(a["text"], b["text"]) for i, a in enumerate(sent) for b in sent[i + 1:] if overlap(a, b)]
    assert not crowded, f"{where}: 'sent' labels overlap: {crowded}"


def check(page: Page, cells: list[dict]) -> None:
    """With the file browser closed (as the runner leaves it) and open (as a student first sees JupyterLab,
    the figures some 300 px narrower)."""
    figures = page.locator(".jp-RenderedPlotly").filter(has=page.locator(".updatemenu-button"))
    assert figures.count() == 2, "notebook 03 shows two ring animations (real ranks, 8 simulated ranks)"
    for layout, show in (("file browser closed", "collapseLeft"), ("file browser open", "expandLeft")):
        page.evaluate(f"() => window.jupyterapp.shell.{show}()")
        wait_for_layout(page)  # plotly redraws at the new width
        for i in range(figures.count()):
            check_first_and_last_hop(page, figures.nth(i), f"{layout}, animation {i}")
    page.evaluate("() => window.jupyterapp.shell.collapseLeft()")
    wait_for_layout(page)


def check_first_and_last_hop(page: Page, figure, where: str) -> None:
    figure.scroll_into_view_if_needed()
    check_labels(figure.evaluate(BOXES), f"{where}, before the first hop")
    rail = figure.locator(".slider-rail-touch-rect")
    box = rail.bounding_box()
    rail.click(position={"x": box["width"] - 2, "y": box["height"] / 2})  # to the last hop
    wait_until_changed(page, figure, HOP_LABEL, "hop 0", timeout_ms=5_000)
    wait_for_layout(page)  # the frame's labels drawn
    boxes = figure.evaluate(BOXES)
    assert boxes["hop"] and boxes["hop"][0]["text"] != "hop 0", f"{where}: the slider did not move"
    check_labels(boxes, f"{where}, at {boxes['hop'][0]['text']}")
    rail.click(position={"x": 2, "y": box["height"] / 2})  # back to hop 0, where Play starts from
    wait_until_changed(page, figure, HOP_LABEL, boxes["hop"][0]["text"], timeout_ms=5_000)
    wait_for_layout(page)
