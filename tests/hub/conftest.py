"""The class's hub, started for real: JupyterHub with deploy/'s configuration, its proxy, local test students.

Root is needed (CI runs as root): JupyterHub's spawner starts each student's server as that Unix user, and the
students are local users this fixture makes with useradd and removes with userdel, even when a test fails. Without
root the hub tests skip, saying so. The hub listens on loopback only, on free ports.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import requests

from tests.hub._student import Student

REPOSITORY = Path(__file__).resolve().parents[2]
STUDENTS = 8
GiB = 1024**3
MEMORY_GIB = 2.0  # each student's bound: a server, a kernel, a fork server and 2 ranks use about 0.9 GiB here


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def require_root() -> None:
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        message = "the hub tests need root and useradd: each student is a local Unix user"
        if os.environ.get("CI"):
            pytest.fail(message + "; CI runs as root")
        pytest.skip(message)


def make_user(name: str) -> None:
    subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", name], check=True, capture_output=True)


def remove_user(name: str) -> None:
    """The user, their home, their processes and what they left in /tmp (a later user may get the same uid)."""
    uid = pwd.getpwnam(name).pw_uid
    for process in processes_of([name]):
        process.kill()
    subprocess.run(["userdel", "--remove", name], capture_output=True)
    for left in Path("/tmp").iterdir():
        try:
            if left.lstat().st_uid == uid:
                shutil.rmtree(left) if left.is_dir() and not left.is_symlink() else left.unlink()
        except OSError:
            pass


def processes_of(names: list[str]) -> list[psutil.Process]:
    """The running processes of these users."""
    uids = set()
    for name in names:
        try:
            uids.add(pwd.getpwnam(name).pw_uid)
        except KeyError:
            pass
    found = []
    for process in psutil.process_iter(["uids"]):
        try:
            if process.info["uids"] and process.info["uids"].real in uids:
                found.append(process)
        except psutil.Error:
            pass
    return found


@dataclass
class Hub:
    base: str
    students: dict[str, str]  # name: password
    process: subprocess.Popen
    log: Path
    state: Path

    def student(self, name: str) -> Student:
        return Student(self.base, name, self.students[name])

    def log_tail(self, nbytes: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-nbytes:]

    def stop(self, timeout_seconds: float = 60) -> None:
        """SIGTERM, as systemd or Ctrl-C would stop it: the hub stops every server, then its proxy."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_seconds)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def wait_for_hub(hub: Hub, timeout_seconds: float = 90) -> None:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if hub.process.poll() is not None:
            raise RuntimeError(f"JupyterHub exited with {hub.process.returncode}:\n{hub.log_tail()}")
        try:
            if requests.get(f"{hub.base}/hub/api", timeout=5).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"JupyterHub did not answer in {timeout_seconds:.0f} s:\n{hub.log_tail()}")


@pytest.fixture(scope="module")
def class_hub(tmp_path_factory):
    """The hub with STUDENTS local students (lkhub-XXXX-N), each with a password of their own; stopped, and the
    students removed with their homes and processes, at the end."""
    require_root()
    state = tmp_path_factory.mktemp("hub-state")
    prefix = f"lkhub{secrets.token_hex(2)}"
    names = [f"{prefix}s{i}" for i in range(STUDENTS)]
    passwords_file = state / "passwords.json"
    students = {name: secrets.token_urlsafe(12) for name in names}
    fd = os.open(passwords_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(students, out)
    made = []
    log = state / "jupyterhub.log"
    port = free_port()
    env = {**os.environ, "LABKIT_HUB_STATE": str(state / "hub"), "LABKIT_HUB_PORT": str(port),
           "LABKIT_TEST_PASSWORDS": str(passwords_file), "LABKIT_TEST_HUB_API_PORT": str(free_port()),
           "LABKIT_TEST_PROXY_API_PORT": str(free_port()), "LABKIT_CLASS_WORLD_SIZE": "4",
           "LABKIT_CLASS_THREADS_PER_RANK": "1", "LABKIT_CLASS_MEMORY_GIB": str(MEMORY_GIB),
           "LABKIT_CLASS_CPU_CORES": "2", "PYTHONPATH": str(REPOSITORY)}
    hub = None
    try:
        for name in names:
            make_user(name)
            made.append(name)
        with log.open("wb") as out:
            process = subprocess.Popen(
                [str(Path(sys.executable).with_name("jupyterhub")), "-f", str(REPOSITORY / "tests/hub/hub_config.py")],
                cwd=state, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        hub = Hub(f"http://127.0.0.1:{port}", students, process, log, state)
        wait_for_hub(hub)
        yield hub
    finally:
        if hub is not None:
            hub.stop()
            with_log = Path(os.environ.get("LABKIT_ARTIFACTS", REPOSITORY / "test-artifacts")) / "hub.log"
            with_log.parent.mkdir(exist_ok=True)
            shutil.copy(log, with_log)
        for name in made:
            remove_user(name)
