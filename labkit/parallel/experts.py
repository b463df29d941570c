"""Expert parallelism: a mixture-of-experts layer whose experts live on different ranks, tokens sent to them and
back with two all-to-alls (GShard, Lepikhin et al. 2020, section 2.2; Switch Transformer, Fedus et al. 2021).

    route(logits, top_k, capacity)      the router's choices: each token's top-k experts, their gates (the softmax
                                        probabilities), and which choices fit under each expert's capacity, first
                                        choices before second ones, tokens in order (GShard's priority)
    load_balancing_loss(routing)        Switch's auxiliary loss, E x sum_e f_e P_e (section 2.2, equation 4)
    MoE(d_model, d_ff, experts, ...)    the layer in one process: router, experts, capacity per group of tokens
    ExpertParallelMoE(moe, group)       the same layer on the ranks of `group` (the ep axis), each holding
                                        experts/ep of the experts and its own tokens
    dispatch(...), combine(...)         the two halves of the exchange, separately (notebook 18's exercise)

A token's output is the sum, over its kept choices, of gate x expert(token); a dropped choice adds nothing (in a
transformer the residual carries the token past the layer). Capacity is counted per group of tokens, a rank's own
(GShard's groups): `MoE.forward(x, groups=n)` cuts x into the n groups the ranks hold, so one process and the ranks
apply the same rule and produce the same output (tests/distributed/test_expert_parallel.py).

The exchange, on each rank: its kept choices sorted by expert (then token, then choice); how many go to each expert
(E counts) exchanged first with an all-to-all, so every rank knows how many rows it receives from each other rank
for each of its experts; then the rows themselves in one uneven all_to_all_single (input_split_sizes: rows for each
rank's experts; output_split_sizes: rows each rank sends here); each local expert runs on its rows; the outputs go
back by the reverse all-to-all and are added into token order, times their gates. On NCCL the split sizes must be
host integers, so reading the exchanged counts waits for the GPU, as in every MoE implementation that uses
all_to_all_single (torch.distributed.all_to_all_single's documentation: split sizes are lists of ints). The
all-to-all is differentiable here (its backward is the all-to-all with the splits swapped), so expert and router
gradients flow as in one process. Every collective is counted by labkit.parallel.counters ("all_to_all" for the
rows, "all_to_all_sizes" for the counts).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from labkit import groups
from labkit._refusals import refuse_while_graded
from labkit.parallel._collectives import all_to_all, all_to_all_sizes
from labkit.plan.expert_parallel import expert_capacity

__all__ = ["READY_MADE", "Dispatched", "ExpertParallelMoE", "MoE", "Routing", "combine", "dispatch",
           "load_balancing_loss", "route"]

READY_MADE = ("labkit.parallel.experts' dispatch", "labkit.parallel.experts' combine")


class Routing(NamedTuple):
    """The router's decision for a group of tokens: `expert` and `gate` (tokens, top_k), the chosen experts and
    their softmax probabilities, `kept` (tokens, top_k), whether each choice fits its expert's capacity, and
    `probs` (tokens, experts), every expert's probability (for the auxiliary loss)."""

    expert: torch.Tensor
    gate: torch.Tensor
    kept: torch.Tensor
    probs: torch.Tensor


def route(logits: torch.Tensor, top_k: int, capacity: int) -> Routing:
    """Each token's top_k experts by router probability, and which choices an expert of `capacity` keeps: every
    token's first choice before any second choice, tokens in order within each (GShard, section 2.2)."""
    probs = torch.softmax(logits, dim=-1)
    gate, expert = probs.topk(top_k, dim=-1)
    tokens, experts = logits.shape
    order = expert.t().reshape(-1)  # choice-major: all first choices, then all second ones
    position = F.one_hot(order, experts).cumsum(0).gather(1, order[:, None]).squeeze(1) - 1
    kept = (position < capacity).view(top_k, tokens).t()
    return Routing(expert, gate, kept, probs)


def load_balancing_loss(routing: Routing) -> torch.Tensor:
    """Switch Transformer's auxiliary loss (section 2.2, equation 4): E x sum_e f_e P_e, where f_e is the share of
    token-choices sent to expert e (before capacity) and P_e the mean probability the router gives e. 1 when both
    are uniform; larger as the load gathers on a few experts. Only P carries a gradient."""
    experts = routing.probs.shape[-1]
    share = F.one_hot(routing.expert.flatten(), experts).to(routing.probs.dtype).mean(0)
    return experts * (share * routing.probs.mean(0)).sum()


def expert_mlp(d_model: int, d_ff: int) -> nn.Sequential:
    """One expert: the transformer's MLP, Linear, GELU, Linear."""
    return nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))


class MoE(nn.Module):
    """A mixture-of-experts layer in one process: a router (Linear d_model -> experts, no bias) and `experts`
    expert MLPs; each token goes to its `top_k` experts, at most capacity_factor x tokens x top_k / experts
    choices per expert per group (labkit.plan.expert_capacity). `seed`: drawn inside a forked RNG, as TinyGPT."""

    def __init__(self, d_model: int, d_ff: int, experts: int, top_k: int = 1, capacity_factor: float = 1.25,
                 seed: int | None = 0):
        super().__init__()
        self.top_k, self.capacity_factor = top_k, capacity_factor
        with torch.random.fork_rng(devices=[], enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            self.router = nn.Linear(d_model, experts, bias=False)
            self.experts = nn.ModuleList(expert_mlp(d_model, d_ff) for _ in range(experts))

    def capacity(self, tokens: int) -> int:
        return expert_capacity(tokens, len(self.experts), self.top_k, self.capacity_factor)

    def forward(self, x: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor, list[Routing]]:
        """x (tokens, d_model) cut into `groups` equal groups, each routed under its own capacity; the output, the
        auxiliary loss (the groups' mean) and each group's Routing."""
        outputs, losses, routings = [], [], []
        for part in x.chunk(groups):
            routing = route(self.router(part), self.top_k, self.capacity(part.shape[0]))
            out = torch.zeros_like(part)
            for e, expert in enumerate(self.experts):
                token, choice = torch.nonzero((routing.expert == e) & routing.kept, as_tuple=True)
                if token.numel():
                    out = out.index_add(0, token, expert(part[token]) * routing.gate[token, choice, None])
            outputs.append(out)
            losses.append(load_balancing_loss(routing))
            routings.append(routing)
        return torch.cat(outputs), torch.stack(losses).mean(), routings


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with autograd: its backward sends each gradient row back where its row came from, the
    all-to-all with the split sizes swapped."""

    @staticmethod
    def forward(ctx, rows, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = rows.new_empty((sum(output_splits), *rows.shape[1:]))
        all_to_all(out, rows.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        back = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        all_to_all(back, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return back, None, None, None


class Dispatched(NamedTuple):
    """What dispatch hands the experts and combine: `rows` received (grouped by sending rank, then by this rank's
    expert), `local_expert` of each received row, and the bookkeeping of the way back: this rank's kept choices
    sorted by expert (`token`, `gate`), and the split sizes both ways."""

    rows: torch.Tensor
    local_expert: torch.Tensor
    token: torch.Tensor
    gate: torch.Tensor
    send_splits: list[int]
    receive_splits: list[int]


def dispatch(x: torch.Tensor, routing: Routing, experts: int, group=None) -> Dispatched:
    """Send each kept choice's token to the rank holding its expert (experts/ep consecutive experts per rank): the
    counts per expert first (an all-to-all of E integers), then the rows (module docstring)."""
    refuse_while_graded(READY_MADE[0])
    ep, local = groups.group_size(group), experts // groups.group_size(group)
    token, choice = torch.nonzero(routing.kept, as_tuple=True)
    expert = routing.expert[token, choice]
    order = torch.argsort(expert * routing.kept.numel() + token * routing.kept.shape[1] + choice)
    token, choice, expert = token[order], choice[order], expert[order]
    counts = torch.bincount(expert, minlength=experts)
    arriving = torch.empty_like(counts)
    all_to_all_sizes(arriving, counts, group)
    send_splits = counts.view(ep, local).sum(1).tolist()
    receive_counts = arriving.view(ep, local)  # [source rank, local expert]
    receive_splits = receive_counts.sum(1).tolist()
    rows = _AllToAll.apply(x[token], receive_splits, send_splits, group)
    local_expert = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(ep),
                                           receive_counts.flatten())
    return Dispatched(rows, local_expert, token, routing.gate[token, choice], send_splits, receive_splits)


def combine(outputs: torch.Tensor, dispatched: Dispatched, tokens: int, group=None) -> torch.Tensor:
    """The experts' outputs back to the ranks their tokens came from (the reverse all-to-all), each times its gate
    and added into its token's row: (tokens, d_model)."""
    refuse_while_graded(READY_MADE[1])
    back = _AllToAll.apply(outputs, dispatched.send_splits, dispatched.receive_splits, group)
    total = back.new_zeros((tokens, back.shape[1]))
    return total.index_add(0, dispatched.token, back * dispatched.gate[:, None])


def run_experts(experts: nn.ModuleList, dispatched: Dispatched) -> torch.Tensor:
    """Each local expert on the rows sent to it, in the rows' order. The result depends on the rows even where no
    expert ran (rows x 0): every rank's backward must then run both all-to-alls' gradients, or the ranks' collectives
    fall out of step (a rank whose experts got no token would skip them)."""
    out = dispatched.rows * 0
    for e, expert in enumerate(experts):
        (index,) = torch.nonzero(dispatched.local_expert == e, as_tuple=True)
        if index.numel():
            out = out.index_copy(0, index, expert(dispatched.rows[index]))
    return out


class ExpertParallelMoE(nn.Module):
    """`moe`'s layer on the ranks of `group` (None: the world): the router replicated, this rank's experts/ep
    experts (rank r: experts r E/ep to (r + 1) E/ep - 1, their parameters shared with `moe`), its own tokens.
    forward(x) -> (its tokens' output, its group's auxiliary loss, its Routing). `dispatch`, `experts` and
    `combine` can be replaced (the exercise's grader passes a student's)."""

    def __init__(self, moe: MoE, group=None, dispatch_fn=None, combine_fn=None):
        super().__init__()
        ep, rank = groups.group_size(group), groups.group_rank(group)
        if len(moe.experts) % ep:
            raise ValueError(f"{len(moe.experts)} experts do not split over ep = {ep} ranks: pass a number of "
                             f"experts that {ep} divides.")
        local = len(moe.experts) // ep
        self.moe, self.group = moe, group
        self.router = moe.router
        self.local_experts = nn.ModuleList(moe.experts[rank * local:(rank + 1) * local])
        self._dispatch, self._combine = dispatch_fn or dispatch, combine_fn or combine

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Routing]:
        routing = route(self.router(x), self.moe.top_k, self.moe.capacity(x.shape[0]))
        dispatched = self._dispatch(x, routing, len(self.moe.experts), self.group)
        out = self._combine(run_experts(self.local_experts, dispatched), dispatched, x.shape[0], self.group)
        return out, load_balancing_loss(routing), routing
