"""Each rank's stdout and stderr, cut into lines, prefixed `[rank N]`, shown as they come.

Ranks write whenever they like; a notebook should not show a different interleaving on every run
of a quick cell, yet a long call should show every rank's progress live. So in each call rank 0's
lines are shown as they arrive, the other ranks' lines are held for the first HOLD_SECONDS, then
shown rank by rank, and from then on every rank's lines appear as they come. A call that ends
within HOLD_SECONDS shows the same text, in rank order, every time. Carriage-return progress bars
(tqdm) keep only their last state.
"""

from __future__ import annotations

import re
import sys
import time
from collections import deque

__all__ = ["HOLD_SECONDS", "STREAMS", "RankOutput", "end_of_call_marker", "release_held", "show_line", "start_call"]

STREAMS = ("stdout", "stderr")
HOLD_SECONDS = 0.5
_END_OF_CALL = re.compile(rb"\x1elabkit-end-of-call (\d+)\x1e")


def end_of_call_marker(call_id: int) -> bytes:
    """The line a rank writes to both streams after a call: all output before it is that call's."""
    return b"\x1elabkit-end-of-call %d\x1e\n" % call_id


class RankOutput:
    """The two output pipes of one rank. `live`: shown as they come from the start of every call."""

    def __init__(self, rank: int, live: bool):
        self.rank = rank
        self.always_live = live
        self.live = live
        self.release_at = float("inf")
        self._partial = {s: b"" for s in STREAMS}
        self._held: list[tuple[str, str]] = []
        self.stderr_tail: deque[str] = deque(maxlen=12)
        self.closed = {s: False for s in STREAMS}
        self.ended_call = {s: -1 for s in STREAMS}

    def feed(self, stream: str, data: bytes) -> None:
        """Take bytes read from `stream`; b"" means the pipe closed (the rank has ended)."""
        if not data:
            self.closed[stream] = True
            data = b"\n" if self._partial[stream] else b""
        buffer = self._partial[stream] + data
        *lines, self._partial[stream] = buffer.split(b"\n")
        for line in lines:
            marker = _END_OF_CALL.search(line)
            if marker:
                self.ended_call[stream] = int(marker.group(1))
                line = line[: marker.start()]  # output of the call that did not end in a newline
                if not line:
                    continue
            self._emit(stream, line.decode(errors="replace"))

    def _emit(self, stream: str, line: str) -> None:
        line = line.rstrip("\r").rsplit("\r", 1)[-1]  # a progress bar's last state; CRLF endings too
        if stream == "stderr":
            self.stderr_tail.append(line)
        if self.live:
            show_line(stream, self.rank, line)
        else:
            self._held.append((stream, line))

    def hold(self, now: float) -> None:
        """A call starts: hold this rank's lines until `now + HOLD_SECONDS` (rank 0's never)."""
        self.live = self.always_live
        self.release_at = now + HOLD_SECONDS

    def flush(self) -> None:
        """Show held lines; called at the end of every call, in rank order."""
        for stream, line in self._held:
            show_line(stream, self.rank, line)
        self._held.clear()


def start_call(outputs: list[RankOutput]) -> None:
    """A call starts on every rank: hold the lines of ranks after 0 for HOLD_SECONDS."""
    now = time.monotonic()
    for output in outputs:
        output.hold(now)


def release_held(outputs: list[RankOutput]) -> None:
    """Past HOLD_SECONDS into a call, show the held lines rank by rank and every rank's next ones live.

    Called by the pool each time it wakes up to read (at least every half second)."""
    now = time.monotonic()
    for output in sorted(outputs, key=lambda o: o.rank):
        if not output.live and now >= output.release_at:
            output.flush()
            output.live = True


def show_line(stream: str, rank: int, line: str) -> None:
    """Show one line of rank `rank`'s `stream` ("stdout" or "stderr") on the same stream here: `[rank N] line`."""
    target = sys.stdout if stream == "stdout" else sys.stderr
    target.write(f"[rank {rank}] {line}\n")
    target.flush()
