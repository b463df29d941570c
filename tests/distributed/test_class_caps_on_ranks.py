"""The class caps on real ranks: labkit.run and %%ranks past LABKIT_MAX_WORLD_SIZE are refused before any rank
starts, each rank gets at most LABKIT_MAX_THREADS_PER_RANK torch threads, the graders' own calls are not capped,
and the student keeps at most the cap's ranks warm."""

import pytest
import torch
from IPython.testing import globalipapp

import labkit
from labkit.launch import owner, pools_apart

CAP_MESSAGE = ("world_size=16: this class allows at most 4 ranks per call (set by your instructor for this class: "
               "LABKIT_MAX_WORLD_SIZE=4)")


def test_labkit_run_past_the_class_cap_is_refused_with_the_cap(monkeypatch):
    monkeypatch.setenv("LABKIT_MAX_WORLD_SIZE", "4")
    started = owner.OWNER.pools_started
    with pytest.raises(ValueError, match=rf"^{CAP_MESSAGE.replace('(', '[(]').replace(')', '[)]')}"):
        labkit.run(labkit.rank, world_size=16)
    assert owner.OWNER.pools_started == started  # refused before any rank started
    assert labkit.run(labkit.rank, world_size=2) == [0, 1]


def test_a_ranks_cell_past_the_class_cap_is_refused_with_the_cap(monkeypatch):
    monkeypatch.setenv("LABKIT_MAX_WORLD_SIZE", "4")
    shell = globalipapp.start_ipython() or globalipapp.get_ipython()
    shell.run_cell("%load_ext labkit")
    result = shell.run_cell("%%ranks 16\nx = 1")
    assert isinstance(result.error_in_exec, ValueError) and str(result.error_in_exec).startswith(CAP_MESSAGE)


def test_a_bad_cap_is_named_at_the_call(monkeypatch):
    monkeypatch.setenv("LABKIT_MAX_WORLD_SIZE", "lots")
    with pytest.raises(ValueError, match=r"^LABKIT_MAX_WORLD_SIZE='lots': this class cap \(ranks per call\) must be"):
        labkit.run(labkit.rank, world_size=1)


def test_each_rank_gets_at_most_the_class_cap_of_threads(monkeypatch):
    """One rank on this machine's cores would get them all (2 here); the cap of 1 holds it to one."""
    labkit.shutdown(world_size=1)  # threads are set when a rank starts
    monkeypatch.setenv("LABKIT_MAX_THREADS_PER_RANK", "1")
    assert labkit.run(torch.get_num_threads, world_size=1) == [1]
    labkit.shutdown(world_size=1)
    monkeypatch.delenv("LABKIT_MAX_THREADS_PER_RANK")
    assert labkit.run(torch.get_num_threads, world_size=1) == [labkit.launch.threads_per_rank(1)]
    labkit.shutdown(world_size=1)


def test_graders_calls_are_not_capped_and_the_student_keeps_at_most_the_cap_warm(monkeypatch):
    monkeypatch.setenv("LABKIT_MAX_WORLD_SIZE", "2")
    labkit.shutdown()
    with pools_apart("a grader", keep=False):
        assert labkit.run(labkit.rank, world_size=3) == [0, 1, 2]  # the course fixes the graders' sizes
    labkit.run(labkit.rank, world_size=1)
    first = owner.OWNER.serial((1, "gloo", None))
    labkit.run(labkit.rank, world_size=2)  # 1 + 2 > 2: the 1-rank pool makes room
    assert owner.OWNER.why_ended(first) == ("it was stopped to make room for 2 ranks: labkit keeps at most 2 ranks "
                                            "running (LABKIT_MAX_WORLD_SIZE=2, set by your instructor for this class)")
    labkit.shutdown()
