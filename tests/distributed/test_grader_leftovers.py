"""What a graded solution leaves in its ranks never reaches later, unrelated calls (issue 28's probes): graders grade
on ranks of their own (labkit.launch.pools_apart), and a pool whose ranks found leftovers after a graded call
(labkit.exercises._kit._leftovers) is stopped. Each probe checks the student's next call and the next grading of
a right solution; on main, with the graders' pools the student's own and kept, each of them failed."""

import os
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_exercise_atomic_save import named_temporary_file  # a right atomic save
from test_exercise_average import loop_all_reduce_div  # a right average_gradients
from test_exercises import notebook_02_solution  # a right naive all_reduce

import labkit
from labkit.exercises import check_atomic_save, check_average_gradients, check_naive_allreduce
from labkit.exercises._kit._intercept import Interceptor
from labkit.exercises._kit._runner import GRADERS
from labkit.launch import pools_apart
from labkit.launch.owner import OWNER

LATER_SECONDS = 20.0  # a later call's timeout: well past a right call's milliseconds, short of a 30 s hang


def on_graders_ranks(fn, world_size: int) -> list:
    """`fn` on the graders' own ranks of `world_size`: what the next grading meets there (the leftovers check)."""
    with pools_apart(GRADERS):
        return labkit.run(fn, world_size=world_size, timeout=LATER_SECONDS)


def rank_by_labkit() -> int:
    return labkit.rank()  # looked up at each call, as a student's code does


def a_quarter() -> float:
    return (torch.ones(1) / 4).item()


def ddp_step() -> float:
    """One DDP step on a small model: its gradients all-reduced by DDP's own collectives."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    model(torch.ones(2, 4)).sum().backward()
    return model.module.bias.grad.item()


def all_reduced_one() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def sets_rank_to_zero(model):
    labkit.rank = lambda: 0
    loop_all_reduce_div(model)


def patches_true_division(model):
    torch.Tensor.__truediv__ = lambda self, other: torch.mul(self, 2.0)
    loop_all_reduce_div(model)


def leaves_a_collective_thread(go: str):
    """A right average that also starts a thread issuing all_reduces once `go` exists (after the grading)."""
    def solution(model):
        def all_reduce_forever():
            while not os.path.exists(go):
                time.sleep(0.01)
            while True:
                try:
                    dist.all_reduce(torch.ones(1))
                except Exception:  # noqa: BLE001 - a leftover thread keeps trying, as such threads do
                    time.sleep(0.01)
        if not any(t.name == "leftover" for t in threading.enumerate()):
            threading.Thread(target=all_reduce_forever, name="leftover", daemon=True).start()
        loop_all_reduce_div(model)
    return solution


def no_ops_the_guards_restore(t):
    Interceptor.__exit__ = lambda self, *exc_info: None
    notebook_02_solution(t)


@pytest.fixture(autouse=True)
def student_pools():
    """The student's pools of 2 and 3 ranks, started before the grading (so that, on main, it used them)."""
    for world_size in (2, 3):
        labkit.run(rank_by_labkit, world_size=world_size)


def test_a_solution_setting_labkit_rank_leaves_later_calls_their_ranks():
    check_average_gradients(sets_rank_to_zero, record=False)
    assert labkit.run(rank_by_labkit, world_size=3, timeout=LATER_SECONDS) == [0, 1, 2]  # main: [0, 0, 0]
    assert on_graders_ranks(rank_by_labkit, 3) == [0, 1, 2]
    assert check_average_gradients(loop_all_reduce_div, record=False)


def test_a_solution_patching_torch_leaves_later_calls_torch_s_division():
    check_average_gradients(patches_true_division, record=False)
    assert labkit.run(a_quarter, world_size=3, timeout=LATER_SECONDS) == [0.25] * 3  # main: [2.0] * 3
    assert on_graders_ranks(a_quarter, 3) == [0.25] * 3
    assert check_average_gradients(loop_all_reduce_div, record=False)


def test_a_solution_s_thread_of_collectives_does_not_hang_the_next_ddp_step(tmp_path):
    go = str(tmp_path / "go")
    check_average_gradients(leaves_a_collective_thread(go), record=False)
    Path(go).touch()
    assert len(labkit.run(ddp_step, world_size=3, timeout=LATER_SECONDS)) == 3  # main: hung (RankTimeout)
    assert len(on_graders_ranks(ddp_step, 3)) == 3
    assert check_average_gradients(loop_all_reduce_div, record=False)


def test_a_solution_no_oping_the_guard_s_restore_leaves_all_reduce_working():
    check_naive_allreduce(no_ops_the_guards_restore, record=False)
    assert labkit.run(all_reduced_one, world_size=3, timeout=LATER_SECONDS) == [3.0] * 3  # main: ForbiddenCall
    assert on_graders_ranks(all_reduced_one, 3) == [3.0] * 3
    assert check_naive_allreduce(notebook_02_solution, record=False)


def test_graders_never_use_the_student_s_ranks():
    """The student's pools, and so their %%ranks variables, are the same ranks after a grading as before it."""
    pids = {n: OWNER.kept_pool(n).pids() for n in (2, 3)}
    assert check_average_gradients(loop_all_reduce_div, record=False)
    assert {n: OWNER.kept_pool(n).pids() for n in (2, 3)} == pids
    assert labkit.run(os.getpid, world_size=3) == pids[3]


def test_the_atomic_save_grader_keeps_no_pool_and_leaves_the_student_s_alone(tmp_path, monkeypatch):
    """Its save runs are killed and rlimited: each gets a 1-rank pool of the grader's own, discarded after it."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the grader's scratch directory, the test's own
    pid = labkit.run(os.getpid, world_size=1)
    assert check_atomic_save(named_temporary_file, record=False)
    assert labkit.run(os.getpid, world_size=1) == pid  # main: the grader killed the student's rank
    assert OWNER.kept_pool(1, "gloo", "the atomic-save grader") is None
