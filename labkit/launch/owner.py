"""`labkit.run(fn, world_size=N)`: call a function on N ranks and get their results back.

The owner (a notebook's kernel or a script) keeps, for its whole life, a fork server and one warm
pool of ranks per (world size, backend): the first call pays for the start, later calls cost
milliseconds. The owner itself never joins a process group, so it stays free to plot, to use CUDA
and to be interrupted.

Ranks meet through a torch.distributed.FileStore, one file per pool with an unguessable name
(secrets.token_hex) in a directory only this user can enter (tempfile.mkdtemp creates it with mode
0700). A TCP store on 127.0.0.1 would let any local user list its keys, read the ranks' addresses,
or plant keys for the next pool; a file another user cannot open leaves nothing to reach.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import tempfile
from collections import OrderedDict

from labkit.checks import rank_count, timeout_seconds
from labkit.launch import serialize
from labkit.launch.backend import BackendChoice, choose_backend, usable_gpu_count
from labkit.launch.errors import Interrupted, rank_list
from labkit.launch.forkserver import ForkServer, describe_exit
from labkit.launch.pool import Pool
from labkit.tables import print_line

__all__ = ["MAX_LIVE_RANKS", "OWNER", "PG_TIMEOUT_SECONDS", "START_TIMEOUT_SECONDS", "Owner", "prestart", "run",
           "shutdown"]

MAX_LIVE_RANKS = 16  # ranks kept warm across all pools before the least recently used is stopped
PG_TIMEOUT_SECONDS = float(os.environ.get("LABKIT_PG_TIMEOUT", 30))
START_TIMEOUT_SECONDS = float(os.environ.get("LABKIT_START_TIMEOUT", 120))


class Owner:
    """What this process holds for its ranks: the fork server, the warm pools, the store directory.
    There is one, OWNER; `run`, `shutdown` and %%ranks use it.

    Each pool gets a serial number; when a pool goes, `ended[serial]` says why, so that %%ranks can
    tell the student why the variables it held are gone."""

    def __init__(self):
        self.store_dir: str | None = None
        self.server: ForkServer | None = None
        self.pools: OrderedDict[tuple[int, str], Pool] = OrderedDict()
        self.serials: dict[tuple[int, str], int] = {}  # the serial number of the pool now kept for a key
        self.ended: dict[int, str] = {}  # why the pool with this serial number was stopped
        self.announced: set[str] = set()
        self.gpu_count: int | None = None
        self.pools_started = 0

    def pool(self, world_size: int, backend: str) -> Pool:
        """A healthy pool for `world_size` ranks on `backend` ("auto", "gloo" or "nccl"), started if need be."""
        return self.pools[self.pool_key(world_size, backend)]

    def pool_key(self, world_size: int, backend: str) -> tuple[int, str]:
        """The key of a healthy pool for `world_size` ranks on `backend`, started if need be."""
        if self.gpu_count is None:
            self.gpu_count = usable_gpu_count()
        choice = choose_backend(backend, world_size, self.gpu_count)
        key = (world_size, choice.backend)
        pool = self.pools.get(key)
        if pool is not None and pool.healthy():
            self.pools.move_to_end(key)
            return key
        if pool is not None:
            self.retire(key, _why_unhealthy(pool))
        self._make_room(world_size)
        self.announce(world_size, choice)
        self.pools[key] = self._start_pool(world_size, choice)
        self.serials[key] = self.pools_started
        return key

    def _start_pool(self, world_size: int, choice: BackendChoice) -> Pool:
        if self.server is None or not self.server.alive or self.server.process.poll() is not None:
            if self.server is not None:
                self.server.close()
            self.server = ForkServer()  # start its `import torch` before ours below
        if self.store_dir is None:
            self.store_dir = tempfile.mkdtemp(prefix="labkit-")  # mode 0700, a fresh name
        self.pools_started += 1
        store_path = os.path.join(self.store_dir, secrets.token_hex(16))
        return Pool(world_size, choice, self.server, store_path, PG_TIMEOUT_SECONDS, START_TIMEOUT_SECONDS)

    def retire(self, key: tuple[int, str], reason: str) -> None:
        """Stop the pool kept for `key` and remember why."""
        self.pools.pop(key).close()
        self.ended[self.serials.pop(key)] = reason

    def _make_room(self, world_size: int) -> None:
        for key in [k for k, p in self.pools.items() if p.closed]:
            self.retire(key, _why_unhealthy(self.pools[key]))
        while self.pools and sum(p.world_size for p in self.pools.values()) + world_size > MAX_LIVE_RANKS:
            self.retire(next(iter(self.pools)), f"it was stopped to make room for {world_size} ranks: labkit "
                                                 f"keeps at most {MAX_LIVE_RANKS} ranks running")

    def announce(self, world_size: int, choice: BackendChoice) -> None:
        """Say how `world_size` ranks will run: the backend, why, and each rank's device; once per reason."""
        if choice.reason not in self.announced:
            self.announced.add(choice.reason)
            print_line(f"labkit: {world_size} ranks, {choice.reason}; {_devices(world_size, choice.backend)}.")

    def serial(self, key: tuple[int, str]) -> int | None:
        """The serial number of the pool kept for `key`, None if none is kept."""
        return self.serials.get(key)

    def shutdown(self) -> None:
        for key in list(self.pools):
            self.retire(key, "labkit.shutdown() stopped it")
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.store_dir is not None:
            shutil.rmtree(self.store_dir, ignore_errors=True)
            self.store_dir = None


def _why_unhealthy(pool: Pool) -> str:
    """Why a kept pool cannot serve the next call, in words for the student."""
    if pool.closed:
        return "it was stopped after a call failed, timed out or was interrupted"
    exits = pool.server.exit_status
    dead = [r for r in pool.ranks if r.gone or r.pid in exits]
    if not dead:
        return "labkit's fork server ended, and its ranks with it"
    return f"{rank_list(r.rank for r in dead)} died while idle ({describe_exit(exits.get(dead[0].pid))})"


def _devices(world_size: int, backend: str) -> str:
    """Which device each rank computes on: labkit.device() there (labkit.groups)."""
    if backend != "nccl":
        return "every rank computes on cpu"
    if world_size <= 4:
        return ", ".join(f"rank {r} on cuda:{r}" for r in range(world_size))
    return f"rank i on cuda:i (i = 0..{world_size - 1})"


OWNER = Owner()
atexit.register(OWNER.shutdown)


def run(fn, *args, world_size: int = 2, backend: str = "auto", timeout: float = 60.0, **kwargs) -> list:
    """Call `fn(*args, **kwargs)` on `world_size` ranks and return their results in rank order.

    Every rank runs in its own process with torch.distributed's default process group
    initialised: gloo on the CPU, or NCCL with one GPU per rank when backend="auto" finds enough
    GPUs (or backend="nccl" asks for them). Functions defined in a notebook or a script's
    ``__main__`` work: they travel with cloudpickle. Each rank's prints appear prefixed with
    ``[rank N]``. If a rank raises, dies or hangs past `timeout` seconds, a `RankError` names the
    ranks and shows the root cause in your own lines.

    Example::

        >>> import torch, torch.distributed as dist, labkit
        >>> def total(x):
        ...     t = torch.tensor([float(labkit.rank() + x)])
        ...     dist.all_reduce(t)
        ...     return t.item()
        >>> labkit.run(total, 10, world_size=4)
        [46.0, 46.0, 46.0, 46.0]
    """
    world_size = rank_count(world_size)
    timeout = timeout_seconds("timeout", timeout)
    if not callable(fn):
        raise TypeError(f"labkit.run needs a function to call, got {type(fn).__name__} {fn!r:.60}.")
    if _inside_rank():
        raise RuntimeError("labkit.run cannot be called from inside a rank: call it from the notebook or script.")
    payload = _pickle_call(fn, args, kwargs)
    __tracebackhide__ = True  # IPython shows the student's lines, not labkit's
    try:
        return OWNER.pool(world_size, backend).call(payload, timeout)
    except KeyboardInterrupt:
        pass  # the pool has said what became of the ranks
    raise Interrupted from None  # without the selector and pool frames it interrupted


def shutdown() -> None:
    """Stop every rank this process started, and the fork server. The next run starts afresh."""
    OWNER.shutdown()


def prestart() -> None:
    """Start the fork server now (it imports torch in the background), so the first run is quicker."""
    if OWNER.server is None:
        OWNER.server = ForkServer()


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
