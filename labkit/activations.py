"""Activation memory: how many bytes a forward pass leaves behind for the backward, and how activation
checkpointing (recomputation) shrinks that number.

    saved_activation_nbytes(fn, *inputs)   bytes of the tensors autograd saved during fn(*inputs)
    gpt_blocks_nbytes(model, tokens)       what a TinyGPT's blocks keep, measured that way (each checkpointed or not)
    tiny_gpt_nbytes(...)                   the same, predicted: plan.activation_nbytes plus what TinyGPT adds

Activation checkpointing (torch.utils.checkpoint) keeps only each checkpointed segment's input, drops the
activations inside it, and runs the segment's forward again during the backward to get them back: more
compute, less memory, the same gradients. It has nothing to do with saving a run to disk to survive a
failure; that is fault-tolerance checkpointing, labkit.checkpoint.

Source: Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016; Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", section 4.1 (what a transformer layer keeps); PyTorch's
torch.autograd.graph.saved_tensors_hooks, torch.utils.checkpoint and scaled_dot_product_attention documentation.
Nothing here touches torch.cuda: the count works on any device.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from labkit.checks import flag
from labkit.models import TinyGPT
from labkit.plan import activation_nbytes

__all__ = ["gpt_blocks_nbytes", "saved_activation_nbytes", "tiny_gpt_nbytes"]


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


def gpt_blocks_nbytes(model: TinyGPT, tokens: torch.Tensor, recompute: bool = False) -> int:
    """Bytes the blocks of a labkit.models.TinyGPT keep for the backward on `tokens` (batch, length), measured
    with saved_activation_nbytes: the first block's input (the embeddings' output) and all the blocks save, less
    what the embeddings keep for themselves (their indices), without the head. recompute=True runs each block
    under torch.utils.checkpoint (use_reentrant=False), which keeps only its input: full recomputation."""
    if not isinstance(model, TinyGPT):
        raise TypeError(f"model: a {type(model).__name__}; pass a labkit.models.TinyGPT.")

    def blocks(tokens: torch.Tensor) -> torch.Tensor:
        x = model.embeddings(tokens)
        for block in model.blocks:
            x = checkpoint(block, x, use_reentrant=False) if flag("recompute", recompute) else block(x)
        return x
    return saved_activation_nbytes(blocks, tokens) - saved_activation_nbytes(model.embeddings, tokens)


def tiny_gpt_nbytes(layers: int, d_model: int, heads: int, sequence: int, micro_batch: int, recompute: str = "none",
                    flash_attention: bool = True) -> int:
    """What `gpt_blocks_nbytes` measures, predicted: plan.activation_nbytes for TinyGPT's blocks plus the two
    small terms the paper's count leaves out. TinyGPT's block is the paper's GPT block (pre-LN, a GELU MLP of
    4 d_model) in float32 (4 bytes per value, not 2) without dropout (no masks), so the paper's 16 s b h values
    per layer cost 64 s b h bytes; on top, as torch 2.13 saves them on the CPU:

      LayerNorm (native_layer_norm) keeps each token's mean and 1/std: 2 x 2 b s floats per layer
      scaled_dot_product_attention's flash kernel (flash_attention=True) keeps a logsumexp per head and token,
          a b s floats, and no scores; its math kernel keeps the softmax output, a s^2 b floats, the paper's
          score term without dropout, and no logsumexp; it reshapes v (batch, heads, length, head_dim) to
          (batch x heads, length, head_dim), a copy of s b h floats unless batch or heads is 1, when the reshape
          is a view of the fused q/k/v output: that view keeps the whole 3 s b h buffer alive, 2 s b h more
      under full recomputation only each block's input, s b h floats, as the paper counts

    recompute: "none" or "full" (TinyGPT's blocks have no selective recomputation of their attention core).

    >>> tiny_gpt_nbytes(layers=4, d_model=64, heads=4, sequence=32, micro_batch=8)   # 4 x 4 (16 sbh + 4 bs + a bs)
    4227072
    """
    if recompute not in ("none", "full"):
        raise ValueError(f"recompute={recompute!r}: use 'none' or 'full' (gpt_blocks_nbytes checkpoints whole "
                         "blocks or nothing).")
    kept = activation_nbytes(layers, d_model, heads, sequence, micro_batch, recompute=recompute,
                             flash_attention=flash_attention, bytes_per_value=4, dropout=False)
    if recompute == "full":
        return int(kept)
    statistics = 4 * micro_batch * sequence
    if flash_attention:
        attention = heads * micro_batch * sequence                             # the logsumexp
    else:
        attention = 2 * sequence * micro_batch * d_model if 1 in (micro_batch, heads) else 0   # v's whole buffer
    return int(kept) + layers * 4 * (statistics + attention)
