"""Zero-bubble ZB-H1: the backward split into B (input gradient) and W (weight gradient). Its order against
torch 2.13's ScheduleInterleavedZeroBubble, its plans on NCCL's one stream, its simulated bubble against
(p-1)(F+B-W), the split backward against loss.backward(), and the executor on real gloo ranks against one
process and against the formula."""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from least_bubble import least_bubble, scaled
from nccl_stream_model import plan_posts, stream_deadlock
from torch import nn

import labkit
from labkit.models import make_classification, mlp
from labkit.parallel import (
    count_collectives,
    measured_bubble,
    peak_in_flight,
    run_pipeline,
    schedule,
    simulate_pipeline,
)
from labkit.parallel.pipeline import Action, communication_plan
from labkit.parallel.pipeline.split_backward import backward_input, backward_weight, split_forward
from labkit.plan import bubble_fraction, zero_bubble_fraction

# --- The order ---


def test_the_order_reads_as_the_paper_draws_it():
    """p = 4, m = 8 (Qi et al. 2023, figure 3, ZB-H1): 1F1B's warm-up, B alone in the steady state, stage r
    putting its first r W's off; the last stage ends on the three W's that fill 1F1B's cool-down."""
    assert [" ".join(map(str, a)) for a in schedule("zb-h1", 4, 8)] == [
        "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7",
        "F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7",
        "F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7",
        "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7"]


def torch_zero_bubble(p, m):
    """torch's ScheduleInterleavedZeroBubble (ZB1P) with one stage per rank: its pipeline_order, as
    torch.distributed.pipelining._schedule_visualizer.get_schedule_ops builds it (a mocked PipelineStage; that
    helper itself insists on two stages per rank), with torch's I (backward input) as our B."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    stage_module = pytest.importorskip("torch.distributed.pipelining.stage")
    stage = mock.create_autospec(stage_module.PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, p, None, p
    order = schedules.ScheduleInterleavedZeroBubble([stage], m).pipeline_order
    ours = {"F": "F", "I": "B", "W": "W"}
    return [[Action(ours[str(a.computation_type.value)], a.microbatch_index) for a in order[r] if a is not None]
            for r in range(p)]


def test_order_equals_torchs_zero_bubble_schedule():
    """Every p <= 5 and m <= 3p + 2 that torch takes (it refuses an m that its rounds of m // p do not divide;
    with one stage per rank the rounds change nothing, so this takes them all)."""
    compared = 0
    for p in range(1, 6):
        for m in range(1, 3 * p + 3):
            try:
                theirs = torch_zero_bubble(p, m)
            except ValueError as refused:
                assert "multiple of the number of rounds" in str(refused)
                continue
            assert theirs == schedule("zb-h1", p, m), (p, m)
            compared += 1
    assert compared >= 40   # of 55


def test_every_stage_runs_each_f_b_and_w_once_in_dependency_order():
    for p in range(1, 6):
        for m in range(1, 11):
            for r, actions in enumerate(schedule("zb-h1", p, m)):
                assert sorted((a.kind, a.microbatch) for a in actions) == sorted(
                    (kind, i) for kind in "FBW" for i in range(m))
                at = {(a.kind, a.microbatch): k for k, a in enumerate(actions)}
                assert all(at["F", i] < at["B", i] < at["W", i] for i in range(m)), (p, m, r)
                for kind in "FBW":
                    assert [a.microbatch for a in actions if a.kind == kind] == list(range(m))
                # W holds the activations: min(p, m) on every stage, 1F1B's peak (its first stage's)
                assert peak_in_flight(actions) == min(p, m), (p, m, r)


def test_plans_send_no_message_for_w_and_complete_on_one_stream_per_rank():
    for p in range(1, 7):
        for m in range(1, 11):
            assert stream_deadlock(plan_posts("zb-h1", p, m)) is None, (p, m)
            one_f_one_b = communication_plan("1f1b", p, m)
            for r, steps in enumerate(communication_plan("zb-h1", p, m)):
                assert [s for s in steps if isinstance(s, Action)] == schedule("zb-h1", p, m)[r]
                messages = sorted(str(m) for s in steps if not isinstance(s, Action) for m in s)
                assert messages == sorted(str(m) for s in one_f_one_b[r] if not isinstance(s, Action) for m in s)


# --- The simulator and the formula ---

@pytest.mark.parametrize("forward, backward_input, backward_weight", [(1, 1, 1), (1, 2, 1), (2, 1, 0.5), (1, 1, 0)])
def test_simulated_bubble_is_the_zero_bubble_formula_exactly(forward, backward_input, backward_weight):
    """(p-1)(F+B-W) idle per stage for m >= p and W <= min(F, B), as Qi et al. assume; 1F1B's, with the same
    work, (p-1)(F+B+W)."""
    for p in range(1, 6):
        for m in range(p, 3 * p + 2):
            events = simulate_pipeline("zb-h1", p, m, forward, backward_input + backward_weight,
                                       weight_seconds=backward_weight)
            work = m * (forward + backward_input + backward_weight)
            assert max(e.end for e in events) == pytest.approx(work + (p - 1) * (forward + backward_input
                                                                                  - backward_weight))
            formula = zero_bubble_fraction(p, m, forward, backward_input, backward_weight)
            assert measured_bubble(events) == pytest.approx(formula, abs=1e-12), (p, m)
            one_f_one_b = simulate_pipeline("1f1b", p, m, forward, backward_input + backward_weight)
            assert measured_bubble(one_f_one_b) == pytest.approx(bubble_fraction(p, m), abs=1e-12)
            if p > 1 and backward_weight:   # with no W to defer, ZB-H1 is 1F1B
                assert measured_bubble(events) < measured_bubble(one_f_one_b)
            else:
                assert measured_bubble(events) == pytest.approx(measured_bubble(one_f_one_b), abs=1e-12)


def test_the_equal_cost_case_is_a_third_of_1f1bs_idle_time():
    assert zero_bubble_fraction(4, 8) == pytest.approx(3 / 27)
    assert zero_bubble_fraction(4, 8, 1, 1, 1) * 27 == pytest.approx((4 - 1) * 1)   # 1F1B: (p-1)(F+B+W) = 9
    assert zero_bubble_fraction(1, 3) == 0.0


def test_a_w_longer_than_f_or_b_leaves_more_than_the_formula():
    """Where W > min(F, B) the deferred W's no longer fit the gaps: the simulated timeline idles more than
    (p-1)(F+B-W), which is why the formula refuses those costs."""
    events = simulate_pipeline("zb-h1", 4, 8, 1.0, 3.0, weight_seconds=2.0)
    assert max(e.end for e in events) - 8 * 4.0 > 3 * (1 + 1 - 2)
    with pytest.raises(ValueError, match=r"backward_weight=2\.0 > min\(forward, backward_input\)=1"):
        zero_bubble_fraction(4, 8, 1.0, 1.0, 2.0)


@pytest.mark.parametrize("call, message", [
    (lambda: zero_bubble_fraction(4, 3), r"microbatches=3 < stages=4: \(p-1\)\(F\+B-W\) holds from m >= p"),
    (lambda: zero_bubble_fraction(0, 3), "stages=0: pass a whole number >= 1"),
    (lambda: zero_bubble_fraction(2, 3, forward=-1), "forward=-1"),
    (lambda: simulate_pipeline("1f1b", 2, 4, weight_seconds=0.5), r"weight_seconds=0\.5: '1f1b' runs each "
                                                                   "backward whole"),
    (lambda: simulate_pipeline("zb-h1", 2, 4, 1.0, 2.0, weight_seconds=3.0), r"weight_seconds=3\.0: the W is a "
                                                                              "part of the backward"),
    (lambda: schedule("zb-h1", 2, 4, chunks=2), "chunks=2: 'zb-h1' runs one chunk per stage"),
])
def test_bad_arguments_get_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_simulated_timeline_keeps_each_stages_order_and_every_dependency():
    events = simulate_pipeline("zb-h1", 4, 6, forward_seconds=[1, 2, 1, 1], backward_seconds=2, send_seconds=0.25,
                               weight_seconds=0.5)
    at = {(e.stage, e.kind, e.microbatch): e for e in events}
    assert len(at) == len(events) == 4 * 6 * 3
    for (r, kind, i), e in at.items():
        assert e.seconds == {"F": [1, 2, 1, 1][r], "B": 1.5, "W": 0.5}[kind]
        if kind == "B" and r < 3:   # B waits for the next stage's B (its input gradient), W for nobody else
            assert e.start >= at[(r + 1, "B", i)].end + 0.25
        if kind == "W":
            assert e.start >= at[(r, "B", i)].end
    for r, actions in enumerate(schedule("zb-h1", 4, 6)):
        mine = [e for e in events if e.stage == r]
        assert [(e.kind, e.microbatch) for e in mine] == [(a.kind, a.microbatch) for a in actions]


# --- The split backward, in one process ---

class TwoUses(nn.Module):
    """A layer using one shared Linear, so that its weights get gradients from two layers of the model."""

    def __init__(self, shared: nn.Linear):
        super().__init__()
        self.shared = shared

    def forward(self, x):
        return torch.tanh(self.shared(x))


def split_model(seed=0):
    torch.manual_seed(seed)
    shared = nn.Linear(6, 6)
    return nn.Sequential(nn.Embedding(10, 6), nn.ReLU(), shared, TwoUses(shared), nn.Linear(6, 3)).double()


def test_split_backward_gives_loss_backwards_gradients_and_b_computes_no_weight_gradient():
    """Token ids in (no input gradient), a parameter-free layer, a Linear used by two layers: B leaves every
    .grad untouched; W then gives what loss.backward() gives. Same operations, but the split sums the shared
    weight's two contributions in its own order: 1e-12, relative."""
    tokens, targets = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(1)), torch.arange(8) % 3
    reference = split_model()
    F.cross_entropy(reference(tokens), targets).backward()
    model = split_model()
    pieces = split_forward(model, tokens, then=lambda out: F.cross_entropy(out, targets))
    assert backward_input(pieces, None) is None
    assert all(p.grad is None for p in model.parameters())
    backward_weight(pieces)
    for (name, got), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.allclose(got.grad, want.grad, rtol=1e-12, atol=0), name


def test_split_backward_returns_the_input_gradient():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 5), nn.GELU(), nn.Linear(5, 2)).double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(3, 2, dtype=torch.float64)
    model(x).backward(grad_out)
    want = x.grad.clone()
    pieces = split_forward(model, x.detach().requires_grad_())
    got = backward_input(pieces, grad_out)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-15)


# --- The executor on real ranks ---

BATCH = 20


def train_step(kind, m, emulate=0.0):
    x, y = make_classification(BATCH, dtype=torch.float64)
    model = mlp(layers=3, dtype=torch.float64)   # 7 layers: stages of 2, 2, 2, 1 on 4 ranks
    with count_collectives() as counted:
        result = run_pipeline(model, kind, m, x, y, F.cross_entropy, emulate_compute_seconds=emulate)
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return result, grads, dict(counted.calls), counted.nbytes.get("send", 0)


def both_schedules(ms):
    return [(train_step("zb-h1", m), train_step("1f1b", m)) for m in ms]


@pytest.mark.parametrize("p, ms", [(2, [1, 2, 5]), (3, [2, 3, 7]), (4, [1, 4, 8])])
def test_zero_bubble_step_equals_one_process_and_sends_what_1f1b_sends(p, ms):
    """The loss and every gradient equal one process's (float64; the split backward sums the same products in
    its own order: 1e-12, relative), each stage's events in ZB-H1's order, the messages and their bytes 1F1B's,
    the activations held what peak_in_flight counts."""
    x, y = make_classification(BATCH, dtype=torch.float64)
    reference = mlp(layers=3, dtype=torch.float64)
    loss = F.cross_entropy(reference(x), y)
    loss.backward()
    per_rank = labkit.run(both_schedules, ms, world_size=p)
    for c, m in enumerate(ms):
        seen = {}
        for r, cases in enumerate(per_rank):
            (result, grads, calls, nbytes), (_, _, calls_1f1b, nbytes_1f1b) = cases[c]
            assert [(e.kind, e.microbatch) for e in result.events] == \
                [(a.kind, a.microbatch) for a in schedule("zb-h1", p, m)[r]]
            assert (calls, nbytes) == (calls_1f1b, nbytes_1f1b)
            assert result.peak_in_flight == peak_in_flight(schedule("zb-h1", p, m)[r])
            seen.update(grads)
        assert per_rank[-1][c][0][0].loss == pytest.approx(loss.item(), rel=1e-12, abs=0)
        assert set(seen) == {name for name, _ in reference.named_parameters()}
        for name, want in reference.named_parameters():
            error = (seen[name] - want.grad).abs().max() / want.grad.abs().max()
            assert error <= 1e-12, (m, name, error.item())


EMULATED = (0.04, 0.04)   # forward, backward (B and W 0.02 each): as test_pipeline_parallel.py's


def timed(m):
    forward, backward = EMULATED
    formula = zero_bubble_fraction(labkit.world_size(), m, forward, backward / 2, backward / 2)
    return least_bubble(lambda scale: train_step("zb-h1", m, scaled(EMULATED, scale))[0], formula)


@pytest.mark.parametrize("p", [2, 4])
def test_measured_zero_bubble_is_within_15_percent_of_the_formula_and_below_1f1bs(p):
    m = 4
    bubble = labkit.run(timed, m, world_size=p)[0]
    formula = zero_bubble_fraction(p, m, EMULATED[0], EMULATED[1] / 2, EMULATED[1] / 2)
    assert abs(bubble - formula) <= 0.15 * formula, (p, m, bubble, formula)
    assert bubble < bubble_fraction(p, m)


class Constant(nn.Module):
    """A layer whose output ignores its input: nothing flows back through it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("value", torch.ones(4, dtype=torch.float64))

    def forward(self, x):
        return self.value.expand(x.shape[0], 4)


def test_layers_no_gradient_reaches_keep_no_grad_and_the_stage_still_sends_one():
    """Behind a layer that ignores its input, loss.backward() leaves the earlier weights' .grad None: so do B and
    W (a review found B stopping there and W then failing). The chunk's input gets zeros, which its previous stage
    waits for."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 4), Constant(), nn.Linear(4, 2)).double()
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    pieces = split_forward(model, x, then=lambda out: out.pow(2).sum())
    grad = backward_input(pieces, None)
    backward_weight(pieces)
    assert torch.equal(grad, torch.zeros_like(x))
    assert model[0].weight.grad is None and model[0].bias.grad is None
    want = torch.autograd.grad(model[2](torch.ones(5, 4, dtype=torch.float64)).pow(2).sum(), model[2].weight)[0]
    assert torch.allclose(model[2].weight.grad, want, rtol=1e-12, atol=0)


def test_a_layer_working_in_place_on_its_input_is_refused_by_name():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"layer 1 \(ReLU\) works in place on its input.*nn.ReLU\(inplace=False\)"):
        split_forward(model, torch.randn(3, 4))
