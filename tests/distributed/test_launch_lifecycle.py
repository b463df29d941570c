"""A pool's life: how its start ends, what a call may do to a rank's process, and what a rank leaves behind."""

import os
import signal
import socket
import subprocess
import time
import types

import psutil
import pytest
import torch
import torch.distributed as dist
from processes import alive_after

import labkit
from labkit.launch import pool as pool_module
from labkit.launch.backend import BackendChoice
from labkit.launch.owner import OWNER


def rank_sum():
    t = torch.tensor([float(labkit.rank())])
    dist.all_reduce(t)
    return t.item()


def fresh_pool(world_size: int) -> None:
    """Close the warm gloo pool of `world_size` ranks, if any, so that the next call starts one."""
    labkit.shutdown(world_size=world_size)


def spec_for_rank_1(monkeypatch, **changes) -> None:
    """Start rank 1 of every new pool with `changes` to its spec: a way to make one rank's start go wrong."""
    original = pool_module.Pool.rank_spec

    def spec(self, rank, *args):
        made = original(self, rank, *args)
        return made._replace(**changes) if rank == 1 else made
    monkeypatch.setattr(pool_module.Pool, "rank_spec", spec)


def test_a_rank_that_fails_to_start_fails_the_start_at_once(monkeypatch):
    # rank 1 raises in init_process_group; ranks 0 and 2 would wait in the rendezvous for the group timeout (30 s)
    spec_for_rank_1(monkeypatch, backend="no-such-backend")
    fresh_pool(3)
    start = time.monotonic()
    with pytest.raises(labkit.RankError) as info:
        labkit.run(rank_sum, world_size=3, timeout=60)
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "could not start 3 ranks" in message
    assert "rank 1: " in message and "no-such-backend" in message
    assert "was still starting" in message  # ranks 0 and 2, cut short
    monkeypatch.undo()
    assert labkit.run(rank_sum, world_size=3) == [3.0] * 3


def test_a_start_that_hangs_ends_at_the_calls_timeout(monkeypatch, tmp_path):
    # rank 1 waits for its peers in a store of its own: every rank would wait for the group timeout (30 s)
    monkeypatch.setattr("labkit.launch._lifecycle.MIN_START_SECONDS", 2.0)  # the gloo floor
    spec_for_rank_1(monkeypatch, store_path=str(tmp_path / "a-store-nobody-else-uses"))
    fresh_pool(3)
    start = time.monotonic()
    with pytest.raises(labkit.RankError) as info:
        labkit.run(rank_sum, world_size=3, timeout=4)
    assert time.monotonic() - start < 4 + 6
    message = str(info.value)
    assert "ranks 0-2: not ready after 4 s: was still starting in " in message  # and where
    monkeypatch.undo()
    assert labkit.run(rank_sum, world_size=3) == [3.0] * 3


@pytest.mark.parametrize("call_timeout, start_timeout, expected", [
    (20, 120, 20), (500, 120, 120), (0.1, 120, "the floor"), (0.1, 5, 5),
])
def test_the_start_budget_rule(call_timeout, start_timeout, expected):
    # the call's timeout, but never less than a cold start needs, nor more than LABKIT_START_TIMEOUT
    if expected == "the floor":
        expected = pool_module.cold_start_seconds("gloo", 1)
    assert pool_module.start_budget_seconds(call_timeout, start_timeout) == expected


@pytest.mark.parametrize("world_size, expected", [(2, 26.0), (8, 44.0)])
def test_an_nccl_pool_started_by_a_graders_10_s_call_gets_a_cold_gpu_boxs_start(monkeypatch, world_size, expected):
    """A grader calls with timeout=10; on NCCL the pool's first start may take 1-3 s per GPU more (the driver
    initialising each GPU) and NCCL's communicator: the start's bound is the backend's, not the call's."""
    budgets = []

    class Started(Exception):
        pass

    def recorded(pool, budget_seconds):
        budgets.append(budget_seconds)
        raise Started

    monkeypatch.setattr(pool_module.Pool, "_start", recorded)
    reads, writes = socket.socketpair()
    server = types.SimpleNamespace(fileno=reads.fileno, alive=False)
    pool = pool_module.Pool(world_size, BackendChoice("nccl", "as asked"), server, "/nonexistent/store", 30, 120)
    try:
        with pytest.raises(Started):
            pool.call(b"", timeout_seconds=10)
    finally:
        pool.close()
        reads.close()
        writes.close()
    assert budgets == [expected] == [2 * pool_module.cold_start_seconds("gloo", 1) + 3.0 * world_size]
    assert pool_module.start_budget_seconds(10, 120, "gloo", world_size) == 10  # gloo's start: as before


def silence_fd(fd: int) -> int:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
    return labkit.rank()


@pytest.mark.parametrize("fd", [1, 2])
def test_a_call_that_redirects_its_output_fd_returns_at_once_and_output_comes_back(fd, capfd):
    pids = labkit.run(os.getpid, world_size=2)
    start = time.monotonic()
    assert labkit.run(silence_fd, fd, world_size=2, timeout=30) == [0, 1]
    assert time.monotonic() - start < 5
    labkit.run(lambda: print("still heard") or print("on stderr too", file=__import__("sys").stderr), world_size=2)
    captured = capfd.readouterr()
    assert "[rank 1] still heard" in captured.out and "[rank 1] on stderr too" in captured.err
    assert labkit.run(os.getpid, world_size=2) == pids  # the pool was kept


def start_sleep() -> int:
    """On a rank: start a long-running child process; its pid."""
    return subprocess.Popen(["sleep", "1000"]).pid


def test_a_killed_ranks_children_die_with_it():
    ranks = labkit.run(os.getpid, world_size=2)
    sleeps = labkit.run(start_sleep, world_size=2)
    os.kill(ranks[1], signal.SIGKILL)
    assert alive_after([sleeps[1]], 5) == []
    assert labkit.run(rank_sum, world_size=2) == [1.0, 1.0]  # a fresh pool: the broken one was closed,
    assert alive_after([sleeps[0]], 5) == []  # and rank 0's child with it


def test_a_ranks_orphaned_grandchild_is_reaped():
    def orphan() -> int:  # a child that starts `sleep`, then leaves it to be re-parented
        out = subprocess.run(["sh", "-c", "sleep 1000 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True,
                             check=True)
        return int(out.stdout)
    ranks = labkit.run(os.getpid, world_size=2)
    sleeps = labkit.run(orphan, world_size=2)
    # the fork server is the subreaper of its ranks' descendants: it reaps them, here as in a container without init
    assert [psutil.Process(p).ppid() for p in sleeps] == [OWNER.fork_server.process.pid] * 2
    fresh_pool(2)
    assert alive_after(sleeps + ranks, 5) == []


def test_owner_killed_leaves_no_grandchild_behind(start_script):
    owner = start_script("""
        import os, subprocess, time, labkit
        def start_sleep():
            return subprocess.Popen(["sleep", "1000"]).pid
        print("PIDS", *labkit.run(start_sleep, world_size=2), flush=True)
        time.sleep(60)
    """)
    line = next(line for line in owner.stdout if line.startswith("PIDS"))
    sleeps = [int(p) for p in line.split()[1:]]
    assert len(sleeps) == 2 and alive_after(sleeps, 0) == sleeps
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    assert alive_after(sleeps, 5) == []


def test_destroying_the_process_group_restarts_the_pool_with_a_clear_message(capfd):
    pids = labkit.run(os.getpid, world_size=2)

    def destroy():
        dist.destroy_process_group()
        return labkit.launch.rank.__name__  # the call's result still comes back
    assert labkit.run(destroy, world_size=2) == ["rank", "rank"]
    assert "ranks 0-1 destroyed the process group" in capfd.readouterr().err
    assert labkit.run(rank_sum, world_size=2) == [1.0, 1.0]
    assert labkit.run(os.getpid, world_size=2) != pids


def fake_cuda(fail: bool) -> None:
    """On a rank: pretend CUDA is initialised, and record (or fail) each torch.cuda.synchronize()."""
    torch.cuda.labkit_test_original = (torch.cuda.is_initialized, torch.cuda.synchronize)
    torch.cuda.labkit_test_syncs = 0

    def synchronize(device=None):
        torch.cuda.labkit_test_syncs += 1
        if fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
    torch.cuda.is_initialized = lambda: True
    torch.cuda.synchronize = synchronize


def real_cuda() -> int:
    """On a rank: undo fake_cuda; how many synchronisations it saw."""
    torch.cuda.is_initialized, torch.cuda.synchronize = torch.cuda.labkit_test_original
    return torch.cuda.labkit_test_syncs


def test_a_rank_synchronises_cuda_before_it_replies():
    labkit.run(fake_cuda, False, world_size=2)
    assert labkit.run(real_cuda, world_size=2) == [1, 1]  # after fake_cuda's call (this one restores CUDA first)


def test_a_cuda_error_surfaces_in_the_call_that_caused_it():
    pids = labkit.run(os.getpid, world_size=2)
    with pytest.raises(labkit.RankError, match="CUDA error: an illegal memory access"):
        labkit.run(fake_cuda, True, world_size=2)
    # a CUDA error is sticky: the health check after the failure fails too, so the pool is replaced
    assert labkit.run(os.getpid, world_size=2) != pids
    assert labkit.run(rank_sum, world_size=2) == [1.0, 1.0]


def test_a_follow_on_error_is_never_the_root_cause():
    def fail():
        if labkit.rank() == 0:
            time.sleep(0.5)
            raise OSError("disk full")
        error = RuntimeError("rank 0 failed to save")
        error.labkit_follow_on = True
        raise error
    with pytest.raises(labkit.RankError) as info:
        labkit.run(fail, world_size=2)
    assert "root cause, rank 0: OSError: disk full" in str(info.value)


def test_shutdown_leaves_no_grandchild_behind():
    sleeps = labkit.run(start_sleep, world_size=2)
    labkit.shutdown()
    assert alive_after(sleeps, 5) == []
    assert labkit.run(rank_sum, world_size=2) == [1.0, 1.0]
