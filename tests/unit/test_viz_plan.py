"""The planning figures and the planner widget redraw from labkit.plan."""

import plotly.graph_objects as go
import pytest

from labkit.plan import memory_options
from labkit.viz.plan import memory_bars, speedup_chart
from labkit.widgets import planner


def test_memory_bars_stack_the_three_parts_under_the_gpu_line():
    figure = memory_bars(memory_options(7e9, 8), gpu_nbytes=80e9)
    assert [trace.name for trace in figure.data] == ["weights", "grads", "optimizer"]
    assert figure.data[2].y[0] == pytest.approx(84)  # replicated: 12 bytes x 7e9 in GB
    assert figure.layout.shapes[0].y0 == 80


def test_speedup_chart_reaches_the_device_count_on_fast_links():
    figure = speedup_chart(8, 1.0, 14e9, [1e9, 14.7e9, 1e13], overlaps=(0.0,))
    speedups = figure.data[0].y
    assert speedups[1] == pytest.approx(3.0, rel=1e-3) and speedups[0] < speedups[1] < speedups[2] < 8


def test_planner_recomputes_when_a_control_moves():
    app = planner()
    controls = {c.description: c for c in app.children[0].children[0].children}
    summary, (memory, speed) = app.children[0].children[1], app.children[1].children
    assert isinstance(memory, go.FigureWidget) and "does not fit" in summary.value
    controls["parameters"].value = 1e9
    assert "fits" in summary.value and "does not fit" not in summary.value
    assert memory.data[0].y[0] == pytest.approx(2.0)  # 1e9 bf16 weights = 2 GB
    before = speed.data[0].y
    controls["GPUs (data parallel)"].value = 4
    assert speed.data[0].y != before and "64 (1 GPU: 16)" in summary.value


def test_planner_sizes_lora_by_the_model_it_is_told():
    app = planner()
    controls = {c.description: c for c in app.children[0].children[0].children}
    memory = app.children[1].children[0]
    controls["parameters"].value = 1e8
    controls["LoRA: model width"].value = 512
    controls["LoRA: layers"].value = 8
    bars = dict(zip(memory.data[0].x, memory.data[0].y, strict=True))  # weights, GB
    adapters = 16 * (512 + 512) * 4 * 8                                 # rank 16 on q, k, v, o of 8 layers
    assert bars["LoRA r=16"] == pytest.approx(2 * (1e8 + adapters) / 1e9)


def test_planner_says_replicated_data_parallelism_pools_no_memory():
    app = planner()
    controls = {c.description: c for c in app.children[0].children[0].children}
    summary = app.children[0].children[1]
    assert "replicated data parallelism (DDP) pools no memory" in summary.value and "ZeRO-3 over 8" in summary.value
    controls["ZeRO stage (0 = DDP)"].value = 1                  # 38.5 GB per GPU: sharded, it fits
    assert "fits" in summary.value and "pools no memory" not in summary.value
