"""The rank side of notebook 09's grader (labkit.exercises.atomic_save): the student's save(state_dict, path) runs
here, in a process of its own (labkit.run on 1 rank), under watch, and is killed there on purpose.

`Watch` sees what a save does to `path` where it happens, not through the names the save calls it by, and records
it in a JSON report that the grader reads even after the process was killed:

- files opened for writing, renamed, removed or truncated: Python's audit hooks (PEP 578; the events "open",
  "os.rename" (os.rename, os.replace, Path.replace, shutil.move), "os.remove", "os.truncate"), which CPython raises
  inside the operation itself, so `from os import replace`, io.FileIO, Path.write_bytes and tempfile's files are
  all seen. An audit hook cannot be removed: one is added per process, the first time a watch goes on, and it does
  nothing while no watch is on (the module's `_active`);
- torch.save given a path: its C++ writer opens the file without an audit event, so a profile hook
  (sys.setprofile, and threading.setprofile for threads the save starts) notes each call of torch.save's own code,
  whatever name it was imported as;
- fsync(2): os.fsync, os.fdatasync and os.sync raise no audit event, and a profile hook sees that a C function is
  called but not its arguments (which file). So the watch wraps them where graded code can reach them: the os
  module's attributes, every module-level name bound to them in any loaded module (`from os import fsync` in the
  student's module or a helper of theirs), the save's own globals (a notebook function's, which cloudpickle
  rebuilds outside sys.modules), its closure and its defaults; the wrapper notes which file was synced with how
  many bytes. The profile hook is the witness for a call from Python code through any other binding (a dict or
  a list of functions): such a call is seen but not its file, so every regular file the process has open, and
  every file in path's and tempfile's directories, then counts as synced with the bytes it has: that errs towards
  accepting, not towards telling a right save it did not fsync. What C code calls is not seen by the hook (a
  functools.partial of os.fsync, map(os.fsync, ...)), unless it holds a followed binding.

While a save runs, tempfile's default directory is a scratch folder beside the target's (so a temporary file made
"elsewhere" stays inside the grader's temporary directory, and shows as another directory), the working directory
is the one the drawn spelling of path needs (`Layout`), and labkit.checkpoint's own atomic write is refused (found
on the call stack at the rename).

Two ways to kill a save midway, both real crashes (no exception handler, no cleanup runs):
- `arm(nbytes)`: setrlimit(2) RLIMIT_FSIZE, with SIGXFSZ's default action restored (Python ignores it): the kernel
  kills the process at the first write that takes any file past `nbytes`, torch.save's C++ writes and
  shutil.copy's sendfile(2) included;
- SIGKILL just before a rename onto the target.

Sources: POSIX rename(2) (atomic replacement of the target), fsync(2), setrlimit(2) (RLIMIT_FSIZE, SIGXFSZ); PEP 578
and https://docs.python.org/3/library/audit_events.html (the events); sys.setprofile ("c_call" events).
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import signal
import stat
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

import labkit.checkpoint
from labkit.exercises import progress
from labkit.exercises._kit._intercept import Interceptor

try:
    import resource
except ImportError:  # Windows: no setrlimit(2) and no SIGKILL; the grader says to use WSL
    resource = None

__all__ = ["CAN_KILL", "FORMS", "OVERTAKE_SECONDS", "TARGET", "Layout", "RefusedSave", "Report", "Watch", "arm",
           "first_run", "nbytes_of", "saved_state", "second_run", "state_problem", "watching"]

TARGET = "model.pt"  # the checkpoint's name in each of the grader's directories
CAN_KILL = resource is not None and hasattr(signal, "SIGXFSZ")  # Linux, macOS, WSL
OVERTAKE_SECONDS = 3.0  # how long a first save waits for a second one to overtake it (a right one takes ms)
_OPEN, _SAVE = open, torch.save  # the grader's own files (no watch is on when it writes them)
_SYNCS = {id(function): (name, function) for name in ("fsync", "fdatasync", "sync")
          if (function := getattr(os, name, None)) is not None}  # id -> (name, os's own function)
_TORCH_SAVE_CODE = torch.serialization.save.__code__
_READY_MADE = (str(Path(labkit.checkpoint.__file__).parent) + os.sep, progress.__file__)  # the course's atomic writes
_SHUTIL = os.path.dirname(shutil.__file__) + os.sep + "shutil.py"
_WRITING = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND
FORMS = ("absolute", "relative", "bare")  # how path is spelled: /.../dir/model.pt, dir/model.pt, model.pt

_active: Watch | None = None  # the watch that is on in this process, if any: the hooks do nothing otherwise
_hooked = False  # whether this process has its audit hook (added once: an audit hook cannot be removed)


class RefusedSave(RuntimeError):
    """Raised inside a graded save that calls labkit.checkpoint's own atomic write."""


@dataclass(frozen=True)
class Layout:
    """What one grading drew, afresh each time, that a right save must not depend on: each phase's folder (with a
    space in its name), how path is spelled at each save (`forms`: absolute, relative to the working directory
    with the folder, or a bare file name in it), and the size of the state_dict (`rows` x `columns` floats)."""

    folders: dict[str, str]
    forms: dict[str, str]
    rows: int
    columns: int

    @staticmethod
    def draw() -> Layout:
        """A fresh layout: the three normal saves spell path the three ways, in a random order; every other save
        one way at random; a state_dict of 75 to 200 kB."""
        number = random.randrange(10, 100)
        folders = {key: f"{key} run {number}" for key in ("normal", "crash", "concurrent", "elsewhere")}
        forms = dict(zip(("normal 1", "normal 2", "normal 3"), random.sample(FORMS, len(FORMS)), strict=True))
        forms |= {key: random.choice(FORMS) for key in ("killed before rename", "stale", "concurrent",
                                                        "killed while writing")}
        return Layout(folders, forms, rows=random.randrange(96, 161), columns=random.randrange(192, 321))

    def spelled(self, scratch: Path, folder: str, save: str) -> tuple[str, Path]:
        """(path as save `save` gets it, the working directory it is spelled against) for folder `folder`."""
        directory = scratch / self.folders[folder]
        form = self.forms[save]
        if form == "absolute":
            return str(directory / TARGET), scratch / self.folders["elsewhere"]
        if form == "relative":
            return os.path.join(self.folders[folder], TARGET), scratch
        return TARGET, directory


def saved_state(seed: int, layout: Layout) -> dict:
    """The state_dict a graded save writes: a layer's weight and bias and the step, different for every seed, of
    the layout's size (so that a save killed at half its bytes is killed midway through a write)."""
    generator = torch.Generator().manual_seed(seed)
    return {"layer.weight": torch.randn(layout.rows, layout.columns, generator=generator),
            "layer.bias": torch.randn(layout.rows, generator=generator), "step": torch.tensor(seed)}


def nbytes_of(seed: int, layout: Layout) -> int:
    """How many bytes torch.save writes for saved_state(seed, layout)."""
    buffer = io.BytesIO()
    _SAVE(saved_state(seed, layout), buffer)
    return buffer.getbuffer().nbytes


def state_problem(path, seed: int, layout: Layout, earlier: tuple[int, ...] = ()) -> str | None:
    """None when torch.load(path) gives saved_state(seed) (same keys, dtypes and values), else what is wrong; when
    it gives the state of an `earlier` seed (a previous call's), says which call's."""
    path = Path(path)
    if not path.is_file():
        return f"there is no file at path ({path.name})"
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any failure to load is what the student must see
        first_line = (str(error).strip().splitlines() or [""])[0][:120]
        return (f"path holds {path.stat().st_size:,} bytes and torch.load(path) fails "
                f"({type(error).__name__}: {first_line})")
    wanted = saved_state(seed, layout)
    if not isinstance(loaded, dict) or set(loaded) != set(wanted):
        shown = sorted(loaded) if isinstance(loaded, dict) else type(loaded).__name__
        return f"torch.load(path) gives {shown}, not the state_dict saved (keys {sorted(wanted)})"
    differ = [key for key, value in wanted.items() if not _same(loaded[key], value)]
    if not differ:
        return None
    for call, old in enumerate(earlier, start=1):
        if all(_same(loaded[key], value) for key, value in saved_state(old, layout).items()):
            return (f"torch.load(path) gives the state_dict of save call {call}, not the one this call was given: "
                    "your save wrote what an earlier call was given")
    return f"torch.load(path) gives other values for {differ} than the state_dict saved"


def _same(loaded, wanted: torch.Tensor) -> bool:
    return isinstance(loaded, torch.Tensor) and loaded.dtype == wanted.dtype and torch.equal(loaded, wanted)


class Report:
    """What the rank saw, phase by phase, kept in `scratch`/report.json and rewritten at every event, so that the
    grader can read it after the process was killed."""

    def __init__(self, scratch):
        """An empty report, to be kept in `scratch`/report.json."""
        self.path, self.phases = Path(scratch) / "report.json", {}
        self.lock = threading.RLock()  # a second save runs in a thread (the "concurrent" phase)

    def phase(self, name: str) -> dict:
        """A new phase's record: its events, and later its error, problem and leftovers."""
        self.phases[name] = {"events": [], "error": None, "problem": None, "leftovers": [], "finished": False,
                             "path": None, "form": None}
        self.flush()
        return self.phases[name]

    def flush(self) -> None:
        """Rewrite the report file (the audit hook sees this open too, and ignores it: not the target)."""
        with self.lock, _OPEN(self.path, "w") as file:
            json.dump(self.phases, file)

    @staticmethod
    def read(scratch) -> dict:
        """The phases a rank recorded in `scratch`, {} if it recorded none."""
        try:
            return json.loads((Path(scratch) / "report.json").read_text())
        except (OSError, ValueError):  # none yet, or cut short by the process's death
            return {}


def arm(nbytes: int) -> None:
    """From now on the kernel kills this process (SIGXFSZ, no core file) at the first write that takes a file past
    `nbytes` bytes (setrlimit(2) RLIMIT_FSIZE). Watch's exit undoes it if the process is still alive."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)


def _kill(report: Report) -> None:
    """SIGKILL this process now, as a crash would: no exception, no finally, no cleanup."""
    report.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _path_text(value) -> str | None:
    """`value` as an absolute path with no symbolic links (a relative one against the working directory now), or
    None when it is not a path (a file descriptor, a file object)."""
    if isinstance(value, (str, bytes, os.PathLike)):
        return os.path.realpath(os.fsdecode(os.fspath(value)))
    return None


def _called_from(prefixes) -> bool:
    """Whether a frame of the current call stack runs code from a file under one of `prefixes`."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(prefixes):
            return True
        frame = frame.f_back
    return False


def _audit(event: str, args: tuple) -> None:
    """This process's audit hook (PEP 578): hand the file events to the watch that is on; nothing when none is."""
    watch = _active
    if watch is not None and event in _AUDITED:
        getattr(watch, _AUDITED[event])(*args)


def _profile(frame, event: str, arg) -> None:
    """The profile hook while a watch is on (sys.setprofile): torch.save's own code called, and the sync functions
    called other than through the watch's wrappers (module docstring)."""
    watch = _active
    if watch is None:
        return
    if event == "call" and frame.f_code is _TORCH_SAVE_CODE:
        watch.torch_saved(frame.f_locals.get("f"))
    elif event == "c_call" and id(arg) in _SYNCS and frame.f_code not in _WRAPPER_CODES:
        watch.synced_unfollowed(_SYNCS[id(arg)][0])


_AUDITED = {"open": "audit_open", "os.rename": "audit_rename", "os.remove": "audit_remove",
            "os.truncate": "audit_truncate"}  # event -> the Watch method that handles it


def _hook_once() -> None:
    """Add this process's audit hook, the first time only."""
    global _hooked
    if not _hooked:
        sys.addaudithook(_audit)
        _hooked = True


def watching() -> bool:
    """Whether a watch is on in this process (its hooks, which stay once added, do nothing while none is)."""
    return _active is not None


def _set_active(watch: Watch | None) -> None:
    global _active
    _active = watch


class Watch(Interceptor):
    """While a save runs: record what it does to `target` in `record`, send tempfile to `elsewhere` and the working
    directory to `working`; `on_write()` runs when the target is opened for writing, `on_replace()` just before a
    rename onto it. Everything is restored on exit, however the save ends (the rank runs later calls): an
    `Interceptor`. `save` is the student's function, whose own bindings of the sync functions are followed too."""

    def __init__(self, target, elsewhere, working, report: Report, record: dict, save=None, on_write=None,
                 on_replace=None, on_start=None):
        self.target, self.elsewhere, self.working = os.path.realpath(target), str(elsewhere), str(working)
        self.report, self.record, self.save = report, record, save
        self.on_write, self.on_replace, self.on_start = on_write, on_replace, on_start  # each takes no argument
        self.synced: dict[tuple[int, int], tuple[int, str]] = {}  # (st_dev, st_ino) -> (bytes, by which call)
        self.renamed: dict[tuple[int, int], str] = {}  # (st_dev, st_ino) -> name, of each file renamed onto target
        super().__init__()

    def install(self) -> None:
        """Follow the sync functions, turn the hooks on, send tempfile and the working directory where the layout
        says, then run on_start. What arm changes (the file size limit, core files, SIGXFSZ) and the working
        directory are put back on exit, after the hooks are off."""
        super().install()
        for limit in (resource.RLIMIT_FSIZE, resource.RLIMIT_CORE):
            self.on_exit(resource.setrlimit, limit, resource.getrlimit(limit))
        self.on_exit(signal.signal, signal.SIGXFSZ, signal.getsignal(signal.SIGXFSZ))
        self.on_exit(os.chdir, os.getcwd())
        self.patch(tempfile, "tempdir", self.elsewhere)
        self._follow_syncs()
        self._hooks_on()
        os.chdir(self.working)
        if self.on_start:
            self.on_start()

    def _hooks_on(self) -> None:
        """This watch is the one the hooks report to, and the profile hook is on in this thread and the threads
        it starts, until exit."""
        if _active is not None:
            raise RuntimeError("another atomic-save watch is already on in this process")
        _hook_once()
        self.on_exit(sys.setprofile, sys.getprofile())
        self.on_exit(threading.setprofile, threading.getprofile())
        self.on_exit(_set_active, None)
        _set_active(self)
        sys.setprofile(_profile)
        threading.setprofile(_profile)

    def _follow_syncs(self) -> None:
        """Replace the sync functions by wrappers wherever a name is bound to them: every loaded module's
        globals, the save's own globals, closure and defaults (module docstring)."""
        wrappers = {key: _wrapper(name, function) for key, (name, function) in _SYNCS.items()}
        namespaces = [vars(module) for module in list(sys.modules.values()) if hasattr(module, "__dict__")]
        function = getattr(self.save, "__func__", self.save)  # a bound method's function
        if hasattr(function, "__globals__"):
            namespaces.append(function.__globals__)
        for namespace in namespaces:
            for name, value in list(namespace.items()):
                if id(value) in wrappers and value is _SYNCS[id(value)][1]:
                    self.on_exit(namespace.__setitem__, name, value)
                    namespace[name] = wrappers[id(value)]
        for cell in getattr(function, "__closure__", None) or ():
            value = cell.cell_contents if _filled(cell) else None
            if id(value) in wrappers and value is _SYNCS[id(value)][1]:
                self.on_exit(setattr, cell, "cell_contents", value)
                cell.cell_contents = wrappers[id(value)]
        defaults = getattr(function, "__defaults__", None)
        if defaults and any(id(value) in wrappers for value in defaults):
            self.on_exit(setattr, function, "__defaults__", defaults)  # a descriptor: Interceptor.patch would delete it
            function.__defaults__ = tuple(wrappers.get(id(value), value) for value in defaults)

    def _event(self, kind: str, **details) -> None:
        """Record one thing the save did to the target, at once on disk (the process may be killed next)."""
        with self.report.lock:
            self.record["events"].append({"kind": kind, **details})
            self.report.flush()

    def _wrote(self, how: str) -> None:
        """The target was opened for writing (or torch.save was given it)."""
        self._event("write", how=how)
        if self.on_write:
            self.on_write()

    def audit_open(self, path, mode, flags) -> None:
        """The audit event "open" (open, io.open, io.FileIO, os.open, Path.write_bytes, ...): note the target
        opened for writing, by shutil's copy or by the save itself."""
        if isinstance(flags, int) and flags & _WRITING and _path_text(path) == self.target:
            self._wrote("copy" if _called_from((_SHUTIL,)) else "os.open" if mode is None else "open")

    def audit_truncate(self, path, length) -> None:
        """The audit event "os.truncate": the target cut in place."""
        if _path_text(path) == self.target:
            self._wrote("truncate")

    def torch_saved(self, file) -> None:
        """torch.save's code was called: note the target given as its file (its C++ writer opens it, with no
        audit event)."""
        if _path_text(file) == self.target:
            self._wrote("torch.save")

    def audit_rename(self, src, dst, *dir_fds) -> None:
        """The audit event "os.rename" (os.rename, os.replace, Path.rename and .replace, shutil.move): a rename
        onto the target, or of the target away."""
        if _path_text(dst) == self.target:
            self._onto_target(src)
        elif _path_text(src) == self.target:
            self._event("moved", to=os.path.basename(_path_text(dst) or ""))

    def audit_remove(self, path, *dir_fd) -> None:
        """The audit event "os.remove" (os.remove, os.unlink, Path.unlink): note the target removed."""
        if _path_text(path) == self.target:
            self._event("removed")

    def _onto_target(self, src) -> None:
        """A rename of `src` onto the target: refuse the course's own save, note whether `src` was fsync'ed with
        all its bytes and lies under the target's directory (so on its file system whatever the target, which
        rename(2) needs), then let `on_replace` act (kill, or start a second save)."""
        if _called_from(_READY_MADE):
            self._event("ready_made")
            raise RefusedSave("labkit.checkpoint's own atomic save is switched off while this exercise is graded")
        source = _path_text(src) or ""
        try:
            info = os.stat(source)
        except OSError:
            return  # the rename itself will fail, and the student sees its error
        synced, synced_by = self.synced.get((info.st_dev, info.st_ino), (None, None))
        self.renamed[(info.st_dev, info.st_ino)] = os.path.basename(source)
        directory = os.path.dirname(self.target)
        self._event("replace", source=os.path.basename(source), directory=os.path.dirname(source),
                    under_directory=os.path.commonpath([source, directory]) == directory,
                    relative=not os.path.isabs(os.fsdecode(os.fspath(src))),
                    in_working_directory=os.path.dirname(source) == os.path.realpath(os.getcwd()),
                    fsync="yes" if synced == info.st_size else "no" if synced is None else "unflushed",
                    synced_nbytes=synced, synced_by=synced_by, nbytes=info.st_size)
        if self.on_replace:
            self.on_replace()

    def synced_file(self, info: os.stat_result, by: str) -> None:
        """A file (`info`) made durable by `by`, with the bytes it has now; or a directory fsync'ed."""
        if stat.S_ISDIR(info.st_mode):
            self._event("fsync_directory", same_directory=os.path.samestat(info, os.stat(os.path.dirname(
                self.target))))
            return
        self.synced[(info.st_dev, info.st_ino)] = (info.st_size, by)
        if (info.st_dev, info.st_ino) in self.renamed:
            self._event("synced_after_replace", source=self.renamed[(info.st_dev, info.st_ino)], synced_by=by)

    def synced_all(self, by: str) -> None:
        """os.sync(), or a sync whose file is unknown: every file open in this process and every file in the
        target's and tempfile's directories is on disk with the bytes it has now."""
        infos = []
        for directory in {os.path.dirname(self.target), os.path.realpath(self.elsewhere)}:
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

    def synced_unfollowed(self, name: str) -> None:
        """The profile hook saw os.`name` called through a binding not followed: which file it was is not known,
        so every candidate counts as synced (module docstring)."""
        self.synced_all("os.sync()" if name == "sync" else f"os.{name}")


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


class _Run:
    """One run of the student's save on this rank: its scratch directory, the layout drawn, the report."""

    def __init__(self, save, scratch, layout: Layout):
        self.save, self.scratch, self.layout, self.report = save, Path(scratch), layout, Report(scratch)

    def directory(self, folder: str) -> Path:
        return self.scratch / self.layout.folders[folder]

    def call(self, record: dict, folder: str, key: str, seed: int, then=None, **hooks) -> None:
        """save(saved_state(seed), path) under a watch, path in `folder` spelled as the layout says for save `key`
        (and the working directory set for it), then `then()` (still watched); the save's exception (if any) goes
        into `record`."""
        path, working = self.layout.spelled(self.scratch, folder, key)
        record["path"], record["form"] = path, self.layout.forms[key]
        watch = Watch(self.directory(folder) / TARGET, self.directory("elsewhere"), working, self.report, record,
                      save=self.save, **hooks)
        with watch:
            try:
                self.save(saved_state(seed, self.layout), path)
            except Exception as error:  # noqa: BLE001 - the student's error, reported by the grader
                record["error"] = _error_record(error)
            if then:
                then()
        record["finished"] = True

    def finish(self, record: dict, folder: str, seed: int | None, earlier: tuple[int, ...] = ()) -> bool:
        """After a phase's save: what path holds and what else with data in it is in its folder; whether the phase
        went well."""
        directory = self.directory(folder)
        if record["error"] is None and seed is not None:
            record["problem"] = state_problem(directory / TARGET, seed, self.layout, earlier)
        record["leftovers"] = sorted(entry.name for entry in os.scandir(directory) if entry.name != TARGET
                                     and _holds_data(entry))
        self.report.flush()
        return record["error"] is None and record["problem"] is None


def _error_record(error: Exception) -> dict:
    """An exception as the report keeps it: its type, message, the file it names (OSError's filename) and its
    errno (OSError's, None for others)."""
    return {"type": type(error).__name__, "message": str(error)[:300], "errno": getattr(error, "errno", None),
            "filename": os.path.basename(os.fsdecode(getattr(error, "filename", "") or ""))}


def _holds_data(entry: os.DirEntry) -> bool:
    """Whether `entry` is a file with bytes in it, or a folder with such a file somewhere inside: an empty file (a
    lock file, say) or an empty folder (where temporary files are made) does no harm."""
    if entry.is_dir(follow_symlinks=False):
        return any(_holds_data(inner) for inner in os.scandir(entry.path))
    return not (entry.is_file() and entry.stat().st_size == 0)


def _finish(record: dict, report: Report, directory: Path, seed: int | None) -> bool:
    """After a phase's save: what path holds and what else with data in it is in its directory; whether the phase
    went well."""
    if record["error"] is None and seed is not None:
        record["problem"] = state_problem(directory / TARGET, seed)
    record["leftovers"] = sorted(entry.name for entry in os.scandir(directory) if entry.name != TARGET
                                 and _holds_data(entry))
    report.flush()
    return record["error"] is None and record["problem"] is None


def first_run(save, scratch, layout: Layout) -> None:
    """Phases "normal" (three saves of different states, into an empty folder then over the last one, path spelled
    each of the three ways) and "killed before rename" (a save over a good checkpoint, killed at its rename onto
    path, or midway through any write once it opened path itself for writing). The grader reads the report; this
    process normally dies."""
    run = _Run(save, scratch, layout)
    record = run.report.phase("normal")
    for call, seed in enumerate((1, 2, 3), start=1):
        record["call"] = call
        run.call(record, "normal", f"normal {call}", seed)
        if not run.finish(record, "normal", seed, earlier=tuple(range(1, seed))):
            return
    _SAVE(saved_state(4, layout), run.directory("crash") / TARGET)
    record = run.report.phase("killed before rename")
    nbytes = nbytes_of(5, layout) // 2
    run.call(record, "crash", "killed before rename", 5, on_write=lambda: arm(nbytes),
             on_replace=lambda: _kill(run.report))
    run.finish(record, "crash", None)


def second_run(save, scratch, layout: Layout) -> None:
    """Phases "stale" (a save beside the leftovers of the killed one), "concurrent" (a second save runs whole
    while the first is about to rename) and "killed while writing" (a save killed at the first write past half its
    bytes). The grader reads the report; this process normally dies."""
    run = _Run(save, scratch, layout)
    record = run.report.phase("stale")
    run.call(record, "crash", "stale", 6)
    if not run.finish(record, "crash", 6):
        return
    _SAVE(saved_state(7, layout), run.directory("concurrent") / TARGET)
    record = run.report.phase("concurrent")
    record["second_error"] = None
    overtaker = _Overtaker(save, layout.spelled(run.scratch, "concurrent", "concurrent")[0], layout, record)
    run.call(record, "concurrent", "concurrent", 8, on_replace=overtaker, then=overtaker.finish)
    run.finish(record, "concurrent", None)
    target = run.directory("concurrent") / TARGET
    record["problem"] = state_problem(target, 8, layout) and state_problem(target, 9, layout)
    record = run.report.phase("killed while writing")
    nbytes = nbytes_of(10, layout) // 2
    run.call(record, "crash", "killed while writing", 10, on_start=lambda: arm(nbytes))
    run.finish(record, "crash", None)


class _Overtaker:
    """An on_replace that, the first time, starts a second save of saved_state(9) to the same path (as spelled for
    the first), in a thread, and waits for it: two saves at once, the second overtaking the first. A second save
    that waits for a lock the first one holds goes on once the first has renamed (after OVERTAKE_SECONDS); `finish`
    waits for it then."""

    def __init__(self, save, path: str, layout: Layout, record: dict):
        self.save, self.path, self.layout, self.record, self.thread = save, path, layout, record, None

    def __call__(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._second, daemon=True)
            self.thread.start()
            self.thread.join(OVERTAKE_SECONDS)

    def _second(self) -> None:
        try:
            self.save(saved_state(9, self.layout), self.path)
        except Exception as error:  # noqa: BLE001 - the student's error, reported by the grader
            self.record["second_error"] = _error_record(error)

    def finish(self) -> None:
        """Wait for the second save (still watched); one that never ends counts as its error."""
        if self.thread is not None:
            self.thread.join(OVERTAKE_SECONDS)
            if self.thread.is_alive():
                self.record["second_error"] = {"type": "TimeoutError", "filename": "", "message": (
                    f"the second save had not returned {2 * OVERTAKE_SECONDS:g} s after it started")}
