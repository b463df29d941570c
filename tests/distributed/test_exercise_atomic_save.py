"""check_atomic_save (notebook 09's exercise) against a catalogue of wrong saves, each rejected with a message that
names the mistake, and right saves written in different ways, all accepted.

The grader runs each save in a process of its own (labkit.run on 1 rank) and kills it there on purpose, so every
case here is a real crash: a save that writes into path itself loses the previous checkpoint for real.
"""

import dataclasses
import fcntl
import io
import os
import resource
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from os import fsync, rename, replace
from pathlib import Path

import pytest
import torch

import labkit
from labkit.checkpoint import files
from labkit.exercises._kit._file_watch import FileWatch, watching
from labkit.exercises.atomic_save import FORMS, Layout, check_atomic_save


@pytest.fixture(scope="module", autouse=True)
def warm_pool():
    """Start the fork server (its import of torch) with a first 1-rank call, so that no case's timeout is spent on
    it on a loaded machine (each save run gets a fresh 1-rank pool of the grader's own, discarded after it)."""
    labkit.run(__import__, "labkit.exercises.atomic_save", world_size=1)


# ---- right saves, written differently ---------------------------------------------------------------------

def named_temporary_file(state_dict, path):
    """tempfile.NamedTemporaryFile beside path (delete=False: the rename takes it away), fsync, os.replace."""
    with tempfile.NamedTemporaryFile(dir=os.path.dirname(path), suffix=".tmp", delete=False) as file:
        torch.save(state_dict, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(file.name, path)


def mkstemp_with_cleanup(state_dict, path):
    """tempfile.mkstemp beside path, the file object from its descriptor; the temporary file removed on error."""
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".checkpoint-")
    try:
        with os.fdopen(fd, "wb") as file:
            torch.save(state_dict, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def with_suffix_and_directory_fsync(state_dict, path):
    """pathlib: a fresh name by path.with_suffix, O_EXCL, Path.replace, then the directory fsync'ed too."""
    path = Path(path)
    temporary = path.with_suffix(f".{secrets.token_hex(8)}.tmp")
    with open(temporary, "xb") as file:
        torch.save(state_dict, file)
        file.flush()
        os.fsync(file.fileno())
    temporary.replace(path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def fixed_name_under_a_lock(state_dict, path):
    """A fixed temporary name, but saves take turns: flock(2) on a lock file beside path (a second save waits for
    the first to rename), and "wb" overwrites a crashed save's leftover."""
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with open(path + ".tmp", "wb") as file:
            torch.save(state_dict, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(path + ".tmp", path)


def os_sync_instead_of_fsync(state_dict, path):
    """os.sync() (every file system's dirty data to disk) in place of os.fsync: heavy-handed, but durable."""
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(path))
    with os.fdopen(fd, "wb") as file:
        torch.save(state_dict, file)
    os.sync()
    os.rename(temporary, path)


def temporary_in_a_subdirectory(state_dict, path):
    """The temporary file in a folder inside path's directory: on path's file system, so the rename is atomic."""
    folder = os.path.join(os.path.dirname(path), ".tmp")
    os.makedirs(folder, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=folder)
    with os.fdopen(fd, "wb") as file:
        torch.save(state_dict, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def imported_from_os(state_dict, path):
    """`from os import fsync, replace` (module level): the grader follows the functions, not their names."""
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(path) or ".")
    with os.fdopen(fd, "wb") as file:
        torch.save(state_dict, file)
        file.flush()
        fsync(file.fileno())
    replace(temporary, path)


def imported_rename_and_torch_save(state_dict, path):
    """`from os import rename` and torch.save imported under another name, into a Path beside path."""
    from torch import save as write_checkpoint

    temporary = Path(path).with_name(f".{Path(path).name}.{secrets.token_hex(6)}.partial")
    with open(temporary, "xb") as file:
        write_checkpoint(state_dict, file)
        file.flush()
        fsync(file)  # os.fsync takes a file object too (its fileno())
    rename(temporary, path)


def shutil_move_beside_path(state_dict, path):
    """A temporary file beside path moved onto it with shutil.move (a rename on one file system)."""
    with tempfile.NamedTemporaryFile(dir=Path(path).parent, delete=False, suffix=".tmp") as file:
        torch.save(state_dict, file)
        file.flush()
        os.fdatasync(file.fileno())
    shutil.move(file.name, path)


def sync_as_a_default_argument(state_dict, path, sync=os.fsync, swap=os.replace):
    """The sync and rename functions taken as default arguments."""
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)))
    with os.fdopen(fd, "wb") as file:
        torch.save(state_dict, file)
        file.flush()
        sync(file.fileno())
    swap(temporary, path)


DURABLE = {"file": os.fsync}  # a table of functions: a binding the grader does not follow


def sync_through_a_table(state_dict, path):
    """os.fsync reached through a dict of functions: seen by the profile hook, its file not known."""
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)))
    with os.fdopen(fd, "wb") as file:
        torch.save(state_dict, file)
        file.flush()
        DURABLE["file"](file.fileno())
    Path(temporary).replace(path)


@pytest.mark.parametrize("save", [named_temporary_file, mkstemp_with_cleanup, with_suffix_and_directory_fsync])
def test_right_saves_written_differently_pass(save):
    verdict = check_atomic_save(save, record=False)
    assert verdict, verdict
    assert "killed just before its rename" in verdict.message
    assert ("You fsync the directory too" in verdict.message) == (save is with_suffix_and_directory_fsync)


@pytest.mark.parametrize("save", [fixed_name_under_a_lock, os_sync_instead_of_fsync, temporary_in_a_subdirectory,
                                  imported_from_os, imported_rename_and_torch_save, shutil_move_beside_path,
                                  sync_as_a_default_argument, sync_through_a_table])
def test_less_usual_right_saves_pass(save):
    """Not what the notebook teaches, but atomic all the same: the grader must not refuse them."""
    verdict = check_atomic_save(save, record=False)
    assert verdict, verdict


# ---- wrong saves ------------------------------------------------------------------------------------------

def straight_to_path(state_dict, path):
    """torch.save straight to path: a crash midway leaves half a file."""
    torch.save(state_dict, path)


def open_path_then_write(state_dict, path):
    """open(path, "wb") then write: path is emptied at once."""
    with open(path, "wb") as file:
        torch.save(state_dict, file)
        file.flush()
        os.fsync(file.fileno())


def write_then_copy(state_dict, path):
    """A temporary file, then shutil.copy over path: the copy rewrites path in place."""
    temporary = path + ".tmp"
    with open(temporary, "wb") as file:
        torch.save(state_dict, file)
        file.flush()
        os.fsync(file.fileno())
    shutil.copy(temporary, path)
    os.remove(temporary)


def replace_without_fsync(state_dict, path):
    """os.replace without fsync: the rename may reach the disk before the data."""
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(path))
    with os.fdopen(fd, "wb") as file:
        torch.save(state_dict, file)
    os.replace(temporary, path)


def fsync_after_replace(state_dict, path):
    """os.replace first, os.fsync of the renamed file afterwards: the rename may reach the disk before the data."""
    temporary = f"{path}.{secrets.token_hex(8)}.tmp"
    with open(temporary, "wb") as file:
        torch.save(state_dict, file)
        file.flush()
    os.replace(temporary, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_in_tmp(state_dict, path):
    """NamedTemporaryFile without dir=: the temporary file is in /tmp, another directory."""
    with tempfile.NamedTemporaryFile(delete=False) as file:  # no dir=: tempfile's default directory
        torch.save(state_dict, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(file.name, path)


def remove_then_rename(state_dict, path):
    """os.remove(path), then the rename: a moment with no checkpoint."""
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(path))
    with os.fdopen(fd, "wb") as file:
        torch.save(state_dict, file)
        file.flush()
        os.fsync(file.fileno())
    if os.path.exists(path):
        os.remove(path)
    os.rename(temporary, path)


def remove_then_link(state_dict, path):
    """os.remove(path), then os.link of the new file: a moment with no checkpoint, and no rename to kill at."""
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(path))
    with os.fdopen(fd, "wb") as file:
        torch.save(state_dict, file)
        file.flush()
        os.fsync(file.fileno())
    if os.path.exists(path):
        os.remove(path)
    os.link(temporary, path)
    os.remove(temporary)


def backup_then_rename(state_dict, path):
    """path renamed to a backup, then the new file renamed onto path: a moment with no checkpoint."""
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(path))
    with os.fdopen(fd, "wb") as file:
        torch.save(state_dict, file)
        file.flush()
        os.fsync(file.fileno())
    if os.path.exists(path):
        os.rename(path, path + ".bak")
    os.rename(temporary, path)


def fixed_name_exclusive(state_dict, path):
    """A fixed temporary name opened with "xb": taken forever by a crashed save's leftover."""
    with open(path + ".tmp", "xb") as file:  # a fixed name, never cleaned up after a crash
        torch.save(state_dict, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(path + ".tmp", path)


def fixed_name_reused(state_dict, path):
    """A fixed temporary name opened with "wb": two saves at once write the same file."""
    with open(path + ".tmp", "wb") as file:  # a fixed name, overwritten by whichever save comes next
        torch.save(state_dict, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(path + ".tmp", path)


def fsync_before_flush(state_dict, path):
    """os.fsync while the last small writes still sit in Python's buffer."""
    buffer = __import__("io").BytesIO()
    torch.save(state_dict, buffer)
    data = buffer.getvalue()
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(path))
    with os.fdopen(fd, "wb") as file:
        for start in range(0, len(data), 4096):  # small writes collect in Python's buffer
            file.write(data[start:start + 4096])
        os.fsync(file.fileno())
    os.replace(temporary, path)


def fsync_before_writing(state_dict, path):
    """os.fsync on the empty temporary file, before torch.save writes into it."""
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(path))
    with os.fdopen(fd, "wb") as file:
        os.fsync(file.fileno())
        torch.save(state_dict, file)
    os.replace(temporary, path)


def os_sync_before_writing(state_dict, path):
    """os.sync() before the temporary file is written: it makes nothing of the new checkpoint durable."""
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(path))
    os.sync()
    with os.fdopen(fd, "wb") as file:
        torch.save(state_dict, file)
    os.replace(temporary, path)


def file_io_in_place(state_dict, path):
    """io.FileIO(path, "w"): writes path in place, through a call the grader does not watch."""
    with io.FileIO(path, "w") as file:
        torch.save(state_dict, file)


def pid_only_name(state_dict, path):
    """A temporary name from the process id alone: two saves in one process share it."""
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "wb") as file:
        torch.save(state_dict, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def course_atomic_write(state_dict, path):
    """labkit.checkpoint's own atomic write: the course's answer, refused."""
    files.write_atomically(Path(path), state_dict)


def delete_on_close(state_dict, path):
    """NamedTemporaryFile(delete=True), renamed inside the with: its close cannot find the file."""
    with tempfile.NamedTemporaryFile(dir=os.path.dirname(path)) as file:  # delete=True: it removes it at close
        torch.save(state_dict, file)
        file.flush()
        os.fsync(file.fileno())
        os.replace(file.name, path)


def temporary_named_like_a_checkpoint(state_dict, path):
    """A temporary file named *.pt: a killed save leaves what looks like a checkpoint."""
    path = Path(path)
    temporary = path.with_name(f"new-{secrets.token_hex(4)}-{path.name}")  # new-1a2b3c4d-model.pt
    with open(temporary, "xb") as file:
        torch.save(state_dict, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def imported_torch_save_straight(state_dict, path):
    """torch.save imported under another name, straight to path: seen where torch.save's code runs."""
    from torch import save as write_checkpoint

    write_checkpoint(state_dict, path)


def imported_replace_without_fsync(state_dict, path):
    """`from os import replace` and no fsync: the rename is seen, and so is the missing fsync."""
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)))
    with os.fdopen(fd, "wb") as file:
        torch.save(state_dict, file)
    replace(temporary, path)


def write_bytes_in_place(state_dict, path):
    """Path.write_bytes of the serialized bytes: path rewritten in place."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    Path(path).write_bytes(buffer.getvalue())


def shutil_move_from_tmp(state_dict, path):
    """The temporary file in tempfile's default directory, then shutil.move: a rename here, a copy elsewhere."""
    with tempfile.NamedTemporaryFile(delete=False) as file:
        torch.save(state_dict, file)
        file.flush()
        fsync(file.fileno())
    shutil.move(file.name, path)


def copy_in_a_subprocess(state_dict, path):
    """cp run as a subprocess: path rewritten in place where no audit hook of this process sees it."""
    temporary = f"{path}.{secrets.token_hex(8)}.tmp"
    with open(temporary, "wb") as file:
        torch.save(state_dict, file)
        file.flush()
        os.fsync(file.fileno())
    subprocess.run(["cp", temporary, path], check=True)
    os.remove(temporary)


def directory_of_a_bare_name(state_dict, path):
    """The directory fsync'ed by os.path.dirname(path): '' for a bare file name, which os.open cannot open."""
    directory = os.path.dirname(path)
    fd, temporary = tempfile.mkstemp(dir=directory or None)
    with os.fdopen(fd, "wb") as file:
        torch.save(state_dict, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    directory_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(directory_fd)
    finally:
        os.close(directory_fd)


def temporary_in_the_working_directory(state_dict, path):
    """A temporary name made from path's file name alone: relative, so in the working directory, not path's."""
    temporary = f".{os.path.basename(path)}.{secrets.token_hex(8)}.tmp"
    with open(temporary, "xb") as file:
        torch.save(state_dict, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


_SERIALIZED = {}  # the first checkpoint's bytes, kept by the save below


def serializes_once(state_dict, path):
    """Serializes the state_dict on its first call only (to save time) and writes those bytes every time."""
    if "bytes" not in _SERIALIZED:
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)
        _SERIALIZED["bytes"] = buffer.getvalue()
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)))
    with os.fdopen(fd, "wb") as file:
        file.write(_SERIALIZED["bytes"])
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


_BY_SHAPES = {}  # serialized bytes by the state_dict's keys and shapes, kept by the save below


def cached_by_shapes(state_dict, path):
    """A serialization cache keyed on the state_dict's keys and shapes, not its values: a later state_dict of the
    same shapes gets the first one's bytes."""
    key = tuple((name, tuple(value.shape)) for name, value in state_dict.items())
    if key not in _BY_SHAPES:
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)
        _BY_SHAPES[key] = buffer.getvalue()
    with tempfile.NamedTemporaryFile(dir=os.path.dirname(os.path.abspath(path)), delete=False) as file:
        file.write(_BY_SHAPES[key])
        file.flush()
        os.fsync(file.fileno())
    os.replace(file.name, path)


def not_written_yet(state_dict, path):
    """The notebook's stub."""
    raise NotImplementedError("your turn")


def exits_the_process(state_dict, path):
    """A save that ends its own process (os._exit skips every cleanup)."""
    os._exit(3)


def waits_forever(state_dict, path):
    """A save that never returns."""
    time.sleep(60)


WRONG = [
    (straight_to_path, "torch.save(state_dict, path) writes straight into path", "torch.load(path) fails"),
    (open_path_then_write, "the previous checkpoint is lost. Your save opened path itself for writing"),
    (write_then_copy, "is lost. Copying onto path", "A copy is not a rename"),
    (replace_without_fsync, "with os.replace without fsync"),
    (fsync_after_replace, "called os.fsync on", "only after os.replace had renamed it onto path"),
    (temporary_in_tmp, "tempfile's default directory", "here both were on one, so the rename worked"),
    (remove_then_rename, "removed path (os.remove) before renaming", "there is no file at path"),
    (remove_then_link, "removed path (os.remove) before the new file took its place", "a crash there leaves none"),
    (backup_then_rename, "is lost. Your save moved path away before renaming"),
    (fixed_name_exclusive, "Your temporary file has a fixed name"),
    (fixed_name_reused, "Both saves used the same temporary file name"),
    (pid_only_name, "Both saves used the same temporary file name", "os.getpid() alone"),
    (fsync_before_flush, "still sat in Python's buffer", "called os.fsync when"),
    (fsync_before_writing, "called os.fsync when", "was still empty, before anything was written into it"),
    (os_sync_before_writing, "called os.sync() when", "was still empty, before anything was written into it"),
    (file_io_in_place, "is lost. Your save opened path itself for writing", "io.FileIO"),
    (imported_torch_save_straight, "torch.save(state_dict, path) writes straight into path"),
    (imported_replace_without_fsync, "with os.replace without fsync"),
    (write_bytes_in_place, "is lost. Your save opened path itself for writing", "Path.write_bytes"),
    (shutil_move_from_tmp, "tempfile's default directory", "shutil.move falls back to a copy"),
    (copy_in_a_subprocess, "never renamed a file onto path, nor opened path with open()", "a subprocess",
     "never came"),
    (directory_of_a_bare_name, "a bare file name", "whose os.path.dirname is ''", "FileNotFoundError"),
    (temporary_in_the_working_directory, "was made in the working directory (its name was relative"),
    (serializes_once, "gives the state_dict of save call 1", "Nothing may carry over from one call to the next"),
    (cached_by_shapes, "gives the state_dict of save call 1", "an earlier call"),
    (course_atomic_write, "labkit.checkpoint's own atomic save"),
    (delete_on_close, "removes its file when it is closed (delete=True, its default)"),
    (temporary_named_like_a_checkpoint, "can be mistaken for a checkpoint"),
    (not_written_yet, "Write the body of save"),
    (exits_the_process, "process running your save died", "during the normal save"),
]


@pytest.mark.parametrize("case", WRONG, ids=[save.__name__ for save, *_ in WRONG])
def test_wrong_saves_are_rejected_with_their_mistake_named(case):
    save, *phrases = case  # the phrases the message must hold: the mistake named, the damage shown
    verdict = check_atomic_save(save, record=False)
    assert not verdict, save.__name__
    assert all(phrase in verdict.message for phrase in phrases), verdict.message
    assert "labkit-atomic-save-" not in verdict.message  # the grader's own directory is left out


OTHER_FILE_SYSTEM = "/dev/shm"  # a tmpfs on Linux, while the grader's directory is under tempfile's (/tmp)


def temporary_on_another_file_system(state_dict, path):
    """The temporary file on another file system than path: os.replace fails (EXDEV); cleaned up on error."""
    fd, temporary = tempfile.mkstemp(dir=OTHER_FILE_SYSTEM, prefix="labkit-atomic-test-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            torch.save(state_dict, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        os.remove(temporary)
        raise


@pytest.mark.skipif(not os.path.isdir(OTHER_FILE_SYSTEM) or os.stat(OTHER_FILE_SYSTEM).st_dev
                    == os.stat(tempfile.gettempdir()).st_dev, reason=f"{OTHER_FILE_SYSTEM} is not another file system")
def test_a_temporary_file_on_another_file_system_is_told_the_rename_cannot_cross():
    verdict = check_atomic_save(temporary_on_another_file_system, record=False)
    assert not verdict and "Invalid cross-device link" in verdict.message, verdict.message
    assert "a rename cannot cross file systems" in verdict.message, verdict.message


def test_a_save_that_hangs_is_stopped():
    began = time.monotonic()
    verdict = check_atomic_save(waits_forever, timeout_seconds=2, record=False)
    assert not verdict and "did not return within 2 s" in verdict.message, verdict.message
    assert time.monotonic() - began < 30


def test_not_a_function():
    verdict = check_atomic_save("save", record=False)
    assert not verdict and "pass your function itself" in verdict.message


def _rank_state():
    """What the watch changes on a rank while a save runs: it must all be back afterwards, and its audit hook (which
    stays: an audit hook cannot be removed) reports to no watch."""
    return ([f.__module__ for f in (os.replace, os.rename, os.fsync, fsync, open, torch.save)], tempfile.tempdir,
            resource.getrlimit(resource.RLIMIT_FSIZE), resource.getrlimit(resource.RLIMIT_CORE), os.getcwd(),
            sys.getprofile(), watching())


def test_the_rank_is_left_as_it_was_and_nothing_outside_a_temporary_directory_is_touched(tmp_path, monkeypatch):
    # The grader's scratch directory goes under this test's own temporary directory: the other pytest-xdist worker
    # grades atomic saves too, in the shared /tmp, and its scratch directories come and go meanwhile (a flake).
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = labkit.run(_rank_state, world_size=1)
    assert not check_atomic_save(not_written_yet, record=False)  # the rank survives this one: no kill
    assert labkit.run(_rank_state, world_size=1) == before
    assert list(tmp_path.iterdir()) == []


# ---- what each grading draws afresh: path's spelling, its folder's name, the state_dict's size ----------------

def test_each_grading_draws_a_layout_that_spells_path_three_ways():
    layouts = [Layout.draw() for _ in range(20)]
    for layout in layouts:
        assert sorted(layout.forms[f"normal {call}"] for call in (1, 2, 3)) == sorted(FORMS)
        assert all(" " in folder for folder in layout.folders.values())
        assert 96 <= layout.rows <= 160 and 192 <= layout.columns <= 320
    assert len({(layout.rows, layout.columns) for layout in layouts}) > 1
    assert len({tuple(layout.forms.values()) for layout in layouts}) > 1


_DRAW = Layout.draw


def _forced(first: str, smallest: bool) -> Layout:
    """A drawn layout with the normal saves' spellings rotated to start at `first`, every other save spelled `first`
    too, and the smallest or largest state_dict."""
    layout = _DRAW()
    forms = list(FORMS)
    order = forms[forms.index(first):] + forms[:forms.index(first)]
    forms = {key: order[int(key[-1]) - 1] if key.startswith("normal") else first for key in layout.forms}
    return dataclasses.replace(layout, forms=forms, rows=96 if smallest else 160, columns=192 if smallest else 320)


@pytest.mark.parametrize("first", FORMS)
@pytest.mark.parametrize(("save", "phrase"), [(named_temporary_file, None),
                                              (directory_of_a_bare_name, "a bare file name"),
                                              (temporary_in_the_working_directory, "in the working directory")],
                         ids=["right", "bare_dirname", "working_directory"])
def test_the_draw_decides_nothing(monkeypatch, first, save, phrase):
    """Whatever the draw, a right save passes and the draw-sensitive wrong ones are refused, with their mistake."""
    monkeypatch.setattr(Layout, "draw", staticmethod(lambda: _forced(first, smallest=first == "relative")))
    verdict = check_atomic_save(save, record=False)
    assert bool(verdict) == (phrase is None) and (phrase is None or phrase in verdict.message), verdict


def _watch_then_write(directory):
    """On a rank: a watch on directory/model.pt whose `with` raises, then the same writes with no watch on. What the
    watch recorded, during and after, and whether everything it changed is back."""
    target, before = Path(directory) / "model.pt", _watched_state()
    watch = FileWatch(target)
    try:
        with watch:
            open(target, "wb").close()
            raise KeyError("the save's own error")
    except KeyError:
        pass
    during = [event["kind"] for event in watch.events]
    open(target, "wb").close()
    os.replace(target, Path(directory) / "other.pt")
    after = [event["kind"] for event in watch.events]
    return during, after, watching(), _watched_state() == before


def _watched_state():
    """What a watch changes while it is on: the sync functions' bindings (os's, this module's), the profile hooks."""
    return os.fsync, os.fdatasync, os.sync, fsync, sys.getprofile(), threading.getprofile(), watching()


def test_a_watch_is_undone_when_its_with_raises_and_its_hooks_stay_inert_afterwards(tmp_path):
    [(during, after, is_on, restored)] = labkit.run(_watch_then_write, str(tmp_path), world_size=1)
    assert during == after == ["write"]  # the write under the watch seen; none after it, though the hook stays
    assert not is_on and restored


class _FailsInstalling(FileWatch):
    """A watch whose install fails once everything is on (the kit's hooks and every sync binding replaced)."""

    def install(self):
        super().install()
        assert watching() and os.fsync.__module__ == FileWatch.__module__  # the wrapper, not posix's
        raise OSError("installing failed")


def _install_fails_then_nest(directory):
    """On a rank: a watch whose install raises, then a watch inside a watch. Whether everything was put back after
    the failed install, and what the nested one raised."""
    before, target = _watched_state(), Path(directory) / "model.pt"
    try:
        with _FailsInstalling(target, follow=sync_as_a_default_argument):
            pass
    except OSError:
        pass
    restored = _watched_state() == before and sync_as_a_default_argument.__defaults__ == (os.fsync, os.replace)
    nested = None
    with FileWatch(target):
        try:
            with FileWatch(target):
                pass
        except RuntimeError as error:
            nested = str(error)
    return restored, nested, _watched_state() == before


def test_a_watch_whose_install_fails_puts_everything_back_and_one_watch_is_on_at_a_time(tmp_path):
    [(restored, nested, restored_again)] = labkit.run(_install_fails_then_nest, str(tmp_path), world_size=1)
    assert restored and restored_again
    assert "already on" in nested
