"""The owner's side of one world: N rank processes in one process group, ready for calls.

A pool starts its ranks on its first call, so that the call's timeout bounds the start as well: the
ranks must be ready within min(LABKIT_START_TIMEOUT, max(timeout, the backend's cold start)) seconds
(`start_budget_seconds`: never less than a cold start needs, on a busy laptop or on a GPU box whose driver
has not initialised its GPUs yet), and the call then has its full timeout. A grader's 10 s per call is
thus not its pool's start bound. The start fails as soon as one rank fails to start, saying where the
others were still starting.

A call sends the same cloudpickled payload to every rank and then pumps everything that comes back
(replies, both output pipes, exit reports from the fork server) until every rank has answered, one
has failed and the others had a moment to follow, the timeout passes, or the user interrupts.
Whatever happens, the ranks' output is shown first and one clear exception follows. A pool that
may be out of step (a rank died, was stopped, or issued operations its peers never matched) is
closed, so the next call starts from a clean one.

The ranks speak in protocol.py's messages: a `Call` out, one `Reply` back per rank; `StackRequest`
and `Interrupt` on each rank's control socket.

Ctrl-C asks every rank to stop this very call (worker.py says how). The pool is kept only if every
rank then answers the call within a grace period, every process group counted the same number of
operations on each of its ranks during the call, and a tiny all_reduce still works; if anything
interrupts that decision, the pool is closed.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import selectors
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from labkit.launch import protocol, serialize
from labkit.launch.backend import BackendChoice, threads_per_rank
from labkit.launch.errors import (
    Failure,
    NoReply,
    RankError,
    RankTimeout,
    raised_failure,
    rank_list,
    still_running,
)
from labkit.launch.forkserver import ForkServer, describe_exit
from labkit.launch.inflight import BUFFER_SIZE, collectives_report, where_in_collectives
from labkit.launch.output import STREAMS, RankOutput, release_held, start_call
from labkit.launch.protocol import (
    Call,
    Interrupt,
    Outcome,
    RankSpec,
    Ready,
    Reply,
    Stack,
    StackRequest,
    StartFailed,
)
from labkit.launch.worker import health_probe

__all__ = ["CUDA_INIT_SECONDS_PER_GPU", "DEATH_DETAILS_SECONDS", "HEALTH_CHECK_SECONDS", "HEALTH_PROBE",
           "INTERRUPT_GRACE_SECONDS", "MIN_START_SECONDS", "SETTLE_SECONDS", "STACK_WAIT_SECONDS", "Pool", "RankHandle",
           "cold_start_seconds", "start_budget_seconds"]

SETTLE_SECONDS = 1.5  # after one rank fails, how long the others get to finish or fail too
INTERRUPT_GRACE_SECONDS = 1.5  # after Ctrl-C, how long ranks get to stop by themselves
HEALTH_CHECK_SECONDS = 3.0
STACK_WAIT_SECONDS = 2.0
DEATH_DETAILS_SECONDS = 1.0  # to collect a dead rank's exit status and last stderr lines
MIN_START_SECONDS = 10.0  # importing torch and forming a group, on 2 busy cores, takes seconds
# A cold GPU box: NVIDIA's Driver Persistence docs ("Overview") give "a short (order of 1-3 second) startup cost per
# GPU" for a GPU the driver has not initialised (ECC scrubbing), so 3 s per rank, as if one after another; and the
# gloo start's allowance twice over, for importing torch with CUDA and for NCCL's communicator, which labkit
# creates in init_process_group (device_id is bound, backend.py). Designed from those documented costs; no GPU here.
CUDA_INIT_SECONDS_PER_GPU = 3.0

_call_ids = itertools.count(1)
HEALTH_PROBE = serialize.dumps((health_probe, (), {}))  # the call that checks a pool is still in step


def start_budget_seconds(call_timeout_seconds: float, start_timeout_seconds: float, backend: str = "gloo",
                         world_size: int = 1) -> float:
    """How long a pool started by a call may take to be ready: the call's timeout, but at least a cold start
    (`cold_start_seconds`) and at most the owner's start timeout (LABKIT_START_TIMEOUT).

    >>> start_budget_seconds(10, 120), start_budget_seconds(10, 120, "nccl", 8)
    (10, 44.0)
    """
    return min(start_timeout_seconds, max(call_timeout_seconds, cold_start_seconds(backend, world_size)))


def cold_start_seconds(backend: str, world_size: int) -> float:
    """The least time a pool of `world_size` ranks on `backend` is given to start: MIN_START_SECONDS on gloo; on
    NCCL twice that plus CUDA_INIT_SECONDS_PER_GPU per rank (one GPU each)."""
    if backend != "nccl":
        return MIN_START_SECONDS
    return 2 * MIN_START_SECONDS + CUDA_INIT_SECONDS_PER_GPU * world_size


@dataclass
class RankHandle:
    """The owner's end of one rank: its process, its two sockets, its output pipes, what it said."""

    rank: int
    pid: int
    job: Connection
    control: Connection
    pipes: dict[str, int]  # "stdout"/"stderr" -> the read end of that pipe
    output: RankOutput
    started: Ready | StartFailed | None = None  # its first message (None: not yet)
    replies: dict[int, Reply] = field(default_factory=dict)  # by call id, until the call is concluded
    gone: bool = False  # its job socket closed or its exit was reported
    gone_at: float = 0.0

    def finished(self, call_id: int) -> bool:
        """Gone, or it has replied to `call_id` and both its streams have shown that call's last line."""
        return self.gone or (call_id in self.replies and all(self.output.ended_call[s] >= call_id for s in STREAMS))

    def failed(self, call_id: int) -> bool:
        """Gone, or its reply to `call_id` is not OK."""
        return self.gone or (call_id in self.replies and self.replies[call_id].outcome != Outcome.OK)


class Pool:
    """`world_size` ranks joined in a process group with `choice.backend`, started by the first call."""

    def __init__(self, world_size: int, choice: BackendChoice, server: ForkServer, store_path: str,
                 pg_timeout_seconds: float, start_timeout_seconds: float):
        self._world_size = world_size
        self._store_path = store_path  # the FileStore the ranks meet in; removed when the pool closes
        self._choice = choice
        self._closed = False
        self._started = False
        self._server = server
        self._selector = selectors.DefaultSelector()
        self._selector.register(server.fileno(), selectors.EVENT_READ, ("server", None))
        self._pg_timeout_seconds = pg_timeout_seconds
        self._start_timeout_seconds = start_timeout_seconds
        self._ranks: list[RankHandle] = []
        self._last_call_id = 0  # the id of the latest Call sent to the ranks (0: none yet)

    # ---- read-only hooks: what the owner and tests may ask ---------------------------------------------

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def closed(self) -> bool:
        """True once the pool has stopped its ranks; a closed pool serves no further call."""
        return self._closed

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
        return [r.pid for r in self._ranks]

    def controls(self) -> list[Connection]:
        """Each rank's control socket, in rank order: where `StackRequest` and `Interrupt` go."""
        return [r.control for r in self._ranks]

    def why_unhealthy(self) -> str:
        """Why this pool cannot serve the next call, in words for the student."""
        if self._closed:
            return "it was stopped after a call failed, timed out or was interrupted"
        exits = self._server.exit_status
        dead = [r for r in self._ranks if r.gone or r.pid in exits]
        if not dead:
            return "labkit's fork server ended, and its ranks with it"
        return f"{rank_list(r.rank for r in dead)} died while idle ({describe_exit(exits.get(dead[0].pid))})"

    def _start(self, budget_seconds: float) -> None:
        """Start every rank and wait until all are in the group: at most `budget_seconds`, and no
        longer than until one rank fails. A failed start closes the pool."""
        deadline = time.monotonic() + budget_seconds
        try:
            for rank in range(self._world_size):
                spec = self.rank_spec(rank, self._store_path, self._pg_timeout_seconds)
                self._ranks.append(self._start_rank(spec, max(0.0, deadline - time.monotonic())))
            self._wait_until_ready(deadline, budget_seconds)
        except BaseException:
            self.close()
            raise
        self._started = True

    def rank_spec(self, rank: int, store_path: str, pg_timeout_seconds: float) -> RankSpec:
        """What rank `rank` of this pool is started with: its group, this process's directory and path,
        and the environment torchrun would give it."""
        threads = threads_per_rank(self._world_size)
        env = {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self._world_size),
            "LOCAL_WORLD_SIZE": str(self._world_size), "OMP_NUM_THREADS": str(threads),
            "GLOO_SOCKET_IFNAME": "lo0" if sys.platform == "darwin" else "lo",
            "PYTHONUNBUFFERED": "1", "LABKIT_RANK_PROCESS": "1",
        }
        if not {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"} & set(os.environ):
            env["TORCH_FR_BUFFER_SIZE"] = str(BUFFER_SIZE)  # the hang report's Flight Recorder, on NCCL too
        return RankSpec(rank=rank, world_size=self._world_size, backend=self._choice.backend, store_path=store_path,
                        pg_timeout_seconds=pg_timeout_seconds, threads=threads, cwd=os.getcwd(),
                        sys_path=list(sys.path), env=env)

    def _start_rank(self, spec: RankSpec, timeout_seconds: float) -> RankHandle:
        job_ours, job_theirs = socket.socketpair()
        control_ours, control_theirs = socket.socketpair()
        pipes = {stream: os.pipe() for stream in STREAMS}
        theirs = [job_theirs.fileno(), control_theirs.fileno()] + [w for _, w in pipes.values()]
        try:
            pid = self._server.fork(spec, theirs, timeout_seconds)
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
        rank = spec.rank
        state = RankHandle(rank, pid, Connection(job_ours.detach()), Connection(control_ours.detach()),
                      {stream: r for stream, (r, _) in pipes.items()}, RankOutput(rank, live=rank == 0))
        self._selector.register(state.job.fileno(), selectors.EVENT_READ, ("job", state))
        for stream, fd in state.pipes.items():
            self._selector.register(fd, selectors.EVENT_READ, (stream, state))
        return state

    def _wait_until_ready(self, deadline: float, budget_seconds: float) -> None:
        def failed(r: RankHandle) -> bool:
            return r.gone or isinstance(r.started, StartFailed)

        self._pump(deadline, lambda: (all(r.started is not None or r.gone for r in self._ranks)
                                      or any(map(failed, self._ranks))))
        stacks = self._stacks([r for r in self._ranks if r.started is None and not r.gone])
        when = "when another rank failed" if any(map(failed, self._ranks)) else f"after {budget_seconds:g} s"
        failures = [self._start_failure(r, stacks.get(r.rank), when) for r in self._ranks]
        self._flush_output()
        if any(failures):
            raise RankError(f"labkit could not start {self._world_size} ranks ({self._choice.reason}).",
                            [f for f in failures if f is not None], pool_stopped=True)  # _start closes it

    def _start_failure(self, r: RankHandle, stack: Stack | None, when: str) -> Failure | None:
        """Why rank `r` is not ready (`when` says at which moment it was given up), or None if it is."""
        if isinstance(r.started, StartFailed):
            return raised_failure(r.rank, Outcome.ERROR, r.started.error)
        if r.gone:
            return self._death(r)
        if r.started is None:
            summary, detail = still_running(stack)
            return Failure(r.rank, NoReply.STOPPED, f"not ready {when}: "
                           + summary.replace("was still running", "was still starting"), detail)
        return None

    # ---- calls ------------------------------------------------------------------------------------

    def call(self, payload: bytes, timeout_seconds: float, check_health: bool = True) -> list:
        """Run the pickled `(fn, args, kwargs)` on every rank; results in rank order.

        After a failure or an interrupt that every rank survived, the ranks' operation counts and a
        tiny collective check that the group is still in step (not, say, one rank a collective ahead);
        if not, the pool is closed."""
        if not self._started:
            self._start(start_budget_seconds(timeout_seconds, self._start_timeout_seconds, self._choice.backend,
                                             self._world_size))
        call = Call(next(_call_ids), timeout_seconds, payload)
        self._last_call_id = call.call_id
        try:
            self._send_and_wait(call)
        except KeyboardInterrupt:
            try:
                if not check_health:
                    raise  # the health probe itself was interrupted: nothing left to judge the pool by
                self._stop_after_interrupt(call.call_id)
            except BaseException:
                self.close()  # a second Ctrl-C, or a stream left broken: give up the pool
                raise
            raise
        except BaseException:
            self.close()  # e.g. a test timeout's exception: the ranks may still run this call
            raise
        try:
            return self._conclude(call, check_health)
        except (RankError, TypeError):
            raise  # the call's own verdict; _conclude has decided whether the pool stays
        except BaseException:
            self.close()  # interrupted or broken while concluding: the ranks may be out of step
            raise

    def _send_and_wait(self, call: Call) -> None:
        """Send `call` to every rank, then pump until all have finished it, or one has failed and the
        others had SETTLE_SECONDS to follow, or its timeout passes."""
        deadline = time.monotonic() + call.timeout_seconds
        frame = protocol.encode(call)  # pickled once, sent to every rank

        def all_finished() -> bool:
            return all(r.finished(call.call_id) for r in self._ranks)

        def some_failed() -> bool:
            return any(r.failed(call.call_id) for r in self._ranks)

        start_call([r.output for r in self._ranks])
        for r in self._ranks:
            try:
                r.job.send_bytes(frame)
            except OSError:
                self._mark_gone(r)
        self._pump(deadline, lambda: all_finished() or some_failed())
        if not all_finished() and some_failed():
            self._pump(min(deadline, time.monotonic() + SETTLE_SECONDS), all_finished)

    def _conclude(self, call: Call, check_health: bool) -> list:
        """The results in rank order, or the one exception that says what went wrong; whether the pool
        is kept is decided here."""
        running = [r for r in self._ranks if not r.finished(call.call_id)]
        # Ranks still running: where each is, and from every live rank, the collectives it has not seen complete
        stacks = self._stacks([r for r in self._ranks if not r.gone] if running else [])
        self._flush_output()
        replies = self._take_replies(call.call_id)
        self._close_if_group_destroyed(replies)
        failures = [self._death(r) for r in self._ranks if r.gone and r.rank not in replies]
        failures += [_failure_from_reply(rank, reply) for rank, reply in replies.items() if reply.outcome != Outcome.OK]
        failures += [Failure(r.rank, NoReply.STOPPED, *_still_running(stacks[r.rank])) for r in running]
        if not failures:
            return [serialize.load_result(r, replies[r].body) for r in range(self._world_size)]
        if not (running or any(r.gone for r in self._ranks) or self._closed) and check_health:
            self._keep_if_in_step(replies)
        else:
            self.close()
        notes = collectives_report({rank: stack.collectives if stack else None for rank, stack in stacks.items()})
        raise self._call_error(failures, [r.rank for r in running], call.timeout_seconds, notes)

    def _call_error(self, failures: list[Failure], running: list[int], timeout_seconds: float,
                    notes: list[str]) -> Exception:
        """The exception a failed call raises: TypeError if every failure is an unpicklable result,
        RankTimeout if every failure is a rank still running, RankError otherwise; `notes` (which collective
        each group's ranks are in) go under its headline."""
        restarted = "" if not self._closed else (
            f" The {self._world_size}-rank pool was stopped; the next call starts a fresh one"
            " (variables defined in %%ranks cells are gone)."
        )
        unpicklable = [f for f in failures if f.kind == Outcome.UNPICKLABLE]
        if unpicklable and len(unpicklable) == len(failures):
            return TypeError(f"{rank_list(f.rank for f in unpicklable)} returned a value that cannot be "
                             f"sent back: {unpicklable[0].summary}. Return plain data (tensors, numbers, "
                             "lists, dicts) instead.")
        if running and len(running) == len(failures):
            done = [r.rank for r in self._ranks if r.rank not in running]
            finished = f" ({rank_list(done)} had returned)" if done else ""
            return RankTimeout(f"labkit.run timed out after {timeout_seconds:g} s: {rank_list(running)} "
                               f"still running{finished}.{restarted}", failures, notes, pool_stopped=self._closed)
        failed = sorted({f.rank for f in failures if f.kind != NoReply.STOPPED})
        return RankError(f"{rank_list(failed)} of {self._world_size} failed.{restarted}", failures, notes,
                         pool_stopped=self._closed)

    def _take_replies(self, call_id: int) -> dict[int, Reply]:
        """Each rank's reply to `call_id`, by rank (those that replied); every rank's replies are cleared."""
        replies = {r.rank: r.replies[call_id] for r in self._ranks if call_id in r.replies}
        for r in self._ranks:
            r.replies.clear()
        return replies

    def _stacks(self, running: list[RankHandle]) -> dict[int, Stack | None]:
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

    def _stop_after_interrupt(self, call_id: int) -> None:
        """Ctrl-C: ask every rank still running to stop call `call_id`; keep the pool only if each
        rank answered that call and they stopped in step. Anything raised here closes the pool."""
        for r in self._ranks:
            if not r.finished(call_id):
                try:
                    protocol.send(r.control, Interrupt(call_id))
                except OSError:
                    self._mark_gone(r)
        self._pump(time.monotonic() + INTERRUPT_GRACE_SECONDS, lambda: all(r.finished(call_id) for r in self._ranks))
        self._flush_output()
        stuck = [r.rank for r in self._ranks if not r.finished(call_id)]
        replies = self._take_replies(call_id)
        self._close_if_group_destroyed(replies)
        if stuck or any(r.gone for r in self._ranks):
            self.close()
        else:
            self._keep_if_in_step(replies)
        if self._closed:
            why = f"{rank_list(stuck)} did not stop" if stuck else "the ranks stopped out of step"
            print(f"labkit: interrupted; {why}, so the pool was stopped "
                  "(the next call starts a fresh one).", file=sys.stderr)
        else:
            print("labkit: interrupted; every rank stopped cleanly and the pool is kept.", file=sys.stderr)

    def _close_if_group_destroyed(self, replies: dict[int, Reply]) -> None:
        """A rank that called dist.destroy_process_group() cannot take part in the next call: close
        the pool and say so; the call's results still come back."""
        destroyed = [rank for rank, reply in replies.items() if reply.group_destroyed]
        if destroyed and not self._closed:
            self.close()
            print(f"labkit: {rank_list(destroyed)} destroyed the process group (dist.destroy_process_group()): "
                  f"the {self._world_size}-rank pool was stopped, and the next call starts a fresh one (variables "
                  "defined in %%ranks cells are gone). labkit's pool creates and destroys the group itself.",
                  file=sys.stderr)

    def _keep_if_in_step(self, replies: dict[int, Reply]) -> None:
        """Close the pool unless every rank answered, each process group issued as many operations
        on each of its ranks during the call, and a tiny all_reduce still works.

        The all_reduce alone can be fooled: if rank 1 left an all_reduce unmatched, rank 0's probe
        completes against it. The counts cannot: they are read on each rank, with no collective."""
        if len(replies) != self._world_size or not _same_steps([reply.steps for reply in replies.values()]):
            self.close()
            return
        try:
            total = self.call(HEALTH_PROBE, HEALTH_CHECK_SECONDS, check_health=False)
        except RankError:
            total = None  # the probe call has closed the pool already
        if total != [float(self._world_size)] * self._world_size:
            self.close()

    # ---- moving bytes -----------------------------------------------------------------------------

    def _pump(self, deadline: float, done) -> None:
        """Read replies, output and exit reports until `done()` or the deadline."""
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            for key, _ in self._selector.select(min(remaining, 0.5)):
                kind, r = key.data
                if kind == "server":
                    self._server.read_reports()
                    if not self._server.alive:  # its socket would stay readable at end of file
                        self._selector.unregister(key.fd)
                elif kind == "job":
                    self.receive(r)
                else:
                    self._read_pipe(r, kind)
            for r in self._ranks:
                if not r.gone and r.pid in self._server.exit_status:
                    self._mark_gone(r)
            release_held([r.output for r in self._ranks])

    def receive(self, r: RankHandle) -> None:
        """Take one message from rank `r`'s job socket: its start report, or a reply."""
        try:
            message = protocol.receive(r.job)
        except (EOFError, OSError):
            self._mark_gone(r)
        except BaseException:  # interrupted halfway through a message: this stream can no longer be read
            self._mark_gone(r)
            raise
        else:
            if isinstance(message, Reply):
                r.replies[message.call_id] = message
            else:
                r.started = message

    def _read_pipe(self, r: RankHandle, stream: str) -> None:
        fd = r.pipes[stream]
        data = os.read(fd, 1 << 16)
        r.output.feed(stream, data)
        if not data:
            self._selector.unregister(fd)

    def _mark_gone(self, r: RankHandle) -> None:
        if not r.gone:
            r.gone, r.gone_at = True, time.time()
            self._selector.unregister(r.job.fileno())

    def _death(self, r: RankHandle) -> Failure:
        """A dead rank, named with its signal or exit code and its last lines of stderr."""
        self._server.wait_for_exit([r.pid], DEATH_DETAILS_SECONDS)
        self._pump(time.monotonic() + DEATH_DETAILS_SECONDS, lambda: all(r.output.closed.values()))
        how = describe_exit(self._server.exit_status.get(r.pid))
        hint = " (SIGKILL from outside often means the machine ran out of memory)" if "SIGKILL" in how else ""
        return Failure(r.rank, NoReply.DIED, f"process {how}{hint}", time=r.gone_at,
                       stderr_tail=list(r.output.stderr_tail))

    def _flush_output(self) -> None:
        for r in self._ranks:
            r.output.flush()

    def healthy(self) -> bool:
        """Open, and every rank still alive."""
        if self._closed:
            return False
        self._server.read_reports()
        return self._server.alive and not any(r.gone or r.pid in self._server.exit_status for r in self._ranks)

    def close(self) -> None:
        """Stop every rank now and release every file descriptor. Idempotent."""
        if self._closed:
            return
        self._closed = True
        pids = [r.pid for r in self._ranks]
        try:
            if self._server.alive:  # otherwise its ranks have died with it
                self._server.signal(pids, signal.SIGKILL)
                self._server.wait_for_exit(pids, 3.0)
        finally:  # even if Ctrl-C cut the wait short: a rank whose control socket closes ends itself
            for r in self._ranks:
                r.job.close()
                r.control.close()
                for fd in r.pipes.values():
                    os.close(fd)
            self._selector.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._store_path)


def _still_running(stack: Stack | None) -> tuple[str, str]:
    """errors.still_running for a stopped rank, with the collective it is in where its recorder said."""
    return still_running(stack, where_in_collectives(stack.collectives) if stack else "")


def _same_steps(steps: list[dict[str, int] | None]) -> bool:
    """True if every rank counted its operations, and those in one group issued the same number."""
    if any(s is None for s in steps):
        return False
    per_group: dict[str, set[int]] = {}
    for counts in steps:
        for group, count in counts.items():
            per_group.setdefault(group, set()).add(count)
    return all(len(counts) == 1 for counts in per_group.values())


def _failure_from_reply(rank: int, reply: Reply) -> Failure:
    """A rank's failed reply as a Failure. One marked follow-on (errors.FOLLOW_ON_ATTRIBUTE) gets an
    unknown time (inf), so that whoever picks the earliest failure as the root cause picks another."""
    if reply.outcome == Outcome.UNPICKLABLE:
        return Failure(rank, Outcome.UNPICKLABLE, reply.body, time=reply.finished_at)
    if reply.outcome == Outcome.INTERRUPTED:
        return raised_failure(rank, Outcome.INTERRUPTED, reply.body, "interrupted", time=reply.finished_at)
    error = reply.body
    return raised_failure(rank, Outcome.ERROR, error, time=float("inf") if error.follow_on else reply.finished_at)
