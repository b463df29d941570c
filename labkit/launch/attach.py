"""`labkit.attach(world_size=16, nodes=2)` and `labkit.attached()`: run the notebook's calls on ranks that torchrun
started on other machines.

`attach` listens at `host:port`, prints the torchrun command (and its Slurm form) to run on every node, waits with a
progress bar until all `world_size` ranks have attached and joined their group, and from then on `labkit.run(fn,
world_size=N)` and `%%ranks N` run on them, with local ranks' contract; `labkit.shutdown()` ends them (and torchrun
with them). How the ranks connect and why it is safe: labkit/launch/_listener.py; the pool: _attached.py; the rank's
side: labkit/agent.py.
"""

from __future__ import annotations

import socket

from labkit.checks import rank_count, timeout_seconds
from labkit.launch._attached import Attachment, shell_lines, slurm_command, torchrun_command
from labkit.launch.backend import BACKENDS
from labkit.launch.owner import OWNER, PG_TIMEOUT_SECONDS

__all__ = ["attach", "attach_commands", "attached"]


def attach(world_size: int, nodes: int = 1, host: str | None = None, port: int = 0, backend: str = "auto",
           timeout: float = 600.0) -> Attachment:
    """Wait for `world_size` ranks that torchrun starts on `nodes` machines, and run later calls of that world size
    on them. `host`: the address of this machine that the nodes reach (the listener binds it alone; by default the
    address this machine's name resolves to); `port` 0 picks a free one. Returns the `Attachment`, whose repr is the
    table of attached ranks (rank, host, local rank, device); `timeout` seconds without every rank attached raise
    TimeoutError naming the ranks still missing.

    Example (a notebook on 10.0.0.5, two nodes of 8 GPUs): `labkit.attach(world_size=16, nodes=2, host="10.0.0.5")`
    prints `torchrun --nnodes 2 --nproc-per-node 8 ... -m labkit.agent --connect 10.0.0.5:40917` and waits.
    """
    world_size = rank_count(world_size)
    timeout = timeout_seconds("timeout", timeout)
    if not isinstance(nodes, int) or nodes < 1 or world_size % nodes:
        raise ValueError(f"nodes={nodes!r}: give a positive number of nodes that divides world_size={world_size} "
                         "(every node runs world_size / nodes ranks).")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {', '.join(map(repr, BACKENDS))}.")
    if not isinstance(port, int) or not 0 <= port < 65536:
        raise ValueError(f"port={port!r}: give 0 (any free port) or a port number below 65536.")
    host = host or _default_host()
    with OWNER.turn.held(f"labkit.attach(world_size={world_size})", timeout):
        attachment = Attachment(world_size, nodes, host, port, backend)
        print(attachment.instructions(), flush=True)
        try:
            attachment.form_pool(timeout, PG_TIMEOUT_SECONDS)
        except BaseException:
            attachment.close()
            raise
        OWNER.adopt(attachment)
    return attachment


def attach_commands(world_size: int, nodes: int, connect: str = "NOTEBOOK_HOST:PORT", lines: bool = True) -> str:
    """The two forms of the command `attach` prints for the nodes (torchrun by hand, and under Slurm's srun), for a
    notebook that listens at `connect`, without listening: what an instructor's guide shows. With `lines`, each is
    broken into shell lines of at most 100 characters, as `attach` prints them; without, one line each.

    >>> print(attach_commands(4, 2, lines=False).splitlines()[0])  # doctest: +NORMALIZE_WHITESPACE
    torchrun --nnodes 2 --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint NODE0:29400
    --rdzv-id labkit-demo -m labkit.agent --connect NOTEBOOK_HOST:PORT
    """
    world_size = rank_count(world_size)
    if not isinstance(nodes, int) or nodes < 1 or world_size % nodes:
        raise ValueError(f"nodes={nodes!r}: give a positive number of nodes that divides world_size={world_size}.")
    commands = (torchrun_command(world_size, nodes, connect, "labkit-demo"),
                slurm_command(world_size, nodes, connect, "labkit-demo"))
    return "\n".join(map(shell_lines, commands) if lines else commands)


def attached() -> Attachment | None:
    """The attached ranks (print it for the table: rank, host, local rank, device), None if none are."""
    return OWNER.attachment


def _default_host() -> str:
    """The address this machine's name resolves to: what nodes on its network usually reach it at."""
    try:
        return socket.gethostbyname(socket.getfqdn())
    except OSError:
        return "127.0.0.1"
