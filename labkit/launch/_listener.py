"""`labkit.attach(world_size=16, nodes=2)`: the notebook's ranks on other machines, started there by torchrun.

labkit.run forks its ranks on the notebook's own machine. For ranks across nodes the notebook instead listens, and
prints the command that starts them: torchrun (torch elastic) starts, rendezvouses and restarts the ranks on every
node, and each rank runs `python -m labkit.agent --connect HOST:PORT` (labkit/agent.py), which connects back here.
Once all `world_size` have attached and joined their group, `labkit.run(fn, world_size=16)` and `%%ranks 16` run on
them with the contract of local ranks (owner.py, _attached.py), until `labkit.shutdown()` ends them and torchrun.

Security: the control channel crosses a network, and a rank runs whatever the notebook sends it. So:
- every frame either way is signed with a per-session secret (HMAC-SHA256, checked in constant time before
  anything is unpickled; sequence numbers refuse a replay; labkit.launch._signed says how);
- the secret is 32 random bytes in a file mode 0600 in a folder mode 0700 under the user's home
  (`~/.labkit/attach/HOST_PORT.key`, which cluster nodes usually share), or the environment variable
  LABKIT_ATTACH_SECRET (hex) where they do not: never on a command line, which every local user can read in
  /proc/*/cmdline;
- the listener binds only the address it is given, and a connection that fails the check is closed and logged
  (`Listener.refused`; a warning on the notebook's log).
What stays exposed is torch's own: torchrun's c10d rendezvous store (--rdzv-endpoint) and gloo's and NCCL's
sockets authenticate nobody; keep the nodes on a network only the class's machines reach (the README says so).
"""

from __future__ import annotations

import logging
import os
import pickle
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import NamedTuple

from labkit._private_files import open_private, private_directory
from labkit.checks import MAX_WORLD_SIZE
from labkit.launch import protocol
from labkit.launch._signed import SignedConnection, Unauthenticated, accept_signed

__all__ = []

SECRET_ENV = "LABKIT_ATTACH_SECRET"
# connections authenticated at once: every rank's three, and room; more are closed at once, so that a stranger's
# flood of silent connections holds at most this many threads (each waits HANDSHAKE_SECONDS at most)
MAX_HANDSHAKES = 4 * MAX_WORLD_SIZE
_log = logging.getLogger("labkit.attach")


def secret_path(host: str, port: int) -> Path:
    """Where the secret of the session listening at `host:port` is kept: under the user's home."""
    return Path.home() / ".labkit" / "attach" / f"{host}_{port}.key"


def write_secret(host: str, port: int) -> tuple[bytes, Path]:
    """A fresh secret for the session at `host:port`, written to `secret_path` (0600 in a 0700 folder)."""
    path = secret_path(host, port)
    private_directory(path.parent.parent, "labkit folder", create=True)
    private_directory(path.parent, "labkit attach folder", create=True)
    secret = secrets.token_bytes(32)
    path.unlink(missing_ok=True)
    fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, "attach secret file")
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex() + "\n")
    return secret, path


def read_secret(host: str, port: int) -> bytes:
    """The secret of the session at `host:port`: LABKIT_ATTACH_SECRET, else its file (which must be the user's
    own, mode 0600)."""
    if os.environ.get(SECRET_ENV):
        try:
            return bytes.fromhex(os.environ[SECRET_ENV])
        except ValueError:
            raise ValueError(f"{SECRET_ENV} is not hex: copy it from the notebook's secret file.") from None
    path = secret_path(host, port)
    try:
        fd = open_private(path, os.O_RDONLY, "attach secret file")
    except FileNotFoundError:
        raise FileNotFoundError(f"labkit.agent: no secret at {path}: this node does not share the notebook's home "
                                f"folder, or nobody called labkit.attach() for {host}:{port}. Copy that file here "
                                f"(mode 0600), or set {SECRET_ENV} to its contents.") from None
    with os.fdopen(fd) as f:
        if os.fstat(f.fileno()).st_mode & 0o077:
            raise PermissionError(f"{path} can be read by other users: run `chmod 600 {path}`.")
        return bytes.fromhex(f.read().strip())


def parse_address(text: str) -> tuple[str, int]:
    """'host:port' (or '[v6]:port') as (host, port); ValueError saying what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--connect {text!r}: give HOST:PORT, as labkit.attach() printed it.")
    return host.strip("[]"), int(port)


class Arrival(NamedTuple):
    """One attached rank: what it said (`Hello`) and its three authenticated connections."""

    hello: protocol.Hello
    job: SignedConnection
    control: SignedConnection
    output: SignedConnection

    def close(self) -> None:
        for link in (self.job, self.control, self.output):
            link.close()


class Listener:
    """Accepts ranks' connections at (host, port), authenticates each in a thread of its own (a slow stranger
    holds up nobody), and keeps the ranks whose three connections have all arrived, in order of arrival."""

    def __init__(self, host: str, port: int):
        self._sock = socket.create_server((host, port), backlog=256)  # this address only, never 0.0.0.0 unasked
        self.host, self.port = host, self._sock.getsockname()[1]
        self.secret, self.secret_file = write_secret(host, self.port)
        self.refused: list[tuple[str, str]] = []  # (peer, why) of each connection closed unauthenticated
        self._partial: dict[str, dict[protocol.Role, tuple[protocol.Hello, SignedConnection]]] = {}
        self._arrived: list[Arrival] = []
        self._changed = threading.Condition()
        self._closed = False
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        threading.Thread(target=self._accept, name="labkit-attach", daemon=True).start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self._sock.accept()
            except OSError:
                return  # closed
            if not self._handshakes.acquire(blocking=False):
                sock.close()
                self._refuse(f"{peer[0]}:{peer[1]}", f"{MAX_HANDSHAKES} connections were already being authenticated")
                continue
            threading.Thread(target=self._authenticate, args=(sock, f"{peer[0]}:{peer[1]}"), daemon=True).start()

    def _authenticate(self, sock: socket.socket, peer: str) -> None:
        try:
            self._authenticate_one(sock, peer)
        finally:
            self._handshakes.release()

    def _authenticate_one(self, sock: socket.socket, peer: str) -> None:
        try:
            link, first = accept_signed(sock, self.secret, peer)
            hello = pickle.loads(first)  # signed with the session's secret: one of ours sent it
            if not isinstance(hello, protocol.Hello):
                raise Unauthenticated(f"its first message was a {type(hello).__name__}, not a Hello")
        except (Unauthenticated, OSError, EOFError, pickle.UnpicklingError) as exc:
            sock.close()
            self._refuse(peer, f"{type(exc).__name__}: {exc}")
            return
        with self._changed:
            if self._closed:
                link.close()
                return
            roles = self._partial.setdefault(hello.agent_id, {})
            roles[hello.role] = (hello, link)
            if len(roles) == len(protocol.Role):
                del self._partial[hello.agent_id]
                self._arrived.append(Arrival(roles[protocol.Role.JOB][0],
                                             *(roles[role][1] for role in protocol.Role)))
                self._changed.notify_all()

    def _refuse(self, peer: str, why: str) -> None:
        with self._changed:
            self.refused.append((peer, why))
            self._changed.notify_all()
        _log.warning("labkit.attach: refused a connection from %s (%s); nothing it sent was run", peer, why)

    def take(self) -> list[Arrival]:
        """The ranks that have arrived since the last `take`, in order of arrival."""
        with self._changed:
            arrived, self._arrived = self._arrived, []
            return arrived

    def wait(self, seconds: float) -> None:
        """Until a rank arrives (or a connection is refused), at most `seconds`."""
        with self._changed:
            if not self._arrived:
                self._changed.wait(seconds)

    def close(self) -> None:
        """Stop listening, close what has not been taken, remove the secret file."""
        with self._changed:
            self._closed = True
            for arrival in self._arrived:
                arrival.close()
            for roles in self._partial.values():
                for _, link in roles.values():
                    link.close()
            self._arrived, self._partial = [], {}
        self._sock.close()
        self.secret_file.unlink(missing_ok=True)


def wait_for_ranks(listener: Listener, world_size: int, deadline: float, seen: dict[int, Arrival],
                   on_progress) -> dict[int, Arrival]:
    """Collect arrivals by rank until all `world_size` are in `seen` or the deadline passes; a later arrival for a
    rank replaces an earlier one (a restarted rank), whose connections are closed. `on_progress(len(seen))` after
    each arrival."""
    while len(seen) < world_size and time.monotonic() < deadline:
        listener.wait(min(0.5, max(0.0, deadline - time.monotonic())))
        for arrival in listener.take():
            old = seen.get(arrival.hello.rank)
            if old is not None:
                old.close()
            seen[arrival.hello.rank] = arrival
            on_progress(len(seen))
    return seen
