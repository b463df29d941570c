"""The owner's side of one world: N rank processes in one process group, ready for calls.

A call sends the same cloudpickled payload to every rank and then pumps everything that comes back
(replies, both output pipes, exit reports from the fork server) until every rank has answered, one
has failed and the others had a moment to follow, the timeout passes, or the user interrupts.
Whatever happens, the ranks' output is shown first and one clear exception follows. A pool that
may be out of step (a rank died, was stopped, or issued operations its peers never matched) is
closed, so the next call starts from a clean one.

The ranks speak in protocol.py's messages: a `Call` out, one `Reply` back per rank; `StackRequest`
and `Interrupt` on each rank's control socket.

`Pool` is a composition of three rooms, each a private module with one job:

- `_lifecycle`: starting the ranks (within `start_budget_seconds`), running a call, the health check after a
  failure or an interrupt, and stopping them: every decision to keep or close the pool;
- `_channels`: the rank handles, the selector pump that reads their sockets and pipes (each tagged with a
  `Tag`), and the stacks a rank is asked for: moving bytes, deciding nothing;
- `_conclude`: from what came back, the results or the one exception (`RankError`, `RankTimeout`, TypeError),
  each rank's `Failure`, and whether the ranks are still in step to be kept.

This module adds the read-only hooks the owner and the tests read; the pool's state stays its own.
"""

from __future__ import annotations

import os
from multiprocessing.connection import Connection

from labkit.launch import netns
from labkit.launch._channels import RankHandle
from labkit.launch._lifecycle import Lifecycle, cold_start_seconds, start_budget_seconds
from labkit.launch.errors import rank_list
from labkit.launch.forkserver import describe_exit

__all__ = ["Pool", "RankHandle", "cold_start_seconds", "start_budget_seconds"]


class Pool(Lifecycle):
    """`world_size` ranks joined in a process group with `choice.backend`, started by the first call
    (`_lifecycle.Lifecycle`), with the read-only hooks below."""

    @property
    def store_path(self) -> str:
        """The FileStore the ranks meet in; removed when the pool closes."""
        return self._store_path

    @property
    def last_call_id(self) -> int:
        """The id of the latest Call sent to the ranks (0: none yet)."""
        return self._last_call_id

    def pids(self) -> list[int]:
        """The ranks' process ids, in rank order (empty before the pool starts)."""
        return [r.pid for r in self._channels.ranks]

    def controls(self) -> list[Connection]:
        """Each rank's control socket, in rank order: where `StackRequest` and `Interrupt` go."""
        return [r.control for r in self._channels.ranks]

    def why_unhealthy(self) -> str:
        """Why this pool cannot serve the next call, in words for the student."""
        if self._closed:
            return "it was stopped after a call failed, timed out or was interrupted"
        exits = self._server.exit_status
        dead = [r for r in self._channels.ranks if r.gone or r.pid in exits]
        if not dead:
            return "labkit's fork server ended, and its ranks with it"
        why = f"{rank_list(r.rank for r in dead)} died while idle ({describe_exit(exits.get(dead[0].pid))})"
        if any("Too many open files" in _unread_stderr(r) for r in dead):
            why += f"; a rank said 'Too many open files': {netns.TOO_MANY_FILES_CAUSE}"
        return why


def _unread_stderr(r: RankHandle) -> str:
    """What rank `r` wrote on stderr that no call has shown: the last words of a rank that died between calls
    (gloo's "accept: Too many open files"); at most 1 MiB, without waiting."""
    fd = r.pipes["stderr"]
    os.set_blocking(fd, False)
    chunks: list[bytes] = []
    try:
        while sum(map(len, chunks)) < 1 << 20 and (chunk := os.read(fd, 1 << 16)):
            chunks.append(chunk)
    except OSError:  # nothing more to read now (BlockingIOError), or the pipe is closed already
        pass
    return b"".join(chunks).decode(errors="replace")
