"""The checkpoint file: its name, its format, an atomic and verified write, reading it back, and rotation.

A file `step-000040.pt` is a header (magic, payload length, SHA-256 of the payload) followed by a torch.save of
a dict, so that truncation and corruption are detected at load time. A save writes a temporary file in the same
directory (`.step-000040.pt.<writer's pid>.<random>.tmp`), fsyncs it, reads it back, renames it onto its name
with os.replace and fsyncs the directory: a crash mid-write never leaves a half-written `step-000040.pt`, and a
file that does not load back never gets a checkpoint's name. Older checkpoints are removed only after the new one
has loaded back, and a temporary file only by its writer or once its writer's process is gone.

The directory and its files are private (labkit._private_files): a directory is created 0700 and its files 0600,
and one that another user owns or can write in is refused, as is a file that is a link or not the user's own: a
forged file in this format would otherwise load as the run's own (the SHA-256 is a checksum, not a MAC). A load
beside a run that saves with keep=1 lists the directory, and the file it listed can be rotated away before it is
opened: it then lists again, so that it never reports "no checkpoint" (or "none intact") while one exists.
Sources: POSIX rename(2), fsync(2) (of the file and of its directory); torch.save and torch.load(weights_only=True)
(https://pytorch.org/docs/stable/generated/torch.load.html).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import secrets
import struct
from pathlib import Path

import torch

from labkit import _private_files
from labkit.checkpoint.failures import CheckpointError

__all__ = ["checkpoint_bytes", "checkpoint_directory", "checkpoint_path", "newest_intact", "read_checkpoint",
           "remove_old", "write_atomically"]

_MAGIC = b"LKCKPT01"
_HEADER = struct.Struct(">8sQ32s")  # magic, payload length, sha256 of the payload
_NAME = re.compile(r"step-(\d+)\.pt")
_TEMPORARY = re.compile(r"\.step-\d+\.pt\.(\d+)\.[0-9a-f]+\.tmp")  # .step-000040.pt.<writer's pid>.<random>.tmp
# A listed checkpoint vanishes only when a newer save has rotated it away, so each new listing follows a save; a
# directory that changes under this many listings in a row belongs to a run saving faster than it can be read.
_LISTINGS = 100


class _Vanished(Exception):
    """A listed checkpoint was removed before it could be opened: list the directory again."""


def checkpoint_path(directory, step: int) -> Path:
    """Where step `step`'s checkpoint lives in `directory`: step-000040.pt (zero-padded, so names sort by step)."""
    return Path(directory) / f"step-{step:06d}.pt"


def checkpoint_directory(directory, *, create: bool) -> Path:
    """`directory` once checked to be private (created 0700 if `create` and missing): PermissionError naming its
    owner and mode otherwise, FileNotFoundError if it does not exist (and not `create`), NotADirectoryError."""
    return _private_files.private_directory(Path(directory), "checkpoint directory", create=create)


def checkpoint_bytes(payload: dict) -> bytes:
    """The file's contents for `payload`: the header (magic, payload length, SHA-256), then torch.save's bytes."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    body = buffer.getvalue()
    return _HEADER.pack(_MAGIC, len(body), hashlib.sha256(body).digest()) + body


def write_atomically(path: Path, payload: dict) -> None:
    """Write `payload` beside `path` under a temporary name, fsync it, load it back, rename it onto `path`
    and fsync the directory: `path` is then the old file or a complete new one that loads (rename(2))."""
    data = checkpoint_bytes(payload)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0),
                     _private_files.FILE_MODE)
    except OSError as exc:
        raise _naming(path, exc) from exc
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        problem = read_checkpoint(temporary)[1]
        if problem:
            raise CheckpointError(f"save_checkpoint: the file written for {path} would not load back ({problem}); "
                                  "nothing was replaced or removed.")
        os.replace(temporary, path)
        _fsync_directory(path.parent)
    except OSError as exc:
        raise _naming(path, exc) from exc
    finally:
        temporary.unlink(missing_ok=True)  # still there only if the rename did not happen


def _fsync_directory(directory: Path) -> None:
    """fsync(2) `directory`, so that a rename in it survives a power cut."""
    if os.name == "nt":  # Windows cannot open a directory; NTFS journals the rename itself
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _naming(path: Path, exc: OSError) -> OSError:
    """`exc` again (same errno, so the same OSError subclass), saying which checkpoint: a bare ENOSPC or EFBIG
    from write(2) names no file."""
    if exc.errno is None:
        return OSError(f"could not write checkpoint {path}: {exc}")
    return OSError(exc.errno, f"could not write checkpoint {path}: {exc.strerror or exc}")


def _checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint name in `directory`, newest first. One listing: what each name is (a file,
    still there) is learnt when it is opened, since a save may rotate it away meanwhile."""
    found = [(int(m.group(1)), directory / name) for name in os.listdir(directory) if (m := _NAME.fullmatch(name))]
    return sorted(found, reverse=True)


def remove_old(directory: Path, step: int, keep: int) -> None:
    """Remove the checkpoints below `step` but its newest keep - 1, and the temporary files of crashed saves
    (their writer's process is gone); another writer's temporary file is never touched."""
    older = [path for s, path in _checkpoints(directory) if s < step][keep - 1:]
    crashed = [directory / name for name in os.listdir(directory)
               if (m := _TEMPORARY.fullmatch(name)) and not _alive(int(m.group(1)))]
    for path in older + crashed:
        path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    """Whether process `pid` exists on this machine: kill(2) with signal 0 checks without sending one."""
    if os.name == "nt":  # there os.kill would terminate it: keep its files
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user
        return True
    return True


def newest_intact(directory: Path):
    """(path, payload, [(name, problem) of the newer ones skipped]), or None when there is no checkpoint.
    FileNotFoundError, NotADirectoryError for a bad `directory`, PermissionError for one that is not private;
    CheckpointError when none is intact."""
    if not os.path.lexists(directory):
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist. Create it to start from "
                                "scratch (save_checkpoint creates it too), or check the path.")
    checkpoint_directory(directory, create=False)
    for _ in range(_LISTINGS):
        try:
            return _newest_listed(directory)
        except _Vanished:
            continue
    raise CheckpointError(f"the checkpoints in {directory} were rotated away {_LISTINGS} times in a row while "
                          "being read: is another run saving there as fast as it can?")


def _newest_listed(directory: Path):
    """newest_intact's answer from one listing of `directory`; _Vanished if a listed checkpoint is gone."""
    skipped = []
    for _, path in _checkpoints(directory):
        try:
            payload, problem = read_checkpoint(path)
        except FileNotFoundError:  # rotated away since the listing: a newer one is there now
            raise _Vanished from None
        if payload is not None:
            return path, payload, skipped
        skipped.append((path.name, problem))
    if skipped:
        raise CheckpointError(f"no intact checkpoint in {directory}: "
                              + "; ".join(f"{name} is {problem}" for name, problem in skipped) + ".")
    return None


def read_checkpoint(path: Path) -> tuple[dict | None, str]:
    """(payload, "") for an intact checkpoint file, else (None, what is wrong with it); FileNotFoundError when
    there is no file at `path` (rotated away: the caller lists again). A link, or a file not the user's own, is
    refused: a forged one would load as the run's own."""
    try:
        with os.fdopen(_private_files.open_private(path, os.O_RDONLY, "checkpoint file"), "rb") as file:
            data = file.read()
    except FileNotFoundError:
        raise
    except PermissionError as exc:
        return None, f"refused ({exc})"
    except OSError as exc:
        return None, f"unreadable ({exc.strerror or exc})"
    magic, length, digest = _HEADER.unpack_from(data.ljust(_HEADER.size, b"\0"))
    body = data[_HEADER.size:]
    problem = (f"truncated ({len(data)} bytes, shorter than its header)" if len(data) < _HEADER.size else
               "corrupt (not a labkit checkpoint: bad header)" if magic != _MAGIC else
               f"truncated ({len(body)} of {length} payload bytes)" if len(body) < length else
               f"corrupt ({len(body) - length} bytes more than its header says)" if len(body) > length else
               "corrupt (checksum mismatch)" if hashlib.sha256(body).digest() != digest else "")
    if problem:
        return None, problem
    try:
        payload = torch.load(io.BytesIO(body), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure to unpickle makes the file unusable
        return None, f"unloadable ({type(exc).__name__}: {exc})"
    return payload, ""
