"""The hang report on real gloo ranks: each stopped rank names the collective it is in, with its number in its
process group (torch's Flight Recorder), and the report says which rank diverged. The comparison's rules are in
tests/unit/test_inflight.py; here the recorder's own entries, as gloo leaves them in a hang."""

import re
import time

import pytest
import torch
import torch.distributed as dist

import labkit

HANG_SECONDS = 3.0  # right calls take milliseconds


def hung(fn, world_size=4) -> str:
    with pytest.raises(labkit.RankTimeout) as info:
        labkit.run(fn, world_size=world_size, timeout=HANG_SECONDS)
    return str(info.value)


def warm_up_then(rest):
    """Two collectives every rank completes, then `rest`. A pool numbers its groups' collectives from its start,
    so a warm pool's numbers depend on what ran before: the tests read k and check the rest against it."""
    def fn():
        t = torch.ones(3, device=labkit.device())
        dist.all_reduce(t)
        dist.broadcast(t, src=0)
        rest(t)
    return fn


def last_rank_skips(t):
    if labkit.rank() != labkit.world_size() - 1:
        dist.all_reduce(t)


def test_ranks_in_all_reduce_while_one_rank_never_calls_it():
    """(a) Notebook 10's case: ranks 0-2 wait in all_reduce #3, rank 3 returned without calling it."""
    report = hung(warm_up_then(last_rank_skips))
    assert "ranks 0-2 still running (rank 3 had returned)" in report
    found = re.search(r"The default group: ranks 0-2 are in all_reduce #(\d+); rank 3 never called all_reduce #\1 "
                      r"\(it has issued (\d+) collectives there, all completed\)\. So rank 3 diverged\.", report)
    assert found and int(found[2]) == int(found[1]) - 1, report
    assert "ranks 0-2: was still running in all_reduce, called from " in report
    assert f"; it is in all_reduce #{found[1]} of the default group" in report


def one_rank_broadcasts(t):
    if labkit.rank() == 1:
        dist.broadcast(t, src=0)
    else:
        dist.all_reduce(t)


def test_one_rank_in_broadcast_while_the_others_are_in_all_reduce():
    """(b) A divergence: at collective #3 of the default group rank 1 called broadcast, the others all_reduce."""
    report = hung(warm_up_then(one_rank_broadcasts))
    found = re.search(r"The default group: ranks 0, 2-3 are in all_reduce #(\d+); rank 1 is in broadcast #\1\. "
                      r"So rank 1 diverged\.", report)
    assert found, report
    assert "rank 1: was still running in broadcast" in report
    assert f"it is in broadcast #{found[1]} of the default group" in report


def async_all_reduce_then_waits_elsewhere(t):
    """As on NCCL, where rank 0's all_reduce returns once queued and the rank waits in torch.cuda.synchronize:
    here an async_op=True all_reduce, then a wait in something that is no collective."""
    if labkit.rank() == 0:
        work = dist.all_reduce(t, async_op=True)
        time.sleep(60)
        work.wait()


def test_a_rank_past_its_queued_all_reduce_is_still_named_in_it():
    """(c) Rank 0 waits in time.sleep, not in a collective: its line and the report still name all_reduce #3."""
    report = hung(warm_up_then(async_all_reduce_then_waits_elsewhere))
    found = re.search(r"The default group: rank 0 is in all_reduce #(\d+); ranks 1-3 never called all_reduce #\1 "
                      r"\(they have issued (\d+) collectives there, all completed\)\. So rank 0 diverged\.", report)
    assert found and int(found[2]) == int(found[1]) - 1, report
    assert "rank 0: was still running in async_all_reduce_then_waits_elsewhere" in report
    assert f"; it is in all_reduce #{found[1]} of the default group" in report


def in_a_sub_group(t):
    """Ranks 0 and 1 all-reduce in their own group; rank 1 skips it."""
    pair = dist.new_group([0, 1])
    if labkit.rank() == 0:
        dist.all_reduce(t, group=pair)


def test_a_sub_group_is_named_with_its_ranks_and_its_own_numbering():
    report = hung(warm_up_then(in_a_sub_group), world_size=2)
    assert re.search(r"Group \d+ \(ranks 0-1\): rank 0 is in all_reduce #1; rank 1 never called all_reduce #1 \(it "
                     r"has issued none there\)\. So rank 1 diverged\.", report), report
    assert "The default group:" not in report  # every collective of the default group completed


def test_a_call_that_fails_without_hanging_has_no_collectives_section():
    def f():
        raise ValueError("no hang here")

    with pytest.raises(labkit.RankError) as info:
        labkit.run(f, world_size=2)
    assert "Flight Recorder" not in str(info.value) and info.value.notes == []
