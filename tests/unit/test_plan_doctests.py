"""The examples in labkit.plan's docstrings run and print what they claim."""

import doctest
import importlib

import pytest

MODULES = ["batch", "memory", "pipeline", "time", "traffic", "worked_example"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(f"labkit.plan.{name}"))
    assert result.attempted > 0 and result.failed == 0
