"""The rank side of `python -m labkit.agent --connect HOST:PORT`: a rank that torchrun started, attached to a notebook.

torchrun (torch elastic) starts the ranks on every node, does their rendezvous and restarts them; this module only
connects each one to the notebook that called `labkit.attach` (labkit/launch/attach.py) and then serves that
notebook's calls exactly as a local rank does (labkit.launch.worker.serve): a Call in, a Reply out, stacks and
interrupts on a second connection, its output on a third. `python -m labkit.agent` (labkit/agent.py) runs `main`.

In order: read torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, ...); die with torchrun (a parent-death
SIGKILL, so that a torchrun killed from outside leaves no rank behind); read the session's secret (attach.py says
where) and open three signed connections (labkit.launch._signed), each starting with a `Hello`; send fds 1 and 2 to
the notebook; wait for `Welcome` (or `Refused`: another version, another world size); join the default group from
torchrun's environment (env://, MASTER_ADDR and MASTER_PORT) on the backend the notebook chose; serve calls. When
the notebook goes (its kernel ends, restarts, or calls labkit.shutdown()) the connections close and the rank exits
0, so torchrun ends too; when the notebook gives up the ranks after a failure it asks for exit code 1, and torchrun
restarts them if `--max-restarts` allows, and they attach again.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import secrets
import select
import signal
import socket
import sys
import threading
import time

__all__ = ["CONNECT_SECONDS", "main"]

CONNECT_SECONDS = 30.0  # how long to retry a notebook that does not listen yet (or no more: then give up)
_REQUIRED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    missing = [name for name in _REQUIRED_ENV if name not in os.environ]
    if missing:
        sys.exit(f"labkit.agent: {', '.join(missing)} not set: start it with torchrun, as labkit.attach() prints "
                 "(torchrun ... -m labkit.agent --connect HOST:PORT).")
    from labkit.launch import forkserver

    forkserver.set_parent_death_signal(signal.SIGKILL)  # torchrun killed: no rank stays behind
    if os.getppid() == 1:
        os._exit(0)  # torchrun ended before the signal was armed
    from labkit.launch import _listener, protocol

    host, port = _listener.parse_address(args.connect)
    secret = _listener.read_secret(host, port)
    links = _connect(host, port, secret, _hello_fields())
    job, control, output = (links[role] for role in protocol.Role)
    terminal = os.fdopen(os.dup(2), "w", buffering=1)  # the node's own stderr, for the refusal below
    forwarder = _Forwarder(output)
    welcome = protocol.receive(job)
    if isinstance(welcome, protocol.Refused):
        terminal.write(f"labkit.agent (rank {os.environ['RANK']}): the notebook refused this rank: {welcome.reason}\n")
        os._exit(3)
    _serve(welcome, job, control, forwarder)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m labkit.agent", description=__doc__.splitlines()[0])
    parser.add_argument("--connect", required=True, metavar="HOST:PORT",
                        help="the address labkit.attach() printed in the notebook")
    return parser.parse_args(argv)


def _hello_fields() -> dict:
    """Everything a `Hello` says but its role and agent id."""
    import torch

    from labkit.launch.backend import usable_gpu_count
    from labkit.version import VERSION

    env = os.environ
    return dict(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]), local_rank=int(env["LOCAL_RANK"]),
                local_world_size=int(env["LOCAL_WORLD_SIZE"]), node_rank=int(env.get("GROUP_RANK", 0)),
                host=socket.gethostname(), pid=os.getpid(),
                restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)), gpu_count=usable_gpu_count(),
                labkit_version=VERSION, torch_version=torch.__version__,
                python_version=platform.python_version())


def _connect(host: str, port: int, secret: bytes, fields: dict) -> dict:
    """The three signed connections, each opened with its `Hello`; retried for CONNECT_SECONDS while refused."""
    from labkit.launch import protocol
    from labkit.launch._signed import connect_signed

    agent_id = secrets.token_hex(8)
    deadline = time.monotonic() + CONNECT_SECONDS
    links = {}
    for role in protocol.Role:
        hello = protocol.encode(protocol.Hello(role=role, agent_id=agent_id, **fields))
        while True:
            try:
                links[role] = connect_signed((host, port), secret, hello)
                break
            except (TimeoutError, ConnectionRefusedError) as exc:
                if time.monotonic() > deadline:
                    sys.exit(f"labkit.agent: no notebook listens at {host}:{port} ({exc}); run labkit.attach() "
                             "there first, and use the command it prints.")
                time.sleep(0.5)
    return links


class _Forwarder:
    """Fds 1 and 2 point at pipes whose bytes go to the notebook as `OutputChunk`s: a thread sends them as they
    come, so that a long call's prints show live (local ranks' pipes are read by the owner itself; these must cross
    the network). At the end of a call the main thread drains the pipes itself and sends the end-of-call markers
    after what it drained, holding the same lock as the thread: the marker can never overtake the call's output, and
    a call's end costs no wake-up of the thread."""

    def __init__(self, output):
        self._output = output
        self._lock = threading.Lock()
        self._ends: dict[int, str] = {}
        for fd, stream in ((1, "stdout"), (2, "stderr")):
            read_end, write_end = os.pipe()
            os.dup2(write_end, fd)
            os.close(write_end)
            os.set_blocking(read_end, False)
            self._ends[read_end] = stream
        threading.Thread(target=self._pump, name="labkit-output", daemon=True).start()

    def _pump(self) -> None:
        while True:
            readable, _, _ = select.select(list(self._ends), [], [])
            with self._lock:
                for fd in readable:
                    self._send_available(fd)

    def _send_available(self, fd: int) -> None:
        """Send what pipe `fd` holds now, without waiting; the caller holds the lock."""
        from labkit.launch import protocol

        while True:
            try:
                data = os.read(fd, 1 << 16)
            except BlockingIOError:
                return
            try:
                protocol.send(self._output, protocol.OutputChunk(self._ends[fd], data))
            except OSError:
                os._exit(0)  # the notebook is gone
            if not data:  # the write end closed: nothing more will come (fds 1 and 2 stay open while we live)
                return

    def mark_end_of_call(self, call_id: int) -> None:
        from labkit.launch import protocol
        from labkit.launch.output import end_of_call_marker

        with self._lock:
            for fd in self._ends:
                self._send_available(fd)
            for stream in self._ends.values():
                protocol.send(self._output, protocol.OutputChunk(stream, end_of_call_marker(call_id)))


def _serve(welcome, job, control, forwarder: _Forwarder) -> None:
    """Join the default group from torchrun's environment on the notebook's backend, then serve its calls."""
    from labkit.launch import worker

    os.environ["LABKIT_RANK_PROCESS"] = "1"
    if not {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"} & set(os.environ):
        from labkit.launch.inflight import BUFFER_SIZE

        os.environ["TORCH_FR_BUFFER_SIZE"] = str(BUFFER_SIZE)  # the hang report's Flight Recorder, as local ranks
    from labkit.launch.backend import threads_per_rank

    worker.prepare_process(welcome.threads or threads_per_rank(int(os.environ["LOCAL_WORLD_SIZE"])))
    worker.serve(job, control, lambda: _join_group(welcome), forwarder.mark_end_of_call)


def _join_group(welcome) -> None:
    """The default group, met in torchrun's store under the pool's own `store_prefix`.

    Not init_method="env://": under torchrun that prefixes the keys with TORCHELASTIC_RESTART_COUNT, which counts
    one node's restarts only (a node restarted because another failed keeps its count), so after a restart the
    nodes could meet under different prefixes and read the previous pool's addresses (gloo: "Connection refused").
    The notebook gives every pool a fresh prefix instead. The store is the one torchrun's agent hosts
    (TORCHELASTIC_USE_AGENT_STORE, torch.distributed.elastic's docs); without it rank 0 hosts it, as env:// does."""
    import torch.distributed as dist

    from labkit.launch.backend import init_process_group

    env = os.environ
    timeout = datetime.timedelta(seconds=welcome.pg_timeout_seconds)
    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    hosts_store = env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and rank == 0
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, is_master=hosts_store,
                          timeout=timeout, wait_for_workers=False)
    init_process_group(welcome.backend, local_rank=int(env["LOCAL_RANK"]),
                       store=dist.PrefixStore(welcome.store_prefix, store), rank=rank, world_size=world_size,
                       timeout=timeout)

