"""The instructor's gradebook (labkit.classroom.gradebook) on real local users, as root, as CI runs.

Three temporary users (useradd -m, removed with userdel -r whatever happens) get copies of the course notebooks:
the first a right ring AllReduce (the course's own solution, from its folded Markdown cell) and a wrong gradient
average (summed, never divided: a plausible mistake) with a progress file edited by hand to claim it passed; the
second a right naive AllReduce and a wrong ring (the all-gather forgotten); the third links planted where the
notebook and the progress file should be, and a cell that hangs. The gradebook runs as a command, as the
instructor would, and its CSV says what stands: right passes, wrong fails, untouched is not attempted, the claim
changes nothing, a link is refused, a hang is failed after its time limit, and no process of a student is left.
"""

import csv
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "notebooks"))
from solutions import is_solution, solution_code, source  # noqa: E402 - the folded reference solutions

from labkit.classroom.interpreter import class_python  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXERCISES = ["average_gradients", "naive_allreduce", "ring_allreduce", "stack_map"]  # the cheap ones
NOTEBOOKS = {"average_gradients": ("01_training_step", "check_average_gradients"),
             "naive_allreduce": ("02_collectives", "check_naive_allreduce"),
             "ring_allreduce": ("03_ring_allreduce", "check_ring_allreduce"),
             "stack_map": ("10_nccl_and_debugging", None)}
CLAIMED = {"average_gradients": {"passed": True, "attempts": 3, "passed_at": "2026-01-05T10:00:00+00:00"},
           "stack_map": {"passed": True, "attempts": 1, "passed_at": "2026-01-06T10:00:00+00:00"}}
STANDS = "progress file says passed; re-graded: failed -- the re-graded verdict stands"


def needs_root():
    """Skip (fail on CI, which runs as root) unless this process can make users and act as them."""
    if os.geteuid() != 0 or not all(shutil.which(c) for c in ("useradd", "userdel", "setpriv")):
        message = "needs root, useradd and setpriv to make students and grade as them"
        if os.environ.get("CI"):
            pytest.fail(message + ": CI runs as root")
        pytest.skip(message)


def as_user(name: str, code: str, python: str = sys.executable) -> subprocess.CompletedProcess:
    """Run a Python snippet as the local user `name` (their uid, gid and groups)."""
    return subprocess.run(["setpriv", f"--reuid={name}", f"--regid={name}", "--init-groups", python, "-c", code],
                          capture_output=True, text=True, timeout=60, cwd="/")


def student_solution(notebook: dict, grader: str) -> str:
    """The course's solution of the exercise `grader` grades, as a student's cell: the stub's imports kept, the
    grader called as the stub does (no record=False), and none of the solution's own cross-checks against the
    notebook's demonstrations (its asserts, notebook 13's loop over `places`), which the gradebook does not run."""
    code = next(solution_code(c) for c in notebook["cells"] if is_solution(c) and f"{grader}(" in source(c))
    stub = next(source(c) for c in notebook["cells"] if c["cell_type"] == "code" and f"{grader}(" in source(c))
    imports = [line for line in stub.splitlines() if re.match(r"(from|import)\s", line)]
    kept = [line for line in code.replace(", record=False)", ")").splitlines()
            if not line.strip().startswith("assert ") and "enumerate(places)" not in line]
    return "\n".join(imports + kept)


def with_cell(notebook: dict, grader: str, code: str) -> dict:
    """`notebook` with its stub cell of `grader` (the code cell that calls it) holding `code` instead."""
    stub = next(c for c in notebook["cells"] if c["cell_type"] == "code" and f"{grader}(" in source(c))
    stub["source"] = code
    return notebook


def course_notebook(name: str) -> dict:
    return json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())


def mistaken(exercise: str) -> str:
    """A plausible mistake in the course's solution of `exercise`."""
    notebook, grader = NOTEBOOKS[exercise]
    right = student_solution(course_notebook(notebook), grader)
    mistakes = {"average_gradients": ("p.grad /= n", "pass"),  # summed, never divided by N
                "ring_allreduce": ("hop(chunks[send], chunks[receive])", "pass")}  # the all-gather forgotten
    before, after = mistakes[exercise]
    assert before in right
    return right.replace(before, after)


def right(exercise: str) -> str:
    notebook, grader = NOTEBOOKS[exercise]
    return student_solution(course_notebook(notebook), grader)


def give(home: Path, uid: int, cells: dict) -> None:
    """Copy the test's notebooks into ~/my-notebooks, the cells of `cells` ({exercise: code}) filled in; all the
    student's own (as `make lab`'s copy would be), the home 0700 (issue 30)."""
    folder = home / "my-notebooks"
    folder.mkdir()
    for exercise, (name, grader) in NOTEBOOKS.items():
        notebook = course_notebook(name)
        if exercise in cells:
            notebook = with_cell(notebook, grader, cells[exercise])
        (folder / f"{name}.ipynb").write_text(json.dumps(notebook, indent=1))
    for path in (folder, *folder.iterdir()):
        os.chown(path, uid, uid)
    home.chmod(0o700)


def claim(home: Path, uid: int, progress: dict) -> Path:
    """A progress file written by hand (0600 in a 0700 ~/.labkit, as labkit writes it)."""
    folder = home / ".labkit"
    folder.mkdir(mode=0o700)
    path = folder / "progress.json"
    path.write_text(json.dumps(progress))
    path.chmod(0o600)
    for p in (folder, path):
        os.chown(p, uid, uid)
    return path


def processes_of(uids) -> list[psutil.Process]:
    """The running processes of these users (a zombie has exited: a container's init may leave it unreaped)."""
    return [p for p in psutil.process_iter(["uids", "status"])
            if p.info["uids"] and p.info["uids"].real in uids and p.info["status"] != psutil.STATUS_ZOMBIE]


@pytest.fixture(scope="module")
def students():
    """Three temporary local users {name: home}; removed (userdel -r) at the end, even on failure."""
    needs_root()
    prefix = f"lkgb{uuid.uuid4().hex[:6]}"
    names = [f"{prefix}{i}" for i in range(3)]
    try:
        for name in names:
            subprocess.run(["useradd", "-m", "-s", "/bin/sh", name], check=True, capture_output=True)
        yield {name: Path(pwd.getpwnam(name).pw_dir) for name in names}
    finally:
        uids = {pwd.getpwnam(n).pw_uid for n in names if _exists(n)}
        for process in processes_of(uids):  # the test's own students' processes only, if any outlived it
            process.kill()
        for name in names:
            subprocess.run(["userdel", "-r", name], capture_output=True)


def _exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


@pytest.fixture(scope="module")
def course_python(students):
    """The course's interpreter, which every student must be able to run (the graders' ranks start it again): the
    hub's choice (labkit.classroom.interpreter), made in a folder of this test's where it has to be made."""
    place = Path(tempfile.mkdtemp(prefix="labkit-course-python-"))  # not under pytest's 0700 folder
    os.chmod(place, 0o755)
    yield str(class_python(place / "python"))
    shutil.rmtree(place, ignore_errors=True)


def gradebook(names, *arguments, python: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Run the gradebook command as the instructor would (as root); its output and its CSV's rows."""
    out = tmp_path / "gradebook.csv"
    command = [sys.executable, "-m", "labkit.classroom.gradebook", "--users", *names, "--csv", str(out),
               "--python", python, *arguments]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    rows = list(csv.DictReader(out.open())) if out.exists() else []
    return done, rows


def by_key(rows) -> dict:
    return {(r["student"], r["exercise"]): r for r in rows}


def test_right_passes_wrong_fails_untouched_is_not_attempted_and_a_claim_changes_nothing(students, course_python,
                                                                                       tmp_path):
    (first, home1), (second, home2) = list(students.items())[:2]
    uid1, uid2 = pwd.getpwnam(first).pw_uid, pwd.getpwnam(second).pw_uid
    give(home1, uid1, {"ring_allreduce": right("ring_allreduce"), "average_gradients": mistaken("average_gradients")})
    give(home2, uid2, {"naive_allreduce": right("naive_allreduce"), "ring_allreduce": mistaken("ring_allreduce")})
    claimed = claim(home1, uid1, CLAIMED)
    before = claimed.read_bytes(), claimed.stat().st_mtime_ns

    done, rows = gradebook([first, second], "--exercises", *EXERCISES, "--timeout-seconds", "240",
                           python=course_python, tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr + done.stdout
    print(done.stdout)
    got = by_key(rows)
    assert len(rows) == 8
    assert (got[first, "ring_allreduce"]["passed"], got[first, "ring_allreduce"]["re-graded"]) == ("yes", "passed")
    assert got[first, "naive_allreduce"]["re-graded"] == "not attempted"
    average = got[first, "average_gradients"]
    assert (average["passed"], average["re-graded"], average["note"]) == ("no", "failed", STANDS)
    assert average["attempts recorded"] == "3" and average["first passed at"] == ""
    assert average["progress file says"] == "passed at 2026-01-05T10:00:00+00:00"
    assert got[first, "stack_map"]["re-graded"] == "unverified" and got[first, "stack_map"]["passed"] == "unverified"
    assert (got[second, "naive_allreduce"]["passed"], got[second, "ring_allreduce"]["passed"]) == ("yes", "no")
    assert got[second, "ring_allreduce"]["re-graded"] == "failed"
    assert "progress file says not passed; re-graded: passed" in got[second, "naive_allreduce"]["note"]
    assert got[second, "average_gradients"]["re-graded"] == "not attempted"
    assert {r["progress file says"] for r in rows if r["student"] == second} == {"no progress file"}
    assert STANDS in done.stdout  # the printed table says it too
    # the regrade recorded nothing where the students keep their progress
    assert (claimed.read_bytes(), claimed.stat().st_mtime_ns) == before
    assert not (home2 / ".labkit").exists()
    assert not processes_of({uid1, uid2}), "a grading process or rank outlived the gradebook"
    seconds = [float(r["seconds"]) for r in rows if r["re-graded"] != "unverified"]
    print(f"seconds per student per exercise: {min(seconds):.1f} to {max(seconds):.1f}, "
          f"mean {sum(seconds) / len(seconds):.1f}")


HANGS = """
import subprocess
subprocess.Popen(["sleep", "600"])   # a child of the cell's, in its process group
while True:
    pass
check_naive_allreduce(lambda t: None)
"""


def test_planted_links_are_refused_and_a_hanging_cell_times_out_leaving_nothing(students, course_python, tmp_path):
    name, home = list(students.items())[2]
    first_home = list(students.values())[0]
    uid = pwd.getpwnam(name).pw_uid
    give(home, uid, {"naive_allreduce": HANGS})
    ring = home / "my-notebooks" / "03_ring_allreduce.ipynb"
    ring.unlink()
    ring.symlink_to(first_home / "my-notebooks" / "03_ring_allreduce.ipynb")  # a classmate's (or /etc/shadow)
    os.lchown(ring, uid, uid)
    secret = tmp_path / "root-only-progress.json"  # root's file, claiming passes
    secret.write_text(json.dumps(CLAIMED))
    (home / ".labkit").mkdir(mode=0o700)
    (home / ".labkit" / "progress.json").symlink_to(secret)
    for path in (home / ".labkit", home / ".labkit" / "progress.json"):
        os.lchown(path, uid, uid)
    (home / "linked").symlink_to(home / "my-notebooks")
    os.lchown(home / "linked", uid, uid)

    done, rows = gradebook([name], "--exercises", "ring_allreduce", "naive_allreduce", "--timeout-seconds", "10",
                           python=course_python, tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr + done.stdout
    got = by_key(rows)
    assert got[name, "ring_allreduce"]["re-graded"] == "unreadable"
    assert "symbolic link" in got[name, "ring_allreduce"]["note"]
    assert got[name, "ring_allreduce"]["passed"] == "no"
    assert re.match(r"unreadable: .*symbolic link", got[name, "ring_allreduce"]["progress file says"])
    hang = got[name, "naive_allreduce"]
    assert (hang["passed"], hang["re-graded"], hang["note"]) == ("no", "timed out", "timed out after 10 s")
    assert not processes_of({uid}), "the hanging cell or its child outlived the gradebook"

    done, rows = gradebook([name], "--exercises", "naive_allreduce", "--notebooks", "linked",
                           python=course_python, tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    assert rows[0]["re-graded"] == "unreadable" and "symbolic link" in rows[0]["note"]
