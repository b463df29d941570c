"""labkit.parallel.pipeline (schedule, timeline, executor): the GPipe and 1F1B schedules (checked against
torch.distributed.pipelining's), the executor on real gloo ranks (pipelined training equals one process's;
activations held per stage; two pipelines side by side on sub-groups), and the bubble: exact in the simulator,
within 15% of (p-1)/(m+p-1) on real ranks with emulated compute."""

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
    count_collectives,
    measured_bubble,
    peak_in_flight,
    run_pipeline,
    schedule,
    simulate_pipeline,
    stage_layers,
)
from labkit.parallel.pipeline import HandOver, communication_plan
from labkit.plan import bubble_fraction

KINDS = ["gpipe", "1f1b"]


# --- Schedules ---

@pytest.mark.parametrize("kind", KINDS)
def test_every_stage_runs_each_forward_and_backward_once_backward_after_forward(kind):
    for p in range(1, 6):
        for m in range(1, 10):
            plan = schedule(kind, p, m)
            assert len(plan) == p
            for r, actions in enumerate(plan):
                assert sorted(actions, key=lambda a: (a.kind, a.microbatch)) == \
                    [Action("B", i) for i in range(m)] + [Action("F", i) for i in range(m)], (kind, p, m, r)
                assert all(actions.index(Action("F", i)) < actions.index(Action("B", i)) for i in range(m))
                assert [a.microbatch for a in actions if a.kind == "F"] == list(range(m))  # in order
                assert [a.microbatch for a in actions if a.kind == "B"] == list(range(m))
                assert peak_in_flight(actions) == (m if kind == "gpipe" else min(p - r, m)), (kind, p, m, r)


def test_the_two_orders_read_as_the_papers_draw_them():
    assert [" ".join(map(str, a)) for a in schedule("gpipe", 2, 3)] == ["F0 F1 F2 B0 B1 B2"] * 2
    assert [" ".join(map(str, a)) for a in schedule("1F1B", 4, 6)] == [  # warm-up min(p - r - 1, m) forwards
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5",
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"]
    assert [" ".join(map(str, a)) for a in schedule("1f1b", 3, 1)] == ["F0 B0"] * 3


@pytest.mark.parametrize("args, message", [
    (("zero-bubble", 2, 4), "kind='zero-bubble': use one of 'gpipe', '1f1b', 'interleaved', 'zb-h1'"),
    (("gpipe", 0, 4), "stages=0: pass a whole number >= 1"),
    (("1f1b", 2, 2.5), "microbatches=2.5: pass a whole number >= 1"),
    (("1f1b", True, 2), "stages=True: pass a whole number >= 1"),
])
def test_bad_arguments_get_clear_errors(args, message):
    with pytest.raises(ValueError, match=message):
        schedule(*args)
    with pytest.raises(ValueError, match=message):
        simulate_pipeline(*args)


def torch_order(kind: str, p: int, m: int) -> list[list[Action]]:
    get_schedule_ops = pytest.importorskip(
        "torch.distributed.pipelining._schedule_visualizer",
        reason="torch's private pipeline-schedule visualizer is gone: nothing to cross-check against").get_schedule_ops
    ops = get_schedule_ops({"gpipe": "GPipe", "1f1b": "1F1B"}[kind], p, m)
    return [[Action(str(a.computation_type.value), a.microbatch_index) for a in stage
             if a is not None and str(a.computation_type.value) in ("F", "B")]  # drop REDUCE_GRAD and padding
            for stage in ops]


@pytest.mark.parametrize("kind", KINDS)
def test_action_order_equals_torchs_schedules(kind):
    """torch 2.13's ScheduleGPipe and Schedule1F1B (pipeline_order, as get_schedule_ops lists it) against ours.
    Schedule1F1B refuses m < p, so those are not compared. One known difference: torch's 1F1B order numbers
    the LAST stage's forwards 1..m instead of 0..m-1 ("3F1 3B0 3F2 3B1 ..." for p=4): its
    Schedule1F1B._get_pipeline_order starts the forward counter at 0 and increments it before each
    steady-state forward, which assumes one warm-up forward, and the last stage has none. Torch's runtime
    (_step_microbatches) counts from 0 and is not affected. With torch's numbering shifted back, the orders
    are equal; should torch fix it, they are equal as they come."""
    for p in range(1, 5):
        for m in range(p if kind == "1f1b" else 1, 9):
            theirs, ours = torch_order(kind, p, m), schedule(kind, p, m)
            assert theirs[:-1] == ours[:-1], (kind, p, m)
            last = theirs[-1]
            if kind == "1f1b" and last != ours[-1]:
                assert [a.microbatch for a in last if a.kind == "F"] == list(range(1, m + 1)), (p, m, last)
                last = [Action(a.kind, a.microbatch - (a.kind == "F")) for a in last]
            assert last == ours[-1], (kind, p, m, last)


# --- The simulator ---

@pytest.mark.parametrize("kind", KINDS)
def test_simulated_bubble_is_the_formula_exactly(kind):
    for p in range(1, 6):
        for m in range(1, 13):
            for forward, backward in [(1.0, 2.0), (1.0, 1.0), (0.3, 0.5)]:
                events = simulate_pipeline(kind, p, m, forward, backward)
                assert measured_bubble(events) == pytest.approx(bubble_fraction(p, m), abs=1e-12), (kind, p, m)
                assert max(e.end for e in events) == pytest.approx((m + p - 1) * (forward + backward))


def test_simulated_timeline_respects_dependencies_and_each_stages_order():
    for kind in KINDS:
        events = simulate_pipeline(kind, 4, 6, forward_seconds=[1, 2, 1, 1], backward_seconds=2, send_seconds=0.25)
        at = {(e.stage, e.kind, e.microbatch): e for e in events}
        assert len(at) == len(events) == 4 * 6 * 2
        for (r, kind_, i), e in at.items():
            assert e.seconds == (([1, 2, 1, 1][r]) if kind_ == "F" else 2)
            if kind_ == "F" and r > 0:
                assert e.start >= at[(r - 1, "F", i)].end + 0.25
            if kind_ == "B":
                assert e.start >= at[(r, "F", i)].end
                if r < 3:
                    assert e.start >= at[(r + 1, "B", i)].end + 0.25
        for r, actions in enumerate(schedule(kind, 4, 6)):
            mine = [e for e in events if e.stage == r]
            assert [(e.kind, e.microbatch) for e in mine] == [(a.kind, a.microbatch) for a in actions]
            assert all(a.end <= b.start for a, b in zip(mine, mine[1:], strict=False))


@pytest.mark.parametrize("kind", KINDS)
def test_free_hand_overs_give_the_formula_whichever_plan_is_walked(kind):
    for p in range(1, 5):
        for m in range(1, 9):
            for ahead in (False, True):
                events = simulate_pipeline(kind, p, m, 1.0, 2.0, handover=HandOver(rendezvous=True),
                                           receives_ahead=ahead)
                assert measured_bubble(events) == pytest.approx(bubble_fraction(p, m), abs=1e-12), (kind, p, m)


def test_a_priced_hand_over_as_worked_by_hand():
    """GPipe, 2 stages, 2 micro-batches, F = B = 1, each send 0.02 to post and there 0.03 after its post began,
    each receive 0.01 to post. Stage 0: F0 0-1, posts the header (until 1.02) and a0 (1.04), F1 1.04-2.04, posts
    a1 (sent from 2.04, posted 2.06) and g0's receive (2.07). Stage 1 posts the header's receive (until 0.01),
    waits for the header (in at 1.03) to make a0's buffer, posts a0's receive (1.04): a0 is in at 1.05, so F0 runs
    1.05-2.05; a1's receive (2.06), a1 in at 2.07: F1 2.07-3.07, B0 3.07-4.07, sends g0 (4.07-4.09, in at 4.10):
    stage 0's B0 4.10-5.10 while stage 1's B1 runs 4.09-5.09, sends g1 (in at 5.12; stage 0 posted its receive
    until 5.11): B1 5.12-6.12."""
    cost = HandOver(alpha_seconds=0.03, send_post_seconds=0.02, recv_post_seconds=0.01)
    events = simulate_pipeline("gpipe", 2, 2, 1.0, 1.0, handover=cost)
    starts = {(e.stage, e.kind, e.microbatch): round(e.start, 6) for e in events}
    assert starts == {(0, "F", 0): 0.0, (0, "F", 1): 1.04, (0, "B", 0): 4.1, (0, "B", 1): 5.12,
                      (1, "F", 0): 1.05, (1, "F", 1): 2.07, (1, "B", 0): 3.07, (1, "B", 1): 4.09}


def test_costlier_hand_overs_leave_a_larger_bubble_and_posting_ahead_saves_gloos_round_trip():
    for kind in KINDS:
        bubbles = [measured_bubble(simulate_pipeline(kind, 4, 8, 0.02, 0.04, handover=HandOver(
            alpha_seconds=a, send_post_seconds=a / 2, recv_post_seconds=a / 8), receives_ahead=True))
            for a in (0.0, 1e-4, 1e-3, 1e-2)]
        assert bubbles[0] == pytest.approx(bubble_fraction(4, 8)) and bubbles == sorted(bubbles), bubbles
        gloo = HandOver(alpha_seconds=1e-3, rendezvous=True)
        late, ahead = (measured_bubble(simulate_pipeline(kind, 4, 8, 0.02, 0.04, handover=gloo, receives_ahead=a))
                       for a in (False, True))
        assert late > ahead > bubble_fraction(4, 8), (kind, late, ahead)
    nbytes = simulate_pipeline("1f1b", 4, 8, handover=HandOver(beta_seconds_per_byte=1e-3), message_nbytes=100)
    assert measured_bubble(nbytes) > bubble_fraction(4, 8)  # 0.1 per message: the bytes count


@pytest.mark.parametrize("call, error, match", [
    (lambda: simulate_pipeline("1f1b", 2, 2, send_seconds=1.0, handover=HandOver()), ValueError,
     "send_seconds=1.0 with a handover"),
    (lambda: simulate_pipeline("1f1b", 2, 2, handover=1e-3), TypeError, "handover=0.001: pass a HandOver"),
    (lambda: HandOver(alpha_seconds=-1.0), ValueError, "alpha_seconds=-1.0"),
    (lambda: HandOver(rendezvous="yes"), TypeError, "rendezvous='yes'"),
    (lambda: simulate_pipeline("1f1b", 2, 2, message_nbytes=-1), ValueError, "message_nbytes=-1"),
    (lambda: simulate_pipeline("1f1b", 2, 2, receives_ahead=None), TypeError, "receives_ahead=None"),
])
def test_the_simulators_bad_arguments_get_clear_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_stage_layers_balance_by_layer_count():
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layers(7, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 7)]
    with pytest.raises(ValueError, match=r"a model of 3 layer\(s\) cannot make 4 stages"):
        stage_layers(3, 4)


@pytest.mark.parametrize("layers, stages", [(5, 2), (7, 4), (8, 4), (3, 3), (16, 5), (1, 1)])
def test_stage_layers_cut_as_tensor_split_cuts(layers, stages):
    cuts = torch.arange(layers).tensor_split(stages)
    assert stage_layers(layers, stages) == [range(int(c[0]), int(c[-1]) + 1) for c in cuts]


@pytest.mark.parametrize("layers, error", [(True, ValueError), (2.5, ValueError), (0, ValueError), ("5", TypeError)])
def test_stage_layers_checks_the_layer_count(layers, error):
    with pytest.raises(error, match=rf"^layers={layers!r}: pass a whole number >= 1"):
        stage_layers(layers, 1)


# --- The executor on real ranks: the same loss and gradients as one process ---

BATCH = 20  # micro-batches of unequal sizes for m = 3, 6, 7, 8: the loss weights must handle them


def train_step(kind, m, emulate=0.0):
    x, y = make_classification(BATCH, dtype=torch.float64)
    model = mlp(layers=3, dtype=torch.float64)  # 7 layers: stages of 2, 2, 2, 1 on 4 ranks
    with count_collectives() as counted:
        result = run_pipeline(model, kind, m, x, y, F.cross_entropy, emulate_compute_seconds=emulate)
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return result, grads, counted


def every_case(cases):
    return [train_step(kind, m) for kind, m in cases]


def reference():
    x, y = make_classification(BATCH, dtype=torch.float64)
    model = mlp(layers=3, dtype=torch.float64)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("p, microbatches", [(1, [1, 4]), (2, range(1, 9)), (3, [1, 3, 8]), (4, [1, 3, 8])])
def test_pipelined_step_equals_one_process_and_holds_the_expected_activations(p, microbatches):
    cases = [(kind, m) for kind in KINDS for m in microbatches]
    per_rank = labkit.run(every_case, cases, world_size=p)
    loss, grads = reference()
    for c, (kind, m) in enumerate(cases):
        seen = {}
        for r, results in enumerate(per_rank):
            result, mine, counted = results[c]
            # one activation forward and one gradient back per micro-batch and boundary, all 64 wide
            boundaries = (r < p - 1) + (r > 0)
            assert dict(counted.calls) == ({"send": 2 * m} if boundaries == 2 else {"send": m} if boundaries else {})
            assert counted.nbytes["send"] == boundaries * BATCH * 64 * 8
            assert result.stage == r and result.layers == (stage_layers(7, p)[r],)
            assert result.peak_in_flight == (m if kind == "gpipe" else min(p - r, m)), (kind, m, r)
            assert [(e.kind, e.microbatch) for e in result.events] == \
                [(a.kind, a.microbatch) for a in schedule(kind, p, m)[r]]
            assert (result.loss is None) == (r < p - 1)
            assert set(mine) == {f"{i}.{w}" for i in result.layers[0] if i % 2 == 0 for w in ("weight", "bias")}
            seen.update(mine)
        assert per_rank[-1][c][0].loss == pytest.approx(loss, rel=1e-12, abs=0), (kind, m)
        assert set(seen) == set(grads)
        for name, grad in seen.items():
            error = (grad - grads[name]).abs().max() / grads[name].abs().max()
            assert error <= 1e-12, (kind, m, name, error.item())


# --- Pipelines on process groups: two side by side in one world ---

SIDE_BY_SIDE = {0: ("1f1b", 3, 1), 1: ("gpipe", 4, 2)}  # by rank parity: schedule, micro-batches, data seed


def reference_on(seed):
    """The unsplit model's loss and gradients on data `seed`, in one process."""
    x, y = make_classification(BATCH, seed=seed, dtype=torch.float64)
    model = mlp(layers=3, seed=seed, dtype=torch.float64)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def two_pipelines(parts):
    """Ranks {0, 2} and {1, 3} (or as `parts` says) each run their own 2-stage pipeline, at the same time, on
    their own model seed and data: stage = rank in the group, messages to the group's other rank."""
    made = [new_group(part) for part in parts]
    part = next(i for i, ranks in enumerate(parts) if labkit.rank() in ranks)
    kind, m, seed = SIDE_BY_SIDE[part]
    x, y = make_classification(BATCH, seed=seed, dtype=torch.float64)
    model = mlp(layers=3, seed=seed, dtype=torch.float64)
    with count_collectives() as counted:
        result = run_pipeline(model, kind, m, x, y, F.cross_entropy, group=made[part])
    return part, result, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}, counted


@pytest.mark.parametrize("parts", [[[0, 2], [1, 3]], [[0, 1], [2, 3]]])
def test_two_pipelines_on_sub_groups_each_equal_the_unsplit_model(parts):
    per_rank = labkit.run(two_pipelines, parts, world_size=4)
    for part, ranks in enumerate(parts):
        kind, m, seed = SIDE_BY_SIDE[part]
        loss, grads = reference_on(seed)
        seen = {}
        for stage, rank in enumerate(ranks):
            mine, result, stage_grads, counted = per_rank[rank]
            assert mine == part and result.stage == stage and result.layers == (stage_layers(7, 2)[stage],)
            assert [(e.stage, e.kind, e.microbatch) for e in result.events] == \
                [(stage, a.kind, a.microbatch) for a in schedule(kind, 2, m)[stage]]
            assert dict(counted.calls) == {"send": m} and counted.nbytes["send"] == BATCH * 64 * 8
            seen.update(stage_grads)
        assert per_rank[ranks[0]][1].loss is None
        assert per_rank[ranks[1]][1].loss == pytest.approx(loss, rel=1e-12, abs=0), parts
        assert set(seen) == set(grads)
        for name, grad in seen.items():
            assert (grad - grads[name]).abs().max() <= 1e-12 * grads[name].abs().max(), (parts, part, name)


def outside_the_group():
    pair = new_group([0, 1])
    x, y = make_classification(8)
    return run_pipeline(mlp(), "gpipe", 2, x, y, F.cross_entropy, group=pair).stage


def test_a_rank_outside_the_group_gets_a_clear_error():
    with pytest.raises(labkit.RankError, match=r"run_pipeline: global rank 2 is not in the group passed as group="):
        labkit.run(outside_the_group, world_size=3, timeout=30)


DISAGREEMENTS = {  # rank 3's (schedule kind, micro-batches, mlp hidden layers) where rank 1 passes ("1f1b", 2, 1)
    "schedule": ("gpipe", 2, 1), "microbatches": ("1f1b", 4, 1), "layers": ("1f1b", 2, 2)}


def one_pair_disagrees(what):
    """Ranks {0, 2} run one pipeline and agree; in the pipeline of ranks {1, 3}, rank 3 passes something else."""
    pairs = [new_group([0, 2]), new_group([1, 3])]
    kind, m, hidden = DISAGREEMENTS[what] if labkit.rank() == 3 else ("1f1b", 2, 1)
    x, y = make_classification(8)
    return run_pipeline(mlp(layers=hidden), kind, m, x, y, F.cross_entropy, group=pairs[labkit.rank() % 2]).loss


@pytest.mark.parametrize("what", DISAGREEMENTS)
def test_stages_that_plan_different_steps_are_told_on_every_stage_not_left_to_hang(what):
    # before the check, rank 1 and 3 each waited for messages of the other's plan until the timeout
    with pytest.raises(labkit.RankError) as raised:
        labkit.run(one_pair_disagrees, what, world_size=4, timeout=60)
    assert sorted(f.rank for f in raised.value.failures) == [1, 3]
    theirs = DISAGREEMENTS[what][:2] + (1, 2 * DISAGREEMENTS[what][2] + 1)  # mlp(layers=n) has 2n + 1 layers
    assert ("ValueError: run_pipeline: the ranks passed different (schedule_kind, microbatches, chunks, layers of "
            f"the model) (rank 1: ('1f1b', 2, 1, 3); rank 3: {theirs}). Pass the same schedule") in str(raised.value)


def batched_as_a_word():
    x, y = make_classification(8)
    run_pipeline(mlp(), "gpipe", 2, x, y, F.cross_entropy, batched="yes")


def test_batched_must_be_a_flag():
    with pytest.raises(labkit.RankError, match=r"batched='yes': pass True or False"):
        labkit.run(batched_as_a_word, world_size=2, timeout=30)


def too_short():
    x, y = make_classification(8)
    run_pipeline(mlp(layers=0), "gpipe", 2, x, y, F.cross_entropy)  # one Linear on two ranks


def test_a_model_with_fewer_layers_than_ranks_gets_a_clear_error():
    with pytest.raises(labkit.RankError, match=r"a model of 1 layer\(s\) cannot make 2 stages"):
        labkit.run(too_short, world_size=2, timeout=30)


def batch_not_in_dim_0():
    model = nn.Sequential(nn.Linear(16, 8), nn.Flatten(0), nn.Unflatten(0, (-1, 8)), nn.Linear(8, 4))
    x, y = make_classification(8)
    run_pipeline(model, "gpipe", 2, x, y, F.cross_entropy)


def test_activations_that_lose_the_batch_dimension_get_a_clear_error():
    with pytest.raises(labkit.RankError) as raised:  # rank 1 waits for an activation that never comes
        labkit.run(batch_not_in_dim_0, world_size=2, timeout=5)
    assert "stage 0's output for micro-batch 0 (4 examples) is torch.float32 (32,): activations between stages " \
        "must have the micro-batch in dim 0." in str(raised.value)


# --- The bubble on real ranks, with emulated compute ---

EMULATED = (0.04, 0.04)  # seconds per forward and per backward: ~1 ms of real overhead per action is small


def timed(kind, m):
    """The measured bubble of `kind` with m micro-batches (least_bubble: the best of a few runs)."""
    return least_bubble(lambda scale: train_step(kind, m, scaled(EMULATED, scale))[0],
                        bubble_fraction(labkit.world_size(), m))


@pytest.mark.parametrize("p", [2, 3, 4])
def test_measured_bubble_is_within_15_percent_of_the_formula(p):
    m = 4
    for kind in KINDS:
        bubble = labkit.run(timed, kind, m, world_size=p)[0]
        formula = bubble_fraction(p, m)
        assert abs(bubble - formula) <= 0.15 * formula, (kind, p, m, bubble, formula)


FIRST_CALL = """
import torch.nn.functional as F
import labkit
from labkit.models import make_classification, mlp
from labkit.parallel import run_pipeline

def step():
    x, y = make_classification(32)
    return run_pipeline(mlp(), "gpipe", 1, x, y, F.cross_entropy, emulate_compute_seconds=(0.02, 0.04)).events

for events in labkit.run(step, world_size=4):
    for e in events:
        print("event", e.kind, e.seconds)
"""


def test_a_fresh_process_first_actions_last_what_was_emulated(script):
    """Fresh ranks' very first step, as notebook 06's first figure runs it: a process's first backward costs
    seconds of one-off imports, which must be paid before the clock starts, not drawn inside a 40 ms bar."""
    code, out, err = script(FIRST_CALL)
    assert code == 0, err
    events = [line.split()[1:] for line in out.splitlines() if line.startswith("event ")]
    assert len(events) == 8
    emulated = {"F": 0.02, "B": 0.04}
    for kind, seconds in events:
        assert emulated[kind] <= float(seconds) <= 1.5 * emulated[kind], (kind, seconds)


# --- Communication that cannot hang under NCCL, and timings that wait for the device ---

def test_the_model_catches_the_old_executors_order():
    """The executor before issue 15, p = 2, m = 1, as it posted: stage 1 its header receive before the barrier
    that stage 0 passes before sending it; stage 0 the gradient's receive before the activation's send. Both
    hang on one stream. So do the plan's groups posted one operation at a time, receive first (any m), or
    send first (1F1B, p = 4): batching is what makes them safe."""
    old = [[("barrier",), ("recv", 1, "gradient", 0), ("send", 1, "header", 0), ("send", 1, "activation", 0)],
           [("recv", 0, "header", 0), ("barrier",), ("recv", 0, "activation", 0), ("send", 0, "gradient", 0)]]
    stuck = stream_deadlock([[(op,) for op in ops] for ops in old])
    assert [[op[0] for op in head] for head in stuck] == [["barrier"], ["recv"]]  # the header's receive
    stuck = stream_deadlock([[(op,) for op in ops if op[0] != "barrier"] for ops in old])  # no barrier: still
    assert [[op[3] for op in head] for head in stuck] == [[("gradient", 0)], [("header", 0)]]

    def one_at_a_time(posts, first):
        return [[(op,) for group in groups for op in sorted(group, key=lambda op: op[0] != first)] for groups in posts]

    assert stream_deadlock(one_at_a_time(plan_posts("gpipe", 2, 2), "recv")) is not None
    assert stream_deadlock(one_at_a_time(plan_posts("1f1b", 4, 4), "send")) is not None
    assert stream_deadlock(plan_posts("1f1b", 4, 4)) is None


@pytest.mark.parametrize("kind", KINDS)
def test_every_plan_completes_on_one_stream_per_rank(kind):
    for p in range(1, 7):
        for m in range(1, 11):
            assert stream_deadlock(plan_posts(kind, p, m)) is None, (kind, p, m)
            for r, steps in enumerate(communication_plan(kind, p, m)):
                assert [s for s in steps if isinstance(s, Action)] == schedule(kind, p, m)[r]


def posting_points(steps):
    """Where each message of a stage's plan is posted: message -> the number of actions before its group."""
    points, actions = {}, 0
    for step in steps:
        if isinstance(step, Action):
            actions += 1
        else:
            points.update(dict.fromkeys(step, actions))
    return points


@pytest.mark.parametrize("kind", KINDS)
def test_receives_posted_ahead_come_earlier_never_before_their_buffer_can_be_made(kind):
    """gloo's plan (receives_ahead): the same actions and messages; every receive posted no later than in the
    NCCL plan, and, but for the first of its kind and chunk, before the action of its kind that comes before its
    own; a gradient's after the forward whose output it is (its buffer is shaped like that output); sends where
    they were. The single-stream model shows why NCCL keeps the other order: there such a plan hangs."""
    moved = 0
    for p in range(1, 6):
        for m in range(1, 11):
            chunks = 2 if kind == "interleaved" else 1
            if kind == "interleaved" and m % p:
                continue
            plan, ahead = (communication_plan(kind, p, m, chunks, receives_ahead=a) for a in (False, True))
            for r in range(p):
                actions = [s for s in plan[r] if isinstance(s, Action)]
                assert [s for s in ahead[r] if isinstance(s, Action)] == actions
                now, before = posting_points(ahead[r]), posting_points(plan[r])
                assert now.keys() == before.keys(), (kind, p, m, r)
                where = {(a.kind, a.microbatch, a.chunk): k for k, a in enumerate(actions)}
                for message, k in now.items():
                    if message.op == "send" or message.what == "header":
                        assert k == before[message], (kind, p, m, r, str(message))
                        continue
                    assert k <= before[message], (kind, p, m, r, str(message))
                    moved += k < before[message]
                    if message.what == "gradient":
                        mine = message.chunk - (r == p - 1)  # the chunk whose output the gradient is for
                        assert k > where[("F", message.microbatch, mine)], (kind, p, m, r, str(message))
    assert moved > 0
    assert stream_deadlock(plan_posts("1f1b", 2, 4, receives_ahead=True)) is not None
    assert stream_deadlock(plan_posts("interleaved", 2, 4, 2, receives_ahead=True)) is not None


def test_receives_ahead_must_be_a_flag():
    with pytest.raises(TypeError, match="receives_ahead=1: pass True or False"):
        communication_plan("1f1b", 2, 2, receives_ahead=1)


def recorded_step(cases, batched):
    """On every rank: each case's groups as posted (with sizes), the result, the gradients, and the
    synchronize calls, through a recording StageLink and a recording labkit.measure.synchronize."""
    from labkit import measure
    from labkit.parallel.pipeline import executor

    posted, synced = [], []

    class Recording(executor.StageLink):
        def barrier(self):
            posted.append((("barrier",),))
            super().barrier()

        def post(self, group):
            posted.append(tuple((m.op, m.peer, m.what, m.microbatch, m.chunk, t.numel() * t.element_size(),
                                 t.device.type) for m, t in group))
            return super().post(group)

    real_link, real_sync = executor.StageLink, measure.synchronize
    executor.StageLink, measure.synchronize = Recording, lambda device: synced.append(str(device))
    try:
        out = []
        for kind, m, chunks in cases:
            posted.clear()
            synced.clear()
            x, y = make_classification(BATCH, dtype=torch.float64)
            model = mlp(layers=3, dtype=torch.float64)
            result = run_pipeline(model, kind, m, x, y, F.cross_entropy, chunks, batched=batched)
            out.append((list(posted), result, {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
                        list(synced)))
        return out
    finally:
        executor.StageLink, measure.synchronize = real_link, real_sync


@pytest.mark.parametrize("batched", [True, False])
def test_posted_groups_follow_the_plan_complete_on_one_stream_and_train_right(batched):
    """On gloo ranks, both paths (one batch_isend_irecv per group, the path NCCL takes, and paired
    isend/irecv, each receive posted ahead): the groups as posted, sizes included, are the plan's (batched: it
    passes the single-stream model); each send's size is its receive's; the step equals one process's; every
    clock reading follows labkit.measure.synchronize(labkit.device())."""
    p, cases = 3, [("gpipe", 3, 1), ("1f1b", 4, 1), ("1f1b", 1, 1), ("interleaved", 6, 2)]
    per_rank = labkit.run(recorded_step, cases, batched, world_size=p)
    loss, grads = reference()
    for c, (kind, m, chunks) in enumerate(cases):
        posts = [[tuple(op[:5] if op[0] != "barrier" else op for op in group) for group in per_rank[r][c][0]]
                 for r in range(p)]
        assert posts == plan_posts(kind, p, m, chunks, receives_ahead=not batched), (kind, m)
        sized = [[tuple(op[:6] if op[0] != "barrier" else op for op in group) for group in per_rank[r][c][0]]
                 for r in range(p)]
        if batched:
            assert stream_deadlock(sized) is None, (kind, m)  # the sizes of each send and its receive agree too
        ends = {}  # (from, to, what, micro-batch, chunk) -> nbytes, as the sender and as the receiver posted it
        for r in range(p):
            for op in (op for group in sized[r] for op in group if op[0] != "barrier"):
                pair = (r, op[1]) if op[0] == "send" else (op[1], r)
                ends.setdefault((*pair, *op[2:5]), {})[op[0]] = op[5]
        assert ends and all(set(sizes) == {"send", "recv"} and len(set(sizes.values())) == 1
                            for sizes in ends.values()), (kind, m)
        assert {op[6] for r in range(p) for group in per_rank[r][c][0] for op in group if len(op) > 1} == {"cpu"}
        seen = {}
        for r in range(p):
            _, result, mine, synced = per_rank[r][c]
            assert synced == ["cpu"] * (1 + 2 * len(result.events)), (kind, m, r)  # the start; each action's two
            seen.update(mine)
        assert per_rank[-1][c][1].loss == pytest.approx(loss, rel=1e-12, abs=0)
        for name, grad in seen.items():
            assert (grad - grads[name]).abs().max() <= 1e-12 * grads[name].abs().max(), (kind, m, name)
