"""Notebook 08's planner as a student sees it at 1280 px, with the file browser open and collapsed: every
slider's value and the dropdown's text whole, no control label cut, both charts inside the output area; and a
size typed as people write it ("70B") redraws the memory chart for that model, with its bars.

(The planner's first layout cut its slider values and dropdown text, clipped the speedup chart at the right
and read a typed "70B" as 1e7 parameters, leaving an empty chart.)"""

from pathlib import Path

from playwright.sync_api import Page

NOTEBOOK = "08_worked_example_7b.ipynb"
SCREENSHOT = Path(__file__).resolve().parents[2] / "test-artifacts" / "screenshots" / "08_planner_file_browser.png"

MEASURE = """area => {
  const box = r => ({left: r.left, right: r.right, width: r.width});
  const outer = area.getBoundingClientRect();
  const cut = e => e.scrollWidth > e.clientWidth + 1;
  const past = e => { const r = e.getBoundingClientRect();  // sticking out of the output area, or of its widget
                      const own = (e.closest('.widget-slider, .widget-dropdown, .widget-text') || area)
                                  .getBoundingClientRect();
                      return r.width === 0 || r.left < Math.max(outer.left, own.left) - 1
                             || r.right > Math.min(outer.right, own.right) + 1; };
  const canvas = document.createElement('canvas').getContext('2d');
  const textWidth = (element, text) => { const s = getComputedStyle(element);
                                         canvas.font = `${s.fontWeight} ${s.fontSize} ${s.fontFamily}`;
                                         return canvas.measureText(text).width; };
  return {
    area: box(outer),
    readouts: [...area.querySelectorAll('.widget-readout')].map(e => ({
      text: e.textContent, cut: cut(e), past: past(e)})),
    labels: [...area.querySelectorAll('.widget-label')].filter(e => e.textContent).map(e => ({
      text: e.textContent, cut: cut(e), past: past(e)})),
    dropdowns: [...area.querySelectorAll('.widget-dropdown select')].map(e => {
      const s = getComputedStyle(e), text = e.options[e.selectedIndex].text;
      const room = e.clientWidth - parseFloat(s.paddingLeft) - parseFloat(s.paddingRight);
      return {text, width: textWidth(e, text), room, past: past(e)};
    }),
    charts: [...area.querySelectorAll('.js-plotly-plot')].map(e => box(e.getBoundingClientRect())),
  };
}"""

MEMORY_CHART = """area => { const plot = area.querySelector('.js-plotly-plot');
  const note = area.querySelector('.widget-text + .widget-html .widget-html-content');
  return plot ? {title: plot.querySelector('.gtitle')?.textContent ?? '',
                 bars: plot.querySelectorAll('.barlayer .point path').length,
                 tops: [...area.querySelectorAll('.js-plotly-plot')].map(e => e.getBoundingClientRect().top
                                                                         - area.getBoundingClientRect().top),
                 note: note?.textContent ?? '', noteCut: note ? note.scrollHeight > note.clientHeight + 1 : true}
              : null; }"""


def check(page: Page, cells: list[dict]) -> None:
    """The planner's layout with the file browser open (as a student first sees JupyterLab) and collapsed,
    then "70B" typed into its parameters field."""
    planner = page.locator(".jp-OutputArea-output").filter(has=page.locator(".widget-dropdown")).filter(
        has=page.locator(".widget-text input"))
    assert planner.count() == 1, "notebook 08 shows one planner (a parameters field and a dropdown)"
    planner = planner.first
    for layout, command in (("file browser open", "activateById('filebrowser')"),
                            ("file browser collapsed", "collapseLeft()")):
        page.evaluate(f"() => window.jupyterapp.shell.{command}")
        page.wait_for_timeout(1500)
        planner.scroll_into_view_if_needed()
        check_layout(planner.evaluate(MEASURE), layout)
        if layout == "file browser open":  # the whole planner in one picture: a window as tall as it
            page.set_viewport_size({"width": 1280, "height": 2400})
            page.wait_for_timeout(1000)
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            planner.screenshot(path=str(SCREENSHOT))
            page.set_viewport_size({"width": 1280, "height": 900})
    check_typed_size(page, planner)


def check_layout(found: dict, where: str) -> None:
    """Every readout, label and dropdown text whole and inside the planner; both charts inside it."""
    assert len(found["readouts"]) >= 10, f"{where}: the planner's sliders show no values ({found['readouts']})"
    for kind in ("readouts", "labels"):
        bad = [item["text"] for item in found[kind] if item["cut"] or item["past"]]
        assert not bad, f"{where}: {kind} cut off or outside the planner: {bad}"
    assert found["dropdowns"], f"{where}: no dropdown"
    for dropdown in found["dropdowns"]:
        assert dropdown["width"] <= dropdown["room"] + 1 and not dropdown["past"], \
            f"{where}: the dropdown shows {dropdown['room']:.0f} px of its {dropdown['width']:.0f} px text " \
            f"{dropdown['text']!r}"
    area = found["area"]
    assert len(found["charts"]) == 2, f"{where}: the planner draws two charts, found {len(found['charts'])}"
    for chart in found["charts"]:
        assert area["left"] - 1 <= chart["left"] and chart["right"] <= area["right"] + 1, \
            f"{where}: a chart ({chart['left']:.0f}-{chart['right']:.0f} px) sticks out of the output area " \
            f"({area['left']:.0f}-{area['right']:.0f} px)"


def check_typed_size(page: Page, planner) -> None:
    """Full recomputation chosen (the activations of 8 x 2048 tokens at the 7B's shape fall from 73 GB to 4.3), then
    sizes typed into the parameters field, each then Enter: "70 GB" is refused with a whole message and the plan
    stays; "1B" turns the verdict to "fits" without moving the charts; "70B" redraws the memory chart for 70B,
    with bars."""
    recomputation = planner.locator(".widget-dropdown").filter(has_text="recomputation").locator("select")
    recomputation.scroll_into_view_if_needed()
    recomputation.select_option(label="full (keep each layer's input)")
    page.wait_for_function("area => area.innerText.includes(\"each layer's input only\")",
                           arg=planner.element_handle(), timeout=15_000)
    field = planner.locator(".widget-text input").first
    field.scroll_into_view_if_needed()
    before = planner.evaluate(MEMORY_CHART)

    def enter(text: str, until: str) -> dict:
        field.fill(text)
        field.press("Enter")
        page.wait_for_function(f"area => {{ const c = ({MEMORY_CHART})(area); return c && ({until}); }}",
                               arg=planner.element_handle(), timeout=15_000)
        return planner.evaluate(MEMORY_CHART)

    refused = enter("70 GB", "c.note.includes('not a parameter count')")
    assert not refused["noteCut"], f"the message under the parameters field is cut: {refused['note']!r}"
    assert refused["title"] == before["title"], "a refused size changed the plan"
    smaller = enter("1B", "c.title.includes('1B')")
    assert "fits" in planner.inner_text() and "does not fit" not in planner.inner_text()
    assert all(abs(a - b) <= 1 for a, b in zip(smaller["tops"], before["tops"], strict=True)), \
        f"the charts moved when the verdict changed: {before['tops']} -> {smaller['tops']}"
    chart = enter("70B", "c.title.includes('70B')")
    assert chart["bars"] > 0, f"after typing 70B the memory chart ({chart['title']!r}) has no bars"
    assert "does not fit" in planner.inner_text(), "a 70B model's 1,120 GB of training state cannot fit one GPU"
