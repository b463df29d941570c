"""Expert parallelism's arithmetic: how many tokens an expert takes (its capacity), the bytes a mixture-of-experts
layer's two all-to-alls move, and what placing experts on ep ranks saves in memory. Pure Python, no torch:
labkit.parallel.experts runs the layer these numbers describe, and its tests check them against the ranks.

    expert_capacity(tokens, experts, top_k, capacity_factor)    Switch Transformer's capacity, per group of tokens
    moe_all_to_all_nbytes(tokens, d_model, top_k, ep, ...)      bytes one rank sends per all-to-all (dispatch or
                                                                combine), balanced routing, and the most capacity
                                                                allows
    expert_params_per_rank(experts, ep, params_per_expert)      the experts' parameters one rank holds

Sources: Fedus et al. 2021, "Switch Transformers: Scaling to Trillion Parameter Models with Simple and Efficient
Sparsity", section 2.2 (expert capacity = tokens per batch / experts x capacity factor; top-1 routing); Lepikhin et
al. 2020, "GShard: Scaling Giant Models with Conditional Computation and Automatic Sharding", section 2.2 (top-2,
capacity per group of tokens, the all-to-all dispatch and combine).
"""

from __future__ import annotations

import math

from labkit.checks import number, overflow_named, whole

__all__ = ["expert_capacity", "expert_params_per_rank", "moe_all_to_all_nbytes"]


def expert_capacity(tokens: int, experts: int, top_k: int = 1, capacity_factor: float = 1.25) -> int:
    """The most token-choices one expert takes from a group of `tokens` tokens, each choosing `top_k` of
    `experts` experts: ceil(capacity_factor x tokens x top_k / experts) (Switch Transformer, section 2.2, with
    GShard's top-k). A choice past it is dropped: that token skips the expert (its residual passes on).

    >>> expert_capacity(64, 8, top_k=1, capacity_factor=1.25), expert_capacity(64, 8, top_k=2, capacity_factor=1.0)
    (10, 16)
    """
    tokens, experts, top_k = whole("tokens", tokens), whole("experts", experts), whole("top_k", top_k)
    if top_k > experts:
        raise ValueError(f"top_k={top_k}: a token chooses among {experts} experts; pass top_k <= experts.")
    capacity_factor = number("capacity_factor", capacity_factor, minimum=0.0, inclusive=False)
    with overflow_named("expert_capacity", tokens=tokens, capacity_factor=capacity_factor) as finite:
        return finite(math.ceil(finite(capacity_factor * tokens * top_k / experts)))


def moe_all_to_all_nbytes(tokens: int, d_model: int, top_k: int, ep: int, bytes_per_element: int,
                          experts: int | None = None, capacity_factor: float | None = None) -> dict[str, int]:
    """Bytes one rank sends to the other ranks in one all-to-all of a mixture-of-experts layer (the dispatch; the
    combine sends as many back), its `tokens` tokens each choosing `top_k` experts spread over `ep` ranks:
    {"balanced": tokens x top_k x (ep - 1)/ep rows of d_model, when the choices spread evenly over the ranks,
    "at most": every kept choice to another rank, tokens x top_k rows, or with `experts` and `capacity_factor`
    at most each expert's capacity}. The backward moves the same again, in reverse (an all-to-all's gradient is
    the all-to-all with the split sizes swapped)."""
    tokens, d_model, top_k = whole("tokens", tokens), whole("d_model", d_model), whole("top_k", top_k)
    ep, bytes_per_element = whole("ep", ep), whole("bytes_per_element", bytes_per_element)
    row = d_model * bytes_per_element
    most = tokens * top_k
    if experts is not None and capacity_factor is not None:
        most = min(most, experts * expert_capacity(tokens, experts, top_k, capacity_factor))
    with overflow_named("moe_all_to_all_nbytes", tokens=tokens, d_model=d_model, top_k=top_k,
                        bytes_per_element=bytes_per_element, capacity_factor=capacity_factor) as finite:
        return finite({"balanced": tokens * top_k * (ep - 1) // ep * row, "at most": most * row if ep > 1 else 0})


def expert_params_per_rank(experts: int, ep: int, params_per_expert: float) -> float:
    """The experts' parameters one rank holds when `experts` experts are split over `ep` ranks, experts/ep each
    (ep must divide experts); the router and everything else stay replicated."""
    experts, ep = whole("experts", experts), whole("ep", ep)
    if experts % ep:
        raise ValueError(f"ep={ep} does not divide experts={experts}: each rank holds experts/ep whole experts; "
                         f"pass an ep that divides {experts}.")
    params_per_expert = number("params_per_expert", params_per_expert)
    with overflow_named("expert_params_per_rank", experts=experts, params_per_expert=params_per_expert) as finite:
        return finite(experts // ep * params_per_expert)
