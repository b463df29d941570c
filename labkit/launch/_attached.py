"""Attached ranks on the owner's side: the `Attachment` a `labkit.attach` call makes, and the pool its ranks form.

Why a room of its own: a local pool starts and kills its ranks; an attached pool does neither (torchrun does), so
what differs is only how its ranks arrive (a `Listener`, _listener.py), how they are told to go (`Leave`), and how
their failures are named (host and rank). Everything else, a call, its verdict, the hang report, the interrupt that
keeps ranks in step, is `_lifecycle.Lifecycle`'s, run unchanged on signed TCP connections instead of socketpairs.

One attachment serves one world size. When its pool is given up (a rank died, a call left the ranks out of step),
its ranks are told to exit 1, and torchrun restarts them if `--max-restarts` allows; they attach again, and the
next call takes them, saying that they were restarted and their variables lost (as a local pool does).
"""

from __future__ import annotations

import platform
import secrets
import time

from labkit.launch import protocol
from labkit.launch._lifecycle import Lifecycle
from labkit.launch._listener import Arrival, Listener, wait_for_ranks
from labkit.launch.backend import BackendChoice, choose_backend
from labkit.launch.errors import RankError, rank_list
from labkit.launch.protocol import Leave, Refused, Welcome
from labkit.tables import LINE_CHARS, print_line, progress_bar, text_table, wrapped
from labkit.version import VERSION

__all__ = []

RDZV_PORT = 29400  # torchrun's customary c10d rendezvous port (PyTorch's torchrun docs use it)


def torchrun_command(world_size: int, nodes: int, connect: str, rdzv_id: str, rdzv_host: str = "NODE0") -> str:
    """The command each node runs so that `world_size` ranks on `nodes` nodes attach to the notebook at `connect`:
    torchrun's c10d rendezvous at the first node (`rdzv_host`), up to 3 restarts, labkit.agent as the program."""
    return (f"torchrun --nnodes {nodes} --nproc-per-node {world_size // nodes} --max-restarts 3 --rdzv-backend c10d "
            f"--rdzv-endpoint {rdzv_host}:{RDZV_PORT} --rdzv-id {rdzv_id} -m labkit.agent --connect {connect}")


def slurm_command(world_size: int, nodes: int, connect: str, rdzv_id: str) -> str:
    """`torchrun_command` inside a Slurm allocation: srun starts one torchrun per node, the rendezvous at the
    allocation's first node (`scontrol show hostnames`)."""
    first_node = '$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'
    return (f"srun --nodes {nodes} --ntasks-per-node 1 bash -c "
            f"'{torchrun_command(world_size, nodes, connect, rdzv_id, first_node)}'")


def shell_lines(command: str, indent: str = "  ") -> str:
    """`command` broken at spaces into lines of at most LINE_CHARS characters, each but the last ending in a
    backslash (the shell joins them, also inside the single quotes of `bash -c '...'`, whose shell reads them again),
    so that a notebook shows it whole, not broken mid-word (labkit.tables.wrapped says why)."""
    lines, line = [], indent
    for word in command.split(" "):
        if line.strip() and len(line) + 1 + len(word) + 2 > LINE_CHARS:
            lines.append(line + " \\")
            line = indent + "    "
        line += ("" if not line.strip() else " ") + word
    return "\n".join([*lines, line])


class AttachedPool(Lifecycle):
    """`world_size` ranks that torchrun started and that attached through `Listener`; ready after `_start`."""

    def __init__(self, arrivals: list[Arrival], choice: BackendChoice, pg_timeout_seconds: float,
                 start_timeout_seconds: float):
        super().__init__(len(arrivals), choice, None, "", pg_timeout_seconds, start_timeout_seconds)
        self.arrivals = arrivals
        for a in arrivals:
            self._channels.add_attached(a.hello.rank, a.hello.pid, a.job, a.control, a.output, a.hello.host)

    def _start(self, budget_seconds: float) -> None:
        """Tell every rank to join its group (`Welcome`), and wait until all say `Ready`."""
        deadline = time.monotonic() + budget_seconds
        try:
            welcome = Welcome(self._choice.backend, self._pg_timeout_seconds, 0, f"labkit/{secrets.token_hex(8)}")
            self._channels.send_to_all(protocol.encode(welcome))
            self._wait_until_ready(deadline, budget_seconds)
        except BaseException:
            self.close()
            raise
        self._started = True

    def _verdict(self, call, check_health: bool) -> list:
        try:
            return super()._verdict(call, check_health)
        except RankError as exc:
            raise self._with_hosts(exc) from None

    def _with_hosts(self, exc: RankError) -> RankError:
        """`exc` with the failed ranks' nodes in its headline."""
        failed = {f.rank for f in exc.failures}
        by_where: dict[str, list[int]] = {}
        for r in self._channels.ranks:
            if r.rank in failed:
                by_where.setdefault(r.where, []).append(r.rank)
        where = "; ".join(f"{rank_list(ranks)} {w}" for w, ranks in by_where.items())
        return type(exc)(f"{exc.headline} Where: {where}.", exc.failures, exc.notes, pool_stopped=exc.pool_stopped)

    def healthy(self) -> bool:
        """Open, and no rank has lost its connection (read without waiting)."""
        if self._closed:
            return False
        self._channels.read_waiting()
        return not any(r.gone for r in self._channels.ranks)

    def why_unhealthy(self) -> str:
        if self._closed:
            return "it was stopped after a call failed, timed out or was interrupted"
        lost = [r for r in self._channels.ranks if r.gone]
        return f"{rank_list(r.rank for r in lost)} {lost[0].where} lost their connection to the notebook"

    def close(self, exit_code: int = 1) -> None:
        """Tell every rank to exit with `exit_code` (1: torchrun may restart them; 0: done), and let go of them."""
        if self._closed:
            return
        self._closed = True
        frame = protocol.encode(Leave(exit_code))
        for r in self._channels.ranks:
            try:
                r.control.send_bytes(frame)
            except OSError:
                pass
        self._channels.close()

    def release(self) -> None:
        """The notebook is done with these ranks: they exit 0, and torchrun ends."""
        self.close(exit_code=0)


class Attachment:
    """A notebook's listener for `world_size` ranks that torchrun starts on `nodes` machines, and the pool they form.
    Its repr is the table of attached ranks."""

    def __init__(self, world_size: int, nodes: int, host: str, port: int, backend: str):
        self.world_size, self.nodes, self.backend = world_size, nodes, backend
        self.listener = Listener(host, port)
        self.rdzv_id = f"labkit-{secrets.token_hex(4)}"
        self.pool: AttachedPool | None = None
        self.restarts_seen = 0

    # ---- what the instructor runs ------------------------------------------------------------------

    def torchrun_command(self) -> str:
        return torchrun_command(self.world_size, self.nodes, self.listener.address, self.rdzv_id)

    def slurm_command(self) -> str:
        return slurm_command(self.world_size, self.nodes, self.listener.address, self.rdzv_id)

    def instructions(self) -> str:
        nodes = f"{self.nodes} node{'s' if self.nodes > 1 else ''}"
        return "\n".join([
            wrapped(f"labkit: waiting for {self.world_size} ranks at {self.listener.address} (only this address; the "
                    f"session's secret is in {self.listener.secret_file}, mode 0600, which the nodes read from the "
                    "shared home)."),
            f"On each of the {nodes}, NODE0 being the first node's address:",
            shell_lines(self.torchrun_command()),
            f"Or from a Slurm allocation of {nodes} (salloc), one torchrun per node:",
            shell_lines(self.slurm_command()),
        ])

    # ---- ranks arriving ----------------------------------------------------------------------------

    def form_pool(self, timeout_seconds: float, pg_timeout_seconds: float, seen: dict | None = None) -> AttachedPool:
        """Wait (at most `timeout_seconds`) for every rank, check them, and start their pool: ready to call."""
        deadline = time.monotonic() + timeout_seconds
        seen = {} if seen is None else seen
        with progress_bar(total=self.world_size, desc="ranks attached", unit="rank",
                          bar_format="{n} of {total} ranks attached {bar} {elapsed}") as bar:
            def progress(count: int) -> None:
                bar.n = count
                bar.refresh()
            wait_for_ranks(self.listener, self.world_size, deadline, seen, progress)
        arrivals = [seen[r] for r in sorted(seen)]
        self._check(arrivals, timeout_seconds)
        choice = self._choose_backend(arrivals)
        pool = AttachedPool(arrivals, choice, pg_timeout_seconds, timeout_seconds)
        pool._start(max(1.0, deadline - time.monotonic()))
        hosts = sorted({a.hello.host for a in arrivals})
        print_line(f"labkit: {self.world_size} ranks attached from {len(hosts)} node{'s' if len(hosts) > 1 else ''} "
                   f"({', '.join(hosts)}), {choice.reason}.")
        self.pool = pool
        return pool

    def _check(self, arrivals: list[Arrival], timeout_seconds: float) -> None:
        """Refuse ranks of another world size or another version, and say which ranks never came."""
        problems = []
        wrong_size = [a for a in arrivals if a.hello.world_size != self.world_size]
        if wrong_size:
            problems.append(f"{rank_list(a.hello.rank for a in wrong_size)} on {wrong_size[0].hello.host} belong to "
                            f"a world of {wrong_size[0].hello.world_size} ranks, not {self.world_size}: give torchrun "
                            f"--nnodes x --nproc-per-node = {self.world_size}")
        ours = _versions()
        skewed = [a for a in arrivals if _versions(a.hello) != ours]
        if skewed:
            theirs = _versions(skewed[0].hello)
            problems.append(f"{rank_list(a.hello.rank for a in skewed)} on {skewed[0].hello.host} run "
                            f"{_say(theirs)}, this notebook {_say(ours)}: install the same versions on every node "
                            "(a function pickled by value runs only on the same Python and torch)")
        if problems:
            for a in arrivals:
                self._refuse(a, "; ".join(problems))
            raise RuntimeError("labkit.attach refused the ranks: " + "; ".join(problems) + ".")
        missing = [r for r in range(self.world_size) if r not in {a.hello.rank for a in arrivals}]
        if missing:
            here = sorted({a.hello.host for a in arrivals})
            came = f" ({rank_list(a.hello.rank for a in arrivals)} came, from {', '.join(here)})" if arrivals else ""
            raise TimeoutError(f"labkit.attach: {rank_list(missing)} did not attach within {timeout_seconds:g} s"
                               f"{came}. Is torchrun running on every node with the command above, and can the nodes "
                               f"reach {self.listener.address}? (refused connections: {len(self.listener.refused)})")

    def _refuse(self, arrival: Arrival, reason: str) -> None:
        try:
            protocol.send(arrival.job, Refused(reason))
        except OSError:
            pass
        arrival.close()

    def _choose_backend(self, arrivals: list[Arrival]) -> BackendChoice:
        """The local rule (backend.choose_backend) on every node; NCCL only where every node has a GPU per rank."""
        choices = {a.hello.host: choose_backend(self.backend, a.hello.local_world_size, a.hello.gpu_count)
                   for a in arrivals}
        backends = {c.backend for c in choices.values()}
        if backends == {"nccl"}:
            return BackendChoice("nccl", "nccl, one GPU per rank on every node")
        if "nccl" in backends:
            without = sorted(h for h, c in choices.items() if c.backend == "gloo")
            return BackendChoice("gloo", f"gloo on CPU: {', '.join(without)} lack a GPU per rank")
        return next(iter(choices.values()))

    def next_pool(self, timeout_seconds: float, pg_timeout_seconds: float) -> AttachedPool:
        """After the pool was given up: the ranks torchrun restarted, once all have attached again."""
        pool = self.form_pool(timeout_seconds, pg_timeout_seconds)
        restarts = max(a.hello.restart_count for a in pool.arrivals)
        print_line(f"labkit: torchrun restarted the {self.world_size} attached ranks (restart {restarts}); the "
                   "variables of earlier %%ranks cells are gone.")
        return pool

    # ---- what is attached --------------------------------------------------------------------------

    def table(self) -> str:
        """rank, host, local rank, device and pid of each attached rank."""
        if self.pool is None:
            return f"no ranks attached yet at {self.listener.address}"
        backend = self.pool._choice.backend
        rows = [(a.hello.rank, a.hello.host, a.job.peer.rsplit(":", 1)[0], a.hello.local_rank,
                 f"cuda:{a.hello.local_rank}" if backend == "nccl" else "cpu", a.hello.pid)
                for a in self.pool.arrivals]
        return text_table(("rank", "host", "address", "local rank", "device", "pid"), rows, align="><<><>")

    def __repr__(self) -> str:
        return self.table()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.release()
        self.listener.close()


def _versions(hello: protocol.Hello | None = None) -> tuple[str, str, str]:
    """(labkit, torch, Python minor) of `hello`'s rank, or of this process."""
    if hello is not None:
        return hello.labkit_version, hello.torch_version, ".".join(hello.python_version.split(".")[:2])
    import torch

    return VERSION, torch.__version__, ".".join(platform.python_version().split(".")[:2])


def _say(versions: tuple[str, str, str]) -> str:
    return f"labkit {versions[0]} with torch {versions[1]} on Python {versions[2]}"

