"""Pipeline parallelism by hand: consecutive layers on consecutive ranks (stages); the batch cut into
micro-batches that flow forward through the stages and whose gradients flow back, so stages work at once.

    schedule("1f1b", 4, 8)          each stage's ordered actions: Action("F", i), Action("B", i)
    run_pipeline(model, "1f1b", 8, x, y, loss_fn)   one training step on real ranks (activations and
                                    gradients over paired isend/irecv), timed action by action
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

from labkit.comm.transport import DTYPES, MAX_DIMS, default_transport, signature
from labkit.parallel.data import record_collective
from labkit.plan._checks import choice, number, whole

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


def _send_header(transport, tensor: torch.Tensor, dst: int):
    """Post the send of the first activation's signature (dtype and shape, tag 0), so that the receiver can post its
    receives ahead; later activations keep that shape but for the micro-batch size, in dim 0."""
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"run_pipeline: activations of {tensor.dim()} dimensions; at most {MAX_DIMS} cross.")
    return transport.isend(torch.tensor(signature(tensor), device=tensor.device), dst, 0)


def _send(transport, tensor: torch.Tensor, dst: int, tag: int):
    payload = tensor.detach().contiguous()
    record_collective("send", payload)
    return transport.isend(payload, dst, tag)


def _post_recv(transport, buffer: torch.Tensor, src: int, tag: int) -> tuple:
    return buffer, transport.irecv(buffer, src, tag)


def _wait(buffer: torch.Tensor, pending) -> torch.Tensor:
    pending.wait()
    return buffer


def run_pipeline(model: nn.Sequential, schedule_kind: str, microbatches: int, inputs: torch.Tensor,
                 targets: torch.Tensor, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 emulate_compute_seconds: float | tuple[float, float] = 0.0) -> PipelineResult:
    """One pipelined forward and backward of `model` on this rank's stage; call it on every rank.

    p = the world size; stage r runs layers `stage_layers(len(model), p)[r]` of `model` (the same full model
    on every rank: only this stage's layers run and get gradients). The batch (`inputs`, `targets`, dim 0;
    only the first stage reads inputs, only the last targets) is cut into `microbatches` with tensor_split.
    Activations go forward and their gradients back between neighbours as paired isend/irecv (never
    batch_isend_irecv, which can hang on gloo). Activations must keep the micro-batch in dim 0 and the same
    other dims (the first one's dtype and shape travel ahead in a small header). `loss_fn(output, target)` must
    average over its micro-batch: micro-batch i's loss is scaled by n_i / n, so the gradients accumulated into
    `.grad` (not zeroed here) are the full batch's mean loss's. count_collectives() counts every activation and
    gradient sent as a "send" (the header aside).

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
    stage, actions = model[layers.start:layers.stop], schedule(schedule_kind, p, m)[rank]
    device = next((t.device for t in stage.parameters()), inputs.device)
    xs, ts = inputs.tensor_split(m), targets.tensor_split(m)
    first, last = rank == 0, rank == p - 1
    saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # micro-batch -> (stage input, output or loss)
    # gloo moves a message only once its receive is posted (a late one costs a round trip, ~0.5 ms here), so
    # receives are posted ahead: activation i+1's when activation i is in, gradient i's after forward i. Each
    # peer's receives are posted in the order it sends, as NCCL, which ignores tags, needs. Tags: 0 the
    # header, 2i+1 activation i, 2i+2 its gradient.
    activations, grads, sends, events, peak, loss, transport = {}, {}, [], [], 0, 0.0, default_transport()
    y0 = None  # this stage's output for micro-batch 0: later ones must match it but for the size
    if not first:
        header = _post_recv(transport, torch.empty(2 + MAX_DIMS, dtype=torch.int64, device=device), rank - 1, 0)
    _warm_up(device)
    dist.barrier()
    t0 = time.perf_counter()
    for action in actions:
        i = action.microbatch
        if action.kind == "F":
            if first:
                x = xs[i].to(device)
            else:
                if i == 0:
                    dtype, ndim, *shape = _wait(*header).tolist()
                    buffer = torch.empty(shape[:ndim], dtype=DTYPES[dtype], device=device)
                    activations[0] = _post_recv(transport, buffer, rank - 1, 1)
                x = _wait(*activations.pop(i)).requires_grad_()
                if i + 1 < m:
                    buffer = x.new_empty((len(xs[i + 1]), *x.shape[1:]))
                    activations[i + 1] = _post_recv(transport, buffer, rank - 1, 2 * i + 3)
            start = time.perf_counter()
            y = stage(x)
            if last:
                y = loss_fn(y, ts[i].to(device)) * (len(xs[i]) / len(inputs))
                loss += y.item()
            else:
                grads[i] = _post_recv(transport, torch.empty_like(y), rank + 1, 2 * i + 2)
                y0 = y if i == 0 else y0
                _check_activation(y, y0, i, len(xs[i]), rank)
                if i == 0:  # the shape is known before the compute ends (on a GPU, at launch): it goes ahead
                    sends.append(_send_header(transport, y, rank + 1))
            saved[i] = (x, y)
            _pad(start, fwd_s)
            end = time.perf_counter()
            if not last:
                sends.append(_send(transport, y, rank + 1, 2 * i + 1))
        else:
            x, y = saved.pop(i)
            grad = None if last else _wait(*grads.pop(i))
            start = time.perf_counter()
            if y.requires_grad:  # a first stage of parameter-free layers has nothing to differentiate
                y.backward(grad)
            _pad(start, bwd_s)
            end = time.perf_counter()
            if not first:
                sends.append(_send(transport, x.grad, rank - 1, 2 * i + 2))
        events.append(PipelineEvent(rank, action.kind, i, start - t0, end - t0))
        peak = max(peak, len(saved))
    for work in sends:
        work.wait()
    return PipelineResult(rank, layers, events, peak, loss if last else None)


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
