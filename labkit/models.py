"""Tiny, seeded, offline models and data: each trains visibly in seconds on a laptop CPU.

    make_classification()   a synthetic classification set (Gaussian blobs), as (x, y) tensors
    mlp()                   an nn.Sequential MLP for it; Sequential, so a pipeline can cut it into stages
    lesson_text()           the lesson itself, the corpus of the character-level model
    TinyGPT                 a pre-LN character transformer whose parameter count is
                            labkit.plan.transformer_params(...) exactly
    char_batches()          (inputs, targets) windows of the text for next-character prediction
"""

from __future__ import annotations

from importlib.resources import files

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "TinyGPT", "char_batches", "lesson_text", "make_classification", "mlp"]


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


class Block(nn.Module):
    """Pre-LN transformer block: x + attention(LN(x)), then x + MLP(LN(x)) (GPT-2's layout)."""

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


class TinyGPT(nn.Module):
    """A character-level GPT: token and learned position embeddings, pre-LN blocks, final LayerNorm,
    and an output head tied to the token embedding (Press & Wolf 2017), so it adds no parameters."""

    def __init__(self, vocab: int, d_model: int = 64, layers: int = 2, heads: int = 4, d_ff: int | None = None,
                 context: int = 64):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model={d_model} must be a multiple of heads={heads}.")
        self.context = context
        self.tok, self.pos = nn.Embedding(vocab, d_model), nn.Embedding(context, d_model)
        self.blocks = nn.Sequential(*[Block(d_model, heads, d_ff or 4 * d_model) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight
        for embedding in (self.tok, self.pos):  # GPT-2's scale: N(0, 1) logits through a tied head start far off
            nn.init.normal_(embedding.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits of the next character at every position of `idx` (batch, length <= context)."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln_f(self.blocks(self.tok(idx) + self.pos(positions))))


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
