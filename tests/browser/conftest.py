"""A JupyterLab server for the browser tests, and Playwright pointed at Debian's Chromium.

The server runs on 127.0.0.1 from a temporary copy of notebooks/ (so running them never writes
outputs into the repository), with the course's JupyterLab defaults (jupyter/overrides.json, as `make
setup` installs them: code wraps, no news pop-up), its kernels' IPython config (jupyter/ipython_kernel_config.py:
ipywidgets loaded as a kernel starts) and a test-only config: no token, root allowed (CI runs
as root), cells never virtualised (`windowingMode: none`, else off-screen outputs are detached). Chromium is
never downloaded: set LABKIT_CHROMIUM, or install Debian's `chromium` (tests/conftest.py's browser_type_launch_args)."""

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
SETTINGS = {  # the test's own user settings; the student's defaults come from jupyter/overrides.json
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}
LAB_STATIC = Path(sys.prefix) / "share" / "jupyter" / "lab" / "static"  # the installed JupyterLab's build
SERVER_CONFIG = """
from jupyterlab.galata import configure_jupyter_server
configure_jupyter_server(c)  # no token, no xsrf check, window.jupyterapp exposed: for tests only
c.ServerApp.ip = "127.0.0.1"
c.ServerApp.port = {port}
c.ServerApp.root_dir = {root!r}
c.ServerApp.allow_root = True
c.LabApp.user_settings_dir = {settings!r}
c.LabApp.app_settings_dir = {app_settings!r}
"""


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
    app_settings = course_defaults(base / "app")
    shutil.copytree(ROOT / "notebooks", root, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    for name, value in SETTINGS.items():
        path = settings / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))
    config.mkdir()
    port = free_port()
    (config / "jupyter_server_config.py").write_text(SERVER_CONFIG.format(port=port, root=str(root),
                                                                          settings=str(settings),
                                                                          app_settings=str(app_settings)))
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(config), "JUPYTER_RUNTIME_DIR": str(base / "runtime"),
           "IPYTHONDIR": str(kernel_config(base / "ipython"))}
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


def course_defaults(app: Path) -> Path:
    """An application settings directory holding this checkout's jupyter/overrides.json, the file `make setup`
    copies into .venv/share/jupyter/lab/settings: JupyterLab reads its defaults there. Beside it, a link to the
    installed build (JupyterLab reads its extensions' metadata from ../static); the directory to pass as
    LabApp.app_settings_dir."""
    (app / "settings").mkdir(parents=True)
    shutil.copy(ROOT / "jupyter" / "overrides.json", app / "settings" / "overrides.json")
    (app / "static").symlink_to(LAB_STATIC)
    return app / "settings"


def kernel_config(ipython: Path) -> Path:
    """An IPython directory whose default profile holds this checkout's jupyter/ipython_kernel_config.py, the file
    `make setup` copies into .venv/etc/ipython (which the shared environment of these tests may not have yet); the
    directory, for IPYTHONDIR."""
    (ipython / "profile_default").mkdir(parents=True)
    shutil.copy(ROOT / "jupyter" / "ipython_kernel_config.py", ipython / "profile_default" / "ipython_kernel_config.py")
    return ipython


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
