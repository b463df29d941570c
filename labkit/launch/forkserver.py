"""A clean template process that imports torch once and forks ranks from it.

`import torch` costs seconds; a fork costs milliseconds. Forking the notebook's kernel is unsafe
(CUDA may be initialised, the kernel has threads, OpenMP pools abort after fork), so the owner
starts this small process with subprocess instead: it imports torch, never touches CUDA or starts a
thread pool, and forks one child per rank on request. This is Python's own forkserver pattern
(the default start method on Linux from Python 3.14). Where fork is not safe (macOS, or
LABKIT_START_METHOD=spawn) it starts each rank as a fresh interpreter instead; the protocol is the
same: `ForkRank` and `SignalRanks` in, `Forked` and `Exited` out (protocol.py).

The server reaps its children and reports their exit status to the owner. It dies with its owner
(end of file on its socket, or on Linux a parent-death SIGTERM that it handles), killing every child
it forked.

Everything a rank starts dies with the rank. Each rank leads its own session, so its process group
holds the rank and every process it starts (subprocess, multiprocessing, a shell's background job).
When the server reaps a rank, and when it ends, it kills that whole group. On Linux the server is
also a child subreaper (prctl PR_SET_CHILD_SUBREAPER, see prctl(2)): a rank's orphaned descendants
are re-parented to it rather than to init, and it reaps them, so none is left a zombie in a
container without an init. A process that deliberately leaves its rank's group (setsid, setpgid,
`start_new_session=True`) is not killed: it is on its own, like a daemon. A fork server killed with
SIGKILL cannot clean up: its ranks die by their parent-death signal, their children do not.

The server's own stderr goes to an unlinked temporary file (mode 0600, tempfile.TemporaryFile), not to the
notebook's: if the server dies (say, importing torch under a memory limit), `ForkServer.ended` says how, with
the file's last lines, once, in the error the call raises, instead of a bare "has ended" here and the cause on a
terminal the student may not see.
"""

from __future__ import annotations

import itertools
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import recvfds, sendfds

from labkit.launch import netns, protocol
from labkit.launch.protocol import Exited, Forked, ForkRank, RankSpec, SignalRanks

__all__ = ["STDERR_TAIL_LINES", "ForkServer", "describe_exit", "describe_returncode", "serve",
           "set_parent_death_signal", "start_method"]

_PR_SET_PDEATHSIG = 1  # prctl(2) options, from <linux/prctl.h>
_PR_SET_CHILD_SUBREAPER = 36
STDERR_TAIL_LINES = 12  # of the server's stderr, shown when it has died
_STDERR_TAIL_NBYTES = 8192
_EXIT_WAIT_SECONDS = 2.0  # for a server whose socket closed to be reaped, so that its exit status is known


def _prctl(option: int, value: int) -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(option, value)


def set_parent_death_signal(sig: int) -> None:
    """Linux: have the kernel send `sig` to this process when the thread that started it ends."""
    _prctl(_PR_SET_PDEATHSIG, sig)


def start_method() -> str:
    default = "fork" if sys.platform.startswith("linux") else "spawn"
    method = os.environ.get("LABKIT_START_METHOD", default)
    if method not in ("fork", "spawn"):
        raise ValueError(f"LABKIT_START_METHOD={method!r}: use 'fork' or 'spawn'.")
    return method


class ForkServer:
    """The owner's handle on the template process: fork ranks, signal them, learn how they ended."""

    def __init__(self):
        import threading

        ours, theirs = socket.socketpair()
        labkit_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [labkit_root, env.get("PYTHONPATH")]))
        # The parent-death signal follows the thread that started us: only trust the main thread.
        die_with_parent = threading.current_thread() is threading.main_thread()
        self._stderr = tempfile.TemporaryFile(prefix="labkit-forkserver-")  # unlinked, 0600
        self.process = subprocess.Popen(
            [sys.executable, "-c", "import sys; from labkit.launch.forkserver import serve; "
             "serve(int(sys.argv[1]), sys.argv[2] == '1', sys.argv[3])",
             str(theirs.fileno()), str(int(die_with_parent)), start_method()],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._stderr,
            start_new_session=True, env=env,
        )
        theirs.close()
        self._socket = ours
        self.connection = Connection(os.dup(ours.fileno()))
        self.exit_status: dict[int, int | None] = {}
        self.alive = True  # until its socket closes: then its ranks have died with it
        self._requests = itertools.count()

    def fork(self, spec: RankSpec, fds: list[int], timeout_seconds: float) -> int:
        """Start one rank with `spec`, handing it `fds` (job, control, stdout, stderr); its pid."""
        request_id = next(self._requests)
        try:
            protocol.send(self.connection, ForkRank(request_id, spec))
            sendfds(self._socket, fds)
        except OSError:
            self._lost()
        deadline = time.monotonic() + timeout_seconds
        while self.alive:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.connection.poll(remaining):
                raise RuntimeError(f"labkit's fork server did not start a rank within {timeout_seconds:.0f} s.")
            message = self._receive()
            if isinstance(message, Forked) and message.request_id == request_id:
                self.exit_status.pop(message.pid, None)  # a pid the system has handed out again
                if message.network_refused:
                    netns.warn_once(message.network_refused)
                return message.pid
        raise RuntimeError(self.ended(" before it started a rank" if request_id == 0 else "",
                                      "The next call starts a new one."))

    def signal(self, pids, sig: int) -> None:
        """Send `sig` to each rank's process group, if that rank has not been reaped yet."""
        try:
            protocol.send(self.connection, SignalRanks(list(pids), int(sig)))
        except OSError:
            self._lost()

    def read_reports(self) -> None:
        """Take in every exit report that has arrived, without blocking."""
        while self.alive and self.connection.poll(0):
            self._receive()

    def wait_for_exit(self, pids, timeout_seconds: float) -> bool:
        """Wait until every pid in `pids` has been reaped; False if some still run at the deadline."""
        deadline = time.monotonic() + timeout_seconds
        while not all(pid in self.exit_status for pid in pids):
            remaining = deadline - time.monotonic()
            if not self.alive or remaining <= 0 or not self.connection.poll(remaining):
                return not self.alive  # a dead server's ranks died with it
            self._receive()
        return True

    def _receive(self) -> Forked | Exited | None:
        """The server's next message, noting an exit report; None once the server is lost."""
        try:
            message = protocol.receive(self.connection)
        except (EOFError, OSError):
            self._lost()
            return None
        except BaseException:
            # Ctrl-C halfway through a message: what follows on the socket can no longer be framed,
            # so give this server up; the next pool starts a new one, and closing this one ends its ranks.
            self._lost()
            raise
        if isinstance(message, Exited):
            self.exit_status[message.pid] = message.status
        return message

    def _lost(self) -> None:
        """The server is gone (killed, or crashed): so are its ranks, by the parent-death signal."""
        self.alive = False

    def ended(self, when: str = "", then: str = "") -> str:
        """How the server ended, for a student: its exit status, `when`, a hint where a memory limit (RLIMIT_AS) is
        set, `then` (a sentence), and its last lines of stderr, each prefixed "labkit's fork server:"."""
        status, tail = self.exit_text(), self.stderr_tail()
        lines = "".join(f"\nlabkit's fork server: {line}" for line in tail)
        last = f" Its last lines of stderr:{lines}" if tail else ""
        return f"labkit's fork server {status}{when}{_memory_limit_hint()}.{' ' * bool(then)}{then}{last}"

    def exit_text(self) -> str:
        """'was killed by SIGKILL', 'exited with code 1': how the server process ended, once it has."""
        try:
            returncode = self.process.wait(timeout=_EXIT_WAIT_SECONDS)
        except subprocess.TimeoutExpired:
            return "closed its socket but is still running"
        how = describe_returncode(returncode)
        return f"was {how}" if how.startswith("killed") else how

    def stderr_tail(self) -> list[str]:
        """The last STDERR_TAIL_LINES lines the server wrote to its stderr."""
        try:
            nbytes = os.fstat(self._stderr.fileno()).st_size
            data = os.pread(self._stderr.fileno(), _STDERR_TAIL_NBYTES, max(0, nbytes - _STDERR_TAIL_NBYTES))
        except (OSError, ValueError):  # closed
            return []
        return [line for line in data.decode(errors="replace").splitlines() if line.strip()][-STDERR_TAIL_LINES:]

    def fileno(self) -> int:
        return self.connection.fileno()

    def close(self) -> None:
        """End the server; it kills any rank still running. Waits at most 5 s. Idempotent."""
        self.alive = False
        self.connection.close()
        self._socket.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._stderr.close()


def describe_exit(status: int | None) -> str:
    """'killed by SIGKILL', 'exited with code 3' from a waitpid status."""
    if status is None:
        return "ended (exit status unknown)"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"killed by {name}"
    return f"exited with code {os.WEXITSTATUS(status)}"


def describe_returncode(returncode: int) -> str:
    """'killed by SIGKILL', 'exited with code 1' from a Popen returncode (negative: the signal that ended it)."""
    if returncode < 0:
        return describe_exit(-returncode)  # a waitpid status whose low bits are the signal
    return describe_exit(returncode << 8)


def _memory_limit_hint() -> str:
    """A note on this process's address-space limit (RLIMIT_AS, `ulimit -v`), which the server inherits, if one is
    set: importing torch maps far more than it uses, and OpenBLAS or the loader then fail to allocate."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError):
        return ""
    if soft == resource.RLIM_INFINITY:
        return ""
    return (f" (this process has a memory limit of {soft / 2**20:.0f} MiB of address space, RLIMIT_AS, which the "
            "fork server inherits: importing torch needs more, so raise it, e.g. `ulimit -v unlimited` in the shell "
            "that starts Jupyter, or resource.setrlimit(resource.RLIMIT_AS, ...) before the first call)")


# ---- the server process -------------------------------------------------------------------------

def serve(fd: int, die_with_parent: bool, method: str) -> None:
    """The server's main loop: fork (or spawn) ranks on request, report how they end; at its end,
    whatever the cause, kill every rank's process group."""
    signal.signal(signal.SIGTERM, _exit_cleanly)  # before the parent-death signal can arrive
    if die_with_parent:
        set_parent_death_signal(signal.SIGTERM)  # not SIGKILL: the ranks' children must be killed first
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    connection = Connection(os.dup(fd))
    if method == "fork":  # the point of this process: import once, fork many
        import torch.distributed  # noqa: F401

        import labkit.launch.serialize  # noqa: F401
        import labkit.launch.worker  # noqa: F401
    children: dict[int, object] = {}
    networks = netns.PoolNetworks()
    optimizers_imported = method != "fork"
    try:
        while True:
            if connection.poll(0.02):
                try:
                    request = protocol.receive(connection)
                except (EOFError, OSError):
                    return  # the owner is gone
                _answer(request, children, method, (sock, connection, networks))
            elif not optimizers_imported:
                optimizers_imported = _import_what_optimizers_import(children, connection)
            else:
                networks.make_spare()  # idle: the next pool's namespace, so that its start does not wait
            _reap(children, connection)
            networks.release_ended(children)
    finally:
        for pid in children:
            _signal_group(pid, signal.SIGKILL)
        _reap_all(children, seconds=1.0)


def _import_what_optimizers_import(children: dict, connection: Connection) -> bool:
    """Import torch._dynamo, which every torch optimizer's constructor imports: 1.4-2.7 s of CPU in each rank that
    builds one, paid here once for the ranks forked after it. Done at the first idle moment, after the first ranks
    are forked, so that a pool's cold start does not wait for it. A rank that ends meanwhile is reaped and reported
    at once, from a SIGCHLD handler that lives only as long as the import: the owner waits for that report to say
    how a rank died, and the import took 7.8 s on a loaded 2-core machine (load 20)."""
    reaping = False

    def reap_now(signum, frame) -> None:
        nonlocal reaping
        if not reaping:  # a second SIGCHLD inside the handler: the loop's next _reap finds that child
            reaping = True
            try:
                _reap(children, connection)
            finally:
                reaping = False

    previous = signal.signal(signal.SIGCHLD, reap_now)
    try:
        import torch._dynamo  # noqa: F401
    finally:
        signal.signal(signal.SIGCHLD, previous)
    return True


def _answer(request: ForkRank | SignalRanks, children: dict, method: str,
            server_handles: tuple[socket.socket, Connection, netns.PoolNetworks]) -> None:
    """Start the rank a ForkRank asks for (its fds follow on the socket), in its pool's network namespace where it
    asks for one, or signal the ranks SignalRanks names. A forked rank closes its copies of `server_handles`."""
    sock, connection, networks = server_handles
    if isinstance(request, ForkRank):
        fds = recvfds(sock, 4)
        spec = request.spec
        namespace = networks.for_pool(spec.store_path) if spec.network == netns.PRIVATE else None
        pid, handle = _start_rank(spec, fds, method, server_handles, namespace)
        children[pid] = handle
        if namespace is not None:
            networks.joined(spec.store_path, pid)
        refused = networks.refusal if spec.network == netns.PRIVATE and namespace is None else None
        protocol.send(connection, Forked(request.request_id, pid, refused))
    elif isinstance(request, SignalRanks):
        for pid in request.pids:
            if pid in children:
                _signal_group(pid, request.signal_number)


def _exit_cleanly(signum, frame) -> None:
    """SIGTERM (the owner's death, or anyone's): leave through `serve`'s cleanup."""
    raise SystemExit(0)


def _start_rank(spec: RankSpec, fds: list[int], method: str, server_handles,
                namespace: netns.Namespace | None) -> tuple[int, object]:
    job, control, stdout, stderr = fds
    if method == "spawn":
        with _spec_file(spec) as spec_file:  # not in argv: /proc/<pid>/cmdline is every user's to read
            process = subprocess.Popen(
                [sys.executable, "-c", "import sys; from labkit.launch.worker import spawned_main; spawned_main()",
                 str(spec_file.fileno()), str(job), str(control)],
                pass_fds=(spec_file.fileno(), job, control), stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                start_new_session=True, preexec_fn=None if namespace is None else lambda: netns.enter(namespace),
            )
        pid, handle = process.pid, process
    else:
        server_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            _become_rank(spec, fds, server_pid, server_handles, namespace)
        handle = None
    for fd in fds:
        os.close(fd)
    return pid, handle


def _spec_file(spec: RankSpec):
    """`spec` pickled in an unlinked temporary file (mode 0600, no name left to open), read from its start."""
    spec_file = tempfile.TemporaryFile()
    spec_file.write(pickle.dumps(spec))
    spec_file.flush()
    spec_file.seek(0)
    return spec_file


def _become_rank(spec: RankSpec, fds: list[int], server_pid: int, server_handles,
                 namespace: netns.Namespace | None) -> None:
    job, control, stdout, stderr = fds
    try:
        if namespace is not None:
            netns.enter(namespace)  # first: while this process is sure to be single-threaded
        os.setsid()
        set_parent_death_signal(signal.SIGKILL)
        if os.getppid() != server_pid:
            os._exit(1)
        for handle in server_handles:
            handle.close()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        for fd in (devnull, stdout, stderr):
            os.close(fd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server's handler is not the rank's
        import random

        random.seed()  # as a freshly spawned interpreter would be
        from labkit.launch.worker import main

        main(spec, job, control)
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
    finally:
        os._exit(1)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # each rank leads its own session, so its group is its pid
    except (ProcessLookupError, PermissionError):
        pass


def _reap(children: dict, connection: Connection | None) -> bool:
    """Reap every child that has ended, reporting the ranks among them; False once no child is left."""
    while True:
        ended = _reap_one(children)
        if ended is None:
            return bool(children) or _has_orphans()
        pid, status = ended
        if pid in children:
            del children[pid]
            if connection is not None:
                protocol.send(connection, Exited(pid, status))


def _reap_one(children: dict) -> tuple[int, int | None] | None:
    """Reap one ended child, (pid, waitpid status), or None if none has ended. A rank's group is killed
    just before, while the rank's zombie still holds its pid, so that the group id cannot have been
    handed out again. An orphan re-parented to this subreaper is only reaped. Without os.waitid
    (macOS) only the ranks are looked at."""
    if not hasattr(os, "waitid"):
        for pid in children:
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, None
            if done:
                _signal_group(pid, signal.SIGKILL)
                return pid, status
        return None
    try:
        ended = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None  # no child at all
    if ended is None:
        return None
    if ended.si_pid in children:
        _signal_group(ended.si_pid, signal.SIGKILL)
    try:
        return os.waitpid(ended.si_pid, 0)
    except ChildProcessError:
        return ended.si_pid, None


def _has_orphans() -> bool:
    """True while this process has a child left; asked once no rank is left, so an adopted orphan."""
    if not hasattr(os, "waitid"):
        return False
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def _reap_all(children: dict, seconds: float) -> None:
    """At the server's end: reap its killed ranks and their orphans, waiting up to `seconds`."""
    deadline = time.monotonic() + seconds
    while _reap(children, None) and time.monotonic() < deadline:
        time.sleep(0.01)
