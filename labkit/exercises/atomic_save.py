"""The grader of notebook 09's "your turn": an atomic checkpoint save, `save(state_dict, path)`, killed midway.

A save is atomic when, whatever moment it dies at, `path` holds either the previous checkpoint whole or the new
one whole. The recipe: write the new file under a temporary name in the same directory, flush it and fsync(2) it,
then rename it onto `path` with os.replace, which replaces the name in one step (POSIX rename(2)); fsync the
directory too, so that the rename itself survives a power cut. labkit.checkpoint does this (its files.py), and is
switched off while the exercise is graded.

`check_atomic_save(save)` runs the student's save in a process of its own (labkit.run on 1 rank, so that a save
that hangs is stopped and a killed one does not take the notebook with it; a rank of the grader's own, never the
student's, discarded after each run: a save killed or limited by setrlimit leaves nothing to a later call), every
file inside one temporary directory, and checks, in this order:

1. three normal saves of different state_dicts, into an empty directory and over the previous checkpoint, each
   load back with torch.load equal to the state_dict that call was given (labkit.checkpoint's own save is
   refused), and leave no other non-empty file beside path;
2. killed just before its rename onto path, or midway through any write once it opened path itself (torch.save
   straight to path, open(path, "wb"), shutil.copy onto path), path still loads as the previous checkpoint, and
   was never removed or moved away (the watch sees file operations where they happen, whatever they are called:
   a save that still wrote path in place unseen, through a subprocess's cp say, is never killed: it is told so);
3. the file renamed onto path was fsync'ed (os.fsync, os.fdatasync or os.sync) with all its bytes first, after
   its last write and before the rename, and lay under path's own directory (in it, or in a folder inside it):
   rename(2) is atomic only within one file system, and only path's directory is on path's file system whatever
   path is (tempfile's default directory, /tmp, is often another: a tmpfs, or a local disk beside shared storage);
4. a save beside the temporary file of a killed one works;
5. two saves at once (a second one, in another thread, runs whole while the first is about to rename; one that
   waits for a lock the first holds goes on after it) both succeed and leave one of the two checkpoints, and no
   temporary file (an empty file, such as a lock file, may stay);
6. killed at the first write past half its bytes, path still holds the previous checkpoint, and what the killed
   save left behind cannot be taken for a checkpoint (no name ending like path's).

What a right save must not depend on is drawn afresh at each grading (`Layout`): path is spelled absolute,
relative to the working directory, or as a bare file name (the three normal saves use all three, in a random
order; the other saves one at random), its folder has a space in its name, and the state_dict's size varies (75
to 200 kB). Every mistake the catalogue holds is refused on every draw.

The rank side is in this file too (from `Layout` on): the save runs under the kit's watch of what it does to path
(labkit.exercises._kit._file_watch; `_SaveWatch` says what else it sets up), which writes a JSON report that the
grader reads even after the process was killed. Two ways to kill a save midway, both real crashes (no exception
handler, no cleanup):
- `_arm(nbytes)`: setrlimit(2) RLIMIT_FSIZE, with SIGXFSZ's default action restored (Python ignores it): the
  kernel kills the process at the first write that takes any file past `nbytes`, torch.save's C++ writes and
  shutil.copy's sendfile(2) included;
- SIGKILL just before a rename onto the target.

The kit's runner (`_runner.Spec` and `grade`) does not fit this grader: its cases are independent calls whose
outcomes the ranks return, and whose RankError is the student's failure; here the rank is killed on purpose (the
RankError is the expected end of a run), what it saw is read from disk, and the second run starts from the files
the first one's crash left behind.

Sources: POSIX rename(2) (atomic replacement of the target), fsync(2), setrlimit(2) (RLIMIT_FSIZE, SIGXFSZ).
"""

from __future__ import annotations

import errno
import io
import json
import os
import random
import signal
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

import labkit
import labkit.checkpoint
from labkit.exercises import progress
from labkit.exercises._kit._file_watch import FileWatch
from labkit.exercises._kit._messages import first_failure, not_callable_message, where_ranks_waited
from labkit.exercises._kit._pace import grading_seconds
from labkit.exercises._kit._stack import outermost_caller
from labkit.exercises.progress import graded
from labkit.exercises.verdict import Verdict
from labkit.launch import pools_apart

try:
    import resource
except ImportError:  # Windows: no setrlimit(2) and no SIGKILL; the grader says to use WSL
    resource = None

__all__ = ["FORMS", "Layout", "check_atomic_save"]

_TIMEOUT_SECONDS = 20.0  # per run of the save's process; a right save of 130 kB takes milliseconds
_TARGET = "model.pt"  # the checkpoint's name in each of the grader's directories
_GRADER = "the atomic-save grader"  # whose 1-rank pool each run gets (labkit.launch.pools_apart), then discards
_CAN_KILL = resource is not None and hasattr(signal, "SIGXFSZ")  # Linux, macOS, WSL
_OVERTAKE_SECONDS = 3.0  # how long a first save waits for a second one to overtake it (a right one takes ms)
_READY_MADE = (str(Path(labkit.checkpoint.__file__).parent) + os.sep, progress.__file__)  # the course's atomic writes
FORMS = {"absolute": "an absolute path", "relative": "a path relative to the working directory",
         "bare": "a bare file name, in the working directory"}  # how path is spelled: /.../dir/model.pt, ...


@graded("atomic_save")
def check_atomic_save(save, *, timeout_seconds: float = _TIMEOUT_SECONDS) -> Verdict:
    """Grade `save(state_dict, path)`: crash-safe and concurrent-safe (module docstring).

    Example::

        >>> import torch
        >>> check_atomic_save(lambda state_dict, path: torch.save(state_dict, path))
        Not yet. We killed your save ... torch.save(state_dict, path) writes straight into path...
    """
    timeout_seconds = grading_seconds("timeout_seconds", timeout_seconds)
    if not callable(save):
        return Verdict(False, not_callable_message("check_atomic_save(save)", save))
    if not _CAN_KILL:
        return Verdict(False, "this grader kills your save with setrlimit(2) and SIGKILL, which Windows lacks: run "
                              "the course under WSL (see the README), as for labkit.run.")
    layout = Layout.draw()
    with tempfile.TemporaryDirectory(prefix="labkit-atomic-save-") as scratch:
        for folder in layout.folders.values():
            (Path(scratch) / folder).mkdir()
        problem = _first_run_problem(save, Path(scratch), layout, timeout_seconds)
        if problem is None:
            problem = _second_run_problem(save, Path(scratch), layout, timeout_seconds)
        if problem:
            for shown in (scratch, os.path.realpath(scratch)):  # the grader's temporary directory says nothing
                problem = problem.replace(shown + os.sep, "")
            return Verdict(False, problem[0].upper() + problem[1:])
        synced_directory = any(e["kind"] == "fsync_directory" and e["same_directory"]
                               for e in _Report.read(scratch)["stale"]["events"])
    return Verdict(True, "killed just before its rename, and again midway through writing, your save left the "
                         "previous checkpoint whole at path; three normal saves, path spelled three ways, each "
                         "loaded back what that call was given; the temporary file "
                         "was fsync'ed before os.replace and lay under path's directory (on path's file system); "
                         "a killed save's leftovers and a second save at the same time did not break it. " + (
                             "You fsync the directory too, so the rename itself survives a power cut."
                             if synced_directory else "One step further: after os.replace, fsync path's "
                             "directory (os.open(directory, os.O_RDONLY), os.fsync, os.close), so that the rename "
                             "itself survives a power cut."))


def _run(function, save, scratch: Path, layout: Layout, timeout_seconds: float) -> tuple[dict, str | None]:
    """Run `function(save, scratch, layout)` on 1 rank: the report, and what went wrong with the process itself (a
    hang, or a death the grader did not cause), or None."""
    try:
        with pools_apart(_GRADER, keep=False):
            labkit.run(function, save, str(scratch), layout, world_size=1, timeout=timeout_seconds)
    except labkit.RankTimeout as hang:
        return _Report.read(scratch), (f"your save did not return within {timeout_seconds:g} s, so it was stopped "
                                      f"({where_ranks_waited(hang, 1)}). Does it wait for something, a lock or "
                                      "another process?")
    except labkit.RankError as error:
        report = _Report.read(scratch)
        last = list(report)[-1] if report else None
        if last is None or not last.startswith("killed") or report[last]["finished"]:  # not our kill
            return report, (f"the process running your save died ({first_failure(error)[0].summary}) during the "
                            f"{last or 'first'} save: a save must return, or raise an exception, and never end its "
                            "process.")
    return _Report.read(scratch), None


def _first_run_problem(save, scratch: Path, layout: Layout, timeout_seconds: float) -> str | None:
    """Checks 1 to 3 (module docstring), from the first run's report."""
    report, died = _run(_first_run, save, scratch, layout, timeout_seconds)
    if died:
        return died
    normal = report["normal"]
    problem = _normal_problem(normal)
    if problem:
        return problem
    crashed = scratch / layout.folders["crash"] / _TARGET
    damage = _state_problem(crashed, 4, layout)
    if damage:
        killed = report["killed before rename"]
        if killed["finished"] and _state_problem(crashed, 5, layout) is None:
            damage = "path held the new one"
        return _damage_message(killed["events"], damage, _half_of(5, layout), finished=killed["finished"])
    problem = _rename_problem(normal["events"], scratch, layout)
    if problem is None and normal["leftovers"]:
        return (f"after a save that succeeded, {_names(normal['leftovers'])} remained beside path, where a save "
                "that works leaves only path.")
    return problem


def _normal_problem(normal: dict) -> str | None:
    """What went wrong in a plain save (check 1), or None; what it left beside path is judged after checks 2 and
    3, which explain most leftovers."""
    events = normal["events"]
    if any(e["kind"] == "ready_made" for e in events):
        return ("your save calls labkit.checkpoint's own atomic save (labkit/checkpoint/files.py), the course's "
                "answer; it is switched off while this exercise is graded.")
    if normal["error"]:
        return (f"your save(state_dict, path), called with {_given(normal)}, "
                + _error_text(normal["error"], events, deleted_hint=True, form=normal["form"]) + ".")
    if normal["problem"] and "an earlier call" in normal["problem"]:
        return (f"we called your save 3 times with a different state_dict each time; after call {normal['call']} "
                f"({_given(normal)}), {normal['problem']}. Nothing may carry over from one call to the next.")
    if normal["problem"]:
        return (f"after save(state_dict, path), called with {_given(normal)}, {normal['problem']}. "
                "torch.load(path) must give back the state_dict you were given: torch.save it whole.")
    return None


def _given(record: dict) -> str:
    """How path was spelled at a phase's last save: "path = 'model.pt' (a bare file name, ...)"."""
    path = record["path"]
    if record["form"] == "absolute":  # the grader's temporary directory says nothing
        path = os.path.join("...", *Path(path).parts[-2:])
    return f"path = {path!r} ({FORMS[record['form']]})"


def _error_text(error: dict, events: list, deleted_hint: bool = False, form: str | None = None) -> str:
    """"raised TypeError: ..." for the student, with a hint when the error is a known consequence (with
    `deleted_hint`, a temporary file looked for after it was renamed: NamedTemporaryFile's delete=True; with path
    spelled as a bare name (`form`), a directory taken from it as '')."""
    text = f"raised {error['type']}: {error['message']}"
    renamed = {e["source"] for e in events if e["kind"] == "replace"}
    if error.get("errno") == errno.EXDEV:
        text += (". Your temporary file was on another file system than path, and a rename cannot cross file "
                 "systems (rename(2))")
    elif deleted_hint and error["type"] == "FileNotFoundError" and error["filename"] in renamed:
        text += (f". Your save renamed {error['filename']} onto path and then something looked for it again: "
                 "tempfile.NamedTemporaryFile removes its file when it is closed (delete=True, its default)")
    elif form == "bare" and error["type"] == "FileNotFoundError" and error["message"].endswith(": ''"):
        text += (". path was a bare file name, whose os.path.dirname is '' (the working directory, unnamed), and "
                 "'' names no file or directory: a path given without a directory must work too")
    elif error["type"] == "NotImplementedError":
        text += ". Write the body of save"
    return text


def _names(names) -> str:
    """File names as the student reads them: 'a.tmp', 'b.tmp'."""
    return ", ".join(repr(name) for name in names)


def _damage_message(events: list, damage: str, nbytes: int, armed: bool = False, finished: bool = False) -> str:
    """A killed save left path damaged (`damage`): say when it was killed (`armed`: from its start, at the first
    write past `nbytes`) and what it did to path, from its `events`; or, when it `finished` unkilled without a
    watched write or rename, that it wrote path in place some other way."""
    kinds = [e.get("how", e["kind"]) for e in events if e["kind"] in ("write", "removed", "moved")]
    writes = any(e["kind"] == "write" for e in events)
    if finished and not writes and not armed and not any(e["kind"] == "replace" for e in events):
        return _unkilled_message(kinds, damage)
    when = (f"at the first write past {nbytes:,} bytes, half the checkpoint" if armed else
            f"once it had opened path itself for writing, at the first write past {nbytes:,} bytes (half the "
            "checkpoint)" if writes else "with SIGKILL, just before it renamed a file onto path")
    if "torch.save" in kinds:
        why = ("Your save's torch.save(state_dict, path) writes straight into path: it empties the previous "
               "checkpoint first, and until its last byte path is a half-written file.")
    elif "copy" in kinds:
        why = ("Copying onto path (shutil.copy or copyfile) rewrites path in place: it empties path, then writes "
               "the copy into it, so a crash during the copy leaves a half-copied file. A copy is not a rename.")
    elif "open" in kinds or "os.open" in kinds:
        call = ("open(path, \"wb\"), io.FileIO or Path.write_bytes" if "open" in kinds
                else "os.open(path, os.O_WRONLY | ...)")
        why = (f"Your save opened path itself for writing ({call}), which empties the previous checkpoint at "
               "once; until the last byte is written, path is a half-written file.")
    elif how := _removed_or_moved(kinds):
        why = (f"Your save {how} before renaming the new file onto it: in between there is no checkpoint at all. "
               "A rename onto path replaces the old file in one step, with no moment between.")
    else:
        why = "Your save wrote into path itself."
    return (f"we killed your save {when}, as a crash would. Afterwards {damage}: the previous checkpoint is "
            f"lost. {why}")


def _removed_or_moved(kinds: list) -> str | None:
    """What a save did to the previous checkpoint before the new file took its place, or None."""
    return "removed path (os.remove)" if "removed" in kinds else "moved path away" if "moved" in kinds else None


def _unkilled_message(kinds: list, damage: str) -> str:
    """A save that returned unkilled, having neither renamed a file onto path nor opened path itself for writing,
    left path without the previous checkpoint (`damage`): say how, from the kinds of what it did to path."""
    if how := _removed_or_moved(kinds):
        return (f"your save {how} before the new file took its place, and never renamed a file onto path (it put "
                "the new file there another way: os.link, say), so our kill, set for a rename onto path, never "
                f"came; when it returned, {damage}. Between those two steps there is no checkpoint at path at "
                "all: a crash there leaves none.")
    return ("your save never renamed a file onto path, nor opened path with open(), os.open or torch.save, "
            f"yet path no longer held the previous checkpoint when it returned ({damage}). It wrote into path "
            "in place by another way (a subprocess running cp, say), so our kill, set for a rename onto path, "
            "never came. Writing in place empties path first: a crash midway leaves a half-written file.")


def _rename_problem(events: list, scratch: Path, layout: Layout) -> str | None:
    """Check 3: the file renamed onto path was fsync'ed whole before the rename and lay under path's directory;
    None when so."""
    renames = [e for e in events if e["kind"] == "replace"]
    if not renames:
        return ("your save never renamed a file onto path (os.replace or os.rename): how else can path change from "
                "the old checkpoint to the new one in one step?")
    late = {e["source"]: e["synced_by"] for e in events if e["kind"] == "synced_after_replace"}
    for rename in renames:
        if not rename["under_directory"]:
            return _elsewhere_message(rename, scratch, layout)
        if rename["fsync"] == "unflushed":
            return _early_sync_message(rename)
        if rename["fsync"] == "no" and rename["source"] in late:
            return (f"your save called {late[rename['source']]} on {rename['source']!r} only after os.replace had "
                    "renamed it onto path. Until that fsync the new bytes may be only in the page cache, and the "
                    "rename can reach the disk before them: a crash in between (a power cut, a kernel crash) "
                    "leaves path naming the new file with its data not yet on disk, empty or partial, and the "
                    "previous checkpoint already gone.")
        if rename["fsync"] == "no":
            return (f"your save renamed {rename['source']!r} onto path with os.replace without fsync: the rename "
                    "is atomic, but the new bytes may still be only in the page cache. After a power cut or a "
                    "kernel crash the rename can reach the disk before the data, and path is then empty or "
                    "partial.")
    return None


def _elsewhere_message(rename: dict, scratch: Path, layout: Layout) -> str:
    """The message for a temporary file renamed onto path from outside path's directory. The rename worked here (it
    was on path's file system), but only by chance: the save gets any path."""
    if rename["relative"] and rename.get("in_working_directory"):
        where = ("the working directory (its name was relative, and a relative name is relative to the working "
                 "directory, which need not be path's)")
    elif Path(rename["directory"]).resolve() != (scratch / layout.folders["elsewhere"]).resolve():
        where = f"another directory ({Path(rename['directory']).name})"
    else:
        where = "tempfile's default directory (/tmp on most systems)"
    return (f"your temporary file {rename['source']!r} was made in {where}, not in path's directory. os.replace is "
            "atomic within one file system (rename(2)); here both were on one, so the rename worked, but your save "
            "gets any path, and checkpoints often live on another file system than that directory (/tmp is often "
            "a tmpfs in memory, or a local disk while checkpoints go to shared storage). There os.replace fails "
            "(OSError: Invalid cross-device link) and shutil.move falls back to a copy, which is not atomic.")


def _early_sync_message(rename: dict) -> str:
    """The message for a file fsync'ed (or os.sync'ed) before all the bytes renamed onto path had reached it."""
    said = f"your save called {rename['synced_by']} when {rename['source']!r}"
    after = " fsync(2) makes durable only what the file holds when it is called."
    if not rename["synced_nbytes"]:
        return (f"{said} was still empty, before anything was written into it, and then renamed it onto path "
                f"with {rename['nbytes']:,} bytes: none of them were made durable.{after}")
    return (f"{said} held {rename['synced_nbytes']:,} bytes, and renamed it onto path with {rename['nbytes']:,}: "
            "the rest was written after it, or still sat in Python's buffer, which fsync does not see." + after)


def _second_run_problem(save, scratch: Path, layout: Layout, timeout_seconds: float) -> str | None:
    """Checks 4 to 6 (module docstring), from the second run's report."""
    crash = scratch / layout.folders["crash"]
    leftovers = sorted(name for name in os.listdir(crash) if name != _TARGET)
    report, died = _run(_second_run, save, scratch, layout, timeout_seconds)
    if died:
        return died
    stale = report["stale"]
    if stale["error"] or stale["problem"]:
        return _stale_message(stale, leftovers)
    problem = _concurrent_problem(report["concurrent"])
    if problem:
        return problem
    damage = _state_problem(crash / _TARGET, 6, layout)
    if damage:
        return _damage_message(report["killed while writing"]["events"], damage, _half_of(10, layout),
                               armed=True)
    junk = [name for name in os.listdir(crash) if name != _TARGET and name.endswith(Path(_TARGET).suffix)]
    if junk:
        return (f"the saves we killed left {_names(junk)} beside path ({_TARGET!r}): a name that ends in "
                f"{Path(_TARGET).suffix!r} can be mistaken for a checkpoint, and whatever looks for the newest "
                f"*{Path(_TARGET).suffix} file would load a half-written one.")
    return None


def _stale_message(stale: dict, leftovers: list) -> str:
    """Check 4 failed: a save beside a killed save's leftovers raised, or saved something else."""
    left = f"left {_names(leftovers)} in path's directory" if leftovers else "left nothing behind"
    if stale["error"] is None:
        return (f"a save killed just before its rename {left}; the next save then returned, but "
                f"{stale['problem']}.")
    fixed = stale["error"]["filename"] in leftovers
    return (f"a save killed just before its rename {left}; the next save, called with {_given(stale)}, then "
            f"{_error_text(stale['error'], stale['events'], form=stale['form'])}." + (
                " Your temporary file has a fixed name, and a crashed save leaves it behind, so the name is still "
                "taken." if fixed else ""))


def _concurrent_problem(record: dict) -> str | None:
    """Check 5: two saves at once to the same path; None when both worked and one of the two states is at path."""
    intro = ("two saves to the same path at once (a second save, in another thread, ran from start to end while "
             "the first was about to rename its temporary file onto path): ")
    temporaries = [e["source"] for e in record["events"] if e["kind"] == "replace"]
    one_name = len(set(temporaries)) < len(temporaries) or any(
        error and error["filename"] in temporaries for error in (record["error"], record.get("second_error")))
    shared = ("Both saves used the same temporary file name, so the second overwrote the first's file and "
              "renamed it away (a name from os.getpid() alone is the same for two saves in one process)."
              ) if one_name else ""
    for which, error in (("first", record["error"]), ("second", record.get("second_error"))):
        if error:
            return f"{intro}the {which} {_error_text(error, record['events'])}. {shared}".rstrip()
    if record["problem"]:
        return f"{intro}afterwards {record['problem']}, neither save's state. {shared}".rstrip()
    if record["leftovers"]:
        return f"{intro}afterwards {_names(record['leftovers'])} remained beside path. {shared}".rstrip()
    return None


# ---- the rank side: the save run under watch, and killed ------------------------------------------------------

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
        forms = dict(zip(("normal 1", "normal 2", "normal 3"), random.sample(list(FORMS), len(FORMS)), strict=True))
        forms |= {key: random.choice(list(FORMS)) for key in ("killed before rename", "stale", "concurrent",
                                                              "killed while writing")}
        return Layout(folders, forms, rows=random.randrange(96, 161), columns=random.randrange(192, 321))

    def spelled(self, scratch: Path, folder: str, save: str) -> tuple[str, Path]:
        """(path as save `save` gets it, the working directory it is spelled against) for folder `folder`."""
        directory = scratch / self.folders[folder]
        form = self.forms[save]
        if form == "absolute":
            return str(directory / _TARGET), scratch / self.folders["elsewhere"]
        if form == "relative":
            return os.path.join(self.folders[folder], _TARGET), scratch
        return _TARGET, directory


def _saved_state(seed: int, layout: Layout) -> dict:
    """The state_dict a graded save writes: a layer's weight and bias and the step, different for every seed, of
    the layout's size (so that a save killed at half its bytes is killed midway through a write)."""
    generator = torch.Generator().manual_seed(seed)
    return {"layer.weight": torch.randn(layout.rows, layout.columns, generator=generator),
            "layer.bias": torch.randn(layout.rows, generator=generator), "step": torch.tensor(seed)}


def _half_of(seed: int, layout: Layout) -> int:
    """Half the bytes torch.save writes for _saved_state(seed, layout): where a save is killed midway."""
    buffer = io.BytesIO()
    torch.save(_saved_state(seed, layout), buffer)
    return buffer.getbuffer().nbytes // 2


def _state_problem(path, seed: int, layout: Layout, earlier: tuple[int, ...] = ()) -> str | None:
    """None when torch.load(path) gives _saved_state(seed) (same keys, dtypes and values), else what is wrong;
    when it gives the state of an `earlier` seed (a previous call's), says which call's."""
    path = Path(path)
    if not path.is_file():
        return f"there is no file at path ({path.name})"
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any failure to load is what the student must see
        first_line = (str(error).strip().splitlines() or [""])[0][:120]
        return (f"path holds {path.stat().st_size:,} bytes and torch.load(path) fails "
                f"({type(error).__name__}: {first_line})")
    wanted = _saved_state(seed, layout)
    if not isinstance(loaded, dict) or set(loaded) != set(wanted):
        shown = sorted(loaded) if isinstance(loaded, dict) else type(loaded).__name__
        return f"torch.load(path) gives {shown}, not the state_dict saved (keys {sorted(wanted)})"
    differ = [key for key, value in wanted.items() if not _same(loaded[key], value)]
    if not differ:
        return None
    for call, old in enumerate(earlier, start=1):
        if all(_same(loaded[key], value) for key, value in _saved_state(old, layout).items()):
            return (f"torch.load(path) gives the state_dict of save call {call}, not the one this call was given: "
                    "your save wrote what an earlier call was given")
    return f"torch.load(path) gives other values for {differ} than the state_dict saved"


def _same(loaded, wanted: torch.Tensor) -> bool:
    return isinstance(loaded, torch.Tensor) and loaded.dtype == wanted.dtype and torch.equal(loaded, wanted)


class _Report:
    """What the rank saw, phase by phase, kept in `scratch`/report.json and rewritten at every event, so that the
    grader can read it after the process was killed."""

    def __init__(self, scratch):
        self.path, self.phases = Path(scratch) / "report.json", {}
        self.lock = threading.RLock()  # a second save runs in a thread (the "concurrent" phase)

    def phase(self, name: str) -> dict:
        """A new phase's record: its events, and later its error, problem and leftovers."""
        self.phases[name] = {"events": [], "error": None, "problem": None, "leftovers": [], "finished": False,
                             "path": None, "form": None}
        self.flush()
        return self.phases[name]

    def flush(self) -> None:
        """Rewrite the report file (the watch sees this open too, and ignores it: not the target)."""
        with self.lock, open(self.path, "w") as file:
            json.dump(self.phases, file)

    @staticmethod
    def read(scratch) -> dict:
        """The phases a rank recorded in `scratch`, {} if it recorded none."""
        try:
            return json.loads((Path(scratch) / "report.json").read_text())
        except (OSError, ValueError):  # none yet, or cut short by the process's death
            return {}


def _arm(nbytes: int) -> None:
    """From now on the kernel kills this process (SIGXFSZ, no core file) at the first write that takes a file past
    `nbytes` bytes (setrlimit(2) RLIMIT_FSIZE). The watch's exit undoes it if the process is still alive."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)


def _kill(report: _Report) -> None:
    """SIGKILL this process now, as a crash would: no exception, no finally, no cleanup."""
    report.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class _RefusedSave(RuntimeError):
    """Raised inside a graded save that calls labkit.checkpoint's own atomic write."""


def _ready_made(file: Path, _qualified_name: str) -> str | None:
    return "labkit.checkpoint's atomic write" if str(file).startswith(_READY_MADE) else None


class _SaveWatch(FileWatch):
    """The kit's watch on one save: its events go into the phase's `record` of `report` at once (the process may
    be killed next); while it is on, tempfile's default directory is `elsewhere` and the working directory
    `working`; `on_start()` runs once it is on, `on_write()` when the target is opened for writing, `on_replace()`
    just before a rename onto it, where labkit.checkpoint's own atomic write is refused (found on the call stack).
    A temporary file made "elsewhere" thus stays inside the grader's temporary directory. What `_arm` changes and
    the working directory are put back on exit, after the hooks are off."""

    def __init__(self, target, elsewhere, working, report: _Report, record: dict, save, on_start=None,
                 on_write=None, on_replace=None):
        super().__init__(target, follow=save, scanned=(elsewhere,))
        self.elsewhere, self.working, self.report, self.record = str(elsewhere), str(working), report, record
        self.on_start, self.on_write, self.on_replace = on_start, on_write, on_replace  # each takes no argument

    def install(self) -> None:
        for limit in (resource.RLIMIT_FSIZE, resource.RLIMIT_CORE):
            self.on_exit(resource.setrlimit, limit, resource.getrlimit(limit))
        self.on_exit(signal.signal, signal.SIGXFSZ, signal.getsignal(signal.SIGXFSZ))
        self.on_exit(os.chdir, os.getcwd())
        self.patch(tempfile, "tempdir", self.elsewhere)
        super().install()
        os.chdir(self.working)
        if self.on_start:
            self.on_start()

    def note(self, event: dict) -> None:
        with self.report.lock:
            self.record["events"].append(event)
            self.report.flush()

    def wrote(self) -> None:
        if self.on_write:
            self.on_write()

    def replacing(self) -> None:
        if outermost_caller(_ready_made):
            self.note({"kind": "ready_made"})
            raise _RefusedSave("labkit.checkpoint's own atomic save is switched off while this exercise is graded")
        if self.on_replace:
            self.on_replace()


class _Run:
    """One run of the student's save on this rank: its scratch directory, the layout drawn, the report."""

    def __init__(self, save, scratch, layout: Layout):
        self.save, self.scratch, self.layout, self.report = save, Path(scratch), layout, _Report(scratch)

    def directory(self, folder: str) -> Path:
        return self.scratch / self.layout.folders[folder]

    def call(self, record: dict, folder: str, key: str, seed: int, then=None, check: bool = True,
             earlier: tuple[int, ...] = (), **hooks) -> bool:
        """save(_saved_state(seed), path) under a watch, path in `folder` spelled as the layout says for save `key`
        (and the working directory set for it), then `then()` (still watched); the save's exception (if any) goes
        into `record`, then (with `check`) what path holds, and what else with data in it is in the folder.
        Whether the save went well."""
        path, working = self.layout.spelled(self.scratch, folder, key)
        record["path"], record["form"] = path, self.layout.forms[key]
        directory = self.directory(folder)
        with _SaveWatch(directory / _TARGET, self.directory("elsewhere"), working, self.report, record, self.save,
                        **hooks):
            try:
                self.save(_saved_state(seed, self.layout), path)
            except Exception as error:  # noqa: BLE001 - the student's error, reported by the grader
                record["error"] = _error_record(error)
            if then:
                then()
        record["finished"] = True
        if record["error"] is None and check:
            record["problem"] = _state_problem(directory / _TARGET, seed, self.layout, earlier)
        record["leftovers"] = sorted(entry.name for entry in os.scandir(directory) if entry.name != _TARGET
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


def _first_run(save, scratch, layout: Layout) -> None:
    """Phases "normal" (three saves of different states, into an empty folder then over the last one, path spelled
    each of the three ways) and "killed before rename" (a save over a good checkpoint, killed at its rename onto
    path, or midway through any write once it opened path itself for writing). The grader reads the report; this
    process normally dies."""
    run = _Run(save, scratch, layout)
    record = run.report.phase("normal")
    for call, seed in enumerate((1, 2, 3), start=1):
        record["call"] = call
        if not run.call(record, "normal", f"normal {call}", seed, earlier=tuple(range(1, seed))):
            return
    torch.save(_saved_state(4, layout), run.directory("crash") / _TARGET)
    record = run.report.phase("killed before rename")
    nbytes = _half_of(5, layout)
    run.call(record, "crash", "killed before rename", 5, check=False, on_write=lambda: _arm(nbytes),
             on_replace=lambda: _kill(run.report))


def _second_run(save, scratch, layout: Layout) -> None:
    """Phases "stale" (a save beside the leftovers of the killed one), "concurrent" (a second save runs whole
    while the first is about to rename) and "killed while writing" (a save killed at the first write past half its
    bytes). The grader reads the report; this process normally dies."""
    run = _Run(save, scratch, layout)
    record = run.report.phase("stale")
    if not run.call(record, "crash", "stale", 6):
        return
    torch.save(_saved_state(7, layout), run.directory("concurrent") / _TARGET)
    record = run.report.phase("concurrent")
    record["second_error"] = None
    overtaker = _Overtaker(save, layout.spelled(run.scratch, "concurrent", "concurrent")[0], layout, record)
    run.call(record, "concurrent", "concurrent", 8, check=False, on_replace=overtaker, then=overtaker.finish)
    target = run.directory("concurrent") / _TARGET
    record["problem"] = _state_problem(target, 8, layout) and _state_problem(target, 9, layout)
    record = run.report.phase("killed while writing")
    nbytes = _half_of(10, layout)
    run.call(record, "crash", "killed while writing", 10, check=False, on_start=lambda: _arm(nbytes))


class _Overtaker:
    """An on_replace that, the first time, starts a second save of _saved_state(9) to the same path (as spelled for
    the first), in a thread, and waits for it: two saves at once, the second overtaking the first. A second save
    that waits for a lock the first one holds goes on once the first has renamed (after _OVERTAKE_SECONDS);
    `finish` waits for it then."""

    def __init__(self, save, path: str, layout: Layout, record: dict):
        self.save, self.path, self.layout, self.record, self.thread = save, path, layout, record, None

    def __call__(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._second, daemon=True)
            self.thread.start()
            self.thread.join(_OVERTAKE_SECONDS)

    def _second(self) -> None:
        try:
            self.save(_saved_state(9, self.layout), self.path)
        except Exception as error:  # noqa: BLE001 - the student's error, reported by the grader
            self.record["second_error"] = _error_record(error)

    def finish(self) -> None:
        """Wait for the second save (still watched); one that never ends counts as its error."""
        if self.thread is not None:
            self.thread.join(_OVERTAKE_SECONDS)
            if self.thread.is_alive():
                self.record["second_error"] = _error_record(TimeoutError(
                    f"the second save had not returned {2 * _OVERTAKE_SECONDS:g} s after it started"))
