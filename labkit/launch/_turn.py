"""One call at a time per process: the owner's turn, taken first come, first served, with a bounded wait.

The owner's pools, fork server and selector are one process's state, and a call reads its ranks' replies off
the same sockets any other call would: two threads calling `labkit.run` at once (a widget's callback beside a
cell, a thread pool) took each other's replies, closed each other's selectors and hung. So every call, every
`%%ranks` cell and every shutdown holds the turn while it touches the owner. A waiter that cannot get the turn
within its own timeout is told who holds it; the thread holding it cannot take it again (a nested call would
wait for itself forever), and is told so at once.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

__all__: list[str] = []


class TurnTimeout(TimeoutError):
    """The turn was not free within the waiter's timeout: another thread of this process held it."""


class Turn:
    """The turn: `held(what, timeout_seconds)` waits for it (FIFO) and holds it for a `with` block;
    `held_if_free(what)` takes it only if nobody holds or waits for it (for work that can be skipped); `waiting`
    counts the waiters."""

    def __init__(self):
        self._condition = threading.Condition()
        self._waiting: deque[object] = deque()  # one ticket per waiter, in arrival order
        self._holder: threading.Thread | None = None
        self._what = ""  # what the holder is doing, in words
        self._since = 0.0  # time.monotonic() when the holder took the turn

    @property
    def waiting(self) -> int:
        """How many calls wait for the turn now (a read-only hook for tests and messages)."""
        with self._condition:
            return len(self._waiting)

    @contextmanager
    def held(self, what: str, timeout_seconds: float) -> Iterator[None]:
        """Hold the turn for the block, once every earlier waiter has had it; TurnTimeout after
        `timeout_seconds` of waiting, RuntimeError at once if this thread already holds it."""
        with self._condition:
            self._refuse_nested(what)
            self._wait_for_turn(what, timeout_seconds)
        try:
            yield
        finally:
            self._release()

    @contextmanager
    def held_if_free(self, what: str) -> Iterator[bool]:
        """Hold the turn for the block if it is free now (yields True), else yield False and hold nothing."""
        with self._condition:
            free = self._holder is None and not self._waiting
            if free:
                self._take(what)
        try:
            yield free
        finally:
            if free:
                self._release()

    def _refuse_nested(self, what: str) -> None:
        if self._holder is threading.current_thread():
            raise RuntimeError(f"{what} was called while this thread is still running {self._what} (from inside "
                               "it, e.g. in a callback it runs here): labkit runs one call at a time, so this one "
                               "would wait for itself forever. Make the second call after the first has returned.")

    def _wait_for_turn(self, what: str, timeout_seconds: float) -> None:
        ticket = object()
        self._waiting.append(ticket)
        deadline = time.monotonic() + timeout_seconds
        try:
            while self._holder is not None or self._waiting[0] is not ticket:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TurnTimeout(self._busy_message(what, timeout_seconds))
                self._condition.wait(left)
        finally:
            self._waiting.remove(ticket)
            self._condition.notify_all()  # the next in line may go now (or a waiter gave up)
        self._take(what)

    def _take(self, what: str) -> None:
        self._holder, self._what, self._since = threading.current_thread(), what, time.monotonic()

    def _release(self) -> None:
        with self._condition:
            self._holder, self._what = None, ""
            self._condition.notify_all()

    def _busy_message(self, what: str, timeout_seconds: float) -> str:
        holder = self._holder.name if self._holder is not None else "an earlier waiter"
        doing = f"has been running {self._what} for {time.monotonic() - self._since:.0f} s" \
            if self._holder is not None else "was ahead in line"
        return (f"{what} waited {timeout_seconds:g} s for its turn and did not get it: thread {holder!r} of this "
                f"process {doing}. labkit runs one call at a time per process (the ranks answer one caller); "
                "wait for that call to return, or give this one a longer timeout.")
