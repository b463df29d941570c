"""Tiny, seeded, offline models and data: each trains visibly in seconds on a laptop CPU.

    make_classification()   a synthetic classification set (Gaussian blobs), as (x, y) tensors
    mlp()                   an nn.Sequential MLP for it; Sequential, so a pipeline can cut it into stages
    lesson_text()           the lesson itself, the corpus of the character-level model
    TinyGPT                 a pre-LN character GPT as an nn.Sequential of layers (Embeddings, Block x L, Head),
                            so a pipeline can cut it; its parameter count is labkit.plan.transformer_params(...)
    next_token_loss()       its training loss: cross-entropy of the logits against the next characters
    char_batches()          (inputs, targets) windows of the text for next-character prediction
"""

from __future__ import annotations

from collections import OrderedDict
from importlib.resources import files

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "Embeddings", "Head", "TinyGPT", "char_batches", "lesson_text", "make_classification", "mlp",
           "next_token_loss"]


def make_classification(examples: int = 512, features: int = 16, classes: int = 4, seed: int = 0,
                        dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """`examples` points around `classes` random centres, and their labels. Same seed, same data."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, features, generator=generator, dtype=dtype) * 2
    y = torch.randint(classes, (examples,), generator=generator)
    x = centres[y] + torch.randn(examples, features, generator=generator, dtype=dtype)
    return x, y


def mlp(features: int = 16, hidden: int = 64, classes: int = 4, layers: int = 2, seed: int = 0,
        dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """Linear-ReLU blocks then a classifier: `layers` hidden layers of width `hidden`, seeded."""
    torch.manual_seed(seed)
    widths = [features] + [hidden] * layers
    blocks = [m for a, b in zip(widths[:-1], widths[1:], strict=True) for m in (nn.Linear(a, b), nn.ReLU())]
    return nn.Sequential(*blocks, nn.Linear(widths[-1], classes)).to(dtype)


def lesson_text() -> str:
    """The course's lesson text, shipped in the package (labkit/data/lesson.txt)."""
    return files("labkit").joinpath("data/lesson.txt").read_text(encoding="utf-8")


class Embeddings(nn.Module):
    """The GPT's first layer: token ids (batch, length) in, token embedding + learned position embedding
    (batch, length, d_model) out."""

    def __init__(self, vocab: int, d_model: int, context: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d_model), nn.Embedding(context, d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.shape[1] > self.pos.num_embeddings:
            raise ValueError(f"TinyGPT: sequences of {idx.shape[1]} tokens, but its context is "
                             f"{self.pos.num_embeddings}: pass at most that many.")
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Block(nn.Module):
    """Pre-LN transformer block: x + attention(LN(x)), then x + MLP(LN(x)) (GPT-2's layout). The fused `qkv`
    weight holds q, k and v one after the other, each head h in rows h*head_dim ... (h+1)*head_dim of its
    third."""

    def __init__(self, d_model: int, heads: int, d_ff: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """The GPT's last layer: final LayerNorm, then a linear map to the vocabulary's logits (no bias)."""

    def __init__(self, d_model: int, vocab: int):
        super().__init__()
        self.ln_f, self.linear = nn.LayerNorm(d_model), nn.Linear(d_model, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.ln_f(x))


class TinyGPT(nn.Sequential):
    """A character-level GPT as a stack of layers, each taking one tensor and returning one, so that a pipeline
    can cut it into stages: [Embeddings (token + position), Block x `layers`, Head (final LayerNorm + linear)];
    token ids (batch, length <= context) in, logits (batch, length, vocab) out; `embeddings`, `blocks` and `head`
    name the parts.

    `tied=True`: the head's weight is the token embedding's (Press & Wolf 2017), so it adds no parameters (the
    count is labkit.plan.transformer_params(...), tied_embeddings=tied). `tied=False` gives the head its own
    weight, as a pipeline needs when the embedding and the head live on different stages: tying across stages
    takes an extra all-reduce of the two copies' gradients between the first and the last stage every step
    (Megatron-LM's embedding group; Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
    GPU Clusters Using Megatron-LM").

    `seed`: the weights are drawn after torch.manual_seed(seed) in a torch.random.fork_rng block, so the same
    seed gives the same model and the caller's random stream is left as it was; None draws them from that
    stream as it stands. Embeddings (and an untied head) start at N(0, 0.02) as in GPT-2: N(0, 1) logits through
    a tied head start far off. `.double()` gives a float64 model, for checks to 1e-10.

    Example::

        >>> from labkit.models import TinyGPT, char_batches, lesson_text, next_token_loss
        >>> text = lesson_text()
        >>> model = TinyGPT(len(set(text)))                   # d_model 32, 2 blocks of 4 heads, context 32
        >>> [type(layer).__name__ for layer in model]
        ['Embeddings', 'Block', 'Block', 'Head']
        >>> inputs, targets = next(char_batches(text, batch=4, length=32, steps=1))
        >>> logits = model(inputs)
        >>> tuple(logits.shape), round(next_token_loss(logits, targets).item(), 2)   # chance: ln(82) = 4.41
        ((4, 32, 82), 4.46)
    """

    def __init__(self, vocab: int, d_model: int = 32, layers: int = 2, heads: int = 4, d_ff: int | None = None,
                 context: int = 32, tied: bool = True, seed: int | None = 0):
        if d_model % heads:
            raise ValueError(f"d_model={d_model} must be a multiple of heads={heads}.")
        with torch.random.fork_rng(devices=[], enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            super().__init__(Embeddings(vocab, d_model, context),
                             *[Block(d_model, heads, d_ff or 4 * d_model) for _ in range(layers)],
                             Head(d_model, vocab))
            self.context, self.tied = context, tied
            self._initialise(tied)

    def _initialise(self, tied: bool) -> None:
        """GPT-2's N(0, 0.02) for the embeddings (and an untied head); a tied head shares the token embedding."""
        embedding, head = self[0], self[-1]
        if tied:
            head.linear.weight = embedding.tok.weight
        for weight in (embedding.tok.weight, embedding.pos.weight, *([] if tied else [head.linear.weight])):
            nn.init.normal_(weight, std=0.02)

    def __getitem__(self, index):
        """One layer, or a plain nn.Sequential of a slice of them that keeps their names (a pipeline stage)."""
        if isinstance(index, slice):
            return nn.Sequential(OrderedDict(list(self._modules.items())[index]))
        return super().__getitem__(index)

    @property
    def embeddings(self) -> Embeddings:
        """The first layer: token and position embeddings."""
        return self[0]

    @property
    def blocks(self) -> nn.Sequential:
        """The transformer blocks, between the embeddings and the head."""
        return self[1:-1]

    @property
    def head(self) -> Head:
        """The last layer: final LayerNorm and the projection to the vocabulary."""
        return self[-1]


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of logits (batch, length, vocab) against the next characters (batch, length): the
    GPT's training loss, and a loss_fn run_pipeline can take."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def char_batches(text: str, batch: int, length: int, steps: int, seed: int = 0):
    """`steps` random (inputs, targets) windows of `length` characters, targets shifted by one; the
    vocabulary is the text's sorted characters. Yields LongTensors of shape (batch, length)."""
    vocab = sorted(set(text))
    data = torch.tensor([vocab.index(c) for c in text])
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(len(data) - length, (batch,), generator=generator)
        windows = torch.stack([data[s:s + length + 1] for s in starts.tolist()])
        yield windows[:, :-1], windows[:, 1:]
