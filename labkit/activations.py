"""Activation memory: how many bytes a forward pass leaves behind for the backward, and how activation
checkpointing (recomputation) shrinks that number.

    saved_activation_nbytes(fn, *inputs)   bytes of the tensors autograd saved during fn(*inputs)

Activation checkpointing (torch.utils.checkpoint) keeps only each checkpointed segment's input, drops the
activations inside it, and runs the segment's forward again during the backward to get them back: more
compute, less memory, the same gradients. It has nothing to do with saving a run to disk to survive a
failure; that is fault-tolerance checkpointing, labkit.checkpoint.

Source: Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016; PyTorch's
torch.autograd.graph.saved_tensors_hooks and torch.utils.checkpoint documentation. Nothing here touches
torch.cuda: the count works on any device.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["saved_activation_nbytes"]


def saved_activation_nbytes(fn, *inputs) -> int:
    """Run `fn(*inputs)` with gradients enabled and return the bytes of the activations autograd saved for
    the backward, counted through `torch.autograd.graph.saved_tensors_hooks`.

    - Each storage counts once and whole: ReLU saves its output and the next Linear saves the same tensor
      as its input, which is one buffer in memory, not two.
    - Tensors that exist without the forward are not activations and are left out: the storages of the
      tensors in `inputs`, parameters (any leaf tensor that requires grad, or a view of one, like the
      transposed weight a Linear saves), and the parameters and buffers of `fn` when `fn` is an nn.Module
      or one of its bound methods.
    - torch.utils.checkpoint(..., use_reentrant=False) installs its own hooks inside a segment, which keep
      only placeholders, and saves the segment's input through the hooks outside (torch 2.13,
      `_CheckpointFrame.save_inputs`): what is counted is exactly what checkpointing keeps, each segment's
      input plus whatever runs outside checkpoints. Checkpointing every layer of a small MLP therefore saves
      nothing: the segment boundaries are all its activations.

    The forward's output and graph are dropped before returning, so the memory is freed again.

    Example::

        >>> import torch
        >>> from torch.utils.checkpoint import checkpoint_sequential
        >>> from labkit.activations import saved_activation_nbytes
        >>> from labkit.models import mlp
        >>> model, x = mlp(layers=4), torch.randn(32, 16)      # 4 hidden layers of 64 float32 numbers
        >>> saved_activation_nbytes(model, x)                   # 4 ReLU outputs of 32 x 64 x 4 bytes
        32768
        >>> saved_activation_nbytes(lambda x: checkpoint_sequential(model, 2, x, use_reentrant=False), x)
        24576
    """
    known = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
    owner = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module):
        known |= {t.untyped_storage().data_ptr() for t in [*owner.parameters(), *owner.buffers()]}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        root = tensor if tensor._base is None else tensor._base
        storage = tensor.untyped_storage()
        if not (root.is_leaf and root.requires_grad) and storage.data_ptr() not in known:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor  # kept by autograd as usual: no storage is freed and reused during the forward

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = fn(*inputs)
    del output
    return sum(saved.values())
