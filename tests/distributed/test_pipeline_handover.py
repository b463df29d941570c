"""What a hand-over between pipeline stages costs (labkit.parallel.pipeline.handover: measured on real gloo ranks,
fitted) and measured bubbles with settings taking turns (measured.py)."""

from types import SimpleNamespace

import pytest

import labkit
from labkit.parallel import PipelineEvent, measured_bubble
from labkit.parallel.pipeline import (
    HandOver,
    bubbles_by_round,
    fitted_handover,
    handover_seconds_by_size,
    measure_handover,
    steps_taking_turns,
)


def readings(turns_zero, turns_one, sizes, send=1e-4, recv=2e-5, backend="gloo"):
    """One rank's handover_seconds_by_size readings: its turns per size, its posting times."""
    return {"backend": backend, "sizes": sizes, "turn": turns_zero if turns_one is None else turns_one,
            "send": [[send] * len(t) for t in turns_zero], "recv": [[recv] * len(t) for t in turns_zero]}


def test_the_fit_recovers_the_one_way_time_from_both_ranks_turns():
    """Rank 0's turn is one-way there, rank 1's answer, one-way back: one-way = (turn0 - turn1) / 2."""
    alpha, beta, answer = 4e-4, 1e-9, 0.02
    sizes = [1024, 16384, 262144]
    zero = [[2 * (alpha + n * beta) + answer + wobble for wobble in (0, 1e-5, -1e-5)] for n in sizes]
    one = [[answer] * 3 for _ in sizes]
    handover, one_way = fitted_handover([readings(zero, None, sizes), readings(zero, one, sizes), {"other": 0}])
    assert one_way == pytest.approx({n: alpha + n * beta for n in sizes})
    assert (handover.alpha_seconds, handover.beta_seconds_per_byte) == pytest.approx((alpha, beta), rel=1e-6)
    assert (handover.send_post_seconds, handover.recv_post_seconds, handover.rendezvous) == \
        pytest.approx((1e-4, 2e-5, True))
    nccl, _ = fitted_handover([readings(zero, None, sizes, backend="nccl"), readings(zero, one, sizes)])
    assert not nccl.rendezvous  # NCCL's send does not wait for a posted receive in gloo's way


def test_several_calls_readings_are_merged_size_by_size():
    sizes = [1024, 65536]
    first = readings([[3e-3], [4e-3]], None, sizes), readings([[3e-3], [4e-3]], [[1e-3], [1e-3]], sizes)
    second = readings([[5e-3], [6e-3]], None, sizes), readings([[5e-3], [6e-3]], [[1e-3], [1e-3]], sizes)
    _, one_way = fitted_handover([[first[0], second[0]], [first[1], second[1]]])
    assert one_way == pytest.approx({1024: 1.5e-3, 65536: 2e-3})  # medians of (1e-3, 2e-3) and (1.5e-3, 2.5e-3)


def test_a_hand_over_on_real_ranks_costs_something_and_grows_with_the_bytes():
    handover, one_way = measure_handover(0.005, sizes_nbytes=(1 << 10, 1 << 22), rounds=5)
    assert isinstance(handover, HandOver) and handover.rendezvous  # gloo
    assert handover.alpha_seconds >= 0 and handover.beta_seconds_per_byte > 0
    assert 0 < handover.send_post_seconds < 0.1 and 0 < handover.recv_post_seconds < 0.1
    assert one_way[1 << 22] > one_way[1 << 10] > 0  # 4 MiB take longer than 1 KiB: at least a copy


def test_every_rank_joins_the_barriers_and_only_ranks_0_and_1_hand_over():
    results = labkit.run(handover_seconds_by_size, [1024], 0.0, 2, world_size=3)
    assert [len(r["turn"][0]) for r in results] == [2, 2, 0] and results[0]["sizes"] == [1024]
    with pytest.raises(labkit.RankError, match="needs 2 ranks or more"):
        labkit.run(handover_seconds_by_size, [1024], 0.0, world_size=1)


def test_settings_take_turns_and_each_rounds_bubble_is_over_every_stage():
    order = []

    def step(kind, m):
        order.append((kind, m))
        start = float(len(order))
        return SimpleNamespace(events=[PipelineEvent(0, "F", 0, start, start + 1.0)])

    settings = [("gpipe", 1), ("1f1b", 1), ("gpipe", 2)]
    events = steps_taking_turns(step, settings, 3)
    assert order == settings + settings[1:] + settings[:1] + settings[2:] + settings[:2]  # each round moves on
    assert {s: len(e) for s, e in events.items()} == dict.fromkeys(settings, 3)
    other = {s: [[PipelineEvent(1, "F", 0, e[0].start + 1.0, e[0].start + 2.0)] for e in runs]
             for s, runs in events.items()}  # a second stage, one slot later: half of 2 x 2 idle
    assert bubbles_by_round([events, other]) == {s: [0.5, 0.5, 0.5] for s in settings}
    assert measured_bubble(events[settings[0]][0] + other[settings[0]][0]) == 0.5


def test_a_busy_machines_flat_times_are_measured_again_and_merged(monkeypatch):
    """Times that do not grow with size (noise on a busy machine: fit_point_to_point refuses them) are measured
    again and merged with the first readings, instead of failing the notebook's cell."""
    sizes = [1024, 1 << 20]
    flat = readings([[2e-3], [1e-3]], None, sizes), readings([[2e-3], [1e-3]], [[0.0], [0.0]], sizes)
    growing = readings([[1e-3], [4e-3]], None, sizes), readings([[1e-3], [4e-3]], [[0.0], [0.0]], sizes)
    calls = iter([list(flat), list(growing), list(growing)])
    monkeypatch.setattr(labkit, "run", lambda *args, **kwargs: next(calls))
    handover, one_way = measure_handover(0.02, sizes)
    assert one_way == pytest.approx({1024: 0.75e-3, 1 << 20: 1.25e-3})   # medians of both calls' one-way times
    assert handover.beta_seconds_per_byte > 0 and len(list(calls)) == 1   # fitted at the second call


def test_times_that_never_grow_say_the_machine_is_too_busy(monkeypatch):
    sizes = [1024, 1 << 20]
    flat = readings([[2e-3], [1e-3]], None, sizes), readings([[2e-3], [1e-3]], [[0.0], [0.0]], sizes)
    monkeypatch.setattr(labkit, "run", lambda *args, **kwargs: list(flat))
    with pytest.raises(RuntimeError, match=r"could not be fitted after 4 x 9 rounds: .*rerun the cell"):
        measure_handover(0.02, sizes)
