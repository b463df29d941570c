"""The pipeline executor: one stage per rank of a process group, activations forward and gradients back between
neighbouring stages over point-to-point messages, as `communication_plan` says, each action timed.

    run_pipeline(model, "1f1b", 8, x, y, loss_fn, group=None)   one training step, called on every rank of group
    stage_layers(len(model), stages)                             which layers each stage holds

Stage r is the rank r of `group` (its group rank), and messages name stages: the group's transport
(labkit.comm.default_transport(group)) hands them to torch as group ranks. So several pipelines run side by side on
disjoint groups of one world (the `pp` axis of a mesh).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import labkit
from labkit import groups, measure
from labkit.checks import flag, number, whole
from labkit.comm.torch_transport import TorchTransport, default_transport
from labkit.comm.transport import Pending
from labkit.comm.wire import DTYPES, MAX_DIMS, signature
from labkit.parallel.counters import record_collective
from labkit.parallel.pipeline.schedule import Action, Message, communication_plan
from labkit.parallel.pipeline.timeline import PipelineEvent
from labkit.plan.counts import shard_sizes

__all__ = ["PipelineResult", "StageLink", "run_pipeline", "stage_layers"]


def stage_layers(layers: int, stages: int) -> list[range]:
    """Which layers of an nn.Sequential each stage holds: consecutive, balanced by layer count (a parameter-
    free layer such as ReLU counts as one), the first stages one more when the count does not divide.

    >>> stage_layers(5, 2)
    [range(0, 3), range(3, 5)]
    """
    layers, stages = whole("layers", layers), whole("stages", stages)
    if layers < stages:
        raise ValueError(f"a model of {layers} layer(s) cannot make {stages} stages: each stage needs a layer.")
    sizes = shard_sizes(layers, stages)
    return [range(end - size, end) for size, end in zip(sizes, itertools.accumulate(sizes), strict=True)]


@dataclass
class PipelineResult:
    """What run_pipeline returns on each rank: its `stage` (its rank in the pipeline's group), the model's
    `layers` it ran, its `events` (PipelineEvents timed from a barrier at the start), `peak_in_flight` (most
    micro-batches whose activations it held awaiting their backward), and on the last stage `loss` (the full
    batch's mean)."""
    stage: int
    layers: range
    events: list[PipelineEvent]
    peak_in_flight: int
    loss: float | None


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


def run_pipeline(model: nn.Sequential, schedule_kind: str, microbatches: int, inputs: torch.Tensor,
                 targets: torch.Tensor, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 emulate_compute_seconds: float | tuple[float, float] = 0.0,
                 batched: bool | None = None, group=None) -> PipelineResult:
    """One pipelined forward and backward of `model` on this rank's stage; call it on every rank of `group`.

    The stages are `group`'s ranks (None: the whole world), p of them; stage r (group rank r) runs layers
    `stage_layers(len(model), p)[r]` of `model` (the same full model on every rank: only this stage's layers
    run and get gradients). They are moved to labkit.device() (in place, as Module.to does), and every tensor
    crosses there: under NCCL each stage talks NCCL, even one without parameters. The batch (`inputs`,
    `targets`, dim 0; only the first stage reads inputs, only the last targets) is cut into `microbatches`
    with tensor_split. Activations go forward and their gradients back between neighbours in the groups of
    `communication_plan`: each group one dist.batch_isend_irecv where `batched` (None: on NCCL only, which
    needs it to not hang), else paired isend/irecv (gloo). Activations must keep the micro-batch in dim 0 and
    the same other dims (the first one's dtype and shape travel ahead in a small header). `loss_fn(output,
    target)` must average over its micro-batch: micro-batch i's loss is scaled by n_i / n, so the gradients
    accumulated into `.grad` (not zeroed here) are the full batch's mean loss's. count_collectives() counts
    every activation and gradient sent as a "send" (the header aside).

    Timing: an action starts once its input has arrived and ends when its compute is done, both read on the
    host clock after labkit.measure.synchronize(labkit.device()), so on a GPU the bars are the kernels' run,
    not their launch (the synchronisation serialises host and GPU at each action: a measuring executor).

    `emulate_compute_seconds` (a number, or (forward, backward)): EMULATION. Each action lasts at least
    this long: its real compute, then a sleep for the rest. On a 2-core laptop, where 4 ranks' real compute
    would fight for the cores, sleeping stages (time.sleep frees the CPU) overlap as a GPU cluster's would.
    A process's one-off first-call costs are paid before the clock starts, so even the first call's actions
    last what was asked.

    Example::

        >>> import labkit, torch.nn.functional as F
        >>> from labkit.models import make_classification, mlp
        >>> from labkit.parallel import run_pipeline
        >>> def step():
        ...     x, y = make_classification(32)
        ...     result = run_pipeline(mlp(), "1f1b", 4, x, y, F.cross_entropy)  # mlp(): 5 layers, seeded
        ...     return result.layers, result.peak_in_flight, result.loss
        >>> labkit.run(step, world_size=4)       # the loss: F.cross_entropy(mlp()(x), y), 1.38673...
        [(range(0, 2), 4, None), (range(2, 3), 3, None), (range(3, 4), 2, None), (range(4, 5), 1, 1.386732...)]
    """
    groups.require_member("run_pipeline", group)
    _check_same_plan(model, schedule_kind, microbatches, group)
    m = _checked_step(model, microbatches, inputs, targets)
    emulated = _emulated(emulate_compute_seconds)
    stage, stages = groups.group_rank(group), groups.group_size(group)
    plan = communication_plan(schedule_kind, stages, m)[stage]
    layers = stage_layers(len(model), stages)[stage]
    device = labkit.device()
    run = _StageRun(model[layers.start:layers.stop].to(device), stage, stages, device,
                    _MicroBatches(inputs.tensor_split(m), targets.tensor_split(m), len(inputs), loss_fn), emulated)
    transport = default_transport(group)
    link = StageLink(transport, _batched(batched, transport, device))
    run.start_clock(link)
    for step in plan:
        if isinstance(step, Action):
            run.act(step)
        else:
            run.post(step, link)
    return run.finish(layers)


def _check_same_plan(model, schedule_kind, microbatches, group) -> None:
    """ValueError on every stage unless all passed the same schedule kind, number of micro-batches and number of
    layers: from these each stage plans its messages, and stages with different plans wait for messages that
    never come, until the group's timeout. Checked as given, before any of them is checked on its own: a value
    refused on one stage only would leave the others waiting too."""
    layers = len(model) if isinstance(model, nn.Sequential) else type(model).__name__
    groups.check_same((schedule_kind, microbatches, layers), "run_pipeline",
                      "(schedule_kind, microbatches, layers of the model)",
                      "Pass the same schedule, number of micro-batches and model on every stage.", group)


def _checked_step(model, microbatches, inputs: torch.Tensor, targets: torch.Tensor) -> int:
    """The number of micro-batches, once the model is an nn.Sequential and the batch has one example per
    target and at least one per micro-batch."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"run_pipeline cuts an nn.Sequential into stages, got {type(model).__name__}.")
    m = whole("microbatches", microbatches)
    if len(inputs) != len(targets) or len(inputs) < m:
        raise ValueError(f"run_pipeline: {len(inputs)} inputs and {len(targets)} targets: need the same number, at "
                         f"least one per micro-batch ({m}).")
    return m


def _emulated(seconds: float | tuple[float, float]) -> dict[str, float]:
    """The emulated seconds of a forward ("F") and a backward ("B"): one number for both, or (forward, backward)."""
    pair = seconds if isinstance(seconds, tuple) else (seconds, seconds)
    forward, backward = (number("emulate_compute_seconds", s) for s in pair)
    return {"F": forward, "B": backward}


def _batched(batched: bool | None, transport: TorchTransport, device: torch.device) -> bool:
    """Whether each group of messages goes out as one batch: as asked, or (None) where the group's backend for
    `device` is NCCL."""
    if batched is None:
        return transport.carriage(torch.empty(0, device=device)).backend == "nccl"
    return flag("batched", batched)


@dataclass(frozen=True)
class _MicroBatches:
    """The step's batch cut into micro-batches (`inputs[i]`, `targets[i]`), the whole batch's `examples`, and the
    loss function, which averages over one micro-batch."""
    inputs: tuple[torch.Tensor, ...]
    targets: tuple[torch.Tensor, ...]
    examples: int
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _StageRun:
    """One stage through one run_pipeline step: its layers, the tensors waiting between its actions (inputs kept
    for their backward, outputs to send, buffers being received), the requests it posted, and what it measured.
    The step is `start_clock`, then `post` and `act` in communication_plan's order, then `finish`."""

    def __init__(self, module: nn.Module, stage: int, stages: int, device: torch.device, batch: _MicroBatches,
                 emulated: dict[str, float]):
        self.module, self.stage, self.device, self.batch, self.emulated = module, stage, device, batch, emulated
        self.first, self.last = stage == 0, stage == stages - 1
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # micro-batch -> (stage input, output or loss)
        self.outgoing: dict[tuple[str, int], torch.Tensor] = {}  # (what, micro-batch) -> tensor to send
        self.arriving: dict[tuple[str, int], tuple[torch.Tensor, Pending]] = {}  # ... -> (buffer, its receive)
        self.sends: list[Pending] = []
        self.events: list[PipelineEvent] = []
        self.peak, self.loss, self.t0 = 0, 0.0, 0.0
        self.first_output: torch.Tensor | None = None  # this stage's output for micro-batch 0: the others match it
        self.received: torch.Tensor | None = None  # shaped as the first activation received (dim 0 aside)

    def start_clock(self, link: StageLink) -> None:
        """Pay the process's one-off first-backward costs, then start every stage's clock together."""
        _warm_up(self.device)
        link.barrier()
        self.t0 = _synchronized_now(self.device)

    # --- messages ---

    def post(self, messages: tuple[Message, ...], link: StageLink) -> None:
        """Post one group of messages together; keep each receive's buffer and request for the action that
        needs it, and each send's request until the end of the step."""
        group = [(message, self._tensor_for(message, link.transport.group)) for message in messages]
        for (message, tensor), request in zip(group, link.post(group), strict=True):
            if message.op == "recv":
                self.arriving[(message.what, message.microbatch)] = (tensor, request)
            else:
                self.sends.append(request)

    def _tensor_for(self, message: Message, group) -> torch.Tensor:
        """A send's payload (counted on `group`, the pipeline's), or an empty buffer of the size a receive's
        message will have."""
        if message.op == "send":
            return _payload(self.outgoing.pop((message.what, message.microbatch)), message, group)
        if message.what == "header":
            return torch.empty(2 + MAX_DIMS, dtype=torch.int64, device=self.device)
        if message.what == "gradient":
            return torch.empty_like(self.saved[message.microbatch][1])
        return self._activation_buffer(message.microbatch)

    def _activation_buffer(self, i: int) -> torch.Tensor:
        """Where activation i lands: the first activation's dtype and dims (read from the header, waited for
        once), with micro-batch i's size in dim 0."""
        if self.received is None:
            dtype, ndim, *shape = _wait(*self.arriving.pop(("header", 0))).tolist()
            self.received = torch.empty(shape[:ndim], dtype=DTYPES[dtype], device=self.device)
        return self.received.new_empty((len(self.batch.inputs[i]), *self.received.shape[1:]))

    # --- actions ---

    def act(self, action: Action) -> None:
        """Run one action, timed from when its input is here to when its compute (and emulated rest) is done."""
        start = self._forward(action.microbatch) if action.kind == "F" else self._backward(action.microbatch)
        measure.synchronize(self.device)
        _pad(start, self.emulated[action.kind])
        end = time.perf_counter()
        self.events.append(PipelineEvent(self.stage, action.kind, action.microbatch, start - self.t0, end - self.t0))
        self.peak = max(self.peak, len(self.saved))

    def _forward(self, i: int) -> float:
        """Micro-batch i through this stage's layers (and the loss, on the last); returns when it started."""
        x = self.batch.inputs[i].to(self.device) if self.first else \
            _wait(*self.arriving.pop(("activation", i))).requires_grad_()
        start = _synchronized_now(self.device)
        y = self.module(x)
        if self.last:
            share = len(self.batch.inputs[i]) / self.batch.examples  # the full batch's mean from micro-batch means
            y = self.batch.loss_fn(y, self.batch.targets[i].to(self.device)) * share
            self.loss += y.item()
        else:
            self._hand_on(y, i)
        self.saved[i] = (x, y)
        return start

    def _hand_on(self, y: torch.Tensor, i: int) -> None:
        """Queue activation i for the next stage, and with the first, the header that sizes its buffers."""
        self.first_output = y if i == 0 else self.first_output
        _check_activation(y, self.first_output, i, len(self.batch.inputs[i]), self.stage)
        self.outgoing[("activation", i)] = y
        if i == 0:
            self.outgoing[("header", 0)] = torch.tensor(_header(y), device=self.device)

    def _backward(self, i: int) -> float:
        """Micro-batch i's gradient back through this stage's layers; returns when it started."""
        x, y = self.saved.pop(i)
        grad = None if self.last else _wait(*self.arriving.pop(("gradient", i)))
        start = _synchronized_now(self.device)
        if y.requires_grad:  # a first stage of parameter-free layers has nothing to differentiate
            y.backward(grad)
        if not self.first:
            self.outgoing[("gradient", i)] = x.grad
        return start

    def finish(self, layers: range) -> PipelineResult:
        """Wait for this stage's sends, then report."""
        for request in self.sends:
            request.wait()
        return PipelineResult(self.stage, layers, self.events, self.peak, self.loss if self.last else None)


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
