"""Measured training-state bytes equal labkit.plan.training_memory's prediction; the AllReduce sweep's rounds; the
clocks that wait for a GPU (synchronize, Stopwatch), checked with a fake CUDA device; the barrier-and-median timing
every benchmark uses (seconds_per_call, median_seconds, seconds_taking_turns, slowest_rank_median)."""

import pytest
import torch

import labkit
from labkit import measure
from labkit.measure import allreduce_sweep, training_state_nbytes
from labkit.plan import training_memory


def test_adam_in_float32_holds_16_bytes_per_parameter():
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 3))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 10)).sum().backward()
    optimizer.step()
    params = sum(p.numel() for p in model.parameters())
    measured = training_state_nbytes(model, optimizer)
    assert {k: measured[k] for k in ("weights", "grads", "optimizer", "total")} == \
        training_memory(params, weight_bytes=4, grad_bytes=4, optimizer_bytes=8)
    assert measured["counters"] == 4 * 4  # one float32 step counter per parameter tensor


def test_master_copies_count_as_optimizer_state_and_tied_weights_once():
    embedding = torch.nn.Embedding(7, 5)
    head = torch.nn.Linear(5, 7, bias=False)
    head.weight = embedding.weight
    model = torch.nn.ModuleList([embedding, head]).to(torch.bfloat16)
    masters = [p.detach().float() for p in model.parameters()]
    optimizer = torch.optim.SGD(masters, lr=0.1)
    measured = training_state_nbytes(model, optimizer, masters)
    assert measured == {"weights": 35 * 2, "grads": 0, "optimizer": 35 * 4, "counters": 0, "total": 35 * 6}


def test_allreduce_sweep_takes_turns_one_round_per_run_and_keeps_the_median(monkeypatch, capsys):
    """labkit.run is replaced by a fake that hands out each round's seconds: no ranks needed."""
    rounds = {"a": iter([[3.0, 30.0], [1.0, 10.0], [2.0, 20.0]]), "b": iter([[5.0, 7.0], [4.0, 9.0], [6.0, 8.0]])}
    calls = []

    def fake_run(fn, sizes, allreduce, repeats, warm_up, world_size, timeout):
        calls.append((allreduce, repeats, warm_up))
        return [next(rounds[allreduce])] * world_size

    monkeypatch.setattr(labkit, "run", fake_run)
    measured = allreduce_sweep([4, 40], {"torch": "a", "ring": "b"}, world_size=2)
    assert measured == {"torch": [2.0, 20.0], "ring": [5.0, 8.0]}             # per size, the median of 3 rounds
    assert [name for name, _, _ in calls] == ["a", "b"] * 3                    # the two take turns
    assert [warm for _, _, warm in calls] == [True, True] + [False] * 4        # only the first round warms up
    assert {repeats for _, repeats, _ in calls} == {1}                         # one timed round per run
    bar = capsys.readouterr().out.rsplit("\r", 1)[-1]                         # the progress bar's last state
    assert bar.startswith("AllReduce sweep: 2 sizes, 3 rounds x 2 AllReduces:") and "6/6" in bar, bar


def test_synchronize_waits_for_a_cuda_device_and_nothing_else(monkeypatch):
    """A fake CUDA device: torch.cuda.synchronize is replaced by a recorder, so no GPU is needed."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", calls.append)
    measure.synchronize("cpu")
    measure.synchronize(torch.device("cpu"))
    assert calls == []
    measure.synchronize(torch.device("cuda", 1))
    measure.synchronize("cuda:0")
    assert calls == [torch.device("cuda", 1), torch.device("cuda", 0)]


class FakeEvent:
    """torch.cuda.Event's timing surface, on the host clock: recorded at a set time, read in milliseconds."""
    now, waited = 0.0, []

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None

    def record(self):
        self.at = FakeEvent.now

    def synchronize(self):
        FakeEvent.waited.append(self)

    def elapsed_time(self, end):
        return (end.at - self.at) * 1e3


def test_stopwatch_marks_cuda_events_and_reads_them_once_reached(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.now, FakeEvent.waited = 5.0, []
    watch = measure.Stopwatch("cuda:0")
    FakeEvent.now = 5.25
    mark = watch.mark()
    FakeEvent.now = 9.0  # the host read later: only the event's time counts
    assert watch.seconds(mark) == pytest.approx(0.25)
    assert FakeEvent.waited == [mark]
    cpu = measure.Stopwatch("cpu")
    assert 0.0 <= cpu.seconds(cpu.mark()) < 1.0 and not isinstance(cpu.mark(), FakeEvent)


def timed_rounds():
    """Inside a rank: the order of synchronize and all_reduce calls while allreduce_seconds_by_size times."""
    log = []
    real = measure.synchronize
    measure.synchronize = lambda device: log.append(("sync", str(device)))
    try:
        measure.allreduce_seconds_by_size([4 << 20, 8 << 20], lambda t: log.append(("call", t.numel())),
                                          repeats=2, warm_up=False)
    finally:
        measure.synchronize = real
    return log


def test_allreduce_timing_synchronizes_before_and_after_each_timed_round():
    log = labkit.run(timed_rounds, world_size=1)[0]
    small = [("sync", "cpu"), ("call", 1 << 20), ("call", 1 << 20), ("sync", "cpu")]  # 2 calls of 4 MiB
    large = [("sync", "cpu"), ("call", 2 << 20), ("sync", "cpu")]
    assert log == small + large + large + small  # the sizes take turns at going first


def test_a_timed_round_waits_at_the_barrier_then_for_the_device(monkeypatch):
    """A fake process group and device: the order of barrier, synchronize and calls, and the group passed."""
    log = []
    monkeypatch.setattr(measure, "group_is_up", lambda: True)
    monkeypatch.setattr(measure.dist, "barrier", lambda group=None: log.append(("barrier", group)))
    monkeypatch.setattr(measure, "synchronize", lambda device: log.append(("sync", str(device))))
    seconds = measure.seconds_per_call(lambda: log.append("call"), calls=3, device="cuda:1", group="evens")
    assert log == [("barrier", "evens"), ("sync", "cuda:1"), "call", "call", "call", ("sync", "cuda:1")]
    assert seconds >= 0.0


def test_outside_a_rank_a_round_has_no_barrier_and_times_on_the_cpu(monkeypatch):
    log = []
    monkeypatch.setattr(measure, "synchronize", lambda device: log.append(str(device)))
    measure.seconds_per_call(lambda: None, calls=2)
    assert log == ["cpu", "cpu"]
    with pytest.raises(ValueError, match="calls=0"):
        measure.seconds_per_call(lambda: None, calls=0)


def test_median_seconds_warms_up_once_then_keeps_the_median_round(monkeypatch):
    rounds, warmed = iter([3.0, 1.0, 9.0, 2.0, 5.0]), []
    monkeypatch.setattr(measure, "seconds_per_call", lambda fn, calls, device, group: next(rounds))
    assert measure.median_seconds(lambda: warmed.append(1), repeats=5) == 3.0
    assert warmed == [1]
    with pytest.raises(ValueError, match="repeats=0"):
        measure.median_seconds(lambda: None, repeats=0)


def test_functions_take_every_place_in_turn(monkeypatch):
    order = []
    monkeypatch.setattr(measure, "seconds_per_call",
                        lambda fn, calls, device, group: order.append((fn(), calls)) or len(order))
    seconds = measure.seconds_taking_turns({"a": lambda: "a", "b": lambda: "b", "c": lambda: "c"}, rounds=3,
                                           calls={"a": 1, "b": 2, "c": 3})
    assert [name for name, _ in order] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert set(order) == {("a", 1), ("b", 2), ("c", 3)}
    assert seconds == {"a": [1, 6, 8], "b": [2, 4, 9], "c": [3, 5, 7]}
    assert measure.seconds_taking_turns({}, rounds=3) == {}


def test_the_slowest_rank_of_each_round_then_the_median():
    per_rank = [{"torch": [1.0, 2.0, 9.0], "ring": [4.0, 4.0, 4.0]},
                {"torch": [3.0, 1.0, 1.0], "ring": [5.0, 1.0, 6.0]}]
    assert measure.slowest_rank_median(per_rank) == {"torch": 3.0, "ring": 5.0}


def time_on_my_group(repeats_by_group):
    """Inside a rank of 4: ranks {1, 3} and {0, 2} time on their own group, a different number of rounds each."""
    import torch.distributed as dist

    odd, even = dist.new_group([1, 3]), dist.new_group([0, 2])
    mine = odd if labkit.rank() % 2 else even
    repeats = repeats_by_group[labkit.rank() % 2]
    barriers = []
    real = dist.barrier
    dist.barrier = lambda group=None: barriers.append(group is mine) or real(group=group)
    try:
        measure.median_seconds(lambda: None, repeats=repeats, group=mine)
    finally:
        dist.barrier = real
    return barriers


def test_rounds_wait_only_for_their_own_group():
    """A world barrier would hang here: the two groups time 2 and 5 rounds."""
    per_rank = labkit.run(time_on_my_group, (2, 5), world_size=4, timeout=60)
    assert per_rank == [[True] * 2, [True] * 5, [True] * 2, [True] * 5]


def test_the_peak_of_a_step_holds_the_gradients_that_zero_grad_frees_at_its_end():
    model = torch.nn.Linear(100, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with measure.peak_training_state(model, optimizer) as peak:
        model(torch.randn(4, 100)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert training_state_nbytes(model, optimizer)["grads"] == 0
    assert peak.nbytes == {"weights": 4040, "grads": 4040, "optimizer": 4040, "counters": 0, "total": 12120}
    assert peak.samples > 4


def test_storage_counts_once_freed_storage_not_at_all_and_grads_of_what_the_optimizer_updates():
    """Views of one flat buffer (as sharded parameters are) count its bytes once; a storage resized to 0 (a
    gathered parameter freed) counts nothing; a gradient held only by the optimizer's own tensors counts."""
    flat = torch.zeros(30)
    model = torch.nn.Module()
    model.a, model.b = torch.nn.Parameter(flat[:10]), torch.nn.Parameter(flat[10:])
    shard = torch.nn.Parameter(torch.zeros(5))
    shard.grad = torch.ones(5)
    optimizer = torch.optim.SGD([shard], lr=0.1)
    assert training_state_nbytes(model, optimizer) == {"weights": 120, "grads": 20, "optimizer": 0, "counters": 0,
                                                      "total": 140}
    flat.untyped_storage().resize_(0)
    assert training_state_nbytes(model, optimizer)["weights"] == 0


def test_a_timing_check_that_fails_prints_lines_a_notebook_shows_unbroken(capsys):
    """Notebook 08's claim and measurement made a 186-character line when the timing did not hold (issue 27's
    browser run); every printed line stays within labkit.tables.LINE_CHARS."""
    from labkit.measure import timing_check
    from labkit.tables import LINE_CHARS

    claim = "the handover of a micro-batch's activations takes about what its bytes over the bandwidth predict"
    assert timing_check(False, claim, "41.0 ms measured against 12.0 ms predicted from 3.1 MB at 0.26 GB/s") is False
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) > 1 and max(map(len, lines)) <= LINE_CHARS, lines
