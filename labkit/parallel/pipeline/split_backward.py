"""A chunk's backward in two halves, for the zero-bubble schedules: B, the gradient with respect to the chunk's
input (what the previous stage waits for), then later W, the gradients of its weights (Qi et al. 2023, "Zero
Bubble Pipeline Parallelism", arXiv:2401.10241, section 2).

    pieces = split_forward(layers, x, then=loss)   the forward, each layer on a detached copy of its input
    dx = backward_input(pieces, grad_output)       B: input gradients only, layer by layer, back to x
    backward_weight(pieces)                        W: each layer's weights' gradients, into .grad

Why cut the graph at every layer: a layer's graph then ends at its own input and weights, so B can ask autograd
for the input's gradient alone (torch.autograd.grad with inputs=the layer's input: the weights' gradients, which
nobody asked for, are not computed) and keep the gradient of each layer's output, and W can ask each layer's graph
for its weights alone, without walking back through the layers before it again. Weights that two layers share get
both layers' gradients, each from its own layer, as loss.backward() would sum them.

What it costs: for a layer of one operation on its weights (a Linear; the course's mlp, whose ReLUs are layers of
their own) B and W together do exactly loss.backward()'s arithmetic. For a layer of several (a transformer block),
W walks the layer's graph again from its output, recomputing the gradients inside it that B already computed: a
block's B and W cost about 1.5 times its backward. torch.distributed.pipelining avoids that by keeping the
gradients at the graph's inner nodes (torch/distributed/pipelining/_backward.py: stage_backward_input hooks the
"param_groups", stage_backward_weight starts from them); cutting at layers is the simple version, exact either way.
Limits: a layer that works in place on its input (nn.ReLU(inplace=True)) cannot take the detached copy (refused,
saying so), and a weight a layer uses without registering it gets no gradient from that layer.
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
    scalar loss: one) and `reached`, whether any gradient reached the output at all (loss.backward() leaves the
    weights of a layer it does not reach without a .grad, and so does W)."""
    input: torch.Tensor
    output: torch.Tensor
    weights: list[nn.Parameter]
    grad_output: torch.Tensor | None = None
    reached: bool = False


def split_forward(layers: nn.Sequential, x: torch.Tensor,
                  then: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[LayerPiece]:
    """Run `layers` on `x`, each layer on a detached copy of the previous output (x itself for the first), and
    `then` (the loss, on the model's last piece) on the last layer's output, inside the last layer's piece."""
    pieces, h = [], x
    for k, layer in enumerate(layers):
        leaf = h if k == 0 else h.detach().requires_grad_(h.requires_grad)
        h = _run(layer, leaf, k)
        if then is not None and k == len(layers) - 1:
            h = then(h)
        pieces.append(LayerPiece(leaf, h, [w for w in layer.parameters() if w.requires_grad]))
    return pieces


def _run(layer: nn.Module, x: torch.Tensor, k: int) -> torch.Tensor:
    """layer(x), or a ValueError naming the layer when it works in place on its (detached, leaf) input."""
    try:
        return layer(x)
    except RuntimeError as error:
        if "in-place operation" not in str(error):
            raise
        raise ValueError(f"split_forward: layer {k} ({type(layer).__name__}) works in place on its input, which the "
                         "split backward gives each layer as a detached leaf; build it without in-place operations "
                         "(e.g. nn.ReLU(inplace=False)).") from error


def backward_input(pieces: list[LayerPiece], grad_output: torch.Tensor | None) -> torch.Tensor | None:
    """B: the gradient with respect to the first piece's input, from the gradient of the last piece's output
    (None: a scalar loss). None where the first input needs none (token ids, a first stage's batch); zeros where it
    does but no gradient reaches it (its receiver still waits for one). Each piece keeps the gradient of its output
    for W, and its graph (retain_graph) for W to walk again."""
    grad, reached = grad_output, True
    for piece in reversed(pieces):
        piece.grad_output, piece.reached = grad, reached
        if reached and piece.output.requires_grad and piece.input.requires_grad:
            (grad,) = torch.autograd.grad(piece.output, piece.input, grad, retain_graph=True, allow_unused=True)
        else:
            grad = None
        reached = grad is not None  # a layer that ignores its input (or a constant): no gradient further back
    first = pieces[0].input if pieces else None
    if grad is None and first is not None and first.requires_grad:
        return torch.zeros_like(first)
    return grad


def backward_weight(pieces: list[LayerPiece]) -> None:
    """W: the weights' gradients of every piece B reached, from the gradient it kept for the piece's output,
    accumulated into .grad (as loss.backward() accumulates); each such piece's graph is then freed."""
    for piece in pieces:
        if piece.reached and piece.weights and piece.output.requires_grad:
            torch.autograd.backward(piece.output, piece.grad_output, inputs=piece.weights)
        piece.grad_output = None
