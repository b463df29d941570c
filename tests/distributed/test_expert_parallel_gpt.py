"""MoEGPT trained by ExpertParallelGPT on a dp x ep mesh of real gloo ranks (2 x 2, 1 x 4, 1 x 2) equals one process
training it on the whole batch (each rank's tokens one capacity group): losses and parameters within 1e-10 in
float64; each expert's parameters updated on their one rank of each ep group; traffic by axis (all-to-alls on ep,
gradient sums on both)."""

import pytest
import torch
import torch.nn.functional as F

import labkit
from labkit.models import char_batches, lesson_text
from labkit.parallel import Mesh, count_collectives
from labkit.parallel.experts_gpt import ExpertParallelGPT, MoEGPT

pytestmark = pytest.mark.numerics  # compares floating-point results: make unit runs it again on other kernels

STEPS, BATCH, LENGTH, LR, AUX, TOLERANCE = 3, 4, 12, 0.3, 0.05, 1e-10
TEXT = lesson_text()


def model():
    return MoEGPT(len(set(TEXT)), d_model=8, layers=2, heads=2, experts=4, top_k=2, capacity_factor=1.0,
                  seed=3).double()


def batches():
    return list(char_batches(TEXT, batch=BATCH, length=LENGTH, steps=STEPS, seed=5))


def on_mesh(dp, ep):
    mesh = Mesh(dp=dp, ep=ep)
    gpt = model().to(labkit.device())
    trainer = ExpertParallelGPT(gpt, mesh, lr=LR, aux_weight=AUX)
    with count_collectives() as counted:
        losses = [trainer.train_step(x.to(labkit.device()), y.to(labkit.device())) for x, y in batches()]
    traffic = {axis: dict(t.calls) for axis, t in counted.by_axis(mesh).items() if isinstance(axis, str)}
    own = {id(p) for p in trainer.own_experts}
    params = {name: p.detach().cpu() for name, p in gpt.named_parameters() if ".experts." not in name or id(p) in own}
    return losses, params, traffic


def one_process(world):
    gpt, losses = model(), []
    for x, y in batches():
        gpt.zero_grad()
        logits, aux = gpt(x, groups=world)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) + AUX * aux
        loss.backward()
        with torch.no_grad():
            for p in gpt.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
        losses.append(loss.item())
    return losses, {name: p.detach() for name, p in gpt.named_parameters()}


@pytest.mark.parametrize("dp,ep", [(2, 2), (1, 4), (1, 2)])
def test_dp_x_ep_trains_as_one_process(dp, ep):
    per_rank = labkit.run(on_mesh, dp, ep, world_size=dp * ep)
    want_losses, want = one_process(dp * ep)
    experts_seen = set()
    for rank, (losses, params, traffic) in enumerate(per_rank):
        assert max(abs(a - b) for a, b in zip(losses, want_losses, strict=True)) < TOLERANCE, (rank, losses)
        for name, got in params.items():
            assert (got - want[name]).abs().max() < TOLERANCE, (rank, name)
        experts_seen |= {name.split(".experts.")[1].split(".")[0] for name in params if ".experts." in name}
        assert traffic["ep"]["all_to_all"] == STEPS * 2 * 2 * 2  # 2 layers x (dispatch, combine) x fwd and bwd
        assert traffic["dp"].get("all_reduce", 0) > 0 if dp > 1 else "dp" not in traffic or not traffic["dp"]
    assert experts_seen == {"0", "1", "2", "3"}  # every expert updated on its rank, none twice on an ep group
