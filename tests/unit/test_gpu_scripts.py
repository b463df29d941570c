"""The GPU machine's scripts, checked here without a GPU: what they return decides whether a GPU run failed."""

from __future__ import annotations

import builtins
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_run_notebooks():
    spec = importlib.util.spec_from_file_location("run_notebooks", ROOT / "tests" / "gpu" / "run_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_notebooks"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_one_gpu_has_nothing_to_run_even_without_papermill(monkeypatch, capsys):
    """`make gpu-test` on a one-GPU box: the notebooks would run over gloo, so the script says so and exits 0,
    before it looks for papermill (a missing papermill used to make it exit 1 there)."""
    run_notebooks = load_run_notebooks()
    monkeypatch.setattr(run_notebooks, "gpu_count", lambda: 1)
    monkeypatch.setattr(run_notebooks.importlib.util, "find_spec", lambda name: None)
    assert run_notebooks.main([]) == 0
    assert capsys.readouterr().out.startswith("One GPU: NCCL needs one GPU per rank")
    monkeypatch.setattr(run_notebooks, "gpu_count", lambda: 2)  # two GPUs: then papermill is needed
    assert run_notebooks.main([]) == 1
    assert "papermill and ipykernel missing" in capsys.readouterr().out


FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for python in device_run.sh: each step exits with the status named for it in FAKE_STATUS_<step>.
case "$*" in
    *run_notebooks.py*) exit "${FAKE_STATUS_NOTEBOOKS:-0}" ;;
    *"-m pytest"*) exit "${FAKE_STATUS_PYTEST:-0}" ;;
    *gpu_check*) exit "${FAKE_STATUS_GPU_CHECK:-0}" ;;
    *) exit 0 ;;
esac
"""


@pytest.mark.parametrize(("statuses", "expected"), [
    ({}, 0),
    ({"NOTEBOOKS": "1"}, 1),  # a notebook failed under NCCL: the run failed (it used to exit 0)
    ({"GPU_CHECK": "1"}, 1),
    ({"PYTEST": "2", "NOTEBOOKS": "1"}, 2),  # pytest's status comes first
])
def test_device_run_fails_when_any_step_fails(tmp_path, statuses, expected):
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    env = {**os.environ, "PYTHON": str(python), "OUT": str(tmp_path / "out"), "SITE": str(tmp_path / "site"),
           "TOTAL_SECONDS": "60", "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    env.update({f"FAKE_STATUS_{step}": status for step, status in statuses.items()})
    done = subprocess.run(["bash", str(ROOT / "tests" / "gpu" / "device_run.sh")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == expected, done.stdout + done.stderr
    assert "run_notebooks exit status" in (tmp_path / "out" / "gpu_log.txt").read_text()


def test_every_warning_filter_names_a_category_any_pytest_knows():
    """pytest resolves each filterwarnings category when it reads the configuration: one that an older pytest
    lacks (pytest.PytestRemovedIn10Warning) stops every test there. Only Python's own warning classes, or none."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    filters = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["filterwarnings"]
    assert filters
    for entry in filters:
        parts = entry.split(":")
        category = parts[2] if len(parts) > 2 else ""
        known = getattr(builtins, category, None)
        assert not category or (isinstance(known, type) and issubclass(known, Warning)), entry
