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
- One run per directory: the writer's process takes an exclusive flock(2) on the directory's lock file
  (`.labkit-lock`, mode 0600) at its first save there and holds it until it ends (the kernel drops it even on a
  crash). A second run (or a second group) saving into the same directory is refused, naming the holder's pid,
  instead of overwriting and rotating away the first one's checkpoints. A temporary file is removed by its
  writer, or once its writer's process is gone.
- The directory is the run's own: created mode 0700, its files 0600. A directory that another user owns or that
  group or others can write in is refused (PermissionError naming owner and mode), as is a link made by another
  user; a checkpoint file that is a link or not the user's own is skipped: the SHA-256 header is a checksum, not
  a MAC, so a file planted there would otherwise load as the run's own.
- A load beside a run saving into the same directory never reports "no checkpoint", or none intact, while one
  is there: a checkpoint rotated away between the listing and its reading makes it list again.
- A load is all or nothing: the checkpoint is checked against the model and optimizer (keys, shapes, dtypes,
  parameter groups, an optimizer state to load) before anything is copied; one that does not fit raises
  and leaves model, optimizer and RNGs as they were.

This file holds the two functions and how the ranks of a group agree (on the newest checkpoint, on whether it
fits, on the writer's error); one file per job besides: `files` (the file format, the atomic and verified write,
reading, rotation), `lock` (one run per directory), `fits` (what a checkpoint may hold, whether it fits the model
and optimizer), `rng` (the RNG states), `failures` (CheckpointError, CheckpointWarning).

Sources: POSIX rename(2), fsync(2) (of the file and of its directory), flock(2); torch.save and
torch.load(weights_only=True) (https://pytorch.org/docs/stable/generated/torch.load.html);
torch.nn.Module.load_state_dict, which copies the tensors that fit before it reports those that do not
(https://pytorch.org/docs/stable/generated/torch.nn.Module.html#torch.nn.Module.load_state_dict).
torch.distributed.checkpoint does this job at scale, sharded across ranks (FSDP, tensor parallelism).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from labkit import groups
from labkit.checkpoint import files, fits, lock
from labkit.checkpoint.failures import CheckpointError, CheckpointWarning
from labkit.checkpoint.rng import restore_rng_state, rng_state
from labkit.checks import whole

__all__ = ["CheckpointError", "CheckpointWarning", "load_latest_checkpoint", "save_checkpoint"]


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
    groups.require_member("save_checkpoint", group, alone_ok=True)
    path = files.checkpoint_path(directory, step)
    everyone = groups.gather_objects((step, rng_state()), group)  # also a barrier: every rank reached the save
    groups.check_gathered([s for s, _ in everyone], "save_checkpoint", "steps",
                          "Call save_checkpoint at the same step on every rank.", groups.group_ranks(group))
    error = None
    if groups.group_rank(group) == 0:
        try:
            payload = {"format": 1, "step": step, "data_position": data_position, "extra": extra, "model":
                       model.state_dict(), "optimizer": None if optimizer is None else optimizer.state_dict(),
                       "rng": [state for _, state in everyone]}  # every rank's: each draws its own dropout masks
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
    groups.require_member("load_latest_checkpoint", group, alone_ok=True)
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
    size = groups.group_size(group)
    if len(payload["rng"]) != size:
        warnings.warn(f"checkpoint {path.name} was saved by {len(payload['rng'])} ranks and is loaded by {size}: "
                      "RNG states not restored.", CheckpointWarning, stacklevel=2)
    else:
        restore_rng_state(payload["rng"][groups.group_rank(group)])
    return {key: payload[key] for key in ("step", "data_position", "extra")} | {"path": path}


def _write_checkpoint(path: Path, payload: dict, keep: int) -> None:
    """The writer's part of a save: refuse what would not load back, take the directory's lock, write the file
    atomically, then rotate the older ones away."""
    fits.refuse_unloadable(payload)
    files.checkpoint_directory(path.parent, create=True)
    lock.lock_directory(path.parent)
    files.write_atomically(path, payload)
    files.remove_old(path.parent, payload["step"], keep)


def _raise_on_every_rank(error: Exception | None, group) -> None:
    """After the writer's part of a save: the writer re-raises its own error; every other rank of `group` raises
    a CheckpointError quoting it (marked labkit_follow_on: labkit.run then names the writer's error as the root
    cause); with no error, nothing."""
    reason = groups.broadcast_object(None if error is None else f"{type(error).__name__}: {error}", group)
    if error is not None:
        raise error
    if reason is not None:
        follow_on = CheckpointError(f"save_checkpoint: rank {groups.global_rank(group, 0)} failed to save: {reason}")
        follow_on.labkit_follow_on = True
        raise follow_on


def _agree_on_newest(directory: Path, group):
    """`files.newest_intact(directory)` once every rank of `group` has found the same one: else a RuntimeError naming
    what each found, on every rank. A rank's own error (no such directory, nothing intact) is raised after the
    exchange, so that no rank waits for it."""
    try:
        found, error = files.newest_intact(directory), None
        summary = None if found is None else found[0].name
    except Exception as exc:  # noqa: BLE001 - re-raised below, once every rank knows
        found, error, summary = None, exc, f"{type(exc).__name__}: {exc}"
    everyone = groups.gather_objects((str(directory), summary), group)
    if len({s for _, s in everyone}) > 1:
        found_by = "; ".join(f"rank {r}: {s or 'no checkpoint'} in {d}"
                             for r, (d, s) in zip(groups.group_ranks(group), everyone, strict=True))
        raise RuntimeError(f"load_latest_checkpoint: the ranks found different checkpoints ({found_by}). "
                           "Is the directory on storage that every rank sees?")
    if error is not None:
        raise error
    return found


def _agree_it_fits(path: Path, payload, model: nn.Module, optimizer, group) -> None:
    """`fits.check_fits` on every rank of `group`; if it fails on one, every rank raises (this rank's own error, or a
    CheckpointError naming the first rank that cannot load), before any rank changes anything."""
    error = None
    try:
        fits.check_fits(path, payload, model, optimizer)
    except Exception as exc:  # noqa: BLE001 - re-raised below, once every rank knows
        error = exc
    misfits = groups.gather_objects(None if error is None else f"{type(error).__name__}: {error}", group)
    if error is not None:
        raise error
    for rank, misfit in zip(groups.group_ranks(group), misfits, strict=True):
        if misfit is not None:
            raise CheckpointError(f"load_latest_checkpoint: rank {rank} cannot load {path.name}: {misfit}")
