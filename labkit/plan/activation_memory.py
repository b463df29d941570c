"""Activation memory: the bytes a transformer's forward keeps for its backward, per GPU, with and without
recomputation, tensor and sequence parallelism.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4.1) count a
GPT block's saved tensors for s tokens per sequence, b sequences per micro-batch, width h, a heads, 16-bit values
and 1-byte dropout masks: s b h (34 + 5 a s / h) bytes per layer (their equation 1). Term by term, in s b h:

  replicated under tensor parallelism (10): the inputs of the two LayerNorms, of the q/k/v projection and of the
      MLP's first linear (2 each), the two dropout masks after attention and after the MLP (1 each)
  split over the t tensor-parallel ranks (24): q and k (4), v (2), the attention output the projection takes (2),
      the GELU's input and output, 4h wide (8 each)
  the attention scores, as^2b numbers: the softmax output (2), its dropout mask (1) and the dropout's output (2),
      5 a s^2 b bytes, split over t

With tensor parallelism t that is s b h (10 + 24/t + 5as/(ht)) (equation 2); sequence parallelism splits the
replicated 10 as well: s b h (34/t + 5as/(ht)) (equation 3). Selective recomputation (section 5) recomputes the
attention core and keeps no scores; a flash-attention kernel (Dao et al. 2022) never stores them either, it
recomputes them inside its backward: then s b h (10 + 24/t), or s b h 34/t with sequence parallelism. Full
recomputation keeps only each layer's input, 2 s b h. The paper's Table 2 lists these per layer; L layers keep L
times as much. Other layouts are other byte counts: `bytes_per_value` (4 for float32) and `dropout=False` (no
masks, and the softmax output is then saved once, not also as the dropout's output).

This is the paper's block (a GELU MLP of width 4h, LayerNorm, dropout); at LLaMA-7B's width it is the paper's
standard block, not LLaMA's. LLaMA's own (a SwiGLU MLP of width 11008, RMSNorm, no dropout) keeps, by the same
count, 16 s b h outside its MLP and four 11008-wide tensors in it (the SiLU's input and output, the up
projection's output, the down projection's input): 16 + 8 x 11008 / 4096 = 37.5 s b h, not 34.
"""

from __future__ import annotations

from labkit.checks import choice, flag, number, overflow_named, whole

__all__ = ["RECOMPUTE", "activation_nbytes"]

RECOMPUTE = ("none", "selective", "full")  # nothing, the attention core (the scores), each whole layer


def activation_nbytes(layers: int, d_model: int, heads: int, sequence: int, micro_batch: int, recompute: str = "none",
                      tp: int = 1, sequence_parallel: bool = False, flash_attention: bool = True,
                      bytes_per_value: float = 2, dropout: bool = True) -> float:
    """Bytes of activations the `layers` transformer layers keep per GPU between one micro-batch's forward and its
    backward (Korthikanti et al. 2022, section 4.1, equations 1-3 and Table 2), for `micro_batch` sequences of
    `sequence` tokens through layers of width `d_model` with `heads` attention heads.

    recompute: "none"; "selective" (the attention core is recomputed: no scores kept); "full" (each layer's input
    only, as torch.utils.checkpoint around every layer keeps it). tp: tensor-parallel ranks; sequence_parallel:
    the replicated tensors, and under "full" the layer input, are cut along the sequence over them too.
    flash_attention: the scores are recomputed inside the kernel, never stored (it keeps a logsumexp of a s b
    floats instead, under 0.1% of the rest at LLaMA-7B's shape: not counted). bytes_per_value: 2 for 16-bit
    activations; dropout=False drops the masks. Left out, as in the paper's per-layer count: the embedding, the
    output layer and the loss; and, while a fully recomputed layer runs its backward, that one layer's
    activations again. Frozen weights (LoRA) need not keep their inputs: then this is an upper bound.

    The paper's standard block at LLaMA-7B's width, 34 sbhL:

    >>> round(activation_nbytes(32, 4096, 32, sequence=2048, micro_batch=8) / 1e9, 2)
    73.01
    >>> round(activation_nbytes(32, 4096, 32, 2048, 8, recompute="full") / 1e9, 2)      # 2 sbhL
    4.29
    """
    count, width, head_count = whole("layers", layers), whole("d_model", d_model), whole("heads", heads)
    s, b, t = whole("sequence", sequence), whole("micro_batch", micro_batch), whole("tp", tp)
    how = choice("recompute", recompute, RECOMPUTE)
    split_sequence, flash = flag("sequence_parallel", sequence_parallel), flag("flash_attention", flash_attention)
    mask = 1 if flag("dropout", dropout) else 0  # bytes per element of a dropout mask
    value = number("bytes_per_value", bytes_per_value)
    if head_count % t:
        raise ValueError(f"tp={t}: {head_count} heads do not split over {t} tensor-parallel ranks (each computes whole "
                         f"heads); pass a tp that divides heads={head_count}.")
    if split_sequence and s % t:
        raise ValueError(f"sequence={s}: sequence parallelism cuts the sequence into tp={t} equal parts; pass a "
                         f"sequence that tp divides.")
    inputs = dict(layers=layers, d_model=d_model, heads=heads, sequence=sequence, micro_batch=micro_batch,
                  bytes_per_value=bytes_per_value)
    with overflow_named("activation_nbytes", **inputs) as finite:  # ints past 1.8e308 overflow as floats
        sbh = float(s) * b * width
        shard = t if split_sequence else 1
        if how == "full":
            return finite(count * value * sbh / shard)
        replicated = (4 * value + 2 * mask) * sbh
        scores = 0 if flash or how == "selective" else float(head_count) * s * s * b * (value + mask * (1 + value))
        return finite(count * (replicated / shard + (12 * value * sbh + scores) / t))
