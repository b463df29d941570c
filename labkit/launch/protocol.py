"""The launcher's wire protocol: every message between the owner, the fork server and the ranks, by name.

Each message is one pickled NamedTuple, sent whole with `send` and read with `receive` (a
multiprocessing Connection frames it). A NamedTuple pickles as its class's name and its fields, so it
costs about what a plain tuple does, yet every reader takes its fields by name. Kinds of outcome are
`TextEnum`s: they print and compare as their text. Who says what, on which socket:

=============================  ===================================================================
owner -> fork server           `ForkRank` (the rank's four fds follow by SCM_RIGHTS), `SignalRanks`
fork server -> owner           `Forked` (answers `ForkRank`), `Exited` (whenever a rank is reaped)
owner -> rank, job socket      `Call`
rank -> owner, job socket      `Ready` or `StartFailed` once, then one `Reply` per `Call` (a big result's
                               `Returning` before it)
owner -> rank, control socket  `StackRequest`, `Interrupt`, `Leave` (attached ranks only)
rank -> owner, control socket  `Stack` (the answer to `StackRequest`)
attached rank -> owner         `Hello` first on each of its three connections (attach.py), then as above;
                               `OutputChunk`s on the third, its output
owner -> attached rank, job    `Welcome` or `Refused`, before any `Call`
=============================  ===================================================================

A rank is started from a `RankSpec`. Errors travel as plain data (`ExceptionDescription`, made of
`ExceptionLink`s and `Frame`s, errors.py says how), never as the exception itself: its class might not
exist in the owner, and its frames would pin the rank's tensors.

    >>> import pickle
    >>> reply = Reply(7, Outcome.ERROR, ExceptionDescription([]), 0.0, {"0/cpu": 1}, False)
    >>> pickle.loads(pickle.dumps(reply)).outcome
    <Outcome.ERROR: 'error'>
    >>> reply.outcome == "error", f"{reply.outcome}"
    (True, 'error')
"""

from __future__ import annotations

import pickle
from enum import Enum
from multiprocessing.connection import Connection
from typing import NamedTuple

__all__ = ["Call", "Chained", "ExceptionDescription", "ExceptionLink", "Exited", "ForkRank", "Forked",
           "Frame", "GroupCollectives", "Hello", "Interrupt", "Leave", "Outcome", "OutputChunk", "RankSpec", "Ready",
           "Refused", "Reply", "Returning", "Role", "SignalRanks", "Stack", "StackRequest", "StartFailed", "TextEnum",
           "Welcome", "encode", "receive", "send"]


class TextEnum(str, Enum):
    """Kinds that are their text: a member equals its value ("error") and prints as it.

    What Python 3.11's `enum.StrEnum` does, written for 3.10, which labkit supports: a `str` mixin makes
    members compare, hash and format as their value, and `__str__` makes `str()` and `print` say it too
    (a plain `(str, Enum)` prints `Outcome.ERROR`)."""

    def __str__(self) -> str:
        return self.value


def encode(message: NamedTuple) -> bytes:
    """`message` as the bytes `send` puts on the wire: to send one message to many ranks, pickle it once."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def send(connection: Connection, message: NamedTuple) -> None:
    """Pickle `message` and send it as one frame on `connection`."""
    connection.send_bytes(encode(message))


def receive(connection: Connection):
    """The next message on `connection`; EOFError once the other side has closed it."""
    return pickle.loads(connection.recv_bytes())


# ---- what a rank is told when it starts --------------------------------------------------------------

class RankSpec(NamedTuple):
    """Everything a rank needs to join its pool's process group, sent with `ForkRank`."""

    rank: int
    world_size: int
    backend: str  # "gloo" or "nccl" (backend.py)
    store_path: str  # the FileStore the ranks meet in (owner.py says why a file)
    pg_timeout_seconds: float
    threads: int  # torch.set_num_threads: the machine's cores shared out among the ranks
    cwd: str  # the owner's, so that relative paths mean the same on every rank
    sys_path: list[str]  # the owner's, so that the same modules import
    env: dict[str, str]  # added to the rank's environment: RANK, WORLD_SIZE, OMP_NUM_THREADS, ...
    network: str = "private"  # netns.PRIVATE: a network namespace of the pool's own; netns.SHARED: the host's


# ---- owner and fork server ---------------------------------------------------------------------------

class ForkRank(NamedTuple):
    """Start one rank from `spec`; the server answers with `Forked` carrying the same `request_id`."""

    request_id: int
    spec: RankSpec


class SignalRanks(NamedTuple):
    """Send `signal_number` to the process group of each of `pids` that the server has not reaped yet."""

    pids: list[int]
    signal_number: int


class Forked(NamedTuple):
    """The rank asked for by `ForkRank` number `request_id` runs as process `pid`. `network_refused`: why it shares
    the host's network although its spec asked for a namespace of its own (netns.py), None if it did not."""

    request_id: int
    pid: int
    network_refused: str | None = None


class Exited(NamedTuple):
    """Rank `pid` has ended and been reaped; `status` as os.waitpid gives it (None: unknown)."""

    pid: int
    status: int | None


# ---- owner and rank: calls ---------------------------------------------------------------------------

class Call(NamedTuple):
    """Run the cloudpickled `(fn, args, kwargs)` in `payload`; answer with a `Reply` for `call_id`."""

    call_id: int
    timeout_seconds: float
    payload: bytes


class Outcome(TextEnum):
    """How a call ended on one rank."""

    OK = "ok"  # returned; the Reply's body is the pickled result
    ERROR = "error"  # raised; the body is an ExceptionDescription
    INTERRUPTED = "interrupted"  # stopped by an Interrupt for this call; the body is an ExceptionDescription
    UNPICKLABLE = "unpicklable"  # returned something that cannot be pickled; the body says what, in words


class Reply(NamedTuple):
    """One rank's answer to the `Call` numbered `call_id`."""

    call_id: int
    outcome: Outcome
    body: bytes | ExceptionDescription | str  # by `outcome`: see Outcome
    finished_at: float  # time.time() on the rank: the earliest failure is the root cause
    steps: dict[str, int] | None  # operations each process group issued during the call (None: unknown)
    group_destroyed: bool  # the call ran dist.destroy_process_group(): this pool cannot serve another


class Returning(NamedTuple):
    """Call `call_id` has returned a result of about `result_nbytes` bytes, which the rank now pickles and sends:
    sent before a big result only (worker.py), so that a timeout meanwhile says so, even while pickling holds the
    GIL and the rank cannot answer a `StackRequest`."""

    call_id: int
    result_nbytes: int


class Ready(NamedTuple):
    """The rank has joined its process group and waits for calls."""


class StartFailed(NamedTuple):
    """The rank could not join its process group, and will exit."""

    error: ExceptionDescription


# ---- owner and rank: the control socket --------------------------------------------------------------

class StackRequest(NamedTuple):
    """Where is your main thread? Answered with a `Stack`, even while that thread waits in a collective."""


class Interrupt(NamedTuple):
    """Stop call `call_id`, and no other: worker.py says why an interrupt names its call."""

    call_id: int


class Frame(NamedTuple):
    """One line of a stack: what a traceback prints for it, less the source, which the owner looks up."""

    filename: str
    lineno: int
    function: str


class GroupCollectives(NamedTuple):
    """What one of a rank's process groups has issued on one backend, as torch's Flight Recorder records it
    (labkit/launch/inflight.py): `issued` collectives so far, and those not completed, oldest first, as
    (operation, sequence number), the number being the collective's place among the group's collectives."""

    name: str  # c10d's group name: "0" for the default group, the same on every member rank
    ranks: tuple[int, ...]  # its members' global ranks
    backend: str  # "gloo" or "nccl"
    issued: int
    in_flight: tuple[tuple[str, int], ...]


class Stack(NamedTuple):
    """A rank's main thread, outermost frame first, without labkit's own launch frames.

    `sending_result_nbytes` is set instead when the thread is sending a finished call's result to the
    owner: its frames would only show multiprocessing's `_send`. `synchronizing`: the call has returned and
    the rank waits for the GPU work it queued (worker.py). `collectives`: its groups' collectives, None where
    the Flight Recorder could not say."""

    frames: list[Frame]
    sending_result_nbytes: int | None = None
    synchronizing: bool = False
    collectives: tuple[GroupCollectives, ...] | None = None


# ---- attached ranks (attach.py, labkit.agent): ranks that torchrun started, on any machine ----------------

class Role(TextEnum):
    """Which of an attached rank's three connections to the notebook this is."""

    JOB = "job"  # Welcome, Call in; Ready, Reply out: the local ranks' job socket
    CONTROL = "control"  # StackRequest, Interrupt, Leave in; Stack out: the local ranks' control socket
    OUTPUT = "output"  # OutputChunk out: what the local ranks' two pipes carry


class Hello(NamedTuple):
    """The first frame on each connection of an attached rank: who it is, where, and with what software."""

    role: Role
    agent_id: str  # random, the same on the rank's three connections
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int  # torchrun's GROUP_RANK
    host: str  # socket.gethostname() on the node
    pid: int
    restart_count: int  # torchrun's TORCHELASTIC_RESTART_COUNT: how often it has restarted the workers
    gpu_count: int  # usable CUDA GPUs on the node (backend.usable_gpu_count)
    labkit_version: str
    torch_version: str
    python_version: str


class Welcome(NamedTuple):
    """The notebook takes the rank: join the default group on `backend` ("gloo" or "nccl"), with `threads` threads."""

    backend: str
    pg_timeout_seconds: float
    threads: int  # torch.set_num_threads; 0: the node's cores shared out among its ranks (the notebook cannot see them)
    store_prefix: str  # the keys of this pool's rendezvous in torchrun's store: fresh for each pool (attached_rank.py)


class Refused(NamedTuple):
    """The notebook does not take the rank (another version, another world size); the agent exits saying why."""

    reason: str


class Leave(NamedTuple):
    """End the process now with `exit_code`: 0 when the notebook is done with the ranks (torchrun then ends), 1 when
    their pool is given up after a failure (torchrun restarts them if --max-restarts allows)."""

    exit_code: int


class OutputChunk(NamedTuple):
    """Bytes the attached rank wrote on `stream` ("stdout" or "stderr"); b"" once that stream has closed."""

    stream: str
    data: bytes


# ---- errors as data ----------------------------------------------------------------------------------

class Chained(TextEnum):
    """How an exception relates to the one printed before it, in Python's own words."""

    CAUSE = "cause"  # raise ... from ...: "The above exception was the direct cause of the following exception"
    CONTEXT = "context"  # raised while handling: "During handling of the above exception, another exception occurred"


class ExceptionLink(NamedTuple):
    """One exception of a chain: its class, message, arguments and the frames it was raised through.

    Each argument travels pickled on its own, with its repr beside it: the owner unpickles what it can and
    keeps the repr of the rest, so that an argument whose class the owner lacks cannot spoil the reply."""

    type_name: str  # the class's __qualname__
    module: str  # the class's __module__
    message: str
    frames: list[Frame]
    after: Chained | None  # how it follows the previous link; None for the first
    args: tuple[tuple[bytes | None, str], ...] = ()  # each of exc.args: (pickled, or None if it does not pickle; repr)


class ExceptionDescription(NamedTuple):
    """An exception and the chain that caused it, oldest first, as Python prints them.

    `follow_on`: the exception said it only follows another rank's failure (errors.FOLLOW_ON_ATTRIBUTE),
    so the owner names another failure as the root cause."""

    chain: list[ExceptionLink]
    follow_on: bool = False
