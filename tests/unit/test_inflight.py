"""labkit.launch.inflight without processes: the Flight Recorder's entries summed per group, and the report that
compares the ranks of a group at its first collective not completed (the same comparison runs on real ranks in
tests/distributed/test_hang_report.py)."""

from labkit.launch.errors import still_running
from labkit.launch.inflight import collectives_report, summed_by_group, where_in_collectives
from labkit.launch.protocol import Frame, GroupCollectives, Stack

WORLD = (0, 1, 2, 3)


def entry(name, seq, group="0", retired=True, state="scheduled", p2p=False):
    return {"profiling_name": name, "collective_seq_id": seq, "process_group": [group, "default_pg"],
            "retired": retired, "state": state, "is_p2p": p2p}


def test_entries_are_summed_per_group_and_backend_and_open_ones_kept_in_order():
    entries = [entry("gloo:all_reduce", 1), entry("gloo:barrier", 2), entry("gloo:broadcast", 4, retired=False),
               entry("gloo:all_reduce", 3, retired=False), entry("nccl:send 0->1", 0, retired=False, p2p=True),
               entry("nccl:all_reduce_barrier", 1, retired=False), entry("nccl:_allgather_base", 2, state="completed",
                                                                       retired=False),
               entry("gloo:all_reduce", 1, group="1"), entry("gloo:all_reduce", 9, group="7", retired=False)]
    assert summed_by_group(entries, {"0": WORLD, "1": (0, 1)}) == (
        GroupCollectives("0", WORLD, "gloo", 4, (("all_reduce", 3), ("broadcast", 4))),
        GroupCollectives("0", WORLD, "nccl", 2, (("barrier", 1),)),  # a completed NCCL entry is not open
        GroupCollectives("1", (0, 1), "gloo", 1, ()),
    )  # point-to-point, and groups this rank is not in, left out
    twice = [entry("nccl:all_reduce", 5, retired=False)] * 2  # one collective in both recorders: said once
    assert summed_by_group(twice, {"0": WORLD})[0].in_flight == (("all_reduce", 5),)


def record(issued, *in_flight, name="0", ranks=WORLD, backend="gloo"):
    return (GroupCollectives(name, ranks, backend, issued, tuple(in_flight)),)


def test_one_rank_that_never_called_the_collective_diverged():
    reported = {0: record(4), 1: record(5, ("all_reduce", 5)), 2: record(5, ("all_reduce", 5)),
                3: record(5, ("all_reduce", 5))}
    assert collectives_report(reported) == [
        "The default group: ranks 1-3 are in all_reduce #5; rank 0 never called all_reduce #5 (it has issued 4 "
        "collectives there, all completed). So rank 0 diverged."]


def test_a_rank_in_another_collective_at_the_same_number_diverged():
    reported = {r: record(17, ("all_reduce", 17)) for r in (0, 1, 2)} | {3: record(17, ("broadcast", 17))}
    assert collectives_report(reported) == [
        "The default group: ranks 0-2 are in all_reduce #17; rank 3 is in broadcast #17. So rank 3 diverged."]


def test_the_first_collective_not_completed_is_compared():
    """On NCCL a rank may have queued several collectives that have not completed: the first, #16, is compared."""
    reported = {r: record(17, ("all_reduce", 16), ("all_reduce", 17)) for r in (0, 1, 2)}
    reported[3] = record(16, ("broadcast", 16))
    (line,) = collectives_report(reported)
    assert "ranks 0-2 are in all_reduce #16; rank 3 is in broadcast #16. So rank 3 diverged." in line


def test_two_ranks_that_disagree_cannot_be_told_apart_but_one_that_skipped_can():
    disagree = {0: record(1, ("all_reduce", 1), ranks=(0, 1)), 1: record(1, ("barrier", 1), ranks=(0, 1))}
    assert collectives_report(disagree) == [
        "The default group: rank 0 is in all_reduce #1; rank 1 is in barrier #1. The ranks disagree at collective "
        "#1 (all_reduce vs barrier, as many ranks each): which one diverged cannot be told."]
    skipped = {0: record(0, ranks=(0, 1)), 1: record(1, ("all_reduce", 1), ranks=(0, 1))}
    assert collectives_report(skipped)[0].endswith(
        "rank 1 is in all_reduce #1; rank 0 never called all_reduce #1 (it has issued none there). So rank 0 diverged.")


def test_a_rank_that_returned_with_an_async_collective_open_is_the_one_in_it():
    reported = {0: record(1, ("all_reduce", 1))} | {r: record(0) for r in (1, 2, 3)}
    assert collectives_report(reported)[0].endswith(
        "rank 0 is in all_reduce #1; ranks 1-3 never called all_reduce #1 (they have issued none there). "
        "So rank 0 diverged.")


def test_groups_and_backends_are_named_and_a_silent_rank_is_said():
    sub = (1, 2)
    reported = {0: None, 1: record(3, ("all_reduce", 3), name="2", ranks=sub, backend="nccl")
                + record(5, name="2", ranks=sub), 2: record(2, name="2", ranks=sub, backend="nccl")}
    assert collectives_report(reported) == [
        "Group 2 (ranks 1-2, nccl): rank 1 is in all_reduce #3; rank 2 never called all_reduce #3 (it has issued 2 "
        "collectives there, all completed). So rank 2 diverged."]
    everyone = {r: record(3, ("all_reduce", 3), ranks=(0, 1, 2)) for r in (1, 2)} | {0: None}
    assert collectives_report(everyone) == [
        "The default group: ranks 1-2 are in all_reduce #3; rank 0 did not say (no answer, or no Flight Recorder). "
        "Every rank that said called it, yet it has not completed: look for what they wait for outside this group "
        "(another group's collective, a point-to-point message)."]
    assert collectives_report({r: record(3) for r in WORLD}) == []  # nothing open: nothing to say


def test_a_rank_s_own_line_names_its_collective_and_a_wait_for_queued_gpu_work():
    mine = record(5, ("all_reduce", 5))
    assert where_in_collectives(mine) == "in all_reduce #5 of the default group"
    assert where_in_collectives(record(5)) == where_in_collectives(None) == ""
    summary, _ = still_running(Stack([Frame("/x/torch/cuda/__init__.py", 1, "synchronize")], synchronizing=True),
                               where_in_collectives(mine))
    assert summary == ("had returned and was waiting for the GPU work it queued (labkit's torch.cuda.synchronize "
                       "before it replies); it is in all_reduce #5 of the default group")
