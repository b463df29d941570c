"""The grading process: run as the student, it reads their notebook, runs one exercise's cells, and says the verdict.

`python -m labkit.classroom._regrade exercise NOTEBOOK EXERCISE FD`, `... progress FILE FD` or `... python FD`
(whether the student may run this interpreter again, as the grader's ranks do): the gradebook
starts it as the student's own uid and gid, in a fresh temporary HOME, with LABKIT_PROGRESS pointing there, and
reads one JSON object from the pipe FD once it exits. The student's files are read here, with the student's rights
and never through a link (labkit._private_files: the file must be the student's own regular file), so no link a
student planted makes the gradebook read what the student could not.

The exercise's grader is replaced, in labkit.exercises, by one that keeps each verdict and never records it (the
course solutions' `record=False`): the regrade is not an attempt of the student's. The verdict is the last call's,
as the notebook would show it after Run All; the stub as it stands (NotImplementedError "your turn") is
"not attempted".
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

from labkit import _private_files
from labkit.classroom._cells import graded_cells, setup_cells

__all__: list[str] = []

MAX_NOTEBOOK_NBYTES = 64 * 2**20  # a course notebook with its outputs is a few MB
MAX_MESSAGE_CHARS = 2000  # a verdict's message in the table and the CSV


def read_notebook(path: Path) -> dict:
    """The student's notebook at `path` as JSON; its folder and the file itself must not be links."""
    if path.parent.is_symlink():
        raise PermissionError(f"{path.parent} is a symbolic link (to {os.readlink(path.parent)}): the gradebook "
                              "reads the student's own folder only")
    with os.fdopen(_private_files.open_private(path, os.O_RDONLY, "notebook"), "rb") as file:
        data = file.read(MAX_NOTEBOOK_NBYTES + 1)
    if len(data) > MAX_NOTEBOOK_NBYTES:
        raise ValueError(f"{path} is over {MAX_NOTEBOOK_NBYTES // 2**20} MB: not a course notebook")
    return json.loads(data.decode("utf-8"))


def grader_name(exercise: str) -> str | None:
    """The name, in labkit.exercises, of the grader `graded(exercise)` wraps; None for an exercise a widget records
    (notebook 15's diagnoses: record_attempt), which no cell calls a grader for."""
    import labkit.exercises

    names = [n for n in labkit.exercises.__all__ if getattr(getattr(labkit.exercises, n), "exercise", None) == exercise]
    return names[0] if names else None


def _keeping_verdicts(grader: str, verdicts: list) -> None:
    """Replace labkit.exercises' `grader` by one that appends each verdict to `verdicts` and records none."""
    import labkit.exercises

    original = getattr(labkit.exercises, grader)

    def regraded(*args, **kwargs):
        kwargs["record"] = False  # a student's own record=False changes nothing: nothing is recorded either way
        verdict = original(*args, **kwargs)
        verdicts.append(verdict)
        return verdict
    setattr(labkit.exercises, grader, regraded)


def _is_stub(error: BaseException) -> bool:
    """The notebook's untouched `raise NotImplementedError("your turn")`."""
    return isinstance(error, NotImplementedError) and "your turn" in str(error)


def run_cells(cells: list[tuple[int, str]], notebook: Path) -> BaseException | None:
    """Run the cells' sources in one namespace, as a kernel would; the exception that stopped them, if any."""
    from IPython.display import display  # a kernel's builtin, which cells may call

    namespace = {"__name__": "__main__", "display": display}
    for index, source in cells:
        try:
            exec(compile(source, f"{notebook.name} cell {index}", "exec"), namespace)  # noqa: S102 - the student's cell
        except BaseException as error:  # noqa: BLE001 - the student's error is the verdict, SystemExit too
            error.cell_index = index
            return error
    return None


def grade_exercise(notebook_path: Path, exercise: str) -> dict:
    """{"status": passed | failed | not attempted | no cell, "message": ...} for `exercise` in the notebook."""
    notebook = read_notebook(notebook_path)
    grader = grader_name(exercise)
    graded = graded_cells(notebook, grader) if grader else []
    if not graded:
        return {"status": "no cell", "message": f"no code cell of {notebook_path.name} calls {grader or 'a grader'}"}
    verdicts: list = []
    _keeping_verdicts(grader, verdicts)
    setup = setup_cells(notebook)
    error = run_cells(sorted(set(setup) | set(graded)), notebook_path)
    return _outcome(error, verdicts, grader, {i for i, _ in setup})


def _outcome(error: BaseException | None, verdicts: list, grader: str, setup_indices: set) -> dict:
    """The status and message from the cells' exception (if any) and the grader's verdicts."""
    if error is not None and _is_stub(error) and not verdicts:
        return {"status": "not attempted", "message": "the cell still raises NotImplementedError('your turn')"}
    if error is not None:
        where = "the notebook's setup cell" if error.cell_index in setup_indices else "the exercise's cell"
        last = traceback.format_exception_only(type(error), error)[-1].strip()
        return {"status": "failed", "message": f"{where} (cell {error.cell_index}) raised {last}"}
    if not verdicts:
        return {"status": "failed", "message": f"the cells ran but never called {grader}"}
    verdict = verdicts[-1]
    if not verdict and "NotImplementedError" in verdict.message and "your turn" in verdict.message:
        return {"status": "not attempted", "message": "the cell still raises NotImplementedError('your turn')"}
    return {"status": "passed" if verdict else "failed", "message": str(verdict.message)}


def _reply(fd: int, answer: dict) -> None:
    """Write `answer` (its message cut to MAX_MESSAGE_CHARS) to the gradebook's pipe."""
    answer["message"] = str(answer.get("message", ""))[:MAX_MESSAGE_CHARS]
    with os.fdopen(fd, "w") as pipe:
        json.dump(answer, pipe)


def main(argv: list[str]) -> None:
    """`exercise NOTEBOOK EXERCISE FD`, `progress FILE FD` or `python FD` (module docstring)."""
    mode, *paths, fd = argv
    try:
        if mode == "progress":
            from labkit.exercises.progress import read_progress

            answer = {"status": "read", "progress": read_progress(Path(paths[0])), "message": ""}
        elif mode == "python":
            answer = {"status": "runs" if os.access(sys.executable, os.X_OK) else "cannot run", "message": ""}
        else:
            answer = grade_exercise(Path(paths[0]), paths[1])
    except FileNotFoundError as missing:
        answer = {"status": "missing", "message": f"{missing.filename or missing}: no such file"}
    except Exception as refusal:  # noqa: BLE001 - an unreadable file is a row of the gradebook, said
        answer = {"status": "unreadable", "message": f"{type(refusal).__name__}: {refusal}"}
    _reply(int(fd), answer)
    sys.stdout.flush()
    os._exit(0)  # the grader's pools and threads end with the process: the gradebook kills its group anyway


if __name__ == "__main__":
    main(sys.argv[1:])
