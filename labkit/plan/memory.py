"""Bytes per GPU for training state, LoRA's trainable parameters, and a small transformer's parameter count.

Replicated data parallelism (DDP) copies the whole training state to every rank, so it only works once
weights, gradients and optimizer state fit on one GPU; sharded data parallelism (ZeRO, FSDP: `zero_stage`
below; plan.sharding tabulates the stages and what they move) splits that state over the ranks. The memory
arithmetic comes before the choice of parallelism.
Activations are extra (they depend on batch, sequence and recomputation; Korthikanti et al. 2022): count them
with plan.activation_nbytes and pass them in (`activations_nbytes`; memory_options takes the sequence and
recomputation), and the total includes them.
"""

from __future__ import annotations

import math

from labkit.checks import finite_result, flag, items, number, overflow_named, shown, whole
from labkit.plan.activation_memory import activation_nbytes

__all__ = ["MAX_LISTED_LAYERS", "YOUR_CHOICE", "attention_lora_shapes", "lora_params", "memory_options",
           "tp_in_node", "training_memory", "transformer_params"]

MAX_LISTED_LAYERS = 10_000  # attention_lora_shapes lists 4 shapes per layer: bound the list, not the model


def training_memory(params: float, weight_bytes: float = 2, grad_bytes: float = 2, optimizer_bytes: float = 12,
                    zero_stage: int = 0, dp: int = 1, activations_nbytes: float | None = None) -> dict[str, float]:
    """Bytes per GPU of weights, gradients and optimizer state, with ZeRO sharding over `dp` ranks; and of
    activations when `activations_nbytes` is given (plan.activation_nbytes counts them): an "activations" key,
    included in "total". ZeRO does not shard activations: each rank keeps those of its own micro-batch.

    Defaults are the ZeRO paper's mixed-precision Adam: 2 (bf16/fp16 weights) + 2 (grads) + 12 (fp32 master
    weights, Adam m and v) = 16 bytes/param. Stage 1 shards the optimizer state over dp, stage 2 also the
    gradients, stage 3 also the weights: 4 + 12/dp, 2 + 14/dp, 16/dp bytes/param (Rajbhandari et al. 2020,
    "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", figure 1 and section 5). Other conventions
    (18 bytes with fp32 grads, DeepSpeed's 20) are a matter of passing other byte counts.

    >>> training_memory(7e9)["total"]                          # the lesson's 7B model: 112 GB
    112000000000.0
    >>> training_memory(7e9, zero_stage=3, dp=8)["total"]      # everything sharded over 8 ranks
    14000000000.0
    >>> training_memory(7e9, zero_stage=1, dp=8, activations_nbytes=4.29e9)["total"]   # + full recomputation's
    42790000000.0
    """
    count = number("params", params)
    stage, ranks = whole("zero_stage", zero_stage, minimum=0), whole("dp", dp)
    if stage > 3:
        raise ValueError(f"zero_stage={shown(zero_stage)}: pass 0 (no sharding), 1, 2 or 3.")
    per_param = {
        "weights": number("weight_bytes", weight_bytes) / (ranks if stage >= 3 else 1),
        "grads": number("grad_bytes", grad_bytes) / (ranks if stage >= 2 else 1),
        "optimizer": number("optimizer_bytes", optimizer_bytes) / (ranks if stage >= 1 else 1),
    }
    memory = {part: count * nbytes for part, nbytes in per_param.items()}
    if activations_nbytes is not None:
        memory["activations"] = number("activations_nbytes", activations_nbytes)
    return finite_result("training_memory", {**memory, "total": sum(memory.values())}, params=params,
                         weight_bytes=weight_bytes, grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes,
                         zero_stage=zero_stage, dp=dp, activations_nbytes=activations_nbytes)


def lora_params(shapes, rank: int) -> int:
    """Trainable parameters of LoRA adapters of rank r on matrices given as (d_in, d_out): sum r(d_in + d_out).

    Each frozen W (d_in x d_out) gets trainable A (d_in x r) and B (r x d_out); a rank above min(d_in, d_out)
    adds parameters without adding expressiveness, so it is refused (Hu et al. 2021, "LoRA: Low-Rank
    Adaptation of Large Language Models", section 4.1).

    >>> lora_params([(4096, 4096), (4096, 11008)], rank=8)    # 8 x 8192 + 8 x 15104
    186368
    """
    r = whole("rank", rank)
    pairs = items("shapes", shapes, "a list of (d_in, d_out) pairs")
    if not pairs:
        raise ValueError("shapes=[]: pass at least one (d_in, d_out) pair.")
    total = 0
    for pair in pairs:
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise ValueError(f"shapes: {shown(pair)} is not a (d_in, d_out) pair; pass pairs of whole numbers.")
        d_in, d_out = whole("shapes d_in", pair[0]), whole("shapes d_out", pair[1])
        if r > min(d_in, d_out):
            raise ValueError(f"rank={shown(rank)} exceeds min(d_in, d_out) = {min(d_in, d_out)} of {shown(pair)} in "
                             "shapes: pass a smaller rank.")
        total += r * (d_in + d_out)
    return finite_result("lora_params", total, shapes=shapes, rank=rank)


def transformer_params(vocab: int, d_model: int, layers: int, d_ff: int, context: int | None = None,
                       tied_embeddings: bool = True, bias: bool = True) -> int:
    """Parameters of a GPT-style pre-LN decoder, module by module, as torch would count them.

    Counted (d = d_model):
      token embedding    nn.Embedding(vocab, d)                           vocab d
      position embedding nn.Embedding(context, d), only if context given  context d
      per layer, `layers` times:
        ln_1             nn.LayerNorm(d), weight and bias                 2d
        attention        nn.Linear(d, 3d) for q, k, v + nn.Linear(d, d)   4d^2 (+ 4d with bias)
        ln_2             nn.LayerNorm(d), weight and bias                 2d
        MLP              nn.Linear(d, d_ff) + nn.Linear(d_ff, d)          2 d d_ff (+ d_ff + d with bias)
      final norm         nn.LayerNorm(d), weight and bias                 2d
      LM head            nn.Linear(d, vocab, bias=False), only if not tied_embeddings   d vocab
    `bias` switches the biases of the Linear layers only; LayerNorms always have both. Attention heads
    split d without adding parameters. GPT-2 small (Radford et al. 2019) gives the known 124,439,808.

    >>> transformer_params(vocab=50257, d_model=768, layers=12, d_ff=3072, context=1024)
    124439808
    """
    v, d, n, f = (whole(name, value) for name, value in
                  (("vocab", vocab), ("d_model", d_model), ("layers", layers), ("d_ff", d_ff)))
    positions = 0 if context is None else whole("context", context)
    linear_biases = (3 * d + d + f + d) if flag("bias", bias) else 0
    per_layer = 2 * d + 4 * d * d + 2 * d + 2 * d * f + linear_biases
    head = 0 if flag("tied_embeddings", tied_embeddings) else d * v
    return finite_result("transformer_params", v * d + positions * d + n * per_layer + 2 * d + head, vocab=vocab,
                         d_model=d_model, layers=layers, d_ff=d_ff, context=context)


YOUR_CHOICE = "your choice"


def attention_lora_shapes(d_model: int, layers: int) -> list[tuple[int, int]]:
    """The (d_in, d_out) of the q, k, v and output projections of every layer: where LoRA usually goes."""
    width, count = whole("d_model", d_model), whole("layers", layers)
    if count > MAX_LISTED_LAYERS:
        raise ValueError(f"layers={shown(layers)}: pass at most {MAX_LISTED_LAYERS:,} (the list holds 4 shapes "
                         "per layer).")
    return [(width, width)] * 4 * count


def memory_options(params: float, devices: int, lora_rank: int = 0, zero_stage: int = 0, weight_bytes: float = 2,
                   grad_bytes: float = 2, optimizer_bytes: float = 12, d_model: int = 4096, layers: int = 32,
                   sequence: int | None = None, micro_batch: int = 1, heads: int = 32, recompute: str = "none",
                   flash_attention: bool = True, sequence_parallel: bool = False,
                   accumulation_steps: int = 1) -> dict[str, dict[str, float]]:
    """Bytes per GPU (as `training_memory`'s dicts) for the lesson's Step 6 ways out of the memory wall.

    Keys: "replicated" (plain data parallelism), "ZeRO-1/2/3 over N", "LoRA r=..." (frozen weights, trainable
    adapters on the attention projections of a model of `d_model` and `layers`, LLaMA-7B's 4096 and 32 by
    default; Hu et al. 2021), "TP x PP over N" (weights, grads and optimizer state split N ways; Shoeybi et al.
    2019) and YOUR_CHOICE, which applies `zero_stage` and `lora_rank` together (rank 0 = full fine-tuning).

    With a `sequence` length, each dict also holds "activations" (plan.activation_nbytes, at the weights'
    precision, `weight_bytes` per value), included in its total: a data-parallel GPU keeps one micro-batch of
    `micro_batch` sequences through all `layers` (accumulation runs the micro-batches one after another); for
    LoRA that is an upper bound (frozen layers need not keep their inputs). "TP x PP over N" splits each layer
    over tp = tp_in_node(N, heads) ranks (sequence_parallel applies there) and the layers over pp = N / tp
    stages; 1F1B's first stage holds min(pp, accumulation_steps) micro-batches of ceil(layers / pp) layers
    (Korthikanti et al. 2022, section 4.2.3: with pp in flight, all L layers' worth).

    >>> options = memory_options(7e9, 8)
    >>> round(options["ZeRO-1 over 8"]["total"] / 1e9, 1)          # (4 + 12/8) x 7e9
    38.5
    >>> options = memory_options(7e9, 8, sequence=2048, micro_batch=8, recompute="full")
    >>> round(options["ZeRO-1 over 8"]["activations"] / 1e9, 2), round(options["ZeRO-1 over 8"]["total"] / 1e9, 1)
    (4.29, 42.8)
    """
    n, stage = whole("devices", devices), whole("zero_stage", zero_stage, minimum=0)
    rank, width, depth = (whole("lora_rank", lora_rank, minimum=0), whole("d_model", d_model),
                          whole("layers", layers))
    if rank > width:
        raise ValueError(f"lora_rank={shown(lora_rank)} exceeds d_model={width}: a rank above the projections' "
                         "width adds parameters without adding expressiveness; pass a smaller rank.")
    count = number("params", params)
    state = {name: number(name, value) for name, value in
             (("weight_bytes", weight_bytes), ("grad_bytes", grad_bytes), ("optimizer_bytes", optimizer_bytes))}
    shown_rank = rank or min(16, width)  # the LoRA option shown beside the others: r = 16 unless d_model is smaller
    inputs = dict(params=params, devices=devices, lora_rank=lora_rank, zero_stage=zero_stage,
                  weight_bytes=weight_bytes, grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes, d_model=d_model,
                  layers=layers, sequence=sequence, micro_batch=micro_batch, heads=heads, recompute=recompute,
                  flash_attention=flash_attention, sequence_parallel=sequence_parallel,
                  accumulation_steps=accumulation_steps)
    with overflow_named("memory_options", **inputs):
        replica_nbytes, stage_nbytes = (None, None) if sequence is None else _activations(
            n, depth, width, state["weight_bytes"], sequence=sequence, micro_batch=micro_batch, heads=heads,
            recompute=recompute, flash_attention=flash_attention, sequence_parallel=sequence_parallel,
            accumulation_steps=accumulation_steps)

    def lora(r: int, sharding: int) -> dict[str, float]:
        trainable = lora_params(attention_lora_shapes(width, depth), r)
        frozen = training_memory(count, state["weight_bytes"], 0, 0, zero_stage=sharding, dp=n)
        adapters = training_memory(trainable, **state, zero_stage=sharding, dp=n)
        return _with(replica_nbytes, {part: frozen[part] + adapters[part] for part in frozen})

    def sharded(s: int) -> dict[str, float]:
        return _with(replica_nbytes, training_memory(count, **state, zero_stage=s, dp=n))

    with overflow_named("memory_options", **inputs) as finite:
        full = training_memory(count, **state)
        options = {"replicated": sharded(0)}
        options.update({f"ZeRO-{s} over {n}": sharded(s) for s in (1, 2, 3)})
        options[f"LoRA r={shown_rank}"] = lora(shown_rank, 0)
        options[f"TP x PP over {n}"] = _with(stage_nbytes, {part: nbytes / n for part, nbytes in full.items()})
        options[YOUR_CHOICE] = lora(rank, stage) if rank else sharded(stage)
        return finite(options)  # a frozen part and its adapters' may overflow as they add up


def tp_in_node(devices: int, heads: int, gpus_per_node: int = 8) -> int:
    """The tensor-parallel degree of memory_options' "TP x PP over N": the largest t <= gpus_per_node that divides
    both `devices` and `heads` (tensor parallelism inside a node, on its fast links, and whole heads per rank;
    Narayanan et al. 2021, section 3, takeaway #1; notebook 13). The rest of the devices are pipeline stages.

    >>> tp_in_node(8, 32), tp_in_node(64, 32), tp_in_node(12, 32), tp_in_node(8, 12)
    (8, 8, 4, 4)
    """
    n, a, node = whole("devices", devices), whole("heads", heads), whole("gpus_per_node", gpus_per_node)
    return max(t for t in range(1, min(n, node) + 1) if n % t == 0 and a % t == 0)


def _activations(devices: int, layers: int, d_model: int, bytes_per_value: float, *, sequence, micro_batch, heads,
                 recompute, flash_attention, sequence_parallel, accumulation_steps) -> tuple[float, float]:
    """(bytes a data-parallel GPU keeps, bytes the first stage of "TP x PP over devices" keeps): see memory_options."""
    shape = dict(d_model=d_model, heads=heads, sequence=sequence, micro_batch=micro_batch,
                 recompute=recompute, flash_attention=flash_attention,
                 bytes_per_value=bytes_per_value)
    replica = activation_nbytes(layers, **shape)
    t = tp_in_node(devices, heads)
    stages = devices // t
    in_flight = min(stages, whole("accumulation_steps", accumulation_steps))
    first_stage = activation_nbytes(math.ceil(layers / stages), **shape, tp=t, sequence_parallel=sequence_parallel)
    return replica, in_flight * first_stage


def _with(activations: float | None, memory: dict[str, float]) -> dict[str, float]:
    """`memory` with its "activations" added (and counted in its total), or as it is when there are none."""
    if activations is None:
        return memory
    parts = {part: nbytes for part, nbytes in memory.items() if part != "total"}
    return {**parts, "activations": activations, "total": sum(parts.values()) + activations}
