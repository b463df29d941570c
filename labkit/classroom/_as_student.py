"""Running the grading process as a student: their uid, gid and groups, a fresh HOME, a time limit, nothing left.

The gradebook runs as root (it reads every student's files); a student's code must never. Each grading process is
started through util-linux's setpriv (--reuid, --regid, --init-groups: setresuid, setresgid and initgroups
before exec; --no-new-privs: no setuid program run from it gains rights), in a session of its own
(setsid), with a temporary folder of the student's as HOME and working directory.
When it exits, or when its time is up, its whole process group is killed (SIGKILL): the ranks a grader started
and a student's infinite loop, go with it. A process the student's code moves to a session of its own (setsid)
escapes the group: it then runs on as the student, with nothing of root's, until the caps of the class (cgroups)
or the instructor end it; the gradebook does not wait for it (the pipe is read without blocking).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

__all__: list[str] = []

GROUP_EXIT_SECONDS = 10.0  # a SIGKILLed process exits in milliseconds; one in uninterruptible sleep, later
OUTPUT_TAIL_CHARS = 1000  # of what the grading process printed, kept for a verdict that needs it
_PASSED_ON = ("PATH", "LANG", "LC_ALL", "TZ")  # and LABKIT_* but LABKIT_PROGRESS: the class's caps apply here too
# The gradebook runs on the class's shared server, one grading process after another, each importing torch afresh:
# a pool's start and a right solution wait on everyone's processes there, as in a student's server, so unless the
# instructor set them, it uses the class spawner's defaults (labkit.classroom.spawner). A gloo start's 10 s floor
# ran out once in CI beside other tests (a setup cell failed "did not start a rank", so an untouched exercise read
# "failed"); the longer floor only matters when starting is slow, and a hang still ends at --timeout-seconds.
SHARED_SERVER_DEFAULTS = {"LABKIT_MIN_START_SECONDS": "60", "LABKIT_GRADING_TIME_SCALE": "4"}


@dataclasses.dataclass(frozen=True)
class Student:
    """A local user whose notebooks are graded."""

    name: str
    uid: int
    gid: int
    home: Path


def local_student(name: str) -> Student:
    """The local user `name`; LookupError if there is none, PermissionError for root (uid 0)."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise LookupError(f"no local user {name!r} on this machine (getent passwd {name} finds none)") from None
    if entry.pw_uid == 0:
        raise PermissionError(f"{name!r} is root (uid 0): the gradebook never runs a student's code as root")
    return Student(name, entry.pw_uid, entry.pw_gid, Path(entry.pw_dir))


def grading_environment(home: Path) -> dict[str, str]:
    """The grading process's environment: a few of ours, the shared server's start floor and time scale unless ours
    set them, HOME and LABKIT_PROGRESS in the temporary folder."""
    env = dict(SHARED_SERVER_DEFAULTS)
    env.update({k: v for k, v in os.environ.items()
                if k in _PASSED_ON or (k.startswith("LABKIT_") and k != "LABKIT_PROGRESS")})
    labkit_root = str(Path(__file__).resolve().parents[2])  # this labkit, wherever it is installed
    env.update(HOME=str(home), LABKIT_PROGRESS=str(home / "regrade-progress.json"), PYTHONPATH=labkit_root,
               PYTHONDONTWRITEBYTECODE="1", MPLBACKEND="Agg")
    return env


def _as(student: Student) -> list[str]:
    """The command prefix that runs as the student: util-linux's setpriv (their uid, gid and groups, and no new
    privileges: no setuid program gains any), or none when we already are the student."""
    if os.geteuid() == student.uid:
        return []
    if os.geteuid() != 0:
        raise PermissionError(f"grading {student.name}'s notebooks as another user needs root (the hub's admin "
                              "rights): run the gradebook with sudo")
    if shutil.which("setpriv") is None:
        raise RuntimeError("the gradebook needs util-linux's setpriv to run a student's code as the student")
    return ["setpriv", f"--reuid={student.uid}", f"--regid={student.gid}", "--init-groups", "--no-new-privs", "--"]


@dataclasses.dataclass
class Finished:
    """What a grading process left: its JSON answer (None if none), its exit status, its output's tail."""

    answer: dict | None
    returncode: int | None
    output_tail: str
    timed_out: bool


def run_as_student(student: Student, argv: list[str], timeout_seconds: float, python: str = sys.executable) -> Finished:
    """Run `python -m labkit.classroom._regrade *argv FD` as `student` (module docstring); `python` is the course
    kernel's interpreter, which the grader's ranks run on too: every student must be able to run it."""
    home = Path(tempfile.mkdtemp(prefix=f"labkit-gradebook-{student.name}-"))
    read_fd, write_fd = os.pipe()
    try:
        os.chown(home, student.uid, student.gid) if os.geteuid() == 0 else None
        command = [*_as(student), python, "-m", "labkit.classroom._regrade", *argv, str(write_fd)]
        process = subprocess.Popen(command, cwd=home, env=grading_environment(home), pass_fds=(write_fd,),
                                   start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT)
        os.close(write_fd)
        write_fd = -1
        return _wait(process, read_fd, timeout_seconds)
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)
        shutil.rmtree(home, ignore_errors=True)  # fd-based on Linux: a link planted in it is removed, not followed


def _wait(process: subprocess.Popen, read_fd: int, timeout_seconds: float) -> Finished:
    """Wait for the grading process at most `timeout_seconds`, kill its group, and collect what it said."""
    tail: list[str] = []
    drain = threading.Thread(target=_keep_tail, args=(process.stdout, tail), daemon=True)
    drain.start()
    try:
        process.wait(timeout=timeout_seconds)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
    _kill_group(process)
    drain.join(timeout=5)  # a process that escaped the group may hold the output open: do not wait for it
    return Finished(_answer(read_fd), process.returncode, "".join(tail)[-OUTPUT_TAIL_CHARS:], timed_out)


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the grading process's group (it leads it: start_new_session), reap the process, and wait (at most
    GROUP_EXIT_SECONDS) until no member runs: the kernel delivers the signal, but a rank exits on its own time."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is gone: every process of it has exited
    process.wait()
    deadline = time.monotonic() + GROUP_EXIT_SECONDS
    while _group_running(process.pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _group_running(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (/proc/PID/stat; a zombie has exited, even if unreaped)."""
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_path.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # it exited while we looked
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def _keep_tail(stream, tail: list[str]) -> None:
    """Read `stream` to its end, keeping only its last OUTPUT_TAIL_CHARS characters in `tail` (a student's loop may
    print without end)."""
    for chunk in iter(lambda: stream.read1(65536), b""):
        tail.append(chunk.decode("utf-8", "replace"))
        while len(tail) > 1 and sum(map(len, tail[1:])) > OUTPUT_TAIL_CHARS:
            del tail[0]


def _answer(read_fd: int) -> dict | None:
    """The JSON object on the pipe, read without blocking; None if there is none whole."""
    os.set_blocking(read_fd, False)
    chunks = []
    try:
        while chunk := os.read(read_fd, 65536):
            chunks.append(chunk)
    except BlockingIOError:
        pass  # a writer still holds the pipe (a process that escaped the group): what came is all there is
    try:
        answer = json.loads(b"".join(chunks))
    except ValueError:
        return None
    return answer if isinstance(answer, dict) else None
