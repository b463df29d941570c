"""Notebook 06 as a student sees it: the first figure shows what its title says, and the widgets' labels are whole.

The naive pipeline's timeline is the first figure of the notebook; its title names the emulated forward and
backward times, and every bar must last that long, within 25 % (a fresh kernel's first backward once took
370-650 ms where 40 ms was stated). Read from the plotly JSON the cell put out. The p/m widget's and the
"what is running out?" widget's labels ("micro-batches m" was cut) are checked on the page.
"""

import base64
import re

import numpy as np
from playwright.sync_api import Page

NOTEBOOK = "06_pipeline_parallel.ipynb"
PLOTLY = "application/vnd.plotly.v1+json"
TOLERANCE = 0.25

CUT_LABELS = """() => [...document.querySelectorAll('.jp-OutputArea-output .widget-label')]
  .filter(e => e.textContent && e.scrollWidth > e.clientWidth + 1).map(e => e.textContent)"""


def numbers(values) -> list[float]:
    """A plotly JSON array: a list, or (plotly >= 6) a base64 typed array {"dtype": ..., "bdata": ...}."""
    if isinstance(values, dict):
        return np.frombuffer(base64.b64decode(values["bdata"]), dtype=values["dtype"]).tolist()
    return list(values)


def check(page: Page, cells: list[dict]) -> None:
    figures = [o["data"][PLOTLY] for cell in cells for o in cell["outputs"] if PLOTLY in o.get("data", {})]
    assert figures, "notebook 06 shows no plotly figure"
    first = figures[0]
    title = first["layout"]["title"]
    title = title["text"] if isinstance(title, dict) else title
    stated = re.search(r"forward (\d+) ms, backward (\d+) ms", title)
    assert stated, f"the first figure's title does not state its emulated times: {title!r}"
    emulated_ms = {"forward": float(stated[1]), "backward": float(stated[2])}
    bars = {trace["name"]: numbers(trace["x"]) for trace in first["data"]}
    for name, ms in emulated_ms.items():
        assert bars.get(name), f"the first figure has no {name} bars"
        off = [round(x, 1) for x in bars[name] if not ms <= x <= (1 + TOLERANCE) * ms]
        assert not off, f"the title says {name} {ms:g} ms, but {name} bars last {off} ms"
    cut = page.evaluate(CUT_LABELS)
    assert not cut, f"widget labels cut off: {cut}"
