"""Two students on one server, each confined as the hub's spawner confines them (labkit.classroom.confine in the
child before it starts the kernel): one student's rank allocates past their memory bound and is killed by the
kernel's OOM killer, their call fails saying so, and the other student's calls, running all the while, succeed.

Root only (making cgroups needs it; CI runs as root), and a host with a memory cgroup (cgroup v2 or v1's memory
hierarchy); skipped with the reason otherwise. Sized for 2 shared cores: two kernels of 2 ranks each; the bound,
600 MiB, is about twice what a kernel, its fork server and 2 idle ranks use here (306 MiB at most, measured with
memory.max_usage_in_bytes), and the runaway rank grows by 50 MiB a step. The test waits on events (a line printed,
a process ending), never on a duration; its deadlines only keep a broken run from hanging."""

import functools
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from labkit.classroom import confine, prepare_confinement, release
from labkit.classroom.cgroups import read_counter

ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20
BOUND_NBYTES = 600 * MiB
MAX_PROCESSES = 1024  # tasks: the kernel, the fork server, 2 ranks and their threads
CPU_CORES = 1.0
DEADLINE_SECONDS = 240  # a broken run fails here instead of hanging; a passing one ends on its events

RUNAWAY = """
    import labkit, torch.distributed as dist
    def grow():
        if labkit.rank() == 1:
            blocks = []
            while True:  # 50 MiB a step, each page written, until the kernel says no
                blocks.append(bytearray(b"\\1") * (50 * 2**20))
        dist.barrier()  # rank 0 waits for rank 1, which never comes
    try:
        labkit.run(grow, world_size=2, timeout=120)
    except labkit.RankError as error:
        print("ERROR:", error)
    """

STEADY = """
    import os, signal, sys, torch, torch.distributed as dist, labkit
    def total():
        t = torch.ones(1)
        dist.all_reduce(t)
        return t.item()
    calls = 0
    while True:
        assert labkit.run(total, world_size=2) == [2.0, 2.0]
        calls += 1
        print("call", calls, flush=True)
        if os.path.exists(sys.argv[1]):
            break
    def killed():  # a SIGKILL that is no OOM kill: the count did not rise, so no word of memory bounds
        if labkit.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()
    try:
        labkit.run(killed, world_size=2, timeout=60)
    except labkit.RankError as error:
        print("ERROR:", error)
    """


def memory_cgroups_or_skip() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to make cgroups (CI runs as root)")
    probe = prepare_confinement(f"test-probe-{os.getpid()}", BOUND_NBYTES)
    release(f"test-probe-{os.getpid()}")
    if probe.mechanism == "rlimit":
        pytest.skip(f"this host has no memory cgroup to bound a student's server: {probe.notes[0]}")


def start_student(username: str, code: str, *argv: str) -> subprocess.Popen:
    """A student's kernel, as the spawner starts it: confined in the child, then the kernel's code."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *argv], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)},
                            preexec_fn=functools.partial(confine, username, BOUND_NBYTES, MAX_PROCESSES, CPU_CORES))


def first_call(process: subprocess.Popen) -> str:
    """What `process` printed up to its line "call 1" (after the backend's note), or up to its end."""
    lines = []
    while (line := process.stdout.readline()) and not line.startswith("call 1"):
        lines.append(line)
    return "".join(lines) + line


def wait_until_empty(directories: tuple[Path, ...]) -> list[int]:
    """The processes left in the students' cgroups once their kernels ended: their ranks end with them."""
    deadline = time.monotonic() + 30
    while (left := [int(p) for d in directories for p in (d / "cgroup.procs").read_text().split()]) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_a_rank_past_its_students_memory_bound_is_killed_and_said_so_while_another_student_works(tmp_path):
    memory_cgroups_or_skip()
    started = time.monotonic()
    runaway_user, steady_user = f"test-runaway-{os.getpid()}", f"test-steady-{os.getpid()}"
    done = tmp_path / "runaway-finished"
    steady, runaway = start_student(steady_user, STEADY, str(done)), None
    try:
        seen = first_call(steady)
        assert seen.endswith("call 1\n"), seen  # the steady student's ranks are up before the other's start
        runaway = start_student(runaway_user, RUNAWAY)
        runaway_out, _ = runaway.communicate(timeout=DEADLINE_SECONDS)
        done.touch()
        steady_out, _ = steady.communicate(timeout=DEADLINE_SECONDS)
    finally:
        for process in (p for p in (steady, runaway) if p is not None and p.poll() is None):
            process.kill()
            process.communicate()
    elapsed = time.monotonic() - started
    again = prepare_confinement(runaway_user, BOUND_NBYTES, MAX_PROCESSES, CPU_CORES)  # a second login: the same
    runaway_cgroups = again.cgroups
    steady_cgroups = prepare_confinement(steady_user, BOUND_NBYTES, MAX_PROCESSES, CPU_CORES).cgroups
    try:
        assert ("--- root cause, rank 1: process killed by SIGKILL from the kernel's out-of-memory killer: your "
                "server's memory bound (600 MiB, set by your instructor) was reached; use less memory per rank or "
                "fewer ranks\n") in runaway_out, runaway_out
        assert "ERROR: ranks 0-1 of 2 failed." in runaway_out, runaway_out  # rank 0's gloo error follows on
        assert steady.returncode == 0 and runaway.returncode == 0, runaway_out + steady_out
        calls = 1 + sum(line.startswith("call ") for line in steady_out.splitlines())  # each one right, beside
        # the other student's rank growing and dying: the loop asserts every result
        assert "root cause, rank 1: process killed by SIGKILL (SIGKILL from outside often means" in steady_out, \
            steady_out
        assert "out-of-memory killer" not in steady_out, steady_out
        memory = runaway_cgroups[0]
        counts = [read_counter(memory / name, "oom_kill") for name in ("memory.events", "memory.oom_control")]
        assert [c for c in counts if c is not None] == [1], counts  # the runaway rank, and nothing else
        steady_memory = steady_cgroups[0]
        assert [read_counter(steady_memory / n, "oom_kill") for n in ("memory.events", "memory.oom_control")] \
            in ([0, None], [None, 0])
        assert wait_until_empty(runaway_cgroups + steady_cgroups) == []
    finally:
        removed = release(runaway_user) + release(steady_user)
    assert sorted(removed) == sorted(runaway_cgroups + steady_cgroups)
    assert not any(d.exists() for d in removed)
    print(f"memory bound test: {elapsed:.1f} s, {calls} steady calls beside it; {again.describe()}")
