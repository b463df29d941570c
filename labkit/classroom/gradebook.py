"""The instructor's gradebook: every student's "your turn" cells re-graded as they stand in their notebooks.

    sudo python -m labkit.classroom.gradebook --hub http://127.0.0.1:8000 --csv gradebook.csv
    sudo python -m labkit.classroom.gradebook --users ada grace --exercises ring_allreduce --timeout-seconds 120

For each student (listed by the hub's REST API with an admin token, from $JUPYTERHUB_API_TOKEN or --token-file,
or named with --users) and each exercise of labkit.exercises.progress.EXERCISES, the cells of the student's copy
(~/my-notebooks/) that call the exercise's grader run, after the notebook's setup cells, in a fresh process that
the student's kernel never touched, as nbgrader's autograde runs a notebook: the verdict is that process's, not
what the student's kernel or progress file says. Each process runs as the student (their uid, gid and groups,
never root), in a temporary HOME, with the progress recorded nowhere the student keeps it (record=False), for at
most --timeout-seconds: a hang is failed "timed out after N s", and its whole process group killed.

One table is printed, and written as CSV with --csv: student, exercise, passed (yes, no, unverified), re-graded
(passed, failed, not attempted: the stub untouched, timed out, unreadable: a link or a file not the student's,
missing, unverified: an exercise answered in a widget, whose answer the notebook does not keep), attempts recorded,
first passed at, what the student's progress file says, the seconds the regrade took, and a note: where the
progress file disagrees, "progress file says passed; re-graded: failed -- the re-graded verdict stands".

What it trusts. The student's notebook and progress file are read by the student's own process, without following
links, and must be the student's own files: no link a student plants makes root read anything. The student's
code runs in the grading process, as in nbgrader: it cannot reach root's rights or other students' files, but code
written to cheat (say, replacing the grader from inside the cell, or writing a verdict to the pipe) can forge its
own pass, as it can under nbgrader; the regrade defends against a progress file edited by hand, a kernel's state,
and mistakes, not against a student who attacks the grader. A process the student's code detaches (setsid)
escapes the group kill; the class's caps (cgroups) bound it.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from pathlib import Path

from labkit.classroom._as_student import Student, local_student, run_as_student
from labkit.classroom._hub import hub_users
from labkit.classroom.interpreter import class_python
from labkit.exercises.progress import EXERCISES
from labkit.tables import text_table

__all__ = ["COLUMNS", "DEFAULT_TIMEOUT_SECONDS", "grade_class", "grade_student", "main"]

COLUMNS = ("student", "exercise", "passed", "re-graded", "attempts recorded", "first passed at",
           "progress file says", "seconds", "note")
DEFAULT_TIMEOUT_SECONDS = 300.0  # per exercise: the slowest grader takes about a minute on 2 busy cores
STANDS = "the re-graded verdict stands"


def _check_python(student: Student, python: str, timeout_seconds: float) -> None:
    """RuntimeError unless `student` may run `python` from their grading process, as the grader's ranks do."""
    finished = run_as_student(student, ["python"], timeout_seconds, python)
    if (finished.answer or {}).get("status") != "runs":
        raise RuntimeError(f"{student.name} cannot run the course's Python {python} ({Path(python).resolve()}), so the "
                           "graders' ranks could not start: pass --python an interpreter every student can run (the "
                           "course kernel's), or let them reach it (its folders need o+x)")


def _progress_of(student: Student, progress_file: str, timeout_seconds: float, python: str) -> tuple[dict, str]:
    """({exercise: entry}, "" or why the file is not shown) from the student's progress file, read as them."""
    finished = run_as_student(student, ["progress", str(student.home / progress_file)], timeout_seconds, python)
    answer = finished.answer or {"status": "unreadable", "message": "the reading process said nothing"}
    if answer["status"] == "read":
        return answer["progress"], ""
    return {}, "no progress file" if answer["status"] == "missing" else f"unreadable: {answer['message']}"


def _regrade(student: Student, notebook: Path, exercise: str, timeout_seconds: float,
             python: str) -> tuple[dict, float]:
    """The grading process's answer for one exercise, and the seconds it took."""
    started = time.monotonic()
    finished = run_as_student(student, ["exercise", str(notebook), exercise], timeout_seconds, python)
    seconds = time.monotonic() - started
    if finished.timed_out:
        return {"status": "timed out", "message": f"timed out after {timeout_seconds:g} s"}, seconds
    if finished.answer is None:
        said = finished.output_tail.strip().splitlines()[-1:] or ["nothing"]
        return {"status": "failed", "message": f"the grading process exited with {finished.returncode} without "
                                               f"a verdict; it last printed: {said[0][:200]}"}, seconds
    return finished.answer, seconds


def _claim(entry: dict | None, unread: str) -> str:
    """What the progress file says of one exercise."""
    if unread:
        return unread
    if not entry or not entry.get("attempts") and not entry.get("passed"):
        return "not tried"
    return f"passed at {entry.get('passed_at')}" if entry.get("passed") else f"tried {entry['attempts']}x, not passed"


def _note(answer: dict, entry: dict | None) -> str:
    """The disagreement marker where the progress file and the regrade differ, else the verdict's message."""
    status = answer["status"]
    claimed = bool(entry and entry.get("passed"))
    if status == "unverified":
        return answer["message"]
    if claimed != (status == "passed"):
        said = "passed" if claimed else "not passed"
        return f"progress file says {said}; re-graded: {status} -- {STANDS}"
    return answer["message"] if status != "passed" else ""


def _row(student: str, exercise: str, answer: dict, entry: dict | None, unread: str, seconds: float) -> dict:
    """One line of the gradebook (COLUMNS)."""
    passed = answer["status"] == "passed"
    first = (entry or {}).get("passed_at") if passed else None
    shown = "unverified" if answer["status"] == "unverified" else "yes" if passed else "no"
    return dict(zip(COLUMNS, (student, exercise, shown, answer["status"],
                              (entry or {}).get("attempts", 0), first or "", _claim(entry, unread), f"{seconds:.1f}",
                              _note(answer, entry)), strict=True))


def _widget_answer(answer: dict, entry: dict | None) -> dict:
    """An exercise with no graded cell (notebook 10's stack map, notebook 15's diagnoses: widgets) is unverified."""
    if answer["status"] != "no cell":
        return answer
    claimed = "passed" if entry and entry.get("passed") else "not passed"
    return {"status": "unverified", "message": f"answered in a widget, which the notebook does not keep: only the "
                                               f"progress file says ({claimed}), not re-graded"}


def grade_student(student: Student, exercises: list[str], *, notebooks: str = "my-notebooks",
                  progress_file: str = ".labkit/progress.json",
                  timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS, python: str = sys.executable) -> list[dict]:
    """The gradebook's rows for one student: each exercise re-graded from their notebook (module docstring)."""
    _check_python(student, python, timeout_seconds)
    progress, unread = _progress_of(student, progress_file, timeout_seconds, python)
    rows = []
    for exercise in exercises:
        notebook = student.home / notebooks / f"{EXERCISES[exercise][0]}.ipynb"
        answer, seconds = _regrade(student, notebook, exercise, timeout_seconds, python)
        entry = progress.get(exercise)
        rows.append(_row(student.name, exercise, _widget_answer(answer, entry), entry, unread, seconds))
    return rows


def grade_class(names: list[str], exercises: list[str] | None = None, **options) -> list[dict]:
    """The gradebook's rows for every student in `names`, one after the other (`options`: grade_student's)."""
    exercises = list(EXERCISES) if exercises is None else exercises
    unknown = [e for e in exercises if e not in EXERCISES]
    if unknown:
        raise ValueError(f"unknown exercise(s) {', '.join(unknown)}: the course's are {', '.join(EXERCISES)}")
    students = [local_student(name) for name in dict.fromkeys(names)]
    return [row for student in students for row in grade_student(student, exercises, **options)]


def _table(rows: list[dict]) -> str:
    """The rows as a text table, each note cut to 100 characters (the CSV keeps it whole)."""
    return text_table(COLUMNS, [[str(r[c])[:100] for c in COLUMNS] for r in rows], align="<<<<><<><")


def _write_csv(rows: list[dict], path: Path) -> None:
    """The rows as CSV at `path` (a header line, then one line per student and exercise)."""
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    """The command line (module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m labkit.classroom.gradebook", description=__doc__.split("\n")[0])
    parser.add_argument("--users", nargs="+", default=[], metavar="NAME", help="local users to grade")
    parser.add_argument("--hub", metavar="URL", help="grade every user of this JupyterHub (GET /hub/api/users)")
    parser.add_argument("--token-file", type=Path, help="a file holding the hub's admin API token "
                                                         "(default: $JUPYTERHUB_API_TOKEN)")
    parser.add_argument("--notebooks", default="my-notebooks", help="the notebooks' folder in each home")
    parser.add_argument("--progress-file", default=".labkit/progress.json", help="the progress file, in each home")
    parser.add_argument("--exercises", nargs="+", choices=list(EXERCISES), help="these exercises only (default all)")
    parser.add_argument("--timeout-seconds", type=float, default=DEFAULT_TIMEOUT_SECONDS,
                        help="per student and exercise")
    parser.add_argument("--python", help="the course kernel's interpreter, which every student can run (default: "
                        "the hub's, labkit.classroom.interpreter.class_python)")
    parser.add_argument("--csv", type=Path, metavar="PATH", help="write the gradebook as CSV there too")
    arguments = parser.parse_args(argv)
    arguments.python = arguments.python or str(class_python())
    if not arguments.users and not arguments.hub:
        parser.error("name the students: --users NAME ... or --hub URL (with an admin token)")
    if arguments.timeout_seconds <= 0:
        parser.error(f"--timeout-seconds must be positive, not {arguments.timeout_seconds:g}")
    return arguments


def _names(arguments: argparse.Namespace) -> list[str]:
    """--users, then the hub's users."""
    if not arguments.hub:
        return arguments.users
    token = (arguments.token_file.read_text().strip() if arguments.token_file
             else os.environ.get("JUPYTERHUB_API_TOKEN", ""))
    return arguments.users + hub_users(arguments.hub, token)


def main(argv: list[str] | None = None) -> int:
    """Grade, print the table, write the CSV; 2 with a message when the input is wrong."""
    arguments = _arguments(argv)
    try:
        rows = grade_class(_names(arguments), arguments.exercises, notebooks=arguments.notebooks,
                           progress_file=arguments.progress_file, timeout_seconds=arguments.timeout_seconds,
                           python=arguments.python)
    except (LookupError, PermissionError, ValueError, RuntimeError, OSError) as wrong:
        print(f"gradebook: {wrong}", file=sys.stderr)
        return 2
    print(_table(rows))
    if arguments.csv:
        _write_csv(rows, arguments.csv)
        print(f"gradebook: {len(rows)} rows written to {arguments.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
