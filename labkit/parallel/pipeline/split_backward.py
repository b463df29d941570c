"""A chunk's backward in two halves, for the zero-bubble schedules: B, the gradient with respect to the chunk's
input (what the previous stage waits for), then later W, the gradients of its weights (Qi et al. 2023, "Zero
Bubble Pipeline Parallelism", arXiv:2401.10241, section 2).

    pieces = split_forward(layers, x, then=loss)   the forward, each layer on a detached copy of its input
    dx = backward_input(pieces, grad_output)       B: input gradients only, layer by layer, back to x
    backward_weight(pieces)                        W: each layer's weights' gradients, into .grad

Why cut the graph at every layer: a layer's graph then ends at its own input and weights, so B can ask autograd
for the input's gradient alone (torch.autograd.grad with inputs=the layer's input: the weights' gradients, which
nobody asked for, are not computed) and keep the gradient of each layer's output, and W can ask each layer's graph
for its weights alone, without walking back through the layers before it again. torch.distributed.pipelining
splits the graph without cutting it (torch/distributed/pipelining/_backward.py, stage_backward_input and
stage_backward_weight); cutting costs one tensor per layer boundary and is the same arithmetic. Weights that two
layers share get both layers' gradients, each from its own layer, as loss.backward() would sum them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["LayerPiece", "backward_input", "backward_weight", "split_forward"]


@dataclass
class LayerPiece:
    """One layer's part of the graph: its `input` (a leaf; it requires grad iff what came in did), its `output`,
    its trainable `weights`, and once B has run, `grad_output`, the gradient flowing into the output (None for a
    scalar loss: one)."""
    input: torch.Tensor
    output: torch.Tensor
    weights: list[nn.Parameter]
    grad_output: torch.Tensor | None = None


def split_forward(layers: nn.Sequential, x: torch.Tensor,
                  then: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[LayerPiece]:
    """Run `layers` on `x`, each layer on a detached copy of the previous output (x itself for the first), and
    `then` (the loss, on the model's last piece) on the last layer's output, inside the last layer's piece."""
    pieces, h = [], x
    for k, layer in enumerate(layers):
        leaf = h if k == 0 else h.detach().requires_grad_(h.requires_grad)
        h = layer(leaf)
        if then is not None and k == len(layers) - 1:
            h = then(h)
        pieces.append(LayerPiece(leaf, h, [w for w in layer.parameters() if w.requires_grad]))
    return pieces


def backward_input(pieces: list[LayerPiece], grad_output: torch.Tensor | None) -> torch.Tensor | None:
    """B: the gradient with respect to the first piece's input (None where it needs none), from the gradient of
    the last piece's output (None: a scalar loss). Each piece keeps the gradient of its output for W, and its
    graph (retain_graph) for W to walk again."""
    grad = grad_output
    for piece in reversed(pieces):
        piece.grad_output = grad
        if not piece.input.requires_grad:  # token ids, or a first stage's batch: nothing to pass further back
            return None
        if not piece.output.requires_grad:  # the input did not reach the output
            grad = torch.zeros_like(piece.input)
            continue
        (grad,) = torch.autograd.grad(piece.output, piece.input, grad, retain_graph=True, allow_unused=True)
        grad = torch.zeros_like(piece.input) if grad is None else grad
    return grad


def backward_weight(pieces: list[LayerPiece]) -> None:
    """W: each piece's weights' gradients from the gradient B kept for its output, accumulated into .grad (as
    loss.backward() accumulates); each piece's graph is then freed."""
    for piece in pieces:
        if piece.weights and piece.output.requires_grad:
            torch.autograd.backward(piece.output, piece.grad_output, inputs=piece.weights)
        piece.grad_output = None
