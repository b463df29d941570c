"""The typed boundary between the launcher and its callers (graders): whether a failed call's pool was stopped, the
type and arguments of what each rank raised, and stopping the ranks of one world size, all as data, not prose."""

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
from processes import alive, alive_after

import labkit
from labkit._refusals import ForbiddenCall
from labkit.exercises._kit._messages import first_failure, forbidden_spelling
from labkit.launch.owner import OWNER


def raise_value_error():
    raise ValueError("x", 3)


def one_rank_raises_a_lock():
    if labkit.rank() == 1:
        raise KeyError(threading.Lock(), torch.arange(3))  # a lock does not pickle; a small tensor does
    return labkit.rank()


def test_a_call_that_times_out_says_its_pool_was_stopped():
    before = labkit.run(os.getpid, world_size=2)
    with pytest.raises(labkit.RankTimeout) as info:
        labkit.run(time.sleep, 30, world_size=2, timeout=0.5)
    assert info.value.pool_stopped is True
    assert alive_after(before, 5) == []  # as it says: those ranks are gone


def test_a_failure_every_rank_survived_in_step_keeps_the_pool_and_says_so():
    before = labkit.run(os.getpid, world_size=2)
    with pytest.raises(labkit.RankError) as info:
        labkit.run(raise_value_error, world_size=2)
    assert info.value.pool_stopped is False
    assert labkit.run(os.getpid, world_size=2) == before  # kept, as it says


def test_ranks_out_of_step_after_a_failure_say_the_pool_was_stopped():
    def one_rank_ahead():
        if labkit.rank() == 1:
            dist.all_reduce(torch.ones(1), async_op=True)  # posted, never matched by rank 0
        raise ValueError("both ranks raise, one a collective ahead")
    with pytest.raises(labkit.RankError) as info:
        labkit.run(one_rank_ahead, world_size=2)
    assert info.value.pool_stopped is True and "pool was stopped" in info.value.headline


def test_a_ranks_failure_carries_the_exceptions_type_and_args():
    with pytest.raises(labkit.RankError) as info:
        labkit.run(raise_value_error, world_size=2)
    failures = sorted(info.value.failures, key=lambda f: f.rank)
    assert [(f.rank, f.exception_type, f.exception_args) for f in failures] == [
        (0, "builtins.ValueError", ("x", 3)), (1, "builtins.ValueError", ("x", 3))]
    assert all(f.raised(ValueError) and not f.raised(RuntimeError) for f in failures)


def test_an_argument_that_does_not_pickle_travels_as_its_repr():
    with pytest.raises(labkit.RankError) as info:
        labkit.run(one_rank_raises_a_lock, world_size=2)
    (failure,) = info.value.failures
    lock, tensor = failure.exception_args
    assert failure.exception_type == "builtins.KeyError"
    assert isinstance(lock, str) and "lock" in lock
    assert tensor.tolist() == [0, 1, 2]  # a whole tensor, unpickled here


def test_a_forbidden_call_is_recognised_by_its_type_not_its_text():
    def refused(cls, said):
        raise cls(said)
    with pytest.raises(labkit.RankError) as forbidden:
        labkit.run(refused, ForbiddenCall, "torch.distributed.all_reduce", world_size=2)
    assert first_failure(forbidden.value)[1] == "torch.distributed.all_reduce"
    assert "is switched off while this exercise is graded" in forbidden.value.failures[0].summary
    with pytest.raises(labkit.RankError) as lookalike:  # the same words from another class
        labkit.run(refused, RuntimeError, "torch.distributed.all_reduce is switched off while this exercise is graded",
                   world_size=2)
    assert [forbidden_spelling(f) for f in lookalike.value.failures] == [None, None]


def test_shutdown_of_one_world_size_stops_only_its_pool():
    twos, threes = labkit.run(os.getpid, world_size=2), labkit.run(os.getpid, world_size=3)
    assert len(alive(twos + threes)) == 5
    labkit.shutdown(world_size=2)
    assert OWNER.kept_pool(2) is None
    assert alive_after(twos, 5) == []  # no process left behind
    assert alive(threes) == threes and labkit.run(os.getpid, world_size=3) == threes  # the other pool survived
    assert labkit.run(os.getpid, world_size=2) != twos  # and the next call starts a fresh one


def test_shutdown_of_one_world_size_stops_its_ranks_at_once():
    """What the graders call to stop a pool whose ranks are out of step: no call is run on it."""
    twos, threes = labkit.run(os.getpid, world_size=2), labkit.run(os.getpid, world_size=3)
    start = time.monotonic()
    labkit.shutdown(world_size=3)
    assert time.monotonic() - start < 5  # no call is run: the ranks are stopped
    assert alive_after(threes, 5) == [] and alive(twos) == twos
    assert OWNER.kept_pool(3) is None and OWNER.kept_pool(2).pids() == twos
