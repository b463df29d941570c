"""The tiny models: seeded, the parameter count labkit.plan predicts, a GPT made of layers a pipeline can cut,
and they learn in a few steps."""

import pytest
import torch
from torch import nn
from torch.nn.functional import cross_entropy

from labkit.models import (
    Block,
    Embeddings,
    Head,
    TinyGPT,
    char_batches,
    lesson_text,
    make_classification,
    mlp,
    next_token_loss,
)
from labkit.plan import transformer_params

pytestmark = pytest.mark.numerics  # compares floating-point results: make unit runs it again on other kernels


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("d_model,layers,heads,d_ff,context", [(32, 1, 2, 64, 16), (64, 3, 4, 256, 40)])
def test_tiny_gpt_has_the_formula_s_parameter_count(d_model, layers, heads, d_ff, context, tied):
    with torch.device("meta"):
        model = TinyGPT(50, d_model, layers, heads, d_ff, context, tied=tied)
    counted = sum(p.numel() for p in model.parameters())
    assert counted == transformer_params(50, d_model, layers, d_ff, context=context, tied_embeddings=tied)
    assert (model.head.linear.weight is model.embeddings.tok.weight) == tied


def test_tiny_gpt_is_a_stack_of_one_tensor_layers_a_pipeline_can_cut():
    model = TinyGPT(20, layers=3, tied=False)
    assert [type(layer) for layer in model] == [Embeddings, Block, Block, Block, Head]
    idx = torch.randint(20, (2, 8), generator=torch.Generator().manual_seed(0))
    x = idx
    for layer in model:  # one tensor in, one out, each layer
        x = layer(x)
    assert x.shape == (2, 8, 20) and torch.equal(x, model(idx))  # the same calls in the same order: the same bits
    stage = model[1:3]  # a slice is a plain nn.Sequential that keeps the layers' names, as run_pipeline cuts it
    assert type(stage) is nn.Sequential and list(dict(stage.named_children())) == ["1", "2"]
    assert [type(b) for b in model.blocks] == [Block] * 3
    assert torch.equal(model[3:](model[:3](idx)), model(idx))


def test_tiny_gpt_is_seeded_without_touching_the_callers_random_stream():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    first, second, other = TinyGPT(20, seed=1), TinyGPT(20, seed=1), TinyGPT(20, seed=2)
    assert torch.equal(torch.rand(1), before)
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters(), strict=True))
    assert not torch.equal(first[0].tok.weight, other[0].tok.weight)
    torch.manual_seed(5)
    unseeded = TinyGPT(20, seed=None)
    torch.manual_seed(5)
    assert torch.equal(unseeded[1].qkv.weight, TinyGPT(20, seed=None)[1].qkv.weight)  # the caller's stream


def test_tiny_gpt_runs_in_float64_and_refuses_sequences_past_its_context():
    model = TinyGPT(20, context=8).double()
    assert model(torch.zeros(1, 8, dtype=torch.long)).dtype == torch.float64
    with pytest.raises(ValueError, match="sequences of 9 tokens, but its context is 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_same_seed_same_data_and_model():
    assert all(torch.equal(a, b) for a, b in zip(make_classification(seed=3), make_classification(seed=3), strict=True))
    assert not torch.equal(make_classification(seed=3)[0], make_classification(seed=4)[0])
    assert all(torch.equal(a, b) for a, b in zip(mlp(seed=1).parameters(), mlp(seed=1).parameters(), strict=True))


def test_mlp_learns_the_blobs():
    x, y = make_classification()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first = cross_entropy(model(x), y).item()
    for _ in range(30):
        optimizer.zero_grad()
        cross_entropy(model(x), y).backward()
        optimizer.step()
    assert cross_entropy(model(x), y).item() < first / 3


def test_tiny_gpt_learns_the_lesson_text():
    text = lesson_text()
    assert "AllReduce" in text
    model = TinyGPT(len(set(text)), d_model=32, layers=1, heads=2, context=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for inputs, targets in char_batches(text, batch=8, length=32, steps=40):
        loss = next_token_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < losses[0] - 0.8


def test_tiny_gpt_rejects_heads_that_do_not_divide_the_width():
    with pytest.raises(ValueError, match="multiple of heads"):
        TinyGPT(10, d_model=30, heads=4)
