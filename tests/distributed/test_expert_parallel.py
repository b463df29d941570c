"""labkit.parallel.experts on real gloo ranks (2 to 4) against one process running the same layer with the same
capacity rule (each rank's tokens a group): outputs, the input's gradient and every parameter's gradient within
1e-10 in float64, top-1 and top-2, with tokens dropped and without; the all-to-alls' bytes against what the routing
sends and labkit.plan's bound; the auxiliary loss against its definition."""

import pytest
import torch

import labkit
from labkit.parallel import count_collectives
from labkit.parallel.experts import ExpertParallelMoE, MoE, load_balancing_loss, route
from labkit.plan import expert_capacity, moe_all_to_all_nbytes

pytestmark = pytest.mark.numerics  # compares floating-point results: make unit runs it again on other kernels

TOKENS, D_MODEL, D_FF, TOLERANCE = 24, 6, 8, 1e-10


def layer(experts, top_k, capacity_factor):
    return MoE(D_MODEL, D_FF, experts, top_k=top_k, capacity_factor=capacity_factor, seed=1).double()


def data():
    generator = torch.Generator().manual_seed(2)
    return [torch.randn(TOKENS, D_MODEL, dtype=torch.float64, generator=generator) for _ in range(2)]


def on_rank(experts, top_k, capacity_factor):
    ep, rank = labkit.world_size(), labkit.rank()
    moe = layer(experts, top_k, capacity_factor).to(labkit.device())
    x, weights = (t.chunk(ep)[rank].to(labkit.device()) for t in data())
    x = x.clone().requires_grad_()
    with count_collectives() as counted:
        out, aux, routing = ExpertParallelMoE(moe)(x)
        forward = dict(counted.nbytes)
        ((out * weights).sum() + 0.1 * aux / ep).backward()
    grads = {name: None if p.grad is None else p.grad.cpu() for name, p in moe.named_parameters()}
    kept = int(routing.kept.sum())
    return out.detach().cpu(), x.grad.cpu(), grads, forward, dict(counted.nbytes), kept


def one_process(experts, top_k, capacity_factor, groups):
    moe = layer(experts, top_k, capacity_factor)
    x, weights = data()
    x = x.clone().requires_grad_()
    out, aux, routings = moe(x, groups=groups)
    ((out * weights).sum() + 0.1 * aux).backward()
    return out.detach(), x.grad, {name: p.grad for name, p in moe.named_parameters()}, routings


CASES = [(2, 4, 1, 1.0), (2, 4, 2, 0.5), (3, 6, 2, 1.25), (4, 8, 2, 2.0), (4, 4, 1, 0.75)]  # ep, E, k, factor


@pytest.mark.parametrize("ep,experts,top_k,capacity_factor", CASES)
def test_expert_parallel_layer_equals_one_process(ep, experts, top_k, capacity_factor):
    per_rank = labkit.run(on_rank, experts, top_k, capacity_factor, world_size=ep)
    out, x_grad, grads, routings = one_process(experts, top_k, capacity_factor, ep)
    assert (torch.cat([r[0] for r in per_rank]) - out).abs().max() < TOLERANCE
    assert (torch.cat([r[1] for r in per_rank]) - x_grad).abs().max() < TOLERANCE
    local = experts // ep
    for name, want in grads.items():
        holders = [r for r, outcome in enumerate(per_rank) if outcome[2][name] is not None]
        if name.startswith("experts."):  # an expert's gradient lives on its one rank, whole
            assert holders == [int(name.split(".")[1]) // local], (name, holders)
        got = sum(per_rank[r][2][name] for r in holders)  # the router's: each rank's part, summed (as dp would)
        assert (got - want).abs().max() < TOLERANCE, name
    capacity = expert_capacity(TOKENS // ep, experts, top_k, capacity_factor)
    kept = [int(r.kept.sum()) for r in routings]
    assert [outcome[5] for outcome in per_rank] == kept
    assert all(k <= min(TOKENS // ep * top_k, experts * capacity) for k in kept)
    if capacity_factor < 1:
        assert sum(kept) < TOKENS * top_k  # this case drops choices


@pytest.mark.parametrize("ep,experts,top_k,capacity_factor", CASES[:3])
def test_all_to_all_bytes_are_the_routings(ep, experts, top_k, capacity_factor):
    """Dispatch hands the rows of its kept choices, combine hands back the rows it received; the backward the same
    again, swapped. Within the plan's bound; the split sizes are E int64 counts each time."""
    per_rank = labkit.run(on_rank, experts, top_k, capacity_factor, world_size=ep)
    row = D_MODEL * 8
    received = [0] * ep
    routings = one_process(experts, top_k, capacity_factor, ep)[3]
    for routing in routings:
        for e in routing.expert[routing.kept].tolist():
            received[e // (experts // ep)] += 1
    bound = moe_all_to_all_nbytes(TOKENS // ep, D_MODEL, top_k, ep, 8, experts, capacity_factor)["at most"]
    for rank, (_, _, _, forward, total, kept) in enumerate(per_rank):
        assert forward["all_to_all"] == (kept + received[rank]) * row
        assert total["all_to_all"] == 2 * forward["all_to_all"]
        assert forward["all_to_all_sizes"] == total["all_to_all_sizes"] == experts * 8
        assert kept * row <= bound or ep == 1


def test_the_auxiliary_loss_is_switchs():
    """E sum f_e P_e: 1 for a uniform router whose choices spread evenly; E when every token picks one expert with
    certainty (Fedus et al. 2021, equation 4)."""
    experts = 4
    uniform = torch.zeros(8, experts, dtype=torch.float64)
    routing = route(uniform, 1, capacity=8)._replace(expert=torch.arange(8)[:, None] % experts)
    assert load_balancing_loss(routing).item() == pytest.approx(1.0)
    certain = torch.full((8, experts), -1e9, dtype=torch.float64)
    certain[:, 2] = 0.0
    assert load_balancing_loss(route(certain, 1, capacity=8)).item() == pytest.approx(experts)


def test_capacity_keeps_first_choices_first():
    """GShard's priority: every token's first choice is placed before any second choice."""
    logits = torch.tensor([[3.0, 2.0, 0.0], [3.0, 0.0, 2.0], [0.0, 3.0, 2.0]], dtype=torch.float64)
    routing = route(logits, top_k=2, capacity=1)
    # first choices: experts 0, 0, 1: token 1's first choice finds expert 0 full; second choices: 1, 2, 2
    assert routing.expert.tolist() == [[0, 1], [0, 2], [1, 2]]
    assert routing.kept.tolist() == [[True, False], [False, True], [True, False]]


def uneven_experts():
    return ExpertParallelMoE(layer(5, 1, 1.0))


def test_experts_that_do_not_split_are_refused():
    with pytest.raises(labkit.RankError, match="5 experts do not split over ep = 2"):
        labkit.run(uneven_experts, world_size=2)


def skewed_on_rank():
    """A router that sends every token to the same expert (all its logits 0: a tie, which torch.topk breaks the
    same way on every rank): the other rank receives no row, and its backward must still join both all-to-alls."""
    ep, rank = labkit.world_size(), labkit.rank()
    moe = layer(4, 1, 4.0)
    with torch.no_grad():
        moe.router.weight.zero_()
    x, weights = (t.chunk(ep)[rank] for t in data())
    x = x.clone().requires_grad_()
    out, aux, routing = ExpertParallelMoE(moe)(x)
    (out * weights).sum().backward()
    received = sum(int(p.grad is not None and p.grad.abs().sum() > 0) for p in moe.experts.parameters())
    return out.detach(), x.grad, received


def test_ranks_whose_experts_get_no_token_still_take_part():
    per_rank = labkit.run(skewed_on_rank, world_size=2)
    moe = layer(4, 1, 4.0)
    with torch.no_grad():
        moe.router.weight.zero_()
    x, weights = data()
    x = x.clone().requires_grad_()
    out = moe(x, groups=2)[0]
    (out * weights).sum().backward()
    assert sorted(r[2] for r in per_rank)[0] == 0  # one rank's experts got nothing
    assert (torch.cat([r[0] for r in per_rank]) - out.detach()).abs().max() < TOLERANCE
    assert (torch.cat([r[1] for r in per_rank]) - x.grad).abs().max() < TOLERANCE
