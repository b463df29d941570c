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
import numbers
import os
import secrets
import shutil
import tempfile
from collections import OrderedDict

from labkit.launch import serialize
from labkit.launch.backend import BackendChoice, choose_backend, usable_gpu_count
from labkit.launch.errors import Interrupted, rank_list
from labkit.launch.forkserver import ForkServer, describe_exit
from labkit.launch.pool import Pool

MAX_WORLD_SIZE = 16  # ranks per call; beyond a laptop's worth, use torchrun (README: instructors)
MAX_LIVE_RANKS = 16  # ranks kept warm across all pools before the least recently used is stopped
PG_TIMEOUT_SECONDS = float(os.environ.get("LABKIT_PG_TIMEOUT", 30))
START_TIMEOUT_SECONDS = float(os.environ.get("LABKIT_START_TIMEOUT", 120))
MAX_TIMEOUT_SECONDS = 7 * 24 * 3600  # a week: longer waits overflow gloo's and NCCL's millisecond timeouts


class _Owner:
    """What this process holds for its ranks: the fork server, the warm pools, the store directory.

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
            self._retire(key, _why_unhealthy(pool))
        self._make_room(world_size)
        self._announce(world_size, choice)
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

    def _retire(self, key: tuple[int, str], reason: str) -> None:
        """Stop the pool kept for `key` and remember why."""
        self.pools.pop(key).close()
        self.ended[self.serials.pop(key)] = reason

    def _make_room(self, world_size: int) -> None:
        for key in [k for k, p in self.pools.items() if p.closed]:
            self._retire(key, _why_unhealthy(self.pools[key]))
        while self.pools and sum(p.world_size for p in self.pools.values()) + world_size > MAX_LIVE_RANKS:
            self._retire(next(iter(self.pools)), f"it was stopped to make room for {world_size} ranks: labkit "
                                                 f"keeps at most {MAX_LIVE_RANKS} ranks running")

    def _announce(self, world_size: int, choice: BackendChoice) -> None:
        if choice.reason not in self.announced:
            self.announced.add(choice.reason)
            print(f"labkit: {world_size} ranks, {choice.reason}; {_devices(world_size, choice.backend)}.")

    def serial(self, key: tuple[int, str]) -> int | None:
        """The serial number of the pool kept for `key`, None if none is kept."""
        return self.serials.get(key)

    def shutdown(self) -> None:
        for key in list(self.pools):
            self._retire(key, "labkit.shutdown() stopped it")
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
    exits = pool._server.exit_status
    dead = [r for r in pool.ranks if r.gone or r.pid in exits]
    if not dead:
        return "labkit's fork server ended, and its ranks with it"
    return f"{rank_list(r.rank for r in dead)} died while idle ({describe_exit(exits.get(dead[0].pid))})"


def _devices(world_size: int, backend: str) -> str:
    """Which device each rank computes on: labkit.device() there (context.py)."""
    if backend != "nccl":
        return "every rank computes on cpu"
    if world_size <= 4:
        return ", ".join(f"rank {r} on cuda:{r}" for r in range(world_size))
    return f"rank i on cuda:i (i = 0..{world_size - 1})"


_owner = _Owner()
atexit.register(_owner.shutdown)


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
    world_size = _check_world_size(world_size)
    timeout = _check_timeout(timeout)
    if not callable(fn):
        raise TypeError(f"labkit.run needs a function to call, got {type(fn).__name__} {fn!r:.60}.")
    if _inside_rank():
        raise RuntimeError("labkit.run cannot be called from inside a rank: call it from the notebook or script.")
    payload = _pickle_call(fn, args, kwargs)
    __tracebackhide__ = True  # IPython shows the student's lines, not labkit's
    try:
        return _owner.pool(world_size, backend).call(payload, timeout)
    except KeyboardInterrupt:
        pass  # the pool has said what became of the ranks
    raise Interrupted from None  # without the selector and pool frames it interrupted


def shutdown() -> None:
    """Stop every rank this process started, and the fork server. The next run starts afresh."""
    _owner.shutdown()


def prestart() -> None:
    """Start the fork server now (it imports torch in the background), so the first run is quicker."""
    if _owner.server is None:
        _owner.server = ForkServer()


def _check_world_size(world_size) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral):
        raise TypeError(f"world_size must be a whole number of ranks, got {world_size!r} "
                        f"({type(world_size).__name__}).")
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be between 1 and {MAX_WORLD_SIZE}, got {world_size}. "
                         "For more ranks, run a script under torchrun (see the README's instructor guide).")
    return int(world_size)


def _check_timeout(timeout) -> float:
    """Seconds, more than 0 and at most a week. Compared before any float() so that 10**400 is
    refused, not an OverflowError; NaN fails both comparisons."""
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout must be a number of seconds, got {timeout!r:.40} ({type(timeout).__name__}).")
    if not 0 < timeout <= MAX_TIMEOUT_SECONDS:
        raise ValueError(f"timeout must be a positive number of seconds, at most a week ({MAX_TIMEOUT_SECONDS} s), "
                         f"got {timeout!r:.40}.")
    return float(timeout)


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
