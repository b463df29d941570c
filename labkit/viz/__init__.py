"""Plotly figures for the course: collectives, the ring, traffic, planning, training runs, the mesh, the work
context parallelism shares out, and how evenly experts share tokens."""

from labkit.viz.axis_chart import axis_link_seconds, axis_traffic_bars
from labkit.viz.collectives import before_after
from labkit.viz.context_chart import causal_work_map
from labkit.viz.experts_chart import expert_balance_chart
from labkit.viz.mesh_chart import mesh_grid
from labkit.viz.pipeline_chart import bubble_chart, pipeline_timeline
from labkit.viz.plan import memory_bars, speedup_chart, zero_memory_bars
from labkit.viz.ring_chart import contributions_by_hop, ring_animation
from labkit.viz.traffic_chart import traffic_chart
from labkit.viz.training import ddp_timeline, divergence_chart, fsdp_timeline, loss_curves

__all__ = ["axis_link_seconds", "axis_traffic_bars", "before_after", "bubble_chart", "causal_work_map",
           "contributions_by_hop", "ddp_timeline", "divergence_chart", "expert_balance_chart", "fsdp_timeline",
           "loss_curves", "memory_bars", "mesh_grid", "pipeline_timeline", "ring_animation", "speedup_chart",
           "traffic_chart", "zero_memory_bars"]
