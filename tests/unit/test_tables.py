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
