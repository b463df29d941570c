"""One stage's side of a pipelined step (what run_pipeline runs on each rank): its chunks' layers, the tensors
waiting between its actions, the messages it posts, and the timings it measures.

Stage r of p holds v chunks (v = 1 but for the interleaved schedule); chunk c is piece c p + r of the model's v p
pieces. A forward takes the previous piece's output (stage r - 1's same chunk; on stage 0, the last stage's
chunk c - 1), a backward the next piece's input gradient. With one stage, a chunk hands on to the next in place.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from labkit import measure
from labkit.comm.torch_transport import TorchTransport
from labkit.comm.transport import Pending
from labkit.comm.wire import DTYPES, MAX_DIMS, signature
from labkit.parallel.counters import record_collective
from labkit.parallel.pipeline.schedule import Action, Message
from labkit.parallel.pipeline.split_backward import backward_input, backward_weight, split_forward
from labkit.parallel.pipeline.timeline import PipelineEvent

__all__ = ["MicroBatches", "StageLink", "StageRun"]


class StageLink:
    """How a stage posts a group of Messages to its neighbours: as one dist.batch_isend_irecv (`batched`, through
    `transport.batch()`), or each operation in turn, as a gloo isend or irecv. Both work on gloo; NCCL needs
    the batch (see communication_plan). A Message's `peer` is a stage: a rank of the transport's group, as the
    transport takes (and hands torch) its peers."""

    def __init__(self, transport: TorchTransport, batched: bool):
        self.transport, self.batched = transport, batched

    def barrier(self) -> None:
        """Wait until every stage of the group is here (the timeline's common start)."""
        dist.barrier(group=self.transport.group)

    def post(self, messages: list[tuple[Message, torch.Tensor]]) -> list[Pending]:
        """Post every message (with its tensor) together; one request per message, to wait on."""
        if not self.batched:
            return [self._one(message, tensor) for message, tensor in messages]
        with self.transport.batch():
            pending = [self._one(message, tensor) for message, tensor in messages]
        return pending

    def _one(self, message: Message, tensor: torch.Tensor) -> Pending:
        if message.op == "send":
            return self.transport.isend(tensor, message.peer, message.tag)
        return self.transport.irecv(tensor, message.peer, message.tag)


@dataclass(frozen=True)
class MicroBatches:
    """The step's batch cut into micro-batches (`inputs[i]`, `targets[i]`), the whole batch's `examples`, and the
    loss function, which averages over one micro-batch."""
    inputs: tuple[torch.Tensor, ...]
    targets: tuple[torch.Tensor, ...]
    examples: int
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class _Place:
    """Where a stage sits in the model: stage `stage` of `stages`, with `chunks` chunks."""
    stage: int
    stages: int
    chunks: int

    def first(self, chunk: int) -> bool:
        """Whether this chunk is the model's first piece (it reads the batch)."""
        return self.stage == 0 and chunk == 0

    def last(self, chunk: int) -> bool:
        """Whether this chunk is the model's last piece (it computes the loss)."""
        return self.stage == self.stages - 1 and chunk == self.chunks - 1

    def downstream(self, chunk: int) -> int:
        """The label (Message.chunk) of what goes between this chunk and the next piece: the next piece's chunk."""
        return chunk + (self.stage == self.stages - 1)


class StageRun:
    """One stage through one run_pipeline step: its chunks' modules, the tensors waiting between its actions
    (inputs kept for their backward, outputs to send or hand on, buffers being received), the requests it
    posted, and what it measured. The step is `start_clock`, then `post` and `act` in communication_plan's
    order, then `finish`. Tensors in flight are keyed (what, chunk label, micro-batch), as Messages name them;
    those kept for a backward (chunk, micro-batch). With `split_backward` (the zero-bubble schedules) a backward
    is two actions, B and W (split_backward.py), and what a forward kept waits for the W."""

    def __init__(self, modules: list[nn.Module], place: tuple[int, int, int], device: torch.device,
                 batch: MicroBatches, emulated: dict[str, float], split_backward: bool = False):
        self.modules, self.device, self.batch, self.split = modules, device, batch, split_backward
        self.place = _Place(*place)
        self.emulated = {kind: seconds / self.place.chunks for kind, seconds in emulated.items()}  # per chunk
        self.saved: dict[tuple[int, int], tuple] = {}  # -> (input, output or loss, LayerPieces where split)
        self.outgoing: dict[tuple[str, int, int], torch.Tensor] = {}  # tensors to send, or to hand on in place
        self.arriving: dict[tuple[str, int, int], tuple[torch.Tensor, Pending]] = {}  # -> (buffer, its receive)
        self.sends: list[Pending] = []
        self.events: list[PipelineEvent] = []
        self.peak, self.loss, self.t0 = 0, 0.0, 0.0
        self.first_output: dict[int, torch.Tensor] = {}  # label -> output for micro-batch 0: the others match it
        self.received: dict[int, torch.Tensor] = {}  # label -> shaped as the first activation received (dim 0 aside)

    def start_clock(self, link: StageLink) -> None:
        """Pay the process's one-off first-backward costs, then start every stage's clock together."""
        _warm_up(self.device)
        link.barrier()
        self.t0 = _synchronized_now(self.device)

    # --- messages ---

    def post(self, messages: tuple[Message, ...], link: StageLink) -> None:
        """Post one group of messages together through `link`; keep each receive's buffer and
        request for the action that needs it, and each send's request until the end of the step."""
        group = [(message, self._tensor_for(message, link.transport.group)) for message in messages]
        for (message, tensor), request in zip(group, link.post(group), strict=True):
            if message.op == "recv":
                self.arriving[(message.what, message.chunk, message.microbatch)] = (tensor, request)
            else:
                self.sends.append(request)

    def _tensor_for(self, message: Message, group) -> torch.Tensor:
        """A send's payload (counted on `group`, the pipeline's), or an empty buffer of the size a receive's
        message will have."""
        if message.op == "send":
            return _payload(self.outgoing.pop((message.what, message.chunk, message.microbatch)), message, group)
        if message.what == "header":
            return torch.empty(2 + MAX_DIMS, dtype=torch.int64, device=self.device)
        if message.what == "gradient":  # for this stage's output, sent from its chunk message.chunk - 1 if last
            chunk = message.chunk - (self.place.stage == self.place.stages - 1)
            return torch.empty_like(self.saved[(chunk, message.microbatch)][1])
        return self._activation_buffer(message.chunk, message.microbatch)

    def _activation_buffer(self, chunk: int, i: int) -> torch.Tensor:
        """Where activation i of `chunk` lands: that chunk's first activation's dtype and dims (read from its
        header, waited for once), with micro-batch i's size in dim 0."""
        if chunk not in self.received:
            dtype, ndim, *shape = _wait(*self.arriving.pop(("header", chunk, 0))).tolist()
            self.received[chunk] = torch.empty(shape[:ndim], dtype=DTYPES[dtype], device=self.device)
        like = self.received[chunk]
        return like.new_empty((len(self.batch.inputs[i]), *like.shape[1:]))

    def _take(self, what: str, label: int, i: int) -> torch.Tensor:
        """A received tensor once it has arrived, or (one stage) what this stage's other chunk handed on."""
        key = (what, label, i)
        if key in self.arriving:
            return _wait(*self.arriving.pop(key))
        return self.outgoing.pop(key).detach()

    # --- actions ---

    def act(self, action: Action) -> None:
        """Run one action, timed from when its input is here to when its compute (and emulated rest) is done."""
        i, c = action.microbatch, action.chunk
        run = {"F": self._forward, "B": self._backward_input if self.split else self._backward,
               "W": self._backward_weight}[action.kind]
        start = run(i, c)
        measure.synchronize(self.device)
        _pad(start, self.emulated[action.kind])
        end = time.perf_counter()
        self.events.append(PipelineEvent(self.place.stage, action.kind, i, start - self.t0, end - self.t0, c))
        self.peak = max(self.peak, len(self.saved))

    def _forward(self, i: int, c: int) -> float:
        """Micro-batch i through chunk c's layers (and the loss, after the last piece); returns when it started."""
        x = self.batch.inputs[i].to(self.device) if self.place.first(c) else \
            self._take("activation", c, i).requires_grad_()
        start = _synchronized_now(self.device)
        loss = self._loss_of(i) if self.place.last(c) else None
        if self.split:
            pieces = split_forward(self.modules[c], x, then=loss)
            y = pieces[-1].output
        else:
            pieces, y = None, self.modules[c](x)
            y = y if loss is None else loss(y)
        if loss is not None:
            self.loss += y.item()
        else:
            self._hand_on(y, c, i)
        self.saved[(c, i)] = (x, y, pieces)
        return start

    def _loss_of(self, i: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """Micro-batch i's loss from the model's output, scaled so that the micro-batches' sum is the batch's mean."""
        share = len(self.batch.inputs[i]) / self.batch.examples
        return lambda output: self.batch.loss_fn(output, self.batch.targets[i].to(self.device)) * share

    def _hand_on(self, y: torch.Tensor, c: int, i: int) -> None:
        """Queue chunk c's activation i for the next piece, and with the first, the header that sizes its buffers."""
        label = self.place.downstream(c)
        first = self.first_output.setdefault(label, y)
        _check_activation(y, first, i, len(self.batch.inputs[i]), self.place.stage)
        self.outgoing[("activation", label, i)] = y
        if i == 0 and self.place.stages > 1:
            self.outgoing[("header", label, 0)] = torch.tensor(_header(y), device=self.device)

    def _backward(self, i: int, c: int) -> float:
        """Micro-batch i's gradient back through chunk c's layers; returns when it started."""
        x, y, _ = self.saved.pop((c, i))
        grad = None if self.place.last(c) else self._take("gradient", self.place.downstream(c), i)
        start = _synchronized_now(self.device)
        if y.requires_grad:  # a first stage of parameter-free layers has nothing to differentiate
            y.backward(grad)
        if not self.place.first(c):
            self.outgoing[("gradient", c, i)] = x.grad
        return start

    def _backward_input(self, i: int, c: int) -> float:
        """B of a split backward: micro-batch i's input gradient through chunk c (split_backward.backward_input),
        its layers' weights left for W; returns when it started."""
        pieces = self.saved[(c, i)][2]
        grad = None if self.place.last(c) else self._take("gradient", self.place.downstream(c), i)
        start = _synchronized_now(self.device)
        grad_input = backward_input(pieces, grad)
        if not self.place.first(c):
            self.outgoing[("gradient", c, i)] = grad_input
        return start

    def _backward_weight(self, i: int, c: int) -> float:
        """W: micro-batch i's weight gradients of chunk c (split_backward.backward_weight), which frees what its
        forward kept; returns when it started."""
        pieces = self.saved.pop((c, i))[2]
        start = _synchronized_now(self.device)
        backward_weight(pieces)
        return start

    def finish(self) -> tuple[list[PipelineEvent], int, float | None]:
        """Wait for this stage's sends, then report its events, peak of activations held, and loss (last stage)."""
        for request in self.sends:
            request.wait()
        return self.events, self.peak, self.loss if self.place.last(self.place.chunks - 1) else None


def _header(tensor: torch.Tensor) -> list[int]:
    """The first activation's signature (dtype and shape), sent ahead so that the receiver can make its buffers;
    later activations keep that shape but for the micro-batch size, in dim 0."""
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"run_pipeline: activations of {tensor.dim()} dimensions; at most {MAX_DIMS} cross.")
    return signature(tensor)


def _payload(tensor: torch.Tensor, message: Message, group) -> torch.Tensor:
    """What a send puts on the wire, counted by count_collectives() as a "send" on `group` (the header aside)."""
    payload = tensor.detach().contiguous()
    if message.what != "header":
        record_collective("send", payload, group)
    return payload


def _wait(buffer: torch.Tensor, pending: Pending) -> torch.Tensor:
    """`buffer`, once the receive into it (`pending`) has completed."""
    pending.wait()
    return buffer


def _check_activation(y: torch.Tensor, y0: torch.Tensor, i: int, size: int, stage: int) -> None:
    """The receiver expects micro-batch i's activation to be micro-batch 0's but for dim 0, its size."""
    if y.shape[:1] != (size,) or y.shape[1:] != y0.shape[1:] or y.dtype != y0.dtype:
        raise ValueError(f"run_pipeline: stage {stage}'s output for micro-batch {i} ({size} examples) is {y.dtype} "
                         f"{tuple(y.shape)}: activations between stages must have the micro-batch in dim 0" +
                         (f", and micro-batch 0's other dims {tuple(y0.shape[1:])}, dtype {y0.dtype}." if i else "."))


def _synchronized_now(device: torch.device) -> float:
    """The host clock once `device` has run the work queued on it (labkit.measure.synchronize)."""
    measure.synchronize(device)
    return time.perf_counter()


def _warm_up(device: torch.device) -> None:
    """One tiny forward and backward with an explicit gradient, as a stage's backward is, before the clock starts.
    A process's first such backward imports what autograd needs (torch.fx's shape tools, sympy): seconds on a busy
    CPU, which would otherwise be counted inside its first emulated backward and drawn as a bar ten times too long."""
    weight = torch.ones(2, 2, device=device, requires_grad=True)
    output = torch.nn.functional.linear(torch.ones(1, 2, device=device), weight).relu()
    output.backward(torch.ones_like(output))


def _pad(start: float, seconds: float) -> None:
    """Sleep until `seconds` after `start` (emulated compute; nothing when the real compute took longer)."""
    left = start + seconds - time.perf_counter()
    if left > 0:
        time.sleep(left)
