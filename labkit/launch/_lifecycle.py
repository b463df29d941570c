"""A pool's life: starting its ranks, running a call on them, checking they are still in step, and stopping them.

Why a room of its own: when ranks start and stop is the launcher's one piece of state that outlives a call;
kept apart from moving bytes (`_channels`) and from judging what came back (`_conclude`), each decision to
keep or close the pool is made here and only here.

A pool starts its ranks on its first call, so that the call's timeout bounds the start as well: the
ranks must be ready within min(LABKIT_START_TIMEOUT, max(timeout, the backend's cold start)) seconds
(`start_budget_seconds`: never less than a cold start needs, on a busy laptop or on a GPU box whose driver
has not initialised its GPUs yet), and the call then has its full timeout. A grader's 10 s per call is
thus not its pool's start bound. The start fails as soon as one rank fails to start, saying where the
others were still starting.

Ctrl-C asks every rank to stop this very call (worker.py says how). The pool is kept only if every
rank then answers the call within a grace period, every process group counted the same number of
operations on each of its ranks during the call, and a tiny all_reduce still works; if anything
interrupts that decision, the pool is closed.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import sys
import time

from labkit.classroom.cgroups import oom_kill_count
from labkit.launch import _conclude, netns, protocol, serialize
from labkit.launch._channels import Channels
from labkit.launch.backend import BackendChoice, threads_per_rank
from labkit.launch.errors import RankError, rank_list
from labkit.launch.forkserver import ForkServer
from labkit.launch.inflight import BUFFER_SIZE
from labkit.launch.output import start_call
from labkit.launch.protocol import Call, RankSpec, Reply, StartFailed
from labkit.launch.worker import health_probe

__all__ = []

SETTLE_SECONDS = 1.5  # after one rank fails, how long the others get to finish or fail too
INTERRUPT_GRACE_SECONDS = 1.5  # after Ctrl-C, how long ranks get to stop by themselves
HEALTH_CHECK_SECONDS = 3.0
# Importing torch and forming a group, on 2 busy cores, takes seconds. On a class's shared server a pool's start waits
# on everyone's processes: 8 students starting ranks at once on 2 cores took 11 s (tests/hub), so the hub's spawner
# raises the floor (LABKIT_MIN_START_SECONDS, labkit.classroom.spawner).
MIN_START_SECONDS = float(os.environ.get("LABKIT_MIN_START_SECONDS", 10.0))
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


class Lifecycle:
    """`world_size` ranks joined in a process group with `choice.backend`, started by the first call."""

    def __init__(self, world_size: int, choice: BackendChoice, server: ForkServer, store_path: str,
                 pg_timeout_seconds: float, start_timeout_seconds: float):
        self._world_size = world_size
        self._store_path = store_path  # the FileStore the ranks meet in; removed when the pool closes
        self._choice = choice
        self._closed = False
        self._started = False
        self._server = server
        self._channels = Channels(server)
        self._pg_timeout_seconds = pg_timeout_seconds
        self._start_timeout_seconds = start_timeout_seconds
        self._last_call_id = 0  # the id of the latest Call sent to the ranks (0: none yet)

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def closed(self) -> bool:
        """True once the pool has stopped its ranks; a closed pool serves no further call."""
        return self._closed

    # ---- start ------------------------------------------------------------------------------------

    def _start(self, budget_seconds: float) -> None:
        """Start every rank and wait until all are in the group: at most `budget_seconds`, and no
        longer than until one rank fails. A failed start closes the pool."""
        deadline = time.monotonic() + budget_seconds
        self._channels.oom_kills_before = oom_kill_count()
        try:
            for rank in range(self._world_size):
                spec = self.rank_spec(rank, self._store_path, self._pg_timeout_seconds)
                self._channels.open_rank(spec, max(0.0, deadline - time.monotonic()))
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
                        sys_path=list(sys.path), env=env, network=netns.rank_network(self._choice.backend))

    def _wait_until_ready(self, deadline: float, budget_seconds: float) -> None:
        ranks = self._channels.ranks

        def failed(r) -> bool:
            return r.gone or isinstance(r.started, StartFailed)

        self._channels.pump(deadline, lambda: (all(r.started is not None or r.gone for r in ranks)
                                               or any(map(failed, ranks))))
        stacks = self._channels.stacks([r for r in ranks if r.started is None and not r.gone])
        when = "when another rank failed" if any(map(failed, ranks)) else f"after {budget_seconds:g} s"
        failures = [_conclude.start_failure(self._channels, r, stacks.get(r.rank), when) for r in ranks]
        self._channels.flush_output()
        if any(failures):
            raise RankError(f"labkit could not start {self._world_size} ranks ({self._choice.reason}).",
                            [f for f in failures if f is not None], pool_stopped=True)  # _start closes it

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
            return self._verdict(call, check_health)
        except (RankError, TypeError):
            raise  # the call's own verdict; _verdict has decided whether the pool stays
        except BaseException:
            self.close()  # interrupted or broken while concluding: the ranks may be out of step
            raise

    def _send_and_wait(self, call: Call) -> None:
        """Send `call` to every rank, then pump until all have finished it, or one has failed and the
        others had SETTLE_SECONDS to follow, or its timeout passes."""
        deadline = time.monotonic() + call.timeout_seconds
        ranks = self._channels.ranks

        def all_finished() -> bool:
            return all(r.finished(call.call_id) for r in ranks)

        def some_failed() -> bool:
            return any(r.failed(call.call_id) for r in ranks)

        start_call([r.output for r in ranks])
        self._channels.oom_kills_before = oom_kill_count()
        self._channels.send_to_all(protocol.encode(call))  # pickled once, sent to every rank
        self._channels.pump(deadline, lambda: all_finished() or some_failed())
        if not all_finished() and some_failed():
            self._channels.pump(min(deadline, time.monotonic() + SETTLE_SECONDS), all_finished)

    def _verdict(self, call: Call, check_health: bool) -> list:
        """The results in rank order, or the one exception that says what went wrong (`_conclude` says which);
        whether the pool is kept is decided here."""
        ending = _conclude.gather(self._channels, call.call_id)
        self._close_if_group_destroyed(ending.replies)
        if not ending.failures:
            return _conclude.results(ending, self._world_size)
        if check_health and not self._closed and _conclude.may_keep(ending, self._channels):
            self._keep_if_healthy()
        else:
            self.close()
        raise _conclude.call_error(ending, self._world_size, call.timeout_seconds, pool_stopped=self._closed)

    def _stop_after_interrupt(self, call_id: int) -> None:
        """Ctrl-C: ask every rank still running to stop call `call_id`; keep the pool only if each
        rank answered that call and they stopped in step. Anything raised here closes the pool."""
        ranks = self._channels.ranks
        self._channels.interrupt(call_id)
        self._channels.pump(time.monotonic() + INTERRUPT_GRACE_SECONDS, lambda: all(r.finished(call_id) for r in ranks))
        self._channels.flush_output()
        stuck = [r.rank for r in ranks if not r.finished(call_id)]
        ending = _conclude.Ending(self._channels.take_replies(call_id), [], [], {})
        self._close_if_group_destroyed(ending.replies)
        if stuck or self._closed or not _conclude.may_keep(ending, self._channels):
            self.close()
        else:
            self._keep_if_healthy()
        if self._closed:
            why = f"{rank_list(stuck)} did not stop" if stuck else "the ranks stopped out of step"
            print(f"labkit: interrupted; {why}, so the pool was stopped "
                  "(the next call starts a fresh one).", file=sys.stderr)
        else:
            print("labkit: interrupted; every rank stopped cleanly and the pool is kept.", file=sys.stderr)

    # ---- health -----------------------------------------------------------------------------------

    def _close_if_group_destroyed(self, replies: dict[int, Reply]) -> None:
        """A rank that called dist.destroy_process_group() cannot take part in the next call: close
        the pool and say so; the call's results still come back."""
        destroyed = _conclude.destroyed_group(replies)
        if destroyed and not self._closed:
            self.close()
            print(f"labkit: {rank_list(destroyed)} destroyed the process group (dist.destroy_process_group()): "
                  f"the {self._world_size}-rank pool was stopped, and the next call starts a fresh one (variables "
                  "defined in %%ranks cells are gone). labkit's pool creates and destroys the group itself.",
                  file=sys.stderr)

    def _keep_if_healthy(self) -> None:
        """Close the pool unless a tiny all_reduce still works, once the ranks' counts agree (`_conclude.may_keep`).

        The all_reduce alone can be fooled: if rank 1 left an all_reduce unmatched, rank 0's probe
        completes against it. The counts cannot: they are read on each rank, with no collective."""
        try:
            total = self.call(HEALTH_PROBE, HEALTH_CHECK_SECONDS, check_health=False)
        except RankError:
            total = None  # the probe call has closed the pool already
        if total != [float(self._world_size)] * self._world_size:
            self.close()

    def healthy(self) -> bool:
        """Open, and every rank still alive."""
        if self._closed:
            return False
        self._server.read_reports()
        return self._server.alive and not any(r.gone or r.pid in self._server.exit_status
                                              for r in self._channels.ranks)

    # ---- stop -------------------------------------------------------------------------------------

    def release(self) -> None:
        """The owner is done with this pool (labkit.shutdown): for local ranks, `close`."""
        self.close()

    def close(self) -> None:
        """Stop every rank now and release every file descriptor. Idempotent."""
        if self._closed:
            return
        self._closed = True
        pids = [r.pid for r in self._channels.ranks]
        try:
            if self._server.alive:  # otherwise its ranks have died with it
                self._server.signal(pids, signal.SIGKILL)
                self._server.wait_for_exit(pids, 3.0)
        finally:  # even if Ctrl-C cut the wait short: a rank whose control socket closes ends itself
            self._channels.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._store_path)
