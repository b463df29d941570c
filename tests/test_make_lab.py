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


def jupyter_processes(pid: int) -> list[psutil.Process]:
    """The JupyterLab processes below `pid`; a child that has already exited (a zombie not yet reaped, such as a
    short-lived helper the server started) or vanished while being read is none of them."""
    found = []
    for process in psutil.Process(pid).children(recursive=True):
        try:
            if "jupyter" in " ".join(process.cmdline()):
                found.append(process)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue
    return found


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
    lab = subprocess.Popen(["make", "lab", f"LAB_DIR={tmp_path / 'mine'}"], cwd=ROOT, env=env,
                           start_new_session=True, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
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
        assert set(json.load(kernelspecs)["kernelspecs"]) == {"labkit"}, "one obvious kernel"
        assert (tmp_path / "mine" / "00_setup.ipynb").exists(), "make lab opens the student's own copy"
        server += jupyter_processes(lab.pid)
        listening = {c.laddr.ip for p in server for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN}
        assert listening == {"127.0.0.1"}
    finally:
        os.killpg(lab.pid, signal.SIGTERM)
        lab.wait(timeout=30)
    _, alive = psutil.wait_procs(server, timeout=10)  # psutil tells a reused pid from the same process
    assert server and not alive, "JupyterLab outlived `make lab`"


def make(*args, env=None, check=True):
    result = subprocess.run(["make", "--no-print-directory", *args], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, **(env or {})})
    assert not check or result.returncode == 0, result.stdout + result.stderr
    return result


def test_setup_picks_the_cpu_build_only_where_there_is_no_nvidia_driver(tmp_path):
    dry_run = ("-n", "-W", "pyproject.toml", "setup")
    without_driver = make(*dry_run, env={"PATH": f"{tmp_path}:{os.environ['PATH']}"}).stdout
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    with_driver = make(*dry_run, env={"PATH": f"{tmp_path}:{os.environ['PATH']}"}).stdout
    if not os.path.exists("/proc/driver/nvidia/version"):
        assert "--extra-index-url https://download.pytorch.org/whl/cpu" in without_driver
        assert "no NVIDIA driver found" in without_driver
    assert "download.pytorch.org" not in with_driver and "from PyPI" in with_driver
    chosen = make(*dry_run, "TORCH_INDEX=https://download.pytorch.org/whl/cu130").stdout
    assert "--extra-index-url https://download.pytorch.org/whl/cu130" in chosen
    assert "--progress-bar off" in without_driver  # no terminal here: pip stays quiet


def test_the_students_copy_is_made_once_and_never_overwritten(tmp_path):
    mine = tmp_path / "mine"
    make(f"LAB_DIR={mine}", "copy")
    course = sorted(os.listdir(os.path.join(ROOT, "notebooks")))
    assert sorted(p for p in os.listdir(mine) if p.endswith(".ipynb")) == [p for p in course if p.endswith(".ipynb")]
    edited = mine / "03_ring_allreduce.ipynb"
    edited.write_text("my work")
    (mine / "01_training_step.ipynb").unlink()  # as if 01 were new in a git pull
    make(f"LAB_DIR={mine}", "copy")
    assert edited.read_text() == "my work" and (mine / "01_training_step.ipynb").exists()

    refreshed = make(f"LAB_DIR={mine}", "refresh", "NOTEBOOK=03_ring_allreduce").stdout
    backups = list(mine.glob("03_ring_allreduce.backup-*.ipynb"))
    assert len(backups) == 1 and backups[0].read_text() == "my work" and backups[0].name in refreshed
    with open(os.path.join(ROOT, "notebooks", "03_ring_allreduce.ipynb")) as f:
        assert edited.read_text() == f.read()
    unnamed = make(f"LAB_DIR={mine}", "refresh", check=False)
    assert unnamed.returncode != 0 and "make refresh NOTEBOOK=" in unnamed.stdout


def jupyter_command(*make_args: str) -> str:
    """The `jupyter lab` command that `make -n lab` would run, its continuation lines joined."""
    dry_run = make("-n", "lab", *make_args).stdout.replace("\\\n", " ")
    return next(line for line in dry_run.splitlines() if "jupyter lab" in line)


def test_lab_port_names_the_port_and_the_lab_still_binds_loopback_only(tmp_path):
    named = jupyter_command("LAB_PORT=9999", f"LAB_DIR={tmp_path / 'mine'}").split()
    assert "--ServerApp.port=9999" in named and "--ServerApp.port_retries=0" in named  # that port or an error
    assert [arg for arg in named if arg.startswith("--ServerApp.ip")] == ["--ServerApp.ip=127.0.0.1"]
    default = jupyter_command(f"LAB_DIR={tmp_path / 'mine'}").split()
    assert not [arg for arg in default if arg.startswith("--ServerApp.port")]  # JupyterLab's own choice, 8888
    assert "--ServerApp.ip=127.0.0.1" in default
