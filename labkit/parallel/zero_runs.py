"""The small run that notebooks 11 (ZeRO-1 and -2) and 12 (ZeRO-3 and FSDP) train under every data-parallel
strategy, so that each can be checked against one process training on the whole batch.

    classification_data()         the 512 examples of 16 features and 4 classes every run trains on
    model_and_optimizer(strategy) the notebooks' MLP (three hidden layers of 64) and AdamW, under `strategy`
    train(strategy)               STEPS steps on this rank's slice of the batch (runs inside a rank)
    train_torch(strategy)         the same with torch's ZeroRedundancyOptimizer or FSDP2's fully_shard
    train_alone()                 one process on the whole batch: what every strategy must reproduce
    compare(strategy, world_size) a strategy on world_size ranks against train_alone: the largest gap, and the
                                  numbers of Adam's state (m and v) each rank holds

The strategies: "DDP" (every rank the whole state, gradients averaged), "ZeRO-1" and "ZeRO-2"
(`ShardedOptimizer`, the optimizer state sharded, and the gradients too), "ZeRO-3" (`FullyShardedDP`, the
weights too); for `train_torch`, "torch ZeroRedundancyOptimizer" and "torch fully_shard". One module, so that both
notebooks train exactly the same run and a fresh kernel of either needs nothing from the other.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

import labkit
from labkit.models import make_classification, mlp
from labkit.parallel.data import average_gradients, broadcast_parameters
from labkit.parallel.fsdp import FullyShardedDP
from labkit.parallel.zero import ShardedOptimizer

__all__ = ["ADAMW", "STEPS", "STRATEGIES", "TORCH_STRATEGIES", "Comparison", "adam_state_numbers",
           "classification_data", "compare", "model_and_optimizer", "rank_slice", "train", "train_alone", "train_torch"]

STEPS, ADAMW = 10, {"lr": 0.01, "weight_decay": 0.1}
STRATEGIES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
TORCH_STRATEGIES = ("torch ZeroRedundancyOptimizer", "torch fully_shard")


@functools.cache
def classification_data() -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y): 512 examples, 16 features, 4 classes, seed 1; cached, the same tensors on every call."""
    return make_classification(examples=512, features=16, classes=4, seed=1)


def rank_slice(examples: int) -> slice:
    """This rank's contiguous share of `examples` examples: rank r of N takes [r E / N, (r + 1) E / N)."""
    rank, n = labkit.rank(), labkit.world_size()
    return slice(rank * examples // n, (rank + 1) * examples // n)


def model_and_optimizer(strategy: str):
    """The notebooks' small model (three hidden layers of 64, seeded: the same on every rank) and its AdamW, under
    `strategy`: DDP broadcasts the weights, ZeRO-3 wraps the model in FullyShardedDP, ZeRO-1 and -2 shard AdamW."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r}: DDP, ZeRO-1, ZeRO-2 or ZeRO-3")
    model = mlp(hidden=64, layers=3).to(labkit.device())
    if strategy == "DDP":
        broadcast_parameters(model)
        return model, torch.optim.AdamW(model.parameters(), **ADAMW)
    if strategy == "ZeRO-3":
        model = FullyShardedDP(model)
        return model, torch.optim.AdamW(model.parameters(), **ADAMW)
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, shard_gradients=strategy == "ZeRO-2", **ADAMW)
    return model, optimizer


def adam_state_numbers(optimizer: torch.optim.Optimizer) -> int:
    """How many numbers of Adam's state (m and v, not the step counts) `optimizer` holds on this rank; DTensors
    (fully_shard's) count their local part only."""
    local = [t.to_local() if hasattr(t, "to_local") else t for s in optimizer.state.values() for t in s.values()]
    return sum(t.numel() for t in local if t.dim())


def _flat(weights: dict) -> torch.Tensor:
    """Every tensor of a state dict, flattened end to end on the CPU (DTensors gathered whole)."""
    full = [w.full_tensor() if hasattr(w, "full_tensor") else w for w in weights.values()]
    return torch.cat([w.reshape(-1).cpu() for w in full])


def train(strategy: str) -> tuple[torch.Tensor, int]:
    """STEPS steps of `strategy` on this rank's slice of the batch: the whole final parameters, flat, and how many
    numbers of Adam's state this rank holds. ShardedOptimizer.step reduce-scatters the gradients itself, so only
    DDP averages them; FullyShardedDP's finish() waits for the last reduce-scatters before the step."""
    x, y = classification_data()
    model, optimizer = model_and_optimizer(strategy)
    mine = rank_slice(len(x))
    xb, yb = x[mine].to(labkit.device()), y[mine].to(labkit.device())
    for _ in range(STEPS):
        optimizer.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        if strategy == "DDP":
            average_gradients(model)
        if strategy == "ZeRO-3":
            model.finish()
        optimizer.step()
    weights = model.full_state_dict() if strategy == "ZeRO-3" else model.state_dict()
    return _flat(weights), adam_state_numbers(optimizer)


def train_torch(strategy: str) -> tuple[torch.Tensor, int]:
    """train(), with torch's own: "torch ZeroRedundancyOptimizer" (ZeRO-1's state sharding, after DDP's averaging:
    it shards the update, not the reduction) or "torch fully_shard" (FSDP2, each Linear and then the root)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if strategy not in TORCH_STRATEGIES:
        raise ValueError(f"strategy {strategy!r}: one of {TORCH_STRATEGIES}")
    x, y = classification_data()
    model = mlp(hidden=64, layers=3).to(labkit.device())
    zero1 = strategy == "torch ZeroRedundancyOptimizer"
    if zero1:
        optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **ADAMW)
    else:
        mesh = init_device_mesh(labkit.device().type, (labkit.world_size(),))
        for layer in [*(m for m in model if isinstance(m, nn.Linear)), model]:
            fully_shard(layer, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    mine = rank_slice(len(x))
    for _ in range(STEPS):
        optimizer.zero_grad()
        F.cross_entropy(model(x[mine].to(labkit.device())), y[mine].to(labkit.device())).backward()
        if zero1:
            average_gradients(model)
        optimizer.step()
    return _flat(model.state_dict()), adam_state_numbers(optimizer.optim if zero1 else optimizer)


def train_alone() -> torch.Tensor:
    """One process, the whole batch, STEPS steps of AdamW: the flat final parameters every strategy must reach."""
    x, y = classification_data()
    model = mlp(hidden=64, layers=3)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    for _ in range(STEPS):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return _flat(model.state_dict())


@dataclasses.dataclass(frozen=True)
class Comparison:
    """A strategy's run against one process: the largest difference of any parameter, and Adam's numbers per rank."""

    strategy: str
    gap: float
    states: list[int]


def compare(strategy: str, world_size: int, trainer=None) -> Comparison:
    """Train by `strategy` on `world_size` ranks (with `trainer`, default train; train_torch for torch's) and
    compare every rank's final parameters with train_alone's; prints one line saying so."""
    trainer = trainer or (train_torch if strategy in TORCH_STRATEGIES else train)
    alone = train_alone()
    per_rank = labkit.run(trainer, strategy, world_size=world_size)
    gap = max((weights - alone).abs().max().item() for weights, _ in per_rank)
    states = [state for _, state in per_rank]
    print(f"{strategy:>6}: largest difference from one process {gap:.1e}")
    print(f"{'':>6}  numbers of Adam state per rank {states}")
    return Comparison(strategy, gap, states)
