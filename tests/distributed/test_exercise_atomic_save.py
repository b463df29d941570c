"""check_atomic_save (notebook 09's exercise) against a catalogue of wrong saves, each rejected with a message that
names the mistake, and right saves written in different ways, all accepted.

The grader runs each save in a process of its own (labkit.run on 1 rank) and kills it there on purpose, so every
case here is a real crash: a save that writes into path itself loses the previous checkpoint for real.
"""

import fcntl
import io
import os
import resource
import secrets
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch

import labkit
from labkit.checkpoint import files
from labkit.exercises.atomic_save import check_atomic_save


@pytest.fixture(scope="module", autouse=True)
def warm_pool():
    """Start the pool of 1 rank and import the grader's rank side in it, so that no case's timeout is spent
    starting processes on a loaded machine."""
    labkit.run(__import__, "labkit.exercises.atomic_watch", world_size=1)


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


@pytest.mark.parametrize("save", [named_temporary_file, mkstemp_with_cleanup, with_suffix_and_directory_fsync])
def test_right_saves_written_differently_pass(save):
    verdict = check_atomic_save(save, record=False)
    assert verdict, verdict
    assert "killed just before its rename" in verdict.message
    assert ("You fsync the directory too" in verdict.message) == (save is with_suffix_and_directory_fsync)


@pytest.mark.parametrize("save", [fixed_name_under_a_lock, os_sync_instead_of_fsync, temporary_in_a_subdirectory])
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
    (file_io_in_place, "never renamed a file onto path, nor opened path with open()", "io.FileIO(path, \"w\")",
     "never came"),
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
    """What the watch changes on a rank while a save runs: it must all be back afterwards."""
    return ([f.__module__ for f in (os.replace, os.rename, os.fsync, open, torch.save)], tempfile.tempdir,
            resource.getrlimit(resource.RLIMIT_FSIZE), os.getcwd())


def test_the_rank_is_left_as_it_was_and_nothing_outside_a_temporary_directory_is_touched():
    before = labkit.run(_rank_state, world_size=1)
    leftovers = set(Path(tempfile.gettempdir()).glob("labkit-atomic-save-*"))
    assert not check_atomic_save(not_written_yet, record=False)  # the rank survives this one: no kill
    assert labkit.run(_rank_state, world_size=1) == before
    assert set(Path(tempfile.gettempdir()).glob("labkit-atomic-save-*")) == leftovers
