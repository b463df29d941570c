"""MoEGPT trained by ExpertParallelGPT on a dp x ep mesh of real gloo ranks (2 x 2, 1 x 4, 1 x 2) equals one process
training it on the whole batch (each rank's tokens one capacity group): losses and parameters within 1e-10 in
float64; each expert's parameters updated on their one rank of each ep group; traffic by axis (all-to-alls on ep,
gradient sums on both), and labkit.plan's prediction of it (ParallelLayout(ep=...))."""

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


def batches(batch=BATCH):
    return list(char_batches(TEXT, batch=batch, length=LENGTH, steps=STEPS, seed=5))


def on_mesh(dp, ep, batch=BATCH):
    mesh = Mesh(dp=dp, ep=ep)
    gpt = model().to(labkit.device())
    trainer = ExpertParallelGPT(gpt, mesh, lr=LR, aux_weight=AUX)
    with count_collectives() as counted:
        losses = [trainer.train_step(x.to(labkit.device()), y.to(labkit.device())) for x, y in batches(batch)]
    traffic = {axis: dict(t.calls) for axis, t in counted.by_axis(mesh).items() if isinstance(axis, str)}
    own = {id(p) for p in trainer.own_experts}
    params = {name: p.detach().cpu() for name, p in gpt.named_parameters() if ".experts." not in name or id(p) in own}
    return losses, params, traffic


def one_process(world, batch=BATCH):
    gpt, losses = model(), []
    for x, y in batches(batch):
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


@pytest.mark.parametrize("dp,ep,batch", [(2, 2, BATCH), (1, 4, BATCH), (1, 2, BATCH), (3, 1, 6)])
def test_dp_x_ep_trains_as_one_process(dp, ep, batch):
    """(3, 1): 4 experts on 3 data-parallel ranks, each rank holding every expert (an ep group of one rank)."""
    per_rank = labkit.run(on_mesh, dp, ep, batch, world_size=dp * ep)
    want_losses, want = one_process(dp * ep, batch)
    experts_seen = set()
    for rank, (losses, params, traffic) in enumerate(per_rank):
        assert max(abs(a - b) for a, b in zip(losses, want_losses, strict=True)) < TOLERANCE, (rank, losses)
        for name, got in params.items():
            assert (got - want[name]).abs().max() < TOLERANCE, (rank, name)
        experts_seen |= {name.split(".experts.")[1].split(".")[0] for name in params if ".experts." in name}
        if ep > 1:
            assert traffic["ep"]["all_to_all"] == STEPS * 2 * 2 * 2  # 2 layers x (dispatch, combine) x fwd and bwd
        assert traffic["dp"].get("all_reduce", 0) > 0 if dp > 1 else "dp" not in traffic or not traffic["dp"]
    assert experts_seen == {"0", "1", "2", "3"}  # every expert updated on its rank, none twice on an ep group


def counted_bytes(dp, ep, capacity_factor):
    """Each axis's bytes this rank handed to collectives over the training."""
    mesh = Mesh(dp=dp, ep=ep)
    gpt = MoEGPT(len(set(TEXT)), d_model=8, layers=2, heads=2, experts=4, top_k=2, capacity_factor=capacity_factor,
                 seed=3).double().to(labkit.device())
    trainer = ExpertParallelGPT(gpt, mesh, lr=LR, aux_weight=AUX)
    with count_collectives() as counted:
        for x, y in batches():
            trainer.train_step(x.to(labkit.device()), y.to(labkit.device()))
    by_axis = counted.by_axis(mesh)
    return {axis: dict(by_axis[axis].nbytes) for axis in ("dp", "ep")}


@pytest.mark.parametrize("dp,ep", [(2, 2), (1, 4)])
def test_plan_predicts_the_ep_axis_of_an_expert_parallel_run(dp, ep):
    """labkit.plan.axis_traffic with ep equals what ExpertParallelGPT's ranks handed to ep's collectives: the routing
    counts and the replicated gradients' all-reduce to the byte on every rank; the four all-to-alls of rows to the
    byte summed over each ep group (each rank's combine hands what its experts received, which routing decides),
    with a capacity factor of E/k = 2 so that no choice is dropped, each rank's more than its dispatch's half; dp's
    all-reduce to the byte (a MoE's, without BucketedDDP's flags: ExpertParallelGPT sums by all_reduce_sum)."""
    from labkit.parallel.experts_gpt import moe_gpt_shape
    from labkit.plan import ParallelLayout, axis_traffic

    layout = ParallelLayout(dp=dp, ep=ep)
    shape = moe_gpt_shape(MoEGPT(len(set(TEXT)), d_model=8, layers=2, heads=2, experts=4, top_k=2))
    per_rank = labkit.run(counted_bytes, dp, ep, 2.0, world_size=dp * ep)
    planned = [axis_traffic(shape, layout, BATCH, rank, LENGTH, bytes_per_number=8) for rank in range(dp * ep)]
    for rank, (counted, plan) in enumerate(zip(per_rank, planned, strict=True)):
        for kind in ("all_to_all_sizes", "all_reduce"):
            assert counted["ep"][kind] == STEPS * plan["ep"][kind], (rank, kind)
        dispatch = STEPS * plan["ep"]["all_to_all"] // 2  # the dispatch and its gradient: this rank's T k rows each
        assert dispatch < counted["ep"]["all_to_all"], rank
        if dp > 1:
            assert counted["dp"] == {"all_reduce": STEPS * plan["dp"]["all_reduce"]}, rank
    for first in range(0, dp * ep, ep):  # each ep group: every row one rank sends, another receives
        group = range(first, first + ep)
        assert sum(per_rank[r]["ep"]["all_to_all"] for r in group) == \
            STEPS * sum(planned[r]["ep"]["all_to_all"] for r in group)
