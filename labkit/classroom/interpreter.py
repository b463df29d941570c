"""The Python every student's server runs: the lab's own when students may run it, else one made beside it.

`make setup` builds .venv on whatever python3.11 comes first, often one under a private home (pyenv's
/root/.pyenv, mode 0700). A student's server, started as the student, cannot execute that: "Permission denied"
at every login. `class_python(place)` answers which interpreter the hub starts students on:
- the lab's own (sys.executable) when an ordinary user can reach and run it;
- otherwise a small environment in `place`, made once by root: a venv of a system Python of the same version
  (/usr/bin/python3.X, which every user may run), with no packages of its own but a .pth file that adds the lab's
  site-packages (`site.addsitedir`, so its editable install of labkit works too), and the lab's Jupyter data
  (kernels, JupyterLab's extensions and settings, the kernels' IPython config) linked in. Its kernelspec starts
  `python`, which jupyter_client resolves to the server's own interpreter.
The same X.Y means the same ABI (cp311 wheels load in either); another version is refused with what to do.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

__all__ = ["class_python", "runnable_by_everyone"]

PLACE = Path(__file__).resolve().parents[2] / ".hub-python"  # beside the lab's .venv: the hub's and the gradebook's
LINKED = ("share/jupyter/lab", "share/jupyter/labextensions", "share/jupyter/nbextensions", "etc/ipython",
          "etc/jupyter")


def runnable_by_everyone(path: Path) -> bool:
    """Whether a user with no group in common can execute `path`: every folder above searchable by others."""
    path = Path(os.path.realpath(path))
    if not path.stat().st_mode & stat.S_IXOTH:
        return False
    return all(folder.stat().st_mode & stat.S_IXOTH for folder in path.parents)


def class_python(place: Path = PLACE) -> Path:
    """The interpreter for the students' servers (see the module docstring); makes `place` when needed."""
    own = Path(sys.executable)
    if runnable_by_everyone(own):
        return own
    made = place / "bin" / "python"
    if not made.exists():
        _make(place)
    return made


def _system_python() -> Path:
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (Path(f"/usr/bin/python{version}"), Path(f"/usr/local/bin/python{version}")):
        if candidate.exists() and runnable_by_everyone(candidate):
            return candidate
    raise RuntimeError(
        f"the students cannot run this lab's Python ({os.path.realpath(sys.executable)}: a folder above it is "
        f"private) and there is no /usr/bin/python{version} to make theirs from. Build the lab on a Python every "
        f"user may run: make setup PYTHON=/usr/bin/python3.X VENV=/opt/labkit (Python {version}).")


def _make(place: Path) -> None:
    place.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(_system_python()), "-m", "venv", "--without-pip", str(place)], check=True)
    site_packages = Path(subprocess.check_output(
        [str(place / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        text=True).strip())
    lab_site_packages = sysconfig.get_paths()["purelib"]
    (site_packages / "labkit_lab.pth").write_text(f"import site; site.addsitedir({lab_site_packages!r})\n")
    for relative in LINKED:
        source, target = Path(sys.prefix) / relative, place / relative
        if source.exists() and not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(source)
    _copy_kernelspec(place)
    os.chmod(place, 0o755)


def _copy_kernelspec(place: Path) -> None:
    """The course's kernelspec, starting `python`: jupyter_client runs it on the server's own interpreter."""
    source = Path(sys.prefix) / "share" / "jupyter" / "kernels" / "labkit"
    target = place / "share" / "jupyter" / "kernels" / "labkit"
    shutil.copytree(source, target, dirs_exist_ok=True)
    spec = json.loads((target / "kernel.json").read_text())
    spec["argv"][0] = "python"
    (target / "kernel.json").write_text(json.dumps(spec, indent=1))
