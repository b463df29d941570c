"""README's Python examples run and return what their `# ->` comments say."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
CHECKED = [block for block in BLOCKS if "# ->" in block]


def split_example(block: str) -> tuple[str, str, str]:
    """(the code before the checked expression, the expression, the expected value's text)."""
    lines = block.rstrip("\n").split("\n")
    arrow = next(i for i, line in enumerate(lines) if "# ->" in line)
    code, comment = lines[arrow].split("# ->")
    if code.strip():
        setup, expression = lines[:arrow], code.strip()
    else:  # the comment stands on the line after the expression
        setup, expression = lines[:arrow - 1], lines[arrow - 1].strip()
    expected = [comment] + [line.strip().removeprefix("#") for line in lines[arrow + 1:]]
    return "\n".join(setup), expression, " ".join(expected)


def squeezed(text: str) -> str:
    return re.sub(r"\s+", "", text)


def test_readme_has_checked_examples():
    assert len(CHECKED) >= 2


@pytest.mark.parametrize("block", CHECKED, ids=lambda b: b.split("\n")[0][:40])
def test_readme_example_returns_what_it_says(block):
    setup, expression, expected = split_example(block)
    namespace = {"__name__": "readme_example"}
    exec(compile(setup, "README.md", "exec"), namespace)  # noqa: S102 - the README's own example
    assert squeezed(repr(eval(expression, namespace))) == squeezed(expected)  # noqa: S307


def test_split_example_reads_both_comment_styles():
    inline = "x = 1\nx + 1  # -> 2\n"
    below = "x = 1\nx + 1\n# -> [\n#     2]\n"
    assert split_example(inline) == ("x = 1", "x + 1", " 2")
    assert squeezed(split_example(below)[2]) == "[2]"
    assert split_example(below)[1] == "x + 1"
