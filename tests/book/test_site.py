"""The course's website as a reader gets it: `make book`'s build served on loopback, every page opened in Chromium.

`make book-test` builds the site first (book/prepare.py executes every notebook at 2 ranks, then Sphinx); this test
reads that build (LABKIT_BOOK, default build/book) and fails, in CI, when there is none. Checked on every page:
no console error, every plotly figure of the executed notebook drawn (the executed notebook's own count, from
book/prepare.py's executed/ copy, not the page's), the ring's animation playing, every internal link and anchor
resolving, where and at which commit it ran; the site's size, printed, under SIZE_BUDGET_BYTES, and nothing in it
but what it serves. What must not be given away: test_nothing_given_away.py. Screenshots of three pages at 1280 px
go to test-artifacts/book/.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urljoin, urlparse

import pytest
from built_site import EXECUTED, NOTEBOOKS, ROOT, SITE, require_the_build, site_texts

PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
# Measured 2026-12-07 (make book in CI): 13.3 MiB, of which 10.9 MiB are the same for any course (plotly.js 4.6,
# the theme's scripts, styles, fonts and translations 6.3) and 2.4 MiB the 18 pages (the traced ring's animation
# the largest, 0.27 MiB). 20 MiB leaves room for some twenty notebooks more; past it, ask what grew (a figure with
# thousands of points, plotly.js embedded per figure, Sphinx's doctrees in the published folder: 3.2 MiB).
SIZE_BUDGET_BYTES = 20 * 2**20
SCREENSHOTS = ROOT / "test-artifacts" / "book"
SHOWN = ("index", "03_ring_allreduce", "06_pipeline_parallel")


@pytest.fixture(scope="module")
def site_url():
    """The built site, served on 127.0.0.1 by `python -m http.server` in a process of its own (a static host, as
    GitHub Pages is)."""
    require_the_build()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                               "--directory", str(SITE)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{url}/index.html", timeout=5).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"http.server did not serve {SITE} on port {port}") from None
                time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        server.wait(10)


def figures_in(notebook: dict) -> int:
    """The plotly figures the executed notebook shows: its cells' outputs, and those inside the widgets' Output
    areas (stored widget state) that are not hidden."""
    cells = sum(PLOTLY_MIME in o.get("data", {}) for c in notebook["cells"] for o in c.get("outputs", []))
    state = notebook.get("metadata", {}).get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    hidden = {key for key, m in state.items() if m["state"].get("display") == "none"}
    in_widgets = sum(PLOTLY_MIME in o.get("data", {}) for m in state.values()
                     if m["model_name"] == "OutputModel" and (m["state"].get("layout") or "")[10:] not in hidden
                     for o in m["state"].get("outputs", []))
    return cells + in_widgets


@pytest.mark.parametrize("name", ["index", *NOTEBOOKS])
def test_every_page_draws_its_figures_without_console_errors(site_url, page, name):
    errors = []
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.set_viewport_size({"width": 1280, "height": 900})
    # "load", not "networkidle": a page's figures are drawn by its scripts as the page is parsed, and the traced
    # ring's animation keeps the parser busy after the network has gone quiet (readyState still "loading")
    page.goto(f"{site_url}/{name}.html", wait_until="load")
    expected = 0 if name == "index" else figures_in(json.loads((EXECUTED / f"{name}.ipynb").read_text()))
    figures = page.locator(".plotly-graph-div")
    assert figures.count() == expected, (name, figures.count(), expected)
    if expected:  # every figure drawn: plotly.js puts its SVG into each div
        page.wait_for_function(f"document.querySelectorAll('.plotly-graph-div .main-svg').length >= {expected}",
                               timeout=30_000)
    assert not errors, (name, errors)
    if name in SHOWN:  # at the first figure, as a reader scrolls to it
        if expected:
            figures.first.scroll_into_view_if_needed()
            page.wait_for_timeout(500)
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / f"{name}.png"))


def test_the_ring_animation_plays(site_url, page):
    page.set_viewport_size({"width": 1280, "height": 900})
    page.goto(f"{site_url}/03_ring_allreduce.html", wait_until="load")
    animated = page.locator(".plotly-graph-div:has(.updatemenu-button)").first  # the figure with Play
    animated.scroll_into_view_if_needed()
    label = "div => div.querySelector('.slider-label').textContent"  # the slider names the frame shown
    before = animated.evaluate(label)
    animated.locator(".updatemenu-button").first.click()  # Play
    animated.element_handle().wait_for_element_state("stable")
    page.wait_for_function(f"([div, before]) => ({label})(div) !== before", arg=[animated.element_handle(), before],
                           timeout=30_000)
    assert animated.evaluate(label) != before


class _Links(HTMLParser):
    """A page's ids and its links' targets."""

    def __init__(self):
        super().__init__()
        self.ids, self.links = set(), []

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        if attributes.get("id"):
            self.ids.add(attributes["id"])
        if tag == "a" and attributes.get("href"):
            self.links.append(attributes["href"])


def parsed(path: Path) -> _Links:
    links = _Links()
    links.feed(path.read_text(encoding="utf-8"))
    return links


def test_every_internal_link_and_anchor_resolves():
    require_the_build()
    pages = {path.relative_to(SITE).as_posix(): parsed(path) for path in SITE.rglob("*.html")}
    broken = []
    for name, links in pages.items():
        for href in links.links:
            target = urlparse(urljoin(f"http://site/{name}", href))
            if target.netloc != "site":
                continue  # another site: the course's citations (PyTorch's docs, papers)
            path = unquote(target.path).lstrip("/") or "index.html"
            if not (SITE / path).exists():
                broken.append(f"{name}: {href} (no {path})")
            elif target.fragment and path in pages and target.fragment not in pages[path].ids:
                broken.append(f"{name}: {href} (no #{target.fragment} in {path})")
    assert not broken, "\n".join(broken)
    assert {f"{n}.html" for n in NOTEBOOKS} <= set(pages)


def test_each_page_says_where_and_at_which_commit_it_ran():
    require_the_build()
    texts = site_texts()
    for name in NOTEBOOKS:
        said = re.search(r"Executed for this site on (\d+) (\S+) ranks over (\w+): torch (\S+), .*?commit (\S+),",
                         texts[f"{name}.html"])
        assert said, name
        assert said.group(1) == "2" and said.group(5) not in ("", "unknown"), (name, said.groups())


def test_the_site_is_within_its_size_budget():
    require_the_build()
    nbytes = sum(path.stat().st_size for path in SITE.rglob("*") if path.is_file())
    largest = max((p for p in SITE.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    print(f"\nthe site: {nbytes / 2**20:.1f} MiB in {sum(1 for _ in SITE.rglob('*'))} files; the largest "
          f"{largest.relative_to(SITE)} ({largest.stat().st_size / 2**20:.1f} MiB)")
    assert nbytes < SIZE_BUDGET_BYTES, nbytes


def test_the_site_holds_only_what_it_serves():
    """No sources (_sources/), no Sphinx state (.doctrees/: pickles of every page), no stray files: a host
    publishes the whole folder, and none of it is checked for what must not be given away but what it serves."""
    require_the_build()
    served = (".html", ".js", ".css", ".json", ".txt", ".inv", ".map", ".png", ".svg", ".ico", ".woff", ".woff2",
              ".ttf", ".eot", ".gif", ".po", ".mo")  # .po, .mo: the theme's translations of its own labels
    stray = [p.relative_to(SITE).as_posix() for p in SITE.rglob("*") if p.is_file() and p.name != ".buildinfo"
             and (p.suffix not in served or any(part.startswith(".") for part in p.relative_to(SITE).parts))]
    assert not stray, stray
    assert not list(SITE.glob("_sources/*")), "the site must not copy its sources (they are the notebooks)"
