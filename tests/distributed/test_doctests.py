"""Every example in labkit's docstrings runs and prints what it claims (several start ranks with labkit.run)."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

pytestmark = pytest.mark.numerics  # compares floating-point results: make unit runs it again on other kernels

PACKAGE = Path(__file__).resolve().parents[2] / "labkit"
WITH_EXAMPLES = sorted(
    ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
    for p in PACKAGE.rglob("*.py") if ">>> " in p.read_text()
)


@pytest.fixture(scope="module", autouse=True)
def backend_notes_shown():
    """labkit.run prints which backend it chose once per world size; show those notes before the examples run,
    so that each example's output is only what it claims."""
    import labkit

    for world_size in range(1, 5):
        labkit.run(len, [], world_size=world_size)


def test_the_package_has_examples():
    assert len(WITH_EXAMPLES) >= 10


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, f"{name}: {result.failed} of {result.attempted} failed"
