"""A progress file that is not progress never breaks a grader (issue 28, "Bad input that breaks everything").

Probed at 919f816: {"attempts": 1e400} raised OverflowError and a 100,000-deep nesting RecursionError out of
show_progress() and out of every grader (check_stack_map({}) raised instead of giving its verdict); a FIFO at the
path blocked every grader forever; a symbolic link to /dev/zero read until memory ran out. Whatever the file holds,
it is set aside as progress.json.unreadable-<time> with one warning, and the grader gives its verdict."""

import json
import os
import subprocess
import sys

import pytest

from labkit.exercises import check_stack_map
from labkit.exercises.progress import EXERCISES, load_progress, show_progress

CONTENTS = {
    "attempts past a float's range": '{"stack_map": {"passed": true, "attempts": 1e400}}',
    "lists 100,000 deep": "[" * 100_000 + "]" * 100_000,
    "objects 100,000 deep": '{"a": ' * 100_000 + "1" + "}" * 100_000,
    "valid progress padded past 3 MB": '{"stack_map": {"passed": true, "attempts": 1}}' + " " * (3 * 2**20),
}


@pytest.fixture
def progress_file(tmp_path, monkeypatch):
    path = tmp_path / "me" / "progress.json"
    path.parent.mkdir(mode=0o700)
    monkeypatch.setenv("LABKIT_PROGRESS", str(path))
    return path


def set_aside(folder) -> list:
    return [p for p in folder.iterdir() if ".unreadable-" in p.name]


@pytest.mark.parametrize("content", CONTENTS.values(), ids=CONTENTS)
def test_show_progress_and_a_grader_go_on_and_the_file_is_kept_aside(progress_file, content):
    progress_file.write_text(content)
    with pytest.warns(UserWarning, match="could not read your progress file .* it is kept as .*unreadable-"):
        assert show_progress().summary().startswith(f"0 of {len(EXERCISES)} exercises passed")
    kept = set_aside(progress_file.parent)
    assert len(kept) == 1 and kept[0].read_text() == content              # nothing the student had is lost
    progress_file.write_text(content)
    with pytest.warns(UserWarning, match="could not read your progress file"):
        verdict = check_stack_map({})                                     # its verdict, not the file's error
    assert not verdict and "still open" in verdict.message
    assert load_progress()["stack_map"] == {"passed": False, "attempts": 1, "passed_at": None}


RUN_AND_GRADE = """
import resource, warnings
resource.setrlimit(resource.RLIMIT_DATA, (2**30, 2**30))  # reading /dev/zero whole ends in MemoryError, not swap
from labkit.exercises import check_stack_map
from labkit.exercises.progress import show_progress
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    print(show_progress().summary())
    print(bool(check_stack_map({})))
print("warned:", " | ".join(str(w.message) for w in caught))
"""


def run_and_grade(progress_file) -> str:
    """show_progress() and a grader in a fresh interpreter (one that blocks or fills its memory must not take the
    test down with it); killed after 60 s. Its output."""
    done = subprocess.run([sys.executable, "-c", RUN_AND_GRADE], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "LABKIT_PROGRESS": str(progress_file)})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs as on POSIX")
def test_a_fifo_at_the_path_is_set_aside_not_waited_on(progress_file):
    os.mkfifo(progress_file)
    shown = run_and_grade(progress_file)
    assert f"0 of {len(EXERCISES)} exercises passed" in shown and "not a regular file but a FIFO" in shown, shown
    (kept,) = set_aside(progress_file.parent)
    assert kept.is_fifo() and json.loads(progress_file.read_text())["stack_map"]["attempts"] == 1


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_link_to_dev_zero_is_set_aside_not_read(progress_file):
    progress_file.symlink_to("/dev/zero")
    shown = run_and_grade(progress_file)
    assert f"0 of {len(EXERCISES)} exercises passed" in shown and "is a symbolic link (to /dev/zero)" in shown, shown
    (kept,) = set_aside(progress_file.parent)
    assert os.readlink(kept) == "/dev/zero" and json.loads(progress_file.read_text())["stack_map"]["attempts"] == 1

