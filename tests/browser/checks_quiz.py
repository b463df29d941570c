"""Notebook 16 (the review) as a student sees it: every quiz option a row of its own with a button to pick it.

At 1280 px, with the file browser open and again with it collapsed (and at 900 px with it open, where long
options wrap), for every question of the quiz: each option shows its whole text beside a letter button that is
visible and on top (nothing drawn over it), no two option rows overlap, and no option's text overflows its row.
(ipywidgets' RadioButtons drew long options over the next one, without their radio button: the right answer gave
itself away.) Every question answered (option A, right or wrong), no question scrolls sideways and no feedback is
double-spaced (each had a scrollbar, 4 px too wide, and wrapped feedback read double). Notebook 10's
monitored_barrier demo, once in the same notebook, is checked by checks_barrier.py.
"""

from playwright.sync_api import Page
from settle import wait_for_layout
from widget_checks import check_widget_text

from labkit.exercises import load_questions

NOTEBOOK = "16_review.ipynb"

OPTION_ROWS = """() => {
  const rows = [...document.querySelectorAll('.jp-Notebook .labkit-quiz-option')];
  const boxes = rows.map(row => { const r = row.getBoundingClientRect();  // all measured at one scroll position
                                  return {left: r.left, top: r.top, right: r.right, bottom: r.bottom}; });
  return rows.map((row, i) => {
    const button = row.querySelector('button');
    const text = row.querySelector('.widget-html-content');
    let onTop = false, shown = false;
    if (button) {
      button.scrollIntoView({block: 'center'});
      const r = button.getBoundingClientRect(), style = getComputedStyle(button);
      shown = r.width > 0 && r.height > 0 && style.visibility === 'visible' && style.display !== 'none'
              && Number(style.opacity) > 0;
      const hit = document.elementFromPoint(r.left + r.width / 2, r.top + r.height / 2);
      onTop = hit !== null && button.contains(hit);
    }
    const overflows = [row, text, text && text.parentElement].filter(e => e && (
      e.scrollWidth > e.clientWidth + 1 || e.scrollHeight > e.clientHeight + 1)).map(e => e.className);
    return {row: boxes[i], button: Boolean(button), shown, onTop, overflows,
            text: text ? text.innerText.trim() : ''};
  });
}"""

def check(page: Page, cells: list[dict]) -> None:
    """The quiz's options at 1280 px with the file browser open, then collapsed, then open at 900 px (long
    options wrap there)."""
    expected = [option.text for question in load_questions() for option in question.options]
    for width, sidebar in ((1280, "open"), (1280, "collapsed"), (900, "open")):
        page.set_viewport_size({"width": width, "height": 900})
        command = ("window.jupyterapp.shell.activateById('filebrowser')" if sidebar == "open"
                   else "window.jupyterapp.shell.collapseLeft()")
        page.evaluate(f"() => {command}")
        wait_for_layout(page)
        check_options(page.evaluate(OPTION_ROWS), expected, f"{width} px, file browser {sidebar}")
    page.set_viewport_size({"width": 1280, "height": 900})
    answer_every_question(page)
    check_widget_text(page, "the quiz, every question answered")


def answer_every_question(page: Page) -> None:
    """Pick option A of every question and press its Check: each then shows its feedback."""
    questions = page.locator(".jp-Notebook .labkit-quiz-question")
    for i in range(questions.count()):
        card = questions.nth(i).locator("xpath=..")  # the question's card: its header, options, Check, feedback
        card.locator(".labkit-quiz-option button").first.click()
        card.locator("button", has_text="Check").click()
    page.wait_for_function("() => [...document.querySelectorAll('.jp-Notebook .widget-html-content')]"
                           ".filter(e => /Correct|Not quite/.test(e.innerText)).length >= "
                           f"{questions.count()}", timeout=15_000)


def check_options(rows: list[dict], expected: list[str], where: str) -> None:
    """Every option in order, whole, beside a visible button on top; rows apart; no text past its row."""
    assert [row["text"] for row in rows] == expected, f"{where}: the option rows do not show the options' texts"
    for number, row in enumerate(rows):
        name = f"{where}, question {number // 4 + 1} option {'ABCD'[number % 4]}"
        assert row["button"] and row["shown"], f"{name}: no visible button to pick it"
        assert row["onTop"], f"{name}: something is drawn over its button"
        assert not row["overflows"], f"{name}: its text overflows ({row['overflows']})"
    boxes = [row["row"] for row in rows]
    for i, a in enumerate(boxes):
        for j in range(i + 1, len(boxes)):
            b = boxes[j]
            overlap = (min(a["right"], b["right"]) - max(a["left"], b["left"]) > 0.5
                       and min(a["bottom"], b["bottom"]) - max(a["top"], b["top"]) > 0.5)
            assert not overlap, f"{where}: option rows {i} and {j} overlap: {a} {b}"
