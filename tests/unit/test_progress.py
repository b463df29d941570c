"""The progress file: every graded attempt recorded, passes kept, written atomically, never raised into a grader."""

import json
import os
import subprocess
import sys

import pytest

from labkit.exercises import progress as progress_module
from labkit.exercises.progress import EXERCISES, graded, load_progress, progress_path, record_attempt, show_progress
from labkit.exercises.verdict import Verdict


@pytest.fixture(autouse=True)
def progress_file(tmp_path, monkeypatch):
    path = tmp_path / "me" / "progress.json"
    monkeypatch.setenv("LABKIT_PROGRESS", str(path))
    return path


def test_the_file_is_where_labkit_progress_points_else_in_the_home_directory(progress_file, monkeypatch):
    assert progress_path() == progress_file
    monkeypatch.delenv("LABKIT_PROGRESS")
    monkeypatch.setenv("HOME", "/home/student")
    assert str(progress_path()) == "/home/student/.labkit/progress.json"


def test_a_pass_is_recorded_and_kept_after_a_later_failure(progress_file):
    @graded("ring_allreduce")
    def check(fn):
        return Verdict(fn(), "graded")

    assert not check(lambda: False)
    assert load_progress()["ring_allreduce"] == {"passed": False, "attempts": 1, "passed_at": None}
    assert check(lambda: True)
    assert not check(lambda: False)
    entry = json.loads(progress_file.read_text())["ring_allreduce"]
    assert entry["passed"] and entry["attempts"] == 3 and entry["passed_at"]
    # no temporary file left; the lock file (0600) stays, as a lock file must for flock to serialise
    assert sorted(p.name for p in progress_file.parent.iterdir()) == [".progress.json.lock", "progress.json"]


def test_the_courses_own_solution_is_not_recorded(progress_file):
    @graded("sharded_step")
    def check(fn):
        return Verdict(True, "graded")

    assert check(print, record=False)
    assert not progress_file.exists()


def test_the_table_lists_every_exercise_in_course_order_with_its_status():
    record_attempt("average_gradients", True)
    record_attempt("one_f_one_b", False)
    shown = show_progress("06_pipeline_parallel")
    statuses = {title: status for _, title, status in shown.rows()}
    assert len(shown.rows()) == len(EXERCISES)
    assert statuses[EXERCISES["average_gradients"][1]] == "passed"
    assert statuses[EXERCISES["one_f_one_b"][1]] == "tried 1x, not passed yet"
    assert statuses[EXERCISES["atomic_save"][1]] == "not tried"
    markdown = shown._repr_markdown_()
    assert f"1 of {len(EXERCISES)} exercises passed" in markdown and "| **06_pipeline_parallel** |" in markdown
    assert f"*As of {shown.read_at:%H:%M on %d %B %Y}, when this cell ran: run it again" in markdown  # saved, stale
    assert [row[0] for row in shown.rows()] == sorted(row[0] for row in shown.rows())


@pytest.mark.parametrize("content", ["{not json", "[]", '{"atomic_save": {"attempts": "many"}}',
                                     '{"atomic_save": 3}'])
def test_an_unreadable_file_is_kept_aside_and_never_breaks_grading(progress_file, content):
    progress_file.parent.mkdir()
    progress_file.write_text(content)
    with pytest.warns(UserWarning, match="could not read your progress file .* it is kept as .*unreadable-"):
        record_attempt("atomic_save", True)
    kept = [p for p in progress_file.parent.iterdir() if ".unreadable-" in p.name]
    assert len(kept) == 1 and kept[0].read_text() == content          # nothing the student had is lost
    assert load_progress()["atomic_save"]["passed"]


def test_an_unwritable_file_warns_and_never_breaks_grading(monkeypatch):
    monkeypatch.setenv("LABKIT_PROGRESS", os.devnull + "/progress.json")        # a directory that cannot exist
    with pytest.warns(UserWarning, match="was not saved"):
        record_attempt("atomic_save", True)


def test_kernels_grading_at_the_same_time_lose_no_attempt(progress_file):
    recorder = ("import importlib.util, sys\n"  # progress.py alone, and what it imports (labkit._private_files)
                "spec = importlib.util.spec_from_file_location('progress', sys.argv[1])\n"
                "progress = importlib.util.module_from_spec(spec); spec.loader.exec_module(progress)\n"
                "for _ in range(40): progress.record_attempt('atomic_save', False)\n")
    kernels = [subprocess.Popen([sys.executable, "-c", recorder, progress_module.__file__]) for _ in range(4)]
    assert [kernel.wait(timeout=60) for kernel in kernels] == [0] * 4
    assert load_progress()["atomic_save"]["attempts"] == 4 * 40


def test_exercises_of_another_labkit_version_are_kept(progress_file):
    progress_file.parent.mkdir()
    progress_file.write_text(json.dumps({"renamed_exercise": {"passed": True, "attempts": 2}}))
    record_attempt("atomic_save", False)
    assert json.loads(progress_file.read_text())["renamed_exercise"] == {"passed": True, "attempts": 2}


def test_running_an_untouched_stub_is_not_an_attempt(progress_file):
    @graded("megatron_f_g")
    def check(fn):
        try:
            fn()
        except NotImplementedError as error:
            return Verdict(False, f"rank 0 raised NotImplementedError: {error}.")
        return Verdict(False, "wrong")

    def stub():
        raise NotImplementedError("your turn")

    check(stub)
    assert not progress_file.exists()
    check(lambda: None)
    assert load_progress()["megatron_f_g"]["attempts"] == 1


def test_unknown_exercises_are_refused_with_the_list():
    with pytest.raises(ValueError, match="average_gradients"):
        graded("allreduce")
    with pytest.raises(ValueError, match="unknown exercise 'x'"):
        record_attempt("x", True)


def test_a_progress_file_from_before_the_renamed_notebooks_still_shows_every_attempt(progress_file):
    """Issue 26 renamed 10-13 and split two of them; the file is keyed by exercise, so a file written then reads
    as it did, under the notebooks' new names, and an old copy's show_progress("11_sharding") bolds 11_zero."""
    progress_file.parent.mkdir(parents=True)
    progress_file.write_text(json.dumps({
        "stack_map": {"passed": True, "attempts": 2, "passed_at": "2026-11-30T10:00:00+00:00"},
        "sharded_step": {"passed": False, "attempts": 3, "passed_at": None},
        "mesh_coordinates": {"passed": True, "attempts": 1, "passed_at": "2026-11-30T11:00:00+00:00"},
        "bug_zoo_fix": {"passed": False, "attempts": 1, "passed_at": None}}))
    shown = show_progress("11_sharding")
    where = {title: (notebook, status) for notebook, title, status in shown.rows()}
    assert where[EXERCISES["stack_map"][1]] == ("10_nccl_and_debugging", "passed")
    assert where[EXERCISES["sharded_step"][1]] == ("11_zero", "tried 3x, not passed yet")
    assert where[EXERCISES["mesh_coordinates"][1]] == ("13_3d_parallelism", "passed")
    assert where[EXERCISES["bug_zoo_fix"][1]] == ("15_bug_zoo", "tried 1x, not passed yet")
    assert "| **11_zero** |" in shown._repr_markdown_()
    notebooks = {os.path.splitext(name)[0] for name in os.listdir(os.path.join(os.path.dirname(__file__), "..", "..",
                                                                               "notebooks"))}
    assert {notebook for notebook, _ in EXERCISES.values()} <= notebooks       # every exercise's notebook exists
    assert not set(progress_module.RENAMED_NOTEBOOKS) & notebooks              # and no old name is left
