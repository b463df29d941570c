"""The GPT run that notebooks 13 (3D parallelism) and 14 (3D layouts) train on a dp x pp x tp mesh and check
against one process, so that a fresh kernel of either needs nothing from the other.

    gpt()                           the seeded TinyGPT on the lesson's characters, in float64, untied head
    lesson_shape()                  its sizes, as labkit.plan takes them
    lesson_batches()                the STEPS batches of BATCH sequences of LENGTH characters every run trains on
    train_3d(dp, pp, tp, ...)       ThreeDGPT on this rank (runs inside a rank): a MeshRun
    train_alone()                   one process, the whole model, the whole batch: (losses, parameters)

A MeshRun names what one rank's run gives back: the losses, the full parameters (rank 0 only), the bytes it
handed to each axis's collectives and plan's per step, the training state it held and plan's, and, when the
compute was emulated, the pipeline's measured bubble. Each comes from its own step below (`_trained`,
`_traffic`, `_memory`, `_bubble`).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

import labkit
from labkit.models import TinyGPT, char_batches, lesson_text, next_token_loss
from labkit.parallel.counters import count_collectives
from labkit.parallel.mesh import AXES, Mesh
from labkit.parallel.three_d import ThreeDGPT, gpt_shape

__all__ = ["BATCH", "LENGTH", "LR", "MICROBATCHES", "STEPS", "MeshRun", "gpt", "lesson_batches", "lesson_shape",
           "lesson_vocab", "train_3d", "train_alone"]

STEPS, BATCH, LENGTH, LR, MICROBATCHES = 20, 16, 32, 1e-2, 2


@functools.cache
def lesson_vocab() -> int:
    """How many distinct characters the lesson's text has: the GPT's vocabulary."""
    return len(set(lesson_text()))


def gpt() -> TinyGPT:
    """The same seeded model on every rank, in float64 so that a split sum differs by 1e-16, not 1e-7."""
    return TinyGPT(lesson_vocab(), tied=False).double()


@functools.cache
def lesson_shape():
    """The GPT's sizes as labkit.plan.GPTShape (vocabulary, width, layers, heads, context)."""
    return gpt_shape(TinyGPT(lesson_vocab(), tied=False))


@functools.cache
def lesson_batches() -> tuple:
    """STEPS (inputs, targets) batches of BATCH sequences of LENGTH characters of the lesson, seed 0."""
    return tuple(char_batches(lesson_text(), BATCH, LENGTH, STEPS, seed=0))


@dataclasses.dataclass
class MeshRun:
    """One rank's run of ThreeDGPT: what it computed, sent and held, each beside labkit.plan's prediction.

    losses          the whole batch's mean loss at each step (every rank has them)
    params          every parameter at full shape, on rank 0; None on the others
    counted         bytes handed to collectives over all steps, {axis: {kind: bytes}}
    planned         plan's bytes per step, {axis: {kind: bytes}}
    memory          the training state this rank held, {part: bytes}
    planned_memory  plan's, {part: bytes}
    bubble          the measured idle fraction of one step with emulated compute; None without it
    """

    losses: list[float]
    params: dict | None
    counted: dict
    planned: dict
    memory: dict
    planned_memory: dict
    bubble: float | None = None


def _trained(run: ThreeDGPT, steps: int) -> tuple[list[float], dict]:
    """Step 1: `steps` training steps; their losses, and the bytes counted on each axis of the run's mesh."""
    with count_collectives() as counted:
        losses = [run.train_step(inputs, targets) for inputs, targets in lesson_batches()[:steps]]
    return losses, {axis: dict(counted.by_axis(run.mesh)[axis].nbytes) for axis in AXES}


def _traffic(run: ThreeDGPT) -> dict:
    """Step 2: plan's bytes per step for this rank, on each axis."""
    return run.planned_traffic(BATCH)


def _memory(run: ThreeDGPT) -> tuple[dict, dict]:
    """Step 3: the training state this rank holds, measured, and plan's."""
    return run.measured_memory(), run.planned_memory()


def _bubble(run: ThreeDGPT, emulate_compute_seconds: tuple[float, float]) -> float:
    """Step 4: one more step whose stages' compute lasts (forward, backward) seconds per micro-batch; its measured
    bubble, gathered on the pp group (every rank takes part)."""
    run.train_step(*lesson_batches()[0], emulate_compute_seconds=emulate_compute_seconds)
    return run.pipeline_bubble()


def train_3d(dp: int, pp: int, tp: int, steps: int = STEPS, emulate_compute_seconds=None) -> MeshRun:
    """`steps` steps of ThreeDGPT on the dp x pp x tp mesh, 1F1B with MICROBATCHES micro-batches, on this rank;
    with `emulate_compute_seconds` (forward, backward), also the measured bubble of one more step."""
    run = ThreeDGPT(gpt(), Mesh(dp, pp, tp), MICROBATCHES, "1f1b", lr=LR)
    losses, counted = _trained(run, steps)
    params = run.full_state_dict()                       # a collective: every rank takes part
    memory, planned_memory = _memory(run)
    bubble = _bubble(run, emulate_compute_seconds) if emulate_compute_seconds else None
    return MeshRun(losses, params if labkit.rank() == 0 else None, counted, _traffic(run), memory, planned_memory,
                   bubble)


def train_alone() -> tuple[list[float], dict]:
    """One process, the whole model, the whole batch, STEPS steps of AdamW: the losses and the final parameters
    every layout must reproduce."""
    model = gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for inputs, targets in lesson_batches():
        optimizer.zero_grad()
        loss = next_token_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, dict(model.named_parameters())
