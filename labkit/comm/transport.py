"""The four things a collective algorithm needs from the network, and their torch.distributed version.

A `Transport` posts sends and receives of tensors between ranks (non-blocking, so that a ring can
reduce one segment while the next is still on the wire), counts the bytes, records transfers while
`traced()` is on, and lets every rank see every other rank's tensor signature before an algorithm
starts, so that mismatched shapes fail with an error instead of a hang. `TorchTransport` does this
over torch.distributed point-to-point (gloo or NCCL); `labkit.comm.simulate` has an in-memory one.

The algorithms reduce on the rank itself, so the network only has to move bytes. `carriage` says how
a tensor travels over the backend that carries it: a dtype NCCL has no type for moves as the same
bytes under one it has, and a CUDA tensor on gloo, which has no point-to-point for CUDA tensors,
moves through host memory. The CUDA rules follow PyTorch's documentation and ProcessGroupNCCL's
dtype table; this machine checks them as pure functions, and tests/gpu on a GPU machine.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from labkit.groups import check_gathered, group_rank, group_ranks, group_size, require_member

__all__ = ["DTYPES", "MAX_DIMS", "NCCL_DTYPES", "Batch", "Carriage", "Pending", "TorchTransport", "Transfer",
           "Transport", "carriage", "carrier", "check_rank", "default_transport", "describe_signature", "dtype_index",
           "flat_buffer", "on_the_wire", "resolve_transport", "signature", "traced", "write_back"]

MAX_DIMS = 8  # a signature holds a shape of up to this many dimensions
HEADER_TAG = 1 << 20  # for the signature exchange; data tags stay below it
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
# The dtypes ProcessGroupNCCL maps to an NCCL type (its ncclDataType table; bool travels as ncclUint8). NCCL
# has no 16-bit integer and no complex type: torch.distributed.all_reduce sends complex as
# torch.view_as_real, and ProcessGroupNCCL refuses the rest.
NCCL_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
                         torch.int32, torch.int64, torch.bool})
_REAL_OF = {torch.complex64: torch.float32, torch.complex128: torch.float64}


@dataclass(frozen=True)
class Transfer:
    """One tensor moving from `src` to `dst`: the unit a trace records and an animation draws.

    step: the algorithm's step (ring_allreduce: 0 .. 2(N-1)-1); phase: "reduce-scatter", "all-gather",
    "gather", "broadcast" or "reduce"; chunk: which of the N chunks (None for a whole tensor);
    start/end: seconds (time.perf_counter on a real run, the alpha-beta model in a simulation). On CUDA
    tensors they are when the host posted and finished waiting for the transfer, not when the GPU ran it."""

    step: int
    phase: str
    src: int
    dst: int
    chunk: int | None
    nbytes: int
    start: float = 0.0
    end: float = 0.0

    def key(self) -> tuple:
        """Everything but the times: equal for a real run and a simulation of the same call."""
        return (self.step, self.phase, self.src, self.dst, self.chunk, self.nbytes)


class Pending(Protocol):
    def wait(self) -> None: ...


@dataclass(frozen=True)
class Carriage:
    """How a tensor of one dtype and device travels between ranks.

    backend: what carries it ("gloo", "nccl", another name, or None if the group has no backend for the
    device); wire_dtype: the dtype of the view the backend is given (the same memory, reinterpreted);
    via_host: staged through a CPU copy; batched: a ring step's send and receive are posted together as
    one dist.batch_isend_irecv."""

    backend: str | None
    wire_dtype: torch.dtype
    via_host: bool
    batched: bool


def carrier(backend_config: str, device_type: str) -> str | None:
    """The backend that carries tensors on `device_type` in a group configured as `backend_config`.

    `backend_config` is what dist.get_backend_config(group) returns: "cpu:gloo,cuda:nccl" for labkit's
    NCCL pools (CPU tensors over gloo, CUDA tensors over NCCL), "cpu:gloo,cuda:gloo" for plain gloo; a
    bare name ("nccl") stands for every device.

    >>> carrier("cpu:gloo,cuda:nccl", "cuda"), carrier("cpu:gloo,cuda:nccl", "cpu"), carrier("cuda:nccl", "cpu")
    ('nccl', 'gloo', None)
    """
    backends = {}
    for part in backend_config.lower().split(","):
        device, _, backend = part.strip().rpartition(":")
        backends[device or "*"] = backend
    return backends.get(device_type, backends.get("*"))


def carriage(dtype: torch.dtype, device_type: str, backend_config: str, batched: bool | None = None) -> Carriage:
    """How a `dtype` tensor on `device_type` travels in a group configured as `backend_config`.

    - NCCL: a dtype ProcessGroupNCCL has no NCCL type for travels as the same bytes under one it has:
      complex as its real and imaginary parts (the float view torch.view_as_real gives, as
      torch.distributed.all_reduce sends complex), int16 as its raw bytes (uint8). Neither widening
      (twice the traffic, and the 2(N-1)/N byte count no longer holds) nor refusing is needed: the
      reduction happens on the rank, in the tensor's own dtype.
    - gloo: every dtype as it is; a CUDA tensor goes through host memory, because gloo's send and recv
      take CPU tensors only (PyTorch's distributed docs: gloo on GPU has broadcast and all_reduce).
    - `batched` (None: decide here): NCCL yes, otherwise no. On NCCL, a send and a receive posted one
      after the other can be serialised on one stream; NCCL progresses the operations of one group
      together (NCCL user guide, "Point-to-point communication"), which dist.batch_isend_irecv issues.
      On gloo batch_isend_irecv only posts each operation in turn, and it has hung in some releases.

    >>> carriage(torch.complex64, "cuda", "cpu:gloo,cuda:nccl").wire_dtype
    torch.float32
    >>> carriage(torch.float32, "cuda", "cpu:gloo,cuda:gloo").via_host
    True
    """
    backend = carrier(backend_config, device_type)
    wire = dtype
    if backend == "nccl" and dtype not in NCCL_DTYPES:
        wire = _REAL_OF.get(dtype, torch.uint8)
    via_host = backend == "gloo" and device_type != "cpu"
    return Carriage(backend, wire, via_host, backend == "nccl" if batched is None else batched)


def on_the_wire(tensor: torch.Tensor, wire_dtype: torch.dtype) -> torch.Tensor:
    """`tensor`'s memory seen as `wire_dtype` (complex64 as float32 pairs, int16 as bytes): no copy."""
    return tensor if tensor.dtype == wire_dtype else tensor.view(wire_dtype)


class Transport:
    """Base class: byte counters and tracing; subclasses move the bytes."""

    rank: int
    world_size: int

    def __init__(self):
        self.sent_nbytes = 0
        self.received_nbytes = 0
        self.events: list[Transfer] | None = None  # a list while traced() is on
        self._scratch: dict[tuple, torch.Tensor] = {}

    def _post_send(self, tensor: torch.Tensor, dst: int, tag: int) -> Pending:
        raise NotImplementedError

    def _post_recv(self, tensor: torch.Tensor, src: int, tag: int) -> Pending:
        raise NotImplementedError

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Pending:
        """Start sending `tensor` to rank `dst`; counted in sent_nbytes."""
        self.sent_nbytes += tensor.numel() * tensor.element_size()
        return self._post_send(tensor, dst, tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Pending:
        """Start receiving into `tensor` from rank `src`; counted in received_nbytes."""
        self.received_nbytes += tensor.numel() * tensor.element_size()
        return self._post_recv(tensor, src, tag)

    def exchange(self, send: torch.Tensor, dst: int, receive: torch.Tensor, src: int,
                 tag: int) -> tuple[Pending, Pending]:
        """Start sending `send` to `dst` and receiving `receive` from `src` (one step of a ring).

        Even ranks post the send first, odd ranks the receive, so that where a send blocks until
        matched, neighbours never both wait on a send."""
        if self.rank % 2 == 0:
            sent = self.isend(send, dst, tag)
            return sent, self.irecv(receive, src, tag)
        received = self.irecv(receive, src, tag)
        return self.isend(send, dst, tag), received

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Post several `isend`/`irecv` calls together (see `TorchTransport.batch`); here each is posted as it
        is made, which is the same for a transport whose sends never wait for their receiver."""
        yield

    def signatures(self, mine: list[int], device: torch.device) -> list[list[int]]:
        """Every rank's `mine` (equal-length lists of ints), in rank order, exchanged as tensors on `device`.

        Each rank sends its list straight to every other rank: one round of small messages, where a
        collective would take several. These bookkeeping messages are not counted as traffic. Each
        pair of ranks posts its two messages in the same order (lower rank sends first), so the
        exchange cannot deadlock even where sends block until matched."""
        own = torch.tensor(mine, dtype=torch.int64, device=device)
        theirs, pending = {}, []
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            theirs[peer] = torch.empty_like(own)
            send_first = self.rank < peer
            if send_first:
                pending.append(self._post_send(own, peer, HEADER_TAG))
            pending.append(self._post_recv(theirs[peer], peer, HEADER_TAG))
            if not send_first:
                pending.append(self._post_send(own, peer, HEADER_TAG))
        for p in pending:
            p.wait()
        return [list(mine) if r == self.rank else theirs[r].tolist() for r in range(self.world_size)]

    def now(self) -> float:
        return time.perf_counter()

    def scratch(self, numel: int, like: torch.Tensor, slot: int) -> torch.Tensor:
        """A receive buffer of `numel` elements, kept between calls: fresh memory costs a page fault
        per 4 KiB on first touch, which would double the time of a large reduce-scatter."""
        key = (like.dtype, like.device, slot)
        buffer = self._scratch.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._scratch[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buffer[:numel]

    def send(self, tensor: torch.Tensor, dst: int, step: int, phase: str, chunk: int | None = None) -> None:
        """Blocking send of a whole tensor, recorded as one transfer."""
        start = self.now()
        self.isend(tensor, dst, 0).wait()
        self.record(Transfer(step, phase, self.rank, dst, chunk, tensor.numel() * tensor.element_size(),
                             start, self.now()))

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        """Blocking receive into `tensor`."""
        self.irecv(tensor, src, 0).wait()

    def record(self, event: Transfer) -> None:
        if self.events is not None:
            self.events.append(event)

    def global_ranks(self) -> list[int]:
        """The global rank of each of this transport's ranks, in rank order: what error messages name."""
        return list(range(self.world_size))

    @property
    def right(self) -> int:
        return (self.rank + 1) % self.world_size

    @property
    def left(self) -> int:
        return (self.rank - 1) % self.world_size

    def check_same_tensors(self, tensor: torch.Tensor, name: str) -> None:
        """Raise on every rank if the ranks passed tensors of different dtype or shape to `name`."""
        theirs = self.signatures(signature(tensor), tensor.device)
        check_gathered([describe_signature(s) for s in theirs], name, "tensors",
                       "Every rank must pass a tensor of the same dtype and shape.", self.global_ranks())


def flat_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view of `tensor` to work in place, or a copy if it is not contiguous (see `write_back`).
    Detached, like the data torch.distributed works on: parameters that require grad work too."""
    data = tensor.detach()
    return data.view(-1) if data.is_contiguous() else data.reshape(-1).clone()


def write_back(tensor: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """Finish an in-place collective: copy `flat` into `tensor` unless it already is its memory."""
    if not (tensor.is_contiguous() and flat.data_ptr() == tensor.data_ptr()):
        tensor.detach().copy_(flat.view(tensor.shape))
    return tensor


def check_rank(transport: Transport, rank: int, name: str) -> None:
    """ValueError unless `rank` is one of the transport's ranks: a group rank, 0 .. world_size - 1."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < transport.world_size:
        raise ValueError(f"{name} must be a rank between 0 and {transport.world_size - 1} (its number in group=, "
                         f"not its global rank), got {rank!r}.")


def dtype_index(dtype: torch.dtype) -> int:
    if dtype not in DTYPES:
        raise ValueError(f"labkit.comm does not handle {dtype}; use one of "
                         f"{', '.join(str(d).removeprefix('torch.') for d in DTYPES)}.")
    return DTYPES.index(dtype)


def signature(tensor: torch.Tensor) -> list[int]:
    """[dtype index, ndim, shape padded to 8 dims with -1]: what must agree across ranks."""
    shape = list(tensor.shape)
    if len(shape) > MAX_DIMS:
        shape = [tensor.numel()]  # compare the element count only
    return [dtype_index(tensor.dtype), len(shape), *shape, *[-1] * (MAX_DIMS - len(shape))]


def describe_signature(sig: list[int]) -> str:
    dtype = str(DTYPES[sig[0]]).removeprefix("torch.")
    return f"{dtype}{list(sig[2:2 + sig[1]])}"


class TorchTransport(Transport):
    """Point-to-point over a torch.distributed process group (gloo or NCCL): `group` (None: the whole world).

    `group` is the group as given (None: the world), for torch's own collectives beside the transport's;
    `rank` and `world_size` are the group's, and the peers of `isend`, `irecv` and the collectives built
    on them are group ranks (0 .. world_size-1); the transport hands torch what it wants for each call.

    Each tensor travels as `carriage` says for its dtype and device. Single sends and receives go
    straight to the ProcessGroup object (dist.isend's Python wrapper costs about 0.1 ms a call here,
    more than a small message takes on the wire). A ring step's send and receive go out as one
    dist.batch_isend_irecv where `batched` (default: on NCCL only), else as a pair.

    `batched`: None to decide per backend, True or False to force one path (both work on gloo)."""

    def __init__(self, group=None, batched: bool | None = None):
        import torch.distributed as dist

        require_member("labkit.comm", group)
        super().__init__()
        self.group = group
        self._group = dist.group.WORLD if group is None else group  # the ProcessGroup: its ranks are group ranks
        self.rank, self.world_size = group_rank(group), group_size(group)
        self._global_ranks = group_ranks(group)
        self.backend_config = dist.get_backend_config(self._group)
        self.batched = batched
        self._carriages: dict[tuple, Carriage] = {}
        self._batch: Batch | None = None  # collecting inside batch()

    def global_ranks(self) -> list[int]:
        return list(self._global_ranks)

    def carriage(self, tensor: torch.Tensor) -> Carriage:
        """How `tensor` travels in this group (looked up once per dtype and device type)."""
        key = (tensor.dtype, tensor.device.type)
        if key not in self._carriages:
            self._carriages[key] = carriage(tensor.dtype, tensor.device.type, self.backend_config, self.batched)
        return self._carriages[key]

    def _post_send(self, tensor: torch.Tensor, dst: int, tag: int) -> Pending:
        how = self.carriage(tensor)
        if how.via_host:
            staged = tensor.cpu()  # waits for the device to finish writing `tensor`
            return _Staged(self._post(on_the_wire(staged, how.wire_dtype), dst, tag, send=True), staged)
        return self._post(on_the_wire(tensor, how.wire_dtype), dst, tag, send=True)

    def _post_recv(self, tensor: torch.Tensor, src: int, tag: int) -> Pending:
        how = self.carriage(tensor)
        if how.via_host:
            landing = torch.empty_like(tensor, device="cpu")
            return _Staged(self._post(on_the_wire(landing, how.wire_dtype), src, tag, send=False), landing, tensor)
        return self._post(on_the_wire(tensor, how.wire_dtype), src, tag, send=False)

    def _post(self, wire: torch.Tensor, peer: int, tag: int, send: bool) -> Pending:
        """Post now, or add to the batch that batch() is collecting. `peer` is a group rank, as the ProcessGroup
        object takes it (dist.send would want a global one) and P2POp's `group_peer`."""
        if self._batch is None:
            return self._group.send([wire], peer, tag) if send else self._group.recv([wire], peer, tag)
        import torch.distributed as dist

        op = dist.isend if send else dist.irecv
        self._batch.ops.append(dist.P2POp(op, wire, group=self._group, tag=tag, group_peer=peer))
        return self._batch

    @contextmanager
    def batch(self) -> Iterator[Batch]:
        """Post every `isend` and `irecv` made inside the block as one dist.batch_isend_irecv, when it ends.

        On NCCL the operations of one batch progress together (NCCL user guide, "Point-to-point
        communication"): a stage that sends forward and receives from behind in one batch cannot deadlock
        on a single stream, where two separate calls can. Each call inside the block returns a request
        that waits for the whole batch; wait on them after the block, not inside it. Blocks do not nest."""
        if self._batch is not None:
            raise RuntimeError("transport.batch() blocks do not nest: post the inner operations in the outer "
                               "block.")
        batch = self._batch = Batch()
        try:
            yield batch
        finally:
            self._batch = None
        batch.post()

    def exchange(self, send: torch.Tensor, dst: int, receive: torch.Tensor, src: int,
                 tag: int) -> tuple[Pending, Pending]:
        """One ring step's send and receive; as one dist.batch_isend_irecv where carriage says so."""
        if not (self.carriage(send).batched and self.carriage(receive).batched):
            return super().exchange(send, dst, receive, src, tag)
        with self.batch():
            pending = (self.isend(send, dst, tag), self.irecv(receive, src, tag))
        return pending


class Batch:
    """The operations of one dist.batch_isend_irecv (collected by `TorchTransport.batch()`) and its requests:
    on NCCL one request for the whole batch, on gloo one per operation. Waiting for any operation of the
    batch waits for all of them."""

    def __init__(self):
        self.ops: list = []
        self.works: list = []
        self.posted = False
        self.done = False

    def post(self) -> None:
        """Hand the collected operations to dist.batch_isend_irecv (nothing to post: nothing to wait for)."""
        import torch.distributed as dist

        self.works = dist.batch_isend_irecv(self.ops) if self.ops else []
        self.posted = True

    def wait(self) -> None:
        if not self.posted:
            raise RuntimeError("wait() inside a transport.batch() block: the batch is posted when the block "
                               "ends; wait for its requests after it.")
        if not self.done:
            for work in self.works:
                work.wait()
            self.done = True


class _Staged:
    """A send or receive through host memory: the host tensor must outlive the request, and a receive
    copies into its device tensor once it has arrived."""

    def __init__(self, work: Pending, keep: torch.Tensor, into: torch.Tensor | None = None):
        self.work, self.keep, self.into = work, keep, into

    def wait(self) -> None:
        self.work.wait()
        if self.into is not None:
            self.into.copy_(self.keep)
            self.into = None


_transports: dict = {}  # group (None: the world) -> its TorchTransport, while the world below lasts
_world = None


def default_transport(group=None) -> TorchTransport:
    """This rank's transport of `group` (None: the whole world), made once per group and kept, with its
    receive buffers, until the world's process group is replaced."""
    global _world
    import torch.distributed as dist

    require_member("labkit.comm", group)
    if dist.group.WORLD is not _world:
        _transports.clear()
        _world = dist.group.WORLD
    if group not in _transports:
        _transports[group] = TorchTransport(group)
    return _transports[group]


def resolve_transport(transport: Transport | None, group, caller: str) -> Transport:
    """What a collective runs on: `transport` if one is given (a simulated rank, a forced carriage), else
    this rank's transport of `group`. Both at once is an error: a transport already has its group."""
    if transport is None:
        require_member(caller, group)
        return default_transport(group)
    if group is not None:
        raise ValueError(f"{caller}: pass group= or transport=, not both (a transport has its group: "
                         "TorchTransport(group=...)).")
    return transport


@contextmanager
def traced(transport: Transport | None = None, *, group=None):
    """Record every transfer labkit.comm's collectives make on this rank inside the block: those on `group`
    (None: the whole world), or on `transport`. Sources and destinations are group ranks, like the algorithm's.

    >>> import labkit, torch
    >>> from labkit import comm
    >>> def first_transfer():
    ...     with comm.traced() as events:
    ...         comm.ring_allreduce(torch.ones(4))
    ...     return events[0].key()    # (step, phase, src, dst, chunk, nbytes): rank r starts with chunk r-1
    >>> labkit.run(first_transfer, world_size=2)
    [(0, 'reduce-scatter', 0, 1, 1, 8), (0, 'reduce-scatter', 1, 0, 0, 8)]
    """
    transport = resolve_transport(transport, group, "traced")
    previous, transport.events = transport.events, []
    try:
        yield transport.events
    finally:
        transport.events = previous
