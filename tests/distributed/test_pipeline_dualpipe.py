"""DualPipeV (DeepSeek-V3's DualPipe in its one-direction V form), simulated: its order against torch 2.13's
ScheduleDualPipeV, its V layout, its simulated timeline's dependencies and bubble beside ZB-H1's and 1F1B's, and
its refusals (the executor runs looped layouts only)."""

from unittest import mock

import pytest
import torch.nn.functional as F
from nccl_stream_model import plan_posts, stream_deadlock

import labkit
from labkit.models import make_classification, mlp
from labkit.parallel import measured_bubble, peak_in_flight, run_pipeline, schedule, simulate_pipeline
from labkit.parallel.pipeline import Action, communication_plan
from labkit.parallel.pipeline.layout import piece, piece_after, piece_before

TORCH_KINDS = {"F": "F", "I": "B", "W": "W", "B": "BW"}   # torch's FULL_BACKWARD is "B"; its BACKWARD_INPUT "I"


def torch_dualpipe_v(p, m):
    """torch's ScheduleDualPipeV.pipeline_order (a mocked PipelineStage, as its _schedule_visualizer builds one),
    each overlapped F+B written as its two sub-actions, stage index s < p as chunk 0 and 2p-1-r as chunk 1."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    stage_module = pytest.importorskip("torch.distributed.pipelining.stage")
    stage = mock.create_autospec(stage_module.PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, p, None, 2 * p
    order = schedules.ScheduleDualPipeV([stage, stage], m).pipeline_order
    ranks = []
    for r in range(p):
        actions = []
        for action in (a for a in order[r] if a is not None):
            for one in action.sub_actions or (action,):
                assert one.stage_index in (r, 2 * p - 1 - r)   # torch's V: rank r holds stages r and 2p-1-r
                actions.append(Action(TORCH_KINDS[str(one.computation_type.value)], one.microbatch_index,
                                      int(one.stage_index >= p)))
        ranks.append(actions)
    return ranks


def test_order_equals_torchs_dualpipe_v():
    for p in range(1, 6):
        for m in range(2 * p, 4 * p + 2):
            assert torch_dualpipe_v(p, m) == schedule("dualpipe-v", p, m), (p, m)


def test_every_piece_runs_each_forward_once_and_its_backward_whole_or_as_b_then_w():
    for p in range(1, 6):
        for m in range(2 * p, 3 * p + 2):
            for r, actions in enumerate(schedule("dualpipe-v", p, m)):
                at = {(a.kind, a.microbatch, a.chunk): k for k, a in enumerate(actions)}
                assert len(at) == len(actions)
                for chunk in (0, 1):
                    for i in range(m):
                        whole, split = ("BW", i, chunk) in at, ("B", i, chunk) in at
                        assert whole != split and (whole or ("W", i, chunk) in at), (p, m, r, i, chunk)
                        backward = at["BW" if whole else "B", i, chunk]
                        assert at["F", i, chunk] < backward and (whole or backward < at["W", i, chunk])
                assert peak_in_flight(actions) <= 2 * m


def test_the_v_layout():
    """Stage r holds pieces r and 2p-1-r: down the stages through chunk 0, back up through chunk 1; the last
    stage hands on to itself, stage 0 holds the first and the last piece."""
    p = 4
    assert [(piece("dualpipe-v", r, 0, p), piece("dualpipe-v", r, 1, p)) for r in range(p)] == \
        [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert piece_after("dualpipe-v", 3, 0, p, 2) == (3, 1) and piece_before("dualpipe-v", 3, 1, p, 2) == (3, 0)
    assert piece_after("dualpipe-v", 0, 1, p, 2) is None and piece_before("dualpipe-v", 0, 0, p, 2) is None
    assert piece_after("dualpipe-v", 1, 1, p, 2) == (0, 1)
    assert piece_after("interleaved", 3, 0, p, 2) == (0, 1)   # looped: the last stage hands on to the first


def test_messages_go_between_v_neighbours_and_never_from_a_stage_to_itself():
    p, m = 3, 7
    plans = communication_plan("dualpipe-v", p, m)
    sends, receives = set(), set()
    for r, steps in enumerate(plans):
        for step in steps:
            if isinstance(step, Action):
                continue
            for message in step:
                assert message.peer != r and abs(message.peer - r) == 1
                key = (message.what, message.chunk, message.microbatch)
                (sends if message.op == "send" else receives).add((*key, *(
                    (r, message.peer) if message.op == "send" else (message.peer, r))))
    assert sends == receives
    # per (micro-batch, chunk): an activation and a gradient across each of the p-1 boundaries of its leg
    assert len([s for s in sends if s[0] == "activation"]) == len([s for s in sends if s[0] == "gradient"]) == \
        2 * (p - 1) * m


def test_the_simulated_timeline_keeps_every_dependency_of_the_v():
    p, m = 4, 9
    events = simulate_pipeline("dualpipe-v", p, m, 1.0, 2.0, send_seconds=0.125)
    at = {(e.kind, e.microbatch, e.chunk, e.stage): e for e in events}
    backward = {(i, c, s): at.get(("BW", i, c, s)) or at[("B", i, c, s)] for (_, i, c, s) in at}
    for (kind, i, c, s), e in at.items():
        if kind == "F" and piece_before("dualpipe-v", s, c, p, 2):
            before_stage, before_chunk = piece_before("dualpipe-v", s, c, p, 2)
            gap = 0.0 if before_stage == s else 0.125   # in place on the V's bottom: no message
            assert e.start >= at[("F", i, before_chunk, before_stage)].end + gap - 1e-12
        if kind in ("B", "BW") and piece_after("dualpipe-v", s, c, p, 2):
            after_stage, after_chunk = piece_after("dualpipe-v", s, c, p, 2)
            gap = 0.0 if after_stage == s else 0.125
            assert e.start >= backward[(i, after_chunk, after_stage)].end + gap - 1e-12
        assert e.seconds == pytest.approx({"F": 0.5, "B": 0.5, "W": 0.5, "BW": 1.0}[kind])   # a chunk: half
    for r, actions in enumerate(schedule("dualpipe-v", p, m)):
        mine = [e for e in events if e.stage == r]
        assert [(e.kind, e.microbatch, e.chunk) for e in mine] == [(a.kind, a.microbatch, a.chunk) for a in actions]
        assert all(a.end <= b.start + 1e-12 for a, b in zip(mine, mine[1:], strict=False))


def test_with_the_same_work_dualpipe_v_idles_less_than_zb_h1_which_idles_less_than_1f1b():
    for p in range(2, 6):
        for m in range(2 * p, 4 * p + 1, p):
            bubbles = [measured_bubble(simulate_pipeline(kind, p, m, 1.0, 2.0))
                       for kind in ("dualpipe-v", "zb-h1", "1f1b")]
            assert bubbles == sorted(bubbles) and len(set(bubbles)) == 3, (p, m, bubbles)


def test_the_plan_as_posted_would_hang_on_ncclss_one_stream():
    """The plan is the simulator's: posted so on NCCL's one stream per rank it would hang (the V's two
    directions cross at every pair of stages), one reason run_pipeline refuses the V."""
    assert stream_deadlock(plan_posts("dualpipe-v", 2, 4)) is not None


@pytest.mark.parametrize("call, message", [
    (lambda: schedule("dualpipe-v", 3, 5), r"microbatches=5: 'dualpipe-v' needs at least 2 x stages = 6"),
    (lambda: schedule("dualpipe-v", 2, 4, chunks=3), "chunks=3: 'dualpipe-v' runs two chunks per stage"),
    (lambda: simulate_pipeline("dualpipe-v", 2, 3), r"microbatches=3: 'dualpipe-v' needs at least 2 x stages = 4"),
])
def test_bad_arguments_get_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def dualpipe_step():
    x, y = make_classification(8)
    return run_pipeline(mlp(), "dualpipe-v", 4, x, y, F.cross_entropy)


def test_the_executor_refuses_the_v_on_every_rank_and_says_where_it_is_simulated():
    with pytest.raises(labkit.RankError) as refused:
        labkit.run(dualpipe_step, world_size=2)
    assert "a V-shaped schedule is simulated only: simulate_pipeline('dualpipe-v', stages, microbatches)" in \
        str(refused.value)
