"""Which exercises a student has passed, across the course: a small JSON file in the student's own directory.

Every grader is wrapped in `graded(exercise)`: after grading it records the verdict under the exercise's name, so
`show_progress()`, at the end of every notebook and in notebook 00, can list what is passed, what was tried and
what is still ahead. The file is `~/.labkit/progress.json` (or wherever LABKIT_PROGRESS points): the student's
home directory, never the repository, and no server. It is written atomically (a temporary file, fsync, then
os.replace, as notebook 09 teaches), so a kernel killed mid-write leaves the previous file whole, and under a
lock, so two kernels grading at once both count.

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

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

__all__ = ["EXERCISES", "RENAMED_NOTEBOOKS", "graded", "load_progress", "progress_path", "record_attempt",
           "show_progress"]

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


def progress_path() -> Path:
    """Where the progress is kept: $LABKIT_PROGRESS, else ~/.labkit/progress.json."""
    return Path(os.environ.get("LABKIT_PROGRESS") or Path.home() / ".labkit" / "progress.json")


def load_progress() -> dict:
    """The recorded attempts, {exercise: {"passed": bool, "attempts": int, "passed_at": str | None}}; {} when there
    is no file yet. Entries of exercises this labkit does not know (another version's) are kept as they are. A
    file that cannot be read as such is moved aside to progress.json.unreadable-<time>, never lost, and never
    raised into a grader: its content is the student's."""
    path = progress_path()
    try:
        recorded = json.loads(path.read_text())
        if not isinstance(recorded, dict):
            raise ValueError(f"a JSON {type(recorded).__name__}, not an object")
        return {name: _entry(entry) if name in EXERCISES else entry for name, entry in recorded.items()}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError) as error:
        kept = path.with_name(f"{path.name}.unreadable-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}")
        try:
            path.replace(kept)
            where = f"it is kept as {kept}"
        except OSError:
            where = "it is left where it is"
        warnings.warn(f"labkit: could not read your progress file {path} ({error}); {where}, and a new one starts",
                      stacklevel=2)
        return {}


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
    try:
        with _locked(progress_path().parent):
            progress = load_progress()
            entry = progress.setdefault(exercise, {"passed": False, "attempts": 0, "passed_at": None})
            entry["attempts"] += 1
            if passed and not entry["passed"]:
                entry["passed"], entry["passed_at"] = True, datetime.now(timezone.utc).isoformat(timespec="seconds")
            _write_atomically(progress_path(), json.dumps(progress, indent=1, sort_keys=True) + "\n")
    except OSError as error:
        warnings.warn(f"labkit: your progress was not saved to {progress_path()} ({error}); set LABKIT_PROGRESS "
                      "to a file you can write", stacklevel=2)


@contextlib.contextmanager
def _locked(directory: Path):
    """Hold an exclusive flock(2) on `directory` while the progress file in it is read and rewritten, so that two
    kernels grading at the same moment do not both read the old file and lose one attempt. The lock goes with
    the process (a killed kernel holds none). Where there is no flock (Windows), there is no lock."""
    directory.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write_atomically(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, fsync it, and rename it onto `path` (rename(2))."""
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
