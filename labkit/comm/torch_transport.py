"""`TorchTransport`: labkit.comm's transport over torch.distributed point-to-point (gloo or NCCL), and the one
each collective runs on.

    TorchTransport(group=None, batched=None)   sends and receives between the ranks of a process group
    default_transport(group=None)              this rank's TorchTransport of `group`, made once and kept
    resolve_transport(transport, group, name)  what a collective runs on: the transport given, or the default

Its own module, apart from the `Transport` interface (labkit.comm.transport): the algorithms (ring, tree, naive)
run on any Transport, the simulator's in-memory one too, and no other file of labkit.comm calls torch.distributed.
Everything that does is here: process groups and their ranks, NCCL's batching, staging through host memory, the
transport kept per group. So this file is the one place where labkit.comm reaches the network: the one to read
for how it does, and the one that labkit.exercises' guard switches off while a student's collective is graded.

Peers are group ranks throughout, and go to torch as group ranks: the ProcessGroup object's send and recv number
peers inside their group, and dist.P2POp takes `group_peer`. (torch.distributed's functions take either kind in
torch 2.13: a global rank as `dst`/`src`/`peer`, a group rank as `group_dst`/`group_src`/`group_peer`.)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from labkit.comm.transport import Pending, Transport
from labkit.comm.wire import Carriage, carriage, on_the_wire
from labkit.groups import group_rank, group_ranks, group_size, require_member

__all__ = ["Batch", "TorchTransport", "default_transport", "resolve_transport"]


class TorchTransport(Transport):
    """Point-to-point over a torch.distributed process group (gloo or NCCL): `group` (None: the whole world).

    `group` is the group as given (None: the world), for torch's own collectives beside the transport's;
    `rank` and `world_size` are the group's, and the peers of `isend`, `irecv` and the collectives built
    on them are group ranks (0 .. world_size-1), handed to torch as group ranks (see the module's docstring).

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
        object takes it, and as P2POp's `group_peer` (dist.send would take it as `group_dst`; its `dst` is global)."""
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
        """Wait for every operation of the batch (once posted; the second call returns at once)."""
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
