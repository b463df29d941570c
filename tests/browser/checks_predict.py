"""Notebook 03's predict-then-run widget, as a student meets it at 1280 px: after Run All it shows the comparison
with the default prediction folded (so a student can still predict first), inside the output area, with no
sideways scrolling; moving the slider and pressing the button shows the comparison for that prediction, open,
and pressing again with another prediction updates it."""

from playwright.sync_api import Page
from widget_checks import press_until_shown

NOTEBOOK = "03_ring_allreduce.ipynb"

STATE = """area => {
  const feedback = [...area.querySelectorAll('.widget-html-content')].pop();
  const outer = area.getBoundingClientRect();
  const sticksOut = [...area.querySelectorAll('.widget-html-content, .widget-slider, button')]
    .filter(e => e.getBoundingClientRect().right > outer.right + 1).map(e => e.textContent.slice(0, 40));
  return {text: feedback.textContent, folded: !!feedback.querySelector('details:not([open])'),
          scrolls: area.scrollWidth > area.clientWidth + 1, sticksOut};
}"""


def check(page: Page, cells: list[dict]) -> None:
    """The folded default comparison, then the slider moved to 2(N-1)/N (right) and to 2 (the typical guess)."""
    widget = page.locator(".jp-OutputArea-output").filter(has_text="Predict first.")
    assert widget.count() == 1, "notebook 03 shows one predict-then-run widget"
    widget = widget.first
    widget.scroll_into_view_if_needed()
    state = widget.evaluate(STATE)
    assert state["folded"] and "prediction set then: 6 x S" in state["text"], \
        f"after Run All the default comparison is not shown folded: {state['text'][:200]!r}"
    assert not state["scrolls"] and not state["sticksOut"], f"the widget is wider than the column: {state}"
    handle, button = widget.locator(".widget-slider .noUi-handle").first, widget.locator("button").first
    for presses, key, value, expected in ((36, "ArrowLeft", 1.5, "Right"), (4, "ArrowRight", 2, "2 x S is the limit")):
        for _ in range(presses):  # one step of 0.125 x S each: 2(N-1) = 6 -> 1.5, then 1.5 -> 2
            handle.press(key)
        assert float(handle.get_attribute("aria-valuenow")) == value, "the slider did not take every key press"
        press_until_shown(page, widget, button, expected)
        state = widget.evaluate(STATE)
        assert not state["folded"], "a pressed comparison is folded away"
