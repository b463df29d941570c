"""Notebook 15's bug zoo: six broken data-parallel training runs, what each shows, and what is wrong with each.

Every run is the same small job: a seeded classifier trained by full-batch SGD, each rank on its own equal
shard of one batch, with the course's data parallelism written out (labkit.parallel's broadcast_parameters at
the start, one counted all_reduce per gradient, then a division by N: Li et al., "PyTorch Distributed", VLDB
2020, 3.2.1). Each run breaks one thing. `zoo_run(letter)` runs on every rank and returns a `RankRecord`: the
losses, parameter checksums, BatchNorm statistics, eval outputs and collective counts that a student inspects
with the course's tools; `Symptoms` puts the ranks' records side by side with one process on the whole batch.

The runs are named by letters in the notebook, so that a name gives nothing away; `ANSWERS` (used by the
diagnosis widget, labkit/widgets/zoo_diagnosis.py) says which cause is whose, and `CAUSES` why it shows as it does.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import labkit
from labkit.models import make_classification
from labkit.parallel import all_reduce_sum, broadcast_parameters, count_collectives

__all__ = ["ANSWERS", "BATCH", "CAUSES", "DISTRACTORS", "LR", "STEPS", "Symptoms", "cause_gap", "confirmation",
           "reference_run", "zoo_batch", "zoo_model", "zoo_run"]

BATCH, STEPS, LR = 96, 12, 0.2  # 96 rows: 2, 3 and 4 ranks all get equal shards
RUNS = "ABCDEF"
PROBE_ROWS = 8  # eval-mode outputs are compared on the first rows of the batch


@dataclass(frozen=True)
class Cause:
    """One thing that can be wrong with a data-parallel run: its label in the widget, and what it would show."""

    label: str
    shows: str  # the symptom this cause leaves, in the course's tools


CAUSES = {
    "no_divide": Cause("the gradients are summed over the ranks but never divided by N",
                       "identical replicas, a first step N x as long as one process's, and a loss curve unlike "
                       "one process's (faster at first with a few ranks, diverging with many): every update uses "
                       "N x the averaged gradient, so the run trains with N x the learning rate it was given"),
    "no_broadcast": Cause("the replicas were never broadcast at the start",
                          "different parameter checksums on every rank from the very first step, apart by the "
                          "same amount at every step (they all receive the same averaged update)"),
    "local_batchnorm": Cause("each rank keeps its own BatchNorm statistics",
                             "identical parameters, but BatchNorm's running mean and variance (buffers, never "
                             "all-reduced) differ per rank, so eval-mode outputs differ per rank"),
    "same_shard": Cause("every rank trains on the same shard of the data",
                        "every rank reporting exactly the same loss at every step, and a run equal to one "
                        "process trained on 1/N of the batch: the other shards are never seen"),
    "extra_batch": Cause("one rank has one batch more than the others",
                         "a hang: that rank waits in an all_reduce nobody else joins, and labkit's hang report "
                         "and monitored_barrier name it"),
    "bf16_allreduce": Cause("the gradients are all-reduced in bfloat16",
                            "identical replicas and a healthy loss curve, but half the bytes per all_reduce and "
                            "parameters about 1e-4 to 1e-3 away from float32's one process instead of 1e-7"),
    "learning_rate": Cause("the learning rate is too high for this model",
                           "one process on the whole batch, with the same learning rate, misbehaving too"),
    "float_order": Cause("float32 sums in another order (harmless)",
                         "gaps near float32's rounding, 1e-7, and nothing else"),
    "straggler": Cause("a slow rank (a straggler): the others wait for it",
                       "a run that finishes, only later: longer step times, every rank in the same call"),
    "zero_grad": Cause("optimizer.zero_grad() forgotten",
                       "the first step equal to one process's, and the later ones growing as gradients pile up"),
    "different_data_order": Cause("each rank shuffles its data with another seed",
                                  "different losses per rank (as in any healthy run), nothing more"),
}

# Which cause broke which run, and the distractors offered beside the six causes.
ANSWERS = {"A": "same_shard", "B": "no_divide", "C": "local_batchnorm", "D": "bf16_allreduce",
           "E": "extra_batch", "F": "no_broadcast"}
DISTRACTORS = {"A": ("different_data_order", "learning_rate"), "B": ("learning_rate", "zero_grad"),
               "C": ("float_order", "different_data_order"), "D": ("float_order", "straggler"),
               "E": ("straggler", "learning_rate"), "F": ("different_data_order", "float_order")}


def zoo_batch(device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch, the same on every rank: 96 points of 4 classes around random centres, seeded."""
    x, y = make_classification(examples=BATCH, features=16, classes=4, seed=13)
    return x.to(device), y.to(device)


def zoo_model(batch_norm: bool = False, seed: int = 0, device=None) -> nn.Sequential:
    """The small classifier every run trains: 16 -> 32 -> 4 with a ReLU (and a BatchNorm1d before it when
    `batch_norm`), seeded."""
    torch.manual_seed(seed)
    middle = [nn.BatchNorm1d(32)] if batch_norm else []
    return nn.Sequential(nn.Linear(16, 32), *middle, nn.ReLU(), nn.Linear(32, 4)).to(device)


@dataclass
class RankRecord:
    """What one rank of a run left behind, per step: its own loss and its parameters' checksum (their sum, in
    float64; index 0 is before the first step); at the end: its parameters, its buffers' checksum (BatchNorm's
    running statistics), the checksum of its eval-mode outputs on the first rows, and its all_reduces."""

    losses: list[float] = field(default_factory=list)
    checksums: list[float] = field(default_factory=list)
    final: list[float] = field(default_factory=list)
    buffer_checksum: float = 0.0
    eval_checksum: float = 0.0
    allreduce_calls: int = 0
    allreduce_nbytes: int = 0


def zoo_run(letter: str, barrier: str | None = None) -> RankRecord:
    """On every rank: run `letter`'s training (module docstring; "healthy" breaks nothing). Run E hangs;
    `barrier` "monitored" ends it with dist.monitored_barrier on a gloo group, "detail" with a barrier on a group
    checked as TORCH_DISTRIBUTED_DEBUG=DETAIL checks, so that they name the rank that is missing."""
    bug = "healthy" if letter == "healthy" else ANSWERS[letter]
    rank, world_size = labkit.rank(), labkit.world_size()
    group = _checked_group() if barrier == "detail" else None
    gloo = dist.new_group(backend="gloo") if barrier == "monitored" else None  # a collective: before the hang
    model = zoo_model(bug == "local_batchnorm", seed=rank if bug == "no_broadcast" else 0, device=labkit.device())
    if bug != "no_broadcast":
        broadcast_parameters(model)
    x, y = zoo_batch(labkit.device())
    shard = 0 if bug == "same_shard" else rank
    rows = slice(shard * BATCH // world_size, (shard + 1) * BATCH // world_size)
    steps = STEPS + (bug == "extra_batch" and rank == world_size - 1)
    record = RankRecord(checksums=[_checksum(model.parameters())])
    with count_collectives() as counted:
        for _ in range(steps):
            record.losses.append(_train_step(model, x[rows], y[rows], bug, group))
            record.checksums.append(_checksum(model.parameters()))
    _finish(record, model, x, counted)
    if barrier:
        _wait_for_everyone(group or gloo, monitored=gloo is not None)
    return record


def _train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, bug: str, group) -> float:
    """One SGD step with the gradients averaged over the ranks, as `bug` breaks it; this rank's loss."""
    model.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    for p in model.parameters():
        if bug == "bf16_allreduce":
            low = p.grad.to(torch.bfloat16)
            all_reduce_sum(low, group)
            p.grad.copy_(low)
        else:
            all_reduce_sum(p.grad, group)
        if bug != "no_divide":
            p.grad.div_(labkit.world_size())
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return loss.item()


def _finish(record: RankRecord, model: nn.Module, x: torch.Tensor, counted) -> None:
    """The end of a run into `record`: parameters, buffers, eval outputs, all_reduces per step."""
    record.final = torch.cat([p.detach().reshape(-1).double().cpu() for p in model.parameters()]).tolist()
    record.buffer_checksum = _checksum(b for b in model.buffers() if b.is_floating_point())
    model.eval()
    with torch.no_grad():
        record.eval_checksum = model(x[:PROBE_ROWS]).double().sum().item()
    steps = max(len(record.losses), 1)
    record.allreduce_calls = counted.calls["all_reduce"] // steps
    record.allreduce_nbytes = counted.nbytes["all_reduce"] // steps


def _checked_group():
    """A gloo group whose collectives are checked across ranks first, as under TORCH_DISTRIBUTED_DEBUG=DETAIL
    (set at start-up, it wraps every group; here it is switched on for this one group only)."""
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        return dist.new_group(backend="gloo")
    finally:
        dist.set_debug_level(dist.DebugLevel.OFF)


def _wait_for_everyone(group, monitored: bool) -> None:
    """The end of the epoch: a barrier that names a missing rank instead of waiting for it for ever, either
    dist.monitored_barrier (gloo's alone, so on a gloo group: notebook 10) or a barrier on a checked group."""
    if monitored:
        dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=1))
    else:
        dist.barrier(group=group)


def _checksum(tensors) -> float:
    return sum(t.detach().double().sum().item() for t in tensors)


def reference_run(batch_norm: bool = False, rows: slice = slice(None)) -> RankRecord:
    """One process trained on `rows` of the batch (all of it by default), in float32 as the runs are: what a
    healthy run must equal, to float32 rounding."""
    model, (x, y) = zoo_model(batch_norm), zoo_batch()
    record = RankRecord(checksums=[_checksum(model.parameters())])
    for _ in range(STEPS):
        model.zero_grad()
        loss = F.cross_entropy(model(x[rows]), y[rows])
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
        record.losses.append(loss.item())
        record.checksums.append(_checksum(model.parameters()))
    record.final = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()]).tolist()
    return record


@dataclass
class Symptoms:
    """A run's ranks side by side, against one process on the whole batch: what the course's tools show."""

    records: list[RankRecord]
    reference: RankRecord

    @property
    def world_size(self) -> int:
        return len(self.records)

    def start_checksums(self) -> list[float]:
        return [r.checksums[0] for r in self.records]

    def end_checksums(self) -> list[float]:
        return [r.checksums[-1] for r in self.records]

    def mean_losses(self) -> list[float]:
        """The whole batch's loss at each step: the mean of the ranks' losses (equal shards)."""
        return [sum(losses) / self.world_size for losses in zip(*(r.losses for r in self.records), strict=True)]

    def reference_gap(self, reference: RankRecord | None = None) -> float:
        """The largest difference of any rank's final parameters from one process's (`reference`, by default
        the one on the whole batch)."""
        final = (reference or self.reference).final
        return max(max(abs(a - b) for a, b in zip(r.final, final, strict=True)) for r in self.records)

    def first_step_ratio(self) -> float:
        """How far rank 0's parameters moved in the first step, over how far one process's did (checksums)."""
        mine = self.records[0].checksums[1] - self.records[0].checksums[0]
        return mine / (self.reference.checksums[1] - self.reference.checksums[0])

    def parameter_nbytes(self) -> int:
        return 4 * len(self.reference.final)  # float32

    def __str__(self) -> str:
        r0 = self.records[0]
        return "\n".join([
            f"parameter checksum per rank, at the start: {_numbers(self.start_checksums())}",
            f"parameter checksum per rank, after {STEPS} steps: {_numbers(self.end_checksums())}",
            f"loss per rank at the last step: {_numbers([r.losses[-1] for r in self.records])}",
            f"largest parameter gap from one process on the whole batch: {self.reference_gap():.1e}",
            f"first step's change of the checksum, over one process's: {self.first_step_ratio():.2f}",
            f"BatchNorm running statistics, checksum per rank: {_numbers([r.buffer_checksum for r in self.records])}",
            f"eval-mode outputs, checksum per rank: {_numbers([r.eval_checksum for r in self.records])}",
            f"all_reduce per step on rank 0: {r0.allreduce_calls} calls, {r0.allreduce_nbytes:,} bytes "
            f"(the parameters: {self.parameter_nbytes():,} bytes in float32)"])


def _numbers(values: list[float]) -> str:
    """Checksums at 7 significant digits, float32's, so identical replicas read identical."""
    shown = [f"{v:.7g}" if math.isfinite(v) else str(v) for v in values]
    same = " (identical)" if len(set(shown)) == 1 and len(shown) > 1 else ""
    return ", ".join(shown) + same


# Runs whose cause a measurement can confirm: one process with the cause built in, and what that process is.
# Named by letter, so that a notebook cell can check the measurement before the student has chosen a cause.
_CONFIRMED_BY = {"A": "one process trained on only the first 1/N of the batch, as if every rank had the first shard"}


def _cause_reference(letter: str, world_size: int) -> RankRecord:
    """One process that has run `letter`'s cause built in (only run A has one)."""
    if letter != "A":
        raise ValueError(f"only run A's cause is confirmed by a measurement, not run {letter!r}'s")
    return reference_run(rows=slice(0, BATCH // world_size))


def cause_gap(letter: str, found: Symptoms) -> float:
    """The largest difference of run `letter`'s final parameters from one process that has its cause built in:
    float32 rounding (under 1e-6) when that is the cause. It says nothing of what the cause is."""
    return found.reference_gap(_cause_reference(letter, found.world_size))


def confirmation(letter: str, found: Symptoms) -> str:
    """The sentence the diagnosis widget adds once run `letter` is diagnosed right: the measurement that confirms
    its cause."""
    return (f"A measurement confirms it: run {letter} ends {cause_gap(letter, found):.1e} from "
            f"{_CONFIRMED_BY[letter]}.")

