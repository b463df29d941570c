"""The built website, as the tests in tests/book read it: where it is, and its files as a reader's text."""

from __future__ import annotations

import html
import json
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BOOK = Path(os.environ.get("LABKIT_BOOK", ROOT / "build" / "book"))
SITE, EXECUTED, SOURCES = BOOK / "html", BOOK / "executed", BOOK / "src"
NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
TEXT_SUFFIXES = (".html", ".js", ".json", ".txt", ".ipynb", ".md", ".inv", ".css", ".map")


def require_the_build() -> None:
    """Skip without a build (fail in CI, where make book-test builds it first)."""
    if not (SITE / "index.html").is_file():
        message = f"no site at {SITE}: run `make book` first (make book-test does)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def course_notebook(name: str) -> dict:
    return json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text(encoding="utf-8"))


def reader_text(page_html: str, *, choices: bool = True) -> str:
    """A page as the text a reader sees, whitespace collapsed; without the options of its drop-downs when
    `choices` is False (a list of every cause, or every role, is a question, not its answer)."""
    if not choices:
        page_html = re.sub(r"<select\b.*?</select>", " ", page_html, flags=re.DOTALL)
    inline = re.sub(r"</?(?:span|code|a|em|strong|b|i|kbd|sub|sup)\b[^>]*>", "", page_html)  # Pygments' code spans
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", inline)).split())


def site_texts(*, choices: bool = True) -> dict[str, str]:
    """Every text file of the site (pages, scripts, styles, the search index) by its path; pages as reader_text."""
    texts = {}
    for path in SITE.rglob("*"):
        if path.is_file() and path.suffix in TEXT_SUFFIXES:
            text = path.read_text(encoding="utf-8", errors="replace")
            text = reader_text(text, choices=choices) if path.suffix == ".html" else " ".join(text.split())
            texts[path.relative_to(SITE).as_posix()] = text
    return texts
