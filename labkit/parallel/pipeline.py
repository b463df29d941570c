"""Pipeline parallelism by hand: consecutive layers on consecutive ranks (stages); the batch cut into
micro-batches that flow forward through the stages and whose gradients flow back, so stages work at once.

    schedule("1f1b", 4, 8)          each stage's ordered actions: Action("F", i), Action("B", i)
    communication_plan("1f1b", 4, 8) the same, with the messages each stage posts between its actions
    run_pipeline(model, "1f1b", 8, x, y, loss_fn)   one training step on real ranks (activations and
                                    gradients over point-to-point, as communication_plan says), timed
                                    action by action
    simulate_pipeline("1f1b", 4, 8) the same timeline from stage costs, without processes
    measured_bubble(events)         idle share of a timeline: 1 - busy / (makespan x stages)

GPipe (Huang et al. 2019): every forward, then every backward (in micro-batch order, as torch's
ScheduleGPipe does); m micro-batches of activations wait on each stage. 1F1B (PipeDream-Flush, Narayanan et
al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", section 2.2):
stage r runs min(p - r - 1, m) warm-up forwards, then one forward and one backward in turn, then the
remaining backwards; at most min(p - r, m) micro-batches wait. Both idle (p-1)/(m+p-1) of the time with equal
stage costs (labkit.plan.bubble_fraction). The orders match torch.distributed.pipelining's (tested).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import labkit
from labkit import measure
from labkit.checks import choice, number, whole
from labkit.comm.transport import DTYPES, MAX_DIMS, _Batch, default_transport, signature
from labkit.parallel.data import record_collective

KINDS = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Action:
    """One step of a stage's schedule: the forward ("F") or backward ("B") of micro-batch `microbatch`."""
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


@dataclass(frozen=True)
class PipelineEvent:
    """One action on a timeline, in seconds from the step's start: what run_pipeline measures and
    simulate_pipeline computes. An executor's `start` is when the stage had its input (after any receive)."""
    stage: int
    kind: str
    microbatch: int
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


def schedule(kind: str, stages: int, microbatches: int) -> list[list[Action]]:
    """Each stage's actions, in the order it runs them, for "gpipe" or "1f1b" (case ignored).

    >>> [" ".join(map(str, actions)) for actions in schedule("1f1b", 3, 4)]
    ['F0 F1 F2 B0 F3 B1 B2 B3', 'F0 F1 B0 F2 B1 F3 B2 B3', 'F0 B0 F1 B1 F2 B2 F3 B3']
    """
    kind = choice("kind", kind.lower() if isinstance(kind, str) else kind, KINDS)
    p, m = whole("stages", stages), whole("microbatches", microbatches)
    plan = []
    for r in range(p):
        warmup = m if kind == "gpipe" else min(p - r - 1, m)
        actions = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):  # steady state: one forward, one backward
            actions += [Action("F", warmup + i), Action("B", i)]
        actions += [Action("B", i) for i in range(m - warmup, m)]  # cool-down
        plan.append(actions)
    return plan


def peak_in_flight(actions: Sequence[Action]) -> int:
    """Most micro-batches whose forward has run and backward not yet, along one stage's actions."""
    waiting = peak = 0
    for action in actions:
        waiting += 1 if action.kind == "F" else -1
        peak = max(peak, waiting)
    return peak


def measured_bubble(events: Sequence[PipelineEvent]) -> float:
    """Idle share of a timeline: 1 - (sum of action times) / (makespan x stages), the definition behind
    (p-1)/(m+p-1). Pass every stage's events together."""
    if not events:
        raise ValueError("measured_bubble needs the events of at least one action.")
    stages = len({e.stage for e in events})
    makespan = max(e.end for e in events) - min(e.start for e in events)
    return 1.0 - sum(e.seconds for e in events) / (makespan * stages)


def _costs(name: str, value, stages: int) -> list[float]:
    values = list(value) if isinstance(value, Sequence) else [value] * stages
    if len(values) != stages:
        raise ValueError(f"{name}: give one number, or one per stage ({stages}), not {len(values)}.")
    return [number(name, v) for v in values]


def simulate_pipeline(kind: str, stages: int, microbatches: int, forward_seconds: float | Sequence[float] = 1.0,
                      backward_seconds: float | Sequence[float] = 2.0, send_seconds: float = 0.0,
                      ) -> list[PipelineEvent]:
    """The timeline of `schedule(kind, stages, microbatches)` when each stage's forward takes
    `forward_seconds` and backward `backward_seconds` (one number, or one per stage), and a transfer
    between neighbours `send_seconds`. Each action starts as soon as its stage is free, in the schedule's
    order, and its inputs are there: F(i) on stage r after F(i) on r-1, B(i) on r after B(i) on r+1 (and
    after F(i) on r, earlier in the order). Events come by stage, then time.

    >>> events = simulate_pipeline("gpipe", 4, 8, 1.0, 1.0)
    >>> max(e.end for e in events), round(measured_bubble(events), 4)   # (m+p-1)(F+B); 3/11
    (22.0, 0.2727)
    """
    plan = schedule(kind, stages, microbatches)
    p = len(plan)
    forward, backward = _costs("forward_seconds", forward_seconds, p), _costs("backward_seconds", backward_seconds, p)
    send = number("send_seconds", send_seconds)
    ends: dict[tuple[int, str, int], float] = {}
    free, nxt, events = [0.0] * p, [0] * p, []
    while any(nxt[r] < len(plan[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while nxt[r] < len(plan[r]):
                action = plan[r][nxt[r]]
                i = action.microbatch
                needs = [(r - 1, "F", i)] if action.kind == "F" and r > 0 else []
                needs += [(r + 1, "B", i)] if action.kind == "B" and r < p - 1 else []
                if any(need not in ends for need in needs):
                    break  # its input is not ready: another stage must go first
                start = max([free[r], *[ends[need] + send for need in needs]])
                end = start + (forward[r] if action.kind == "F" else backward[r])
                ends[(r, action.kind, i)] = free[r] = end
                events.append(PipelineEvent(r, action.kind, i, start, end))
                nxt[r] += 1
                progressed = True
        if not progressed:  # cannot happen for gpipe or 1f1b; a guard should a schedule ever deadlock
            raise RuntimeError(f"simulate_pipeline: no stage can go on; next actions {nxt} of {plan}.")
    return sorted(events, key=lambda e: (e.stage, e.start))


# --- The executor: one stage per rank, activations and gradients over point-to-point ---

def stage_layers(layers: int, stages: int) -> list[range]:
    """Which layers of an nn.Sequential each stage holds: consecutive, balanced by layer count (a parameter-
    free layer such as ReLU counts as one), the first stages one more when the count does not divide.

    >>> stage_layers(5, 2)
    [range(0, 3), range(3, 5)]
    """
    whole("stages", stages)
    if layers < stages:
        raise ValueError(f"a model of {layers} layer(s) cannot make {stages} stages: each stage needs a layer.")
    cuts = torch.arange(layers).tensor_split(stages)
    return [range(int(c[0]), int(c[-1]) + 1) for c in cuts]


@dataclass
class PipelineResult:
    """What run_pipeline returns on each rank: its `stage` (= rank), the model's `layers` it ran, its
    `events` (PipelineEvents timed from a barrier at the start), `peak_in_flight` (most micro-batches whose
    activations it held awaiting their backward), and on the last stage `loss` (the full batch's mean)."""
    stage: int
    layers: range
    events: list[PipelineEvent]
    peak_in_flight: int
    loss: float | None


@dataclass(frozen=True)
class Message:
    """One point-to-point operation of a stage: "send" to or "recv" from neighbour `peer` micro-batch
    `microbatch`'s "activation" (forward) or "gradient" (backward), or the "header" (the first activation's
    dtype and shape, so that the receiver can size its buffers)."""
    op: str
    what: str
    microbatch: int
    peer: int

    @property
    def tag(self) -> int:
        """0 for the header, 2i+1 for activation i, 2i+2 for its gradient (gloo matches by tag; NCCL ignores
        tags and matches each pair's operations in posting order, which communication_plan keeps equal)."""
        return 0 if self.what == "header" else 2 * self.microbatch + (1 if self.what == "activation" else 2)

    def __str__(self) -> str:
        return f"{self.op} {self.what[0]}{self.microbatch}"


def communication_plan(kind: str, stages: int, microbatches: int) -> list[list[Action | tuple[Message, ...]]]:
    """Each stage's schedule with its messages: actions, and between them groups of Messages posted together.

    After each action comes one group: its output's send and the next action's input's receive (torch's
    Schedule1F1B and Megatron's send_forward_recv_backward pair them the same way); the header, needed on
    the host before the first activation's buffer exists, travels alone. Why groups: under NCCL each rank
    runs its point-to-point operations in posting order on one stream (with `device_id`, eager init), and a
    send waits for its receive; a stage that posted "receive gradient i" before "send activation i", with its
    neighbour posting "receive activation i" first, would hang both. The operations of one group run
    together (NCCL user guide, "Group calls"; dist.batch_isend_irecv), so any order inside it is safe. No
    barrier sits between a posted receive and its send. tests/distributed/test_pipeline_parallel.py runs
    every group, as posted on real ranks, through that single-stream model.

    >>> def show(step):
    ...     return str(step) if isinstance(step, Action) else "[" + " ".join(map(str, step)) + "]"
    >>> [" ".join(map(show, steps)) for steps in communication_plan("1f1b", 2, 2)]  # a: activation, g: gradient
    ['F0 [send h0] [send a0] F1 [send a1 recv g0] B0 [recv g1] B1', '[recv h0] [recv a0] F0 B0 [send g0 recv a1] F1 B1 \
[send g1]']
    """
    plan = []
    for r, actions in enumerate(schedule(kind, stages, microbatches)):
        steps: list = [(Message("recv", "header", 0, r - 1),)] if r > 0 else []
        steps += [tuple(_messages(actions[0], "recv", r, stages))]
        for k, action in enumerate(actions):
            steps.append(action)
            if action == Action("F", 0) and r < stages - 1:
                steps.append((Message("send", "header", 0, r + 1),))
            after = _messages(action, "send", r, stages)
            steps.append(tuple(after + (_messages(actions[k + 1], "recv", r, stages) if k + 1 < len(actions) else [])))
        plan.append([step for step in steps if step != ()])
    return plan


def _messages(action: Action, op: str, stage: int, stages: int) -> list[Message]:
    """What `stage` must "recv" before `action` (its input), or "send" after it (its output): none at the ends."""
    forward = action.kind == "F"
    peer = stage + (1 if forward == (op == "send") else -1)
    if not 0 <= peer < stages:
        return []
    return [Message(op, "activation" if forward else "gradient", action.microbatch, peer)]


class _Link:
    """How a stage posts a group of Messages: as one dist.batch_isend_irecv (`batched`), or each operation in
    turn, as a gloo isend or irecv. Both work on gloo; NCCL needs the batch (see communication_plan)."""

    def __init__(self, transport, batched: bool):
        self.transport, self.batched = transport, batched

    def barrier(self) -> None:
        dist.barrier()

    def post(self, group: list[tuple[Message, torch.Tensor]]) -> list:
        """Post every message of `group` (with its tensor); one request per message, to wait on."""
        transport = self.transport
        if not self.batched:
            return [self._one(message, tensor) for message, tensor in group]
        batch = transport._batch = _Batch()  # TorchTransport collects the P2POps of one batch_isend_irecv here
        try:
            pending = [self._one(message, tensor) for message, tensor in group]
        finally:
            transport._batch = None
        batch.works = dist.batch_isend_irecv(batch.ops)
        return pending

    def _one(self, message: Message, tensor: torch.Tensor):
        if message.op == "send":
            return self.transport.isend(tensor, message.peer, message.tag)
        return self.transport.irecv(tensor, message.peer, message.tag)


def run_pipeline(model: nn.Sequential, schedule_kind: str, microbatches: int, inputs: torch.Tensor,
                 targets: torch.Tensor, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 emulate_compute_seconds: float | tuple[float, float] = 0.0,
                 batched: bool | None = None) -> PipelineResult:
    """One pipelined forward and backward of `model` on this rank's stage; call it on every rank.

    p = the world size; stage r runs layers `stage_layers(len(model), p)[r]` of `model` (the same full model
    on every rank: only this stage's layers run and get gradients). They are moved to labkit.device() (in
    place, as Module.to does), and every tensor crosses there: under NCCL each stage talks NCCL, even one
    without parameters. The batch (`inputs`, `targets`, dim 0; only the first stage reads inputs, only the
    last targets) is cut into `microbatches` with tensor_split. Activations go forward and their gradients
    back between neighbours in the groups of `communication_plan`: each group one dist.batch_isend_irecv
    where `batched` (None: on NCCL only, which needs it to not hang), else paired isend/irecv (gloo).
    Activations must keep the micro-batch in dim 0 and the same other dims (the first one's dtype and shape
    travel ahead in a small header). `loss_fn(output, target)` must average over its micro-batch:
    micro-batch i's loss is scaled by n_i / n, so the gradients accumulated into `.grad` (not zeroed here) are
    the full batch's mean loss's. count_collectives() counts every activation and gradient sent as a "send"
    (the header aside).

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
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"run_pipeline cuts an nn.Sequential into stages, got {type(model).__name__}.")
    rank, p = dist.get_rank(), dist.get_world_size()
    m = whole("microbatches", microbatches)
    if len(inputs) != len(targets) or len(inputs) < m:
        raise ValueError(f"run_pipeline: {len(inputs)} inputs and {len(targets)} targets: need the same number, at "
                         f"least one per micro-batch ({m}).")
    emulate = emulate_compute_seconds if isinstance(emulate_compute_seconds, tuple) else (emulate_compute_seconds,) * 2
    fwd_s, bwd_s = (number("emulate_compute_seconds", seconds) for seconds in emulate)
    layers = stage_layers(len(model), p)[rank]
    device = labkit.device()
    stage = model[layers.start:layers.stop].to(device)
    transport = default_transport()
    if batched is None:
        batched = transport.carriage(torch.empty(0, device=device)).backend == "nccl"
    link = _Link(transport, batched)
    xs, ts = inputs.tensor_split(m), targets.tensor_split(m)
    last = rank == p - 1
    saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # micro-batch -> (stage input, output or loss)
    outgoing: dict[tuple[str, int], torch.Tensor] = {}  # (what, micro-batch) -> tensor to send
    arriving: dict[tuple[str, int], tuple[torch.Tensor, object]] = {}  # (what, micro-batch) -> (buffer, request)
    sends, events, peak, loss = [], [], 0, 0.0
    y0 = like = None  # this stage's output for micro-batch 0; the first activation received (dim 0 aside)
    _warm_up(device)
    link.barrier()
    measure.synchronize(device)
    t0 = time.perf_counter()
    for step in communication_plan(schedule_kind, p, m)[rank]:
        if not isinstance(step, Action):  # a group of messages, posted together
            group = []
            for message in step:
                key = (message.what, message.microbatch)
                if message.op == "send":
                    group.append((message, _payload(outgoing.pop(key), message)))
                elif message.what == "header":
                    group.append((message, torch.empty(2 + MAX_DIMS, dtype=torch.int64, device=device)))
                elif message.what == "gradient":
                    group.append((message, torch.empty_like(saved[message.microbatch][1])))
                else:
                    if like is None:  # activation 0: its dtype and shape are in the header
                        dtype, ndim, *shape = _wait(*arriving.pop(("header", 0))).tolist()
                        like = torch.empty(shape[:ndim], dtype=DTYPES[dtype], device=device)
                    group.append((message, like.new_empty((len(xs[message.microbatch]), *like.shape[1:]))))
            for (message, tensor), request in zip(group, link.post(group), strict=True):
                if message.op == "recv":
                    arriving[(message.what, message.microbatch)] = (tensor, request)
                else:
                    sends.append(request)
            continue
        i = step.microbatch
        if step.kind == "F":
            x = xs[i].to(device) if rank == 0 else _wait(*arriving.pop(("activation", i))).requires_grad_()
            measure.synchronize(device)
            start = time.perf_counter()
            y = stage(x)
            if last:
                y = loss_fn(y, ts[i].to(device)) * (len(xs[i]) / len(inputs))
                loss += y.item()
            else:
                y0 = y if i == 0 else y0
                _check_activation(y, y0, i, len(xs[i]), rank)
                outgoing[("activation", i)] = y
                if i == 0:
                    outgoing[("header", 0)] = torch.tensor(_header(y), device=device)
            saved[i] = (x, y)
            seconds = fwd_s
        else:
            x, y = saved.pop(i)
            grad = None if last else _wait(*arriving.pop(("gradient", i)))
            measure.synchronize(device)
            start = time.perf_counter()
            if y.requires_grad:  # a first stage of parameter-free layers has nothing to differentiate
                y.backward(grad)
            if rank > 0:
                outgoing[("gradient", i)] = x.grad
            seconds = bwd_s
        measure.synchronize(device)
        _pad(start, seconds)
        end = time.perf_counter()
        events.append(PipelineEvent(rank, step.kind, i, start - t0, end - t0))
        peak = max(peak, len(saved))
    for request in sends:
        request.wait()
    return PipelineResult(rank, layers, events, peak, loss if last else None)


def _header(tensor: torch.Tensor) -> list[int]:
    """The first activation's signature (dtype and shape), sent ahead so that the receiver can make its buffers;
    later activations keep that shape but for the micro-batch size, in dim 0."""
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"run_pipeline: activations of {tensor.dim()} dimensions; at most {MAX_DIMS} cross.")
    return signature(tensor)


def _payload(tensor: torch.Tensor, message: Message) -> torch.Tensor:
    """What a send puts on the wire, counted by count_collectives() as a "send" (the header aside)."""
    payload = tensor.detach().contiguous()
    if message.what != "header":
        record_collective("send", payload)
    return payload


def _wait(buffer: torch.Tensor, pending) -> torch.Tensor:
    pending.wait()
    return buffer


def _check_activation(y: torch.Tensor, y0: torch.Tensor, i: int, size: int, rank: int) -> None:
    """The receiver expects micro-batch i's activation to be micro-batch 0's but for dim 0, its size."""
    if y.shape[:1] != (size,) or y.shape[1:] != y0.shape[1:] or y.dtype != y0.dtype:
        raise ValueError(f"run_pipeline: stage {rank}'s output for micro-batch {i} ({size} examples) is {y.dtype} "
                         f"{tuple(y.shape)}: activations between stages must have the micro-batch in dim 0" +
                         (f", and micro-batch 0's other dims {tuple(y0.shape[1:])}, dtype {y0.dtype}." if i else "."))


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
