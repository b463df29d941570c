"""`labkit.run(fn, world_size=N)`: call a function on N ranks and get their results back.

The owner (a notebook's kernel or a script) keeps, for its whole life, a fork server and one warm
pool of ranks per (world size, backend): the first call pays for the start, later calls cost
milliseconds. The owner itself never joins a process group, so it stays free to plot, to use CUDA
and to be interrupted.

Ranks meet through a torch.distributed.FileStore, one file per pool with an unguessable name
(secrets.token_hex) in a directory only this user can enter (tempfile.mkdtemp creates it with mode
0700). A TCP store on 127.0.0.1 would let any local user list its keys, read the ranks' addresses,
or plant keys for the next pool; a file another user cannot open leaves nothing to reach.

One call at a time: every call, `%%ranks` cell and shutdown holds the owner's turn (_turn.py) while it
touches the pools, so two threads never read each other's replies. Pools are kept per (world size, backend,
whose): `whose` is None for the student's own calls, and a name inside `pools_apart(name)` (a grader's), so
that what graded code leaves in its ranks never reaches the student's, nor the student's `%%ranks`
variables a grader.
"""

from __future__ import annotations

import atexit
import contextvars
import os
import secrets
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

from labkit.checks import rank_count, timeout_seconds
from labkit.classroom.caps import MAX_WORLD_SIZE_VARIABLE, capped_world_size, max_world_size
from labkit.launch import serialize
from labkit.launch._turn import Turn
from labkit.launch.backend import BackendChoice, choose_backend, usable_gpu_count
from labkit.launch.errors import Interrupted
from labkit.launch.forkserver import ForkServer
from labkit.launch.pool import Pool
from labkit.tables import print_line

__all__ = ["EXIT_WAIT_SECONDS", "MAX_APART_RANKS", "MAX_LIVE_RANKS", "OWNER", "PG_TIMEOUT_SECONDS", "PoolKey",
           "SHUTDOWN_WAIT_SECONDS", "START_TIMEOUT_SECONDS", "Owner", "live_ranks_limit", "pools_apart", "prestart",
           "run", "shutdown", "student_world_size"]

MAX_LIVE_RANKS = 16  # the student's own ranks kept warm before their least recently used pool is stopped
MAX_APART_RANKS = 16  # the same for all pools apart (the graders') together: neither budget evicts the other's
PG_TIMEOUT_SECONDS = float(os.environ.get("LABKIT_PG_TIMEOUT", 30))
START_TIMEOUT_SECONDS = float(os.environ.get("LABKIT_START_TIMEOUT", 120))
SHUTDOWN_WAIT_SECONDS = 60.0  # how long labkit.shutdown() waits for a call of another thread to end
EXIT_WAIT_SECONDS = 5.0  # at exit, how long to wait for such a call before stopping the ranks anyway

PoolKey = tuple[int, str, str | None]  # (world size, backend, whose: None for the student's own pools)
ATTACHED = "attached"  # the backend field of the key of the pool of attached ranks (labkit.attach)
_whose: contextvars.ContextVar[str | None] = contextvars.ContextVar("labkit_pools_whose", default=None)


class Owner:
    """What this process holds for its ranks: the fork server, the warm pools, the store directory.
    There is one, OWNER; `run`, `shutdown` and %%ranks use it, each holding its `turn`.

    Each pool gets a serial number; when a pool goes, `why_ended(serial)` says why, so that %%ranks can
    tell the student why the variables it held are gone. Its state is its own: the read-only hooks
    (`kept_pool`, `store_directory`, `fork_server`, `serial`, `why_ended`, `gpu_count`, `turn`) are what others
    read."""

    def __init__(self):
        self._store_dir: str | None = None
        self._server: ForkServer | None = None
        self._pools: OrderedDict[PoolKey, Pool] = OrderedDict()
        self._serials: dict[PoolKey, int] = {}  # the serial number of the pool now kept for a key
        self._ended: dict[int, str] = {}  # why the pool with this serial number was stopped
        self._announced: set[str] = set()
        self._gpu_count: int | None = None
        self._pools_started = 0
        self._turn = Turn()
        self._attachment = None  # _attached.Attachment: ranks torchrun started, for one world size

    @property
    def turn(self) -> Turn:
        """The one turn every call, cell and shutdown holds while it touches the pools (_turn.py)."""
        return self._turn

    def call(self, fn, args: tuple, kwargs: dict, world_size: int, backend: str, timeout: float) -> list:
        """`fn(*args, **kwargs)` on a pool of `world_size` ranks (`run`'s work); the caller holds the turn."""
        payload = _pickle_call(fn, args, kwargs)
        __tracebackhide__ = True  # IPython shows the student's lines, not labkit's
        try:
            return self.pool(world_size, backend).call(payload, timeout)
        except KeyboardInterrupt:
            pass  # the pool has said what became of the ranks
        raise Interrupted from None  # without the selector and pool frames it interrupted

    def pool(self, world_size: int, backend: str) -> Pool:
        """A healthy pool for `world_size` ranks on `backend` ("auto", "gloo" or "nccl"), started if need be."""
        return self._pools[self.pool_key(world_size, backend)]

    def pool_key(self, world_size: int, backend: str) -> PoolKey:
        """The key of a healthy pool for `world_size` ranks on `backend`, for whoever asks (`pools_apart`),
        started if need be."""
        attachment = self._attachment
        if attachment is not None and world_size == attachment.world_size and _whose.get() is None:
            return self._attached_key(backend)
        choice = choose_backend(backend, world_size, self.gpu_count())
        key = (world_size, choice.backend, _whose.get())
        pool = self._pools.get(key)
        if pool is not None and pool.healthy():
            self._pools.move_to_end(key)
            return key
        if pool is not None:
            self._retire(key, pool.why_unhealthy())
        self._make_room(world_size, key[2])
        self.announce(world_size, choice)
        self._pools[key] = self._start_pool(world_size, choice)
        self._serials[key] = self._pools_started
        return key

    def adopt(self, attachment) -> None:
        """Serve the student's calls on `attachment.world_size` ranks with its pool of attached ranks, from now on;
        a previous attachment is ended. The caller holds the turn."""
        self.detach()
        self._attachment = attachment
        key = (attachment.world_size, ATTACHED, None)
        if key in self._pools:
            self._retire(key, "labkit.attach() replaced it")
        self._pools_started += 1
        self._pools[key] = attachment.pool
        self._serials[key] = self._pools_started

    def _attached_key(self, backend: str) -> PoolKey:
        """The key of the healthy pool of attached ranks; after torchrun restarted them, the pool they form again."""
        attachment = self._attachment
        if backend not in ("auto", attachment.pool._choice.backend):
            raise ValueError(f"backend={backend!r}: the {attachment.world_size} attached ranks run "
                             f"{attachment.pool._choice.backend} (labkit.attach chose it); leave backend='auto'.")
        key = (attachment.world_size, ATTACHED, None)
        pool = self._pools.get(key)
        if pool is not None and pool.healthy():
            return key
        if pool is not None:
            self._retire(key, pool.why_unhealthy())
        self._pools_started += 1
        self._pools[key] = attachment.next_pool(START_TIMEOUT_SECONDS, PG_TIMEOUT_SECONDS)
        self._serials[key] = self._pools_started
        return key

    def detach(self) -> None:
        """End the attached ranks (they exit 0, and torchrun ends) and stop listening. The caller holds the turn."""
        if self._attachment is None:
            return
        key = (self._attachment.world_size, ATTACHED, None)
        if key in self._pools:
            self._retire(key, "labkit.shutdown() ended the attached ranks", release=True)
        self._attachment.close()
        self._attachment = None

    @property
    def attachment(self):
        """The attached ranks' `Attachment` (labkit.attach), None if none."""
        return self._attachment

    def _start_pool(self, world_size: int, choice: BackendChoice) -> Pool:
        if self._server is None or not self._server.alive or self._server.process.poll() is not None:
            if self._server is not None:
                self._server.close()
            self._server = ForkServer()  # start its `import torch` before ours below
        if self._store_dir is None:
            self._store_dir = tempfile.mkdtemp(prefix="labkit-")  # mode 0700, a fresh name
        self._pools_started += 1
        store_path = os.path.join(self._store_dir, secrets.token_hex(16))
        return Pool(world_size, choice, self._server, store_path, PG_TIMEOUT_SECONDS, START_TIMEOUT_SECONDS)

    def _retire(self, key: PoolKey, reason: str, release: bool = False) -> None:
        """Stop the pool kept for `key` and remember why; `release`: the owner is done with it (attached ranks then
        exit 0 rather than ask torchrun for a restart)."""
        pool = self._pools.pop(key)
        pool.release() if release else pool.close()
        self._ended[self._serials.pop(key)] = reason

    def _make_room(self, world_size: int, whose: str | None) -> None:
        """Stop closed pools, then the least recently used of the same budget until `world_size` more ranks fit.
        Two budgets, so that neither evicts the other: the student's own pools (MAX_LIVE_RANKS), whose ranks hold
        their %%ranks variables, and all pools apart (MAX_APART_RANKS). Why: one shared budget let a grading
        beside the student's pools of 2, 3 and 4 ranks stop its previous case's pool for every case, 36 cold
        starts in six gradings (benchmarks/grading_beside_student_pools.py); an idle rank keeps about 5 MB of its
        own (the rest is shared with the fork server), so 32 idle ranks cost little."""
        for key in [k for k, p in self._pools.items() if p.closed]:
            self._retire(key, self._pools[key].why_unhealthy())
        apart = whose is not None
        limit, ranks = (MAX_APART_RANKS, "graders' ranks") if apart else (live_ranks_limit(), "ranks")
        same = [k for k in self._pools if k[1] != ATTACHED and (k[2] is not None) == apart]  # least recently used
        while same and sum(self._pools[k].world_size for k in same) + world_size > limit:
            self._retire(same.pop(0), f"it was stopped to make room for {world_size} ranks: labkit keeps at most "
                                      f"{limit} {ranks} running{_class_cap_note(limit, apart)}")

    def announce(self, world_size: int, choice: BackendChoice) -> None:
        """Say how `world_size` ranks will run: the backend, why, and each rank's device; once per reason."""
        if choice.reason not in self._announced:
            self._announced.add(choice.reason)
            print_line(f"labkit: {world_size} ranks, {choice.reason}; {_devices(world_size, choice.backend)}.")

    @property
    def pools_started(self) -> int:
        """How many pools this owner has started (a read-only hook: benchmarks/grading_beside_student_pools.py)."""
        return self._pools_started

    def serial(self, key: PoolKey) -> int | None:
        """The serial number of the pool kept for `key`, None if none is kept."""
        return self._serials.get(key)

    def why_ended(self, serial: int) -> str | None:
        """Why the pool with serial number `serial` was stopped; None if it was not (or never existed)."""
        return self._ended.get(serial)

    def kept_pool(self, world_size: int, backend: str = "gloo", whose: str | None = None) -> Pool | None:
        """The pool kept for `world_size` ranks on `backend` ("gloo" or "nccl") for `whose` (None: the student's
        own), None if none is; starts nothing."""
        return self._pools.get((world_size, backend, whose))

    def gpu_count(self) -> int:
        """The usable GPUs, counted once (backend.usable_gpu_count) on first asking."""
        if self._gpu_count is None:
            self._gpu_count = usable_gpu_count()
        return self._gpu_count

    @property
    def store_directory(self) -> str | None:
        """The directory (mode 0700) of the pools' store files; None before the first pool and after shutdown."""
        return self._store_dir

    @property
    def fork_server(self) -> ForkServer | None:
        """The fork server the ranks are started from; None before the first start and after shutdown."""
        return self._server

    def prestart(self) -> None:
        """Start the fork server now, if none runs and no call is under way (a call starts its own)."""
        with self._turn.held_if_free("labkit.prestart()") as free:
            if free and self._server is None:
                self._server = ForkServer()

    def stop(self, world_size: int) -> None:
        """Stop the pools of `world_size` ranks (any backend) of whoever asks (`pools_apart`), now; other pools
        and the fork server stay. The caller holds the turn."""
        whose = _whose.get()
        if whose is None and self._attachment is not None and self._attachment.world_size == world_size:
            self.detach()
        for key in [k for k in self._pools if k[0] == world_size and k[2] == whose]:
            self._retire(key, f"labkit.shutdown(world_size={world_size}) stopped it")

    def stop_apart(self, whose: str) -> None:
        """Stop every pool kept apart for `whose` (`pools_apart`); the caller holds the turn."""
        for key in [k for k in self._pools if k[2] == whose]:
            self._retire(key, f"the pools apart for {whose} were discarded")

    def shutdown(self) -> None:
        """Stop every pool and the fork server, end the attached ranks, and remove the store directory. The caller
        holds the turn."""
        self.detach()
        for key in list(self._pools):
            self._retire(key, "labkit.shutdown() stopped it")
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._store_dir is not None:
            shutil.rmtree(self._store_dir, ignore_errors=True)
            self._store_dir = None

    def shutdown_at_exit(self) -> None:
        """`shutdown` as the process exits: after the call under way in another thread, if any, ends within
        EXIT_WAIT_SECONDS; else without waiting longer (the process is going, and its ranks must not stay)."""
        try:
            with self._turn.held("labkit's shutdown at exit", EXIT_WAIT_SECONDS):
                self.shutdown()
        except (TimeoutError, RuntimeError):
            self._abandon()

    def _abandon(self) -> None:
        """At exit while another thread's call still runs: close the fork server, which kills every rank as it
        ends, and remove the store directory, without a word on the pools' sockets: that call's thread reads
        them too, and an orderly close waiting for the ranks' exit reports once blocked the exit forever on a
        message the other thread had taken (two readers of one socket)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._attachment is not None:  # its ranks exit when their connections close with this process
            self._attachment.listener.close()
        self._pools.clear()
        if self._store_dir is not None:
            shutil.rmtree(self._store_dir, ignore_errors=True)
            self._store_dir = None


def live_ranks_limit() -> int:
    """How many of the student's own ranks stay warm: MAX_LIVE_RANKS, or the class's LABKIT_MAX_WORLD_SIZE where
    that is smaller (labkit.classroom.caps): a class cap of 4 ranks per call that let a student keep 2 + 3 + 4
    ranks running would share the server's memory no better than no cap."""
    cap = max_world_size()
    return MAX_LIVE_RANKS if cap is None else min(MAX_LIVE_RANKS, cap)


def _class_cap_note(limit: int, apart: bool) -> str:
    """ " (LABKIT_MAX_WORLD_SIZE=4, set by your instructor)" when the class cap set the student's budget."""
    if apart or limit == MAX_LIVE_RANKS:
        return ""
    return f" ({MAX_WORLD_SIZE_VARIABLE}={limit}, set by your instructor for this class)"


def student_world_size(world_size) -> int:
    """`world_size` checked (labkit.checks.rank_count) and, for the student's own calls, within the class cap
    (labkit.classroom.caps.capped_world_size). Graders' calls (`pools_apart`) are not capped: the course fixes
    their sizes (at most 4 ranks, the README's exercise table), and a cap below them would leave an exercise
    ungradable; they keep a budget of their own (MAX_APART_RANKS) and the server's memory bound still holds."""
    world_size = rank_count(world_size)
    return world_size if _whose.get() is not None else capped_world_size(world_size)


@contextmanager
def pools_apart(whose: str, keep: bool = True) -> Iterator[None]:
    """Inside the block, this thread's labkit.run and labkit.shutdown(world_size=...) use pools of `whose` own,
    never the student's (nor their %%ranks variables); with keep=False those pools are stopped as it ends."""
    token = _whose.set(whose)
    try:
        yield
    finally:
        _whose.reset(token)
        if not keep:
            with OWNER.turn.held(f"the end of {whose}'s pools", SHUTDOWN_WAIT_SECONDS):
                OWNER.stop_apart(whose)


def _devices(world_size: int, backend: str) -> str:
    """Which device each rank computes on: labkit.device() there (labkit.groups)."""
    if backend != "nccl":
        return "every rank computes on cpu"
    if world_size <= 4:
        return ", ".join(f"rank {r} on cuda:{r}" for r in range(world_size))
    return f"rank i on cuda:i (i = 0..{world_size - 1})"


OWNER = Owner()
atexit.register(OWNER.shutdown_at_exit)


def run(fn, *args, world_size: int = 2, backend: str = "auto", timeout: float = 60.0, **kwargs) -> list:
    """Call `fn(*args, **kwargs)` on `world_size` ranks and return their results in rank order.

    Every rank runs in its own process with torch.distributed's default process group
    initialised: gloo on the CPU, or NCCL with one GPU per rank when backend="auto" finds enough
    GPUs (or backend="nccl" asks for them). Functions defined in a notebook or a script's
    ``__main__`` work: they travel with cloudpickle. Each rank's prints appear prefixed with
    ``[rank N]``. If a rank raises, dies or hangs past `timeout` seconds, a `RankError` names the
    ranks and shows the root cause in your own lines. Calls from several threads take turns, first
    come first served: one waits (at most `timeout` seconds) while another's ranks run.

    Example::

        >>> import torch, torch.distributed as dist, labkit
        >>> def total(x):
        ...     t = torch.tensor([float(labkit.rank() + x)])
        ...     dist.all_reduce(t)
        ...     return t.item()
        >>> labkit.run(total, 10, world_size=4)
        [46.0, 46.0, 46.0, 46.0]
    """
    world_size = student_world_size(world_size)
    timeout = timeout_seconds("timeout", timeout)
    if not callable(fn):
        raise TypeError(f"labkit.run needs a function to call, got {type(fn).__name__} {fn!r:.60}.")
    if _inside_rank():
        raise RuntimeError("labkit.run cannot be called from inside a rank: call it from the notebook or script.")
    __tracebackhide__ = True  # IPython shows the student's lines, not labkit's
    with OWNER.turn.held(f"labkit.run(world_size={world_size})", timeout):
        return OWNER.call(fn, args, kwargs, world_size, backend, timeout)


def shutdown(world_size: int | None = None) -> None:
    """Stop every rank this process started, and the fork server. The next run starts afresh.

    With `world_size`, stop only the pools of that many ranks (say, ranks left out of step by a wrong
    answer), now, and wait for their processes to end; other world sizes' pools and the fork server stay, and
    so do the graders' own pools (inside `pools_apart(whose)`, only that caller's pools of that size stop).
    A call under way in another thread is waited for, at most SHUTDOWN_WAIT_SECONDS."""
    what = "labkit.shutdown()" if world_size is None else f"labkit.shutdown(world_size={world_size})"
    world_size = None if world_size is None else rank_count(world_size)
    with OWNER.turn.held(what, SHUTDOWN_WAIT_SECONDS):
        if world_size is None:
            OWNER.shutdown()
        else:
            OWNER.stop(world_size)


def prestart() -> None:
    """Start the fork server now (it imports torch in the background), so the first run is quicker."""
    OWNER.prestart()


def _pickle_call(fn, args: tuple, kwargs: dict) -> bytes:
    try:
        return serialize.dumps((fn, args, kwargs))
    except Exception as exc:
        culprit = _unpicklable_part(fn, args, kwargs)
        raise TypeError(f"labkit.run cannot send {culprit} to the ranks: it cannot be pickled "
                        f"({type(exc).__name__}: {exc}). Pass plain data (tensors, numbers, lists, dicts), "
                        "or create the object inside the function.") from exc


def _unpicklable_part(fn, args: tuple, kwargs: dict) -> str:
    parts = [("the function", fn)] + [(f"argument {i}", a) for i, a in enumerate(args)]
    parts += [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]
    for name, value in parts:
        try:
            serialize.dumps(value)
        except Exception:  # noqa: BLE001 - any failure to pickle names the culprit
            return f"{name} ({type(value).__name__})"
    return "the call"


def _inside_rank() -> bool:
    return os.environ.get("LABKIT_RANK_PROCESS") == "1"
