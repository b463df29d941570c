"""Interleaved 1F1B (Narayanan et al. 2021, section 2.2.2) in labkit.parallel.pipeline: v chunks per stage. The
order against torch's ScheduleInterleaved1F1B, the plan's messages against an independent derivation and the
single-stream NCCL model, the simulator's bubble against (p-1)/(v m+p-1) exactly, and the executor on real gloo
ranks: equal to one process and to 1F1B, on sub-groups, with tensor-parallel layers talking on another axis, and
its measured bubble within 15% of the formula."""

import pytest
import torch
import torch.nn.functional as F
from least_bubble import least_bubble, scaled
from nccl_stream_model import plan_posts, stream_deadlock
from torch import nn

import labkit
from labkit.groups import new_group
from labkit.models import make_classification, mlp
from labkit.parallel import (
    Action,
    Mesh,
    ParallelMLP,
    count_collectives,
    measured_bubble,
    peak_in_flight,
    run_pipeline,
    schedule,
    simulate_pipeline,
    stage_layers,
)
from labkit.parallel.pipeline import communication_plan
from labkit.plan import bubble_fraction

CASES = [(p, m, v) for p in range(1, 6) for v in range(2, 5) for m in range(p, 4 * p + 1, p)]


def warmup(p, m, v, r):
    """Forwards before stage r's first backward: Megatron-LM's (v-1) p + 2 (p-r-1), at most all m v."""
    return min((v - 1) * p + 2 * (p - r - 1), m * v)


# --- The schedule ---

def test_every_stage_runs_each_chunks_forward_and_backward_once_in_order():
    for p, m, v in CASES:
        for r, actions in enumerate(schedule("interleaved", p, m, chunks=v)):
            every = {(kind, i, c) for kind in "FB" for i in range(m) for c in range(v)}
            assert sorted((a.kind, a.microbatch, a.chunk) for a in actions) == sorted(every), (p, m, v, r)
            for c in range(v):
                assert [a.microbatch for a in actions if a.kind == "F" and a.chunk == c] == list(range(m))
                assert [a.microbatch for a in actions if a.kind == "B" and a.chunk == c] == list(range(m))
                assert all(actions.index(Action("F", i, c)) < actions.index(Action("B", i, c)) for i in range(m))
            held = warmup(p, m, v, r) + (warmup(p, m, v, r) < m * v)  # the warm-up, plus the first pair's forward
            assert peak_in_flight(actions) == held, (p, m, v, r)


def test_the_order_reads_as_megatron_draws_it():
    # p = 2, m = 4, v = 2: stage 0 warms up with (v-1) p + 2 (p-1) = 4 forwards, stage 1 with 2
    assert [" ".join(map(str, a)) for a in schedule("interleaved", 2, 4, chunks=2)] == [
        "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3",
        "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3"]
    assert str(Action("F", 3)) == "F3" and str(Action("B", 0, 2)) == "B0.2"


def torch_interleaved(p, m, v):
    get_schedule_ops = pytest.importorskip(
        "torch.distributed.pipelining._schedule_visualizer",
        reason="torch's private pipeline-schedule visualizer is gone: nothing to cross-check against").get_schedule_ops
    ops = get_schedule_ops("Interleaved1F1B", p, m, num_stages_per_rank=v)
    assert all(a.stage_index % p == r for r, stage in enumerate(ops) for a in stage if a is not None)
    return [[Action(str(a.computation_type.value), a.microbatch_index, a.stage_index // p) for a in stage
             if a is not None and str(a.computation_type.value) in ("F", "B")] for stage in ops]


def test_order_equals_torchs_interleaved_1f1b():
    """torch 2.13's ScheduleInterleaved1F1B (stage index c p + r is rank r's chunk c) against ours, m a multiple
    of p (torch also takes others, in rounds of m // p; Megatron-LM and this refuse them)."""
    for p in range(1, 5):
        for v in range(2, 5):
            for m in range(p, 4 * p + 1, p):
                assert torch_interleaved(p, m, v) == schedule("interleaved", p, m, chunks=v), (p, m, v)


@pytest.mark.parametrize("call, error, message", [
    (lambda: schedule("1f1b", 2, 4, chunks=2), ValueError, "chunks=2: '1f1b' runs one chunk per stage; more "
                                                            r"\(chunks >= 2\) is kind='interleaved'"),
    (lambda: schedule("gpipe", 2, 4, chunks=3), ValueError, "chunks=3: 'gpipe' runs one chunk per stage"),
    (lambda: schedule("interleaved", 2, 4), ValueError, r"chunks=1: 'interleaved' needs chunks >= 2 per stage "
                                                         r"\(with one chunk it is '1f1b'\)"),
    (lambda: schedule("interleaved", 4, 6, chunks=2), ValueError, "microbatches=6: interleaving runs micro-batches "
                                                                   "in groups of stages=4; pass a multiple of 4"),
    (lambda: schedule("interleaved", 2, 4, chunks=0), ValueError, "chunks=0: pass a whole number >= 1"),
    (lambda: schedule("interleaved", 2, 4, chunks=True), ValueError, "chunks=True: pass a whole number >= 1"),
    (lambda: simulate_pipeline("interleaved", 3, 4, chunks=2), ValueError, "microbatches=4: interleaving"),
    (lambda: communication_plan("interleaved", 3, 3, chunks=1), ValueError, "chunks=1: 'interleaved' needs"),
    (lambda: communication_plan("1f1b", 2, 2**19), ValueError, "microbatches=524288: pass fewer than 524287"),
    (lambda: communication_plan("interleaved", 1, 1, 2**12), ValueError, "chunks=4096: pass fewer than 4096"),
    (lambda: stage_layers(7, 2, chunks=4), ValueError, r"a model of 7 layer\(s\) cannot make 8 pieces \(2 stages "
                                                        r"x 4 chunks\): each needs a layer"),
])
def test_bad_arguments_get_clear_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_stage_layers_with_chunks_cut_the_model_into_v_p_pieces_in_order():
    assert stage_layers(8, 2, chunks=2) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert stage_layers(9, 3, chunks=2) == stage_layers(9, 6) == [
        range(0, 2), range(2, 4), range(4, 6), range(6, 7), range(7, 8), range(8, 9)]


# --- The messages ---

def derived(action, r, p, v):
    """(receives before, sends after) `action` on stage r, derived from the chunk layout alone: piece c p + r
    takes piece c p + r - 1's output and hands on to piece c p + r + 1; (op, peer, what, micro-batch, chunk of
    the receiving forward)."""
    i, c, last_stage = action.microbatch, action.chunk, r == p - 1
    first, last = (r, c) == (0, 0), (r, c) == (p - 1, v - 1)
    if p == 1:
        return [], []
    if action.kind == "F":
        return ([] if first else [("recv", (r - 1) % p, "activation", i, c)],
                [] if last else [("send", (r + 1) % p, "activation", i, c + last_stage)])
    return ([] if last else [("recv", (r + 1) % p, "gradient", i, c + last_stage)],
            [] if first else [("send", (r - 1) % p, "gradient", i, c)])


def one_action_at_a_time(p, m, v):
    """The plan as GPipe's and 1F1B's are posted: after each action, its sends and the next action's receives."""
    posts = []
    for r, actions in enumerate(schedule("interleaved", p, m, chunks=v)):
        groups = [(("barrier",),), tuple(derived(actions[0], r, p, v)[0])]
        for k, action in enumerate(actions):
            after = derived(actions[k + 1], r, p, v)[0] if k + 1 < len(actions) else []
            groups.append(tuple(derived(action, r, p, v)[1] + after))
        posts.append([group for group in groups if group])
    return posts


def test_the_plan_sends_what_the_chunk_layout_says_and_a_header_per_receiving_chunk():
    for p, m, v in CASES:
        for r, steps in enumerate(communication_plan("interleaved", p, m, chunks=v)):
            posted = [(msg.op, msg.peer, msg.what, msg.microbatch, msg.chunk) for step in steps
                      if not isinstance(step, Action) for msg in step]
            wanted = [message for a in schedule("interleaved", p, m, chunks=v)[r] for part in derived(a, r, p, v)
                      for message in part]
            assert sorted(m_ for m_ in posted if m_[2] != "header") == sorted(wanted), (p, m, v, r)
            headers = sorted(m_ for m_ in posted if m_[2] == "header")
            receiving = [c for c in range(v) if p > 1 and (r, c) != (0, 0)]
            sending = [c + (r == p - 1) for c in range(v) if p > 1 and (r, c) != (p - 1, v - 1)]
            assert headers == sorted([("recv", (r - 1) % p, "header", 0, c) for c in receiving] +
                                     [("send", (r + 1) % p, "header", 0, c) for c in sending]), (p, m, v, r)


def test_every_plan_completes_on_one_stream_per_rank_where_one_action_at_a_time_would_hang():
    for p, m, v in CASES + [(6, 12, 2), (6, 6, 3), (7, 14, 2)]:
        assert stream_deadlock(plan_posts("interleaved", p, m, v)) is None, (p, m, v)
        for r, steps in enumerate(communication_plan("interleaved", p, m, chunks=v)):
            assert [s for s in steps if isinstance(s, Action)] == schedule("interleaved", p, m, chunks=v)[r]
    # posted after each action, as 1F1B's are, a steady-state pair's messages hang (p = 2: both neighbours are one)
    assert stream_deadlock(one_action_at_a_time(2, 4, 2)) is not None


def test_each_pair_of_stages_tags_its_messages_apart_and_alike_on_both_ends():
    """gloo matches a send to a receive by peer and tag: between two stages, one direction, no tag twice."""
    for p, m, v in [(2, 4, 2), (3, 6, 3), (4, 8, 2), (2, 2, 4)]:
        tags = {}
        for r, steps in enumerate(communication_plan("interleaved", p, m, chunks=v)):
            for msg in (msg for step in steps if not isinstance(step, Action) for msg in step):
                pair = (r, msg.peer) if msg.op == "send" else (msg.peer, r)
                tags.setdefault((pair, msg.op), []).append(msg.tag)
        for (pair, op), sent in tags.items():
            assert len(set(sent)) == len(sent), (p, m, v, pair, op)
            assert sorted(sent) == sorted(tags[(pair, "recv" if op == "send" else "send")]), (p, m, v, pair)


# --- The simulator ---

def test_simulated_bubble_is_the_interleaved_formula_exactly():
    for p, m, v in CASES:
        for forward, backward in [(1.0, 2.0), (1.0, 1.0), (0.3, 0.5)]:
            events = simulate_pipeline("interleaved", p, m, forward, backward, chunks=v)
            assert len(events) == 2 * p * m * v
            assert measured_bubble(events) == pytest.approx(bubble_fraction(p, m, v), abs=1e-12), (p, m, v)
            assert max(e.end for e in events) == pytest.approx((m + (p - 1) / v) * (forward + backward))


def test_simulated_interleaved_timeline_respects_the_chunk_layout():
    p, m, v, send = 3, 6, 2, 0.25
    events = simulate_pipeline("interleaved", p, m, forward_seconds=[1, 2, 1], backward_seconds=2,
                               send_seconds=send, chunks=v)
    at = {(e.stage, e.kind, e.microbatch, e.chunk): e for e in events}
    assert len(at) == len(events) == 2 * p * m * v
    for (r, kind, i, c), e in at.items():
        assert e.seconds == ([1, 2, 1][r] if kind == "F" else 2) / v
        if kind == "F" and (r, c) != (0, 0):
            assert e.start >= at[(r - 1, "F", i, c) if r else (p - 1, "F", i, c - 1)].end + send
        if kind == "B":
            assert e.start >= at[(r, "F", i, c)].end
            if (r, c) != (p - 1, v - 1):
                assert e.start >= at[(r + 1, "B", i, c) if r < p - 1 else (0, "B", i, c + 1)].end + send
    for r, actions in enumerate(schedule("interleaved", p, m, chunks=v)):
        mine = [e for e in events if e.stage == r]
        assert [(e.kind, e.microbatch, e.chunk) for e in mine] == [(a.kind, a.microbatch, a.chunk) for a in actions]
        assert all(a.end <= b.start for a, b in zip(mine, mine[1:], strict=False))
    one = simulate_pipeline("interleaved", 1, 3, 1.0, 2.0, send_seconds=5.0, chunks=3)  # in place: no transfers
    assert max(e.end for e in one) == pytest.approx(9.0) and measured_bubble(one) == pytest.approx(0.0)


# --- The executor on real ranks: the same loss and gradients as one process, and as 1F1B ---

BATCH, LAYERS = 20, 9  # mlp(layers=4): 9 layers, enough for 9 pieces; micro-batches of unequal sizes for m = 3, 6, 8


def steps(cases, emulate=0.0):
    """Each case (schedule, micro-batches, chunks) on this rank: its result, its gradients, its counted sends."""
    out = []
    for kind, m, v in cases:
        x, y = make_classification(BATCH, dtype=torch.float64)
        model = mlp(layers=4, dtype=torch.float64)
        with count_collectives() as counted:
            result = run_pipeline(model, kind, m, x, y, F.cross_entropy, v, emulate_compute_seconds=emulate)
        out.append((result, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}, counted))
    return out


def reference(seed=0):
    x, y = make_classification(BATCH, seed=seed, dtype=torch.float64)
    model = mlp(layers=4, seed=seed, dtype=torch.float64)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def assert_equal_gradients(seen, grads, *context):
    assert set(seen) == set(grads), context
    for name, grad in seen.items():
        assert (grad - grads[name]).abs().max() <= 1e-12 * grads[name].abs().max(), (*context, name)


@pytest.mark.parametrize("p, cases", [
    (1, [("interleaved", 3, 3), ("1f1b", 3, 1)]),
    (2, [("interleaved", 2, 2), ("interleaved", 4, 2), ("interleaved", 6, 4), ("1f1b", 6, 1)]),
    (3, [("interleaved", 3, 2), ("interleaved", 6, 3), ("1f1b", 6, 1)]),
    (4, [("interleaved", 4, 2), ("interleaved", 8, 2), ("gpipe", 8, 1)]),
])
def test_interleaved_step_equals_one_process_and_one_chunk_per_stage(p, cases):
    per_rank = labkit.run(steps, cases, world_size=p)
    loss, grads = reference()
    one_chunk = {}
    for k, (kind, m, v) in enumerate(cases):
        seen = {}
        for r, results in enumerate(per_rank):
            result, mine, counted = results[k]
            pieces = stage_layers(LAYERS, p, v)
            assert result.layers == tuple(pieces[c * p + r] for c in range(v)), (kind, m, v, r)
            assert [(e.kind, e.microbatch, e.chunk) for e in result.events] == \
                [(a.kind, a.microbatch, a.chunk) for a in schedule(kind, p, m, v)[r]]
            assert result.peak_in_flight == peak_in_flight(schedule(kind, p, m, v)[r])
            # each piece but the last sends every micro-batch's activation on, each but the first its gradient back
            sent = 0 if p == 1 else 2 * v - (r == 0) - (r == p - 1)
            assert dict(counted.calls) == ({"send": m * sent} if sent else {}), (kind, m, v, r)
            assert counted.nbytes["send"] == sent * BATCH * 64 * 8
            assert (result.loss is None) == (r < p - 1)
            seen.update(mine)
        assert per_rank[-1][k][0].loss == pytest.approx(loss, rel=1e-12, abs=0), (kind, m, v)
        assert_equal_gradients(seen, grads, kind, m, v)
        if v == 1:
            one_chunk = seen
    for k, (_, m, v) in enumerate(cases):  # and, micro-batch for micro-batch, what 1F1B (or GPipe) computed
        if v > 1 and m == cases[-1][1]:
            assert_equal_gradients({n: g for results in per_rank for n, g in results[k][1].items()}, one_chunk, m, v)


SIDE_BY_SIDE = {0: ("interleaved", 4, 2, 1), 1: ("interleaved", 2, 3, 2)}  # by part: schedule, m, chunks, seed


def two_pipelines(parts):
    """Two interleaved pipelines at once, on disjoint pairs of ranks, each with its own model seed and data."""
    made = [new_group(part) for part in parts]
    part = next(i for i, ranks in enumerate(parts) if labkit.rank() in ranks)
    kind, m, v, seed = SIDE_BY_SIDE[part]
    x, y = make_classification(BATCH, seed=seed, dtype=torch.float64)
    model = mlp(layers=4, seed=seed, dtype=torch.float64)
    result = run_pipeline(model, kind, m, x, y, F.cross_entropy, v, group=made[part])
    return part, result, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def test_two_interleaved_pipelines_on_sub_groups_each_equal_the_unsplit_model():
    parts = [[0, 2], [1, 3]]  # stage 1 of the first pair is global rank 2: messages go to global peers
    per_rank = labkit.run(two_pipelines, parts, world_size=4)
    for part, ranks in enumerate(parts):
        kind, m, v, seed = SIDE_BY_SIDE[part]
        loss, grads = reference(seed)
        seen = {}
        for stage, rank in enumerate(ranks):
            mine, result, stage_grads = per_rank[rank]
            assert mine == part and result.stage == stage
            assert [(e.stage, e.kind, e.microbatch, e.chunk) for e in result.events] == \
                [(stage, a.kind, a.microbatch, a.chunk) for a in schedule(kind, 2, m, v)[stage]]
            seen.update(stage_grads)
        assert per_rank[ranks[1]][1].loss == pytest.approx(loss, rel=1e-12, abs=0), part
        assert_equal_gradients(seen, grads, part)


def token_model_step(m):
    """Token ids (a LongTensor) into the first piece; (batch, 6, 8) activations at one boundary and (batch, 48) at
    the next, each chunk's own shape announced by its own header."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.Tanh(), nn.Flatten(1), nn.Linear(48, 4)).double()
    tokens, y = torch.randint(0, 10, (BATCH, 6), generator=torch.Generator().manual_seed(1)), torch.arange(BATCH) % 4
    result = run_pipeline(model, "interleaved", m, tokens, y, F.cross_entropy, 2)
    split = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    loss = F.cross_entropy(model(tokens), y)
    loss.backward()
    return result.loss, loss.item(), {n: (g - model.get_parameter(n).grad).abs().max().item() for n, g in split.items()}


def test_token_ids_enter_the_first_piece_and_each_chunk_boundary_keeps_its_own_shape():
    per_rank = labkit.run(token_model_step, 4, world_size=2)
    assert per_rank[1][0] == pytest.approx(per_rank[1][1], rel=1e-12, abs=0) and per_rank[0][0] is None
    errors = {name: error for *_, stage in per_rank for name, error in stage.items()}
    assert set(errors) == {"0.weight", "1.weight", "1.bias", "4.weight", "4.bias"} and max(errors.values()) < 1e-12


def tensor_parallel_stages():
    """pp = 2 x tp = 2 on 4 ranks: an interleaved pipeline over the pp axis whose pieces hold Megatron MLPs split
    over the tp axis (all-reduces there in the middle of the pipeline's sends), against the unsplit model."""
    mesh = Mesh(pp=2, tp=2)
    torch.manual_seed(0)
    first, last = nn.Linear(16, 32).double(), nn.Linear(32, 4).double()
    mlps = [(nn.Linear(32, 64).double(), nn.Linear(64, 32).double()) for _ in range(3)]
    model = nn.Sequential(first, *[ParallelMLP.from_mlp(a, b, nn.Tanh(), group=mesh.group("tp")) for a, b in mlps],
                          last)
    full = nn.Sequential(first, *[nn.Sequential(a, nn.Tanh(), b) for a, b in mlps], last)
    x, y = make_classification(BATCH, dtype=torch.float64)
    result = run_pipeline(model, "interleaved", 4, x, y, F.cross_entropy, 2, group=mesh.group("pp"))
    split = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(), full.zero_grad()
    loss = F.cross_entropy(full(x), y)
    loss.backward()
    return result.loss, loss.item(), {n: _full_part(model, full, n, g) for n, g in split.items()}


def _full_part(model, full, name, grad):
    """Relative error of a parameter's gradient against the unsplit model's (its shard of it, for a split one)."""
    layer, *rest = name.split(".")
    if not rest[:-1]:  # an unsplit Linear: the same parameter in both
        whole = dict(full.named_parameters())[name].grad
    else:
        linear = getattr(model[int(layer)], rest[0])
        whole = dict(full[int(layer)].named_parameters())[f"{0 if rest[0] == 'fc1' else 2}.{rest[1]}"].grad
        whole = whole[linear.shard] if rest[0] == "fc1" else whole[:, linear.shard] if rest[1] == "weight" else whole
    return ((grad - whole).abs().max() / whole.abs().max()).item()


def test_interleaved_stages_may_hold_tensor_parallel_layers_talking_on_another_axis():
    per_rank = labkit.run(tensor_parallel_stages, world_size=4)
    for rank, (pipelined, unsplit, errors) in enumerate(per_rank):
        assert (pipelined is None) == (rank < 2)  # ranks 2 and 3: the last stage of their pp pair
        assert pipelined is None or pipelined == pytest.approx(unsplit, rel=1e-12, abs=0)
        assert errors and max(errors.values()) <= 1e-12, (rank, errors)
    assert sorted({name.split(".")[0] for *_, errors in per_rank for name in errors}) == list("01234")


# --- The bubble on real ranks, with emulated compute ---

EMULATED = (0.08, 0.08)  # a stage's forward and backward of a micro-batch: 40 ms per chunk at v = 2


def timed(m, v):
    """The measured bubble of interleaved 1F1B (least_bubble: the best of a few runs)."""
    return least_bubble(lambda scale: steps([("interleaved", m, v)], scaled(EMULATED, scale))[0][0],
                        bubble_fraction(labkit.world_size(), m, v))


@pytest.mark.parametrize("p", [2, 3, 4])
def test_measured_interleaved_bubble_is_within_15_percent_of_the_formula(p):
    """m = p: the largest bubble interleaving allows, so that the messages' few milliseconds on a loaded 2-core
    machine (v times as many hops as 1F1B's) stay small beside it."""
    bubble, formula = labkit.run(timed, p, 2, world_size=p)[0], bubble_fraction(p, p, 2)
    assert abs(bubble - formula) <= 0.15 * formula, (p, bubble, formula)
    assert formula < bubble_fraction(p, p)  # interleaving shrinks it: (p-1)/(2m+p-1) < (p-1)/(m+p-1)
