"""Shared helpers: run a Python snippet as its own process (an independent owner of ranks)."""

import os
import socket
import subprocess
import sys
import textwrap

import pytest
from hypothesis import settings

# No per-example deadline: two tests run at once on 2 cores (make unit), and a loaded machine made one example of
# a plan property take 392 ms against hypothesis's default 200 ms. The properties are what the tests check.
settings.register_profile("labkit", deadline=None)
settings.load_profile("labkit")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Graders record exercise progress (labkit.exercises.progress): the tests' goes here, never into the student's.
os.environ["LABKIT_PROGRESS"] = os.path.join(ROOT, "test-artifacts", "progress.json")


def _start(code: str, **env) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **env},
    )


@pytest.fixture
def start_script():
    """Start a snippet as a fresh `python -c` process, like an instructor's script; killed at the end."""
    started = []
    yield lambda code, **env: started.append(_start(code, **env)) or started[-1]
    for process in started:
        process.kill()
        process.communicate()


@pytest.fixture
def script():
    """Run a snippet to completion; returns (returncode, stdout, stderr)."""
    def run(code: str, timeout: float = 120, **env):
        process = _start(code, **env)
        out, err = process.communicate(timeout=timeout)
        return process.returncode, out, err
    return run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def free_port():
    """A function giving a TCP port on 127.0.0.1 that nothing listens on right now."""
    return _free_port


@pytest.fixture
def port(free_port) -> int:
    return free_port()
