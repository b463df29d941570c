"""Which exercises a student has passed, across the course: a small JSON file in the student's own directory.

Every grader is wrapped in `graded(exercise)`: after grading it records the verdict under the exercise's name, so
`show_progress()`, at the end of every notebook and in notebook 00, can list what is passed, what was tried and
what is still ahead. The file is `~/.labkit/progress.json` (or wherever LABKIT_PROGRESS points): the student's
home directory, never the repository, and no server. It is written atomically (a temporary file, fsync, then
os.replace, as notebook 09 teaches), so a kernel killed mid-write leaves the previous file whole, and under a
lock, so two kernels grading at once both count.

The file is the student's alone (labkit._private_files): its folder is created 0700 and the file 0600; a folder
another user owns or can write in is not used (a progress file planted in a shared folder showed someone else's
passes), said in a warning. The lock is a 0600 file beside it (`.progress.json.lock`), since any user who can open
a folder can flock it, and it is waited for at most LOCK_WAIT_SECONDS. Whatever the file holds (a number past a
float's range, a nesting 100,000 deep, a FIFO, a link to /dev/zero), it is read at most 3 MB, never followed or
waited on, and a file that does not read as progress is set aside with a warning: grading never depends on it.

The course's own solutions are folded Markdown cells that a student's Run All never executes; CI runs them
(tests/notebooks/solutions.py turns them into code) through the same graders with `record=False`: running them
is not the student passing.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
import warnings
from datetime import datetime, timezone
from pathlib import Path

from labkit import _private_files

__all__ = ["EXERCISES", "LOCK_WAIT_SECONDS", "RENAMED_NOTEBOOKS", "graded", "load_progress", "progress_path",
           "read_progress", "record_attempt", "show_progress"]

EXERCISES = {  # name: (notebook, what the student builds), in course order
    "average_gradients": ("01_training_step", "average the gradients by hand after backward()"),
    "naive_allreduce": ("02_collectives", "AllReduce from send and recv"),
    "ring_allreduce": ("03_ring_allreduce", "the ring AllReduce"),
    "bucketed_ddp_hook": ("04_data_parallel", "a bucketed DDP gradient hook"),
    "megatron_f_g": ("05_tensor_parallel", "Megatron's f and g operators"),
    "one_f_one_b": ("06_pipeline_parallel", "the 1F1B action order of one stage"),
    "no_sync_accumulation": ("07_gradient_accumulation", "gradient accumulation with no_sync"),
    "atomic_save": ("09_checkpointing", "an atomic checkpoint save"),
    "stack_map": ("10_nccl_and_debugging", "the software stack's map"),
    "sharded_step": ("11_zero", "ZeRO-1's sharded optimizer step"),
    "mesh_coordinates": ("13_3d_parallelism", "a rank's (dp, pp, tp) coordinates and groups"),
    "bug_zoo_diagnoses": ("15_bug_zoo", "diagnose six broken training runs"),
    "bug_zoo_fix": ("15_bug_zoo", "fix a broken training run"),
    "ring_step": ("17_context_parallel", "one step of ring attention: a block attended to and merged in"),
    "expert_dispatch": ("18_expert_parallel", "expert parallelism's dispatch and combine (all-to-all)"),
}

# Notebooks renamed when the course was reordered (issue 26). The progress file is keyed by exercise, so a
# student's attempts carry over whatever the notebooks are called; a copy of an old notebook still calling
# show_progress with its old name gets its new one shown in bold.
RENAMED_NOTEBOOKS = {
    "10_nccl_and_review": "10_nccl_and_debugging",
    "11_sharding": "11_zero",
    "12_3d_parallelism": "13_3d_parallelism",
    "13_bug_zoo": "15_bug_zoo",
}

LOCK_WAIT_SECONDS = 10.0  # a kernel holds the lock for milliseconds; one held longer is stuck, and grading goes on
_MAX_NBYTES = 3 * 2**20  # the course's 13 exercises take about 2 kB: a bigger file is not one labkit wrote


def progress_path() -> Path:
    """Where the progress is kept: $LABKIT_PROGRESS, else ~/.labkit/progress.json."""
    return Path(os.environ.get("LABKIT_PROGRESS") or Path.home() / ".labkit" / "progress.json")


def load_progress() -> dict:
    """The recorded attempts, {exercise: {"passed": bool, "attempts": int, "passed_at": str | None}}; {} when there
    is no file yet. Entries of exercises this labkit does not know (another version's) are kept as they are. A
    file that cannot be read as such is moved aside to progress.json.unreadable-<time>, never lost, and never
    raised into a grader: its content is the student's. A folder that is not the student's own is not read (a
    warning says why)."""
    path = progress_path()
    try:
        _progress_folder(path, create=False)
    except FileNotFoundError:
        return {}
    except OSError as refusal:  # another user's folder, or one they can write in: not read, not touched
        warnings.warn(f"labkit: your progress is not read from {path}: {refusal}", stacklevel=2)
        return {}
    try:
        return _parse(_read_capped(path))
    except FileNotFoundError:
        return {}
    except Exception as error:  # noqa: BLE001 - whatever the file holds, it must not break a grader: set it aside
        _set_aside(path, error)
        return {}


def read_progress(path: Path) -> dict:
    """The progress recorded in the file at `path`, read only: what load_progress returns, but every problem (no
    file, a folder or file that is not private, a link, a file that is not progress) raised, and nothing moved
    aside. For the instructor's gradebook (labkit.classroom), which shows a student's file and must not change it."""
    _progress_folder(path, create=False)
    return _parse(_read_capped(path))


def _progress_folder(path: Path, *, create: bool) -> Path:
    """The progress file's folder, checked to be private (created 0700 if `create`)."""
    return _private_files.private_directory(path.parent, "progress folder", create=create)


def _read_capped(path: Path) -> str:
    """The progress file's text: a regular file of the student's own, not followed if a link, never waited on
    if a FIFO, and at most _MAX_NBYTES (a link to /dev/zero would read until memory ran out)."""
    with os.fdopen(_private_files.open_private(path, os.O_RDONLY, "progress file"), "rb") as file:
        data = file.read(_MAX_NBYTES + 1)
    if len(data) > _MAX_NBYTES:
        raise ValueError(f"over {_MAX_NBYTES // 2**20} MB, far more than labkit writes")
    return data.decode("utf-8")


def _parse(text: str) -> dict:
    """The progress recorded in `text`, each known exercise's entry checked; raises when it is not progress."""
    recorded = json.loads(text)
    if not isinstance(recorded, dict):
        raise ValueError(f"a JSON {type(recorded).__name__}, not an object")
    return {name: _entry(entry) if name in EXERCISES else entry for name, entry in recorded.items()}


def _set_aside(path: Path, error: Exception) -> None:
    """Move the unreadable progress file (whatever it is: a file, a link, a FIFO) to progress.json.unreadable-<time>
    beside it, and say so once."""
    kept = path.with_name(f"{path.name}.unreadable-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}")
    try:
        os.replace(path, kept)  # renames the link or the FIFO itself, never what it points to
        where = f"it is kept as {kept}"
    except OSError:
        where = "it is left where it is"
    warnings.warn(f"labkit: could not read your progress file {path} ({type(error).__name__}: {error}); {where}, "
                  "and a new one starts",
                  stacklevel=3)


def _entry(entry) -> dict:
    """One exercise's record, checked: TypeError or ValueError when it is not one (the file is then set aside)."""
    if not isinstance(entry, dict):
        raise TypeError(f"an entry is a {type(entry).__name__}, not an object")
    return {"passed": bool(entry.get("passed")), "attempts": int(entry.get("attempts") or 0),
            "passed_at": entry.get("passed_at")}


def record_attempt(exercise: str, passed: bool) -> None:
    """Add one attempt at `exercise` to the progress file. A pass, once recorded, stays: a later failed attempt
    (say, while experimenting) does not take it back. A file that cannot be written is reported, not raised."""
    if exercise not in EXERCISES:
        raise ValueError(f"unknown exercise {exercise!r}; the course's exercises are {', '.join(EXERCISES)}")
    path = progress_path()
    try:
        with _locked(path):
            progress = load_progress()
            entry = progress.setdefault(exercise, {"passed": False, "attempts": 0, "passed_at": None})
            entry["attempts"] += 1
            if passed and not entry["passed"]:
                entry["passed"], entry["passed_at"] = True, datetime.now(timezone.utc).isoformat(timespec="seconds")
            _write_atomically(path, json.dumps(progress, indent=1, sort_keys=True) + "\n")
    except Exception as error:  # noqa: BLE001 - the progress file is never a reason for a grader to fail
        warnings.warn(f"labkit: your progress was not saved to {path} ({error}); set LABKIT_PROGRESS to a file "
                      "in a folder of your own", stacklevel=2)


@contextlib.contextmanager
def _locked(path: Path):
    """Hold an exclusive flock(2) on the lock file beside the progress file `path` while it is read and rewritten,
    so that two kernels grading at the same moment do not both read the old file and lose one attempt. The lock
    goes with the process (a killed kernel holds none); it is waited for LOCK_WAIT_SECONDS at most, then
    TimeoutError. Where there is no flock (Windows), there is no lock."""
    lock_file = _progress_folder(path, create=True) / f".{path.name}.lock"
    fd = _private_files.hold_lock(lock_file, "progress lock file", wait_seconds=LOCK_WAIT_SECONDS)
    if fd is None:
        raise TimeoutError(f"another process has held {lock_file} for over {LOCK_WAIT_SECONDS:g} s: is a kernel "
                           "stuck while recording? Restart it")
    try:
        yield
    finally:
        if fd >= 0:
            os.close(fd)


def _write_atomically(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path` (mode 0600, as mkstemp makes it), fsync it, and rename it
    onto `path` (rename(2))."""
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.replace(f.name, path)
    finally:
        Path(f.name).unlink(missing_ok=True)  # still there only if the rename failed


def graded(exercise: str):
    """Decorator for a grader `check(fn, ...) -> Verdict`: records each verdict under `exercise` in the progress
    file. The wrapped grader takes one more keyword, `record=True`; the course's own solutions pass False."""
    if exercise not in EXERCISES:
        raise ValueError(f"unknown exercise {exercise!r}: add it to EXERCISES in {__name__} ({', '.join(EXERCISES)})")

    def wrap(check):
        @functools.wraps(check)
        def check_and_record(*args, record: bool = True, **kwargs):
            verdict = check(*args, **kwargs)
            if record and not _untouched_stub(verdict):
                record_attempt(exercise, bool(verdict))
            return verdict
        check_and_record.exercise = exercise  # the gradebook finds an exercise's grader by it (labkit.classroom)
        return check_and_record
    return wrap


def _untouched_stub(verdict) -> bool:
    """The notebook's stub, run as it stands (`raise NotImplementedError("your turn")`): not an attempt, so that
    running a whole notebook does not count as trying its exercise."""
    return not verdict and "NotImplementedError" in verdict.message and "your turn" in verdict.message


class Progress:
    """The course's exercises with what the student has done: a Markdown table in a notebook, text elsewhere."""

    def __init__(self, recorded: dict, notebook: str | None = None):
        self.recorded, self.notebook = recorded, notebook
        self.read_at = datetime.now().astimezone()  # a notebook saved with this table and reopened shows it as then

    def rows(self) -> list[tuple[str, str, str]]:
        """(notebook, exercise, status) for every exercise of this labkit, in course order."""
        rows = []
        for name, (notebook, title) in EXERCISES.items():
            entry = self.recorded.get(name, {})
            status = ("passed" if entry.get("passed") else
                      f"tried {entry['attempts']}x, not passed yet" if entry.get("attempts") else "not tried")
            rows.append((notebook, title, status))
        return rows

    def summary(self) -> str:
        passed = sum(1 for *_, status in self.rows() if status == "passed")
        return f"{passed} of {len(EXERCISES)} exercises passed (kept in {progress_path()})"

    def __repr__(self) -> str:
        return self.summary() + "".join(f"\n  {nb}  {title}: {status}" for nb, title, status in self.rows())

    def _repr_markdown_(self) -> str:
        marks = {"passed": "✅ passed", "not tried": "· not tried"}
        # a table saved in a notebook stays as it was: it says when it was read, and how to read it again
        read = (f"*As of {self.read_at:%H:%M on %d %B %Y}, when this cell ran: run it again for your progress now.*")
        lines = [f"**Your progress:** {self.summary()}", "", read, "", "| notebook | exercise | status |",
                 "|---|---|---|"]
        for notebook, title, status in self.rows():
            here = notebook == self.notebook
            shown = f"**{notebook}**" if here else notebook
            lines.append(f"| {shown} | {title} | {marks.get(status, '⏳ ' + status)} |")
        return "\n".join(lines)


def show_progress(notebook: str | None = None) -> Progress:
    """Your progress across the course; `notebook` (e.g. "04_data_parallel") is shown in bold.

    >>> show_progress().rows()[0][:2]
    ('01_training_step', 'average the gradients by hand after backward()')
    """
    return Progress(load_progress(), RENAMED_NOTEBOOKS.get(notebook, notebook))
