"""What sharding the data-parallel replicas buys and what it costs: ZeRO's memory per device and traffic per step.

Replicated data parallelism (DDP) keeps the whole training state on every rank; ZeRO (Rajbhandari et al. 2020,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models") shards it over the N data-parallel ranks
in three stages, and PyTorch's FSDP is stage 3 (Zhao et al. 2023, "PyTorch FSDP"). What each stage shards:
  stage 0 (DDP)  nothing
  stage 1        the optimizer state (the paper's P_os)
  stage 2        + the gradients (P_os+g)
  stage 3        + the weights (P_os+g+p)
Memory comes from `training_memory`; the traffic is counted for ring collectives, as `ring_allreduce_bytes` does.
"""

from __future__ import annotations

from labkit.checks import finite_result, number, overflow_named, shown, whole
from labkit.plan.memory import training_memory
from labkit.plan.traffic import ring_allreduce_bytes, ring_reduce_scatter_bytes

__all__ = ["ZERO_STAGES", "zero_collective_bytes_per_param", "zero_memory_table", "zero_redundancy_optimizer_bytes",
           "zero_traffic_bytes"]

ZERO_STAGES = {0: "nothing (replicated, DDP)", 1: "the optimizer state", 2: "the optimizer state and gradients",
               3: "the optimizer state, gradients and weights"}  # stage: what it shards over the ranks


def zero_memory_table(params: float, dp: int, weight_bytes: float = 2, grad_bytes: float = 2,
                      optimizer_bytes: float = 12) -> dict[int, dict[str, float]]:
    """Bytes per device of weights, grads and optimizer state for each ZeRO stage, 0 to 3, over `dp` ranks.

    Each entry is `training_memory`'s dict for that stage, so the defaults are the paper's mixed-precision Adam
    (K = 12 bytes of optimizer state per parameter). The paper's figure 1: 7.5B parameters on N_d = 64 ranks,
    120 GB per device replicated, then 31.4, 16.6 and 1.9 GB (GB = 1e9 bytes):

    >>> table = zero_memory_table(7.5e9, dp=64)
    >>> {stage: round(memory["total"] / 1e9, 1) for stage, memory in table.items()}
    {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    """
    return {stage: training_memory(params, weight_bytes, grad_bytes, optimizer_bytes, zero_stage=stage, dp=dp)
            for stage in ZERO_STAGES}


def zero_collective_bytes_per_param(zero_stage: int, weight_bytes: float = 2, grad_bytes: float = 2) -> float:
    """Bytes per parameter that one training step's collectives carry under ZeRO stage `zero_stage`, summed over
    the collectives, before a ring's (N-1)/N:

      stage 0 (DDP)  the gradients' AllReduce, a ReduceScatter then an AllGather: 2 grad_bytes
      stages 1, 2    a ReduceScatter of the gradients (each rank keeps the shard it updates), then an AllGather
                     of the updated weights: grad_bytes + weight_bytes, DDP's traffic when both are equal
      stage 3        the weights AllGathered before the forward and again before the backward, the gradients
                     ReduceScattered: grad_bytes + 2 weight_bytes, 1.5x DDP's when all are equal

    (Rajbhandari et al. 2020, section 7: 2 Psi for stages 1 and 2, 3 Psi for stage 3.)

    >>> [zero_collective_bytes_per_param(stage) for stage in range(4)]       # bf16 weights and gradients
    [4.0, 4.0, 4.0, 6.0]
    """
    stage = whole("zero_stage", zero_stage, minimum=0)
    if stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage={shown(zero_stage)}: pass 0 (no sharding), 1, 2 or 3.")
    weights, grads = number("weight_bytes", weight_bytes), number("grad_bytes", grad_bytes)
    per_param = {0: 2 * grads, 1: grads + weights, 2: grads + weights, 3: grads + 2 * weights}[stage]
    return finite_result("zero_collective_bytes_per_param", per_param, zero_stage=zero_stage,
                         weight_bytes=weight_bytes, grad_bytes=grad_bytes)


def zero_traffic_bytes(params: float, world_size: int, zero_stage: int = 0, weight_bytes: float = 2,
                       grad_bytes: float = 2) -> float:
    """Bytes each rank sends (and receives) in one training step of ZeRO stage `zero_stage` over `world_size`
    ranks, with ring collectives: (N-1)/N x params x `zero_collective_bytes_per_param`.

    >>> zero_traffic_bytes(1e9, 4, zero_stage=0) / 1e9        # DDP: 2 (N-1)/N x 2 GB of bf16 gradients
    3.0
    >>> zero_traffic_bytes(1e9, 4, zero_stage=3) / 1e9        # ZeRO-3: the extra AllGather of the weights, 1.5x
    4.5
    """
    count = number("params", params)
    per_param = zero_collective_bytes_per_param(zero_stage, weight_bytes, grad_bytes)
    with overflow_named("zero_traffic_bytes", params=params, world_size=world_size, zero_stage=zero_stage,
                        weight_bytes=weight_bytes, grad_bytes=grad_bytes) as finite:
        return finite(ring_reduce_scatter_bytes(finite(count * per_param), world_size))


def zero_redundancy_optimizer_bytes(params: float, world_size: int, weight_bytes: float = 2,
                                    grad_bytes: float = 2) -> float:
    """Bytes each rank sends in one step of torch's ZeroRedundancyOptimizer (ZeRO-1's sharded update, as PyTorch
    ships it) over `world_size` ranks: not the paper's reduce-scatter and all-gather (zero_traffic_bytes' stage 1),
    but DDP's all-reduce of every gradient, 2(N-1)/N x params x grad_bytes, and then a broadcast of every
    parameter from the rank that updated it (torch.distributed.optim.ZeroRedundancyOptimizer's step, after
    DDP). A broadcast pipelined along a ring, as NCCL runs it, has every rank but the last forward what it got;
    with the N ranks as roots in turn that is (N-1)/N of the weights per rank, an all-gather's bytes:
        (2 grad_bytes + weight_bytes) (N-1)/N x params,
    1.5x DDP's (and ZeRO-3's) when the two byte counts are equal. The shares are whole parameters, so a rank's own
    bytes differ from the average by its successor's share's distance from 1/N.

    >>> zero_redundancy_optimizer_bytes(7e9, 8) / 1e9          # the lesson's 7B on 8 GPUs: DDP's 24.5 GB x 1.5
    36.75
    """
    count = number("params", params)
    inputs = {"params": params, "world_size": world_size, "weight_bytes": weight_bytes, "grad_bytes": grad_bytes}
    weights, grads = number("weight_bytes", weight_bytes), number("grad_bytes", grad_bytes)
    with overflow_named("zero_redundancy_optimizer_bytes", **inputs) as finite:
        allreduce = ring_allreduce_bytes(finite(count * grads), world_size)
        return finite(allreduce + ring_reduce_scatter_bytes(finite(count * weights), world_size))
