"""Every notebook is shaped like a lesson and committed clean. (nbval runs them: `make notebooks`.)"""

import glob
import json
import os
import re

import pytest

NOTEBOOKS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "notebooks", "*.ipynb")))


def load(path):
    with open(path) as f:
        return json.load(f)


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_opens_with_a_question_and_ends_with_takeaways_and_questions(path):
    cells = load(path)["cells"]
    first = "".join(cells[0]["source"])
    assert cells[0]["cell_type"] == "markdown" and first.startswith("# ")
    assert "**The question.**" in first
    last = "".join(cells[-1]["source"])
    assert "## Takeaways" in last and "## Check yourself" in last


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_uses_the_labkit_kernel_and_has_no_outputs(path):
    notebook = load(path)
    assert notebook["metadata"]["kernelspec"]["name"] == "labkit"
    code = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    assert all(not c["outputs"] and c["execution_count"] is None for c in code)
    assert any("assert " in "".join(c["source"]) for c in code), "claims are checked by code"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_ends_with_a_link_to_a_notebook_that_exists(path):
    last = "".join(load(path)["cells"][-1]["source"])
    links = re.findall(r"\]\((\d\d_[a-z0-9_]+\.ipynb)\)", last.split("## Check yourself")[-1])
    assert links, "the last cell links to the next notebook"
    assert all(os.path.exists(os.path.join(os.path.dirname(path), link)) for link in links)
