"""labkit.tables.text_table: the one text-table layout (worked example, gpu-check, benchmarks)."""

import ast
import pathlib
import re

import pytest

from labkit import tables
from labkit.tables import text_table


def test_columns_are_as_wide_as_their_widest_cell_two_spaces_apart():
    table = text_table(("a", "bb"), [(1, "x"), (22, "yyy")], indent="  ")
    assert table.splitlines() == ["  a   bb", "  --  ---", "  1   x", "  22  yyy"]


def test_right_aligned_columns_and_no_rule():
    table = text_table(("size", "ms", "note"), [("1 KiB", 0.5, ""), ("64 MiB", 12.25, "slow")], align="<>",
                       rule=False)
    assert table.splitlines() == ["size       ms  note", "1 KiB     0.5", "64 MiB  12.25  slow"]


def test_no_line_ends_in_spaces():
    table = text_table(("quantity", "value"), [("a long quantity", "1"), ("b", "")])
    assert all(line == line.rstrip() for line in table.splitlines())


def test_a_row_of_the_wrong_length_is_named():
    with pytest.raises(ValueError, match=r"row 1 has 1 cells \(\['x'\]\) but the header has 2"):
        text_table(("a", "b"), [(1, 2), ("x",)])


@pytest.mark.parametrize("align", ["<<<", "^"])
def test_an_alignment_that_does_not_fit_is_named(align):
    with pytest.raises(ValueError, match=f"align='{re.escape(align)}'.*'<' \\(left\\) or '>' \\(right\\)"):
        text_table(("a", "b"), [], align=align)


def test_the_module_imports_no_torch():
    """labkit.plan formats its worked example with it and stays torch-free."""
    source = ast.parse(pathlib.Path(tables.__file__).read_text())
    imported = {alias.name for node in ast.walk(source) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(source) if isinstance(node, ast.ImportFrom)}
    assert not {name for name in imported if name.split(".")[0] in ("torch", "labkit")}, imported


def _as_shown(text: str) -> list[str]:
    """Lines of `text` as a notebook or terminal shows them: after a carriage return a line is overwritten from
    its start (JupyterLab's text output does the same)."""
    lines = []
    for line in text.split("\n"):
        shown = ""
        for part in line.split("\r"):
            shown = part + shown[len(part):]
        lines.append(shown)
    return lines


def test_a_line_printed_while_a_bar_is_drawn_keeps_a_line_of_its_own(capsys):
    notice = "labkit: 4 ranks, gloo on CPU: no usable CUDA GPU found; every rank computes on cpu."
    for i in tables.progress_bar(range(3), desc="AllReduce timings", unit="run", mininterval=0):
        if i == 0:
            tables.print_line(notice)
    shown = _as_shown(capsys.readouterr().out)
    assert shown[0].rstrip() == notice
    assert shown[1].startswith("AllReduce timings: 100%") and "3/3" in shown[1] and shown[2:] == [""]
    assert all(len(line) <= tables.LINE_CHARS for line in shown)


def test_wrapped_breaks_between_words_within_the_line_width():
    sentence = " ".join(f"word{i}" for i in range(60))
    lines = tables.wrapped(sentence, indent="    ").split("\n")
    assert len(lines) > 2 and all(len(line) <= tables.LINE_CHARS for line in lines)
    assert all(line.startswith("    word") for line in lines[1:]) and lines[0].startswith("word0 word1")
    assert " ".join(line.strip() for line in lines) == sentence                 # no word cut, none lost
    assert tables.wrapped("short\nlines kept") == "short\nlines kept"
