"""ContextParallelGPT and Mesh(cp=...) on real gloo ranks: a TinyGPT trained on dp x cp = 2 x 2 and 1 x 4 (and
1 x 3, a length no cp divides into equal chunks), and with tp on dp x cp x tp = 1 x 2 x 2 and 2 x 2 x 2, equals one
process trained on the whole batch, losses and parameters within 1e-10 in float64; each axis's traffic counted where
it went (the ring's sends and gradient sums on cp, gradient sums on dp, the split layers' all-reduces on tp)."""

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


def on_mesh(dp, cp, length, tp=1):
    mesh = Mesh(dp=dp, cp=cp, tp=tp)
    gpt = model().to(labkit.device())
    trainer = ContextParallelGPT(gpt, mesh, lr=LR)
    with count_collectives() as counted:
        losses = [trainer.train_step(x.to(labkit.device()), y.to(labkit.device())) for x, y in batches(length)]
    traffic = {axis: dict(t.calls) for axis, t in counted.by_axis(mesh).items() if isinstance(axis, str)}
    return losses, trainer.full_parameters(), mesh.coordinate, traffic, len(list(trainer.layers.parameters()))


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
    return losses, {name: p.detach() for name, p in gpt.named_parameters()}


@pytest.mark.parametrize("dp,cp,tp,length", [(2, 2, 1, 30), (1, 4, 1, 30), (1, 3, 1, 29), (1, 2, 2, 29),
                                             (2, 2, 2, 30)])
def test_dp_x_cp_x_tp_trains_as_one_process(dp, cp, tp, length):
    per_rank = labkit.run(on_mesh, dp, cp, length, tp, world_size=dp * cp * tp)
    want_losses, want_params = one_process(length)
    for rank, (losses, params, coordinate, traffic, local) in enumerate(per_rank):
        assert max(abs(a - b) for a, b in zip(losses, want_losses, strict=True)) < TOLERANCE, (rank, losses)
        assert set(params) == set(want_params)
        gap = max((params[name] - want).abs().max().item() for name, want in want_params.items())
        assert gap < TOLERANCE, (rank, coordinate, gap)
        assert set(coordinate) == {"dp", "pp", "cp", "tp"}
        assert traffic["cp"]["send"] > 0 and traffic["cp"]["all_reduce"] == STEPS * local
        assert traffic["dp"].get("all_reduce", 0) == (STEPS * local if dp > 1 else 0)
        assert (traffic["tp"].get("all_reduce", 0) > 0) == (tp > 1)   # the split layers' f and g
    ranks_of = {(c["dp"], c["cp"], c["tp"]): rank for rank, (_, _, c, _, _) in enumerate(per_rank)}
    assert ranks_of == {(d, c, t): (d * cp + c) * tp + t for d in range(dp) for c in range(cp) for t in range(tp)}


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


def counted_bytes(dp, cp, tp, length):
    """Each axis's bytes this rank handed to collectives over the training, and the parameter tensors it holds."""
    mesh = Mesh(dp=dp, cp=cp, tp=tp)
    trainer = ContextParallelGPT(model().to(labkit.device()), mesh, lr=LR)
    with count_collectives() as counted:
        for x, y in batches(length):
            trainer.train_step(x.to(labkit.device()), y.to(labkit.device()))
    by_axis = counted.by_axis(mesh)
    return {axis: dict(by_axis[axis].nbytes) for axis in ("dp", "cp", "tp")}, len(list(trainer.layers.parameters()))


@pytest.mark.parametrize("dp,cp,tp,length", [(1, 2, 2, 29), (2, 2, 1, 30), (1, 3, 1, 23)])
def test_plan_predicts_every_axis_bytes_of_a_context_parallel_run(dp, cp, tp, length):
    """labkit.plan.axis_traffic with cp equals what each rank handed to cp's and tp's collectives, to the byte
    (the ring's sends for every block, forward and backward, the gradients' all-reduce over cp, tp's on the tokens
    the rank holds); dp's too, but for BucketedDDP's one flag per parameter tensor, which the plan counts and
    ContextParallelGPT's plain all_reduce_sum of each gradient does not send."""
    from labkit.parallel.three_d import gpt_shape
    from labkit.plan import ParallelLayout, axis_traffic

    layout = ParallelLayout(dp=dp, tp=tp, cp=cp, microbatches=1)
    for rank, (counted, tensors) in enumerate(labkit.run(counted_bytes, dp, cp, tp, length, world_size=dp * cp * tp)):
        planned = axis_traffic(gpt_shape(model()), layout, BATCH, rank, length, bytes_per_number=8)
        assert counted["cp"] == {kind: STEPS * n for kind, n in planned["cp"].items()}, rank
        assert counted["tp"] == {kind: STEPS * n for kind, n in planned["tp"].items()}, rank
        flags = {"all_reduce": 8 * tensors} if dp > 1 else {}
        assert counted["dp"] == {kind: STEPS * (n - flags.get(kind, 0)) for kind, n in planned["dp"].items()}, rank
