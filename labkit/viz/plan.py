"""Figures for the planning arithmetic: memory per GPU against the GPU's memory (by ZeRO stage too), and speedup
against bandwidth."""

from __future__ import annotations

import math

import plotly.graph_objects as go

from labkit.checks import choice
from labkit.plan import GB, ring_allreduce_bytes
from labkit.plan.step_time import data_parallel_speedup, hideable_seconds
from labkit.viz.style import BLUE, GREEN, GREY, ORANGE, PURPLE, RED, log_axis

__all__ = ["STAGE_LABELS", "UNITS", "memory_bars", "speedup_chart", "zero_memory_bars"]

PARTS = {"weights": BLUE, "grads": ORANGE, "optimizer": GREEN, "activations": PURPLE}  # memory_bars', bottom up
STAGE_LABELS = {0: "DDP<br>nothing sharded", 1: "ZeRO-1<br>optimizer state", 2: "ZeRO-2<br>+ gradients",
                3: "ZeRO-3<br>+ weights"}  # zero_memory_bars' bars: the stage, and what it shards
UNITS = {"GB": GB, "MB": 1e6}  # the bars' unit: GB for models people train, MB for the small ones measured here


def memory_bars(plans: dict[str, dict[str, float]], gpu_nbytes: float | None = None,
                title: str | None = None, unit: str = "GB") -> go.Figure:
    """One stacked bar per plan: bytes per GPU of weights, grads and optimizer state (`training_memory`'s dicts),
    and activations where the plans hold them (memory_options with a sequence), with the GPU's memory as a dashed
    line, named in the legend; heights in `unit` (a key of UNITS: GB = 1e9 bytes, MB = 1e6). The title says
    "before activations" unless the plans count them."""
    scale = UNITS[choice("unit", unit, UNITS)]
    labels = list(plans)
    drawn = {part: color for part, color in PARTS.items() if any(part in plans[label] for label in labels)}
    figure = go.Figure([go.Bar(x=labels, y=[plans[label].get(part, 0) / scale for label in labels], name=part,
                               marker_color=color, hovertemplate=f"%{{x}}: %{{y:.1f}} {unit}<extra>{part}</extra>")
                        for part, color in drawn.items()])
    if gpu_nbytes:
        # named in the legend, not written beside the line: a label at the line's end sits over the tallest bars
        figure.add_hline(y=gpu_nbytes / scale, line={"dash": "dash", "color": RED}, showlegend=True,
                         name=f"GPU memory {gpu_nbytes / scale:g} {unit}")
    if title is None:
        title = "Memory per GPU" + (", activations included" if "activations" in drawn else " before activations")
    figure.update_layout(barmode="stack", title=title, height=380, margin={"t": 50},
                         yaxis_title=f"memory per GPU, {unit} (1e{math.log10(scale):.0f} bytes)")
    return figure


def zero_memory_bars(table: dict[int, dict[str, float]], gpu_nbytes: float | None = None,
                     title: str = "Memory per GPU by ZeRO stage, before activations", unit: str = "GB",
                     predicted: dict[int, dict[str, float]] | None = None) -> go.Figure:
    """`plan.zero_memory_table`'s stages as `memory_bars`: per GPU, weights, grads and optimizer state stacked
    (in `unit`: GB = 1e9 bytes, MB = 1e6), each bar's total written above it; the ZeRO paper's figure 1 for
    `zero_memory_table(7.5e9, dp=64)`. A dict of measured bytes keyed the same way (stage: parts) draws too, and
    `predicted` (plan's table for the same stages) then marks each predicted total beside its measured bar."""
    _check_stages("table", table)
    if predicted is not None:
        _check_stages("predicted", predicted)
    plans = {STAGE_LABELS[stage]: memory for stage, memory in table.items()}
    figure = memory_bars(plans, gpu_nbytes, title, unit)
    scale = UNITS[unit]
    for label, memory in plans.items():
        figure.add_annotation(x=label, y=memory["total"] / scale, text=f"{memory['total'] / scale:.1f} {unit}",
                              showarrow=False, yanchor="bottom")
    if predicted:
        figure.add_scatter(x=[STAGE_LABELS[stage] for stage in predicted],
                           y=[memory["total"] / scale for memory in predicted.values()], mode="markers",
                           name="predicted total (plan)", marker={"symbol": "line-ew-open", "size": 40,
                                                                  "line": {"width": 3, "color": GREY}},
                           hovertemplate=f"%{{x}}: plan predicts %{{y:.3f}} {unit}<extra></extra>")
    return figure


def _check_stages(name: str, table: dict) -> None:
    """ValueError unless `table` is keyed by ZeRO stages, at least one."""
    if not table or any(stage not in STAGE_LABELS for stage in table):
        raise ValueError(f"{name} has stages {list(table)}: pass plan.zero_memory_table's dict, keyed by ZeRO "
                         "stage 0, 1, 2 or 3.")


def speedup_chart(devices: int, compute_seconds: float, gradient_nbytes: float, bandwidths, overlaps=(0.0, 0.9),
                  marker_bandwidth: float | None = None, accumulation_steps: int = 1) -> go.Figure:
    """Data-parallel speedup over one GPU against per-rank bandwidth (bytes/s), one line per overlap fraction:
    the ring AllReduce of `gradient_nbytes` on `devices` ranks costs ring_allreduce_bytes / bandwidth per step,
    of which the fraction `overlap` starts during the backward and hides behind the last of `accumulation_steps`
    micro-batches' backward at most (labkit.plan.step_seconds' one model of overlap).
    The bandwidth axis is viz.style's log_axis: round numbers only (decades over 3 decades or more: 0.1, 1,
    10, ... GB/s), spanning the bandwidths and the marker."""
    nbytes = ring_allreduce_bytes(gradient_nbytes, devices)
    rates = list(bandwidths)
    figure = go.Figure()

    def speedup(bandwidth: float, overlap: float) -> float:
        return data_parallel_speedup(devices, compute_seconds, nbytes / bandwidth, overlap, accumulation_steps)

    backward = hideable_seconds(compute_seconds, accumulation_steps)   # the last micro-batch's backward
    for overlap in overlaps:
        name = (f"up to {overlap:.0%} of the AllReduce hidden, behind the last {backward:.2g} s of backward"
                if overlap else "nothing hidden")
        figure.add_scatter(x=[b / GB for b in rates], y=[speedup(b, overlap) for b in rates], mode="lines", name=name)
    if marker_bandwidth:
        figure.add_scatter(x=[marker_bandwidth / GB], y=[speedup(marker_bandwidth, overlaps[0])], mode="markers",
                           name="your link", marker={"size": 12, "color": RED})
    figure.add_hline(y=devices, line={"dash": "dash", "color": GREY},
                     annotation_text=f"{devices}x: communication for free", annotation_position="top right")
    shown = [*rates, marker_bandwidth] if marker_bandwidth else rates
    figure.update_xaxes(**log_axis("per-rank bandwidth, GB/s (one direction)", [b / GB for b in shown]))
    figure.update_layout(title=f"Speedup of {devices} data-parallel GPUs over one",
                         yaxis_title="speedup over one GPU (x)", yaxis_range=[0, devices * 1.08], height=380,
                         margin={"t": 50})
    return figure
