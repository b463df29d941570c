"""ContextParallelGPT and Mesh(cp=...) on real gloo ranks: a TinyGPT trained on dp x cp = 2 x 2 and 1 x 4 (and
1 x 3, a length no cp divides into equal chunks) equals one process trained on the whole batch, losses and
parameters within 1e-10 in float64; each axis's traffic counted where it went (the ring's sends and gradient sums on
cp, gradient sums on dp)."""

import pytest
import torch

import labkit
from labkit.models import TinyGPT, char_batches, lesson_text, next_token_loss
from labkit.parallel import Mesh, count_collectives
from labkit.parallel.context_gpt import ContextParallelGPT

pytestmark = pytest.mark.numerics  # compares floating-point results: make unit runs it again on other kernels

STEPS, BATCH, LR, TOLERANCE = 3, 4, 0.3, 1e-10
TEXT = lesson_text()


def model():
    return TinyGPT(len(set(TEXT)), d_model=16, layers=2, heads=2, context=32, seed=3).double()


def batches(length):
    return list(char_batches(TEXT, batch=BATCH, length=length, steps=STEPS, seed=5))


def on_mesh(dp, cp, length):
    mesh = Mesh(dp=dp, cp=cp)
    gpt = model().to(labkit.device())
    trainer = ContextParallelGPT(gpt, mesh, lr=LR)
    with count_collectives() as counted:
        losses = [trainer.train_step(x.to(labkit.device()), y.to(labkit.device())) for x, y in batches(length)]
    traffic = {axis: dict(t.calls) for axis, t in counted.by_axis(mesh).items() if isinstance(axis, str)}
    return losses, [p.detach().cpu() for p in gpt.parameters()], mesh.coordinate, traffic


def one_process(length):
    gpt, losses = model(), []
    for x, y in batches(length):
        gpt.zero_grad()
        loss = next_token_loss(gpt(x), y)
        loss.backward()
        with torch.no_grad():
            for p in gpt.parameters():
                p -= LR * p.grad
        losses.append(loss.item())
    return losses, [p.detach() for p in gpt.parameters()]


@pytest.mark.parametrize("dp,cp,length", [(2, 2, 30), (1, 4, 30), (1, 3, 29)])
def test_dp_x_cp_trains_as_one_process(dp, cp, length):
    per_rank = labkit.run(on_mesh, dp, cp, length, world_size=dp * cp)
    want_losses, want_params = one_process(length)
    for rank, (losses, params, coordinate, traffic) in enumerate(per_rank):
        assert max(abs(a - b) for a, b in zip(losses, want_losses, strict=True)) < TOLERANCE, (rank, losses)
        gap = max((a - b).abs().max().item() for a, b in zip(params, want_params, strict=True))
        assert gap < TOLERANCE, (rank, coordinate, gap)
        assert set(coordinate) == {"dp", "pp", "cp", "tp"}
        assert traffic["cp"]["send"] > 0 and traffic["cp"]["all_reduce"] == STEPS * len(params)
        assert traffic["dp"].get("all_reduce", 0) == (STEPS * len(params) if dp > 1 else 0)
    ranks_of = {(c["dp"], c["cp"]): rank for rank, (_, _, c, _) in enumerate(per_rank)}
    assert ranks_of == {(d, c): d * cp + c for d in range(dp) for c in range(cp)}  # cp inside dp, tp innermost


def mesh_without_cp():
    mesh = Mesh(tp=2)
    return mesh.axes, mesh.size("cp"), mesh.coordinate


def test_a_mesh_without_cp_is_the_3d_one():
    assert labkit.run(mesh_without_cp, world_size=2)[1] == (("dp", "pp", "tp"), 1, {"dp": 0, "pp": 0, "tp": 1})


def wrong_cp():
    return Mesh(cp=3)


def test_a_cp_that_does_not_divide_the_world_is_refused():
    with pytest.raises(labkit.RankError, match="cp=3 x ep=1 does not divide the world of 4 ranks"):
        labkit.run(wrong_cp, world_size=4)
