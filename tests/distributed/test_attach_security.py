"""Strangers at an attached notebook's listener (labkit/launch/_listener.py): garbage, a well-formed but unsigned
hello, a replayed one, a connection that never speaks, and another local user. Each payload is a pickle that would
create a file if anything unpickled it: no such file appears, every attempt is refused and logged, and the ranks keep
serving calls."""

from __future__ import annotations

import os
import pickle
import socket
import sys
import textwrap
import threading
import time

import pytest

import labkit
from labkit.launch import owner
from labkit.launch._listener import MAX_HANDSHAKES
from labkit.launch._signed import GREETING, NONCE_NBYTES, connect_signed
from tests.distributed.test_attach import free_port
from tests.distributed.two_nodes import LOOPBACK, Nodes


class CreatesAFile:
    """Unpickling this creates `path`: the proof that something ran a stranger's pickle."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def one_node(tmp_path):
    nodes = Nodes(count=1)
    try:
        port = free_port(nodes.notebook_host)
        rdzv_port = free_port(nodes.addresses[0]) if nodes.network == LOOPBACK else 29400
        nodes.start(f"{nodes.notebook_host}:{port}", ranks_per_node=2, rdzv_port=rdzv_port, log_dir=tmp_path)
        attachment = labkit.attach(world_size=2, nodes=1, host=nodes.notebook_host, port=port, timeout=120)
        yield nodes, attachment
    finally:
        labkit.shutdown()
        nodes.close()


def _refused_soon(listener, count: int, seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and len(listener.refused) < count:
        time.sleep(0.05)
    return len(listener.refused) >= count


def test_strangers_are_refused_and_run_nothing_while_the_ranks_keep_serving(one_node, tmp_path):
    nodes, attachment = one_node
    listener = attachment.listener
    address = (listener.host, listener.port)
    proof = tmp_path / "a stranger's code ran"
    evil = pickle.dumps(CreatesAFile(str(proof)))

    with socket.create_connection(address) as garbage:  # 1. garbage
        garbage.recv(len(GREETING) + NONCE_NBYTES)
        garbage.sendall(os.urandom(64) + evil)
    assert _refused_soon(listener, 1)

    with pytest.raises((ConnectionError, EOFError)):  # 2. well formed, signed with a wrong secret
        link = connect_signed(address, os.urandom(32), evil)
        link.recv_bytes()
    assert _refused_soon(listener, 2)

    # 3. replayed: what a holder of the secret sent on another connection (an eavesdropper's capture: here that
    # connection went to a stand-in listener, whose nonce is not the real one's), sent again to the real listener
    recorded = _what_a_holder_of_the_secret_sends(listener.secret, evil)
    with socket.create_connection(address) as replay:
        replay.recv(len(GREETING) + NONCE_NBYTES)
        replay.sendall(recorded)
    assert _refused_soon(listener, 3)
    reasons = [why for _, why in listener.refused]
    assert all("not signed with this session's secret" in why for why in reasons[1:]), reasons

    # 4. connections that never speak hold up nobody: past MAX_HANDSHAKES at once, the next are closed at once
    silent = [socket.create_connection(address) for _ in range(MAX_HANDSHAKES + 5)]
    try:
        assert labkit.run(labkit.rank, world_size=2) == [0, 1]
        assert _refused_soon(listener, 3 + 5)
        assert sum("already being authenticated" in why for _, why in listener.refused) >= 5
    finally:
        for sock in silent:
            sock.close()
    assert not proof.exists(), "nothing a stranger sent was unpickled"
    assert owner.OWNER.attachment is attachment and labkit.run(labkit.rank, world_size=2) == [0, 1]


def _what_a_holder_of_the_secret_sends(secret: bytes, payload: bytes) -> bytes:
    """The bytes connect_signed sends after the greeting (its nonce, then `payload` signed), to a stand-in
    listener that greets with a nonce of its own."""
    stand_in = socket.create_server(("127.0.0.1", 0))
    received = bytearray()

    def listen():
        sock, _ = stand_in.accept()
        sock.sendall(GREETING + os.urandom(NONCE_NBYTES))
        while chunk := sock.recv(1 << 16):
            received.extend(chunk)
        sock.close()
    thread = threading.Thread(target=listen)
    thread.start()
    connect_signed(stand_in.getsockname(), secret, payload).close()
    thread.join(10)
    stand_in.close()
    return bytes(received)


OTHER_USER = textwrap.dedent("""
    import os, pickle, socket, sys
    host, port, key_file, proof = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    try:
        open(key_file).read()
        print("READ THE SECRET")
    except PermissionError:
        print("secret unreadable")
    mine = [p for p in os.listdir("/proc") if p.isdigit()]
    for pid in mine:
        try:
            if bytes.fromhex(sys.argv[5]) in open(f"/proc/{pid}/cmdline", "rb").read():
                print("SECRET ON A COMMAND LINE", pid)
        except OSError:
            pass
    class CreatesAFile:
        def __reduce__(self):
            return (open, (proof, "w"))
    sys.path.insert(0, sys.argv[6])
    from labkit.launch._signed import connect_signed
    try:
        link = connect_signed((host, port), b"guess" * 7, pickle.dumps(CreatesAFile()))
        link.recv_bytes()
        print("ACCEPTED")
    except (ConnectionError, EOFError, OSError) as exc:
        print("refused", type(exc).__name__)
""")


def test_another_local_user_can_neither_read_the_secret_nor_get_code_run(one_node, as_another_user, tmp_path):
    nodes, attachment = one_node
    listener = attachment.listener
    os.chmod(tmp_path, 0o777)  # the stranger may write its proof here: only the notebook unpickling it would
    proof = tmp_path / "proof"
    secret_hex = listener.secret.hex()
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    before = len(listener.refused)
    done = as_another_user([sys.executable, "-c", OTHER_USER,
                            listener.host, str(listener.port), str(listener.secret_file), str(proof),
                            listener.secret.hex(), repo])
    out = done.stdout + done.stderr
    assert "secret unreadable" in out and "READ THE SECRET" not in out, out
    assert "SECRET ON A COMMAND LINE" not in out and "ACCEPTED" not in out, out
    assert "refused" in out, out
    assert _refused_soon(listener, before + 1)
    assert not proof.exists()
    assert secret_hex not in " ".join(open(f"/proc/{p.pid}/cmdline").read() for p in nodes.launches)
    assert labkit.run(labkit.rank, world_size=2) == [0, 1]


def test_the_listener_binds_only_the_address_it_was_given(one_node):
    nodes, attachment = one_node
    listener = attachment.listener
    assert listener._sock.getsockname()[0] == nodes.notebook_host
    if nodes.network == LOOPBACK:
        pytest.skip("on loopback the given address is 127.0.0.1: no other address of this machine to try")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", listener.port), timeout=5)
