"""labkit.launch._signed: a frame is accepted only as the next frame of its own connection and direction, signed with
the session's secret; anything else raises Unauthenticated before its payload is returned (so before pickle)."""

from __future__ import annotations

import socket
import threading

import pytest

from labkit.launch._signed import GREETING, HELLO_LIMIT_NBYTES, Unauthenticated, accept_signed, connect_signed

SECRET = b"s" * 32


class Recorder:
    """A socket wrapper that keeps every byte sent through it."""

    def __init__(self, sock):
        self.sock, self.sent = sock, bytearray()

    def sendall(self, data):
        self.sent += data
        self.sock.sendall(data)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def pair(secret_of_connector: bytes = SECRET, hello: bytes = b"hello"):
    """(listener's connection, its first payload, connector's connection) over real TCP on loopback."""
    server = socket.create_server(("127.0.0.1", 0))
    result = {}

    def accept():
        sock, peer = server.accept()
        try:
            result["accepted"] = accept_signed(sock, SECRET, f"{peer}")
        except Exception as exc:  # noqa: BLE001 - the test reads it
            result["error"] = exc
    thread = threading.Thread(target=accept)
    thread.start()
    connector = connect_signed(server.getsockname(), secret_of_connector, hello)
    thread.join(10)
    server.close()
    return result, connector


def test_a_signed_conversation_goes_both_ways():
    result, connector = pair()
    listener, first = result["accepted"]
    assert first == b"hello"
    listener.send_bytes(b"welcome")
    assert connector.recv_bytes() == b"welcome"
    connector.send_bytes(b"x" * 100_000)
    assert listener.recv_bytes() == b"x" * 100_000


def test_a_connector_without_the_secret_is_refused_at_its_first_frame():
    result, _ = pair(secret_of_connector=b"w" * 32)
    assert isinstance(result["error"], Unauthenticated)


def recorded_pair():
    """(listener's connection, connector's, a Recorder of every byte the connector sends)."""
    result, connector = pair()
    recorder = Recorder(connector._sock)
    connector._sock = recorder
    return result["accepted"][0], connector, recorder


def test_a_replayed_frame_is_refused_on_the_same_connection():
    listener, connector, recorder = recorded_pair()
    connector.send_bytes(b"run this once")
    assert listener.recv_bytes() == b"run this once"
    recorder.sock.sendall(bytes(recorder.sent))  # the same bytes again
    with pytest.raises(Unauthenticated):
        listener.recv_bytes()


def test_a_frame_sent_back_in_the_other_direction_is_refused():
    listener, connector, recorder = recorded_pair()
    connector.send_bytes(b"towards the listener")
    listener.recv_bytes()
    listener._sock.sendall(bytes(recorder.sent))  # reflected to the connector: the other direction's key
    with pytest.raises(Unauthenticated):
        connector.recv_bytes()


def test_an_altered_payload_is_refused():
    result, connector = pair()
    listener, _ = result["accepted"]
    real, frame = connector._sock, bytearray()
    connector._sock = _Swallow(frame)
    connector.send_bytes(b"pay 10")
    frame[-1:] = b"9"
    real.sendall(bytes(frame))
    with pytest.raises(Unauthenticated):
        listener.recv_bytes()


class _Swallow:
    """A socket stand-in that keeps what it is given instead of sending it."""

    def __init__(self, into: bytearray):
        self.into = into

    def sendall(self, data):
        self.into += data


def test_a_first_frame_over_the_hello_limit_is_refused_before_it_is_read():
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    sock, _ = server.accept()
    client.sendall(b"n" * 32 + (HELLO_LIMIT_NBYTES + 1).to_bytes(8, "big"))  # a nonce, then a huge length
    with pytest.raises(Unauthenticated, match="over the"):
        accept_signed(sock, SECRET, "stranger")
    assert client.recv(len(GREETING)) == GREETING
    for s in (client, sock, server):
        s.close()
