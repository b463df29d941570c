"""Messages that say what happened (issue 28): a fork server that died at start, a rank that exited or died with
the fork server, a KeyboardInterrupt the student raised, a rank sleeping in its own code, a result still being
pickled at the timeout; in labkit's RankError and in a grader's verdict, which shows its first line.

Each probe's message on main (commit c3ee247) is in its test's comment."""

import os
import re
import signal
import stat
import time

import pytest

import labkit
from labkit.exercises import allreduce
from labkit.launch.owner import OWNER


def test_a_fork_server_that_dies_at_start_says_how_once_with_its_stderr_and_the_memory_limit(script):
    # main: "labkit's fork server has ended; the next call starts a new one." on each call, and OpenBLAS's
    # "Memory allocation still failed" on the owner's stderr only
    code, out, err = script("""
        import os, resource
        import torch  # a kernel that has used torch already: the owner itself gets by
        import labkit
        import labkit.launch.pool, labkit.launch.serialize, labkit.launch.worker
        resource.setrlimit(resource.RLIMIT_AS, (500 << 20, 500 << 20))
        try:
            labkit.run(os.getpid, world_size=2)
        except RuntimeError as error:
            print(error)
    """)
    assert code == 0, err
    assert "labkit's fork server exited with code 1 before it started a rank" in out, out
    assert "memory limit of 500 MiB of address space, RLIMIT_AS" in out and "ulimit -v" in out, out
    assert "The next call starts a new one. Its last lines of stderr:\nlabkit's fork server: " in out, out
    assert "Memory allocation" in out or "MemoryError" in out or "Cannot allocate memory" in out, out
    assert "fork server" not in err and "Memory allocation" not in err, err  # said once, in the error


def test_the_fork_servers_stderr_is_an_unlinked_file_only_the_owner_can_read():
    labkit.run(labkit.rank, world_size=2)
    fd = f"/proc/{OWNER.fork_server.process.pid}/fd/2"
    assert os.readlink(fd).endswith(" (deleted)"), os.readlink(fd)
    assert stat.S_IMODE(os.stat(fd).st_mode) == 0o600
    ours = os.fstat(2)  # pytest's capture is an unlinked 0600 file too: the server's must be its own
    assert (os.stat(fd).st_dev, os.stat(fd).st_ino) != (ours.st_dev, ours.st_ino)


def exit_on_rank_1(t=None):
    if labkit.rank() == 1:
        os._exit(0)
    time.sleep(5)


def test_a_rank_that_exits_in_the_call_exited_before_replying():
    # main: "rank 1: process exited with code 0", and the grader "rank 1 raised process exited with code 0"
    with pytest.raises(labkit.RankError) as info:
        labkit.run(exit_on_rank_1, world_size=2)
    assert "root cause, rank 1: process exited with code 0 before replying (the function never returned" \
        in str(info.value), info.value
    verdict = allreduce.check_naive_allreduce(exit_on_rank_1)
    assert "rank 1's process exited with code 0 before replying" in str(verdict), verdict
    assert "raised process" not in str(verdict)


def kill_the_fork_server():
    if labkit.rank() == 1:
        os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(5)


def test_ranks_that_died_with_the_fork_server_say_so():
    # main: "ranks 0-2: process ended (exit status unknown)"
    with pytest.raises(labkit.RankError) as info:
        labkit.run(kill_the_fork_server, world_size=3)
    assert ("ranks 0-2: process died before replying with labkit's fork server, which was killed by SIGKILL (every "
            "rank dies with it)") in str(info.value), info.value
    assert labkit.run(labkit.rank, world_size=3) == [0, 1, 2]  # the next call starts a new one


def raise_keyboard_interrupt(t=None):
    raise KeyboardInterrupt


def test_a_keyboard_interrupt_the_code_raised_is_named_as_its_own():
    # main: "ranks 0-1: interrupted", and the grader "rank 0 raised interrupted"
    with pytest.raises(labkit.RankError) as info:
        labkit.run(raise_keyboard_interrupt, world_size=2)
    own = "KeyboardInterrupt, from the function's own code (raised there, not by the stop button)"
    assert f"ranks 0-1: {own}" in str(info.value), info.value
    verdict = str(allreduce.check_naive_allreduce(raise_keyboard_interrupt))
    assert re.search(rf"rank \d raised {re.escape(own)}", verdict), verdict


def sleep_in_own_code(t):
    time.sleep(1000)


def test_a_rank_sleeping_in_its_own_code_is_not_said_to_wait_for_a_message():
    # main: "it never finished (stopped after 3 s): some rank waited for a message that never came. ..."
    verdict = str(allreduce.check_naive_allreduce(sleep_in_own_code, timeout_seconds=3))
    assert "never came" not in verdict, verdict
    assert "no rank was waiting for a message or a collective: each was still running your own code" in verdict
    assert "rank 0 was still running in sleep_in_own_code at File" in verdict and "time.sleep(1000)" in verdict
    with pytest.raises(labkit.RankTimeout) as info:
        labkit.run(sleep_in_own_code, None, world_size=2, timeout=2)
    assert "time.sleep(1000) (the rank's own code: it was not waiting for a message or a collective)" in str(
        info.value), info.value


class PicklesHoldingTheGil:
    """Pickling that takes long without ever letting go of the GIL, as copying 800 MB of storage does: the rank's
    control thread cannot answer the owner's StackRequest meanwhile."""

    def __reduce__(self):
        import ctypes

        ctypes.PyDLL(None).sleep(60)  # PyDLL keeps the GIL through the call; the timeout's SIGKILL ends it
        return int, ()


def a_big_result_slow_to_pickle():
    import torch

    return torch.zeros(4_000_000), PicklesHoldingTheGil()  # 16 MB of tensor


def test_a_timeout_while_the_result_is_pickled_says_it_had_returned_and_how_big_it_is():
    # main: "ranks 0-1: was still running and did not say where"
    labkit.run(labkit.rank, world_size=2)  # started first: a cold start under load once took the 2 s, in an import
    with pytest.raises(labkit.RankTimeout) as info:
        labkit.run(a_big_result_slow_to_pickle, world_size=2, timeout=5)
    assert "ranks 0-1: had returned; its result (16.0 MB) was being pickled and sent when the timeout passed" \
        in str(info.value), info.value
