"""Which parallelism: ask what is running out, and the answer names the strategy (the lesson's L1)."""

from __future__ import annotations

from labkit.plan._checks import number

DATA, TENSOR, PIPELINE = "data parallelism", "tensor parallelism", "pipeline parallelism"


def parallelism_for(state_nbytes: float, largest_layer_nbytes: float, gpu_nbytes: float) -> tuple[str, str]:
    """The strategy for a model whose training state (weights, gradients, optimizer) takes `state_nbytes`,
    whose largest layer's state takes `largest_layer_nbytes`, on GPUs of `gpu_nbytes`, and why.

    - Everything fits on one GPU: time is what runs out -> data parallelism (replicate, split the batch).
    - One layer does not fit: split the matrix itself -> tensor parallelism.
    - Every layer fits but the stack does not: too many layers -> pipeline parallelism.
    Tensor and pipeline parallelism are both "model parallelism", the umbrella term; large runs combine all
    three (3D parallelism) and shard the optimizer state too. Activations are left out.

    >>> parallelism_for(112e9, 2e9, 80e9)[0]      # a 7B model's 16 bytes/param on an 80 GB GPU
    'pipeline parallelism'
    """
    state, layer = number("state_nbytes", state_nbytes), number("largest_layer_nbytes", largest_layer_nbytes)
    gpu = number("gpu_nbytes", gpu_nbytes, inclusive=False)
    if layer > state:
        raise ValueError(f"largest_layer_nbytes={largest_layer_nbytes!r} exceeds state_nbytes={state_nbytes!r}: a "
                         "layer is part of the model; pass the largest layer's share.")
    if state <= gpu:
        return DATA, ("the model, its gradients and optimizer state fit on one GPU: time is what runs out, so "
                      "replicate the model and split the batch")
    if layer > gpu:
        return TENSOR, ("one layer alone does not fit: split its weight matrices across GPUs (tightly coupled, "
                        "inside a node)")
    return PIPELINE, ("every layer fits but the stack does not: put consecutive layers on consecutive GPUs and "
                      "keep them busy with micro-batches")
