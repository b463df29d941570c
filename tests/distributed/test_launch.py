"""labkit.run on real processes: results, output, errors, hangs, deaths, interrupts, cleanup."""

import os
import re
import signal
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist
from processes import alive_after
from sockets import listening_sockets

import labkit
from labkit.launch.backend import threads_per_rank
from labkit.launch.errors import NoReply
from labkit.launch.protocol import Outcome


def rank_sum():
    t = torch.tensor([float(labkit.rank())])
    dist.all_reduce(t)
    return t.item()


def test_results_come_back_in_rank_order():
    assert labkit.run(lambda: labkit.rank() * 10, world_size=4) == [0, 10, 20, 30]


def test_all_reduce_of_rank_ids_on_four_ranks():
    assert labkit.run(rank_sum, world_size=4) == [6.0] * 4


def test_arguments_and_keywords_reach_every_rank():
    def f(a, b, *, scale):
        return (a + b) * scale + labkit.world_size()
    assert labkit.run(f, 1, 2, scale=10, world_size=3) == [33, 33, 33]


def test_closure_over_local_tensor_travels_by_value():
    weights = torch.arange(4.0)
    assert labkit.run(lambda: float(weights.sum()) + labkit.rank(), world_size=2) == [6.0, 7.0]


def test_device_is_cpu_under_gloo_and_threads_are_shared_out():
    results = labkit.run(lambda: (str(labkit.device()), torch.get_num_threads()), world_size=2)
    devices, threads = zip(*results, strict=True)
    assert devices == ("cpu", "cpu")
    assert set(threads) == {threads_per_rank(2)}


def test_output_is_prefixed_and_in_rank_order(capfd):
    def chatty():
        for i in range(3):
            print(f"line {i}")
    labkit.run(chatty, world_size=3)
    out = capfd.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("[rank")]
    assert lines == [f"[rank {r}] line {i}" for r in range(3) for i in range(3)]


def test_stderr_and_output_without_newline_are_kept(capfd):
    def f():
        import sys
        print("warn", file=sys.stderr)
        print("no newline", end="")
    labkit.run(f, world_size=2)
    captured = capfd.readouterr()
    assert "[rank 1] no newline" in captured.out
    assert "[rank 0] warn" in captured.err and "[rank 1] warn" in captured.err


def test_exception_on_one_rank_names_it_with_the_users_line():
    def f():
        t = torch.ones(1)
        if labkit.rank() == 1:
            raise ValueError("rank one is unhappy")
        dist.all_reduce(t)  # rank 0 waits here for rank 1, which never comes
    start = time.monotonic()
    with pytest.raises(labkit.RankError) as info:
        labkit.run(f, world_size=2, timeout=60)
    assert time.monotonic() - start < 5
    message = str(info.value)
    assert "rank 1 of 2 failed" in message
    assert "root cause, rank 1: ValueError: rank one is unhappy" in message
    assert 'raise ValueError("rank one is unhappy")' in message  # the user's own line
    assert "rank 0" in message
    assert {f.rank: f.kind for f in info.value.failures}[1] is Outcome.ERROR
    assert labkit.run(rank_sum, world_size=2) == [1.0, 1.0]


def test_identical_failures_are_merged():
    def f():
        return undefined_name  # noqa: F821
    with pytest.raises(labkit.RankError) as info:
        labkit.run(f, world_size=4)
    message = str(info.value)
    assert "ranks 0-3: NameError: name 'undefined_name' is not defined" in message
    assert message.count("NameError") == 2  # the summary line, and the traceback once
    assert labkit.run(rank_sum, world_size=4) == [6.0] * 4  # a symmetric failure keeps the pool


def test_hang_raises_with_each_ranks_stack_then_recovers():
    def f():
        if labkit.rank() == 0:
            dist.all_reduce(torch.ones(1))
        return "done"
    start = time.monotonic()
    with pytest.raises(labkit.RankTimeout) as info:
        labkit.run(f, world_size=2, timeout=3)
    assert time.monotonic() - start < 3 + 10
    message = str(info.value)
    assert "rank 0 still running (rank 1 had returned)" in message
    assert re.search(r'in all_reduce, called from File ".*test_launch.py", line \d+: dist.all_reduce', message)
    assert [(f.rank, f.kind) for f in info.value.failures] == [(0, NoReply.STOPPED)]
    assert info.value.failures[0].kind is NoReply.STOPPED
    assert labkit.run(rank_sum, world_size=2) == [1.0, 1.0]


@pytest.mark.parametrize("how, expected", [
    ("os.kill(os.getpid(), signal.SIGKILL)", "killed by SIGKILL"),
    ("os._exit(3)", "exited with code 3"),
])
def test_dead_rank_is_named_with_its_signal_and_stderr(how, expected):
    code = f"import os, signal, sys; print('about to go', file=sys.stderr, flush=True); {how}"

    def f():
        if labkit.rank() == 1:
            exec(code)
        dist.all_reduce(torch.ones(1))
    with pytest.raises(labkit.RankError) as info:
        labkit.run(f, world_size=2, timeout=30)
    message = str(info.value)
    assert f"rank 1: process {expected}" in message
    assert "about to go" in message.split("last lines of stderr:")[1]
    assert {f.rank: f.kind for f in info.value.failures}[1] is NoReply.DIED
    assert labkit.run(rank_sum, world_size=2) == [1.0, 1.0]


class Interrupter:
    """Ctrl-C for tests: SIGINT to this process after a delay, or once ranks have written marker
    files (a chosen moment, not a guessed one). Python raises KeyboardInterrupt on SIGINT only if
    the process did not start with SIGINT ignored, as a background job of a non-interactive shell
    (CI) does; so the handler is installed here, as ipykernel does while it runs a cell."""

    def __init__(self, folder):
        self.folder = str(folder)
        self.sent_at = None
        self._stop = threading.Event()
        self._threads = []

    def after(self, seconds: float) -> None:
        self._start(lambda: self._stop.wait(seconds) or True)

    def when_ranks_reach(self, count: int) -> None:
        """Interrupt once `count` ranks have called `reach(folder)`."""
        def ready():
            self._stop.wait(0.01)
            return len(os.listdir(self.folder)) >= count
        self._start(ready)

    def _start(self, ready) -> None:
        def wait_then_interrupt():
            while not (ready() or self._stop.is_set()):
                pass
            if not self._stop.is_set():
                self.sent_at = time.monotonic()
                os.kill(os.getpid(), signal.SIGINT)
        self._threads.append(threading.Thread(target=wait_then_interrupt, daemon=True))
        self._threads[-1].start()

    def seconds_since_sent(self) -> float:
        return time.monotonic() - self.sent_at

    def close(self) -> None:
        self._stop.set()  # a SIGINT not sent yet must not hit a later test
        for thread in self._threads:
            thread.join()


@pytest.fixture
def interrupter(tmp_path):
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupter = Interrupter(tmp_path)
    yield interrupter
    interrupter.close()
    signal.signal(signal.SIGINT, previous)


def reach(folder: str) -> None:
    """On a rank: say "I am here" to the interrupter."""
    open(os.path.join(folder, f"rank-{labkit.rank()}"), "w").close()


def test_keyboard_interrupt_returns_quickly_and_the_next_call_works(interrupter):
    def long_call():
        if labkit.rank() == 0:
            time.sleep(30)  # in Python: stops at once
        else:
            dist.barrier()  # blocked in C++ waiting for rank 0
    interrupter.after(1.0)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        labkit.run(long_call, world_size=2, timeout=60)
    assert time.monotonic() - start < 1.0 + 3
    assert labkit.run(rank_sum, world_size=2) == [1.0, 1.0]


def test_interrupting_python_code_keeps_a_healthy_pool(interrupter):
    labkit.run(rank_sum, world_size=2)
    pids_before = labkit.run(os.getpid, world_size=2)
    interrupter.after(1.0)
    with pytest.raises(KeyboardInterrupt):
        labkit.run(time.sleep, 30, world_size=2)
    assert labkit.run(os.getpid, world_size=2) == pids_before


class SlowToUnpickle:
    """An argument that takes seconds to arrive on a rank, like a module imported under load: the
    rank has the call but has not reached the user's code yet."""

    def __init__(self, folder: str):
        self.folder = folder

    def __reduce__(self):
        return arrive_slowly, (self.folder,)


def arrive_slowly(folder: str) -> str:
    reach(folder)
    time.sleep(3)
    return folder


def sleep_long(_):
    time.sleep(30)


def test_an_interrupt_before_the_users_code_starts_is_not_lost(interrupter):
    pids_before = labkit.run(os.getpid, world_size=2)
    interrupter.when_ranks_reach(2)
    with pytest.raises(KeyboardInterrupt):
        labkit.run(sleep_long, SlowToUnpickle(interrupter.folder), world_size=2)
    assert interrupter.seconds_since_sent() < 3
    assert labkit.run(os.getpid, world_size=2) == pids_before  # both ranks stopped: the pool is kept


def test_a_sigint_not_sent_for_this_call_does_not_stop_it():
    def f():
        os.kill(os.getpid(), signal.SIGINT)  # as a late SIGINT meant for an earlier call would
        time.sleep(0.5)
        return labkit.rank()
    assert labkit.run(f, world_size=2) == [0, 1]


def test_an_interrupt_for_an_earlier_call_does_not_stop_this_one():
    from labkit.launch import protocol
    from labkit.launch.owner import OWNER
    labkit.run(rank_sum, world_size=2, backend="gloo")
    pool = OWNER.kept_pool(2, "gloo")
    earlier, controls = pool.last_call_id, pool.controls()  # the id rank_sum ran as
    timer = threading.Timer(0.5, lambda: [protocol.send(c, protocol.Interrupt(earlier)) for c in controls])
    timer.start()
    try:
        assert labkit.run(lambda: time.sleep(1.5) or labkit.rank(), world_size=2, backend="gloo") == [0, 1]
    finally:
        timer.join()


def test_ranks_interrupted_out_of_step_are_replaced_at_once(interrupter, capfd):
    def one_rank_ahead(folder):
        if labkit.rank() == 1:
            dist.all_reduce(torch.ones(1), async_op=True)  # posted, never matched by rank 0
        reach(folder)
        time.sleep(30)
    pids_before = labkit.run(os.getpid, world_size=2)
    interrupter.when_ranks_reach(2)
    with pytest.raises(KeyboardInterrupt):
        labkit.run(one_rank_ahead, interrupter.folder, world_size=2)
    # rank 0's probe all_reduce would complete against rank 1's pending one, and rank 1's probe wait
    # out its 3 s timeout; the operation counts tell at once
    assert interrupter.seconds_since_sent() < 2.5
    assert "stopped out of step" in capfd.readouterr().err
    assert labkit.run(os.getpid, world_size=2) != pids_before
    assert labkit.run(rank_sum, world_size=2) == [1.0, 1.0]


def slow_health_probe(folder: str) -> float:
    reach(folder)
    time.sleep(30)
    return float(labkit.world_size())


def test_ctrl_c_during_the_health_check_after_a_failure_is_not_swallowed(interrupter, monkeypatch):
    from labkit.launch import serialize
    probe = serialize.dumps((slow_health_probe, (interrupter.folder,), {}))
    monkeypatch.setattr("labkit.launch._lifecycle.HEALTH_PROBE", probe)  # the pool's health check after a failure

    def fail_everywhere():
        raise ValueError("every rank fails alike, so the pool's health is checked")
    interrupter.when_ranks_reach(2)
    with pytest.raises(KeyboardInterrupt):
        labkit.run(fail_everywhere, world_size=2)
    assert interrupter.seconds_since_sent() < 3
    monkeypatch.undo()
    assert labkit.run(rank_sum, world_size=2) == [1.0, 1.0]


def group_timeout_seconds():
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    return backend.options._timeout.total_seconds()


@pytest.mark.parametrize("timeout", [7, 100])
def test_the_group_timeout_outlasts_the_call_timeout(timeout):
    # so that a hang is reported by labkit, with stacks, before gloo's own timeout fires
    assert labkit.run(group_timeout_seconds, world_size=2, timeout=timeout) == [timeout + 15.0] * 2


def test_a_dead_fork_server_is_replaced():
    from labkit.launch.owner import OWNER
    labkit.run(rank_sum, world_size=2)
    OWNER.fork_server.process.kill()
    OWNER.fork_server.process.wait()
    assert labkit.run(rank_sum, world_size=2) == [1.0, 1.0]


def test_two_hundred_calls_leak_no_fds_threads_or_processes():
    me = psutil.Process()
    labkit.run(rank_sum, world_size=2)
    before = (me.num_fds(), me.num_threads(), len(me.children(recursive=True)))
    for _ in range(200):
        labkit.run(rank_sum, world_size=2)
    assert (me.num_fds(), me.num_threads(), len(me.children(recursive=True))) == before


def test_every_listening_socket_is_on_loopback():
    pids = labkit.run(os.getpid, world_size=2)
    listening = [c.laddr.ip for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    listening += [ip for pid in pids for ip, _ in listening_sockets(pid)]  # in the ranks' own network namespace
    assert listening, "the ranks' gloo pairs should be listening"  # the owner listens on nothing (a FileStore)
    assert set(listening) == {"127.0.0.1"}


def test_owner_killed_leaves_no_rank_behind(start_script):
    owner = start_script("""
        import os, time, labkit
        print("PIDS", *labkit.run(os.getpid, world_size=3), flush=True)
        time.sleep(60)
    """)
    line = next(line for line in owner.stdout if line.startswith("PIDS"))
    pids = [int(p) for p in line.split()[1:]]
    assert len(pids) == 3 and all(psutil.pid_exists(p) for p in pids)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    assert alive_after(pids, 5) == []


def test_two_owners_at_once_do_not_collide(start_script):
    code = """
        import labkit, torch, torch.distributed as dist
        def f():
            t = torch.ones(1); dist.all_reduce(t); return t.item()
        for _ in range(20):
            assert labkit.run(f, world_size=2) == [2.0, 2.0]
        print("ok")
    """
    owners = [start_script(code) for _ in range(2)]
    outputs = [o.communicate(timeout=120) for o in owners]
    assert [o.returncode for o in owners] == [0, 0], outputs
    assert all(out.strip().endswith("ok") for out, _ in outputs)


def test_script_main_functions_and_spawn_start_method(script):
    code = """
        import labkit
        def double(x):
            return 2 * x + labkit.rank()
        print(labkit.run(double, 5, world_size=2))
    """
    for method in ("fork", "spawn"):
        returncode, out, err = script(code, LABKIT_START_METHOD=method)
        assert returncode == 0, err
        assert out.strip().endswith("[10, 11]")
