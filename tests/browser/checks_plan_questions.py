"""Notebook 08's first predict-then-run question, answered as a student does: a prediction typed into the slider's
box ("4", the speedup), then the button. The verdict reads as English, naming where the number comes from: "4.00x
is what theory gives (labkit.plan: 4.04x)". (It once said "4.00x is what was labkit.plan.")"""

from playwright.sync_api import Page
from widget_checks import press_until_shown, type_into

NOTEBOOK = "08_worked_example_7b.ipynb"


def check(page: Page, cells: list[dict]) -> None:
    widget = page.locator(".jp-OutputArea-output").filter(has_text="Predict first.").filter(
        has_text="the speedup over one GPU?")
    assert widget.count() == 1, "notebook 08 asks for the speedup in one predict-then-run widget"
    widget = widget.first
    widget.scroll_into_view_if_needed()
    control = widget.locator(".widget-vbox").filter(has=page.locator(".widget-text input")).last
    shown = type_into(page, control, "4")
    assert shown["box"] == "4.00" and float(shown["value"]) == 4, f"the typed prediction was not taken: {shown}"
    press_until_shown(page, widget, widget.locator("button", has_text="Run the experiment"), "Right")
    text = widget.inner_text()
    assert "4.00x is what theory gives (labkit.plan: 4.04x)." in text, text[-400:]
    assert "what was labkit.plan" not in text
