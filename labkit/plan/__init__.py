"""The arithmetic of distributed training: pure functions, units in their names, each formula cited.

Bytes and seconds are plain floats, bandwidths bytes/s; GB = 1e9 bytes wherever a number is printed.
`print(worked_example())` recomputes the lesson's 7B example, Steps 1-6.
"""

from labkit.plan.activation_memory import RECOMPUTE, activation_nbytes
from labkit.plan.axis_traffic import (
    GPTShape,
    ParallelLayout,
    axis_traffic,
    axis_wire_bytes,
    check_fit,
    rank_layers,
    rank_params,
)
from labkit.plan.batch import effective_batch, scale_lr, steps_per_epoch
from labkit.plan.bubble import bubble_fraction, zero_bubble_fraction
from labkit.plan.context_parallel import (
    CONTEXT_VARIANTS,
    attention_work,
    context_attention_saved_nbytes,
    context_layout,
    context_parallel_nbytes,
)
from labkit.plan.counts import format_count, parse_count
from labkit.plan.expert_parallel import expert_capacity, expert_params_per_rank, moe_all_to_all_nbytes
from labkit.plan.memory import (
    YOUR_CHOICE,
    attention_lora_shapes,
    lora_params,
    memory_options,
    tp_in_node,
    training_memory,
    transformer_params,
)
from labkit.plan.sharding import (
    ZERO_STAGES,
    zero_collective_bytes_per_param,
    zero_memory_table,
    zero_redundancy_optimizer_bytes,
    zero_traffic_bytes,
)
from labkit.plan.step_time import (
    BACKWARD_SHARE,
    bandwidth_for_speedup,
    data_parallel_speedup,
    hideable_seconds,
    step_seconds,
    tokens_to_hide_allreduce,
)
from labkit.plan.strategy import parallelism_for
from labkit.plan.traffic import (
    GB,
    allreduce_seconds,
    bus_bandwidth,
    fit_alpha_beta,
    fit_point_to_point,
    naive_allreduce_bytes,
    ring_allreduce_bytes,
)
from labkit.plan.worked_example import WorkedExample, worked_example

__all__ = [
    "BACKWARD_SHARE",
    "CONTEXT_VARIANTS",
    "GB",
    "GPTShape",
    "RECOMPUTE",
    "ParallelLayout",
    "YOUR_CHOICE",
    "ZERO_STAGES",
    "WorkedExample",
    "activation_nbytes",
    "allreduce_seconds",
    "attention_work",
    "attention_lora_shapes",
    "axis_traffic",
    "axis_wire_bytes",
    "bandwidth_for_speedup",
    "bubble_fraction",
    "bus_bandwidth",
    "check_fit",
    "context_attention_saved_nbytes",
    "context_layout",
    "context_parallel_nbytes",
    "data_parallel_speedup",
    "effective_batch",
    "expert_capacity",
    "expert_params_per_rank",
    "fit_alpha_beta",
    "fit_point_to_point",
    "format_count",
    "hideable_seconds",
    "lora_params",
    "memory_options",
    "moe_all_to_all_nbytes",
    "naive_allreduce_bytes",
    "parallelism_for",
    "parse_count",
    "rank_layers",
    "rank_params",
    "ring_allreduce_bytes",
    "scale_lr",
    "step_seconds",
    "steps_per_epoch",
    "tokens_to_hide_allreduce",
    "tp_in_node",
    "training_memory",
    "transformer_params",
    "worked_example",
    "zero_collective_bytes_per_param",
    "zero_memory_table",
    "zero_redundancy_optimizer_bytes",
    "zero_traffic_bytes",
    "zero_bubble_fraction",
]
