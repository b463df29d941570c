"""Parallelism by hand, checked against torch's own: data parallelism (`data`: gradient averaging,
bucketed and overlapped with the backward as torch DDP does), sharded data parallelism (`zero`: the optimizer
state, and gradients, sharded over the ranks, ZeRO-1 and -2, laid out by `zero_buckets`; `fsdp`: the parameters
too, unit by unit, ZeRO-3 as torch's FSDP does it, its units in `fsdp_units`; both cut a flat vector of parameters
over the ranks with `flat_shards`), tensor parallelism (`tensor`: Megatron's column- and row-parallel layers;
`tensor_gpt`: a whole GPT split by heads and vocabulary; `sequence`: sequence parallelism's collectives)
and pipeline parallelism (`pipeline`: GPipe, 1F1B and interleaved 1F1B schedules, an executor over
point-to-point sends, and a simulator), combined on a mesh (`mesh`: the ranks on named axes dp, pp and tp,
each axis's process groups from torch's DeviceMesh; `three_d`: a GPT trained on all three axes at
once). `counters` counts labkit's collectives by kind and group; `torch_counters` every collective a rank makes,
torch's own too. `zero_runs` and `mesh_runs` are the runs two notebooks share (11 and 12: the small MLP under every
ZeRO stage; 13 and 14: the GPT on a mesh), imported from their modules."""

from labkit.parallel.counters import (
    AllReduceCounter,
    CollectiveCounter,
    Traffic,
    all_reduce_sum,
    count_allreduces,
    count_collectives,
    record_collective,
)
from labkit.parallel.data import Bucket, BucketedDDP, Event, average_gradients, broadcast_parameters
from labkit.parallel.fsdp import FullyShardedDP, UnitEvent
from labkit.parallel.mesh import AXES, MAX_LAYOUT_RANKS, Mesh, MeshPlace, mesh_layout
from labkit.parallel.pipeline import (
    Action,
    HandOver,
    PipelineEvent,
    PipelineResult,
    measured_bubble,
    peak_in_flight,
    run_pipeline,
    schedule,
    simulate_pipeline,
    stage_layers,
)
from labkit.parallel.sequence import (
    allreduce_sequence_parallel_grads,
    gather_from_sequence_parallel,
    reduce_scatter_to_sequence_parallel,
    sequence_parallel_linear,
    sequence_slice,
)
from labkit.parallel.tensor import (
    ColumnParallelLinear,
    ParallelMLP,
    RowParallelLinear,
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    split_to_tensor_parallel,
)
from labkit.parallel.tensor_gpt import (
    FullPlace,
    ParallelAttention,
    ParallelBlock,
    ParallelHead,
    VocabParallelEmbedding,
    gather_full_parameters,
    model_description,
    tensor_parallel_gpt,
)
from labkit.parallel.three_d import OtherStage, ThreeDGPT, gpt_shape
from labkit.parallel.torch_counters import count_torch_collectives
from labkit.parallel.zero import ShardedOptimizer
from labkit.plan.counts import shard_sizes  # notebook 05 shows the cut the tensor-parallel layers use

__all__ = ["AXES", "Action", "AllReduceCounter", "Bucket", "BucketedDDP", "CollectiveCounter", "ColumnParallelLinear",
           "Event", "HandOver", "MAX_LAYOUT_RANKS", "Mesh", "MeshPlace", "ParallelMLP", "PipelineEvent",
           "PipelineResult",
           "RowParallelLinear", "ShardedOptimizer", "all_reduce_sum", "average_gradients", "broadcast_parameters",
           "copy_to_tensor_parallel", "count_allreduces", "count_collectives", "gather_from_tensor_parallel",
           "measured_bubble", "mesh_layout", "peak_in_flight", "record_collective", "reduce_from_tensor_parallel",
           "run_pipeline", "schedule", "shard_sizes", "simulate_pipeline", "split_to_tensor_parallel", "stage_layers",
           "FullyShardedDP", "Traffic", "UnitEvent",
           "FullPlace", "ParallelAttention", "ParallelBlock", "ParallelHead", "VocabParallelEmbedding",
           "allreduce_sequence_parallel_grads", "gather_from_sequence_parallel", "gather_full_parameters",
           "reduce_scatter_to_sequence_parallel", "sequence_parallel_linear", "sequence_slice", "tensor_parallel_gpt",
           "OtherStage", "ThreeDGPT", "gpt_shape", "model_description", "count_torch_collectives"]
