"""Notebook 08's planner as a student sees it at 1280 px, with the file browser open and collapsed: every
slider's value (in its text box) and the dropdown's text whole, no control label cut, both charts inside the
output area and using its width (side by side, or each the whole width), plotly's toolbar clear of their titles,
the GPU's memory named in the legend, not written over the bars; a size typed as people write it ("70B") redraws
the memory chart for that model, with its bars; and values typed into a slider's box: "1e3", "-3" and "seventy"
GPUs refused with the reason, the last good value kept, "16" taken.

(The planner's first layout cut its slider values and dropdown text, clipped the speedup chart at the right
and read a typed "70B" as 1e7 parameters, leaving an empty chart. ipywidgets' own readout took "1e3" GPUs as 1,
"-3" as 1 and ignored "seventy", without a word.)"""

from pathlib import Path

from playwright.sync_api import Page
from settle import wait_for_layout
from widget_checks import check_toolbar_clear_of_titles, type_into

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
    readouts: [...area.querySelectorAll('.widget-text input')].map(e => ({  // typed boxes: the sliders' values
      text: e.value, cut: cut(e), past: past(e)})),
    sliderReadouts: [...area.querySelectorAll('.widget-readout')].filter(e => e.offsetParent !== null).length,
    labels: [...area.querySelectorAll('.widget-label')].filter(e => e.textContent).map(e => ({
      text: e.textContent, cut: cut(e), past: past(e)})),
    dropdowns: [...area.querySelectorAll('.widget-dropdown select')].map(e => {
      const s = getComputedStyle(e), text = e.options[e.selectedIndex].text;
      const room = e.clientWidth - parseFloat(s.paddingLeft) - parseFloat(s.paddingRight);
      return {text, width: textWidth(e, text), room, past: past(e)};
    }),
    charts: [...area.querySelectorAll('.js-plotly-plot')].map(e => box(e.getBoundingClientRect())),
    legend: [...area.querySelectorAll('.js-plotly-plot')].map(e => e.querySelector('.legend')?.textContent ?? ''),
    overBars: [...area.querySelectorAll('.js-plotly-plot .annotation-text')].map(e => e.textContent),
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
        wait_for_layout(page)
        planner.scroll_into_view_if_needed()
        check_layout(planner.evaluate(MEASURE), layout)
        check_toolbar_clear_of_titles(page, planner, f"the planner, {layout}")
        if layout == "file browser open":  # the whole planner in one picture: a window as tall as it
            page.set_viewport_size({"width": 1280, "height": 2400})
            wait_for_layout(page)
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            planner.screenshot(path=str(SCREENSHOT))
            page.set_viewport_size({"width": 1280, "height": 900})
    check_typed_size(page, planner)
    check_typed_gpus(page, planner)


def check_layout(found: dict, where: str) -> None:
    """Every readout, label and dropdown text whole and inside the planner; both charts inside it."""
    assert len(found["readouts"]) >= 13, f"{where}: the planner's sliders show no values ({found['readouts']})"
    assert not found["sliderReadouts"], f"{where}: a slider keeps ipywidgets' readout, which takes typed text silently"
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
    used = sum(chart["width"] for chart in found["charts"]) if found["charts"][0]["right"] <= \
        found["charts"][1]["left"] + 1 else min(chart["width"] for chart in found["charts"])   # side by side, or not
    assert used >= 0.9 * area["width"], f"{where}: the charts use {used:.0f} px of the {area['width']:.0f} px"
    assert "GPU memory 80 GB" in found["legend"][0], f"{where}: the GPU's memory is not in the legend"
    assert not any("GPU memory" in text for text in found["overBars"]), f"{where}: a label is written over the bars"


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


def check_typed_gpus(page: Page, planner) -> None:
    """The GPUs slider's box, typed as a student tries it: "1e3" (above 64), "-3" (below 1) and "seventy" are
    refused with the reason and the planner keeps 8 GPUs; "16" is taken, and the plan says 16x."""
    gpus = planner.locator(".widget-vbox").filter(has=page.locator(".widget-label", has_text="GPUs (data parallel)")
                                                  ).last
    gpus.scroll_into_view_if_needed()
    for typed, reason in (("1e3", "1e3 is 1000, above the most this slider takes, 64."),
                          ("-3", "-3 is below the least this slider takes, 1."),
                          ("seventy", "\"seventy\" is not a number")):
        shown = type_into(page, gpus, typed)
        assert reason in shown["note"] and "Still 8." in shown["note"], (typed, shown)
        assert shown["box"] == "8" and float(shown["value"]) == 8, f"typed {typed!r}, the planner left 8: {shown}"
        assert "of 8x" in planner.inner_text(), f"typed {typed!r}: the plan is no longer for 8 GPUs"
    shown = type_into(page, gpus, "16")
    assert shown["box"] == "16" and float(shown["value"]) == 16 and not shown["note"].strip(), shown
    page.wait_for_function("area => area.innerText.includes('of 16x')", arg=planner.element_handle(), timeout=15_000)
