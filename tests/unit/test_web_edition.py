"""The web edition of a notebook (book/web_edition.py) and the site's landing page (book/landing.py), on small
notebooks made here and on the course's own: what is withheld, how figures and widgets are drawn, where it ran."""

import copy
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "book"))
sys.path.insert(0, str(ROOT / "tests" / "notebooks"))
from landing import landing_page, section  # noqa: E402 - book/ is a folder of scripts
from solutions import is_solution, solution_code  # noqa: E402
from web_edition import LIVE_NOTE, PLOTLY_MIME, WIDGET_MIME, WITHHELD_TAGS, web_notebook, widget_html  # noqa: E402

FIGURE = {"data": [{"type": "bar", "y": [1, 2, 3]}], "layout": {"title": {"text": "bytes per rank"}}}
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def cell(kind: str, source: str, tags=(), outputs=None) -> dict:
    made = {"cell_type": kind, "id": f"c{abs(hash(source)) % 10**8}", "metadata": {"tags": list(tags)},
            "source": source}
    if kind == "code":
        made |= {"outputs": outputs or [], "execution_count": 1}
    return made


def notebook(*cells, widgets=None) -> dict:
    made = {"cells": list(cells), "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    if widgets is not None:
        made["metadata"]["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": widgets}}
    return made


def model(name: str, **state) -> dict:
    return {"model_name": name, "state": {"_model_name": name, **state}}


def display(data: dict) -> dict:
    return {"output_type": "display_data", "data": data, "metadata": {}}


def text_of(web: dict) -> str:
    return json.dumps(web)


def test_solutions_and_answer_keys_are_replaced_by_a_line_saying_where_they_are():
    secret = "dist.all_reduce(p.grad); p.grad /= n  # the secret line"
    original = notebook(cell("markdown", "# 01 · Title"), cell("code", "check(my_fn)  # the stub"),
                        cell("markdown", f"<details><summary>Reference solution</summary>\n\n```python\n{secret}\n"
                                         "```\n</details>", tags=["solution"]),
                        cell("markdown", "* NCCL communicates, Triton serves.", tags=["answer-key"]))
    web = web_notebook(original, "*ran here*")
    assert "the secret line" not in text_of(web) and "Triton serves" not in text_of(web)
    assert "check(my_fn)  # the stub" in text_of(web)
    sources = [c["source"] for c in web["cells"]]
    assert f"*{WITHHELD_TAGS['solution']}*" in sources and f"*{WITHHELD_TAGS['answer-key']}*" in sources
    assert original["cells"][2]["source"].endswith("</details>")  # the executed notebook itself is untouched


def test_a_key_within_a_sentence_is_withheld_and_the_sentence_kept():
    web = web_notebook(notebook(cell("markdown", 'In one clause each: <span class="answer-key">NCCL communicates,\n'
                                                 'Triton serves.</span> Then more.')), "*p*")
    assert web["cells"][0]["source"] == "In one clause each: *(an exercise's key: withheld on the web, in the " \
                                        "notebook)* Then more."


@pytest.mark.parametrize("name", ["03_ring_allreduce", "10_nccl_and_debugging", "16_review"])
def test_the_stack_maps_key_is_withheld_wherever_the_course_states_it(name):
    original = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())
    assert "TensorRT-LLM optimizes" in text_of(original)
    assert "TensorRT-LLM optimizes" not in text_of(web_notebook(original, "*p*"))


def test_where_it_ran_goes_under_the_title():
    web = web_notebook(notebook(cell("code", "x = 1"), cell("markdown", "# 03 · Title"), cell("markdown", "text")),
                       "*2 CPU ranks, gloo, commit abc123*")
    assert [c["source"] for c in web["cells"]][:3] == ["x = 1", "# 03 · Title", "*2 CPU ranks, gloo, commit abc123*"]


def test_a_plotly_figure_becomes_its_div_and_newplot_call_without_plotly_js():
    web = web_notebook(notebook(cell("markdown", "# t"), cell("code", "fig", outputs=[display({PLOTLY_MIME: FIGURE})])),
                       "*p*")
    data = web["cells"][2]["outputs"][0]["data"]
    assert list(data) == ["text/html"]
    assert 'class="plotly-graph-div"' in data["text/html"] and "Plotly.newPlot" in data["text/html"]
    assert "bytes per rank" in data["text/html"]
    assert len(data["text/html"]) < 20_000  # plotly.js (4.8 MB) is the site's, loaded once, not the figure's


def test_papermills_injected_parameters_are_folded_into_the_parameters_cell():
    web = web_notebook(notebook(cell("markdown", "# t"),
                                cell("code", "world_size = 4  # ranks", tags=["parameters"]),
                                cell("code", "# Parameters\nworld_size = 2\n", tags=["injected-parameters"])), "*p*")
    code = [c["source"] for c in web["cells"] if c["cell_type"] == "code"]
    assert code == ["world_size = 2  # as this site ran it; the notebook's own cell:\n# world_size = 4  # ranks"]


def stream(text: str) -> dict:
    return {"output_type": "stream", "name": "stdout", "text": text}


def test_outputs_read_as_printed_and_the_builds_own_paths_as_a_readers():
    stale = display({"text/html": "<div class='labkit-stale-note'>This output is from an earlier session</div>"})
    outputs = [stream("\rbar:  50%|##  |"), stream("\rbar: 100%|####|\n"), stream("done\n"), stale,
               display({"text/markdown": "kept in /build/progress.json"})]
    web = web_notebook(notebook(cell("markdown", "# t"), cell("code", "run()", outputs=outputs)), "*p*",
                       {"/build/progress.json": "~/.labkit/progress.json"})
    shown = web["cells"][2]["outputs"]
    assert shown[0]["text"] == "bar: 100%|####|\ndone\n"  # one stream, each rewritten line as it was left
    assert len(shown) == 2 and "earlier session" not in text_of(shown)  # no kernel stopped here: none ran it
    assert shown[1]["data"]["text/markdown"] == "kept in ~/.labkit/progress.json"


def test_the_line_before_a_solution_goes_with_it():
    intro = cell("markdown", "The course's reference solution, folded: open it only after trying.")
    web = web_notebook(notebook(cell("markdown", "# t"), intro, cell("markdown", "secret", tags=["solution"]),
                                cell("markdown", "after")), "*p*")
    assert "open it only after trying" not in text_of(web) and "secret" not in text_of(web)
    assert [c["source"] for c in web["cells"]][-1] == "after"


WIDGETS = {
    "box": model("VBoxModel", children=["IPY_MODEL_html", "IPY_MODEL_row", "IPY_MODEL_hidden", "IPY_MODEL_out"]),
    "html": model("HTMLModel", value="<b>Predict first.</b>", description=""),
    "row": model("HBoxModel", children=["IPY_MODEL_slider", "IPY_MODEL_choice", "IPY_MODEL_button"]),
    "slider": model("IntSliderModel", value=4, description="ranks p"),
    "choice": model("DropdownModel", _options_labels=["gloo", "nccl"], index=1, description="backend"),
    "button": model("ButtonModel", description="Run the experiment"),
    "hidden": model("HTMLModel", value="the verdict, shown after Check", layout="IPY_MODEL_gone"),
    "gone": model("LayoutModel", display="none"),
    "out": model("OutputModel", outputs=[display({PLOTLY_MIME: FIGURE}),
                                         {"output_type": "stream", "name": "stdout", "text": "5 < 7"}]),
}


def test_a_widget_shows_its_last_state_under_the_line_that_it_is_live_in_jupyterlab():
    shown = widget_html("box", WIDGETS)
    assert shown.index(LIVE_NOTE) < shown.index("<b>Predict first.</b>")
    assert 'type="range" disabled value="4"' in shown and "ranks p" in shown
    assert re.search(r"<option selected>nccl</option>", shown) and "<button disabled>Run the experiment" in shown
    assert "the verdict, shown after Check" not in shown  # hidden in the notebook, hidden here
    assert "Plotly.newPlot" in shown and "5 &lt; 7" in shown  # an Output widget's figure and text


def test_a_widget_output_becomes_static_html_and_the_state_leaves_the_notebook():
    view = display({WIDGET_MIME: {"model_id": "box", "version_major": 2, "version_minor": 0}, "text/plain": "VBox()"})
    web = web_notebook(notebook(cell("markdown", "# t"), cell("code", "widget", outputs=[view]), widgets=WIDGETS),
                       "*p*")
    assert "widgets" not in web["metadata"]  # no widget JavaScript: nothing for it to render, offline
    assert list(web["cells"][2]["outputs"][0]["data"]) == ["text/html"]
    missing = web_notebook(notebook(cell("code", "w", outputs=[view])), "*p*")
    assert "did not keep" in missing["cells"][1]["outputs"][0]["data"]["text/html"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_reference_solution_of_the_course_survives_its_web_edition(path):
    original = json.loads(path.read_text())
    solutions = [solution_code(c) for c in original["cells"] if is_solution(c)]
    web = text_of(web_notebook(copy.deepcopy(original), "*p*"))
    for code in solutions:
        stub_text = text_of([c for c in original["cells"] if not is_solution(c)])
        own_lines = [line.strip() for line in code.splitlines()
                     if len(line.strip()) > 20 and json.dumps(line.strip())[1:-1] not in stub_text]
        assert own_lines, code  # a solution with lines of its own, which the web edition must not hold
        assert not [line for line in own_lines if json.dumps(line)[1:-1] in web], path.name


README = """# The Lab

What it is.

## Start

Some text.

```bash
make lab     # open the course
# then, in another terminal:
make test    # check everything
```

## The course

| notebook | the question it answers |
| --- | --- |
| `00_setup` | Can this machine run a distributed job? |
| `01_training_step` | Why AllReduce? |

**Learning path.** In order.

### You build it: the graded exercises

Not on the landing page.

## Running code on N ranks
"""


def test_the_landing_page_is_the_readmes_course_map_with_links_and_its_two_commands():
    page = landing_page(README, ["00_setup", "01_training_step"], "ran on 2 CPU ranks")
    assert page.startswith("# The Lab\n\nWhat it is.")
    assert "| [`00_setup`](00_setup.ipynb) | Can this machine" in page and "[`01_training_step`]" in page
    assert "**Learning path.** In order." in page and "Not on the landing page" not in page
    assert "make lab     # open the course\n# then, in another terminal:\nmake test" in page
    assert "ran on 2 CPU ranks" in page
    assert page.rstrip().endswith("00_setup\n01_training_step\n```")  # the toctree, in course order


def test_the_landing_page_says_which_readme_heading_it_lacks():
    with pytest.raises(ValueError, match="no '## The course' heading"):
        landing_page(README.replace("## The course", "## Course"), ["00_setup"], "p")
    assert section(README, "## Start").endswith("```")  # a "# comment" in a code block is no heading
