"""The hub's side of a student's bounds, on made-up cgroup trees (labkit.classroom, cgroups.py and _limits.py): what
/proc/self/cgroup and the cgroup files say, and which mechanism `prepare_confinement` chooses where.

A made-up tree is a folder laid out like /sys/fs/cgroup, passed as `cgroup_root`, with the files the kernel would
have made in the student's cgroup already there (cgroupfs makes them; _limits never creates a control file). The
real thing, with OOM kills, is tests/distributed/test_memory_bound.py (root only)."""

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.classroom import cgroups, prepare_confinement
from labkit.classroom._limits import cgroup_name

MiB = 2**20
V1_FILES = {"memory": ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "memory.oom_control"],
            "pids": ["pids.max"], "cpu": ["cpu.cfs_quota_us", "cpu.cfs_period_us"]}


def files(directory: Path, names, text: str = "") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        (directory / name).write_text(text)
    return directory


def proc_file(tmp_path: Path, text: str, name: str = "hub") -> Path:
    path = tmp_path / f"proc-{name}-cgroup"
    path.write_text(text)
    return path


def fake_v1(tmp_path: Path, controllers=("memory", "pids", "cpu"), user="alice") -> tuple[Path, Path]:
    """A v1 host whose hub runs in /hub of every controller, with `controllers` mounted."""
    root = tmp_path / "cgroup"
    for controller in controllers:
        files(root / controller, ["cgroup.procs"])
        files(root / controller / "hub", ["cgroup.procs"] + V1_FILES[controller])
        files(root / controller / "hub" / f"labkit-{user}", ["cgroup.procs"] + V1_FILES[controller])
    (root / "cpu" / "hub" / f"labkit-{user}" / "cpu.cfs_period_us").write_text("100000\n") if "cpu" in controllers \
        else None
    return root, proc_file(tmp_path, "".join(f"{i}:{c}:/hub\n" for i, c in enumerate(controllers, 1)) + "0::/\n")


def fake_v2(tmp_path: Path, offered="cpuset cpu io memory pids", user="alice") -> tuple[Path, Path]:
    """A v2 host offering `offered`, its hub in /system.slice/hub.service."""
    root = files(tmp_path / "cgroup", ["cgroup.controllers", "cgroup.subtree_control", "cgroup.procs"])
    (root / "cgroup.controllers").write_text(offered + "\n")
    files(root / "labkit", ["cgroup.subtree_control", "cgroup.procs"])
    files(root / "labkit" / f"labkit-{user}", ["cgroup.procs", "memory.max", "memory.swap.max", "pids.max",
                                                 "cpu.max", "memory.events"])
    return root, proc_file(tmp_path, "0::/system.slice/hub.service\n")


def test_proc_self_cgroup_is_read_per_controller():
    text = "12:cpu,cpuacct:/a\n4:memory:/process_api/x\n1:name=systemd:/s\n0::/user.slice/u.scope\n"
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"labkit-test-cgroup-{os.getpid()}"
    path.write_text(text)
    try:
        assert cgroups.controller_paths(path) == {"cpu": "/a", "cpuacct": "/a", "memory": "/process_api/x",
                                                  "name=systemd": "/s", "": "/user.slice/u.scope"}
    finally:
        path.unlink()
    assert cgroups.controller_paths(Path("/no/such/file")) == {}


def test_v1_memory_bound_is_the_tightest_of_the_cgroup_and_its_ancestors(tmp_path):
    root, proc = fake_v1(tmp_path)
    (root / "memory" / "hub" / "memory.limit_in_bytes").write_text(f"{512 * MiB}\n")
    student = root / "memory" / "hub" / "labkit-alice"
    (student / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (student / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    inside = proc_file(tmp_path, "4:memory:/hub/labkit-alice\n", "student")
    assert cgroups.memory_cgroup(root, inside) == (1, student)
    assert cgroups.memory_bound_nbytes(root, inside) == 512 * MiB
    assert cgroups.oom_kill_count(root, inside) == 3
    (student / "memory.limit_in_bytes").write_text(f"{600 * MiB}\n")
    assert cgroups.memory_bound_nbytes(root, inside) == 512 * MiB
    (student / "memory.limit_in_bytes").write_text(f"{300 * MiB}\n")
    assert cgroups.memory_bound_nbytes(root, inside) == 300 * MiB
    assert cgroups.memory_bound_nbytes(root, proc) == 512 * MiB  # the hub's own cgroup
    (root / "memory" / "hub" / "memory.limit_in_bytes").write_text("")
    assert cgroups.memory_bound_nbytes(root, proc) is None


def test_v2_memory_bound_and_oom_kills_come_from_memory_max_and_memory_events(tmp_path):
    root, _ = fake_v2(tmp_path)
    student = root / "labkit" / "labkit-alice"
    inside = proc_file(tmp_path, "0::/labkit/labkit-alice\n", "student")
    (student / "memory.max").write_text("max\n")
    (student / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 2\noom_kill 2\noom_group_kill 0\n")
    assert cgroups.memory_bound_nbytes(root, inside) is None
    assert cgroups.oom_kill_count(root, inside) == 2
    (student / "memory.max").write_text(f"{600 * MiB}\n")
    assert cgroups.memory_bound_nbytes(root, inside) == 600 * MiB


def test_no_memory_cgroup_means_no_bound_and_no_count(tmp_path):
    assert cgroups.oom_kill_count(tmp_path, proc_file(tmp_path, "")) is None
    assert cgroups.memory_bound_nbytes(tmp_path, Path("/no/such/file")) is None
    root, _ = fake_v2(tmp_path)
    assert cgroups.oom_kill_count(root, proc_file(tmp_path, "0::/\n")) is None  # the v2 root has no memory files


def test_v1_bounds_are_written_in_each_mounted_controller_under_the_callers_own_cgroup(tmp_path):
    root, proc = fake_v1(tmp_path)
    confinement = prepare_confinement("alice", 600 * MiB, 256, 1.5, cgroup_root=root, proc_cgroup=proc)
    assert confinement.mechanism == "cgroup v1" and confinement.notes == ()
    assert confinement.cgroups == tuple(root / c / "hub" / "labkit-alice" for c in ("memory", "pids", "cpu"))
    read = {name: (d / name).read_text() for d in confinement.cgroups for name in os.listdir(d)}
    assert (read["memory.limit_in_bytes"], read["memory.memsw.limit_in_bytes"]) == (str(600 * MiB),) * 2
    assert (read["pids.max"], read["cpu.cfs_quota_us"]) == ("256", "150000")
    again = prepare_confinement("alice", 700 * MiB, 256, 1.5, cgroup_root=root, proc_cgroup=proc)  # next login
    assert again.cgroups == confinement.cgroups
    assert (root / "memory" / "hub" / "labkit-alice" / "memory.limit_in_bytes").read_text() == str(700 * MiB)


def test_v1_without_a_pids_or_cpu_hierarchy_bounds_memory_and_says_what_it_could_not(tmp_path):
    root, proc = fake_v1(tmp_path, controllers=("memory",))
    confinement = prepare_confinement("alice", 600 * MiB, 256, 2, cgroup_root=root, proc_cgroup=proc)
    assert confinement.mechanism == "cgroup v1" and confinement.cgroups == (root / "memory/hub/labkit-alice",)
    assert confinement.notes == ("no pids bound: no cgroup v1 pids controller mounted",
                                 "no cpu bound: no cgroup v1 cpu controller mounted")


def test_v2_makes_the_students_cgroup_under_a_parent_of_its_own(tmp_path):
    root, proc = fake_v2(tmp_path, offered="cpuset io memory pids")
    confinement = prepare_confinement("alice", 600 * MiB, 256, 1, cgroup_root=root, proc_cgroup=proc)
    student = root / "labkit" / "labkit-alice"
    assert (confinement.mechanism, confinement.cgroups) == ("cgroup v2", (student,))
    assert confinement.notes == (f"no cpu bound: cgroup v2 at {root} offers no cpu controller",)
    assert [(student / n).read_text() for n in ("memory.max", "memory.swap.max", "pids.max")] == \
        [str(600 * MiB), "0", "256"]
    assert (root / "cgroup.subtree_control").read_text() == "+pids"  # each controller written in turn, pids last
    assert "labkit: alice's server confined by cgroup v2: memory 600 MiB, 256 processes and threads, 1 CPU cores" \
        in confinement.describe()


@pytest.mark.parametrize("tree", ["none", "v2 without memory", "v1 without memory"])
def test_without_a_memory_controller_resource_limits_stand_in_and_say_why(tmp_path, tree):
    if tree == "none":
        root, proc = tmp_path / "empty", proc_file(tmp_path, "")
        root.mkdir()
        why = "no cgroup memory controller mounted (neither cgroup v2 nor v1's memory hierarchy)"
    elif tree == "v2 without memory":
        root, proc = fake_v2(tmp_path, offered="cpu pids")
        why = f"cgroup v2 at {root} offers no memory controller (cgroup.controllers: "
    else:
        root, proc = fake_v1(tmp_path, controllers=("pids", "cpu"))
        why = "no cgroup memory controller mounted"
    confinement = prepare_confinement("alice", 600 * MiB, 256, 1, cgroup_root=root, proc_cgroup=proc)
    assert (confinement.mechanism, confinement.cgroups) == ("rlimit", ())
    assert confinement.notes[0].startswith(why) and confinement.notes[1] == "no CPU bound (resource limits have none)"


def test_the_resource_limits_are_set_in_the_process_that_enters():
    confinement = prepare_confinement("alice", 3000 * MiB, 4000, cgroup_root=Path("/no/such/root"))
    code = "import resource; print(resource.getrlimit(resource.RLIMIT_AS), resource.getrlimit(resource.RLIMIT_NPROC))"
    child = subprocess.run([sys.executable, "-c", code], preexec_fn=confinement.enter, capture_output=True, text=True,
                           check=True)
    assert child.stdout.split("\n")[0] == f"({3000 * MiB}, {3000 * MiB}) (4000, 4000)"
    assert resource.getrlimit(resource.RLIMIT_AS) != (3000 * MiB, 3000 * MiB)  # only the child's


@pytest.mark.parametrize("username, name", [("alice", "labkit-alice"), ("a.b-c", "labkit-a.b-c"),
                                            ("a_b", "labkit-a_5fb"), ("ab@x.org", "labkit-ab_40x.org"),
                                            ("../x", "labkit-.._2fx"), ("é", "labkit-_c3_a9")])
def test_each_username_gets_a_cgroup_name_of_its_own_that_is_one_path_segment(username, name):
    assert cgroup_name(username) == name


@pytest.mark.parametrize("arguments, message", [
    (("", MiB), "username='': pass the student's hub username"),
    (("alice", 0), "memory_nbytes=0: pass a whole number >= 1"),
    (("alice", MiB, 0), "max_processes=0: pass a whole number >= 1"),
    (("alice", MiB, None, -1), "cpu_cores=-1: pass a finite number > 0")])
def test_bad_bounds_are_named(tmp_path, arguments, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        prepare_confinement(*arguments, cgroup_root=tmp_path)
