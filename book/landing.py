"""The site's landing page, from the README: what the course is, the course map, the learning path, and how to run it.

One source: the README's opening paragraph, its "## Start" commands and its "## The course" section (the table of
notebooks: question, study time, run time, what it runs and what you write; then the learning path) are copied,
with each notebook's name in the table made a link to its page. A README edit changes the site at its next build.
"""

from __future__ import annotations

import re

__all__ = ["landing_page", "section"]


def section(readme: str, heading: str) -> str:
    """The README's text under `heading` (a line such as "## The course"), up to the next heading of its level or
    higher (subsections included); ValueError if the README has no such heading."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = readme.splitlines()
    if heading not in lines:
        raise ValueError(f"the README has no {heading!r} heading: the landing page is built from it")
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if re.match(rf"#{{1,{level}}} ", lines[i])
                and not _in_fence(lines, i)), len(lines))
    return "\n".join(lines[start:end]).strip()


def _in_fence(lines: list[str], index: int) -> bool:
    """Whether line `index` is inside a ``` code block (a comment line there starts with # too)."""
    return sum(line.startswith("```") for line in lines[:index]) % 2 == 1


def _until(text: str, heading: str) -> str:
    """`text` up to the line `heading` (exclusive), or all of it."""
    return text.split(f"\n{heading}\n", 1)[0].strip()


def landing_page(readme: str, notebooks: list[str], provenance: str) -> str:
    """index.md: the title, the course map with links, the learning path, the two commands, and the toctree."""
    title = readme.splitlines()[0].lstrip("# ").strip()
    intro = readme.split("\n## ", 1)[0].split("\n", 1)[1].strip()
    course = _until(section(readme, "## The course"), "### You build it: the graded exercises")
    for name in notebooks:
        course = course.replace(f"| `{name}` |", f"| [`{name}`]({name}.ipynb) |")
    start = section(readme, "## Start")
    commands = re.search(r"```bash\n.*?```", start, re.DOTALL)
    if commands is None:
        raise ValueError("the README's Start section has no ```bash block: the landing page shows its two commands")
    toctree = "\n".join(["```{toctree}", ":hidden:", ":maxdepth: 1", "", *notebooks, "```"])
    return "\n\n".join([f"# {title}", intro, f"*{provenance}*", "## The course", course,
                        "## Run it yourself", "On your machine, with Python 3.10 or newer, `make` and git "
                        "(no conda, no GPU), in a clone of the repository:", commands.group(0),
                        "Every page here is a notebook as it ran for this site; in JupyterLab its widgets are live "
                        "and the exercises are yours to write.", toctree]) + "\n"
