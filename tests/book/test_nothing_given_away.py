"""Nothing is given away on the course's website: no reference solution of a "your turn" cell, no key of notebook
10's stack map, no run of the bug zoo paired with its cause; the stubs, hints and graders' verdicts are there.

Read from `make book`'s build (built_site.py): every file of the site (pages as the text a reader sees, scripts,
the search index) and the web editions Sphinx built it from. A solution is looked for three ways: its lines that
nothing else in the course holds, as they read; any three of its lines in a row with comments and spaces taken
out (a copy without its comments); and, structurally, no cell tagged `solution` or `answer-key` in the sources.
The stack map's pairs and the zoo's causes are looked for beside their product or run, in either order, with the
drop-downs' option lists left out (every role and every cause is offered on every card: that is the question).
"""

from __future__ import annotations

import io
import json
import re
import sys
import tokenize

from built_site import NOTEBOOKS, ROOT, SITE, SOURCES, course_notebook, reader_text, require_the_build, site_texts

sys.path.insert(0, str(ROOT / "tests" / "notebooks"))
from solutions import is_solution, solution_code  # noqa: E402 - the folded reference solutions

from labkit.exercises.bug_zoo import ANSWERS, CAUSES  # noqa: E402
from labkit.exercises.stack_map import STACK_MAP  # noqa: E402

WITHHELD = ("solution", "answer-key")
NEAR_WORDS = 4  # "TensorRT-LLM optimizes", "Triton: serves", "serves (Triton)": a pair within a few words


def bare(code: str) -> list[str]:
    """Each line of `code` without its comment and without any space: how a copy reads whatever its layout."""
    try:
        lines: dict[int, str] = {}
        for token in tokenize.generate_tokens(io.StringIO(code).readline):
            if token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                                  tokenize.ENDMARKER):
                lines[token.start[0]] = lines.get(token.start[0], "") + token.string.replace(" ", "")
        return [line for _, line in sorted(lines.items())]
    except (tokenize.TokenError, IndentationError, SyntaxError):  # a cell magic (%%ranks): by hand
        return [re.sub(r"\s", "", line.split("#")[0]) for line in code.splitlines() if line.split("#")[0].strip()]


def course_text() -> tuple[str, str]:
    """Every notebook's cells but its solutions: as read (whitespace collapsed), and bare (no spaces at all)."""
    cells = [c for name in NOTEBOOKS for c in course_notebook(name)["cells"] if not is_solution(c)]
    read = " ".join(" ".join("".join(c["source"]).split()) for c in cells)
    return read, re.sub(r"\s", "", read)


def test_no_reference_solution_reaches_the_site():
    require_the_build()
    texts = site_texts()
    squeezed = {where: re.sub(r"\s", "", text) for where, text in texts.items()}
    read, bare_course = course_text()
    leaks, looked_for = [], 0
    for name in NOTEBOOKS:
        for cell in (c for c in course_notebook(name)["cells"] if is_solution(c)):
            code = solution_code(cell)
            lines = [" ".join(line.split()) for line in code.splitlines()]
            own = [line for line in lines if len(line) > 20 and line not in read]
            runs = ["".join(run) for run in zip(*(bare(code)[i:] for i in range(3)), strict=False)]
            runs = [run for run in runs if len(run) > 30 and run not in bare_course]
            looked_for += len(own) + len(runs)
            leaks += [f"{name}: {line!r} in {where}" for line in own for where, text in texts.items() if line in text]
            leaks += [f"{name}: {run!r} (bare) in {where}" for run in runs for where, text in squeezed.items()
                      if run in text]
    assert looked_for > 100, looked_for  # enough of every solution to mean something
    assert not leaks, "\n".join(leaks)


def test_no_withheld_cell_is_among_the_sources_and_each_says_where_it_is():
    require_the_build()
    for name in NOTEBOOKS:
        web = json.loads((SOURCES / f"{name}.ipynb").read_text(encoding="utf-8"))
        tagged = [c for c in web["cells"] if set(c.get("metadata", {}).get("tags", [])) & set(WITHHELD)]
        assert not tagged, (name, [c["source"][:80] for c in tagged])
        solutions = sum(is_solution(c) for c in course_notebook(name)["cells"])
        notes = sum("reference solution of the exercise above is in the notebook" in "".join(c["source"])
                    for c in web["cells"])
        assert notes == solutions, (name, notes, solutions)


def near(first: str, second: str, text: str) -> bool:
    """Whether `first` and `second` stand within NEAR_WORDS words of each other, in either order."""
    gap = rf"(?:\W+\w+){{0,{NEAR_WORDS}}}?\W+"
    a, b = re.escape(first.lower()), re.escape(second.lower())
    return re.search(rf"{a}{gap}{b}|{b}{gap}{a}", text.lower()) is not None


def test_the_stack_maps_key_is_nowhere_on_the_site():
    require_the_build()
    texts = site_texts(choices=False)
    leaks = [f"{product} {role} in {where}" for product, role in STACK_MAP.items() for where, text in texts.items()
             if product != "NCCL" and near(product, role, text)]  # "NCCL communicates" is the course's subject
    for form in (json.dumps(STACK_MAP), repr(STACK_MAP), str(sorted(STACK_MAP.items()))):
        leaks += [f"the stack map as data in {where}" for where, text in texts.items() if form[1:50] in text]
    chosen = re.findall(r"<option selected>(.*?)</option>", (SITE / "10_nccl_and_debugging.html").read_text())
    assert chosen and set(chosen) == {"?"}, chosen  # the exercise's drop-downs as a new student leaves them
    assert not leaks, "\n".join(leaks)


def test_no_run_of_the_bug_zoo_is_paired_with_its_cause():
    require_the_build()
    page = (SITE / "15_bug_zoo.html").read_text(encoding="utf-8")
    text = reader_text(page, choices=False)
    leaks = [f"run {letter} beside '{CAUSES[cause].label}'" for letter, cause in ANSWERS.items()
             if re.search(rf"Run {letter}\b.{{0,300}}{re.escape(CAUSES[cause].label)}", text)]
    leaks += [f"what {cause} shows, said" for cause, said in CAUSES.items()
              if " ".join(said.shows.split())[:50] in text]  # the feedback of a Check never pressed
    leaks += [f"the answers as data in {where}" for where, t in site_texts().items()
              for form in (json.dumps(ANSWERS), repr(ANSWERS)) if form[1:30] in t]
    chosen = re.findall(r"<option selected>(.*?)</option>", page)
    assert chosen and set(chosen) == {"choose a cause"}, chosen
    assert not leaks, "\n".join(leaks)


def test_the_stubs_hints_and_verdicts_on_the_stubs_are_there():
    require_the_build()
    ring = reader_text((SITE / "03_ring_allreduce.html").read_text(encoding="utf-8"))
    assert 'raise NotImplementedError("your turn")' in ring and "Not yet" in ring
    zoo = reader_text((SITE / "15_bug_zoo.html").read_text(encoding="utf-8"))
    assert "Hint 1" in zoo and "Withheld on the web" in zoo
