"""The in-memory simulator runs the real algorithms: right answers, the lesson's traffic, model times."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit import comm
from labkit.comm import ring
from labkit.comm.simulator import ALPHA_SECONDS, BETA_SECONDS_PER_BYTE, with_model_times
from labkit.plan.traffic import allreduce_seconds, naive_allreduce_bytes, ring_allreduce_bytes


@settings(max_examples=40, deadline=None)
@given(world_size=st.integers(1, 9), numel=st.integers(0, 50), segment_elements=st.integers(1, 8),
       algorithm=st.sampled_from(["ring_allreduce", "naive_allreduce", "tree_allreduce"]))
def test_simulated_allreduce_is_the_sum(world_size, numel, segment_elements, algorithm):
    inputs = [torch.randint(-5, 6, (numel,)).double() for _ in range(world_size)]
    expected = sum(inputs) if inputs else None
    previous, ring.SEGMENT_NBYTES = ring.SEGMENT_NBYTES, 8 * segment_elements
    try:
        results = comm.run_simulated(algorithm, [t.clone() for t in inputs])[0]
    finally:
        ring.SEGMENT_NBYTES = previous
    assert all(torch.equal(r, expected) for r in results)  # whole numbers: every sum exact, in any order


@pytest.mark.parametrize("world_size", [2, 4, 8, 16])
def test_traffic_matches_the_formulas(world_size):
    numel = 16 * 12  # divisible by every world size here
    nbytes = 4 * numel
    _, transports, _ = comm.run_simulated("ring_allreduce", [torch.zeros(numel) for _ in range(world_size)])
    assert {t.sent_nbytes for t in transports} == {ring_allreduce_bytes(nbytes, world_size)}
    _, transports, _ = comm.run_simulated("naive_allreduce", [torch.zeros(numel) for _ in range(world_size)])
    assert transports[0].sent_nbytes == transports[0].received_nbytes == naive_allreduce_bytes(nbytes, world_size)


def test_ring_steps_phases_and_chunks():
    events = comm.simulate("ring_allreduce", 4, 8)
    assert [e.step for e in events] == [s for s in range(6) for _ in range(4)]
    assert {e.phase for e in events if e.step < 3} == {"reduce-scatter"}
    assert {e.phase for e in events if e.step >= 3} == {"all-gather"}
    assert all(e.dst == (e.src + 1) % 4 for e in events)
    step0 = {e.src: e.chunk for e in events if e.step == 0}
    assert step0 == {0: 3, 1: 0, 2: 1, 3: 2}  # rank r starts by sending chunk r-1


def test_model_times_show_the_hub_waiting_its_turn():
    n, nbytes = 8, 1_000_000
    hub = comm.simulate("naive_allreduce", n, nbytes // 4)
    ring_events = comm.simulate("ring_allreduce", n, nbytes // 4)
    hub_time, ring_time = max(e.end for e in hub), max(e.end for e in ring_events)
    alpha, beta = ALPHA_SECONDS, BETA_SECONDS_PER_BYTE
    assert hub_time == pytest.approx(2 * (n - 1) * (alpha + nbytes * beta))
    assert ring_time == pytest.approx(2 * (n - 1) * (alpha + nbytes / n * beta))
    # one alpha-beta model: the simulator's times are the planner's formulas (Thakur et al. 2005)
    model = {"latency": alpha, "bandwidth": 1 / beta}
    assert hub_time == pytest.approx(allreduce_seconds(nbytes, n, algorithm="naive", **model))
    assert ring_time == pytest.approx(allreduce_seconds(nbytes, n, algorithm="ring", **model))


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 8, 9, 16])
def test_the_tree_takes_2_log2_n_steps_of_the_whole_tensor(world_size):
    nbytes, steps = 4000, (world_size - 1).bit_length()
    events = comm.simulate("tree_allreduce", world_size, nbytes // 4)
    assert sorted({e.step for e in events}) == list(range(2 * steps))
    assert {e.phase for e in events if e.step < steps} == {"reduce"} and all(e.nbytes == nbytes for e in events)
    assert len(events) == 2 * (world_size - 1)                    # every rank but the root: once in, once out
    assert sum(e.src == 0 for e in events) == sum(e.dst == 0 for e in events) == steps   # the root's messages
    model = {"latency": ALPHA_SECONDS, "bandwidth": 1 / BETA_SECONDS_PER_BYTE}
    assert max(e.end for e in events) == pytest.approx(allreduce_seconds(nbytes, world_size, algorithm="tree", **model))


def test_with_model_times_keeps_the_transfers():
    events = comm.simulate("broadcast", 5, 3, torch.float32, 2)
    again = with_model_times(events)
    assert [e.key() for e in again] == [e.key() for e in events]
    assert {e.src for e in events if e.step == 0} == {2}


def test_a_deadlock_is_reported_not_hung(monkeypatch):
    from labkit.comm import simulator as sim
    monkeypatch.setattr(sim, "_WAIT_SECONDS", 0.2)

    def receive_only(t, transport):
        transport.recv(t, (transport.rank + 1) % transport.world_size)
    with pytest.raises(RuntimeError, match="never matched by a send"):
        comm.run_simulated(receive_only, [torch.zeros(1), torch.zeros(1)])


def test_an_unsupported_dtype_is_named():
    with pytest.raises(ValueError, match="labkit.comm does not handle torch.uint16"):
        comm.simulate("ring_allreduce", 2, 4, torch.uint16)


@pytest.mark.parametrize("world_size, numel, error, message", [
    (0, 4, ValueError, r"^world_size=0: pass a whole number >= 1"),
    (2.5, 4, ValueError, r"^world_size=2\.5: pass a whole number >= 1"),
    (True, 4, ValueError, r"^world_size=True: pass a whole number >= 1"),
    ("2", 4, TypeError, r"^world_size='2': pass a whole number >= 1 \(an int, not a bool\), not a str"),
    (2, -1, ValueError, r"^numel=-1: pass a whole number >= 0"),
    (2, True, ValueError, r"^numel=True: pass a whole number >= 0"),  # once taken for a tensor of 1 element
    (2, None, TypeError, r"^numel=None: pass a whole number >= 0"),
])
def test_bad_simulation_arguments(world_size, numel, error, message):
    with pytest.raises(error, match=message):
        comm.simulate("ring_allreduce", world_size, numel)
