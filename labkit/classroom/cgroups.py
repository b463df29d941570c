"""Where this process's cgroups are, and what its memory cgroup says: the bound, and how many OOM kills it has seen.

Why: a rank killed by SIGKILL is, on a class server, most likely the kernel's out-of-memory killer enforcing the
student's memory bound (labkit.classroom's `confine`). The report that says so must read the bound from the cgroup
itself, not from a setting that may disagree with it, and tell an OOM kill from a SIGKILL sent by hand: the cgroup's
OOM kill count rises only for the former. Both cgroup versions:

- v2 (one hierarchy, /sys/fs/cgroup is cgroup2): /proc/self/cgroup's "0::/path"; memory.max, memory.events;
- v1 (a hierarchy per controller, /sys/fs/cgroup/memory ...): the line naming the controller; memory.limit_in_bytes,
  memory.oom_control.

Both OOM counters are hierarchical (the kernel counts a kill in the victim's cgroup and every ancestor), so a
kernel reading its own cgroup sees its ranks' kills. Every function takes the cgroup root and the
/proc/<pid>/cgroup file as parameters, so that tests give them a made-up tree.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CGROUP_ROOT", "PROC_SELF_CGROUP", "controller_paths", "memory_bound_nbytes", "memory_cgroup",
           "oom_kill_cause", "oom_kill_count", "read_counter", "unified"]

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
UNLIMITED_NBYTES = 1 << 62  # v1 writes "no limit" as LONG_MAX rounded to a page (9223372036854771712)
UNIFIED = ""  # controller_paths' key for the v2 hierarchy ("0::/path")


def controller_paths(proc_cgroup: Path = PROC_SELF_CGROUP) -> dict[str, str]:
    """{controller: the process's cgroup path in its hierarchy} from /proc/<pid>/cgroup ("4:memory:/a/b"); the v2
    hierarchy's path under "" (UNIFIED); {} where the file does not exist (macOS)."""
    try:
        text = proc_cgroup.read_text()
    except OSError:
        return {}
    paths: dict[str, str] = {}
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [UNIFIED]:
            paths[controller] = path
    return paths


def unified(cgroup_root: Path = CGROUP_ROOT) -> bool:
    """True where `cgroup_root` itself is a cgroup2 hierarchy (it has cgroup.controllers), as on current
    distributions; False on v1 or hybrid hosts, whose controllers each have a directory of their own."""
    return (cgroup_root / "cgroup.controllers").is_file()


def memory_cgroup(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP) -> tuple[int, Path] | None:
    """(the cgroup version, 1 or 2; the directory of the process's memory cgroup), or None where it has none
    with memory files (no memory controller, the v2 root, no cgroups at all)."""
    paths = controller_paths(proc_cgroup)
    if unified(cgroup_root):
        directory, version, probe = cgroup_root / paths.get(UNIFIED, "/").lstrip("/"), 2, "memory.max"
    elif "memory" in paths:
        directory, version, probe = cgroup_root / "memory" / paths["memory"].lstrip("/"), 1, "memory.limit_in_bytes"
    else:
        return None
    return (version, directory) if (directory / probe).is_file() else None


def read_counter(path: Path, name: str) -> int | None:
    """The number after `name` in a flat keyed file ("oom_kill 3" in memory.events), None if absent."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition(" ")
        if key == name and value.strip().isdigit():
            return int(value)
    return None


def oom_kill_count(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP) -> int | None:
    """How many processes the OOM killer has killed in the process's memory cgroup and below it (v2
    memory.events, v1 memory.oom_control: "oom_kill N"), None without a memory cgroup or that counter (v1 before
    Linux 4.13)."""
    found = memory_cgroup(cgroup_root, proc_cgroup)
    if found is None:
        return None
    version, directory = found
    return read_counter(directory / ("memory.events" if version == 2 else "memory.oom_control"), "oom_kill")


def memory_bound_nbytes(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP) -> int | None:
    """The tightest memory bound on the process: the least memory.max (v2) or memory.limit_in_bytes (v1) of its
    memory cgroup and its ancestors, None where none is set (or no memory cgroup)."""
    found = memory_cgroup(cgroup_root, proc_cgroup)
    if found is None:
        return None
    version, directory = found
    top = cgroup_root if version == 2 else cgroup_root / "memory"
    name = "memory.max" if version == 2 else "memory.limit_in_bytes"
    bounds = [_bound_nbytes(d / name) for d in [directory, *directory.parents] if d == top or top in d.parents]
    bounds = [b for b in bounds if b is not None]
    return min(bounds) if bounds else None


def _bound_nbytes(path: Path) -> int | None:
    """One cgroup's memory limit in bytes; None for "max", v1's LONG_MAX, or no such file."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit() or int(text) >= UNLIMITED_NBYTES:
        return None
    return int(text)


def oom_kill_cause(kills_before: int | None, cgroup_root: Path = CGROUP_ROOT,
                   proc_cgroup: Path = PROC_SELF_CGROUP) -> str | None:
    """Why a process of this cgroup just died of SIGKILL, when the OOM kill count rose past `kills_before` (read
    before it could have died): "the kernel's out-of-memory killer: your server's memory bound (600 MiB, set by
    your instructor) was reached; ..."; None when the count did not rise (a SIGKILL from someone), or cannot be
    read. The bound is the cgroup's own; "set by your instructor" only in a cgroup labkit.classroom made."""
    now = oom_kill_count(cgroup_root, proc_cgroup)
    if kills_before is None or now is None or now <= kills_before:
        return None
    bound = memory_bound_nbytes(cgroup_root, proc_cgroup)
    found = memory_cgroup(cgroup_root, proc_cgroup)
    if bound is None:
        reached = "the machine ran out of memory"
    elif found is not None and found[1].name.startswith("labkit-"):
        reached = f"your server's memory bound ({_mib(bound)}, set by your instructor) was reached"
    else:
        reached = f"the memory bound of this process's cgroup ({_mib(bound)}) was reached"
    return f"the kernel's out-of-memory killer: {reached}; use less memory per rank or fewer ranks"


def _mib(nbytes: int) -> str:
    """600 MiB; 1.5 GiB."""
    return f"{nbytes / 2**30:.3g} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.4g} MiB"
