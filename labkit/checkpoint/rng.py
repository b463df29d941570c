"""The random number generators a training step draws from, as a state a checkpoint can hold, and back.

A resumed run ends bit-identical to one never stopped only if it draws the same dropout masks, shuffles and
noise: so torch's CPU generator, Python's `random`, numpy's global generator and CUDA's (once in use) are saved,
per rank, in a form that torch.load(weights_only=True) reads back (tensors, not numpy arrays).
"""

from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["restore_rng_state", "rng_state"]


def rng_state() -> dict:
    """This process's RNG states: {"torch", "python", "numpy"} and "cuda" once CUDA is in use.

    numpy's key array travels as an int64 tensor: weights_only loading takes a tensor, not an ndarray."""
    kind, keys, *rest = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), *rest)}
    if torch.cuda.is_initialized():  # never initialises CUDA; its RNG only matters once CUDA is in use
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    """Set this process's RNGs to `state` (from `rng_state`); CUDA's only where as many GPUs are visible."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available() and torch.cuda.device_count() == len(state["cuda"]):
        torch.cuda.set_rng_state_all(state["cuda"])
