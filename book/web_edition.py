"""The web edition of an executed notebook: what a reader sees before installing anything, and nothing more.

`web_notebook` takes a notebook as papermill executed it (nbformat's JSON as a dict) and returns the one the site is
built from:
- **Nothing given away.** Cells tagged `solution` (the folded reference solutions, tests/notebooks/solutions.py) and
  `answer-key` (a key an exercise checks against, e.g. notebook 10's stack map) are replaced by a line saying where
  to find them: in the notebook, in JupyterLab; so is a key stated within a sentence, marked
  `<span class="answer-key">...</span>` (the stack map, taught in notebook 03 and restated in 16). Stubs, hints and
  the graders' verdicts on the stubs stay.
- **Figures stay interactive.** Each plotly figure (JupyterLab's `application/vnd.plotly.v1+json` output, in a cell
  or inside a widget) becomes the `<div>` and `Plotly.newPlot` call plotly.io.to_html writes, without plotly.js:
  the site loads plotly.js once (book/conf.py), not once per figure. Animations wait for their Play button.
- **Widgets show their last state.** A widget needs a kernel; the notebook keeps its last state (nbclient stores
  it), drawn here as static HTML (labels, values, texts, figures, disabled controls) under a line saying that it is
  live in JupyterLab. Without the kernel's JavaScript (ipywidgets' html-manager, a CDN download) the page works
  offline.
- **Where it ran.** A line under the title: on which machine, at which commit, so timings read as a laptop's.
"""

from __future__ import annotations

import copy
import html
import json
import re

import plotly.io as pio
from markdown_it import MarkdownIt

__all__ = ["LIVE_NOTE", "PLOTLY_MIME", "WIDGET_MIME", "WITHHELD_TAGS", "figure_html", "read", "web_notebook",
           "widget_html"]

PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
WITHHELD_TAGS = {"solution": "The reference solution of the exercise above is in the notebook, folded, not on the web: "
                             "try it yourself first, in JupyterLab (`make lab`).",
                 "answer-key": "Withheld on the web: what follows here gives away an exercise's answer (its key, or "
                               "which cause is whose). It is in the notebook: check your answers in JupyterLab (`make "
                               "lab`), then read it there."}
KEY_IN_A_SENTENCE = re.compile(r'<span class="answer-key">.*?</span>', re.DOTALL)
KEY_WITHHELD = "*(an exercise's key: withheld on the web, in the notebook)*"
LIVE_NOTE = ("<p class=\"labkit-live\"><b>Live in JupyterLab.</b> This widget needs a running kernel: shown here as "
             "the notebook left it. Run the course yourself (<code>make lab</code>) to use it.</p>")
FOLD_CHARACTERS = 40_000  # a widget's snapshot longer than this is folded under a summary
STALE_NOTE_CLASS = "labkit-stale-note"  # labkit/widgets/app.py's note that a widget's kernel has stopped: not here
FIGURE_CONFIG = {"displaylogo": False, "responsive": True}  # as labkit.widgets.figure_slot draws them in JupyterLab
_MARKDOWN = MarkdownIt("commonmark", {"html": True}).enable("table")


def _text(value) -> str:
    """nbformat's multiline strings: a string, or a list of lines."""
    return value if isinstance(value, str) else "".join(value)


def figure_html(figure: dict) -> str:
    """One plotly figure (its JSON, as the plotly mime output holds it) as a <div> and its newPlot script. A figure
    wider than the page's column (notebook 05's 880 px matrices) scrolls sideways in it (labkit-book.css)."""
    return pio.to_html(figure, include_plotlyjs=False, full_html=False, auto_play=False, config=FIGURE_CONFIG,
                       validate=False)


def _output_html(output: dict, state: dict) -> str:
    """A cell's or an Output widget's output as static HTML (a figure, a widget, HTML, Markdown, text)."""
    if output.get("output_type") == "stream":
        return f"<pre class=\"labkit-stream\">{html.escape(_as_printed(_text(output.get('text', ''))))}</pre>"
    if output.get("output_type") == "error":
        return f"<pre class=\"labkit-error\">{html.escape(output.get('ename', ''))}: " \
               f"{html.escape(output.get('evalue', ''))}</pre>"
    data = output.get("data", {})
    if PLOTLY_MIME in data:
        return figure_html(data[PLOTLY_MIME])
    if WIDGET_MIME in data:
        return _widget(data[WIDGET_MIME]["model_id"], state)
    if "text/html" in data:
        return _text(data["text/html"])
    if "text/markdown" in data:
        return _MARKDOWN.render(_text(data["text/markdown"]))
    return f"<pre>{html.escape(_text(data.get('text/plain', '')))}</pre>"


def _model(reference: str, state: dict) -> dict | None:
    """The state of the widget `reference` names ("IPY_MODEL_<id>" or the id), or None if the notebook lacks it."""
    model = state.get(reference.removeprefix("IPY_MODEL_"))
    return model["state"] if model else None


def _hidden(model: dict, state: dict) -> bool:
    """Whether the widget's layout hides it (display: none, visibility: hidden): hidden on the page too."""
    layout = _model(model.get("layout") or "", state) or {}
    return layout.get("display") == "none" or layout.get("visibility") == "hidden"


def _control(model: dict, body: str) -> str:
    """A control with its description before it, as ipywidgets lays it out."""
    label = f"<span class=\"labkit-label\">{html.escape(model.get('description') or '')}</span> " \
        if model.get("description") else ""
    return f"<div class=\"labkit-control\">{label}{body}</div>"


def _options(model: dict) -> str:
    """A selection widget's options, the chosen one marked."""
    chosen = model.get("index")
    labels = model.get("_options_labels") or []
    items = "".join(f"<option{' selected' if i == chosen else ''}>{html.escape(str(label))}</option>"
                    for i, label in enumerate(labels))
    return f"<select disabled>{items}</select>"


def _widget(model_id: str, state: dict) -> str:
    """The widget `model_id` and its children as static HTML, from the notebook's stored widget state."""
    model = _model(model_id, state)
    if model is None:
        return "<p><i>(a widget whose state the notebook did not keep)</i></p>"
    if _hidden(model, state):
        return ""
    kind = model.get("_model_name", "")
    if kind in ("VBoxModel", "HBoxModel", "BoxModel", "GridBoxModel", "TabModel", "AccordionModel"):
        direction = "row" if kind == "HBoxModel" else "column"
        children = "".join(_widget(child, state) for child in model.get("children", []))
        return f"<div class=\"labkit-box labkit-{direction}\">{children}</div>"
    if kind in ("HTMLModel", "HTMLMathModel"):
        return _control(model, f"<div>{model.get('value', '')}</div>")
    if kind == "LabelModel":
        return _control(model, f"<span>{html.escape(str(model.get('value', '')))}</span>")
    if kind in ("ButtonModel", "ToggleButtonModel"):
        return f"<button disabled>{html.escape(model.get('description') or '')}</button>"
    if kind == "CheckboxModel":
        checked = " checked" if model.get("value") else ""
        return f"<label><input type=\"checkbox\" disabled{checked}> {html.escape(model.get('description') or '')}" \
               "</label>"
    if kind in ("RadioButtonsModel", "ToggleButtonsModel"):
        chosen, labels = model.get("index"), model.get("_options_labels") or []
        items = "".join(f"<label><input type=\"radio\" disabled{' checked' if i == chosen else ''}> "
                        f"{html.escape(str(label))}</label>" for i, label in enumerate(labels))
        return _control(model, f"<div class=\"labkit-box labkit-column\">{items}</div>")
    if kind in ("DropdownModel", "SelectModel"):
        return _control(model, _options(model))
    if kind.endswith("SliderModel"):
        value = model.get("value", "")
        bounds = "".join(f" {name}=\"{model[name]}\"" for name in ("min", "max", "step") if name in model)
        return _control(model, f"<input type=\"range\" disabled{bounds} value=\"{html.escape(str(value))}\"> "
                               f"<span>{html.escape(str(value))}</span>")
    if kind in ("TextModel", "TextareaModel", "IntTextModel", "FloatTextModel"):
        shown = model.get("value", "")
        return _control(model, f"<input type=\"text\" disabled value=\"{html.escape(str(shown))}\">")
    if kind == "OutputModel":
        return "".join(_output_html(output, state) for output in model.get("outputs", []))
    return f"<p><i>({html.escape(kind or 'a widget')})</i></p>"


def widget_html(model_id: str, state: dict) -> str:
    """The note that the widget is live in JupyterLab, then its last state; folded when it is long (notebook 16's
    quiz: 33 questions, some 10,000 px of disabled buttons)."""
    shown = _widget(model_id, state)
    if len(shown) > FOLD_CHARACTERS:
        shown = f"<details><summary>The widget as the notebook left it (open to see it all)</summary>{shown}</details>"
    return f"<div class=\"labkit-widget\">{LIVE_NOTE}{shown}</div>"


def _markdown_cell(source: str, cell_id: str) -> dict:
    return {"cell_type": "markdown", "id": cell_id, "metadata": {}, "source": source}


def _as_printed(text: str) -> str:
    """A stream's text as a terminal leaves it: of a line a progress bar rewrote with carriage returns, the last."""
    return "\n".join(line.rstrip("\r").rsplit("\r", 1)[-1] for line in text.split("\n"))


def _web_outputs(outputs: list[dict], state: dict, replacements: dict[str, str]) -> list[dict]:
    """A cell's outputs as the site shows them: consecutive prints of a stream as one, as printed; the note that a
    widget's kernel has stopped left out (here no kernel ever ran it); figures and widgets as HTML."""
    shown: list[dict] = []
    for output in outputs:
        if STALE_NOTE_CLASS in _text(output.get("data", {}).get("text/html", "")):
            continue
        if output.get("output_type") == "stream" and shown and shown[-1].get("output_type") == "stream" \
                and shown[-1].get("name") == output.get("name"):
            shown[-1] = {**shown[-1], "text": _text(shown[-1]["text"]) + _text(output["text"])}
            continue
        shown.append(output)
    for i, output in enumerate(shown):
        if output.get("output_type") == "stream":
            shown[i] = {**output, "text": _as_printed(_text(output["text"]))}
        shown[i] = _replaced(_web_output(shown[i], state), replacements)
    return shown


def _replaced(output: dict, replacements: dict[str, str]) -> dict:
    """`output` with each key of `replacements` (the build's own paths) replaced by its value in every text."""
    text = json.dumps(output)
    for old, new in replacements.items():
        text = text.replace(json.dumps(old)[1:-1], json.dumps(new)[1:-1])
    return json.loads(text)


def _web_output(output: dict, state: dict) -> dict:
    """One output as the site shows it: figures and widgets as HTML, everything else as it was."""
    data = output.get("data", {})
    if PLOTLY_MIME in data:
        return {**output, "data": {"text/html": figure_html(data[PLOTLY_MIME])}}
    if WIDGET_MIME in data:
        return {**output, "data": {"text/html": widget_html(data[WIDGET_MIME]["model_id"], state)}}
    return output


def _without_solution_intros(cells: list[dict]) -> list[dict]:
    """The cells without the line before each reference solution ("The course's reference solution, folded: open it
    only after trying."): on the web the solution is not there to open."""
    def introduces(i: int) -> bool:
        return (cells[i]["cell_type"] == "markdown" and i + 1 < len(cells)
                and "solution" in cells[i + 1].get("metadata", {}).get("tags", [])
                and _text(cells[i]["source"]).startswith("The course's reference solution"))
    return [cell for i, cell in enumerate(cells) if not introduces(i)]


def _as_this_site_ran(cells: list[dict]) -> list[dict]:
    """The cells with papermill's injected parameters folded into the notebook's `parameters` cell: one cell that
    shows the value this site ran with and the notebook's own, not two that disagree."""
    injected = [c for c in cells if "injected-parameters" in c.get("metadata", {}).get("tags", [])]
    if not injected:
        return cells
    values = [line for line in _text(injected[0]["source"]).splitlines() if line.strip() and not line.startswith("#")]
    for cell in cells:
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            own = "\n".join(f"# {line}".rstrip() for line in _text(cell["source"]).splitlines())
            cell["source"] = "\n".join(values) + "  # as this site ran it; the notebook's own cell:\n" + own
    return [c for c in cells if c is not injected[0]]


def web_notebook(notebook: dict, provenance: str, replacements: dict[str, str] | None = None) -> dict:
    """The web edition of an executed `notebook` (module docstring); `provenance` is the Markdown line of where and
    at which commit it ran, put under its title; `replacements` maps the build's own texts in outputs (its progress
    file's path) to what a reader's would be."""
    web = copy.deepcopy(notebook)
    state = (web.get("metadata", {}).pop("widgets", {}).get(WIDGET_STATE) or {}).get("state", {})
    cells = []
    for i, cell in enumerate(_without_solution_intros(_as_this_site_ran(web["cells"]))):
        tags = set(cell.get("metadata", {}).get("tags", []))
        withheld = [tag for tag in WITHHELD_TAGS if tag in tags]
        if withheld:
            note = f"*{WITHHELD_TAGS[withheld[0]]}*"
            if not (cells and cells[-1]["source"] == note):  # one note for a run of withheld cells
                cells.append(_markdown_cell(note, cell.get("id", f"withheld-{i}")))
            continue
        if cell["cell_type"] == "markdown":
            cell["source"] = KEY_IN_A_SENTENCE.sub(KEY_WITHHELD, _text(cell["source"]))
        if cell["cell_type"] == "code":
            cell["outputs"] = _web_outputs(cell.get("outputs", []), state, replacements or {})
        cells.append(cell)
    title = next((i for i, c in enumerate(cells) if c["cell_type"] == "markdown"), -1)
    cells.insert(title + 1, _markdown_cell(provenance, "where-it-ran"))
    web["cells"] = cells
    return web


def read(path) -> dict:
    """A notebook's JSON as a dict."""
    with open(path, encoding="utf-8") as file:
        return json.load(file)
