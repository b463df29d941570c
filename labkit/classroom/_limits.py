"""Each student's server in a box of its own: a cgroup (memory, processes, CPU) or, lacking one, resource limits.

Why: thirty students share one machine, and a rank that allocates without end must be killed by the kernel before it
takes memory from the other twenty-nine. The hub's spawner confines each student's single-user server as it starts,
and everything that server starts (kernels, labkit's fork server, the ranks) inherits the box:

- cgroup v2 (/sys/fs/cgroup is cgroup2 with the memory controller): <root>/labkit/labkit-<user> by default, with
  memory.max, memory.swap.max = 0, pids.max and cpu.max. A cgroup with processes cannot hand controllers to its
  children ("no internal processes"), so the students' cgroups live under a parent of their own (`parent=`, e.g. a
  systemd-delegated "/system.slice/jupyterhub.service/students"), never under the hub's own cgroup;
- cgroup v1 (a directory per controller): labkit-<user> under the calling process's own cgroup of each controller,
  with memory.limit_in_bytes (and memory.memsw.limit_in_bytes, so that swap is no way out), pids.max and
  cpu.cfs_quota_us; memory is required, pids and cpu are used where mounted and writable;
- neither: setrlimit, RLIMIT_AS (address space per process, not per student: a weaker bound) and RLIMIT_NPROC (per
  user). No CPU bound then.

`prepare_confinement` does the work that may fail (directories, limits) and says which mechanism it chose and what
it could not set; `Confinement.enter` only writes a pid or sets limits, small enough for a preexec_fn between fork
and exec; `confine` is both at once. A second login finds the student's cgroup and reuses it, with the limits set
anew. `release` removes it after the server stops. All run as root, in the hub's process or its child.
"""

from __future__ import annotations

import os
import resource
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from labkit.checks import number, whole
from labkit.classroom.cgroups import CGROUP_ROOT, PROC_SELF_CGROUP, controller_paths, unified

__all__ = []

V2_PARENT = "/labkit"  # the students' cgroups' parent on cgroup v2, under the root
CPU_PERIOD_MICROSECONDS = 100_000  # cpu.max's and cfs_period_us's default period
RELEASE_WAIT_SECONDS = 5.0  # after SIGKILL, how long the last processes get to leave the cgroup
_V1_FILES = {"memory": "memory.limit_in_bytes", "pids": "pids.max", "cpu": "cpu.cfs_quota_us"}
_SAFE = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-")


class _Unusable(Exception):
    """This cgroup version cannot confine here; the message says why (it goes into the fallback's notes)."""


@dataclass(frozen=True)
class Confinement:
    """How a student's server is bounded: `mechanism` ("cgroup v2", "cgroup v1" or "rlimit"), the cgroup
    directories it joins (none under rlimit), its bounds, and `notes`: each bound that could not be set, and why."""

    mechanism: str
    username: str
    memory_nbytes: int
    max_processes: int | None = None
    cpu_cores: float | None = None
    cgroups: tuple[Path, ...] = ()
    notes: tuple[str, ...] = field(default=())

    def enter(self, pid: int | None = None) -> None:
        """Put process `pid` (default: this one) in the student's cgroups, or under the resource limits. Nothing
        but writes and setrlimit: safe in a preexec_fn, before the process drops to the student's uid."""
        pid = os.getpid() if pid is None else pid
        for directory in self.cgroups:
            _write(directory / "cgroup.procs", str(pid))
        if self.mechanism == "rlimit":
            resource.prlimit(pid, resource.RLIMIT_AS, (self.memory_nbytes, self.memory_nbytes))
            if self.max_processes is not None:
                resource.prlimit(pid, resource.RLIMIT_NPROC, (self.max_processes, self.max_processes))

    def describe(self) -> str:
        """One line for the hub's log: the mechanism, the bounds, where, and what could not be set."""
        bounds = [f"memory {self.memory_nbytes / 2**20:g} MiB"]
        bounds += [f"{self.max_processes} processes and threads"] if self.max_processes is not None else []
        bounds += [f"{self.cpu_cores:g} CPU cores"] if self.cpu_cores is not None else []
        where = f" in {', '.join(map(str, self.cgroups))}" if self.cgroups else ""
        notes = f"; {'; '.join(self.notes)}" if self.notes else ""
        return f"labkit: {self.username}'s server confined by {self.mechanism}: {', '.join(bounds)}{where}{notes}"


def cgroup_name(username: str) -> str:
    """'labkit-<username>', every character but letters, digits, '.' and '-' written as _xx (its UTF-8 bytes in
    hex): hub usernames may hold '@' or '/', and two users must never share a name ('a_b' is 'labkit-a_5fb')."""
    if not isinstance(username, str) or not username:
        raise ValueError(f"username={username!r}: pass the student's hub username, a non-empty string.")
    return "labkit-" + "".join(c if c in _SAFE else "".join(f"_{b:02x}" for b in c.encode()) for c in username)


def prepare_confinement(username: str, memory_nbytes: int, max_processes: int | None = None,
                        cpu_cores: float | None = None, *, parent: str | None = None,
                        cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP) -> Confinement:
    """Make (or find) `username`'s cgroup with these bounds and return how to enter it; where no cgroup version
    can, a Confinement by resource limits, whose notes say why. `max_processes` counts threads too (the pids
    controller counts tasks, RLIMIT_NPROC a user's threads); `parent`: on v2, the cgroup the students' cgroups go
    under (default "/labkit"; it must hold no process); on v1, under the caller's own cgroups when None."""
    memory_nbytes = whole("memory_nbytes", memory_nbytes)
    max_processes = None if max_processes is None else whole("max_processes", max_processes)
    cpu_cores = None if cpu_cores is None else number("cpu_cores", cpu_cores, minimum=0.0, inclusive=False)
    bounds = Confinement("", username, memory_nbytes, max_processes, cpu_cores)
    name, root = cgroup_name(username), Path(cgroup_root)
    try:
        if unified(root):
            return _prepare_v2(bounds, _v2_directory(name, root, parent), root)
        return _prepare_v1(bounds, _v1_directories(name, root, Path(proc_cgroup), parent))
    except _Unusable as why:
        notes = [str(why)] + (["no CPU bound (resource limits have none)"] if cpu_cores is not None else [])
        return Confinement("rlimit", username, memory_nbytes, max_processes, cpu_cores, (), tuple(notes))


def confine(username: str, memory_nbytes: int, max_processes: int | None = None, cpu_cores: float | None = None,
            **where) -> Confinement:
    """`prepare_confinement`, then `enter` with this process: the spawner's preexec_fn in one call (`where`:
    prepare_confinement's keywords). Prefer preparing in the hub and entering in the child, where a log line
    about the mechanism can be written safely."""
    confinement = prepare_confinement(username, memory_nbytes, max_processes, cpu_cores, **where)
    confinement.enter()
    return confinement


def release(username: str, *, parent: str | None = None, cgroup_root: Path = CGROUP_ROOT,
            proc_cgroup: Path = PROC_SELF_CGROUP, wait_seconds: float = RELEASE_WAIT_SECONDS) -> list[Path]:
    """After `username`'s server stopped: kill what is left in their cgroups (a rank that outlived its kernel),
    wait up to `wait_seconds` for them to be empty, and remove them. Returns the directories removed; one still
    busy after the wait raises OSError naming it. Nothing to do (no such cgroup, rlimit hosts) returns []."""
    name, root = cgroup_name(username), Path(cgroup_root)
    if unified(root):
        directories = [_v2_directory(name, root, parent)]
    else:
        directories = list(_v1_directories(name, root, Path(proc_cgroup), parent).values())
    removed = []
    for directory in (d for d in directories if d.is_dir()):
        _empty(directory, wait_seconds)
        directory.rmdir()
        removed.append(directory)
    return removed


# ---- cgroup v2 ----------------------------------------------------------------------------------------------------

def _v2_directory(name: str, root: Path, parent: str | None) -> Path:
    return root / (parent or V2_PARENT).strip("/") / name


def _prepare_v2(bounds: Confinement, directory: Path, root: Path) -> Confinement:
    """The student's v2 cgroup: memory required, pids and cpu where the root offers them."""
    offered = set(_read(root / "cgroup.controllers").split())
    wanted = ["memory"] + [c for c, v in (("pids", bounds.max_processes), ("cpu", bounds.cpu_cores)) if v is not None]
    if "memory" not in offered:
        raise _Unusable(f"cgroup v2 at {root} offers no memory controller (cgroup.controllers: {' '.join(offered)})")
    notes = [f"no {c} bound: cgroup v2 at {root} offers no {c} controller" for c in wanted if c not in offered]
    usable = [c for c in wanted if c in offered]
    steps = directory.parent.relative_to(root).parts
    for depth in range(len(steps) + 1):  # the root, then each cgroup down to the students' parent
        _enable(root.joinpath(*steps[:depth]), usable)
    directory.mkdir(parents=False, exist_ok=True)
    _set(directory / "memory.max", str(bounds.memory_nbytes), "memory")
    notes += _try(directory / "memory.swap.max", "0", "swap is not bounded")
    if "pids" in usable:
        notes += _try(directory / "pids.max", str(bounds.max_processes), "no process bound")
    if "cpu" in usable:
        quota = max(1000, round(bounds.cpu_cores * CPU_PERIOD_MICROSECONDS))
        notes += _try(directory / "cpu.max", f"{quota} {CPU_PERIOD_MICROSECONDS}", "no CPU bound")
    return _with(bounds, "cgroup v2", (directory,), notes)


def _enable(directory: Path, controllers: list[str]) -> None:
    """Hand `controllers` to `directory`'s children (cgroup.subtree_control), creating it if need be; memory's
    refusal (EBUSY: the directory holds processes) makes v2 unusable, the others' only lose their bound."""
    directory.mkdir(exist_ok=True)
    enabled = set(_read(directory / "cgroup.subtree_control").split())
    for controller in [c for c in controllers if c not in enabled]:
        try:
            _write(directory / "cgroup.subtree_control", f"+{controller}")
        except OSError as error:
            if controller == "memory":
                raise _Unusable(f"cgroup v2: cannot enable memory for the children of {directory} ({error}; a cgroup "
                                "holding processes cannot: pass parent= a delegated cgroup without any)") from error
            controllers.remove(controller)


# ---- cgroup v1 ----------------------------------------------------------------------------------------------------

def _v1_directories(name: str, root: Path, proc_cgroup: Path, parent: str | None) -> dict[str, Path]:
    """{controller: the student's directory} for the v1 controllers mounted under `root` (memory, pids, cpu)."""
    own = controller_paths(proc_cgroup)
    found = {}
    for controller in _V1_FILES:
        mount = root / controller
        if (mount / "cgroup.procs").is_file() and (controller in own or parent is not None):
            found[controller] = mount / (parent or own[controller]).strip("/") / name
    return found


def _prepare_v1(bounds: Confinement, directories: dict[str, Path]) -> Confinement:
    """The student's v1 cgroups: memory required, pids and cpu where mounted and writable."""
    if "memory" not in directories:
        raise _Unusable("no cgroup memory controller mounted (neither cgroup v2 nor v1's memory hierarchy)")
    values = {"memory": bounds.memory_nbytes, "pids": bounds.max_processes, "cpu": bounds.cpu_cores}
    joined, notes = [], []
    for controller, directory in directories.items():
        if values[controller] is None:
            continue
        try:
            directory.mkdir(exist_ok=True)
            _set_v1(controller, directory, values[controller])
        except OSError as error:
            if controller == "memory":
                raise _Unusable(f"cgroup v1: cannot bound memory in {directory} ({error})") from error
            notes.append(f"no {controller} bound: cgroup v1 refused {directory} ({error})")
            continue
        joined.append(directory)
    notes += _try(directories["memory"] / "memory.memsw.limit_in_bytes", str(bounds.memory_nbytes),
                      "swap is not bounded")
    notes += [f"no {c} bound: no cgroup v1 {c} controller mounted" for c in ("pids", "cpu")
              if values[c] is not None and c not in directories]
    return _with(bounds, "cgroup v1", tuple(joined), notes)


def _set_v1(controller: str, directory: Path, value) -> None:
    if controller == "cpu":
        period = int(_read(directory / "cpu.cfs_period_us") or CPU_PERIOD_MICROSECONDS)
        value = max(1000, round(value * period))
    _set(directory / _V1_FILES[controller], str(value), controller)


# ---- files ---------------------------------------------------------------------------------------------------------

def _with(bounds: Confinement, mechanism: str, cgroups: tuple[Path, ...], notes: list[str]) -> Confinement:
    return Confinement(mechanism, bounds.username, bounds.memory_nbytes, bounds.max_processes, bounds.cpu_cores,
                       cgroups, tuple(notes))


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _write(path: Path, text: str) -> None:
    """Write a control file that must exist: cgroupfs makes its files itself, and O_CREAT would hide a missing
    controller behind a plain file of our own."""
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)  # as the shell's `echo 1 > file` does
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _set(path: Path, text: str, what: str) -> None:
    """`_write`, with the file and the value in the error."""
    try:
        _write(path, text)
    except OSError as error:
        raise OSError(error.errno, f"cannot set the {what} bound: writing {text} to {path}: {error.strerror}") from None


def _try(path: Path, text: str, otherwise: str) -> list[str]:
    """`_write` where the file may be missing (no swap accounting): [] when it worked, else one note."""
    try:
        _write(path, text)
        return []
    except OSError as error:
        return [f"{otherwise} ({path.name}: {error.strerror})"]


def _empty(directory: Path, wait_seconds: float) -> None:
    """SIGKILL every process left in `directory` until none is; OSError if some remain after `wait_seconds`."""
    deadline = time.monotonic() + wait_seconds
    while pids := [int(p) for p in _read(directory / "cgroup.procs").split()]:
        if time.monotonic() > deadline:
            raise OSError(f"{directory} still holds processes {pids} after {wait_seconds:g} s: not removed")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
