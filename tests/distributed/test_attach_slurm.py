"""The README's Slurm recipe for attached ranks, run as written against a real one-host Slurm (Debian's slurm-wlm:
munged, slurmctld and slurmd started here, as root, in a folder of the test's own): `salloc` an allocation, and in it
the `srun ... bash -c 'torchrun ...'` that labkit.attach prints. One host is one node, so the recipe runs with
--nodes 1; its two-node form differs only in the numbers (Slurm runs several slurmd on one host only when built
with --enable-multiple-slurmd, which Debian's is not)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import labkit
from tests.distributed.test_attach import free_port

REPO = Path(__file__).resolve().parents[2]
DAEMONS = ("munged", "slurmctld", "slurmd")


@pytest.fixture
def one_host_slurm(tmp_path):
    """SLURM_CONF of a running one-host cluster (partition `debug`, this host, its CPUs); stopped at the end."""
    if os.geteuid() != 0 or not all(shutil.which(d) for d in DAEMONS):
        message = "needs root and Debian's slurm-wlm (munged, slurmctld, slurmd)"
        if os.environ.get("CI"):
            pytest.fail(message + ": .ci/run installs it")
        pytest.skip(message)
    base = Path(tempfile_short())
    for folder in ("state", "spool", "log"):
        (base / folder).mkdir(parents=True)
    key = base / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    socket_path = base / "munge.socket"
    host = socket.gethostname()
    conf = base / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=labkit", f"SlurmctldHost={host}", "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", f"AuthInfo=socket={socket_path}", "CredType=cred/munge",
        f"StateSaveLocation={base}/state", f"SlurmdSpoolDir={base}/spool",
        f"SlurmctldPidFile={base}/slurmctld.pid", f"SlurmdPidFile={base}/slurmd.pid",
        f"SlurmctldLogFile={base}/log/slurmctld.log", f"SlurmdLogFile={base}/log/slurmd.log",
        f"SlurmctldPort={free_port('127.0.0.1')}", f"SlurmdPort={free_port('127.0.0.1')}",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU", "ReturnToService=2", "MpiDefault=none", "JobCompType=jobcomp/none",
        "AccountingStorageType=accounting_storage/none",
        f"NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""]))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    try:
        subprocess.run(["munged", "--force", "-S", str(socket_path), "--key-file", str(key), "--pid-file",
                        f"{base}/munged.pid", "--log-file", f"{base}/log/munged.log", "--seed-file",
                        f"{base}/munge.seed"], check=True, env=env)
        subprocess.run(["slurmctld"], check=True, env=env)
        subprocess.run(["slurmd"], check=True, env=env)
        deadline = time.monotonic() + 30
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True,
                                           text=True).stdout and time.monotonic() < deadline:
            time.sleep(0.5)
        yield env
    finally:
        for name in ("slurmd", "slurmctld", "munged"):
            pid_file = base / f"{name}.pid"
            if pid_file.exists():
                try:
                    os.kill(int(pid_file.read_text()), signal.SIGTERM)
                except (ProcessLookupError, ValueError):
                    pass
        time.sleep(0.5)
        shutil.rmtree(base, ignore_errors=True)


def tempfile_short() -> str:
    """A fresh folder with a short path: munge's socket path must fit a sockaddr_un (108 bytes)."""
    import tempfile
    return tempfile.mkdtemp(prefix="lkslurm-", dir="/tmp")


def test_the_slurm_recipe_attaches_ranks_from_an_allocation(one_host_slurm, tmp_path):
    port = free_port("127.0.0.1")
    env = {**one_host_slurm, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    # labkit.attach prints this command, in shell lines of 100 characters, and then waits: the same code gives it
    # here, before attach listens, and it runs as printed (its lines joined by the shell)
    printed = labkit.launch.attach_commands(2, 1, connect=f"127.0.0.1:{port}")
    command = printed[printed.index("  srun"):]
    assert command.lstrip().startswith("srun --nodes 1 --ntasks-per-node 1 bash -c 'torchrun --nnodes 1")
    assert command.count("\n") >= 1
    log = open(tmp_path / "salloc.log", "wb")
    job = subprocess.Popen(["salloc", "--nodes", "1", "bash", "-c", command], env=env, cwd=REPO, stdout=log,
                           stderr=subprocess.STDOUT, start_new_session=True)
    try:
        labkit.attach(world_size=2, nodes=1, host="127.0.0.1", port=port, timeout=120)
        assert labkit.run(lambda: os.environ["SLURM_JOB_ID"] != "" and labkit.rank(), world_size=2) == [0, 1]
        labkit.shutdown()
        assert job.wait(60) == 0, (tmp_path / "salloc.log").read_text()
    finally:
        labkit.shutdown()
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
