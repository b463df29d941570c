"""Every citation points at something a reader has: a paper, PyTorch's docs, or a file in this repository."""

import json
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRACKED = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
SOURCES = [p for p in TRACKED if p.startswith(("labkit/", "notebooks/", "benchmarks/")) or p == "README.md"]
# A Markdown link to a file of the repository (not a web address or an anchor).
LOCAL_LINK = re.compile(r"\]\((?!https?:|#|mailto:)([^)\s]+?)(?:#[^)]*)?\)")


def text(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


@pytest.mark.parametrize("path", SOURCES)
def test_no_citation_of_files_outside_the_repository(path):
    content = text(path)
    assert "REFERENCE.md" not in content, f"{path} cites REFERENCE.md, which is not in the repository"
    assert "../shared" not in content, f"{path} points at ../shared, which users do not have"


@pytest.mark.parametrize("path", [p for p in SOURCES if p.endswith((".md", ".ipynb"))])
def test_every_local_link_resolves(path):
    folder = os.path.dirname(os.path.join(ROOT, path))
    prose = text(path)
    if path.endswith(".ipynb"):
        prose = "\n".join("".join(c["source"]) for c in json.loads(prose)["cells"] if c["cell_type"] == "markdown")
    missing = [link for link in LOCAL_LINK.findall(prose) if not os.path.exists(os.path.join(folder, link))]
    assert not missing, f"{path} links to files the repository does not have: {missing}"
