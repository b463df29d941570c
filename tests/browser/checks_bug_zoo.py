"""Notebook 15's diagnosis widget as a student uses it at 1280 px: six cards, each with its drop-down whole (the
longest cause readable), a wrong answer told why not (what that cause would show), the right one confirmed, and
the count at the top kept as the answers change; with every card's feedback shown, no card scrolls sideways and
no feedback is double-spaced (every card had a scrollbar, 4 px too wide, and wrapped feedback read double)."""

from pathlib import Path

from playwright.sync_api import Page, expect
from settle import wait_for_layout
from widget_checks import check_widget_text

from labkit.exercises.bug_zoo import ANSWERS, CAUSES, DISTRACTORS

NOTEBOOK = "15_bug_zoo.ipynb"
SCREENSHOT = Path(__file__).resolve().parents[2] / "test-artifacts" / "screenshots" / "15_bug_zoo_widget.png"

DROPDOWN_FITS = """card => { const select = card.querySelector('select');
  const r = select.getBoundingClientRect(), area = card.closest('.jp-OutputArea-output').getBoundingClientRect();
  return {width: r.width, inside: r.left >= area.left - 1 && r.right <= area.right + 1,
          options: [...select.options].map(o => o.text.replaceAll('\\u00a0', ' '))}; }"""


def check(page: Page, cells: list[dict]) -> None:
    """Answer every card wrong, then right, reading the feedback and the count each time; then a screenshot."""
    cards = page.locator(".labkit-diagnosis")
    assert cards.count() == len(ANSWERS), f"notebook 15 shows {cards.count()} diagnosis cards, not {len(ANSWERS)}"
    score = page.locator(".jp-OutputArea-output").filter(has=cards.first).locator(".widget-html").first
    for i, (letter, answer) in enumerate(ANSWERS.items()):
        card = cards.nth(i)
        card.scroll_into_view_if_needed()
        found = card.evaluate(DROPDOWN_FITS)
        assert found["inside"] and found["width"] >= 400, f"run {letter}'s drop-down is cut or too narrow: {found}"
        assert CAUSES[answer].label in found["options"], f"run {letter} does not offer its cause: {found}"
        wrong = DISTRACTORS[letter][0]
        answer_with(card, found["options"].index(CAUSES[wrong].label))
        feedback = card.locator(".widget-html").last.inner_text()
        assert "Not this one" in feedback and CAUSES[wrong].shows[:40] in feedback, (letter, feedback)
        answer_with(card, found["options"].index(CAUSES[answer].label))
        feedback = card.locator(".widget-html").last.inner_text()
        assert "Right" in feedback, (letter, feedback)
        # the count is another widget: its new value comes in a message of its own, after the card's feedback
        expect(score).to_contain_text(f"{i + 1} of {len(ANSWERS)} runs diagnosed right", timeout=30_000)
    check_widget_text(page, "the bug zoo's cards, every one answered")
    page.set_viewport_size({"width": 1280, "height": 1800})
    wait_for_layout(page)
    cards.first.scroll_into_view_if_needed()
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    page.locator(".jp-OutputArea-output").filter(has=cards.first).screenshot(path=str(SCREENSHOT))
    page.set_viewport_size({"width": 1280, "height": 900})


def answer_with(card, index: int) -> None:
    """Choose option `index` in the card's drop-down (ipywidgets writes its spaces as no-break spaces) and press
    Check; wait for the feedback to change (the kernel computes it: 30 s, as for the score, on a loaded machine;
    10 s once ran out beside another notebook in CI)."""
    before = card.locator(".widget-html").last.inner_text()
    card.locator("select").select_option(index=index)
    card.locator("button", has_text="Check").click()
    card.page.wait_for_function("([node, before]) => node.innerText !== before",
                                arg=[card.locator(".widget-html").last.element_handle(), before], timeout=30_000)
