"""Shared helpers: run a Python snippet as its own process (an independent owner of ranks)."""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from hypothesis import settings

# No per-example deadline: two tests run at once on 2 cores (make unit), and a loaded machine made one example of
# a plan property take 392 ms against hypothesis's default 200 ms. The properties are what the tests check.
settings.register_profile("labkit", deadline=None)
settings.load_profile("labkit")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The browser tests' Chromium (tests/browser, tests/book): Debian's, never a download (`playwright install` needs
# the internet and a browser build Playwright chooses).
CHROMIUM = os.environ.get("LABKIT_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run", "--disable-quic"]
# Graders record exercise progress (labkit.exercises.progress): the tests' goes here, never into the student's.
os.environ["LABKIT_PROGRESS"] = os.path.join(ROOT, "test-artifacts", "progress.json")


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args):
    """pytest-playwright's launch arguments, with Debian's Chromium; a skip (a failure in CI) without it."""
    if not os.path.exists(CHROMIUM):
        message = f"no Chromium at {CHROMIUM}: `apt-get install chromium`, or set LABKIT_CHROMIUM"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return {**browser_type_launch_args, "executable_path": CHROMIUM, "args": CHROMIUM_FLAGS}


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


ANOTHER_UID = 65534  # "nobody": the other local user beside the student (thirty students on one server)
AS_ANOTHER_USER = ["setpriv", "--reuid", str(ANOTHER_UID), "--regid", str(ANOTHER_UID), "--clear-groups"]


@pytest.fixture
def as_another_user():
    """Run a command as another local user (uid 65534); returns the CompletedProcess (text, output captured).

    Needs root and util-linux's setpriv: CI runs as root, so there these tests run and must pass; elsewhere they
    are skipped with the reason. A `python` snippet runs as `[sys.executable, "-c", code]`: the checkout and its
    .venv are world-readable on a fresh clone (umask 022)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        message = "needs root and setpriv to act as a second local user"
        if os.environ.get("CI"):
            pytest.fail(message + ": CI runs as root")
        pytest.skip(message)

    def run(command: list[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(AS_ANOTHER_USER + list(command), capture_output=True, text=True, timeout=timeout,
                              cwd=kwargs.pop("cwd", "/"), **kwargs)
    return run


@pytest.fixture
def shared_folder():
    """A folder that every local user can write in, like /tmp (mode 1777, the student's), removed at the end: the
    place where another user plants folders and files, or takes locks, beside the student's own."""
    folder = tempfile.mkdtemp(prefix="labkit-shared-", dir="/tmp")
    os.chmod(folder, 0o1777)
    yield Path(folder)
    shutil.rmtree(folder, ignore_errors=True)


HOLD_FLOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # taken at once, or this exits: a test never waits on it
print("held", flush=True)
time.sleep(120)
"""


@pytest.fixture
def another_users_flock(as_another_user):
    """`hold(path)`: another local user takes an exclusive flock(2) on `path` and holds it until the test ends (then
    killed), as `flock path sleep 120` would; returns True once held, False if that user cannot open `path` or
    another process holds it."""
    holders = []

    def hold(path) -> bool:
        holder = subprocess.Popen(AS_ANOTHER_USER + [sys.executable, "-c", HOLD_FLOCK, str(path)], cwd="/", text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        holders.append(holder)
        return holder.stdout.readline().strip() == "held"  # "" once it exited: it could not open `path`
    yield hold
    for holder in holders:
        holder.kill()
        holder.wait()
