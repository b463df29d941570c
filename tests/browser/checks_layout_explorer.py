"""Notebook 14's layout explorer as a student sees it at 1280 px, with the file browser open and collapsed: every
control's label and value whole, both charts inside the output area, plotly's toolbar clear of their titles, which
say why they show ranks 0-3 of 8 (replica dp 0: the other replica is the same); and layouts picked in its
dropdowns: a product other than the world is explained in the summary, a good one redraws both charts for that
layout; experts per block picked with tp = 2 are refused with plan's reason, and ep = 2 with tp = 1 draws ep's bars."""

from pathlib import Path

from playwright.sync_api import Page
from settle import wait_for_layout
from widget_checks import check_toolbar_clear_of_titles

NOTEBOOK = "14_3d_layouts.ipynb"
SCREENSHOT = Path(__file__).resolve().parents[2] / "test-artifacts" / "screenshots" / "14_explorer_file_browser.png"
EXPERTS_SCREENSHOT = SCREENSHOT.with_name("14_explorer_experts.png")  # 8 experts per block over ep = 2

MEASURE = """area => {
  const outer = area.getBoundingClientRect();
  const cut = e => e.scrollWidth > e.clientWidth + 1;
  const past = e => { const r = e.getBoundingClientRect();
                      return r.width === 0 || r.left < outer.left - 1 || r.right > outer.right + 1; };
  const canvas = document.createElement('canvas').getContext('2d');
  const textWidth = (element, text) => { const s = getComputedStyle(element);
                                         canvas.font = `${s.fontWeight} ${s.fontSize} ${s.fontFamily}`;
                                         return canvas.measureText(text).width; };
  return {
    texts: [...area.querySelectorAll('.widget-label, .widget-checkbox label')]
      .filter(e => e.textContent.replace(/\\u200b/g, '').trim())  // ipywidgets' empty labels hold a zero-width space
      .map(e => ({text: e.textContent, cut: cut(e), past: past(e)}))
      .concat([...area.querySelectorAll('.widget-text input')]  // the sliders' values, in their typed boxes
                .map(e => ({text: e.value, cut: cut(e), past: past(e)}))),
    dropdowns: [...area.querySelectorAll('.widget-dropdown select')].map(e => {
      const s = getComputedStyle(e), text = e.options[e.selectedIndex].text;
      return {text, width: textWidth(e, text), room: e.clientWidth - parseFloat(s.paddingLeft)
                                                    - parseFloat(s.paddingRight)}; }),
    charts: [...area.querySelectorAll('.js-plotly-plot')].map(e => {
      const r = e.getBoundingClientRect();
      return {left: r.left, right: r.right, title: e.querySelector('.gtitle')?.textContent ?? ''}; }),
    area: {left: outer.left, right: outer.right},
  };
}"""


def check(page: Page, cells: list[dict]) -> None:
    explorer = page.locator(".jp-OutputArea-output").filter(has=page.locator(".widget-dropdown")).filter(
        has=page.locator(".widget-checkbox"))
    assert explorer.count() == 1, "notebook 14 shows one layout explorer (dropdowns for dp, pp, tp and a checkbox)"
    explorer = explorer.first
    for where, command in (("file browser open", "activateById('filebrowser')"),
                           ("file browser collapsed", "collapseLeft()")):
        page.evaluate(f"() => window.jupyterapp.shell.{command}")
        wait_for_layout(page)
        explorer.scroll_into_view_if_needed()
        check_layout(explorer.evaluate(MEASURE), where)
        check_toolbar_clear_of_titles(page, explorer, f"the layout explorer, {where}")
        if where == "file browser open":  # the whole explorer in one picture: a window as tall as it
            page.set_viewport_size({"width": 1280, "height": 2400})
            wait_for_layout(page)
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            explorer.screenshot(path=str(SCREENSHOT))
            page.set_viewport_size({"width": 1280, "height": 900})
    check_picked_layouts(page, explorer)


def check_layout(found: dict, where: str) -> None:
    """Labels, slider values and the checkbox's text whole and inside the output; dropdown values whole; both
    charts inside the output area."""
    assert len(found["texts"]) >= 6, f"{where}: the explorer shows too few labels ({found['texts']})"
    bad = [item["text"] for item in found["texts"] if item["cut"] or item["past"]]
    assert not bad, f"{where}: labels or values cut off or outside the explorer: {bad}"
    assert len(found["dropdowns"]) == 7, \
        f"{where}: dp, pp, tp, cp, ep, experts per block and k are seven dropdowns ({found['dropdowns']})"
    for dropdown in found["dropdowns"]:
        assert dropdown["width"] <= dropdown["room"] + 1, f"{where}: the dropdown value {dropdown['text']!r} is cut"
    area = found["area"]
    assert len(found["charts"]) == 2, f"{where}: the explorer draws two charts, found {len(found['charts'])}"
    for chart in found["charts"]:
        assert area["left"] - 1 <= chart["left"] and chart["right"] <= area["right"] + 1, \
            f"{where}: the chart {chart['title']!r} sticks out of the output area"
        assert "ranks 0-3 of 8: replica dp 0 (dp 1 holds and sends the same)" in chart["title"], \
            f"{where}: the chart {chart['title']!r} does not say why it shows 4 of the 8 ranks"


def pick(page: Page, explorer, axis: str, size: int, summary_says: str, label: str | None = None) -> dict:
    """Choose `size` in the dropdown of `axis` (or the one whose label starts `label`), wait until the summary says
    `summary_says`; the explorer now."""
    dropdown = explorer.locator(".widget-dropdown").filter(has_text=label or f"{axis} (")
    dropdown.locator("select").select_option(label=str(size))
    page.wait_for_function("([area, text]) => area.textContent.includes(text)",
                           arg=[explorer.element_handle(), summary_says], timeout=15_000)
    return explorer.evaluate(MEASURE)


def check_picked_layouts(page: Page, explorer) -> None:
    """tp = 4 beside dp = 2, pp = 2 is 16 ranks on a world of 8: explained, the charts stay; dp = 1 then makes
    1 x 2 x 4, which both charts draw; back to 2 x 2 x 2 for the slider check that follows."""
    before = explorer.evaluate(MEASURE)
    refused = pick(page, explorer, "tp", 4, "but the world has 8")
    assert [c["title"] for c in refused["charts"]] == [c["title"] for c in before["charts"]], \
        "a refused layout redrew the charts"
    chosen = pick(page, explorer, "dp", 1, "dp=1 x pp=2 x tp=4 = 8 ranks")
    assert all("dp=1 x pp=2 x tp=4" in chart["title"] for chart in chosen["charts"]), \
        f"the charts do not show the layout picked: {[c['title'] for c in chosen['charts']]}"
    pick(page, explorer, "tp", 2, "dp=1 x pp=2 x tp=2 = 4 ranks")
    pick(page, explorer, "dp", 2, "dp=2 x pp=2 x tp=2 = 8 ranks")
    pick(page, explorer, "experts", 8, "tp=2 with experts=8: labkit plans a mixture of experts", "experts per block")
    pick(page, explorer, "tp", 1, "= 4 ranks, but the world has 8")
    experts = pick(page, explorer, "ep", 2, "dp=2 x pp=2 x ep=2 x tp=1 = 8 ranks")
    assert all("dp=2 x pp=2 x ep=2 x tp=1" in chart["title"] for chart in experts["charts"]), \
        f"the charts do not show the layout picked: {[c['title'] for c in experts['charts']]}"
    explorer.screenshot(path=str(EXPERTS_SCREENSHOT))
    pick(page, explorer, "ep", 1, "= 4 ranks, but the world has 8")
    pick(page, explorer, "tp", 2, "tp=2 with experts=8")  # the world's again, but experts need tp = 1
    pick(page, explorer, "experts", "0 (dense MLP)", "dp=2 x pp=2 x tp=2 = 8 ranks", "experts per block")
