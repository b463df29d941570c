"""Folders and files that only their owner can touch: created 0700 and 0600, refused when they are not private.

Thirty students on one server are thirty "other local users" (issue 28). A folder another user owns, or one that
group or others can write in, lets them plant or swap files: a forged checkpoint in labkit's own format (its
SHA-256 header is a checksum, not a MAC) then loads as the run's own, a planted progress file shows someone else's
passes. A lock file others can open lets them hold its lock and freeze the student. So labkit checks what it uses,
as ssh refuses a loose ~/.ssh (sshd's StrictModes): a folder must be the user's own and writable by the user
alone, and may be a symbolic link only if the user made the link; a file is opened without following links
(O_NOFOLLOW), must be a regular file (a FIFO would block a reader forever, /dev/zero would fill its memory), the
user's own and writable by the user alone. A refusal is a PermissionError that names the owner and the mode and
says what to do. Only the last folder of a path is checked: the folders above it are the user's to choose.

Where there are no user ids (Windows), nothing is checked: there a folder's access list decides.
Sources: open(2) (O_NOFOLLOW, O_NONBLOCK on a FIFO), lstat(2), inode(7) (st_mode); flock(2); sshd_config(5),
StrictModes.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

try:
    import fcntl
    import pwd
except ImportError:  # Windows: no flock(2), no user ids
    fcntl = pwd = None

__all__: list[str] = []

DIRECTORY_MODE, FILE_MODE = 0o700, 0o600
_CHECKED = hasattr(os, "geteuid")  # POSIX: files have owners and modes
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
_OPEN_FLAGS = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


def private_directory(path: Path, what: str, *, create: bool) -> Path:
    """`path` once it is checked to be a private folder (see the module docstring), created mode 0700 (with its
    missing parents, umask's mode) when `create` and it does not exist. FileNotFoundError when it does not exist
    and not `create`; NotADirectoryError for a file; PermissionError, naming owner and mode, when it is not
    private. `what` ("checkpoint directory") starts the messages."""
    path = Path(path)
    if create and not os.path.lexists(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, DIRECTORY_MODE)  # mode & ~umask: at most 0700, never more
        except FileExistsError:
            pass  # made meanwhile, by another of the user's processes or by someone else: checked below
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        _refuse_foreign(path, info, what, "is a symbolic link made by")
        info = os.stat(path)  # the user's own link: its folder is checked as any other
    if not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(f"{path} is a file, not a {what}.")
    _refuse_foreign(path, info, what, "belongs to")
    _refuse_loose(path, info, what)
    return path


def open_private(path: Path, flags: int, what: str) -> int:
    """os.open(path, flags) of a private regular file, created mode 0600 with os.O_CREAT: its descriptor.

    Never follows a link at `path` and never waits on a FIFO (O_NONBLOCK: regular files ignore it). A file of
    another user, one that group or others can write, a link, a FIFO or a device: PermissionError naming it."""
    try:
        fd = os.open(path, flags | _OPEN_FLAGS | getattr(os, "O_NONBLOCK", 0), FILE_MODE)
    except OSError:
        if os.path.islink(path):  # O_NOFOLLOW's ELOOP (EMLINK on FreeBSD): say what it is
            raise PermissionError(f"{what} {path} is a symbolic link (to {os.readlink(path)}): labkit does not follow "
                                  "links to its files. Remove the link.") from None
        raise
    try:
        check_private_file(path, os.fstat(fd), what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def hold_lock(path: Path, what: str, *, wait_seconds: float) -> int | None:
    """Take an exclusive flock(2) on the private lock file `path` (created 0600), waiting at most `wait_seconds`:
    its descriptor (closing it lets go, and the kernel lets go when the process ends, even killed), or None when
    another process still holds it then. Never waits without a bound: a stuck holder must not freeze a grader.
    The file is readable by its owner only, since flock needs only a descriptor opened for reading. Where there is
    no flock (Windows), -1: nothing is held."""
    if fcntl is None:
        return -1
    fd = open_private(path, os.O_RDWR | os.O_CREAT, what)
    if stat.S_IMODE(os.fstat(fd).st_mode) & 0o077:
        os.fchmod(fd, FILE_MODE)  # the user's own file, opened before by a looser labkit: nobody else may open it
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None
            time.sleep(0.02)
        except BaseException:
            os.close(fd)
            raise


def check_private_file(path: Path, info: os.stat_result, what: str) -> None:
    """PermissionError unless `info` (an fstat of `path`) is a regular file of this user that only this user can
    write."""
    if not stat.S_ISREG(info.st_mode):
        raise PermissionError(f"{what} {path} is not a regular file but a {_kind(info.st_mode)}: labkit reads and "
                              "writes only plain files there. Remove it.")
    _refuse_foreign(path, info, what, "belongs to")
    _refuse_loose(path, info, what)


def _refuse_foreign(path: Path, info: os.stat_result, what: str, relation: str) -> None:
    """PermissionError when another user owns `path` (`info`: its lstat): they could change or replace it."""
    if _CHECKED and info.st_uid != os.geteuid():
        raise PermissionError(f"{what} {path} {relation} {_user(info.st_uid)}, not you ({_user(os.geteuid())}), "
                              f"mode {stat.S_IMODE(info.st_mode):04o}: another user could put their files in your "
                              "place, so labkit does not use it. Use a folder of your own (labkit creates a "
                              "missing one, mode 0700).")


def _refuse_loose(path: Path, info: os.stat_result, what: str) -> None:
    """PermissionError when group or others can write `path` (`info`: its stat), sticky bit or not."""
    if not _CHECKED or not info.st_mode & _OTHERS_WRITE:
        return
    who = " and ".join(name for bit, name in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "every user"))
                       if info.st_mode & bit)
    raise PermissionError(f"{what} {path} is yours but has mode {stat.S_IMODE(info.st_mode):04o}: {who} can write to "
                          "it, so another user could plant or replace files there, and labkit does not use it. "
                          f"Run `chmod go-w {path}`, or use a folder of your own.")


def _user(uid: int) -> str:
    """'alice (uid 1000)', or 'uid 1000' for a uid without a name."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    kinds = ((stat.S_ISFIFO, "FIFO (named pipe)"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
             (stat.S_ISSOCK, "socket"), (stat.S_ISDIR, "folder"), (stat.S_ISLNK, "symbolic link"))
    return next((name for test, name in kinds if test(mode)), "special file")
