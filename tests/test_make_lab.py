"""`make lab`, as a new user types it: JupyterLab on 127.0.0.1 with a token, the labkit kernel inside .venv.

The test adds a config that allows root (CI runs as root) and opens no browser; `make lab` itself never
allows root."""

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def answers(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def status(url: str, token: str | None = None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"token {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_kernel_is_registered_inside_the_venv():
    spec_path = os.path.join(sys.prefix, "share", "jupyter", "kernels", "labkit", "kernel.json")
    with open(spec_path) as f:
        argv = json.load(f)["argv"]
    assert os.path.abspath(argv[0]).startswith(os.path.abspath(sys.prefix))


@pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, ".venv", ".installed")), reason="needs `make setup`")
def test_make_lab_serves_on_loopback_and_refuses_requests_without_the_token(tmp_path, port):
    (tmp_path / "jupyter_server_config.py").write_text(
        f"c.ServerApp.allow_root = True\nc.ServerApp.open_browser = False\n"
        f"c.ServerApp.port = {port}\nc.ServerApp.port_retries = 0\n"
    )
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    lab = subprocess.Popen(["make", "lab"], cwd=ROOT, env=env, start_new_session=True, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    server: list[psutil.Process] = []
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in lab.stdout], daemon=True).start()
    try:
        token, deadline = None, time.monotonic() + 120
        while token is None and time.monotonic() < deadline:
            try:
                match = re.search(rf"http://127\.0\.0\.1:{port}/lab\?token=(\w+)", lines.get(timeout=1))
            except queue.Empty:
                assert lab.poll() is None, "make lab exited early"
                continue
            token = match and match.group(1)
        assert token, "JupyterLab never printed its URL with a token"
        while not answers(port):
            assert time.monotonic() < deadline, "JupyterLab printed its URL but never answered"
            time.sleep(0.2)
        assert status(f"http://127.0.0.1:{port}/api/status") == 403
        assert status(f"http://127.0.0.1:{port}/api/status", token) == 200
        kernelspecs = urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{port}/api/kernelspecs", headers={"Authorization": f"token {token}"}))
        assert "labkit" in json.load(kernelspecs)["kernelspecs"]
        server += [p for p in psutil.Process(lab.pid).children(recursive=True) if "jupyter" in " ".join(p.cmdline())]
        listening = {c.laddr.ip for p in server for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN}
        assert listening == {"127.0.0.1"}
    finally:
        os.killpg(lab.pid, signal.SIGTERM)
        lab.wait(timeout=30)
    _, alive = psutil.wait_procs(server, timeout=10)  # psutil tells a reused pid from the same process
    assert server and not alive, "JupyterLab outlived `make lab`"
