"""Tensor parallelism for a whole GPT (Shoeybi et al. 2019, "Megatron-LM", section 3), each layer of
labkit.models.TinyGPT split over the ranks of one group, with sequence parallelism as an option (Korthikanti et al.
2022, section 4.2.2):

    tensor_parallel_gpt(model, group, sequence_parallel)   the same layers, split for this rank: an nn.Sequential
    VocabParallelEmbedding    token embedding split by vocabulary; position embedding replicated
    ParallelAttention         Q, K, V column-parallel by whole heads, causal attention on this rank's heads, the
                              output projection row-parallel
    ParallelBlock             LayerNorms replicated, ParallelAttention and the Megatron ParallelMLP
    ParallelHead              final LayerNorm replicated, the vocabulary projection column-parallel, logits gathered
    gather_full_parameters(model, group, grads)   the unsplit model's parameters (or gradients), for checks

The communication per micro-batch of b sequences of s tokens, width h, vocabulary V, t ranks, for each of L
blocks (Megatron's count per layer, two all-reduces forward and two backward: Shoeybi et al. 2019, figure 4):

    plain TP   forward   block: 2 all-reduce (b, s, h)      embedding: 1 all-reduce (b, s, h)
                                                            head: 1 all-gather of the logits, (b, s, V / t) each
               backward  block: 2 all-reduce (b, s, h)      head: 1 all-reduce (b, s, h); embedding: none
    with SP    forward   block: 2 all-gather (b, s/t, h) each, 2 reduce-scatter (b, s, h)
                         embedding: 1 reduce-scatter (b, s, h); head: 1 all-gather (b, s/t, h) + the logits'
               backward  block: 4 all-gather (b, s/t, h) (2 of them gather a layer's input again, which sequence
                         parallelism stores only in part), 2 reduce-scatter (b, s, h)
                         head: 1 all-gather + 1 reduce-scatter; embedding: 1 all-gather
               per step  1 all-reduce of the replicated parameters' gradients (allreduce_sequence_parallel_grads)

The logits are gathered, not fed to a vocabulary-parallel cross-entropy (Megatron's, section 3, which moves b s
numbers instead of b s V): the model then ends in ordinary logits, any loss function takes them, and for a
character vocabulary (V of about 80, h = 32) the gather is about as small as a block's all-reduce. A tied head
shares the embedding's shard: both cut the vocabulary with shard_sizes, so rank r holds the same rows of the one
matrix.
"""

from __future__ import annotations

import copy
import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from labkit import groups
from labkit.checks import flag
from labkit.models import Block, Embeddings, Head
from labkit.parallel.sequence import reduce_scatter_to_sequence_parallel, sequence_slice
from labkit.parallel.tensor import ColumnParallelLinear, ParallelMLP, RowParallelLinear, reduce_from_tensor_parallel
from labkit.plan.counts import shard_sizes

__all__ = ["FullPlace", "ParallelAttention", "ParallelBlock", "ParallelHead", "VocabParallelEmbedding",
           "gather_full_parameters", "model_description", "tensor_parallel_gpt"]


@dataclass(frozen=True)
class FullPlace:
    """Where a split layer's parameter sits in the unsplit layer: its `name` there and, if it is split, the
    dimension `dim` it was cut along and the `index` (full positions along it) this rank holds; None: replicated."""
    name: str
    dim: int | None = None
    index: torch.Tensor | None = None


def _held(part: slice) -> torch.Tensor:
    return torch.arange(part.start, part.stop)


def _column_places(layer: ColumnParallelLinear, name: str, rows: torch.Tensor | None = None) -> dict:
    rows = _held(layer.shard) if rows is None else rows
    places = {"weight": FullPlace(f"{name}.weight", 0, rows)}
    return places | ({"bias": FullPlace(f"{name}.bias", 0, rows)} if layer.bias is not None else {})


def _row_places(layer: RowParallelLinear, name: str) -> dict:
    places = {"weight": FullPlace(f"{name}.weight", 1, _held(layer.shard))}
    return places | ({"bias": FullPlace(f"{name}.bias")} if layer.bias is not None else {})


def _prefixed(prefix: str, places: dict) -> dict:
    return {f"{prefix}.{local}": place for local, place in places.items()}


class VocabParallelEmbedding(nn.Module):
    """Token embedding split by vocabulary: group rank r holds the rows `shard` (shard_sizes of the vocabulary,
    contiguous); a token outside them embeds to zeros here, so the all-reduce of the group's outputs (g) gives
    each token its one row (Shoeybi et al. 2019, section 3: the input embedding matrix split along the
    vocabulary). The position embedding is replicated and added after. Under sequence parallelism
    the all-reduce is a reduce-scatter along the sequence and each rank adds its positions' embeddings."""

    def __init__(self, embeddings: Embeddings, group=None, sequence_parallel: bool = False):
        super().__init__()
        vocab, size = embeddings.tok.num_embeddings, groups.group_size(group)
        if vocab < size:
            raise ValueError(f"VocabParallelEmbedding: a vocabulary of {vocab} cannot be split over {size} ranks; "
                             "use a tensor-parallel group of at most as many ranks as tokens.")
        sizes, rank = shard_sizes(vocab, size), groups.group_rank(group)
        self.shard = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
        self.weight = nn.Parameter(embeddings.tok.weight.detach()[self.shard].clone())
        self.pos = copy.deepcopy(embeddings.pos)
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The embeddings of token ids `idx` (batch, length) at `positions` (None: 0 .. length-1; a context-parallel
        rank passes its tokens' global positions, labkit.parallel.context_gpt)."""
        local = idx - self.shard.start
        outside = (local < 0) | (local >= len(self.weight))
        tokens = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0)
        if positions is not None and self.sequence_parallel:
            raise ValueError("VocabParallelEmbedding: positions are chosen by sequence parallelism; pass none.")
        positions = torch.arange(idx.shape[1], device=idx.device) if positions is None else positions
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel(tokens, self.group) + \
                self.pos(positions[sequence_slice(idx.shape[1], self.group)])
        return reduce_from_tensor_parallel(tokens, self.group) + self.pos(positions)

    def sequence_sharded_parameters(self) -> list[nn.Parameter]:
        """The position embedding, under sequence parallelism: each rank adds only its positions' rows."""
        return [self.pos.weight] if self.sequence_parallel else []

    def full_places(self) -> dict[str, FullPlace]:
        """Each parameter's place in labkit.models.Embeddings."""
        return {"weight": FullPlace("tok.weight", 0, _held(self.shard)), "pos.weight": FullPlace("pos.weight")}


def _head_rows(width: int, heads: int, parts: int, rank: int) -> torch.Tensor:
    """The rows of a fused [q; k; v] weight (3 x `width` rows, each third `heads` heads of width / heads rows) that
    group rank `rank` of `parts` needs for its heads: the same heads' rows of q, of k and of v. Not the rank's
    contiguous share of the rows, which would hand rank 0 of 2 all of q and half of k, and no v."""
    head_width, mine = width // heads, heads // parts
    heads_rows = torch.arange(rank * mine * head_width, (rank + 1) * mine * head_width)
    return torch.cat([third * width + heads_rows for third in range(3)])


class ParallelAttention(nn.Module):
    """Causal multi-head attention split by heads (Shoeybi et al. 2019, section 3 and figure 3b): this rank's
    `heads` heads' Q, K and V come out of a column-parallel layer (f before it: no communication forward), attend
    on this rank only, and a row-parallel output projection sums the heads' contributions (g after it: one
    all-reduce forward). The rank's rows of the fused qkv weight are `qkv_rows` (see _head_rows)."""

    def __init__(self, block: Block, group=None, sequence_parallel: bool = False):
        super().__init__()
        size, width = groups.group_size(group), block.qkv.in_features
        if block.heads % size:
            raise ValueError(f"tensor_parallel_gpt: {block.heads} heads cannot be split over a tensor-parallel group "
                             f"of {size} ranks: each rank computes whole heads, so pass a group whose size divides "
                             f"heads={block.heads} (or a model with a multiple of {size} heads).")
        self.heads = block.heads // size
        order = torch.cat([_head_rows(width, block.heads, size, r) for r in range(size)])
        grouped = skip_init(nn.Linear, width, 3 * width, dtype=block.qkv.weight.dtype, device=block.qkv.weight.device)
        with torch.no_grad():  # the fused layer with its rows grouped by rank: rank r's heads are its contiguous part
            grouped.weight.copy_(block.qkv.weight[order])
            grouped.bias.copy_(block.qkv.bias[order])
        self.qkv_rows = _head_rows(width, block.heads, size, groups.group_rank(group))
        self.qkv = ColumnParallelLinear.from_linear(grouped, False, group, sequence_parallel)
        self.proj = RowParallelLinear.from_linear(block.proj, True, group, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.qkv(x)  # (batch, whole sequence, 3 x this rank's heads' width)
        batch, length = y.shape[:2]
        q, k, v = y.view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(attended.transpose(1, 2).reshape(batch, length, -1))

    def full_places(self) -> dict[str, FullPlace]:
        """Each parameter's place in labkit.models.Block."""
        return _prefixed("qkv", _column_places(self.qkv, "qkv", self.qkv_rows)) | \
            _prefixed("proj", _row_places(self.proj, "proj"))


class ParallelBlock(nn.Module):
    """A pre-LN block split over the group: x + ParallelAttention(LN(x)), then x + ParallelMLP(LN(x)), the
    LayerNorms replicated. Forward 2 all-reduces, backward 2 (Shoeybi et al. 2019, section 3); under sequence
    parallelism the LayerNorms and residuals act on this rank's part of the sequence and each all-reduce becomes an
    all-gather before and a reduce-scatter after (Korthikanti et al. 2022, section 4.2.2)."""

    def __init__(self, block: Block, group=None, sequence_parallel: bool = False):
        super().__init__()
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        self.attention = ParallelAttention(block, group, sequence_parallel)
        fc1, activation, fc2 = block.mlp
        self.mlp = ParallelMLP.from_mlp(fc1, fc2, copy.deepcopy(activation), group, sequence_parallel)
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def sequence_sharded_parameters(self) -> list[nn.Parameter]:
        """The LayerNorms' weights and biases, under sequence parallelism."""
        return [*self.ln1.parameters(), *self.ln2.parameters()] if self.sequence_parallel else []

    def full_places(self) -> dict[str, FullPlace]:
        """Each parameter's place in labkit.models.Block."""
        norms = {f"{ln}.{p}": FullPlace(f"{ln}.{p}") for ln in ("ln1", "ln2") for p in ("weight", "bias")}
        fc1, fc2 = _column_places(self.mlp.fc1, "mlp.0"), _row_places(self.mlp.fc2, "mlp.2")
        mlp = _prefixed("fc1", fc1) | _prefixed("fc2", fc2)
        return norms | _prefixed("attention", self.attention.full_places()) | _prefixed("mlp", mlp)


class ParallelHead(nn.Module):
    """The final LayerNorm, replicated, then the projection to the vocabulary split by vocabulary (column-parallel,
    f before it), its logits all-gathered: every rank returns the whole (batch, length, vocab). Under sequence
    parallelism the LayerNorm runs on this rank's part of the sequence and the projection all-gathers it."""

    def __init__(self, head: Head, group=None, sequence_parallel: bool = False):
        super().__init__()
        self.ln_f = copy.deepcopy(head.ln_f)
        self.linear = ColumnParallelLinear.from_linear(head.linear, True, group, sequence_parallel)
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.ln_f(x))

    def sequence_sharded_parameters(self) -> list[nn.Parameter]:
        """The final LayerNorm's weight and bias, under sequence parallelism."""
        return list(self.ln_f.parameters()) if self.sequence_parallel else []

    def full_places(self) -> dict[str, FullPlace]:
        """Each parameter's place in labkit.models.Head."""
        return {"ln_f.weight": FullPlace("ln_f.weight"), "ln_f.bias": FullPlace("ln_f.bias"),
                "linear.weight": FullPlace("linear.weight", 0, _held(self.linear.shard))}


_SPLITS = {Embeddings: VocabParallelEmbedding, Block: ParallelBlock, Head: ParallelHead}


def model_description(model: nn.Sequential) -> str:
    """The layers' kinds and a digest of every parameter: equal on two ranks only for the same model."""
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return f"{[type(layer).__name__ for layer in model]}, weights sha256 {digest.hexdigest()[:12]}"


def _check_model(model, group) -> None:
    """TypeError unless `model` is a stack of labkit.models layers; ValueError on every rank of `group` unless its
    ranks passed the same one."""
    groups.require_member("tensor_parallel_gpt", group)
    if not isinstance(model, nn.Sequential) or not all(type(layer) in _SPLITS for layer in model):
        raise TypeError("tensor_parallel_gpt splits an nn.Sequential of labkit.models layers (Embeddings, Block, "
                        f"Head), such as a TinyGPT or a slice of one; got {type(model).__name__}.")
    groups.check_same(model_description(model), "tensor_parallel_gpt", "models",
                      "Build the full model from the same seed on every rank (TinyGPT(..., seed=0)).", group)


def tensor_parallel_gpt(model: nn.Sequential, group=None, sequence_parallel: bool = False) -> nn.Sequential:
    """This rank's share of `model` (a labkit.models.TinyGPT, or a slice of its layers) split over `group` (None:
    the world): the same layers under the same names, each split as its class says; copies, the full model is left
    as it is. Every rank of the group passes the same full model. A tied head shares the embedding's shard.

    With `sequence_parallel` the layers between the embedding and the head pass (batch, length / t, d_model)
    activations (length a multiple of the group's size t); call allreduce_sequence_parallel_grads(model, group)
    once per step after the backward. On a group of one rank the split model is the model.

    Example: 2 ranks compute the logits one process does, each holding half of every block::

        >>> import labkit, torch
        >>> from labkit.models import TinyGPT
        >>> from labkit.parallel import tensor_parallel_gpt
        >>> def check(sequence_parallel):
        ...     model = TinyGPT(vocab=20).double()
        ...     split = tensor_parallel_gpt(model, sequence_parallel=sequence_parallel)
        ...     idx = torch.randint(20, (2, 8), generator=torch.Generator().manual_seed(0))
        ...     return split[1].attention.heads, torch.allclose(split(idx), model(idx), rtol=0, atol=1e-12)
        >>> labkit.run(check, False, world_size=2), labkit.run(check, True, world_size=2)
        ([(2, True), (2, True)], [(2, True), (2, True)])
    """
    _check_model(model, group)
    sequence_parallel = flag("sequence_parallel", sequence_parallel)
    split = nn.Sequential(OrderedDict((name, _SPLITS[type(layer)](layer, group, sequence_parallel))
                                      for name, layer in model.named_children()))
    first, last = model[0], model[-1]
    if isinstance(first, Embeddings) and isinstance(last, Head) and last.linear.weight is first.tok.weight:
        split[-1].linear.weight = split[0].weight  # the same rows of the same matrix: shard_sizes of the vocabulary
    return split


def _sharded_parts(model: nn.Sequential, grads: bool) -> tuple[dict, dict]:
    """This rank's parameters (or gradients) by the unsplit model's names: the replicated ones, and the split ones
    with their places."""
    places = {f"{name}.{local}": FullPlace(f"{name}.{place.name}", place.dim, place.index)
              for name, layer in model.named_children() for local, place in layer.full_places().items()}
    whole, parts = {}, {}
    for name, parameter in model.named_parameters():
        tensor = parameter.grad if grads else parameter
        if tensor is not None:
            place, tensor = places[name], tensor.detach().cpu().clone()
            if place.dim is None:
                whole[place.name] = tensor
            else:
                parts[place.name] = (place.dim, place.index, tensor)
    return whole, parts


def gather_full_parameters(model: nn.Sequential, group=None, grads: bool = False) -> dict[str, torch.Tensor]:
    """The unsplit model's parameters (or, with `grads`, their gradients), keyed by its parameter names, put
    together on every rank of `group` from a model `tensor_parallel_gpt` split over it: a check, not a training
    step (one all_gather_object, not counted as the model's traffic), on the CPU.

        >>> import labkit, torch
        >>> from labkit.models import TinyGPT
        >>> from labkit.parallel import gather_full_parameters, tensor_parallel_gpt
        >>> def check():
        ...     model = TinyGPT(vocab=21, layers=1)          # 21 tokens over 4 ranks: 6, 5, 5, 5
        ...     full = gather_full_parameters(tensor_parallel_gpt(model))
        ...     return all(torch.equal(full[n], p) for n, p in model.named_parameters()), len(full)
        >>> labkit.run(check, world_size=4)[0]
        (True, 16)
    """
    groups.require_member("gather_full_parameters", group)
    whole, parts = _sharded_parts(model, flag("grads", grads))
    everyone = groups.gather_objects(parts, group)
    for name, (dim, _, mine) in parts.items():
        pieces = [theirs[name] for theirs in everyone]
        full_shape = list(mine.shape)
        full_shape[dim] = sum(len(index) for _, index, _ in pieces)
        full = mine.new_empty(full_shape)
        for _, index, tensor in pieces:
            full.index_copy_(dim, index, tensor)
        whole[name] = full
    return whole
