"""A JupyterLab server for the browser tests, and Playwright pointed at Debian's Chromium.

The server runs on 127.0.0.1 from a temporary copy of notebooks/ (so running them never writes
outputs into the repository), with a test-only config: no token, root allowed (CI runs as root),
cells never virtualised (`windowingMode: none`, else off-screen outputs are detached), no news
popup. Chromium is never downloaded: set LABKIT_CHROMIUM, or install Debian's `chromium`."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = ROOT / "test-artifacts" / "screenshots"
CHROMIUM = os.environ.get("LABKIT_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run", "--disable-quic"]
SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false"},
}
SERVER_CONFIG = """
from jupyterlab.galata import configure_jupyter_server
configure_jupyter_server(c)  # no token, no xsrf check, window.jupyterapp exposed: for tests only
c.ServerApp.ip = "127.0.0.1"
c.ServerApp.port = {port}
c.ServerApp.root_dir = {root!r}
c.ServerApp.allow_root = True
c.LabApp.user_settings_dir = {settings!r}
"""


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args):
    if not os.path.exists(CHROMIUM):
        message = f"no Chromium at {CHROMIUM}: `apt-get install chromium`, or set LABKIT_CHROMIUM"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return {**browser_type_launch_args, "executable_path": CHROMIUM, "args": CHROMIUM_FLAGS}


@pytest.fixture(scope="session")
def screenshots() -> Path:
    """Where each notebook's screenshot goes (`make test` prints it)."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS


@pytest.fixture(scope="session")
def lab_url(tmp_path_factory, free_port):
    """Start JupyterLab on a free port of 127.0.0.1 over a copy of the notebooks; its base URL."""
    base = tmp_path_factory.mktemp("lab")
    root, settings, config = base / "notebooks", base / "settings", base / "config"
    shutil.copytree(ROOT / "notebooks", root, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    for name, value in SETTINGS.items():
        path = settings / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))
    config.mkdir()
    port = free_port()
    (config / "jupyter_server_config.py").write_text(SERVER_CONFIG.format(port=port, root=str(root),
                                                                          settings=str(settings)))
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(config), "JUPYTER_RUNTIME_DIR": str(base / "runtime")}
    log = open(base / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "jupyter", "lab"], cwd=root, env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(f"{url}/api/status", server, base / "server.log")
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


def _wait_for(url: str, server: subprocess.Popen, log: Path, seconds: float = 90) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"JupyterLab did not answer within {seconds:.0f} s:\n{log.read_text()[-3000:]}")
