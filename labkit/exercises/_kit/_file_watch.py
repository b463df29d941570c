"""What graded code does to one file, seen where it happens: `FileWatch`, an Interceptor (notebook 09's grader).

A watch sees what graded code does to its `target`, not through the names the code calls it by, and hands each
thing seen to `note` as one event (a dict with its "kind"):

- files opened for writing, renamed, removed or truncated: Python's audit hooks (PEP 578; the events "open",
  "os.rename" (os.rename, os.replace, Path.replace, shutil.move), "os.remove", "os.truncate"), which CPython raises
  inside the operation itself, so `from os import replace`, io.FileIO, Path.write_bytes and tempfile's files are
  all seen. An audit hook cannot be removed: one is added per process, the first time a watch goes on, and it does
  nothing while no watch is on (the module's `_active`);
- torch.save given a path: its C++ writer opens the file without an audit event, so a profile hook
  (sys.setprofile, and threading.setprofile for threads the code starts) notes each call of torch.save's own code,
  whatever name it was imported as;
- fsync(2): os.fsync, os.fdatasync and os.sync raise no audit event, and a profile hook sees that a C function is
  called but not its arguments (which file). So the watch wraps them where graded code can reach them: the os
  module's attributes, every module-level name bound to them in any loaded module (`from os import fsync` in the
  student's module or a helper of theirs), and the graded function's own globals (a notebook function's, which
  cloudpickle rebuilds outside sys.modules), closure and defaults; the wrapper notes which file was synced with
  how many bytes. The profile hook is the witness for a call from Python code through any other binding (a dict
  or a list of functions): such a call is seen but not its file, so every regular file the process has open, and
  every file in the target's directory and the `scanned` ones, then counts as synced with the bytes it has: that
  errs towards accepting, not towards telling a right save it did not fsync. What C code calls is not seen by the
  hook (a functools.partial of os.fsync, map(os.fsync, ...)), unless it holds a followed binding.

Every binding replaced, and the hooks' target, are put back by the Interceptor's one ExitStack, however the `with`
ends, an exception while installing included. One watch at a time per process.

Sources: PEP 578 and https://docs.python.org/3/library/audit_events.html (the events); sys.setprofile ("c_call"
events); POSIX fsync(2).
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import threading
from pathlib import Path

import torch

from labkit.exercises._kit._intercept import Interceptor
from labkit.exercises._kit._stack import outermost_caller

__all__: list[str] = []

_SYNCS = {id(function): (name, function) for name in ("fsync", "fdatasync", "sync")
          if (function := getattr(os, name, None)) is not None}  # id -> (name, os's own function)
_TORCH_SAVE_CODE = torch.serialization.save.__code__
_SHUTIL = Path(shutil.__file__)
_WRITING = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND

_active: FileWatch | None = None  # the watch that is on in this process, if any: the hooks do nothing otherwise
_hooked = False  # whether this process has its audit hook (added once: an audit hook cannot be removed)


def watching() -> bool:
    """Whether a watch is on in this process (its hooks, which stay once added, do nothing while none is)."""
    return _active is not None


def _set_active(watch: FileWatch | None) -> None:
    global _active
    _active = watch


def _audit(event: str, args: tuple) -> None:
    """This process's audit hook (PEP 578): hand the file events to the watch that is on; nothing when none is."""
    watch = _active
    if watch is not None and event in _AUDITED:
        getattr(watch, _AUDITED[event])(*args)


_AUDITED = {"open": "audit_open", "os.rename": "audit_rename", "os.remove": "audit_remove",
            "os.truncate": "audit_truncate"}  # event -> the FileWatch method that handles it


def _profile(frame, event: str, arg) -> None:
    """The profile hook while a watch is on (sys.setprofile): torch.save's own code called, and the sync functions
    called other than through the watch's wrappers (module docstring)."""
    watch = _active
    if watch is None:
        return
    if event == "call" and frame.f_code is _TORCH_SAVE_CODE:
        watch.torch_saved(frame.f_locals.get("f"))
    elif event == "c_call" and id(arg) in _SYNCS and frame.f_code not in _WRAPPER_CODES:
        name = _SYNCS[id(arg)][0]
        watch.synced_all("os.sync()" if name == "sync" else f"os.{name}")


def _path_text(value) -> str | None:
    """`value` as an absolute path with no symbolic links (a relative one against the working directory now), or
    None when it is not a path (a file descriptor, a file object)."""
    if isinstance(value, (str, bytes, os.PathLike)):
        return os.path.realpath(os.fsdecode(os.fspath(value)))
    return None


class FileWatch(Interceptor):
    """While on, each thing graded code does to `target` is one event handed to `note` (module docstring): "write"
    (with `how`: open, os.open, copy, truncate, torch.save), "removed", "moved" (`to`), "replace" (a rename onto
    the target: its source, where it lay, and whether it was fsync'ed with all its bytes), "synced_after_replace"
    and "fsync_directory". `follow` is the graded function whose own bindings of the sync functions are followed
    too; `scanned`, directories whose files count as synced when a sync of an unknown file is seen. Subclasses act
    in `wrote()` (the target opened for writing) and `replacing()` (just before a rename onto it; an exception
    there refuses the rename), and may extend `install`."""

    def __init__(self, target, follow=None, scanned=()):
        self.target, self.follow = os.path.realpath(target), follow
        self.scanned = tuple(os.path.realpath(directory) for directory in scanned)
        self.events: list[dict] = []
        self.synced: dict[tuple[int, int], tuple[int, str]] = {}  # (st_dev, st_ino) -> (bytes, by which call)
        self.renamed: dict[tuple[int, int], str] = {}  # (st_dev, st_ino) -> name, of each file renamed onto target
        super().__init__()

    def install(self) -> None:
        """Follow the sync functions, then turn the hooks on (they report to this watch until exit)."""
        super().install()
        self._follow_syncs()
        if _active is not None:
            raise RuntimeError("another file watch is already on in this process")
        global _hooked
        if not _hooked:
            sys.addaudithook(_audit)
            _hooked = True
        self.on_exit(sys.setprofile, sys.getprofile())
        self.on_exit(threading.setprofile, threading.getprofile())
        self.on_exit(_set_active, None)
        _set_active(self)
        sys.setprofile(_profile)
        threading.setprofile(_profile)

    def note(self, event: dict) -> None:
        """Keep one event (a subclass may keep it where it survives the process's death)."""
        self.events.append(event)

    def wrote(self) -> None:
        """The target was just opened for writing (or given to torch.save)."""

    def replacing(self) -> None:
        """A file is about to be renamed onto the target (its "replace" event noted)."""

    def _follow_syncs(self) -> None:
        """Replace the sync functions by wrappers wherever a name is bound to them: every loaded module's globals,
        the followed function's own globals, keyword defaults, closure and defaults (module docstring)."""
        wrappers = {key: _wrapper(name, function) for key, (name, function) in _SYNCS.items()}

        def followed(value) -> bool:
            return id(value) in wrappers and value is _SYNCS[id(value)][1]

        function = getattr(self.follow, "__func__", self.follow)  # a bound method's function
        namespaces = [vars(module) for module in list(sys.modules.values()) if hasattr(module, "__dict__")]
        namespaces += [n for n in (getattr(function, "__globals__", None), getattr(function, "__kwdefaults__", None))
                       if n is not None]
        for namespace in namespaces:
            for name, value in list(namespace.items()):
                if followed(value):
                    self.on_exit(namespace.__setitem__, name, value)
                    namespace[name] = wrappers[id(value)]
        for cell in getattr(function, "__closure__", None) or ():
            value = cell.cell_contents if _filled(cell) else None
            if followed(value):
                self.on_exit(setattr, cell, "cell_contents", value)
                cell.cell_contents = wrappers[id(value)]
        defaults = getattr(function, "__defaults__", None)
        if defaults and any(map(followed, defaults)):
            self.on_exit(setattr, function, "__defaults__", defaults)  # a descriptor: Interceptor.patch would delete it
            function.__defaults__ = tuple(wrappers[id(value)] if followed(value) else value for value in defaults)

    def _wrote(self, how: str) -> None:
        self.note({"kind": "write", "how": how})
        self.wrote()

    def audit_open(self, path, mode, flags) -> None:
        """The audit event "open" (open, io.open, io.FileIO, os.open, Path.write_bytes, ...): the target opened for
        writing, by shutil's copy or by the code itself."""
        if isinstance(flags, int) and flags & _WRITING and _path_text(path) == self.target:
            by_shutil = outermost_caller(lambda file, _: "copy" if file == _SHUTIL else None)
            self._wrote(by_shutil or ("os.open" if mode is None else "open"))

    def audit_truncate(self, path, length) -> None:
        """The audit event "os.truncate": the target cut in place."""
        if _path_text(path) == self.target:
            self._wrote("truncate")

    def torch_saved(self, file) -> None:
        """torch.save's code was called: the target given as its file (its C++ writer opens it, with no audit
        event)."""
        if _path_text(file) == self.target:
            self._wrote("torch.save")

    def audit_rename(self, src, dst, *dir_fds) -> None:
        """The audit event "os.rename" (os.rename, os.replace, Path.rename and .replace, shutil.move): a rename
        onto the target, or of the target away."""
        if _path_text(dst) == self.target:
            self._onto_target(src)
        elif _path_text(src) == self.target:
            self.note({"kind": "moved", "to": os.path.basename(_path_text(dst) or "")})

    def audit_remove(self, path, *dir_fd) -> None:
        """The audit event "os.remove" (os.remove, os.unlink, Path.unlink): the target removed."""
        if _path_text(path) == self.target:
            self.note({"kind": "removed"})

    def _onto_target(self, src) -> None:
        """A rename of `src` onto the target: note whether `src` was fsync'ed with all its bytes and lies under the
        target's directory (so on its file system whatever the target, which rename(2) needs), then `replacing`."""
        source = _path_text(src) or ""
        try:
            info = os.stat(source)
        except OSError:
            return  # the rename itself will fail, and the graded code sees its error
        synced, synced_by = self.synced.get((info.st_dev, info.st_ino), (None, None))
        self.renamed[(info.st_dev, info.st_ino)] = os.path.basename(source)
        directory = os.path.dirname(self.target)
        self.note({"kind": "replace", "source": os.path.basename(source), "directory": os.path.dirname(source),
                   "under_directory": os.path.commonpath([source, directory]) == directory,
                   "relative": not os.path.isabs(os.fsdecode(os.fspath(src))),
                   "in_working_directory": os.path.dirname(source) == os.path.realpath(os.getcwd()),
                   "fsync": "yes" if synced == info.st_size else "no" if synced is None else "unflushed",
                   "synced_nbytes": synced, "synced_by": synced_by, "nbytes": info.st_size})
        self.replacing()

    def synced_file(self, info: os.stat_result, by: str) -> None:
        """A file (`info`) made durable by `by`, with the bytes it has now; or a directory fsync'ed."""
        if stat.S_ISDIR(info.st_mode):
            self.note({"kind": "fsync_directory",
                       "same_directory": os.path.samestat(info, os.stat(os.path.dirname(self.target)))})
            return
        self.synced[(info.st_dev, info.st_ino)] = (info.st_size, by)
        if (info.st_dev, info.st_ino) in self.renamed:
            self.note({"kind": "synced_after_replace", "source": self.renamed[(info.st_dev, info.st_ino)],
                       "synced_by": by})

    def synced_all(self, by: str) -> None:
        """os.sync(), or a sync whose file is unknown: every file open in this process and every file in the
        target's and the scanned directories is on disk with the bytes it has now."""
        infos = []
        for directory in {os.path.dirname(self.target), *self.scanned}:
            infos += [entry.stat(follow_symlinks=False) for entry in os.scandir(directory)
                      if entry.is_file(follow_symlinks=False)]
        for fd in _open_descriptors():
            try:
                infos.append(os.fstat(fd))
            except OSError:  # closed meanwhile
                continue
        for info in infos:
            if stat.S_ISREG(info.st_mode):
                self.synced_file(info, by)


def _open_descriptors() -> list[int]:
    """This process's open file descriptors (Linux and WSL's /proc; none elsewhere)."""
    try:
        return [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return []


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _wrapper(name: str, original):
    """What a binding of os.`name` (fsync, fdatasync, sync) is while a watch is on: the real call, then the file
    (or every file, for sync) noted as durable by the watch that is on."""
    if name == "sync":
        def synced_everything():
            original()
            if _active is not None:
                _active.synced_all("os.sync()")
        return synced_everything

    def synced(fd):
        original(fd)
        if _active is not None:
            _active.synced_file(os.fstat(fd if isinstance(fd, int) else fd.fileno()), f"os.{name}")
    return synced


_WRAPPER_CODES = {_wrapper("sync", None).__code__, _wrapper("fsync", None).__code__}
