"""check_expert_dispatch, notebook 18's grader, on real gloo ranks: right dispatch/combine pairs written differently
pass; every catalogued wrong one is rejected with its mistake named."""

import re

import pytest
import torch
import torch.distributed as dist

from labkit.exercises import check_expert_dispatch
from labkit.parallel.experts import dispatch as course_dispatch

pytestmark = pytest.mark.numerics  # the grader compares floating-point results: make unit runs it on other kernels


def exchange(counts):
    arriving = torch.empty_like(counts)
    dist.all_to_all_single(arriving, counts)
    return arriving


# ---- right, written differently ----------------------------------------------------------------------------------

def sorted_dispatch(x, expert, kept, experts):
    """The notebook's solution: kept choices sorted by expert, counts exchanged, rows sent."""
    ranks = dist.get_world_size()
    local = experts // ranks
    token, choice = kept.nonzero(as_tuple=True)
    chosen = expert[token, choice]
    order = torch.argsort(chosen, stable=True)
    token, choice, chosen = token[order], choice[order], chosen[order]
    counts = torch.bincount(chosen, minlength=experts)
    arriving = exchange(counts).view(ranks, local)
    send = counts.view(ranks, local).sum(1).tolist()
    receive = arriving.sum(1).tolist()
    rows = x.new_empty(sum(receive), x.shape[1])
    dist.all_to_all_single(rows, x[token], receive, send)
    labels = torch.arange(local).repeat(ranks).repeat_interleave(arriving.flatten())
    return rows, labels, (token, choice, send, receive)


def sorted_combine(outputs, gate, state, tokens):
    token, choice, send, receive = state
    back = outputs.new_empty(sum(send), outputs.shape[1])
    dist.all_to_all_single(back, outputs, send, receive)
    out = torch.zeros(tokens, outputs.shape[1], dtype=outputs.dtype)
    return out.index_add(0, token, back * gate[token, choice, None])


def loop_dispatch(x, expert, kept, experts):
    """Rows gathered expert by expert in a loop, labels sent alongside as a column of the rows."""
    ranks = dist.get_world_size()
    local = experts // ranks
    picked, sizes = [], []
    for e in range(experts):
        token, choice = ((expert == e) & kept).nonzero(as_tuple=True)
        picked.append((token, choice))
        sizes.append(token.numel())
    token = torch.cat([t for t, _ in picked])
    choice = torch.cat([c for _, c in picked])
    counts = torch.tensor(sizes)
    send = counts.view(ranks, local).sum(1).tolist()
    receive = exchange(counts).view(ranks, local).sum(1).tolist()
    label = torch.tensor([e % local for e, n in enumerate(sizes) for _ in range(n)], dtype=x.dtype)
    payload = torch.cat([x[token], label[:, None]], 1)
    arrived = x.new_empty(sum(receive), x.shape[1] + 1)
    dist.all_to_all_single(arrived, payload, receive, send)
    return arrived[:, :-1], arrived[:, -1].long(), {"token": token, "choice": choice, "send": send, "receive": receive}


def loop_combine(outputs, gate, state, tokens):
    back = outputs.new_empty(sum(state["send"]), outputs.shape[1])
    dist.all_to_all_single(back, outputs.contiguous(), state["send"], state["receive"])
    out = torch.zeros(tokens, outputs.shape[1], dtype=outputs.dtype)
    for row, (t, j) in enumerate(zip(state["token"].tolist(), state["choice"].tolist(), strict=True)):
        out[t] += gate[t, j] * back[row]
    return out


def scatter_add_combine(outputs, gate, state, tokens):
    """sorted_dispatch's state, the results added with scatter_add_ and the gates taken by flat index."""
    token, choice, send, receive = state
    back = outputs.new_empty(sum(send), outputs.shape[1])
    dist.all_to_all_single(back, outputs.contiguous(), send, receive)
    weights = gate.flatten()[token * gate.shape[1] + choice]
    out = torch.zeros(tokens, outputs.shape[1], dtype=outputs.dtype)
    return out.scatter_add_(0, token[:, None].expand_as(back), back * weights[:, None])


# ---- wrong: the catalogue ----------------------------------------------------------------------------------------

def unsorted_dispatch(x, expert, kept, experts):
    """Sends choices in token order: split sizes cut the rows at the wrong places."""
    ranks = dist.get_world_size()
    local = experts // ranks
    token, choice = kept.nonzero(as_tuple=True)
    chosen = expert[token, choice]
    counts = torch.bincount(chosen, minlength=experts)
    arriving = exchange(counts).view(ranks, local)
    send, receive = counts.view(ranks, local).sum(1).tolist(), arriving.sum(1).tolist()
    rows = x.new_empty(sum(receive), x.shape[1])
    dist.all_to_all_single(rows, x[token], receive, send)
    labels = torch.arange(local).repeat(ranks).repeat_interleave(arriving.flatten())
    return rows, labels, (token, choice, send, receive)


def capacity_ignored(x, expert, kept, experts):
    return sorted_dispatch(x, expert, torch.ones_like(kept), experts)


def sizes_not_exchanged(x, expert, kept, experts):
    """Assumes each rank receives from every rank what it sends to it."""
    ranks = dist.get_world_size()
    local = experts // ranks
    token, choice = kept.nonzero(as_tuple=True)
    chosen = expert[token, choice]
    order = torch.argsort(chosen, stable=True)
    token, choice, chosen = token[order], choice[order], chosen[order]
    counts = torch.bincount(chosen, minlength=experts)
    send = counts.view(ranks, local).sum(1).tolist()
    rows = x.new_empty(sum(send), x.shape[1])
    dist.all_to_all_single(rows, x[token], send, send)
    return rows, torch.zeros(rows.shape[0], dtype=torch.long), (token, choice, send, send)


def labels_in_send_order(x, expert, kept, experts):
    """Labels from this rank's own sorted choices, not from what arrived."""
    rows, labels, state = sorted_dispatch(x, expert, kept, experts)
    local = experts // dist.get_world_size()
    token, choice = kept.nonzero(as_tuple=True)
    mine = (expert[token, choice] % local).sort().values
    padding = torch.zeros(max(0, rows.shape[0] - mine.numel()), dtype=torch.long)
    return rows, torch.cat([mine, padding])[:rows.shape[0]], state


def combine_without_gates(outputs, gate, state, tokens):
    return sorted_combine(outputs, torch.ones_like(gate), state, tokens)


def combine_gates_twice(outputs, gate, state, tokens):
    return sorted_combine(outputs, gate * gate, state, tokens)


def combine_into_positions(outputs, gate, state, tokens):
    """Results added row by row into positions 0, 1, ... instead of their tokens."""
    token, choice, send, receive = state
    back = outputs.new_empty(sum(send), outputs.shape[1])
    dist.all_to_all_single(back, outputs, send, receive)
    out = torch.zeros(tokens, outputs.shape[1], dtype=outputs.dtype)
    weighted = back * gate[token, choice, None]
    return out.index_add(0, torch.arange(weighted.shape[0]) % tokens, weighted)


_dropped = {}


def dispatch_remembering_x(x, expert, kept, experts):
    _dropped["x"], _dropped["kept"] = x, kept
    return sorted_dispatch(x, expert, kept, experts)


def dropped_slots_keep_their_token(outputs, gate, state, tokens):
    out = sorted_combine(outputs, gate, state, tokens)
    return out + _dropped["x"] * (~_dropped["kept"]).sum(1, keepdim=True)


def the_course_dispatch(x, expert, kept, experts):
    from labkit.parallel.experts import Routing

    return course_dispatch(x, Routing(expert, torch.ones_like(expert, dtype=x.dtype), kept, None), experts), None, None


def all_gather_instead(x, expert, kept, experts):
    gathered = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, x)
    return sorted_dispatch(x, expert, kept, experts)


def returns_two(x, expert, kept, experts):
    return sorted_dispatch(x, expert, kept, experts)[:2]


CATALOGUE = [
    (unsorted_dispatch, sorted_combine, "not the same ones|wrong one of its experts|sorted by expert"),
    (capacity_ignored, sorted_combine, "kept False were sent too"),
    (sizes_not_exchanged, sorted_combine, "split sizes are exchanged|not the same ones|wrong one"),
    (labels_in_send_order, sorted_combine, "labelled some for the wrong one"),
    (sorted_dispatch, combine_without_gates, "without the gates"),
    (sorted_dispatch, combine_gates_twice, "gate applied twice"),
    (sorted_dispatch, combine_into_positions, "wrong tokens' places|differs from one process"),
    (dispatch_remembering_x, dropped_slots_keep_their_token, "dropped choice its token back"),
    (the_course_dispatch, sorted_combine, "labkit.parallel.experts' dispatch.*switched off"),
    (all_gather_instead, sorted_combine, "all_gather.*all_to_all_single only"),
    (returns_two, sorted_combine, "must return three things"),
]


@pytest.mark.parametrize("dispatch,combine,message", CATALOGUE,
                         ids=[d.__name__ + "+" + c.__name__ for d, c, _ in CATALOGUE])
def test_a_wrong_dispatch_or_combine_is_rejected_with_its_mistake_named(dispatch, combine, message):
    verdict = check_expert_dispatch(dispatch, combine, record=False)
    assert not verdict, verdict
    assert re.search(message, verdict.message, flags=re.IGNORECASE | re.DOTALL), verdict.message


RIGHT = [(sorted_dispatch, sorted_combine), (loop_dispatch, loop_combine), (sorted_dispatch, scatter_add_combine)]


@pytest.mark.parametrize("dispatch,combine", RIGHT, ids=["sorted", "loops", "scatter_add"])
def test_right_pairs_written_differently_pass(dispatch, combine):
    verdict = check_expert_dispatch(dispatch, combine, record=False)
    assert verdict, verdict.message


def test_not_functions_are_told_what_to_pass():
    verdict = check_expert_dispatch(sorted_dispatch, None, record=False)
    assert not verdict and "pass your two functions themselves" in verdict.message
