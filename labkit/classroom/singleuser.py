"""What a student's single-user server runs first, as the student: a private home, the course copied in, Jupyter.

JupyterHub's spawner (labkit.classroom.spawner) starts `python -m labkit.classroom.singleuser ARGS` after it has
dropped to the student's uid; this module then
- makes the home folder 0700 and the umask 077: Debian's useradd made homes world-readable (HOME_MODE 0755) until
  Debian 12, and a class's notebooks, progress and rendezvous files are each student's own;
- copies the course's notebooks that the student's folder lacks (as `make lab` makes my-notebooks/), never
  overwriting one: a student's edits and outputs are theirs, and a notebook the instructor adds later appears at
  the next login;
- and replaces itself with `python -m jupyterhub.singleuser ARGS` (the same process: the hub watches its pid).
Running this as the student, not in the hub as root, means a folder the student made into a link (to /etc, say)
can only ever lead the copy where the student may write anyway.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

__all__ = ["COURSE_ENV", "FOLDER_ENV", "copy_course", "main", "make_home_private"]

COURSE_ENV = "LABKIT_COURSE_NOTEBOOKS"  # the course's notebooks/ folder, set by the spawner
FOLDER_ENV = "LABKIT_NOTEBOOK_FOLDER"  # the student's copy, relative to their home (my-notebooks)


def make_home_private(home: Path) -> None:
    """Home 0700 (when it is the student's own; a home root owns is left as it is) and umask 077 for what follows."""
    os.umask(0o077)
    if home.stat().st_uid == os.getuid():
        os.chmod(home, 0o700)


def copy_course(course: Path, folder: Path) -> list[str]:
    """Copy each course notebook that `folder` lacks into it (0600 under umask 077); the names copied."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    copied = []
    for notebook in sorted(course.glob("*.ipynb")):
        target = folder / notebook.name
        try:  # O_EXCL: a notebook the student has, or made meanwhile in another tab, is never overwritten
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            continue
        with os.fdopen(fd, "wb") as out, notebook.open("rb") as source:
            shutil.copyfileobj(source, out)
        copied.append(notebook.name)
    return copied


def main(argv: list[str]) -> None:
    """Prepare the student's home, then become `jupyterhub-singleuser argv`."""
    home = Path.home()
    make_home_private(home)
    course = os.environ.get(COURSE_ENV)
    if course:
        copied = copy_course(Path(course), home / os.environ.get(FOLDER_ENV, "my-notebooks"))
        if copied:
            print(f"labkit: copied {len(copied)} course notebooks into your folder", file=sys.stderr)
    os.execv(sys.executable, [sys.executable, "-m", "jupyterhub.singleuser", *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
