"""The pipeline executor: one stage per rank of a process group, activations forward and gradients back between
neighbouring stages over point-to-point messages, as `communication_plan` says, each action timed.

    run_pipeline(model, "1f1b", 8, x, y, loss_fn, group=None)   one training step, called on every rank of group
    stage_layers(len(model), stages, chunks=1)                   which layers each stage (and chunk) holds

What each stage does in the step (its layers, tensors, messages and clock) is stage_run.StageRun.

Stage r is the rank r of `group` (its group rank), and messages name stages: the group's transport
(labkit.comm.default_transport(group)) hands them to torch as group ranks. So several pipelines run side by side on
disjoint groups of one world (the `pp` axis of a mesh).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import labkit
from labkit import groups
from labkit.checks import flag, number, whole
from labkit.comm.torch_transport import TorchTransport, default_transport
from labkit.parallel.pipeline.layout import V_SHAPED
from labkit.parallel.pipeline.schedule import SPLIT_BACKWARD, Action, communication_plan
from labkit.parallel.pipeline.stage_run import MicroBatches, StageLink, StageRun
from labkit.parallel.pipeline.timeline import PipelineEvent
from labkit.plan.counts import shard_sizes

__all__ = ["PipelineResult", "run_pipeline", "stage_layers"]


def stage_layers(layers: int, stages: int, chunks: int = 1) -> list[range]:
    """Which layers of an nn.Sequential each stage holds: consecutive, balanced by layer count (a parameter-
    free layer such as ReLU counts as one), the first stages one more when the count does not divide. With
    `chunks` per stage (interleaved), the model is cut so into stages x chunks pieces, listed in model order:
    stage r's chunk c is piece c * stages + r (Narayanan et al. 2021, section 2.2.2).

    >>> stage_layers(5, 2)
    [range(0, 3), range(3, 5)]
    >>> pieces = stage_layers(8, 2, chunks=2)  # stage 0: layers 0-1 and 4-5; stage 1: 2-3 and 6-7
    >>> [pieces[c * 2 + 0] for c in range(2)]
    [range(0, 2), range(4, 6)]
    """
    layers, stages, chunks = whole("layers", layers), whole("stages", stages), whole("chunks", chunks)
    pieces = stages * chunks
    if layers < pieces:
        cut = f"{pieces} stages" if chunks == 1 else f"{pieces} pieces ({stages} stages x {chunks} chunks)"
        raise ValueError(f"a model of {layers} layer(s) cannot make {cut}: each needs a layer.")
    sizes = shard_sizes(layers, pieces)
    return [range(end - size, end) for size, end in zip(sizes, itertools.accumulate(sizes), strict=True)]


@dataclass
class PipelineResult:
    """What run_pipeline returns on each rank: its `stage` (its rank in the pipeline's group), the model's
    `layers` it ran (one range per chunk: one but for the interleaved schedule), its `events` (PipelineEvents
    timed from a barrier at the start), `peak_in_flight` (most activations it held awaiting their backward: one
    per micro-batch and chunk, as schedule.peak_in_flight counts), and on the last stage `loss` (the full
    batch's mean)."""
    stage: int
    layers: tuple[range, ...]
    events: list[PipelineEvent]
    peak_in_flight: int
    loss: float | None


def run_pipeline(model: nn.Sequential, schedule_kind: str, microbatches: int, inputs: torch.Tensor,
                 targets: torch.Tensor, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 chunks: int = 1, emulate_compute_seconds: float | tuple[float, float] = 0.0,
                 batched: bool | None = None, group=None) -> PipelineResult:
    """One pipelined forward and backward of `model` on this rank's stage; call it on every rank of `group`.

    The stages are `group`'s ranks (None: the whole world), p of them. The model (the same full model on every
    rank: only this stage's layers run and get gradients) is cut into p x `chunks` pieces by stage_layers; stage r
    (group rank r) runs piece r, and with v = chunks >= 2 (schedule_kind "interleaved") also pieces r + p, ..., r
    + (v-1) p, so that the last stage's chunk c hands on to the first stage's chunk c + 1. Its layers are moved to
    labkit.device() (in place, as Module.to does), and every tensor crosses there: under NCCL each stage talks
    NCCL, even one without parameters. The batch (`inputs`, `targets`, dim 0; only the first piece reads inputs,
    only the last targets) is cut into `microbatches` with tensor_split. Activations go forward and their
    gradients back between neighbours in the groups of `communication_plan`: each group one dist.batch_isend_irecv
    where `batched` (None: on NCCL only, which needs it to not hang), else paired isend/irecv (gloo), each receive
    then posted one action ahead (communication_plan's receives_ahead, which would hang NCCL): a message then
    lands while its receiver still computes. Activations must keep the micro-batch in dim 0 and the same other
    dims (each chunk's first one's dtype and shape travel ahead in a small header); the first piece's input may be
    of any dtype (token ids), later ones are differentiated. `loss_fn(output, target)` must average over its
    micro-batch: micro-batch i's loss is scaled by n_i / n, so the gradients accumulated into `.grad` (not zeroed
    here) are the full batch's mean loss's. count_collectives() counts every activation and gradient sent as a
    "send" on `group` (the header aside). Layers that talk on other groups (tensor-parallel ones, on a mesh's tp
    axis) may: the pipeline's messages go on `group` only.

    Timing: an action starts once its input has arrived and ends when its compute is done, both read on the
    host clock after labkit.measure.synchronize(labkit.device()), so on a GPU the bars are the kernels' run,
    not their launch (the synchronisation serialises host and GPU at each action: a measuring executor).

    `emulate_compute_seconds` (a number, or (forward, backward)): EMULATION. A stage's forward (backward) of
    a micro-batch lasts at least this long, each chunk's 1/v of it: its real compute, then a sleep for the
    rest; "zb-h1" gives its B and W half the backward's each. On a 2-core laptop, where 4 ranks' real compute would
    fight for the cores, sleeping stages
    (time.sleep frees the CPU) overlap as a GPU cluster's would. A process's one-off first-call costs are paid
    before the clock starts, so even the first call's actions last what was asked.

    Example::

        >>> import labkit, torch.nn.functional as F
        >>> from labkit.models import make_classification, mlp
        >>> from labkit.parallel import run_pipeline
        >>> def step(kind, chunks):
        ...     x, y = make_classification(32)
        ...     result = run_pipeline(mlp(), kind, 4, x, y, F.cross_entropy, chunks)  # mlp(): 5 layers, seeded
        ...     return result.layers, result.peak_in_flight, result.loss
        >>> for layers, peak, loss in labkit.run(step, "1f1b", 1, world_size=4):
        ...     print(layers, peak, loss)  # F.cross_entropy(mlp()(x), y); float32's 7th digit may differ by CPU
        (range(0, 2),) 4 None
        (range(2, 3),) 3 None
        (range(3, 4),) 2 None
        (range(4, 5),) 1 1.38673...
        >>> for layers, peak, loss in labkit.run(step, "interleaved", 2, world_size=2):
        ...     print(layers, peak, loss)       # 4 pieces of 2, 1, 1, 1 layers; the same loss
        (range(0, 2), range(3, 4)) 5 None
        (range(2, 3), range(4, 5)) 3 1.38673...
    """
    groups.require_member("run_pipeline", group)
    _check_same_plan(model, schedule_kind, microbatches, chunks, group)
    kind = schedule_kind.lower() if isinstance(schedule_kind, str) else schedule_kind  # communication_plan checks it
    if kind in V_SHAPED:
        raise ValueError(f"schedule_kind={schedule_kind!r}: run_pipeline runs the looped layouts (gpipe, 1f1b, "
                         "interleaved, zb-h1); a V-shaped schedule is simulated only: simulate_pipeline"
                         f"({schedule_kind!r}, stages, microbatches) draws its step.")
    m = _checked_step(model, microbatches, inputs, targets)
    stage, stages = groups.group_rank(group), groups.group_size(group)
    pieces = stage_layers(len(model), stages, chunks)
    layers = tuple(pieces[c * stages + stage] for c in range(chunks))
    device = labkit.device()
    split = kind in SPLIT_BACKWARD
    run = StageRun([model[piece.start:piece.stop].to(device) for piece in layers], (stage, stages, chunks), device,
                   MicroBatches(inputs.tensor_split(m), targets.tensor_split(m), len(inputs), loss_fn),
                   _emulated(emulate_compute_seconds, split), split_backward=split)
    transport = default_transport(group)
    link = StageLink(transport, _batched(batched, transport, device))
    plan = communication_plan(schedule_kind, stages, m, chunks, receives_ahead=not link.batched)[stage]
    run.start_clock(link)
    for step in plan:
        if isinstance(step, Action):
            run.act(step)
        else:
            run.post(step, link)
    events, peak, loss = run.finish()
    return PipelineResult(stage, layers, events, peak, loss)


def _check_same_plan(model, schedule_kind, microbatches, chunks, group) -> None:
    """ValueError on every stage unless all passed the same schedule kind, number of micro-batches, chunks and
    number of layers: from these each stage plans its messages, and stages with different plans wait for
    messages that never come, until the group's timeout. Checked as given, before any of them is checked on its
    own: a value refused on one stage only would leave the others waiting too."""
    layers = len(model) if isinstance(model, nn.Sequential) else type(model).__name__
    groups.check_same((schedule_kind, microbatches, chunks, layers), "run_pipeline",
                      "(schedule_kind, microbatches, chunks, layers of the model)",
                      "Pass the same schedule, number of micro-batches and chunks, and model on every stage.", group)


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


def _emulated(seconds: float | tuple[float, float], split: bool) -> dict[str, float]:
    """The emulated seconds of a forward ("F") and a backward ("B"): one number for both, or (forward, backward);
    a split backward's B and W half of it each (Qi et al. 2023's equal-cost case)."""
    pair = seconds if isinstance(seconds, tuple) else (seconds, seconds)
    if len(pair) != 2:
        raise ValueError(f"emulate_compute_seconds={seconds!r}: pass one number, or (forward, backward).")
    forward, backward = (number("emulate_compute_seconds", s) for s in pair)
    return {"F": forward, "B": backward / 2, "W": backward / 2} if split else {"F": forward, "B": backward}


def _batched(batched: bool | None, transport: TorchTransport, device: torch.device) -> bool:
    """Whether each group of messages goes out as one batch: as asked, or (None) where the group's backend for
    `device` is NCCL."""
    if batched is None:
        return transport.carriage(torch.empty(0, device=device)).backend == "nccl"
    return flag("batched", batched)
