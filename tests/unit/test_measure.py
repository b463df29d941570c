"""Measured training-state bytes equal labkit.plan.training_memory's prediction; the AllReduce sweep's rounds."""

import torch

import labkit
from labkit.measure import allreduce_sweep, training_state_nbytes
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


def test_allreduce_sweep_takes_turns_one_round_per_run_and_keeps_the_median(monkeypatch):
    """labkit.run is replaced by a fake that hands out each round's seconds: no ranks needed."""
    rounds = {"a": iter([[3.0, 30.0], [1.0, 10.0], [2.0, 20.0]]), "b": iter([[5.0, 7.0], [4.0, 9.0], [6.0, 8.0]])}
    calls = []

    def fake_run(fn, sizes, allreduce, repeats, warm_up, world_size, timeout):
        calls.append((allreduce, repeats, warm_up))
        return [next(rounds[allreduce])] * world_size

    monkeypatch.setattr(labkit, "run", fake_run)
    measured = allreduce_sweep([4, 40], {"torch": "a", "ring": "b"}, world_size=2)
    assert measured == {"torch": [2.0, 20.0], "ring": [5.0, 8.0]}             # per size, the median of 3 rounds
    assert [name for name, _, _ in calls] == ["a", "b"] * 3                    # the two take turns
    assert [warm for _, _, warm in calls] == [True, True] + [False] * 4        # only the first round warms up
    assert {repeats for _, repeats, _ in calls} == {1}                         # one timed round per run
