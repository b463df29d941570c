"""One run per checkpoint directory: its writer's process holds an exclusive flock(2) on the directory's lock file.

A second run (or a second group) saving into the same directory would overwrite and rotate away the first one's
checkpoints; it is refused instead, naming the holder's pid (from Linux's /proc/locks). The lock is taken at the
first save and held until the process ends: the kernel drops it even when the process is killed.

The lock is on a file, `.labkit-lock` (mode 0600), not on the directory: any user who can open a folder can flock
it, so another local user holding a flock on a 0755 checkpoint folder made every save fail "in use by another
run" (issue 28); only the owner can open a 0600 file, and the folder is private (labkit._private_files), so no one
else can plant one.
Source: flock(2); /proc/locks in proc(5).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from labkit import _private_files
from labkit.checkpoint.failures import CheckpointError, CheckpointWarning

__all__ = ["LOCK_NAME", "lock_directory"]

LOCK_NAME = ".labkit-lock"  # in the checkpoint directory; a listing of checkpoints leaves it out

_locks: dict[tuple[int, int], int] = {}  # (st_dev, st_ino) of a directory this process holds -> its descriptor


def lock_directory(directory: Path) -> None:
    """Hold an exclusive flock(2) on `directory`'s lock file until this process ends: one run per directory.

    A second process saving there would overwrite and rotate away this run's checkpoints; it is refused,
    naming this one. The kernel releases the lock when the holder ends, even when it is killed."""
    _forget_removed()
    info = os.stat(directory)
    if (info.st_dev, info.st_ino) in _locks:
        return
    lock_file = Path(directory) / LOCK_NAME
    try:
        fd = _private_files.hold_lock(lock_file, "checkpoint lock file", wait_seconds=0)
    except PermissionError:
        raise  # a planted or loose lock file: the refusal names it
    except OSError as exc:  # a file system without flock (some network mounts): save, unprotected
        warnings.warn(f"cannot lock checkpoint directory {directory} ({exc.strerror or exc}): a second run saving "
                      "there would not be detected.", CheckpointWarning, stacklevel=3)
        return
    if fd is None:
        raise CheckpointError(
            f"checkpoint directory {directory} is in use by another run: {_lock_holder(os.stat(lock_file))} holds "
            "its lock. Two runs saving into one directory would overwrite and rotate away each other's checkpoints. "
            "Save into another directory, or end that run first (an idle labkit.run pool keeps its ranks alive "
            "until labkit.shutdown()).")
    if fd >= 0:  # -1: no flock here (Windows), so a second run saving there goes undetected
        _locks[(info.st_dev, info.st_ino)] = fd


def _forget_removed() -> None:
    """Let go of the descriptors of held directories that have been removed since."""
    for key, fd in list(_locks.items()):
        if os.fstat(fd).st_nlink == 0:
            os.close(fd)
            del _locks[key]


def _lock_holder(info: os.stat_result) -> str:
    """'process 1234': who holds the flock on this inode, from Linux's /proc/locks; else 'another process'."""
    inode = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return "another process"
    for fields in map(str.split, lines):  # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:5678 0 EOF"; "->": a waiter
        if "FLOCK" in fields and "->" not in fields and inode in fields:
            return f"process {fields[fields.index(inode) - 1]}"
    return "another process"


def _forget_locks() -> None:
    """In a forked child: the locks are the parent's, and closing the child's copies leaves them held."""
    for fd in _locks.values():
        os.close(fd)
    _locks.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_locks)
