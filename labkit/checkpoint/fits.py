"""What a checkpoint may hold, and whether one fits: checked before anything is written or changed.

At save time: every value must be one that torch.load(weights_only=True) reads back, or the file would be
written without complaint and never load. At load time: the checkpoint must restore whole into the model and
optimizer, because torch.nn.Module.load_state_dict copies every tensor that fits before it reports those that do
not (https://pytorch.org/docs/stable/generated/torch.nn.Module.html#torch.nn.Module.load_state_dict), which would
leave the model half overwritten.
"""

from __future__ import annotations

import collections
from pathlib import Path

import torch
from torch import nn

from labkit.checkpoint.failures import CheckpointError

__all__ = ["check_fits", "refuse_unloadable"]

_ENTRIES = ("format", "step", "data_position", "extra", "model", "optimizer", "rng")
# What torch.load(weights_only=True) reads back, by exact type: numpy.float64 is a float subclass it refuses.
_LEAVES = frozenset({type(None), bool, int, float, complex, str, bytes, bytearray,
                     torch.dtype, torch.device, torch.Size})


def refuse_unloadable(payload: dict) -> None:
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


def check_fits(path: Path, payload, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Raise unless `payload` restores whole into `model` and `optimizer`; changes nothing.

    CheckpointError if an entry is missing; ValueError if keys, shapes or dtypes differ (a dtype cast would not
    resume bit-identical), or the optimizer's state or parameter groups do not fit."""
    _require_entries(path, payload)
    if problems := _model_problems(model.state_dict(), payload["model"]):
        raise ValueError(f"load_latest_checkpoint: {path.name} does not fit the model ({'; '.join(problems)}); "
                         "nothing was loaded.")
    if optimizer is not None:
        _check_optimizer_fits(path, payload["optimizer"], optimizer)


def _require_entries(path: Path, payload) -> None:
    """CheckpointError unless `payload` is a dict holding every entry save_checkpoint writes."""
    entries = payload if isinstance(payload, dict) else {}
    if missing := [key for key in _ENTRIES if key not in entries]:
        raise CheckpointError(f"checkpoint {path} has no {', '.join(map(repr, missing))} "
                              f"entr{'y' if len(missing) == 1 else 'ies'} (it holds {sorted(entries)}): was it "
                              "written by labkit.checkpoint.save_checkpoint?")


def _model_problems(ours: dict, theirs: dict) -> list[str]:
    """What keeps the saved state_dict `theirs` from loading into the model's `ours`: missing and unknown keys,
    then each tensor of another shape or dtype."""
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
    return problems


def _check_optimizer_fits(path: Path, saved: dict | None, optimizer: torch.optim.Optimizer) -> None:
    """ValueError unless the optimizer state `saved` exists and has `optimizer`'s parameter groups, each with as
    many parameters: checked here, with the model, so that every rank knows before any rank changes anything."""
    if saved is None:
        raise ValueError(f"load_latest_checkpoint: {path.name} was saved without an optimizer state; nothing was "
                         "loaded.")
    here = [len(group["params"]) for group in optimizer.param_groups]
    there = [len(group["params"]) for group in saved["param_groups"]]
    if len(here) != len(there):
        raise ValueError(f"load_latest_checkpoint: {path.name} does not fit the optimizer ({len(here)} parameter "
                         f"groups here, {len(there)} in the checkpoint); nothing was loaded.")
    if here != there:
        raise ValueError(f"load_latest_checkpoint: {path.name} does not fit the optimizer (parameters per group: "
                         f"{here} here, {there} in the checkpoint); nothing was loaded.")
