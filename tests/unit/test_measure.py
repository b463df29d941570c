"""Measured training-state bytes equal labkit.plan.training_memory's prediction."""

import torch

from labkit.measure import training_state_nbytes
from labkit.plan import training_memory


def test_adam_in_float32_holds_16_bytes_per_parameter():
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 3))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 10)).sum().backward()
    optimizer.step()
    params = sum(p.numel() for p in model.parameters())
    measured = training_state_nbytes(model, optimizer)
    assert {k: measured[k] for k in ("weights", "grads", "optimizer", "total")} == \
        training_memory(params, weight_bytes=4, grad_bytes=4, optimizer_bytes=8)
    assert measured["counters"] == 4 * 4  # one float32 step counter per parameter tensor


def test_master_copies_count_as_optimizer_state_and_tied_weights_once():
    embedding = torch.nn.Embedding(7, 5)
    head = torch.nn.Linear(5, 7, bias=False)
    head.weight = embedding.weight
    model = torch.nn.ModuleList([embedding, head]).to(torch.bfloat16)
    masters = [p.detach().float() for p in model.parameters()]
    optimizer = torch.optim.SGD(masters, lr=0.1)
    measured = training_state_nbytes(model, optimizer, masters)
    assert measured == {"weights": 35 * 2, "grads": 0, "optimizer": 35 * 4, "counters": 0, "total": 35 * 6}
