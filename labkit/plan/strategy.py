"""Which parallelism: ask what is running out, and the answer names the strategy (the lesson's L1 and Step 6).

The lesson's three answers (time -> data, one layer -> tensor, too many layers -> pipeline) plus the one its
worked 7B example ends on: when the model fits and only its training state (gradients, optimizer) does not,
shard that state over the data-parallel ranks or train LoRA adapters before splitting the model. Where the
weights themselves do not fit, sharding them too (ZeRO-3, PyTorch FSDP) is as much an answer as the pipeline:
torchtitan's preset config for Llama-3-70B uses FSDP2 and 8-way tensor parallelism, no pipeline, with full
activation checkpointing, for 64 A100 GPUs by its own comment (torchtitan/models/llama3/train_configs/
llama3_70b.toml in pytorch/torchtitan).
"""

from __future__ import annotations

from typing import NamedTuple

from labkit.checks import number
from labkit.plan.memory import training_memory
from labkit.plan.traffic import GB

__all__ = ["Recommendation", "parallelism_for"]

DATA, SHARDED = "data parallelism", "sharded data parallelism or LoRA"
TENSOR, PIPELINE = "tensor parallelism", "pipeline parallelism or ZeRO-3/FSDP"


class Recommendation(NamedTuple):
    """The strategy to reach for first, and why (with the bytes that decided it)."""

    strategy: str
    why: str


def parallelism_for(params: float, largest_layer_params: float, gpu_nbytes: float, weight_bytes: float = 2,
                    grad_bytes: float = 2, optimizer_bytes: float = 12) -> Recommendation:
    """The first strategy for training `params` parameters, the largest layer holding `largest_layer_params`,
    on GPUs of `gpu_nbytes`, and why. Bytes per parameter default to mixed-precision Adam's 2 + 2 + 12 = 16
    (Rajbhandari et al. 2020, "ZeRO", section 3.1); activations are left out.

    Asked in this order, the first yes decides:
    1. The training state (weights + gradients + optimizer state) fits on one GPU: time is what runs out ->
       data parallelism, replicated (PyTorch DDP): every GPU holds all of it, N GPUs pool no memory.
    2. The weights fit, the training state does not: it is the state that runs out, not the model -> shard it
       over the data-parallel ranks (ZeRO stages 1-3, PyTorch FSDP: sharded data parallelism, whose N GPUs do
       pool memory) or freeze the weights and train LoRA adapters (Hu et al. 2021); no need to split the model.
    3. One layer's training state does not fit: a pipeline stage could not hold it -> tensor parallelism
       splits the layer's matrices (Shoeybi et al. 2019, "Megatron-LM").
    4. Every layer fits but the weights of the stack do not: too many layers -> pipeline parallelism
       (Huang et al. 2019, "GPipe") or ZeRO-3/FSDP, which shards the weights too and gathers one layer at a
       time (Rajbhandari et al. 2020, section 5.3; Zhao et al. 2023, "PyTorch FSDP"); at that size usually with
       tensor parallelism inside a node (torchtitan's preset config for Llama-3-70B: FSDP2 + 8-way tensor parallelism).
    Tensor and pipeline parallelism are both "model parallelism"; large runs combine all of these.

    >>> parallelism_for(7e9, 0.2e9, 80e9).strategy    # the lesson's 7B: 14 GB of weights, 112 GB of state
    'sharded data parallelism or LoRA'
    """
    count = number("params", params, inclusive=False)
    layer = number("largest_layer_params", largest_layer_params, inclusive=False)
    gpu = number("gpu_nbytes", gpu_nbytes, inclusive=False)
    if layer > count:
        raise ValueError(f"largest_layer_params={largest_layer_params!r} exceeds params={params!r}: a layer is part "
                         "of the model; pass the largest layer's share.")
    per_param = {"weight_bytes": weight_bytes, "grad_bytes": grad_bytes, "optimizer_bytes": optimizer_bytes}
    full, layer_state = training_memory(count, **per_param), training_memory(layer, **per_param)["total"]
    state, weights = full["total"], full["weights"]
    on_gpu = f"one {gpu / GB:g} GB GPU"
    if state <= gpu:
        return Recommendation(DATA, (
            f"the training state ({state / GB:.1f} GB) fits on {on_gpu}: time is what runs out, so replicate the "
            "model and split the batch (replicated data parallelism, PyTorch DDP)"))
    if weights <= gpu:
        return Recommendation(SHARDED, (
            f"the weights ({weights / GB:.1f} GB) fit on {on_gpu} but the training state ({state / GB:.1f} GB) "
            "does not: the gradients and optimizer state run out, not one layer or the stack. Shard them over the "
            "data-parallel ranks (ZeRO-1/2; ZeRO-3 and PyTorch FSDP shard the weights too) or freeze the weights "
            "and train LoRA adapters; replicated data parallelism (DDP) alone pools no memory"))
    if layer_state > gpu:
        return Recommendation(TENSOR, (
            f"one layer's training state ({layer_state / GB:.1f} GB) does not fit on {on_gpu}, so no pipeline "
            "stage could hold it: split the layer's matrices across GPUs (tightly coupled, inside a node)"))
    return Recommendation(PIPELINE, (
        f"even the weights ({weights / GB:.1f} GB) exceed {on_gpu} while every layer fits (at most "
        f"{layer_state / GB:.1f} GB of state): too many layers. Put consecutive layers on consecutive GPUs and keep "
        "them busy with micro-batches (pipeline parallelism), or shard the weights too and gather one layer at a "
        "time (ZeRO-3, PyTorch FSDP); at this size usually with tensor parallelism inside a node (torchtitan's preset "
        "config for Llama-3-70B uses FSDP2 + tensor parallelism)"))
