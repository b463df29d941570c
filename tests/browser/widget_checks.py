"""What the checks of labkit's widgets share: no widget scrolling sideways or double-spaced, plotly's toolbar clear
of a chart's title, and typing into a TypedSlider's box (labkit.widgets.typed)."""

from playwright.sync_api import Locator, Page, TimeoutError

WIDGETS_SCROLLING = """() => [...document.querySelectorAll('.jp-OutputArea-output .widget-box')]
  .filter(e => e.scrollWidth > e.clientWidth + 1 && getComputedStyle(e).overflowX !== 'visible')
  .map(e => `${e.className}: ${e.scrollWidth - e.clientWidth} px wider than its box: ${e.innerText.slice(0, 80)}`)"""

DOUBLE_SPACED = """() => [...document.querySelectorAll('.jp-OutputArea-output .widget-html-content, '
                                         + '.jp-OutputArea-output .widget-html-content *')]
  .filter(e => [...e.childNodes].some(n => n.nodeType === Node.TEXT_NODE && n.textContent.trim()))
  .filter(e => { const s = getComputedStyle(e), range = document.createRange();
                 range.selectNodeContents(e);
                 const lines = new Set([...range.getClientRects()].map(r => Math.round(r.top))).size;
                 return lines > 1 && parseFloat(s.lineHeight) > 1.7 * parseFloat(s.fontSize); })
  .map(e => `line height ${getComputedStyle(e).lineHeight} at ${getComputedStyle(e).fontSize}: `
            + e.innerText.slice(0, 80))"""


def check_widget_text(page: Page, where: str) -> None:
    """No widget box scrolls sideways (a part 100% wide plus its 2 px margins sticks out by 4 px) and no wrapped
    widget text is double-spaced (text in an ipywidgets HTML inherits the controls' 28 px line height)."""
    scrolling = page.evaluate(WIDGETS_SCROLLING)
    assert not scrolling, f"{where}: {len(scrolling)} widgets scroll sideways: {scrolling[:3]}"
    spaced = page.evaluate(DOUBLE_SPACED)
    assert not spaced, f"{where}: {len(spaced)} widget texts are double-spaced: {spaced[:3]}"


TOOLBAR_AND_TITLE = """plot => { const box = e => { const r = e.getBoundingClientRect();
                                         return {left: r.left, right: r.right, top: r.top, bottom: r.bottom}; };
  const bar = plot.querySelector('.modebar'), title = plot.querySelector('.gtitle');
  return {toolbar: bar && getComputedStyle(bar).opacity !== '0' ? box(bar) : null,
          title: title ? box(title) : null, text: title ? title.textContent : ''}; }"""


def check_toolbar_clear_of_titles(page: Page, area: Locator, where: str) -> None:
    """Hover each chart in `area` (plotly shows its toolbar then): the toolbar's box and the title's do not
    overlap. (A narrow chart's title ran under the toolbar, which hid its end.)"""
    plots = area.locator(".js-plotly-plot")
    assert plots.count(), f"{where}: no chart"
    for i in range(plots.count()):
        plot = plots.nth(i)
        plot.scroll_into_view_if_needed()
        plot.locator(".nsewdrag").first.hover()
        page.wait_for_timeout(400)
        found = plot.evaluate(TOOLBAR_AND_TITLE)
        assert found["toolbar"] and found["title"], f"{where}: chart {i} shows no toolbar or no title: {found}"
        bar, title = found["toolbar"], found["title"]
        overlap = min(bar["right"], title["right"]) > max(bar["left"], title["left"]) and \
            min(bar["bottom"], title["bottom"]) > max(bar["top"], title["top"])
        assert not overlap, f"{where}: the toolbar covers the title {found['text']!r} of chart {i}: {found}"


def type_into(page: Page, control: Locator, text: str) -> dict:
    """Type `text` into a TypedSlider's box and press Enter; once the kernel has answered (the box shows another
    text, refused, or the slider stands at the typed value, taken): its box, its refusal line, its slider's value."""
    field = control.locator(".widget-text input")
    field.fill(text)
    field.press("Enter")
    page.wait_for_function("""([c, typed]) => c.querySelector('.widget-text input').value !== typed
                              || parseFloat(c.querySelector('.noUi-handle').getAttribute('aria-valuenow'))
                                 === parseFloat(typed)""", arg=[control.element_handle(), text], timeout=10_000)
    page.wait_for_timeout(300)
    return control.evaluate("""c => ({box: c.querySelector('.widget-text input').value,
                                      note: [...c.querySelectorAll('.widget-html')].filter(e => e.offsetParent)
                                              .map(e => e.innerText).join(' '),
                                      value: c.querySelector('.noUi-handle').getAttribute('aria-valuenow')})""")


def press_until_shown(page: Page, widget: Locator, button: Locator, expected: str, presses: int = 4) -> None:
    """Press the button until the comparison includes `expected`. Why more than once: ipywidgets sends a model's
    state one message at a time and buffers later changes until the kernel has answered the last one, while a
    button's click is a custom message sent at once (WidgetModel.sync and .send in @jupyter-widgets/base 8), so
    with a busy kernel the click can overtake the slider's last value and the kernel compares an earlier
    prediction (CI: one timeout in 17 notebooks at two at a time). A later press finds the last value there."""
    for press in range(1, presses + 1):
        button.click()
        try:
            page.wait_for_function("([area, text]) => area.textContent.includes(text)",
                                   arg=[widget.element_handle(), expected], timeout=30_000)
            return
        except TimeoutError:
            if press == presses:
                raise AssertionError(f"{presses} presses, and the comparison never showed {expected!r}: "
                                     f"{widget.inner_text()[-300:]!r}") from None
