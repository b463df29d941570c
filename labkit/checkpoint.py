"""Fault-tolerance checkpointing for data-parallel training: save what a run needs to go on after a crash,
durably, and load the newest checkpoint that is intact.

"Checkpointing" means two unrelated things, so say which (the lesson's last summary bullet):

    activation checkpointing       drop activations in the forward, recompute them in the backward: compute
      (memory, within a step)      for memory, same gradients (torch.utils.checkpoint; measured by
                                   labkit.activations.saved_activation_nbytes)
    fault-tolerance checkpointing  write model, optimizer, RNG states and data position to disk, so that a
      (durability, across a run)   run killed at step 23 resumes from step 20 and ends as if never stopped

This module is the second. In data parallelism one rank writes and all ranks load (the directory must be
on storage every rank sees). A save is atomic: a temporary file in the same directory, fsync'ed, renamed
onto its name with os.replace, then the directory fsync'ed, so a crash mid-write never leaves a half-written
step-000040.pt. A header holds the payload's length and SHA-256 (then a torch.save of a dict, read back with
weights_only=True: `data_position` and `extra` hold tensors, numbers, strings, None and containers of them),
so truncation and corruption are detected, and the newest `keep` checkpoints stay, so a bad one falls back
to the one before. Without a process group both functions act as rank 0 of 1 (one process, one device).

Sources: POSIX rename(2) and fsync(2), of the file and of its directory; torch.save/torch.load(weights_only=True)
(https://pytorch.org/docs/stable/generated/torch.load.html).
torch.distributed.checkpoint does this job at scale, sharded across ranks (FSDP, tensor parallelism).
"""

from __future__ import annotations

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

__all__ = ["CheckpointError", "CheckpointWarning", "load_latest_checkpoint", "save_checkpoint"]

MAGIC = b"LKCKPT01"
_HEADER = struct.Struct(">8sQ32s")  # magic, payload length, sha256 of the payload
_NAME = re.compile(r"step-(\d+)\.pt")
_TEMPORARY = re.compile(r"\.step-\d+\.pt\..+\.tmp")


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (truncated, corrupt) or only partly restored."""


class CheckpointError(RuntimeError):
    """The directory holds checkpoints, but none of them is intact."""


def save_checkpoint(directory, model: nn.Module, optimizer: torch.optim.Optimizer | None, step: int,
                    data_position, extra=None, *, keep: int = 3) -> Path:
    """Write step `step`'s checkpoint into `directory` (created if needed); every rank gets its path.

    Call it on every rank at the same step. Rank 0 writes the model and optimizer state_dicts, the step, the
    data position (how far the data stream got: examples consumed, epoch and offset...), `extra` and every
    rank's RNG states (torch CPU, Python's random, numpy's global one, CUDA's if in use); every rank waits
    until it is on disk. Of the older checkpoints, the newest keep - 1 stay; higher steps are left alone.

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
    for name, value, least in (("step", step, 0), ("keep", keep, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"save_checkpoint: {name} must be a whole number >= {least}, got {value!r}.")
    rank, world = _rank_and_world()
    path = Path(directory) / f"step-{step:06d}.pt"
    everyone = _all_gather((step, _rng_state()))  # also a barrier: every rank has reached the save
    if len(set(steps := [s for s, _ in everyone])) > 1:
        raise ValueError(f"save_checkpoint: every rank must save the same step, got steps {steps} (rank order).")
    error = None
    if rank == 0:
        try:
            payload = {"format": 1, "step": step, "data_position": data_position, "extra": extra, "model":
                       model.state_dict(), "optimizer": None if optimizer is None else optimizer.state_dict(),
                       "rng": [rng for _, rng in everyone]}  # every rank's: each draws its own dropout masks
            _write_atomically(path, payload)
            _remove_old(path.parent, step, keep)
        except Exception as exc:  # noqa: BLE001 - re-raised below, once every rank knows
            error = exc
    failures = _all_gather(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if failures[0] is not None:
        raise RuntimeError(f"save_checkpoint: rank 0 could not write {path}: {failures[0]}")
    return path


def load_latest_checkpoint(directory, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict | None:
    """Restore the newest intact checkpoint in `directory` into `model`, `optimizer` and this rank's RNGs.

    Returns {"step", "data_position", "extra", "path"}, or None if the directory holds no checkpoint. A newer
    truncated or corrupt one is skipped with a CheckpointWarning saying what is wrong ("checkpoint
    step-000040.pt is corrupt (checksum mismatch); using step-000030.pt"). Raises FileNotFoundError if the
    directory does not exist (a mistyped path must not restart a run from step 0), NotADirectoryError for a
    file, CheckpointError if no checkpoint is intact. Every rank must find the same one, or every rank raises.
    RNG states are restored only under the world size that saved them (else a warning).
    """
    rank, world = _rank_and_world()
    try:
        found, error = _newest_intact(Path(directory)), None
        summary = None if found is None else found[0].name
    except Exception as exc:  # noqa: BLE001 - re-raised below, once every rank knows
        error, summary = exc, f"{type(exc).__name__}: {exc}"
    everyone = _all_gather((str(directory), summary))
    if len({s for _, s in everyone}) > 1:
        found_by = "; ".join(f"rank {r}: {s or 'no checkpoint'} in {d}" for r, (d, s) in enumerate(everyone))
        raise RuntimeError(f"load_latest_checkpoint: the ranks found different checkpoints ({found_by}). "
                           "Is the directory on storage that every rank sees?")
    if error is not None:
        raise error
    if found is None:
        return None
    path, payload, skipped = found
    for name, problem in skipped:
        warnings.warn(f"checkpoint {name} is {problem}; using {path.name}", CheckpointWarning, stacklevel=2)
    model.load_state_dict(payload["model"])
    if optimizer is not None and payload["optimizer"] is None:
        raise ValueError(f"load_latest_checkpoint: {path.name} was saved without an optimizer state.")
    if optimizer is not None:
        optimizer.load_state_dict(payload["optimizer"])
    if len(payload["rng"]) != world:
        warnings.warn(f"checkpoint {path.name} was saved by {len(payload['rng'])} ranks and is loaded by {world}: "
                      "RNG states not restored.", CheckpointWarning, stacklevel=2)
    else:
        _restore_rng(payload["rng"][rank])
    return {key: payload[key] for key in ("step", "data_position", "extra")} | {"path": path}


def _write_atomically(path: Path, payload: dict) -> None:
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    body = buffer.getvalue()
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(_HEADER.pack(MAGIC, len(body), hashlib.sha256(body).digest()) + body)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    if os.name != "nt":  # Windows cannot open a directory; NTFS journals the rename itself
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _checkpoints(directory: Path) -> list[tuple[int, Path]]:  # (step, path), newest first
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.fullmatch(p.name)) and p.is_file()]
    return sorted(found, reverse=True)


def _remove_old(directory: Path, step: int, keep: int) -> None:  # and the temporary files of crashed saves
    older = [path for s, path in _checkpoints(directory) if s < step][keep - 1:]
    for path in older + [p for p in directory.iterdir() if _TEMPORARY.fullmatch(p.name)]:
        path.unlink(missing_ok=True)


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


def _rank_and_world() -> tuple[int, int]:
    grouped = dist.is_available() and dist.is_initialized()
    return (dist.get_rank(), dist.get_world_size()) if grouped else (0, 1)


def _all_gather(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank; [obj] without a process group."""
    if _rank_and_world()[1] == 1:
        return [obj]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


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
