"""The pool's channels: each rank's handle (its process, two sockets, two output pipes), the selector pump that
reads them all, and the stacks a rank is asked for; nothing here decides anything about a call.

Why a room of its own: moving bytes is the part of the launcher that must never block and never lose a message
(a reply half read, a pipe left unregistered); kept apart, it can be read for that alone, and the lifecycle and
the conclusion of a call speak to the ranks only through `Channels`.

Every file descriptor the selector watches is registered with a `Tag` saying what it is, as one of the kinds in
`Tag` (a `TextEnum`, the convention of torchtitan's parallel_dims.py: members are their text, so a pipe's tag is
also the name of its stream, "stdout" or "stderr", as labkit.launch.output names them).
"""

from __future__ import annotations

import os
import selectors
import socket
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from labkit.launch import protocol
from labkit.launch.forkserver import ForkServer
from labkit.launch.output import STREAMS, RankOutput, release_held
from labkit.launch.protocol import (
    Interrupt,
    Outcome,
    RankSpec,
    Ready,
    Reply,
    Returning,
    Stack,
    StackRequest,
    StartFailed,
    TextEnum,
)

__all__ = []

STACK_WAIT_SECONDS = 2.0


class Tag(TextEnum):
    """What a file descriptor in the pump's selector is: the fork server's socket, a rank's job socket, or one of
    its output pipes (the stream's own name)."""

    SERVER = "server"  # exit reports from the fork server
    JOB = "job"  # a rank's start report and replies
    STDOUT = "stdout"
    STDERR = "stderr"
    OUTPUT = "output"  # an attached rank's output, both streams in `OutputChunk` frames (attach.py)


@dataclass
class RankHandle:
    """The owner's end of one rank: its process, its two sockets, its output pipes, what it said."""

    rank: int
    pid: int
    job: Connection
    control: Connection
    pipes: dict[str, int]  # "stdout"/"stderr" -> the read end of that pipe (none for an attached rank)
    output: RankOutput
    output_link: Connection | None = None  # an attached rank's output connection, instead of pipes
    where: str = ""  # an attached rank's node, "on node-b (10.0.0.3)"; "" for a local rank
    started: Ready | StartFailed | None = None  # its first message (None: not yet)
    replies: dict[int, Reply] = field(default_factory=dict)  # by call id, until the call is concluded
    returning: dict[int, int] = field(default_factory=dict)  # call id -> the nbytes of a big result being sent
    gone: bool = False  # its job socket closed or its exit was reported
    gone_at: float = 0.0

    def finished(self, call_id: int) -> bool:
        """Gone, or it has replied to `call_id` and both its streams have shown that call's last line."""
        return self.gone or (call_id in self.replies and all(self.output.ended_call[s] >= call_id for s in STREAMS))

    def failed(self, call_id: int) -> bool:
        """Gone, or its reply to `call_id` is not OK."""
        return self.gone or (call_id in self.replies and self.replies[call_id].outcome != Outcome.OK)


class Channels:
    """Every rank's handle, in rank order (`ranks`), and the one selector that reads what they and the fork
    server send."""

    def __init__(self, server: ForkServer | None):
        self.server = server  # None for attached ranks: torchrun, not labkit, started them
        self.ranks: list[RankHandle] = []
        # The memory cgroup's OOM kill count as the latest start or call began (labkit.classroom.cgroups), so that
        # a rank's SIGKILL is named the OOM killer's only if the count rose since; None: no such count here.
        self.oom_kills_before: int | None = None
        self._selector = selectors.DefaultSelector()
        if server is not None:
            self._selector.register(server.fileno(), selectors.EVENT_READ, (Tag.SERVER, None))

    def open_rank(self, spec: RankSpec, timeout_seconds: float) -> RankHandle:
        """Have the fork server start rank `spec.rank` with fresh sockets and pipes, and watch them."""
        job_ours, job_theirs = socket.socketpair()
        control_ours, control_theirs = socket.socketpair()
        pipes = {stream: os.pipe() for stream in STREAMS}
        theirs = [job_theirs.fileno(), control_theirs.fileno()] + [w for _, w in pipes.values()]
        try:
            pid = self.server.fork(spec, theirs, timeout_seconds)
        except BaseException:
            for ours in (job_ours, control_ours):
                ours.close()
            for read_end, _ in pipes.values():
                os.close(read_end)
            raise
        finally:
            job_theirs.close()
            control_theirs.close()
            for _, write_end in pipes.values():
                os.close(write_end)
        handle = RankHandle(spec.rank, pid, Connection(job_ours.detach()), Connection(control_ours.detach()),
                            {stream: r for stream, (r, _) in pipes.items()}, RankOutput(spec.rank, live=spec.rank == 0))
        self.ranks.append(handle)
        self._selector.register(handle.job.fileno(), selectors.EVENT_READ, (Tag.JOB, handle))
        for stream, fd in handle.pipes.items():
            self._selector.register(fd, selectors.EVENT_READ, (Tag(stream), handle))
        return handle

    def add_attached(self, rank: int, pid: int, job, control, output_link, host: str) -> RankHandle:
        """Watch an attached rank's three signed connections (attach.py): job, control, and its output; `host`
        names its node in its output's labels and in errors."""
        where = f"on {host} ({job.peer.rsplit(':', 1)[0]})"
        handle = RankHandle(rank, pid, job, control, {}, RankOutput(rank, live=rank == 0, host=host),
                            output_link=output_link, where=where)
        self.ranks.append(handle)
        self._selector.register(job.fileno(), selectors.EVENT_READ, (Tag.JOB, handle))
        self._selector.register(output_link.fileno(), selectors.EVENT_READ, (Tag.OUTPUT, handle))
        return handle

    def send_to_all(self, frame: bytes) -> None:
        """Send one encoded message to every rank's job socket; a rank that cannot take it is gone."""
        for r in self.ranks:
            try:
                r.job.send_bytes(frame)
            except OSError:
                self.mark_gone(r)

    def interrupt(self, call_id: int) -> None:
        """Ask every rank still running call `call_id` to stop it (worker.py says how)."""
        for r in self.ranks:
            if not r.finished(call_id):
                try:
                    protocol.send(r.control, Interrupt(call_id))
                except OSError:
                    self.mark_gone(r)

    def pump(self, deadline: float, done) -> None:
        """Read replies, output and exit reports until `done()` or the deadline."""
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._read_once(min(remaining, 0.5))

    def read_waiting(self) -> None:
        """Read what has already come (an attached rank's lost connection, say), without waiting."""
        self._read_once(0.0)

    def _read_once(self, timeout_seconds: float) -> None:
        """One pass: wait at most `timeout_seconds` for something to read, and read all that is ready."""
        for key, _ in self._selector.select(timeout_seconds):
            tag, r = key.data
            if tag is Tag.SERVER:
                self.server.read_reports()
                if not self.server.alive:  # its socket would stay readable at end of file
                    self._selector.unregister(key.fd)
            elif tag is Tag.JOB:
                self.receive(r)
            elif tag is Tag.OUTPUT:
                self._read_output_link(r)
            else:
                self._read_pipe(r, tag)
        for r in self.ranks:
            if not r.gone and self.server is not None and r.pid in self.server.exit_status:
                self.mark_gone(r)
        release_held([r.output for r in self.ranks])

    def receive(self, r: RankHandle) -> None:
        """Take one message from rank `r`'s job socket: its start report, or a reply."""
        try:
            message = protocol.receive(r.job)
        except (EOFError, OSError):
            self.mark_gone(r)
        except BaseException:  # interrupted halfway through a message: this stream can no longer be read
            self.mark_gone(r)
            raise
        else:
            if isinstance(message, Reply):
                r.replies[message.call_id] = message
            elif isinstance(message, Returning):
                r.returning[message.call_id] = message.result_nbytes
            else:
                r.started = message

    def _read_pipe(self, r: RankHandle, stream: Tag) -> None:
        fd = r.pipes[stream]
        data = os.read(fd, 1 << 16)
        r.output.feed(stream.value, data)
        if not data:
            self._selector.unregister(fd)

    def _read_output_link(self, r: RankHandle) -> None:
        """One `OutputChunk` of an attached rank; at the connection's end (or a frame that fails its check), both
        of its streams are closed."""
        try:
            chunk = protocol.receive(r.output_link)
        except (EOFError, OSError):
            self._selector.unregister(r.output_link.fileno())
            for stream in STREAMS:
                if not r.output.closed[stream]:
                    r.output.feed(stream, b"")
            return
        r.output.feed(chunk.stream, chunk.data)

    def mark_gone(self, r: RankHandle) -> None:
        """Rank `r` will say no more: its job socket closed or its exit was reported."""
        if not r.gone:
            r.gone, r.gone_at = True, time.time()
            self._selector.unregister(r.job.fileno())

    def stacks(self, running: list[RankHandle]) -> dict[int, Stack | None]:
        """Ask each running rank where its main thread is; None where no answer came."""
        for r in running:
            try:
                protocol.send(r.control, StackRequest())
            except OSError:
                pass
        stacks, deadline = {}, time.monotonic() + STACK_WAIT_SECONDS
        for r in running:
            try:
                answered = r.control.poll(max(0.0, deadline - time.monotonic()))
                stacks[r.rank] = protocol.receive(r.control) if answered else None
            except (EOFError, OSError):
                stacks[r.rank] = None
        return stacks

    def take_replies(self, call_id: int) -> dict[int, Reply]:
        """Each rank's reply to `call_id`, by rank (those that replied); every rank's replies are cleared."""
        replies = {r.rank: r.replies[call_id] for r in self.ranks if call_id in r.replies}
        for r in self.ranks:
            r.replies.clear()
            r.returning.clear()
        return replies

    def flush_output(self) -> None:
        """Show every rank's output held so far."""
        for r in self.ranks:
            r.output.flush()

    def close(self) -> None:
        """Release every file descriptor (the ranks' processes are the lifecycle's to stop)."""
        for r in self.ranks:
            r.job.close()
            r.control.close()
            for fd in r.pipes.values():
                os.close(fd)
            if r.output_link is not None:
                r.output_link.close()
        self._selector.close()
