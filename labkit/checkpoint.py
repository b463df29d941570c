"""Fault-tolerance checkpointing for data-parallel training: save what a run needs to go on after a crash,
durably, and load the newest checkpoint that is intact.

"Checkpointing" means two unrelated things, so say which (the lesson's last summary bullet):

    activation checkpointing       drop activations in the forward, recompute them in the backward: compute
      (memory, within a step)      for memory, same gradients (torch.utils.checkpoint; measured by
                                   labkit.activations.saved_activation_nbytes)
    fault-tolerance checkpointing  write model, optimizer, RNG states and data position to disk, so that a
      (durability, across a run)   run killed at step 23 resumes from step 20 and ends as if never stopped

This module is the second. In data parallelism one rank writes and all ranks load (the directory must be
on storage every rank sees). Both functions take `group=`: None for the whole world, or a sub-group (one
replica set, a mesh axis's group), whose rank 0 writes and whose ranks load; groups that checkpoint apart use
directories apart. Without a process group both functions act as rank 0 of 1. What they promise:

- A save is atomic: a temporary file in the same directory, fsync'ed, read back, renamed onto its name with
  os.replace, then the directory fsync'ed. A crash mid-write never leaves a half-written step-000040.pt, and
  a file that does not load back never gets a checkpoint's name. A header holds the payload's length and
  SHA-256 (then a torch.save of a dict), so truncation and corruption are detected at load time.
- A save succeeds only if its file loads with torch.load(weights_only=True). `data_position` and `extra` may
  hold tensors, bool, int, float, complex, str, bytes, None, torch dtypes and devices, and dicts, lists,
  tuples and sets of them; anything else (a numpy scalar or array, a pathlib.Path, a datetime, a slice) is
  refused before writing, with its place named (extra['when']): convert it first (.item(),
  torch.from_numpy(), str(path), .isoformat(), (start, stop, step)).
- The newest `keep` checkpoints stay, so a damaged one falls back to the one before; older ones are removed
  only after the new one has loaded back.
- One run per directory: the writer's process takes an exclusive flock(2) on the directory at its first save
  there and holds it until it ends (the kernel drops it even on a crash). A second run (or a second group)
  saving into the same directory is refused, naming the holder's pid, instead of overwriting and rotating
  away the first one's checkpoints. A temporary file is removed by its writer, or once its writer's process
  is gone.
- A load is all or nothing: the checkpoint is checked against the model and optimizer (keys, shapes, dtypes,
  parameter groups, an optimizer state to load) before anything is copied; one that does not fit raises
  and leaves model, optimizer and RNGs as they were.

Sources: POSIX rename(2), fsync(2) (of the file and of its directory), flock(2); torch.save and
torch.load(weights_only=True) (https://pytorch.org/docs/stable/generated/torch.load.html);
torch.nn.Module.load_state_dict, which copies the tensors that fit before it reports those that do not
(https://pytorch.org/docs/stable/generated/torch.nn.Module.html#torch.nn.Module.load_state_dict).
torch.distributed.checkpoint does this job at scale, sharded across ranks (FSDP, tensor parallelism).
"""

from __future__ import annotations

import collections
import hashlib
import io
import os
import random
import re
import secrets
import struct
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from labkit import groups
from labkit.checks import whole
from labkit.launch import device

try:
    import fcntl
except ImportError:  # Windows: no flock(2), so a second run saving into the same directory goes undetected
    fcntl = None

__all__ = ["CheckpointError", "CheckpointWarning", "load_latest_checkpoint", "save_checkpoint"]

MAGIC = b"LKCKPT01"
_HEADER = struct.Struct(">8sQ32s")  # magic, payload length, sha256 of the payload
_NAME = re.compile(r"step-(\d+)\.pt")
_TEMPORARY = re.compile(r"\.step-\d+\.pt\.(\d+)\.[0-9a-f]+\.tmp")  # .step-000040.pt.<writer's pid>.<random>.tmp
_ENTRIES = ("format", "step", "data_position", "extra", "model", "optimizer", "rng")
# What torch.load(weights_only=True) reads back, by exact type: numpy.float64 is a float subclass it refuses.
_LEAVES = frozenset({type(None), bool, int, float, complex, str, bytes, bytearray,
                     torch.dtype, torch.device, torch.Size})
_locks: dict[tuple[int, int], int] = {}  # (st_dev, st_ino) of a directory this process holds -> its descriptor


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (truncated, corrupt) or only partly restored."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or used: none is intact, the directory belongs to another run, a file
    lacks an entry, or (on the group's other ranks) its writer, group rank 0, failed to save."""


def save_checkpoint(directory, model: nn.Module, optimizer: torch.optim.Optimizer | None, step: int,
                    data_position, extra=None, *, keep: int = 3, group=None) -> Path:
    """Write step `step`'s checkpoint into `directory` (created if needed); every rank gets its path.

    Call it on every rank of `group` (None: the whole world) at the same step. The group's rank 0 writes the
    model and optimizer state_dicts, the step, the data position (how far the data stream got: examples
    consumed, epoch and offset...), `extra` and every group rank's RNG states (torch CPU, Python's random,
    numpy's global one, CUDA's if in use); every rank of the group waits until it is on disk. Of the older
    checkpoints, the newest keep - 1 stay; higher steps are left alone.
    Raises TypeError for a value torch.load(weights_only=True) cannot read back, CheckpointError if another
    run holds the directory, OSError (naming the file) if writing fails; the group's other ranks then raise
    CheckpointError("save_checkpoint: rank 0 failed to save: <rank 0's error>") (rank 0: the writer's global
    rank). ValueError on every rank when the ranks pass different steps, or on a rank outside `group`.

    Example::

        >>> import tempfile
        >>> from labkit.checkpoint import load_latest_checkpoint, save_checkpoint
        >>> from labkit.models import mlp
        >>> with tempfile.TemporaryDirectory() as directory:
        ...     path = save_checkpoint(directory, mlp(), None, step=40, data_position=40 * 32)
        ...     state = load_latest_checkpoint(directory, mlp(seed=1))     # now mlp()'s weights
        >>> path.name, state["step"], state["data_position"]
        ('step-000040.pt', 40, 1280)
    """
    step, keep = whole("step", step, minimum=0), whole("keep", keep, minimum=1)
    rank = _rank_in(group, "save_checkpoint")
    path = Path(directory) / f"step-{step:06d}.pt"
    everyone = groups.gather_objects((step, _rng_state()), group)  # also a barrier: every rank reached the save
    groups.check_gathered([s for s, _ in everyone], "save_checkpoint", "steps",
                          "Call save_checkpoint at the same step on every rank.", _global_ranks(group))
    error = None
    if rank == 0:
        try:
            payload = {"format": 1, "step": step, "data_position": data_position, "extra": extra, "model":
                       model.state_dict(), "optimizer": None if optimizer is None else optimizer.state_dict(),
                       "rng": [rng for _, rng in everyone]}  # every rank's: each draws its own dropout masks
            _write_checkpoint(path, payload, keep)
        except Exception as exc:  # noqa: BLE001 - re-raised below, once every rank knows
            error = exc
    _raise_on_every_rank(error, group)
    return path


def load_latest_checkpoint(directory, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                           group=None) -> dict | None:
    """Restore the newest intact checkpoint in `directory` into `model`, `optimizer` and this rank's RNGs.

    Returns {"step", "data_position", "extra", "path"}, or None if the directory holds no checkpoint. A newer
    truncated or corrupt one is skipped with a CheckpointWarning saying what is wrong ("checkpoint
    step-000040.pt is corrupt (checksum mismatch); using step-000030.pt"). Raises FileNotFoundError if the
    directory does not exist (a mistyped path must not restart a run from step 0), NotADirectoryError for a
    file, CheckpointError if no checkpoint is intact or one lacks an entry, ValueError if it does not fit the
    model or optimizer (other keys, shapes or dtypes; no optimizer state): then nothing is changed. Every rank
    of `group` (None: the whole world) must find the same one and every one must be able to load it, or every
    rank of the group raises. RNG states are restored only under the group size that saved them (else a
    warning); group rank r gets the RNG states that group rank r saved.
    """
    rank, size = _rank_in(group, "load_latest_checkpoint"), _size_of(group)
    found = _agree_on_newest(Path(directory), group)
    if found is None:
        return None
    path, payload, skipped = found
    for name, problem in skipped:
        warnings.warn(f"checkpoint {name} is {problem}; using {path.name}", CheckpointWarning, stacklevel=2)
    _agree_it_fits(path, payload, model, optimizer, group)
    if optimizer is not None:
        optimizer.load_state_dict(payload["optimizer"])  # checks the groups before it changes anything
    model.load_state_dict(payload["model"])
    if len(payload["rng"]) != size:
        warnings.warn(f"checkpoint {path.name} was saved by {len(payload['rng'])} ranks and is loaded by {size}: "
                      "RNG states not restored.", CheckpointWarning, stacklevel=2)
    else:
        _restore_rng(payload["rng"][rank])
    return {key: payload[key] for key in ("step", "data_position", "extra")} | {"path": path}


def _write_checkpoint(path: Path, payload: dict, keep: int) -> None:
    """The writer's part of a save: refuse what would not load back, take the directory's lock, write the file
    atomically, then rotate the older ones away."""
    _refuse_unloadable(payload)
    path.parent.mkdir(parents=True, exist_ok=True)
    _lock(path.parent)
    _write_atomically(path, payload)
    _remove_old(path.parent, payload["step"], keep)


def _raise_on_every_rank(error: Exception | None, group) -> None:
    """After the writer's part of a save: the writer re-raises its own error; every other rank of `group` raises
    a CheckpointError quoting it (marked labkit_follow_on: labkit.run then names the writer's error as the root
    cause); with no error, nothing."""
    reason = _from_rank_0(None if error is None else f"{type(error).__name__}: {error}", group)
    if error is not None:
        raise error
    if reason is not None:
        follow_on = CheckpointError(f"save_checkpoint: rank {_global_ranks(group)[0]} failed to save: {reason}")
        follow_on.labkit_follow_on = True
        raise follow_on


def _agree_on_newest(directory: Path, group):
    """`_newest_intact(directory)` once every rank of `group` has found the same one: else a RuntimeError naming
    what each found, on every rank. A rank's own error (no such directory, nothing intact) is raised after the
    exchange, so that no rank waits for it."""
    try:
        found, error = _newest_intact(directory), None
        summary = None if found is None else found[0].name
    except Exception as exc:  # noqa: BLE001 - re-raised below, once every rank knows
        found, error, summary = None, exc, f"{type(exc).__name__}: {exc}"
    everyone = groups.gather_objects((str(directory), summary), group)
    if len({s for _, s in everyone}) > 1:
        found_by = "; ".join(f"rank {r}: {s or 'no checkpoint'} in {d}"
                             for r, (d, s) in zip(_global_ranks(group), everyone, strict=True))
        raise RuntimeError(f"load_latest_checkpoint: the ranks found different checkpoints ({found_by}). "
                           "Is the directory on storage that every rank sees?")
    if error is not None:
        raise error
    return found


def _agree_it_fits(path: Path, payload, model: nn.Module, optimizer, group) -> None:
    """`_check_fits` on every rank of `group`; if it fails on one, every rank raises (this rank's own error, or a
    CheckpointError naming the first rank that cannot load), before any rank changes anything."""
    error = None
    try:
        _check_fits(path, payload, model, optimizer)
    except Exception as exc:  # noqa: BLE001 - re-raised below, once every rank knows
        error = exc
    misfits = groups.gather_objects(None if error is None else f"{type(error).__name__}: {error}", group)
    if error is not None:
        raise error
    for rank, misfit in zip(_global_ranks(group), misfits, strict=True):
        if misfit is not None:
            raise CheckpointError(f"load_latest_checkpoint: rank {rank} cannot load {path.name}: {misfit}")


def _refuse_unloadable(payload: dict) -> None:
    """Raise TypeError naming the first value in `payload` that torch.load(weights_only=True) refuses: a file
    holding one is written without complaint, never loads, and rotation has removed the last one that did."""
    for key, value in payload.items():
        found = _unloadable(value, key)
        if found is not None:
            where, kind = found
            raise TypeError(f"save_checkpoint: {where} is a {kind}, which torch.load(weights_only=True) cannot read "
                            "back, so the checkpoint could never be loaded. Convert it first: a numpy value with "
                            ".item() or torch.from_numpy(), a path with str(), a datetime with .isoformat(), a "
                            "slice as (start, stop, step). Nothing was written.")


def _unloadable(value, where: str) -> tuple[str, str] | None:
    """(where, type name) of the first value inside `value` that weights_only loading refuses, else None."""
    kind = type(value)
    if kind in _LEAVES or isinstance(value, torch.Tensor):  # tensor subclasses: the read-back decides
        return None
    if kind in (dict, collections.OrderedDict):
        inside = [(f"a key of {where}", key) for key in value]
        inside += [(f"{where}[{key!r}]", item) for key, item in value.items()]
    elif kind in (list, tuple):
        inside = [(f"{where}[{i}]", item) for i, item in enumerate(value)]
    elif kind is set:
        inside = [(f"an element of {where}", item) for item in value]
    else:
        return where, kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return next((found for found in (_unloadable(item, place) for place, item in inside) if found), None)


def _lock(directory: Path) -> None:
    """Hold an exclusive flock(2) on `directory` until this process ends: one run per directory.

    A second process saving there would overwrite and rotate away this run's checkpoints; it is refused,
    naming this one. The kernel releases the lock when the holder ends, even when it is killed."""
    if fcntl is None:
        return
    for key, fd in list(_locks.items()):  # directories removed since: let their descriptors go
        if os.fstat(fd).st_nlink == 0:
            os.close(fd)
            del _locks[key]
    info = os.stat(directory)
    if (info.st_dev, info.st_ino) in _locks:
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CheckpointError(
            f"checkpoint directory {directory} is in use by another run: {_lock_holder(info)} holds its lock. Two "
            "runs saving into one directory would overwrite and rotate away each other's checkpoints. Save into "
            "another directory, or end that run first (an idle labkit.run pool keeps its ranks alive until "
            "labkit.shutdown()).") from None
    except OSError as exc:  # a file system without flock (some network mounts): save, unprotected
        warnings.warn(f"cannot lock checkpoint directory {directory} ({exc.strerror or exc}): a second run saving "
                      "there would not be detected.", CheckpointWarning, stacklevel=3)
    _locks[(info.st_dev, info.st_ino)] = fd


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


if fcntl is not None:
    os.register_at_fork(after_in_child=_forget_locks)


def _write_atomically(path: Path, payload: dict) -> None:
    """Write `payload` beside `path` under a temporary name, fsync it, load it back, rename it onto `path`
    and fsync the directory: `path` is then the old file or a complete new one that loads (rename(2))."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    body = buffer.getvalue()
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    except OSError as exc:
        raise _naming(path, exc) from exc
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(_HEADER.pack(MAGIC, len(body), hashlib.sha256(body).digest()) + body)
            file.flush()
            os.fsync(file.fileno())
        problem = _read(temporary)[1]
        if problem:
            raise CheckpointError(f"save_checkpoint: the file written for {path} would not load back ({problem}); "
                                  "nothing was replaced or removed.")
        os.replace(temporary, path)
        if os.name != "nt":  # Windows cannot open a directory; NTFS journals the rename itself
            fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    except OSError as exc:
        raise _naming(path, exc) from exc
    finally:
        temporary.unlink(missing_ok=True)  # still there only if the rename did not happen


def _naming(path: Path, exc: OSError) -> OSError:
    """`exc` again (same errno, so the same OSError subclass), saying which checkpoint: a bare ENOSPC or EFBIG
    from write(2) names no file."""
    if exc.errno is None:
        return OSError(f"could not write checkpoint {path}: {exc}")
    return OSError(exc.errno, f"could not write checkpoint {path}: {exc.strerror or exc}")


def _checkpoints(directory: Path) -> list[tuple[int, Path]]:  # (step, path), newest first
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.fullmatch(p.name)) and p.is_file()]
    return sorted(found, reverse=True)


def _remove_old(directory: Path, step: int, keep: int) -> None:
    """Remove the checkpoints below `step` but its newest keep - 1, and the temporary files of crashed saves
    (their writer's process is gone); another writer's temporary file is never touched."""
    older = [path for s, path in _checkpoints(directory) if s < step][keep - 1:]
    crashed = [p for p in directory.iterdir() if (m := _TEMPORARY.fullmatch(p.name)) and not _alive(int(m.group(1)))]
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


def _newest_intact(directory: Path):
    """(path, payload, [(name, problem) of the newer ones skipped]), or None when there is no checkpoint."""
    if not directory.exists():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist. Create it to start from "
                                "scratch (save_checkpoint creates it too), or check the path.")
    if not directory.is_dir():
        raise NotADirectoryError(f"{directory} is a file, not a checkpoint directory.")
    skipped = []
    for _, path in _checkpoints(directory):
        payload, problem = _read(path)
        if payload is not None:
            return path, payload, skipped
        skipped.append((path.name, problem))
    if skipped:
        raise CheckpointError(f"no intact checkpoint in {directory}: "
                              + "; ".join(f"{name} is {problem}" for name, problem in skipped) + ".")
    return None


def _read(path: Path) -> tuple[dict | None, str]:
    """(payload, "") for an intact checkpoint file, else (None, what is wrong with it)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        return None, f"unreadable ({exc.strerror or exc})"
    magic, length, digest = _HEADER.unpack_from(data.ljust(_HEADER.size, b"\0"))
    body = data[_HEADER.size:]
    problem = (f"truncated ({len(data)} bytes, shorter than its header)" if len(data) < _HEADER.size else
               "corrupt (not a labkit checkpoint: bad header)" if magic != MAGIC else
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


def _check_fits(path: Path, payload, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Raise unless `payload` restores whole into `model` and `optimizer`; changes nothing.

    Module.load_state_dict copies every tensor that fits before it reports those that do not, which would
    leave the model half overwritten: so keys, shapes and dtypes are checked here, first (a dtype cast would
    not resume bit-identical), and the optimizer's state and parameter groups too."""
    entries = payload if isinstance(payload, dict) else {}
    if missing := [key for key in _ENTRIES if key not in entries]:
        raise CheckpointError(f"checkpoint {path} has no {', '.join(map(repr, missing))} "
                              f"entr{'y' if len(missing) == 1 else 'ies'} (it holds {sorted(entries)}): was it "
                              "written by labkit.checkpoint.save_checkpoint?")
    ours, theirs = model.state_dict(), payload["model"]
    problems = []
    if absent := [key for key in ours if key not in theirs]:
        problems.append("missing from the checkpoint: " + ", ".join(absent))
    if unknown := [key for key in theirs if key not in ours]:
        problems.append("not in the model: " + ", ".join(unknown))
    for key in [key for key in ours if key in theirs]:
        here, there = ours[key], theirs[key]
        if not (isinstance(here, torch.Tensor) and isinstance(there, torch.Tensor)):
            continue
        if here.shape != there.shape:
            problems.append(f"{key}: shape {tuple(here.shape)} here, {tuple(there.shape)} in the checkpoint")
        elif here.dtype != there.dtype:
            problems.append(f"{key}: {here.dtype} here, {there.dtype} in the checkpoint")
    if problems:
        raise ValueError(f"load_latest_checkpoint: {path.name} does not fit the model ({'; '.join(problems)}); "
                         "nothing was loaded.")
    if optimizer is None:
        return
    if payload["optimizer"] is None:
        raise ValueError(f"load_latest_checkpoint: {path.name} was saved without an optimizer state; nothing was "
                         "loaded.")
    here = [len(group["params"]) for group in optimizer.param_groups]
    there = [len(group["params"]) for group in payload["optimizer"]["param_groups"]]
    if len(here) != len(there):
        raise ValueError(f"load_latest_checkpoint: {path.name} does not fit the optimizer ({len(here)} parameter "
                         f"groups here, {len(there)} in the checkpoint); nothing was loaded.")
    if here != there:
        raise ValueError(f"load_latest_checkpoint: {path.name} does not fit the optimizer (parameters per group: "
                         f"{here} here, {there} in the checkpoint); nothing was loaded.")


def _rank_in(group, caller: str) -> int:
    """This rank's number in `group` (None: the world); 0 without a process group. ValueError naming `caller`
    on a rank outside `group`."""
    if not groups.group_is_up():
        return 0
    groups.require_member(caller, group)
    return groups.group_rank(group)


def _size_of(group) -> int:
    """How many ranks `group` holds; 1 without a process group."""
    return groups.group_size(group) if groups.group_is_up() else 1


def _global_ranks(group) -> list[int]:
    """`group`'s global ranks in group-rank order, for messages; [0] without a process group."""
    return groups.group_ranks(group) if groups.group_is_up() else [0]


def _from_rank_0(obj, group):
    """Group rank 0's `obj` on every rank of `group` (broadcast through labkit.device()); `obj` itself without
    a process group or in a group of one."""
    if _size_of(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=groups.global_rank(group, 0), group=group, device=device())
    return box[0]


def _rng_state() -> dict:
    kind, keys, *rest = np.random.get_state()  # weights_only loading takes a tensor, not an ndarray
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), *rest)}
    if torch.cuda.is_initialized():  # never initialises CUDA; its RNG only matters once CUDA is in use
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available() and torch.cuda.device_count() == len(state["cuda"]):
        torch.cuda.set_rng_state_all(state["cuda"])
