"""The tiny models: seeded, the parameter count labkit.plan predicts, and they learn in a few steps."""

import pytest
import torch
from torch.nn.functional import cross_entropy

from labkit.models import TinyGPT, char_batches, lesson_text, make_classification, mlp
from labkit.plan import transformer_params


@pytest.mark.parametrize("d_model,layers,heads,d_ff,context", [(32, 1, 2, 64, 16), (64, 3, 4, 256, 40)])
def test_tiny_gpt_has_the_formula_s_parameter_count(d_model, layers, heads, d_ff, context):
    with torch.device("meta"):
        model = TinyGPT(50, d_model, layers, heads, d_ff, context)
    counted = sum(p.numel() for p in model.parameters())
    assert counted == transformer_params(50, d_model, layers, d_ff, context=context)
    assert model.head.weight is model.tok.weight


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
    torch.manual_seed(0)
    model = TinyGPT(len(set(text)), d_model=32, layers=1, heads=2, context=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for inputs, targets in char_batches(text, batch=8, length=32, steps=40):
        loss = cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < losses[0] - 0.8


def test_tiny_gpt_rejects_heads_that_do_not_divide_the_width():
    with pytest.raises(ValueError, match="multiple of heads"):
        TinyGPT(10, d_model=30, heads=4)
