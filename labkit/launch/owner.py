"""`labkit.run(fn, world_size=N)`: call a function on N ranks and get their results back.

The owner (a notebook's kernel or a script) keeps, for its whole life, a rendezvous store on
127.0.0.1 and a fork server, and one warm pool of ranks per (world size, backend): the first
call pays for the start, later calls cost milliseconds. The owner itself never joins a process
group, so it stays free to plot, to use CUDA and to be interrupted.
"""

from __future__ import annotations

import atexit
import math
import numbers
import os
import socket
from collections import OrderedDict

from labkit.launch import serialize
from labkit.launch.backend import BackendChoice, choose_backend, usable_gpu_count
from labkit.launch.forkserver import ForkServer
from labkit.launch.pool import Pool

MAX_WORLD_SIZE = 16  # ranks per call; beyond a laptop's worth, use torchrun (README: instructors)
MAX_LIVE_RANKS = 16  # ranks kept warm across all pools before the least recently used is stopped
PG_TIMEOUT_SECONDS = float(os.environ.get("LABKIT_PG_TIMEOUT", 30))
START_TIMEOUT_SECONDS = float(os.environ.get("LABKIT_START_TIMEOUT", 120))


class _Owner:
    """What this process holds for its ranks: the store, the fork server, the warm pools."""

    def __init__(self):
        self.store = None
        self.server: ForkServer | None = None
        self.pools: OrderedDict[tuple[int, str], Pool] = OrderedDict()
        self.announced: set[str] = set()
        self.gpu_count: int | None = None
        self.pools_started = 0

    def pool(self, world_size: int, backend: str) -> Pool:
        if self.gpu_count is None:
            self.gpu_count = usable_gpu_count()
        choice = choose_backend(backend, world_size, self.gpu_count)
        key = (world_size, choice.backend)
        pool = self.pools.get(key)
        if pool is not None and pool.healthy():
            self.pools.move_to_end(key)
            return pool
        if pool is not None:
            pool.close()
            del self.pools[key]
        self._make_room(world_size)
        self._announce(world_size, choice)
        pool = self._start_pool(world_size, choice)
        self.pools[key] = pool
        return pool

    def _start_pool(self, world_size: int, choice: BackendChoice) -> Pool:
        if self.server is None or not self.server.alive or self.server.process.poll() is not None:
            if self.server is not None:
                self.server.close()
            self.server = ForkServer()  # start its `import torch` before ours below
        if self.store is None:
            self.store = _loopback_store()
        self.pools_started += 1
        return Pool(world_size, choice, self.server, self.store.port, f"labkit/{os.getpid()}/{self.pools_started}",
                    PG_TIMEOUT_SECONDS, START_TIMEOUT_SECONDS)

    def _make_room(self, world_size: int) -> None:
        for key in [k for k, p in self.pools.items() if p.closed]:
            del self.pools[key]
        while self.pools and sum(p.world_size for p in self.pools.values()) + world_size > MAX_LIVE_RANKS:
            _, oldest = self.pools.popitem(last=False)
            oldest.close()

    def _announce(self, world_size: int, choice: BackendChoice) -> None:
        if choice.reason not in self.announced:
            self.announced.add(choice.reason)
            print(f"labkit: {world_size} ranks, {choice.reason}.")

    def shutdown(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()
        if self.server is not None:
            self.server.close()
            self.server = None
        self.store = None


def _loopback_store():
    """A TCPStore that listens on 127.0.0.1 only, on a port the OS picks.

    torch's TCPStore("127.0.0.1", 0, is_master=True) listens on every interface (the host is only
    where clients connect), so bind the socket ourselves and hand it over; detach it, or Python
    would close it under the store's feet at exit."""
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         master_listen_fd=listener.detach(), use_libuv=False)


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
    return _owner.pool(world_size, backend).call(payload, timeout)


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
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout must be a number of seconds, got {timeout!r} ({type(timeout).__name__}).")
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"timeout must be a positive, finite number of seconds, got {timeout!r}.")
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
