"""3D parallelism by the numbers: for a GPT on a dp x pp x tp layout (a cp axis for long sequences, an ep axis for a
mixture of experts), the layers and parameters each rank holds, and the bytes it hands to each axis's collectives
in one training step.

    GPTShape(vocab, d_model, layers, heads, context)        the model (labkit.models.TinyGPT's layers)
    ParallelLayout(dp, pp, tp, microbatches, ...)           the layout, and a rank's place in it
    check_fit(shape, layout, batch, sequence)               ValueError unless the layout fits the model and batch
    rank_layers(shape, layout, rank)                        the layers (0: embeddings, 1..L: blocks, L+1: head)
    rank_params(shape, layout, rank)                        the parameters the rank holds: its memory's basis
    axis_traffic(shape, layout, batch, rank)                bytes it hands to each axis per step, by collective
    axis_wire_bytes(traffic, layout)                        what ring collectives move for them, per axis

The layers are split as labkit.parallel.ThreeDGPT splits them: the pipeline cuts [Embeddings, Block x L, Head]
into pp x chunks pieces (balanced by layer count, as stage_layers cuts), and tensor parallelism splits each layer
over tp (attention by heads, the Megatron MLP, embedding and head by vocabulary: labkit.parallel.tensor_gpt).

The bytes follow labkit.parallel.counters' convention, so a prediction equals count_collectives().by_axis(mesh)
to the byte (ep's all-to-alls: summed over each ep group, below): each collective counts the payload this rank
hands it, an all-reduce its tensor, an all-gather its own part (padded to the largest), a reduce-scatter the whole
tensor it sums, a send the tensor sent, an all-to-all all it hands (its own part included). Per micro-batch of b
sequences of s tokens (width h, vocabulary V, t = tp, a = b s h numbers):

  tp, plain (Shoeybi et al. 2019, "Megatron-LM", section 3): the embedding 1 all-reduce (a) forward; each block
      2 all-reduces (a) forward and 2 backward (the g and f around its attention and its MLP); the head 1
      all-reduce (a) backward, and forward the logits all-gathered, ceil(V / t) b s numbers from each rank (what
      labkit.parallel.tensor_gpt does). With vocab_parallel_loss, Megatron's vocabulary-parallel cross-entropy
      (same section) replaces that gather: each rank keeps its vocabulary slice of the logits and the loss takes
      3 all-reduces of b s numbers (the max, the target's logit and the sum of exponentials per token; its
      backward is local), in FP32 whatever the model's precision (VocabParallelCrossEntropy casts the logits
      with .float(), megatron/core/tensor_parallel/cross_entropy.py): LOSS_BYTES_PER_NUMBER = 4 bytes each.
      labkit's executor does not run it: the layout says which one is planned.
  tp, sequence parallel (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
      Models", section 4.2.2): each all-reduce becomes a reduce-scatter (a) and an all-gather (a / t). The
      embedding 1 reduce-scatter forward, 1 all-gather backward; a block 2 all-gathers and 2 reduce-scatters
      forward, 4 all-gathers (2 gather a stored shard again) and 2 reduce-scatters backward; the head 1 all-gather
      forward, 1 all-gather and 1 reduce-scatter backward, and the logits. Once a step, 1 all-reduce of the
      gradients of the parameters used on a sequence shard: 6 h per block (2 LayerNorms, 2 row-parallel biases),
      the position embedding's context x h, the final LayerNorm's 2 h.
  pp (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
      section 2.2): every piece but the model's last sends its output forward (a; a / t under sequence
      parallelism, which leaves each tp rank its part of the sequence), every piece but the first sends its
      input's gradient back. Without sequence parallelism each tp rank sends the whole activation, as labkit's
      executor does. With scatter_gather, Megatron's scatter/gather optimisation (section 4.1 of that paper):
      each tp rank sends its 1/t of the activation (a / t) across the boundary, and the receiving tp group
      all-gathers the parts (a / t from each rank) over its own, faster, links: the cross-node bytes fall t-fold
      for an all-gather on the tp axis per message received. Under sequence parallelism the activation is
      already a / t per rank, and nothing is gathered.
  dp, zero_stage 0 (Li et al. 2020, "PyTorch Distributed", section 3.2): one all-reduce of every gradient the
      rank holds, once per step after the last micro-batch, plus labkit's BucketedDDP's one number per parameter
      tensor (how many ranks produced that gradient).
  dp, zero_stage 1 or 2 (Rajbhandari et al. 2020, "ZeRO", section 7.2.1): labkit.parallel.ShardedOptimizer over
      the rank's P parameters in one bucket (as ThreeDGPT builds it), once per step after the last micro-batch:
      one reduce-scatter of the gradients, padded to dp x ceil(P / dp) numbers (each rank's slice travels at the
      largest slice's size), and one all-gather of the rank's updated slice, ceil(P / dp) numbers. On the wire
      2 (dp - 1) ceil(P / dp): the all-reduce's 2 (dp - 1) / dp x P, up to the padding and without the flags.
  cp (context parallelism, labkit.parallel.context_gpt; Liu et al. 2023, "Ring Attention"): each rank holds its
      zig-zag positions of every sequence (plan.held_positions: s_r of s), so every other axis's activations are
      b s_r h instead of b s h; every block's attention passes K and V of its heads (b heads / t rows of h / heads)
      around the ring forward and backward (plan.context_parallel_nbytes, every micro-batch); once a step, one
      all-reduce of every gradient the rank holds over cp (the cp ranks hold the same weights and split the
      sequences' tokens, as dp ranks split the batch). Planned with plain tp (ContextParallelGPT's; sequence
      parallelism cuts the sequence another way), checked against ContextParallelGPT's counts where pp = 1. That
      sum over cp, then dp, is ContextParallelGPT's; one all-reduce over dp x cp together (torchtitan's "dp_cp"
      mesh) would send about 2 P on the wire instead of 2(dp-1)/dp P + 2(cp-1)/cp P.
  ep (expert parallelism, labkit.parallel.experts_gpt; GShard, Lepikhin et al. 2020, section 2.2): with
      GPTShape(experts=E, top_k=k) each block's MLP is E expert MLPs of width d_ff and a router (h x E, no bias), as
      MoEGPT builds it; the E experts are cut over the ep ranks, E/ep each, and everything else is replicated. The
      ep ranks split the batch as dp replicas do (b = batch / (dp ep m)). Every MoE block, every micro-batch, on
      its T = b s tokens: an all-to-all of the E routing counts (8-byte integers, torch.bincount's int64:
      COUNT_BYTES, whatever bytes_per_number is), then four all-to-alls of rows of h numbers: the dispatch (the
      rank's T k choices) and the combine (the rows its experts received) forward, and their gradients backward.
      Each rank hands its T k choices to the dispatch and to the combine's gradient; to the combine and the
      dispatch's gradient it hands what its experts received, T k rows on average over the group, more or fewer
      on one rank as routing falls (at most capacity_factor T k). The plan counts T k for each of the four:
      balanced routing with no choice dropped (a capacity_factor of at least E/k keeps every choice), exact summed
      over the ep group's ranks (every row sent is received), not rank by rank. Once a step the replicated
      parameters' gradients are all-reduced over ep (then over dp, with the experts', as every other gradient);
      the experts' over dp only, since an ep group holds each expert once (Rajbhandari et al. 2022,
      "DeepSpeed-MoE"; DeepSpeed's deepspeed/moe/experts.py). The dp all-reduce of a MoE counts no flags:
      ExpertParallelGPT sums each gradient with a plain all_reduce_sum, not BucketedDDP. Planned on dp x pp x ep
      with zero_stage 0, as ExpertParallelGPT runs it: experts split over tp (Megatron's expert tensor
      parallelism), a MoE with cp and ZeRO's sharding of a MoE's state (DeepSpeed-MoE shards the dense part over
      dp x ep and the experts over dp) are not.

A size-1 axis moves nothing: its entry is empty. `axis_wire_bytes` turns the payloads into the bytes a ring moves
per rank (all-reduce 2(N-1)/N, reduce-scatter (N-1)/N of the whole, all-gather N-1 parts; Thakur et al. 2005), the
number to put against a link's speed.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, fields

from labkit._refusals import refuse_while_graded
from labkit.checks import choice, finite_result, flag, number, shown, whole
from labkit.plan.context_parallel import context_parallel_nbytes, held_positions
from labkit.plan.counts import shard_sizes
from labkit.plan.traffic import ring_allreduce_bytes, ring_reduce_scatter_bytes

__all__ = ["COLLECTIVES", "COUNT_BYTES", "LOSS_BYTES_PER_NUMBER", "GPTShape", "ParallelLayout", "axis_traffic",
           "axis_wire_bytes", "check_fit", "rank_layers", "rank_params"]

_AXES = ("dp", "pp", "cp", "ep", "tp")  # as labkit.parallel.mesh.ALL_AXES, outermost first (plan imports no torch)
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send", "broadcast", "all_to_all",
               "all_to_all_sizes")  # labkit.parallel.counters' kinds
LOSS_BYTES_PER_NUMBER = 4  # Megatron's vocabulary-parallel loss all-reduces FP32 numbers (module docstring)
COUNT_BYTES = 8  # a MoE block's routing counts: torch.bincount's int64 (labkit.parallel.experts.dispatch)


@dataclass(frozen=True)
class GPTShape:
    """A GPT's sizes, as labkit.models.TinyGPT takes them: `vocab`, `d_model`, `layers` (blocks), `heads`,
    `context` (positions), `d_ff` (the MLP's width; None: 4 d_model), whether the head is `tied` to the token
    embedding, and for a mixture of experts (labkit.parallel.experts_gpt.MoEGPT) the `experts` per block, each an
    MLP of width d_ff, and the `top_k` each token goes to (experts=0: a dense MLP, TinyGPT's)."""
    vocab: int
    d_model: int
    layers: int
    heads: int
    context: int
    d_ff: int | None = None
    tied: bool = False
    experts: int = 0
    top_k: int = 1

    def __post_init__(self):
        for name in ("vocab", "d_model", "layers", "heads", "context", "top_k"):
            whole(name, getattr(self, name))
        flag("tied", self.tied)
        if self.top_k > max(1, whole("experts", self.experts, minimum=0)):
            raise ValueError(f"GPTShape: top_k={shown(self.top_k)} experts per token, but a block has "
                             f"experts={shown(self.experts)}; pass top_k <= experts (experts=0: a dense MLP, top_k=1).")
        if self.d_model % self.heads:
            raise ValueError(f"GPTShape: d_model={shown(self.d_model)} must be a multiple of "
                             f"heads={shown(self.heads)}.")
        d_ff = 4 * self.d_model if self.d_ff is None else whole("d_ff", self.d_ff)
        object.__setattr__(self, "d_ff", finite_result("GPTShape", d_ff, d_model=self.d_model, d_ff=self.d_ff))

    def __repr__(self) -> str:
        """The fields, experts and top_k only for a mixture of experts: a dense GPT reads as it always has."""
        names = [f.name for f in fields(self) if self.experts or f.name not in ("experts", "top_k")]
        return f"GPTShape({', '.join(f'{name}={getattr(self, name)!r}' for name in names)})"


@dataclass(frozen=True)
class ParallelLayout:
    """A dp x pp x tp layout (tp innermost: global rank (dp_i pp + pp_j) tp + tp_k, as labkit.parallel.Mesh lays
    ranks out), with `microbatches` per step on each pipeline, `chunks` pieces per stage (interleaved 1F1B),
    sequence parallelism on the tp axis or not, and the dp axis's `zero_stage`: 0 replicates the optimizer state
    (BucketedDDP's all-reduce of the gradients), 1 shards it over the dp group and 2 the gradients too
    (labkit.parallel.ShardedOptimizer: a reduce-scatter and an all-gather). ZeRO-3, which shards the weights and
    gathers them in every forward and backward, is not an option of this layout. `cp` ranks (context parallelism,
    the last field so that older positional calls keep their meaning) split every sequence, between pp and tp:
    global rank ((dp_i pp + pp_j) cp + cp_l) tp + tp_k, as Mesh(dp, pp, cp=..., tp=...) lays it out; place()
    names cp only when cp > 1, as a Mesh names its axes. `ep` ranks (expert parallelism, after cp) hold each
    their experts/ep of a GPTShape's experts and split the batch as dp does: global rank
    (((dp_i pp + pp_j) cp + cp_l) ep + ep_m) tp + tp_k, Mesh's order; place() names ep only when ep > 1. Two of
    Megatron-LM's
    optimisations that labkit.parallel.ThreeDGPT does not run can be planned: `scatter_gather` (pipeline sends
    of 1/tp of the activation per tp rank, all-gathered after; Narayanan et al. 2021, section 4.1) and
    `vocab_parallel_loss` (the head's logits kept split over tp, the loss from 3 all-reduces of b s FP32 numbers;
    Shoeybi et al. 2019, section 3). Both default to False, what ThreeDGPT runs.

    >>> layout = ParallelLayout(dp=2, pp=2, tp=2, microbatches=2)
    >>> layout.world_size, layout.place(5)
    (8, {'dp': 1, 'pp': 0, 'tp': 1})
    """
    dp: int = 1
    pp: int = 1
    tp: int = 1
    microbatches: int = 1
    chunks: int = 1
    sequence_parallel: bool = False
    zero_stage: int = 0
    scatter_gather: bool = False
    vocab_parallel_loss: bool = False
    cp: int = 1
    ep: int = 1

    def __post_init__(self):
        for name in ("dp", "pp", "tp", "microbatches", "chunks", "cp", "ep"):
            whole(name, getattr(self, name))
        for name in ("sequence_parallel", "scatter_gather", "vocab_parallel_loss"):
            flag(name, getattr(self, name))
        if whole("zero_stage", self.zero_stage, minimum=0) > 2:
            raise ValueError(f"zero_stage={shown(self.zero_stage)}: pass 0 (the optimizer state replicated), 1 (it "
                             "sharded over dp) or 2 (the gradients too); ZeRO-3 is not an option of this layout.")

    @property
    def world_size(self) -> int:
        """dp x pp x cp x ep x tp ranks."""
        return self.dp * self.pp * self.cp * self.ep * self.tp

    @property
    def axes(self) -> tuple[str, ...]:
        """The layout's axes, outermost first: dp, pp, tp, and cp and ep between pp and tp when larger than 1 (as a
        Mesh names them)."""
        return tuple(axis for axis in _AXES if axis not in ("cp", "ep") or self.size(axis) > 1)

    def size(self, axis: str) -> int:
        """How many ranks a group on `axis` ("dp", "pp", "cp", "ep" or "tp") holds."""
        return getattr(self, choice("axis", axis, _AXES))

    def place(self, rank: int) -> dict[str, int]:
        """Global rank `rank`'s coordinate on each axis."""
        refuse_while_graded("labkit.plan.ParallelLayout(...).place")
        rank = whole("rank", rank, minimum=0)
        if rank >= self.world_size:
            raise ValueError(f"rank={shown(rank)}: this layout has {self.world_size} ranks; pass 0 to "
                             f"{self.world_size - 1}.")
        rest, tp_k = divmod(rank, self.tp)
        rest, ep_m = divmod(rest, self.ep)
        rest, cp_l = divmod(rest, self.cp)
        dp_i, pp_j = divmod(rest, self.pp)
        place = {"dp": dp_i, "pp": pp_j, "cp": cp_l, "ep": ep_m, "tp": tp_k}
        return {axis: place[axis] for axis in self.axes}


def check_fit(shape: GPTShape, layout: ParallelLayout, batch: int | None = None, sequence: int | None = None) -> None:
    """ValueError, saying what to change, unless `layout` can split `shape` (and a step's `batch` of sequences of
    `sequence` tokens, when given): whole heads per tp rank (each computes whole heads), a vocabulary row per tp
    rank, a layer per pipeline piece, an untied head when the embedding and the head sit in different pieces,
    experts that ep divides (on dp x pp x ep), the batch cut evenly over dp x ep ranks and micro-batches, the
    sequence within the context and, under sequence parallelism, cut evenly over tp.

    >>> check_fit(GPTShape(vocab=82, d_model=32, layers=2, heads=4, context=32), ParallelLayout(tp=3))
    Traceback (most recent call last):
    ...
    ValueError: tp=3: 4 heads do not split over 3 tensor-parallel ranks (each computes whole heads); pass a tp ...
    """
    if not isinstance(shape, GPTShape):
        raise TypeError(f"shape={shown(shape)}: pass a labkit.plan.GPTShape(vocab, d_model, layers, heads, context).")
    if not isinstance(layout, ParallelLayout):
        raise TypeError(f"layout={shown(layout)}: pass a labkit.plan.ParallelLayout(dp, pp, tp, microbatches).")
    _check_model_fit(shape, layout)
    if batch is not None:
        _check_batch_fit(shape, layout, whole("batch", batch), _sequence(shape, sequence))


def _check_model_fit(shape: GPTShape, layout: ParallelLayout) -> None:
    t, pieces = layout.tp, layout.pp * layout.chunks
    if shape.heads % t:
        raise ValueError(f"tp={t}: {shape.heads} heads do not split over {t} tensor-parallel ranks (each computes "
                         f"whole heads); pass a tp that divides heads={shape.heads}.")
    if shape.vocab < t:
        raise ValueError(f"tp={t}: a vocabulary of {shape.vocab} cannot give each of {t} ranks a row; pass tp <= "
                         f"{shape.vocab}.")
    if shape.layers + 2 < pieces:
        raise ValueError(f"pp={layout.pp} x chunks={layout.chunks}: {pieces} pipeline pieces, but the model has "
                         f"{shape.layers + 2} layers (embeddings, {shape.layers} blocks, head), one per piece at "
                         "least; pass fewer stages or chunks, or a deeper model.")
    if shape.tied and pieces > 1:
        raise ValueError(f"pp={layout.pp} x chunks={layout.chunks}: a tied head shares the embedding's weight, but the "
                         "embedding and the head sit in different pipeline pieces (tying them would take an all-reduce "
                         "of the two copies' gradients between the first and last stage every step, on no axis of "
                         "the mesh); use an untied model (TinyGPT(..., tied=False)).")
    _check_experts_fit(shape, layout)


def _check_experts_fit(shape: GPTShape, layout: ParallelLayout) -> None:
    """ep needs experts, a whole number of them per ep rank, and a dp x pp x ep layout (module docstring)."""
    if layout.ep > 1 and not shape.experts:
        raise ValueError(f"ep={layout.ep}: expert parallelism splits a block's experts over ranks, but this model's "
                         "blocks are dense (experts=0); pass a GPTShape with experts, or ep=1.")
    if shape.experts % layout.ep:
        raise ValueError(f"ep={layout.ep}: {shape.experts} experts do not split over {layout.ep} ranks (each holds "
                         f"whole experts); pass an ep that divides experts={shape.experts}.")
    for axis in ("tp", "cp"):
        if shape.experts and layout.size(axis) > 1:
            raise ValueError(f"{axis}={layout.size(axis)} with experts={shape.experts}: labkit plans a mixture of "
                             "experts on dp x pp x ep, as ExpertParallelGPT runs it (experts split over tp, "
                             f"Megatron's expert tensor parallelism, and MoE with cp are not planned); pass {axis}=1.")
    if shape.experts and layout.zero_stage:
        raise ValueError(f"zero_stage={layout.zero_stage} with experts={shape.experts}: labkit plans a mixture of "
                         "experts with its state replicated over dp, as ExpertParallelGPT trains it (DeepSpeed-MoE "
                         "shards the dense part over dp x ep and the experts over dp, which is not planned); pass "
                         "zero_stage=0.")


def _check_batch_fit(shape: GPTShape, layout: ParallelLayout, batch: int, sequence: int) -> None:
    cut = layout.dp * layout.ep * layout.microbatches
    if batch % cut:
        ranks = f"dp={layout.dp} replicas" + (f" x ep={layout.ep}" if layout.ep > 1 else "")
        raise ValueError(f"batch={batch}: the batch is cut over {ranks} x microbatches="
                         f"{layout.microbatches}, {cut} equal parts; pass a batch that is a multiple of {cut}.")
    if layout.cp > 1:
        held_positions(sequence, layout.cp)  # ValueError unless every rank gets a token of each zig-zag chunk
        if layout.sequence_parallel:
            raise ValueError(f"cp={layout.cp} with sequence_parallel: both cut the sequence, and labkit plans cp "
                             "with plain tensor parallelism (ContextParallelGPT's); pass sequence_parallel=False.")
    if layout.sequence_parallel and sequence % layout.tp:
        raise ValueError(f"sequence={sequence}: sequence parallelism cuts each sequence over tp={layout.tp} ranks; "
                         f"pass a length that is a multiple of {layout.tp}.")


def _sequence(shape: GPTShape, sequence: int | None) -> int:
    """The tokens per sequence: `sequence`, at most the context; None: the whole context."""
    if sequence is None:
        return shape.context
    length = whole("sequence", sequence)
    if length > shape.context:
        raise ValueError(f"sequence={length}: the model has {shape.context} positions; pass at most that many.")
    return length


def rank_layers(shape: GPTShape, layout: ParallelLayout, rank: int) -> list[range]:
    """The model's layers global rank `rank` holds, one range per chunk (0: the embeddings, 1 to L the blocks,
    L + 1 the head): the layers + 2 cut into pp x chunks balanced pieces, stage j's chunk c being piece c pp + j
    (labkit.parallel.stage_layers' cut; Narayanan et al. 2021, section 2.2.2).

    >>> rank_layers(GPTShape(vocab=82, d_model=32, layers=2, heads=4, context=32), ParallelLayout(pp=2), rank=1)
    [range(2, 4)]
    """
    check_fit(shape, layout)
    sizes = shard_sizes(shape.layers + 2, layout.pp * layout.chunks)
    pieces = [range(end - size, end) for size, end in zip(sizes, itertools.accumulate(sizes), strict=True)]
    stage = layout.place(rank)["pp"]
    return [pieces[c * layout.pp + stage] for c in range(layout.chunks)]


def _kind(shape: GPTShape, layer: int) -> str:
    return "embeddings" if layer == 0 else "head" if layer == shape.layers + 1 else "block"


def _expert_params(shape: GPTShape) -> int:
    """One expert's parameters: the MLP's fc1 (d_ff x h and its bias) and fc2 (h x d_ff and its bias)."""
    return shape.d_ff * (shape.d_model + 1) + shape.d_model * shape.d_ff + shape.d_model


def _layer_params(shape: GPTShape, kind: str, t: int, k: int, ep: int = 1) -> tuple[int, int]:
    """(numbers, tensors) of one layer's parameters on tp rank k of t: split as labkit.parallel.tensor_gpt does; a
    MoE block's on an ep rank: its router and experts/ep experts (tp = 1 then, _check_experts_fit)."""
    h, vocab_rows, ff = shape.d_model, shard_sizes(shape.vocab, t)[k], shard_sizes(shape.d_ff, t)[k]
    if kind == "embeddings":
        return vocab_rows * h + shape.context * h, 2
    if kind == "head":
        return 2 * h + (0 if shape.tied else vocab_rows * h), 2 if shape.tied else 3
    attention = (3 * h // t) * (h + 1) + h * (h // t) + h  # q, k, v of this rank's heads; its columns of proj
    if shape.experts:  # the router (no bias), and experts/ep experts of 4 tensors each
        held = shape.experts // ep
        return 4 * h + attention + h * shape.experts + held * _expert_params(shape), 9 + 4 * held
    mlp = ff * (h + 1) + h * ff + h  # fc1's rows, fc2's columns, fc2's bias whole
    return 4 * h + attention + mlp, 12


def _rank_parts(shape: GPTShape, layout: ParallelLayout, rank: int) -> tuple[list[str], int, int]:
    """The kinds of the layers rank `rank` holds, and their parameters' (numbers, tensors)."""
    kinds = [_kind(shape, layer) for piece in rank_layers(shape, layout, rank) for layer in piece]
    k = layout.place(rank)["tp"]
    held = [_layer_params(shape, kind, layout.tp, k, layout.ep) for kind in kinds]
    return kinds, sum(n for n, _ in held), sum(c for _, c in held)


def rank_params(shape: GPTShape, layout: ParallelLayout, rank: int) -> int:
    """Parameters global rank `rank` holds: its stage's layers (rank_layers), each 1/tp of the split matrices
    (tp rank k's share of uneven ones, as shard_sizes cuts) and the whole replicated ones (LayerNorms, row-parallel
    biases, the position embedding; a MoE block's router, and its experts/ep experts).
    labkit.plan.training_memory(rank_params(...), ...) is its training state; on one rank, for a dense model,
    transformer_params(...) (with context) of the whole model.

    >>> shape = GPTShape(vocab=82, d_model=32, layers=2, heads=4, context=32)
    >>> rank_params(shape, ParallelLayout(), 0), [rank_params(shape, ParallelLayout(pp=2, tp=2), r) for r in range(4)]
    (31744, [8784, 8784, 7824, 7824])
    """
    return _rank_parts(shape, layout, rank)[1]


def _tp_per_microbatch(shape: GPTShape, kind: str, layout: ParallelLayout, b: int, s: int) -> Counter:
    """Numbers one layer hands to tp collectives per micro-batch of b sequences of s tokens (module docstring)."""
    t, whole_act = layout.tp, b * s * shape.d_model
    part = whole_act // t
    loss = Counter() if layout.vocab_parallel_loss else Counter({"all_gather": b * s * math.ceil(shape.vocab / t)})
    if not layout.sequence_parallel:
        layers = {"embeddings": {"all_reduce": whole_act}, "block": {"all_reduce": 4 * whole_act},
                  "head": {"all_reduce": whole_act}}
    else:
        layers = {"embeddings": {"reduce_scatter": whole_act, "all_gather": part},
                  "block": {"reduce_scatter": 4 * whole_act, "all_gather": 6 * part},
                  "head": {"reduce_scatter": whole_act, "all_gather": 2 * part}}
    return Counter(layers[kind]) + (loss if kind == "head" else Counter())


def _loss_numbers(layout: ParallelLayout, kinds, b: int, s: int) -> Counter:
    """Numbers the vocabulary-parallel loss hands to its tp all-reduces in one step, each LOSS_BYTES_PER_NUMBER
    bytes: 3 b s per micro-batch on a rank holding the head (module docstring)."""
    if layout.tp == 1 or not layout.vocab_parallel_loss or "head" not in kinds:
        return Counter()
    return Counter({"all_reduce": 3 * b * s * layout.microbatches})


def _sequence_sharded_numbers(shape: GPTShape, kind: str) -> int:
    """Parameters of a layer used on a sequence shard, whose gradients are all-reduced over tp once a step."""
    h = shape.d_model
    return {"embeddings": shape.context * h, "block": 6 * h, "head": 2 * h}[kind]


def _tp_numbers(shape, layout, kinds, b, s) -> Counter:
    """Numbers the rank hands to the tp axis's collectives in one step."""
    if layout.tp == 1:
        return Counter()
    numbers = Counter()
    for kind in kinds:
        numbers.update(_tp_per_microbatch(shape, kind, layout, b, s))
    numbers = Counter({collective: n * layout.microbatches for collective, n in numbers.items()})
    if layout.sequence_parallel:
        numbers["all_reduce"] += sum(_sequence_sharded_numbers(shape, kind) for kind in kinds)
    return numbers


def _dp_numbers(layout: ParallelLayout, params: int, tensors: int) -> Counter:
    """Numbers the rank hands to the dp axis's collectives in one step, for its `params` numbers in `tensors`
    tensors: BucketedDDP's all-reduce (with a flag per tensor), or ShardedOptimizer's one bucket, its
    reduce-scatter padded to dp equal slices and the all-gather of its own slice."""
    if layout.dp == 1:
        return Counter()
    if layout.zero_stage == 0:
        return Counter({"all_reduce": params + tensors})
    piece = -(-params // layout.dp)  # ceil(P / dp), exact for any whole number
    return Counter({"reduce_scatter": layout.dp * piece, "all_gather": piece})


def _pp_messages(layout: ParallelLayout, stage: int) -> int:
    """Messages a stage sends per micro-batch, and receives: each piece's output forward but the last piece's,
    each piece's input gradient back but the first's."""
    p, v = layout.pp, layout.chunks
    if p == 1:
        return 0
    pieces = [c * p + stage for c in range(v)]
    return sum(piece != p * v - 1 for piece in pieces) + sum(piece != 0 for piece in pieces)


def _split_activation(layout: ParallelLayout) -> bool:
    """Whether each tp rank sends only its 1/tp of a boundary activation (sequence parallelism, or scatter/gather)."""
    return layout.sequence_parallel or layout.scatter_gather


def _pp_numbers(shape, layout, stage: int, b: int, s: int) -> Counter:
    """Numbers the rank sends to its pipeline neighbours in one step (_pp_messages per micro-batch)."""
    activation = b * s * shape.d_model // (layout.tp if _split_activation(layout) else 1)
    sent = _pp_messages(layout, stage) * layout.microbatches * activation
    return Counter({"send": sent} if sent else {})


def _scatter_gather_numbers(shape, layout, stage: int, b: int, s: int) -> Counter:
    """The tp all-gathers that rebuild each received activation under scatter/gather: a / t from each rank."""
    if not layout.scatter_gather or layout.sequence_parallel or layout.tp == 1:
        return Counter()
    gathered = _pp_messages(layout, stage) * layout.microbatches * (b * s * shape.d_model // layout.tp)
    return Counter({"all_gather": gathered} if gathered else {})


def _cp_numbers(shape: GPTShape, layout: ParallelLayout, kinds, params: int, rank: int, b: int, s: int) -> Counter:
    """Numbers the rank hands to the cp axis in one step: its ring's sends, every block's attention forward and
    backward for every micro-batch, and the all-reduce of its gradients (module docstring)."""
    if layout.cp == 1:
        return Counter()
    cp_rank = layout.place(rank)["cp"]
    ring = context_parallel_nbytes(s, layout.cp, rows=1, head_dim=shape.d_model // shape.heads, bytes_per_element=1)
    rows = b * shape.heads // layout.tp  # the ring's bytes are linear in its rows: whole numbers, exact at any size
    per_attention = rows * (ring["forward"][cp_rank] + ring["backward"][cp_rank])
    blocks = sum(kind == "block" for kind in kinds)
    return Counter({"send": blocks * layout.microbatches * per_attention, "all_reduce": params})


def _ep_numbers(shape: GPTShape, layout: ParallelLayout, kinds, params: int, b: int, s: int) -> Counter:
    """Numbers the rank hands to the ep axis in one step: four all-to-alls of T k rows of h numbers per MoE block
    per micro-batch, and the all-reduce of the replicated parameters' gradients (module docstring). The routing
    counts, 8-byte integers whatever the numbers are, are _ep_count_bytes'."""
    if layout.ep == 1:
        return Counter()
    blocks = sum(kind == "block" for kind in kinds)
    experts_held = blocks * shape.experts // layout.ep * _expert_params(shape)
    rows = 4 * b * s * shape.top_k  # dispatch and combine, forward and backward
    return Counter({"all_to_all": blocks * layout.microbatches * rows * shape.d_model,
                    "all_reduce": params - experts_held})


def _ep_count_bytes(shape: GPTShape, layout: ParallelLayout, kinds) -> Counter:
    """Bytes of the routing counts' all-to-all in one step: E integers per MoE block per micro-batch (forward only:
    the counts carry no gradient)."""
    if layout.ep == 1:
        return Counter()
    blocks = sum(kind == "block" for kind in kinds)
    return Counter({"all_to_all_sizes": blocks * layout.microbatches * shape.experts * COUNT_BYTES})


def _tokens_held(layout: ParallelLayout, rank: int, s: int) -> int:
    """Tokens of each sequence the rank holds: all s, or its zig-zag share with cp > 1."""
    return s if layout.cp == 1 else held_positions(s, layout.cp)[layout.place(rank)["cp"]]


def axis_traffic(shape: GPTShape, layout: ParallelLayout, batch: int, rank: int, sequence: int | None = None,
                 bytes_per_number: int = 4) -> dict[str, dict[str, int]]:
    """Bytes global rank `rank` hands to each axis's collectives in one training step, by collective: {"dp":
    {"all_reduce": ...} (ZeRO: "reduce_scatter" and "all_gather"), "pp": {"send": ...}, "tp": {"all_reduce": ...,
    ...}} (a size-1 axis: {}), for a step of `batch` sequences of `sequence` tokens (None: the context) cut over
    dp replicas and micro-batches, numbers of `bytes_per_number` bytes (8: float64). The formulas, with their
    sources, are in the module's docstring; the convention is count_collectives()'s, so a run's
    CollectiveCounter.by_axis(mesh) equals this exactly (ep's all-to-alls: summed over each ep group, as routing
    decides what one rank's experts receive).

    >>> shape = GPTShape(vocab=82, d_model=32, layers=2, heads=4, context=32)
    >>> layout = ParallelLayout(dp=2, pp=2, tp=2, microbatches=2)
    >>> axis_traffic(shape, layout, batch=16, rank=0, bytes_per_number=8)      # stage 0: embeddings, block 1
    {'dp': {'all_reduce': 70384}, 'pp': {'send': 65536}, 'tp': {'all_reduce': 327680}}
    >>> axis_traffic(shape, layout, batch=16, rank=3, bytes_per_number=8)      # stage 1: block 2, head
    {'dp': {'all_reduce': 62712}, 'pp': {'send': 65536}, 'tp': {'all_gather': 83968, 'all_reduce': 327680}}
    >>> zero = ParallelLayout(dp=2, pp=2, tp=2, microbatches=2, zero_stage=1)     # 8784 numbers: 4392 each
    >>> axis_traffic(shape, zero, batch=16, rank=0, bytes_per_number=8)["dp"]
    {'all_gather': 35136, 'reduce_scatter': 70272}
    """
    check_fit(shape, layout, whole("batch", batch), sequence)
    s, nbytes = _sequence(shape, sequence), whole("bytes_per_number", bytes_per_number)
    b = batch // (layout.dp * layout.ep * layout.microbatches)
    kinds, params, tensors = _rank_parts(shape, layout, rank)
    stage, held = layout.place(rank)["pp"], _tokens_held(layout, rank, s)
    flags = 0 if shape.experts else tensors  # a MoE's gradients go by all_reduce_sum, without BucketedDDP's flags
    numbers = {"dp": _dp_numbers(layout, params, flags),
               "pp": _pp_numbers(shape, layout, stage, b, held),
               "cp": _cp_numbers(shape, layout, kinds, params, rank, b, s),
               "ep": _ep_numbers(shape, layout, kinds, params, b, s),
               "tp": _tp_numbers(shape, layout, kinds, b, held) + _scatter_gather_numbers(shape, layout, stage, b,
                                                                                        held)}
    in_bytes = {axis: Counter({kind: n * nbytes for kind, n in counted.items()}) for axis, counted in numbers.items()}
    loss = _loss_numbers(layout, kinds, b, held)                          # FP32 whatever bytes_per_number is
    in_bytes["tp"] += Counter({kind: n * LOSS_BYTES_PER_NUMBER for kind, n in loss.items()})
    in_bytes["ep"] += _ep_count_bytes(shape, layout, kinds)
    traffic = {axis: {kind: n for kind, n in sorted(counted.items()) if n} for axis, counted in in_bytes.items()
               if axis in layout.axes}
    return finite_result("axis_traffic", traffic, batch=batch, sequence=sequence, bytes_per_number=bytes_per_number)


def _wire_bytes(collective: str, nbytes: float, ranks: int) -> float:
    """Bytes a rank sends in a ring `collective` to which it hands `nbytes` (counters' convention)."""
    if collective == "all_reduce":
        return ring_allreduce_bytes(nbytes, ranks)
    if collective == "reduce_scatter":
        return ring_reduce_scatter_bytes(nbytes, ranks)
    if collective == "all_gather":  # its own part of ranks parts: (N-1)/N of the whole
        return ring_reduce_scatter_bytes(nbytes * ranks, ranks)
    if collective in ("all_to_all", "all_to_all_sizes"):  # pairwise, balanced: 1/N of what it hands stays here
        return ring_reduce_scatter_bytes(nbytes, ranks)
    return nbytes  # a send or a broadcast: the tensor, once


def axis_wire_bytes(traffic: dict[str, dict[str, float]], layout: ParallelLayout) -> dict[str, float]:
    """Bytes a rank sends over the links of each axis in one step, for `traffic` (axis_traffic's) with ring
    collectives of the axis's size (Thakur et al. 2005; labkit.plan.traffic): an all-reduce 2(N-1)/N of its
    tensor, a reduce-scatter (N-1)/N of its tensor, an all-gather N-1 times its part, a send its tensor, an
    all-to-all (N-1)/N of what it hands, the part for its own rank staying (balanced: moe_all_to_all_nbytes). Divided by
    a link's bandwidth (bytes/s), the seconds each axis's traffic takes there.

    >>> layout = ParallelLayout(dp=2, pp=2, tp=2, microbatches=2)
    >>> axis_wire_bytes({"dp": {"all_reduce": 1000}, "pp": {"send": 500}, "tp": {"all_gather": 300}}, layout)
    {'dp': 1000.0, 'pp': 500.0, 'tp': 300.0}
    """
    checked = _checked_traffic(traffic)
    if not isinstance(layout, ParallelLayout):
        raise TypeError(f"layout={shown(layout)}: pass a labkit.plan.ParallelLayout(dp, pp, tp, microbatches).")
    wire = {axis: float(sum(_wire_bytes(collective, nbytes, layout.size(axis))
                            for collective, nbytes in checked.get(axis, {}).items())) for axis in layout.axes}
    return finite_result("axis_wire_bytes", wire, traffic=traffic)


def _checked_traffic(traffic) -> dict[str, dict[str, float]]:
    """`traffic` as {axis: {collective: nbytes}}, once its axes, collectives and byte counts are ones it can hold."""
    wanted = "axis_traffic's dict, {axis: {collective: nbytes}}"
    if not isinstance(traffic, Mapping):
        raise TypeError(f"traffic={shown(traffic)}: pass {wanted}.")
    checked = {}
    for axis, kinds in traffic.items():
        if axis not in _AXES or not isinstance(kinds, Mapping):
            raise ValueError(f"traffic={shown(traffic)}: pass {wanted}, its axes among {', '.join(_AXES)}.")
        checked[axis] = {choice(f"traffic[{axis!r}] collective", collective, COLLECTIVES):
                         number(f"traffic[{axis!r}][{collective!r}]", nbytes) for collective, nbytes in kinds.items()}
    return checked

