"""Signed connections over TCP: every frame carries an HMAC of the session's secret, checked before it is used.

Why: an attached rank (attach.py) unpickles what the notebook sends it, and the notebook unpickles what the rank
sends back; whoever could put a frame on either socket would run code as the instructor. So, as Jupyter signs its
messages (jupyter_client's `Session.sign`, HMAC-SHA256 over the message), every frame here is signed and checked in
constant time (`hmac.compare_digest`) before a byte of it reaches pickle:

- The listener opens each connection with `GREETING` and a fresh random nonce; the connecting side answers with a
  nonce of its own. Each direction of the connection then has a key of its own, HMAC(secret, direction, both
  nonces), so no frame is valid on any other connection or in the other direction.
- A frame is its payload's length (8 bytes), its tag (32 bytes: HMAC(key, sequence number, payload)) and the
  payload. The sequence number is the frame's place on its connection, counted on both sides and never sent: a
  frame replayed, dropped or reordered fails its check.
- The first frame from the connecting side is limited to HELLO_LIMIT_NBYTES, so that a stranger cannot make the
  listener read much before it is refused.

A frame that fails its check raises `Unauthenticated` (a ConnectionError, so the launcher's readers treat the
connection as closed); the connection is then of no further use. `SignedConnection` offers what the launcher asks of
multiprocessing's Connection (`send_bytes`, `recv_bytes`, `poll`, `fileno`, `close`), so that the pool's channels and
the rank's worker use it unchanged. The secret itself never travels.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import select
import socket
import struct

__all__ = []

GREETING = b"labkit-attach/1\n"
NONCE_NBYTES = 32
TAG_NBYTES = 32  # SHA-256
HELLO_LIMIT_NBYTES = 1 << 16
FRAME_LIMIT_NBYTES = 1 << 40  # a bound on what a corrupted length can make a reader try to allocate
HANDSHAKE_SECONDS = 10.0
_HEADER = struct.Struct(">Q")
_SEQUENCE = struct.Struct(">Q")
# TCP keepalive (tcp(7)): a peer whose machine vanished without closing its sockets (power, cable) is noticed in
# about KEEPIDLE + KEEPINTVL * KEEPCNT = 11 s, not after the kernel's default two hours.
_KEEPIDLE_SECONDS, _KEEPINTVL_SECONDS, _KEEPCNT = 5, 2, 3


class Unauthenticated(ConnectionError):
    """A frame, or the greeting, failed its check: the peer does not hold the session's secret, or replayed or
    altered a frame."""


def keep_alive(sock: socket.socket) -> None:
    """No Nagle delay (a call's small frames go at once: a warm call costs milliseconds) and TCP keepalive."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", _KEEPIDLE_SECONDS), ("TCP_KEEPINTVL", _KEEPINTVL_SECONDS),
                        ("TCP_KEEPCNT", _KEEPCNT)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _key(secret: bytes, direction: bytes, listener_nonce: bytes, connector_nonce: bytes) -> bytes:
    return hmac.new(secret, direction + listener_nonce + connector_nonce, hashlib.sha256).digest()


class SignedConnection:
    """One TCP connection whose frames are signed both ways (the module's docstring says how)."""

    def __init__(self, sock: socket.socket, send_key: bytes, receive_key: bytes, peer: str):
        self._sock = sock
        self._send_key, self._receive_key = send_key, receive_key
        self._sent = self._received = 0
        self.peer = peer  # "host:port" of the other end, for messages

    def fileno(self) -> int:
        return self._sock.fileno()

    @property
    def closed(self) -> bool:
        return self._sock.fileno() < 0

    def send_bytes(self, payload: bytes) -> None:
        """Send `payload` as one signed frame."""
        tag = hmac.new(self._send_key, _SEQUENCE.pack(self._sent) + payload, hashlib.sha256).digest()
        self._sent += 1
        self._sock.sendall(_HEADER.pack(len(payload)) + tag + payload)

    def recv_bytes(self, limit_nbytes: int = FRAME_LIMIT_NBYTES) -> bytes:
        """The next frame's payload, once its tag checks; EOFError at a clean end of the connection."""
        header = self._exactly(_HEADER.size, at_start=True)
        (nbytes,) = _HEADER.unpack(header)
        if nbytes > limit_nbytes:
            raise Unauthenticated(f"a frame of {nbytes:,} bytes from {self.peer}, over the {limit_nbytes:,} allowed")
        tag = self._exactly(TAG_NBYTES)
        payload = self._exactly(nbytes)
        expected = hmac.new(self._receive_key, _SEQUENCE.pack(self._received) + payload, hashlib.sha256).digest()
        if not hmac.compare_digest(tag, expected):
            raise Unauthenticated(f"frame {self._received} from {self.peer} is not signed with this session's secret "
                                  "(or was replayed, reordered or altered)")
        self._received += 1
        return payload

    def poll(self, timeout: float = 0.0) -> bool:
        """True if a frame (or the end of the connection) is waiting, within `timeout` seconds."""
        readable, _, _ = select.select([self._sock], [], [], max(0.0, timeout))
        return bool(readable)

    def _exactly(self, nbytes: int, at_start: bool = False) -> bytes:
        view = memoryview(bytearray(nbytes))
        got = 0
        while got < nbytes:
            n = self._sock.recv_into(view[got:])
            if n == 0:
                if at_start and got == 0:
                    raise EOFError(f"{self.peer} closed the connection")
                raise ConnectionError(f"{self.peer} closed the connection in the middle of a frame")
            got += n
        return view.tobytes()

    def close(self) -> None:
        self._sock.close()


def accept_signed(sock: socket.socket, secret: bytes, peer: str) -> tuple[SignedConnection, bytes]:
    """The listener's side of the handshake on an accepted `sock`: greet with a nonce, take the peer's, and read
    its first frame (at most HELLO_LIMIT_NBYTES, within HANDSHAKE_SECONDS). Returns the connection and that frame's
    payload, checked but not unpickled; raises Unauthenticated (or OSError, EOFError) for a peer without the
    secret."""
    sock.settimeout(HANDSHAKE_SECONDS)
    listener_nonce = os.urandom(NONCE_NBYTES)
    sock.sendall(GREETING + listener_nonce)
    raw = SignedConnection(sock, b"", b"", peer)
    connector_nonce = raw._exactly(NONCE_NBYTES, at_start=True)
    conn = SignedConnection(sock, _key(secret, b"listener->connector", listener_nonce, connector_nonce),
                            _key(secret, b"connector->listener", listener_nonce, connector_nonce), peer)
    hello = conn.recv_bytes(HELLO_LIMIT_NBYTES)
    sock.settimeout(None)
    keep_alive(sock)
    return conn, hello


def connect_signed(address: tuple[str, int], secret: bytes, hello: bytes,
                   timeout_seconds: float = HANDSHAKE_SECONDS) -> SignedConnection:
    """The connecting side: open a connection to `address`, check the greeting, and send `hello` as the first
    signed frame."""
    sock = socket.create_connection(address, timeout=timeout_seconds)
    try:
        peer = f"{address[0]}:{address[1]}"
        raw = SignedConnection(sock, b"", b"", peer)
        greeting = raw._exactly(len(GREETING), at_start=True)
        if greeting != GREETING:
            raise Unauthenticated(f"{peer} is not a labkit notebook waiting for ranks (it said {greeting[:40]!r})")
        listener_nonce = raw._exactly(NONCE_NBYTES)
        connector_nonce = os.urandom(NONCE_NBYTES)
        sock.sendall(connector_nonce)
        conn = SignedConnection(sock, _key(secret, b"connector->listener", listener_nonce, connector_nonce),
                                _key(secret, b"listener->connector", listener_nonce, connector_nonce), peer)
        conn.send_bytes(hello)
        sock.settimeout(None)
        keep_alive(sock)
        return conn
    except BaseException:
        sock.close()
        raise
