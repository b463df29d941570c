"""The progress file is the student's alone (issue 28, "Other users"): another local user can neither freeze a grader
with a flock nor make the student's table show their passes.

Probed at 919f816 as uid 65534 beside the student: ~/.labkit was created 0755, so `flock ~/.labkit sleep 60`
blocked every grader with no timeout; a progress file planted in a shared folder showed someone else's "3 of 13
passed" and the student's attempts were never saved. The other-user tests run as uid 65534 (as_another_user)."""

import fcntl
import json
import os
import stat
import subprocess
import sys

import pytest

from labkit.exercises import progress
from labkit.exercises.progress import EXERCISES, load_progress, record_attempt, show_progress

THREE_PASSES = {name: {"passed": True, "attempts": 1, "passed_at": "2026-12-01T10:00:00+00:00"}
                for name in ("average_gradients", "naive_allreduce", "ring_allreduce")}


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def record_in_a_fresh_kernel(env: dict) -> subprocess.CompletedProcess:
    """One attempt recorded by a fresh interpreter, as a grader in another notebook would; killed after 30 s."""
    code = "from labkit.exercises.progress import record_attempt; record_attempt('stack_map', False)"
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=30)


def test_what_labkit_creates_only_the_student_can_open(tmp_path, monkeypatch):
    monkeypatch.delenv("LABKIT_PROGRESS")
    monkeypatch.setenv("HOME", str(tmp_path))
    record_attempt("stack_map", True)
    folder = tmp_path / ".labkit"
    assert mode(folder) == 0o700                                             # at 919f816: 0755
    assert (mode(folder / "progress.json"), mode(folder / ".progress.json.lock")) == (0o600, 0o600)


def test_another_users_flock_on_the_labkit_folder_cannot_be_taken(shared_folder, another_users_flock):
    home = shared_folder / "student"
    home.mkdir(mode=0o755)  # a home folder others may list, as most are
    env = {"HOME": str(home), "LABKIT_PROGRESS": ""}
    assert record_in_a_fresh_kernel(env).returncode == 0
    assert not another_users_flock(home / ".labkit")                         # 0700: they cannot open it
    assert not another_users_flock(home / ".labkit" / ".progress.json.lock")
    assert record_in_a_fresh_kernel(env).returncode == 0
    assert json.loads((home / ".labkit" / "progress.json").read_text())["stack_map"]["attempts"] == 2


def test_another_users_flock_on_a_folder_they_can_open_blocks_no_grader(shared_folder, another_users_flock):
    """A progress folder of the student's own that others may open (LABKIT_PROGRESS=$HOME/bob.json, the README's
    class under one account): their flock on the folder is no lock of labkit's, and the lock file is 0600."""
    folder = shared_folder / "student"
    folder.mkdir(mode=0o755)
    env = {"LABKIT_PROGRESS": str(folder / "bob.json")}
    assert record_in_a_fresh_kernel(env).returncode == 0
    assert another_users_flock(folder)                                       # held, as `flock ~/.labkit sleep 60`
    assert not another_users_flock(folder / ".bob.json.lock")
    assert record_in_a_fresh_kernel(env).returncode == 0                     # at 919f816: blocked, past 30 s
    assert json.loads((folder / "bob.json").read_text())["stack_map"]["attempts"] == 2


def test_a_lock_held_past_the_bound_is_said_and_grading_goes_on(tmp_path, monkeypatch):
    path = tmp_path / "me" / "progress.json"
    monkeypatch.setenv("LABKIT_PROGRESS", str(path))
    monkeypatch.setattr(progress, "LOCK_WAIT_SECONDS", 0.2)
    record_attempt("stack_map", False)
    stuck = os.open(path.parent / ".progress.json.lock", os.O_RDONLY)       # another open file: flock(2) conflicts
    try:
        fcntl.flock(stuck, fcntl.LOCK_EX)
        with pytest.warns(UserWarning, match=r"progress was not saved .*another process has held .*"
                                             r"\.progress\.json\.lock for over 0\.2 s"):
            record_attempt("stack_map", False)
    finally:
        os.close(stuck)
    assert load_progress()["stack_map"]["attempts"] == 1


def plant_progress(as_another_user, folder, *, folder_mode: str) -> None:
    """Another user makes `folder` (mode `folder_mode`) and writes three passes into progress.json there."""
    done = as_another_user(["sh", "-c", f'mkdir -m {folder_mode} "$0" && cat > "$0/progress.json"', str(folder)],
                           input=json.dumps(THREE_PASSES))
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("folder_mode", ["1777", "0755"])
def test_a_progress_file_planted_in_a_shared_folder_is_not_used(as_another_user, shared_folder, monkeypatch,
                                                                folder_mode):
    why = rf"belongs to nobody \(uid 65534\), not you \(root \(uid 0\)\), mode {folder_mode}: another user could"
    folder = shared_folder / "class"
    plant_progress(as_another_user, folder, folder_mode=folder_mode)
    monkeypatch.setenv("LABKIT_PROGRESS", str(folder / "progress.json"))
    with pytest.warns(UserWarning, match=f"your progress is not read from .*progress folder .*class .*{why}"):
        shown = show_progress()
    assert shown.summary().startswith(f"0 of {len(EXERCISES)} exercises passed")           # at 919f816: "3 of 13"
    with pytest.warns(UserWarning, match=f"your progress was not saved .*{why}.* a folder of your own"):
        record_attempt("stack_map", True)
    assert json.loads((folder / "progress.json").read_text()) == THREE_PASSES   # theirs, untouched


def test_a_progress_folder_that_is_another_users_link_is_not_followed(as_another_user, shared_folder, monkeypatch):
    theirs = shared_folder / "theirs"
    plant_progress(as_another_user, theirs, folder_mode="777")
    assert as_another_user(["ln", "-s", str(theirs), str(shared_folder / "class")]).returncode == 0
    monkeypatch.setenv("LABKIT_PROGRESS", str(shared_folder / "class" / "progress.json"))
    with pytest.warns(UserWarning, match="is a symbolic link made by nobody"):
        assert show_progress().summary().startswith(f"0 of {len(EXERCISES)} exercises passed")
