"""Threads of one process calling labkit.run at once (a widget's callback beside a cell, a thread pool): calls
take turns, first come first served, each gets its own result; a wait is bounded and says who holds the turn; a
nested call is refused at once (issue 28: 2 x 10 calls gave 1-4 wrong or failed, and hangs). That a %%ranks cell
holds the turn for the whole cell is in test_magic.py, whose IPython shell is the process's one."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import labkit
from labkit.launch.owner import OWNER

THREADS, CALLS = 2, 10  # the probe: 2 x 10 calls gave one call the other thread's result


def tagged(thread: int, call: int) -> tuple[int, int, int]:
    return thread, call, labkit.rank()


def wait_for_file(started: str, release: str) -> int:
    """On a rank: say it started (rank 0 creates `started`), then wait until `release` exists."""
    if labkit.rank() == 0:
        Path(started).touch()
    while not os.path.exists(release):
        time.sleep(0.01)
    return time.monotonic_ns()


def monotonic_ns() -> int:
    return time.monotonic_ns()  # one clock for every process of the machine: the calls' order


def in_threads(target, count: int) -> list[threading.Thread]:
    threads = [threading.Thread(target=target, args=(t,), name=f"caller-{t}", daemon=True) for t in range(count)]
    for thread in threads:
        thread.start()
    return threads


def test_two_threads_each_get_their_own_results():
    labkit.run(tagged, -1, -1, world_size=2)
    got: dict[tuple[int, int], object] = {}

    def calls(thread: int):
        for call in range(CALLS):
            try:
                got[thread, call] = labkit.run(tagged, thread, call, world_size=2, timeout=60)
            except Exception as error:  # noqa: BLE001 - each failure is reported below
                got[thread, call] = f"{type(error).__name__}: {error}"

    for thread in in_threads(calls, THREADS):
        thread.join(300)
    wrong = {k: v for k, v in got.items() if v != [(k[0], k[1], 0), (k[0], k[1], 1)]}
    assert len(got) == THREADS * CALLS and not wrong, f"{len(wrong)} of {THREADS * CALLS} wrong or failed: {wrong}"


def test_a_waiting_call_is_bounded_and_names_who_holds_the_turn(tmp_path):
    started, release = str(tmp_path / "started"), str(tmp_path / "release")
    holder = in_threads(lambda _: labkit.run(wait_for_file, started, release, world_size=2, timeout=120), 1)[0]
    try:
        while not os.path.exists(started):
            time.sleep(0.01)
        begun = time.monotonic()
        with pytest.raises(TimeoutError) as waited:
            labkit.run(tagged, 0, 0, world_size=3, timeout=1)
        assert time.monotonic() - begun < 30  # bounded by its own timeout (1 s), not by the holder's call
    finally:
        Path(release).touch()
        holder.join(120)
    message = str(waited.value)
    assert "waited 1 s for its turn" in message and "'caller-0'" in message, message
    assert "labkit.run(world_size=2)" in message, message  # what holds it
    assert labkit.run(tagged, 1, 1, world_size=2) == [(1, 1, 0), (1, 1, 1)]  # and nothing was broken


def test_waiting_calls_go_first_come_first_served():
    labkit.run(tagged, 0, 0, world_size=2)
    ran: dict[int, int] = {}  # thread -> when its call ran on rank 0
    threads = []
    with OWNER.turn.held("the test", 60):
        for thread in range(3):
            threads += in_threads(lambda _, t=thread: ran.__setitem__(t, labkit.run(monotonic_ns, world_size=2)[0]),
                                  1)
            while OWNER.turn.waiting < thread + 1:  # this one is in line before the next starts
                time.sleep(0.01)
    for thread in threads:
        thread.join(120)
    assert sorted(ran, key=ran.get) == [0, 1, 2], ran


class CallingStdout:
    """A stdout whose write (a rank's line shown here) calls labkit.run: a call nested in a running one."""

    def __init__(self, real):
        self.real, self.refusals = real, []

    def write(self, text: str) -> int:
        if "[rank" in text and not self.refusals:
            try:
                labkit.run(tagged, 0, 0, world_size=2, timeout=60)
                self.refusals.append("not refused")
            except RuntimeError as refused:
                self.refusals.append(str(refused))
        return self.real.write(text)

    def flush(self):
        self.real.flush()


def test_a_nested_call_from_the_thread_holding_the_turn_is_refused_at_once(monkeypatch):
    stdout = CallingStdout(sys.stdout)
    monkeypatch.setattr(sys, "stdout", stdout)
    begun = time.monotonic()
    assert labkit.run(print, "hello", world_size=2, timeout=60) == [None, None]
    assert time.monotonic() - begun < 60
    assert len(stdout.refusals) == 1 and "would wait for itself forever" in stdout.refusals[0], stdout.refusals
    assert "labkit.run(world_size=2)" in stdout.refusals[0]


def test_prestart_skips_while_a_call_holds_the_turn():
    labkit.shutdown()
    with OWNER.turn.held("the test", 60):
        labkit.prestart()
        assert OWNER.fork_server is None  # it did not touch the owner under the holder's feet
    labkit.prestart()
    assert OWNER.fork_server is not None


EXITS = """
import atexit, os, sys, threading, time
import labkit
out, release, forever = sys.argv[1], sys.argv[2], sys.argv[3] == "forever"
def until_released():
    print("pid", os.getpid(), flush=True)
    while forever or not os.path.exists(release):
        time.sleep(0.01)
    time.sleep(1)  # still running as the exit begins its shutdown; well within EXIT_WAIT_SECONDS (5 s)
    return "finished"
def call():
    print("call", labkit.run(until_released, world_size=2, timeout=600), flush=True)
threading.Thread(target=call, daemon=True).start()
while open(out).read().count("pid") < 2:
    time.sleep(0.05)
atexit.register(open, release, "w")  # registered after labkit's shutdown, so it runs before it
"""


@pytest.mark.parametrize("forever", [False, True], ids=["ending", "endless"])
def test_the_exit_waits_for_a_call_of_another_thread_a_few_seconds_only(tmp_path, forever):
    """A daemon thread's call still running as the script ends: the exit lets it finish if it can within about 5 s
    (EXIT_WAIT_SECONDS; main's exit killed its ranks under it), and stops an endless one's ranks then, instead of
    waiting for the call's 600 s; no rank is left behind."""
    script, out, release = tmp_path / "exits.py", tmp_path / "out", tmp_path / "release"
    script.write_text(EXITS)
    with open(out, "w") as output:
        begun = time.monotonic()
        subprocess.run([sys.executable, str(script), str(out), str(release), "forever" if forever else "ending"],
                       stdout=output, stderr=subprocess.STDOUT, timeout=300, env={**os.environ,
                                                                                  "PYTHONUNBUFFERED": "1"})
    seconds, lines = time.monotonic() - begun, out.read_text().splitlines()
    pids = [int(line.split()[-1]) for line in lines if line.startswith("[rank") and " pid " in line]
    assert len(pids) == 2 and seconds < 300, lines
    assert ("call ['finished', 'finished']" in lines) != forever, lines
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids), "a rank was left behind"
