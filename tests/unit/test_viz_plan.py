"""The planning figures and the planner widget redraw from labkit.plan."""

import plotly.graph_objects as go
import pytest

from labkit.plan import (
    YOUR_CHOICE,
    activation_nbytes,
    memory_options,
    training_memory,
    zero_memory_table,
    zero_traffic_bytes,
)
from labkit.viz import zero_memory_bars
from labkit.viz.plan import STAGE_LABELS, memory_bars, speedup_chart
from labkit.widgets import FigureSlot, planner
from labkit.widgets.planner import CONVENTIONS


def test_memory_bars_stack_the_three_parts_under_the_gpu_line():
    figure = memory_bars(memory_options(7e9, 8), gpu_nbytes=80e9)
    assert [trace.name for trace in figure.data] == ["weights", "grads", "optimizer"]
    assert figure.data[2].y[0] == pytest.approx(84)  # replicated: 12 bytes x 7e9 in GB
    assert figure.layout.shapes[0].y0 == 80 and "GB" in figure.layout.yaxis.title.text
    line = figure.layout.shapes[0]   # named in the legend: no text drawn over the bars
    assert line.showlegend and line.name == "GPU memory 80 GB" and not figure.layout.annotations
    assert figure.layout.title.text == "Memory per GPU before activations"


def test_zero_memory_bars_are_plans_numbers_stage_by_stage():
    table = zero_memory_table(7.5e9, dp=64)                           # the ZeRO paper's figure 1
    figure = zero_memory_bars(table, gpu_nbytes=32e9)
    assert [trace.name for trace in figure.data] == ["weights", "grads", "optimizer"]
    assert list(figure.data[0].x) == [STAGE_LABELS[stage] for stage in range(4)]
    for trace in figure.data:                                         # each part's height is plan's bytes in GB
        assert list(trace.y) == pytest.approx([table[stage][trace.name] / 1e9 for stage in range(4)])
    tops = [sum(trace.y[i] for trace in figure.data) for i in range(4)]
    assert tops == pytest.approx([120, 31.40625, 16.640625, 1.875])
    totals = [a for a in figure.layout.annotations if not a.text.startswith("GPU memory")]
    assert [a.text for a in totals] == ["120.0 GB", "31.4 GB", "16.6 GB", "1.9 GB"]
    assert [a.y for a in totals] == pytest.approx(tops) and [a.x for a in totals] == list(figure.data[0].x)
    assert figure.layout.barmode == "stack" and figure.layout.shapes[0].y0 == 32


def test_zero_memory_bars_draw_the_stages_they_are_given_and_refuse_others():
    table = zero_memory_table(1e9, dp=4)
    figure = zero_memory_bars({stage: table[stage] for stage in (0, 3)})
    assert list(figure.data[0].x) == [STAGE_LABELS[0], STAGE_LABELS[3]] and not figure.layout.shapes
    for bad in ({4: table[0]}, {}):
        with pytest.raises(ValueError, match=r"pass plan.zero_memory_table's dict, keyed by ZeRO stage 0, 1, 2 or 3"):
            zero_memory_bars(bad)


def test_zero_memory_bars_draw_measured_megabytes_with_plans_totals_beside_them():
    measured = zero_memory_table(1e6, dp=4, weight_bytes=4, grad_bytes=4, optimizer_bytes=8)  # a small fp32 model
    predicted = {stage: {**parts, "total": parts["total"] * 1.01} for stage, parts in measured.items()}
    figure = zero_memory_bars(measured, gpu_nbytes=12e6, unit="MB", predicted=predicted)
    assert list(figure.data[0].y) == pytest.approx([4, 4, 4, 1])                  # weights in MB (1e6 bytes)
    assert [a.text for a in figure.layout.annotations] == ["16.0 MB", "10.0 MB", "7.0 MB", "4.0 MB"]
    assert figure.layout.shapes[0].y0 == 12 and "MB (1e6 bytes)" in figure.layout.yaxis.title.text
    marks = figure.data[-1]
    assert marks.name == "predicted total (plan)" and list(marks.y) == pytest.approx([16.16, 10.1, 7.07, 4.04])
    assert "GB (1e9 bytes)" in zero_memory_bars(measured).layout.yaxis.title.text  # GB unless told otherwise
    with pytest.raises(ValueError, match=r"unit='kB': use one of 'GB', 'MB'"):
        zero_memory_bars(measured, unit="kB")
    with pytest.raises(ValueError, match=r"predicted has stages \[5\]"):
        zero_memory_bars(measured, predicted={5: measured[0]})


def test_speedup_chart_reaches_the_device_count_on_fast_links():
    figure = speedup_chart(8, 1.0, 14e9, [1e9, 14.7e9, 1e13], overlaps=(0.0,))
    speedups = figure.data[0].y
    assert speedups[1] == pytest.approx(3.0, rel=1e-3) and speedups[0] < speedups[1] < speedups[2] < 8
    assert figure.layout.shapes[0].y0 == 8


def test_speedup_chart_hides_only_behind_the_last_micro_batchs_backward():
    # the lesson's step with 2 micro-batches: at 12.25 GB/s, all of the AllReduce started early, 3x (issue 25)
    figure = speedup_chart(8, 1.0, 14e9, [12.25e9, 36.75e9, 73.5e9], overlaps=(0.0, 1.0), accumulation_steps=2)
    nothing, all_started = figure.data[0], figure.data[1]
    assert list(all_started.y) == pytest.approx([3.0, 6.0, 8.0])
    assert list(nothing.y) == pytest.approx([8 / (1 + 2.0), 8 / (1 + 2 / 3), 8 / (1 + 1 / 3)])
    assert nothing.name == "nothing hidden" and all_started.name == ("up to 100% of the AllReduce hidden, behind the "
                                                                    "last 0.33 s of backward")


def test_the_bandwidth_axis_is_the_shared_log_axis():
    figure = speedup_chart(8, 1.0, 14e9, [10 ** (k / 20) * 1e9 for k in range(-20, 61)])
    assert figure.layout.xaxis.type == "log" and "GB/s" in figure.layout.xaxis.title.text
    assert list(figure.layout.xaxis.tickvals) == [0.1, 1, 10, 100, 1000]  # 4 decades: decades only
    assert list(figure.layout.xaxis.ticktext) == ["0.1", "1", "10", "100", "1k"]
    short = speedup_chart(8, 1.0, 14e9, [3e9, 42e9]).layout.xaxis  # under 3 decades: 1-2-5, not 2 decades
    assert list(short.tickvals) == [2, 5, 10, 20, 50]


def test_the_bandwidth_axis_reaches_a_marker_beyond_the_bandwidths():
    figure = speedup_chart(8, 1.0, 14e9, [1e9, 10e9], marker_bandwidth=400e9)
    low, high = figure.layout.xaxis.range
    assert low < 0 < 2.61 < high and figure.layout.xaxis.tickvals[-1] == 500  # log10 of 1 and 400 GB/s


def controls_of(app):
    left = app.children[0].children[0]
    return {c.description: c for c in left.children if c.description}, left.children[1]


def figures_of(app):
    return [slot.figure for slot in app.children[1].children]


def test_planner_recomputes_when_a_control_moves():
    app = planner()
    controls, _ = controls_of(app)
    summary, (memory, speed) = app.children[0].children[1], figures_of(app)
    assert isinstance(memory, go.Figure) and "does not fit" in summary.value
    controls["parameters"].value = "1B"
    assert "does not fit" in summary.value        # 16 GB of state, but 73 GB of activations at 7B's shape
    controls["model width"].value, controls["layers"].value = 2048, 16    # a 1B model's shape
    memory, speed = figures_of(app)
    assert "fits" in summary.value and "does not fit" not in summary.value
    assert f"{activation_nbytes(16, 2048, 32, 2048, 8) / 1e9:.1f} GB per GPU: 8 x 2,048 tokens" in summary.value
    assert memory.data[0].y[0] == pytest.approx(2.0)  # 1e9 bf16 weights = 2 GB
    before = speed.data[0].y
    controls["GPUs (data parallel)"].value = 4
    assert figures_of(app)[1].data[0].y != before and "64 (1 GPU: 16)" in summary.value


@pytest.mark.parametrize("text, params", [("70B", 70e9), ("6.7 billion", 6.7e9), ("7,000,000,000", 7e9),
                                          ("175 B", 175e9), ("1.5T", 1.5e12), ("350M", 350e6), ("7e9", 7e9)])
def test_planner_reads_sizes_as_people_type_them(text, params):
    app = planner()
    controls, note = controls_of(app)
    controls["parameters"].value = text
    memory = figures_of(app)[0]
    assert memory.data[0].y[0] == pytest.approx(2 * params / 1e9)  # bf16 weights, replicated
    assert f"= {params:,.0f} parameters" in note.value and len(memory.data[0].x) > 0


def test_planner_refuses_what_is_not_a_count_and_keeps_the_last_good_size():
    app = planner()
    controls, note = controls_of(app)
    summary = app.children[0].children[1]
    controls["parameters"].value = "70B"
    before, drawn = summary.value, figures_of(app)[0]
    controls["parameters"].value = "70 GB"
    assert "size in bytes, not a parameter count" in note.value and "Still planning for 70B" in note.value
    assert summary.value == before and figures_of(app)[0] is drawn
    controls["parameters"].value = "seventy"
    assert "not a parameter count" in note.value and "70B, 6.7 billion" in note.value
    controls["parameters"].value = "1B"
    assert "= 1,000,000,000 parameters" in note.value and "1B parameters" in figures_of(app)[0].layout.title.text


def test_planner_sizes_lora_by_the_model_it_is_told():
    app = planner()
    controls, _ = controls_of(app)
    controls["parameters"].value = "100M"
    controls["model width"].value = 512
    controls["layers"].value = 8
    memory = figures_of(app)[0]
    bars = dict(zip(memory.data[0].x, memory.data[0].y, strict=True))  # weights, GB
    adapters = 16 * (512 + 512) * 4 * 8                                 # rank 16 on q, k, v, o of 8 layers
    assert bars["LoRA r=16"] == pytest.approx(2 * (1e8 + adapters) / 1e9)


def test_planner_says_replicated_data_parallelism_pools_no_memory():
    app = planner()
    controls, _ = controls_of(app)
    summary = app.children[0].children[1]
    assert "replicated data parallelism (DDP) pools no memory" in summary.value and "TP x PP over 8" in summary.value
    assert "activation recomputation" not in summary.value      # 112 GB of state: recomputing cannot help
    controls["ZeRO stage (0 = DDP)"].value = 1                  # 38.5 GB of state and 73 GB of activations
    assert "does not fit" in summary.value and "pools no memory" not in summary.value
    assert "or full activation recomputation, or fewer sequences per micro-batch" in summary.value
    controls["recomputation"].value = "full"                    # 38.5 + 4.3 GB: sharded, it fits
    assert "fits" in summary.value and "does not fit" not in summary.value
    assert "4.3 GB per GPU: 8 x 2,048 tokens, each layer's input only" in summary.value


def test_planner_zero_stage_shards_the_memory_and_zero_3_moves_half_as_much_again():
    app = planner()
    controls, _ = controls_of(app)
    summary, stage = app.children[0].children[1], controls["ZeRO stage (0 = DDP)"]
    assert (stage.slider.min, stage.slider.max, stage.value) == (0, 3, 0)
    speedups = {}
    for k in (1, 2, 3, 0):
        stage.value = k
        memory, speed = figures_of(app)
        yours = memory.data[0].x.index(YOUR_CHOICE)
        assert sum(trace.y[yours] for trace in memory.data) == pytest.approx(training_memory(
            7e9, zero_stage=k, dp=8, activations_nbytes=activation_nbytes(32, 4096, 32, 2048, 8))["total"] / 1e9)
        assert f"{zero_traffic_bytes(7e9, 8, zero_stage=k) / 1e9:,.2f} GB per rank" in summary.value
        speedups[k] = speed.data[0].y
    assert "24.50 GB per rank: the gradients' AllReduce (DDP)" in summary.value
    stage.value = 3
    assert "36.75 GB per rank" in summary.value and "1.5x DDP's" in summary.value
    assert speedups[1] == speedups[2] == speedups[0] and all(   # the extra AllGather slows every slow link
        three < zero for three, zero in zip(speedups[3], speedups[0], strict=True) if zero < 7.9)
    controls["bytes per parameter"].value = "18 B (fp32 grads: Megatron-LM)"
    stage.value = 1                                                 # fp32 gradients out, bf16 weights back
    assert "0.75x DDP's" in summary.value


def test_planner_conventions_keep_their_byte_counts():
    app = planner()
    controls, _ = controls_of(app)
    for label, (weights, grads, optimizer) in CONVENTIONS.items():
        controls["bytes per parameter"].value = label
        assert label.startswith(f"{weights + grads + optimizer} B")
        assert sum(trace.y[0] for trace in figures_of(app)[0].data[:3]) == pytest.approx(
            7 * (weights + grads + optimizer))


def test_figures_take_the_width_their_slots_share():
    app = planner()
    assert all(figure.layout.width is None for figure in figures_of(app))  # each as wide as its slot
    assert all(slot.layout.flex == "1 1 460px" for slot in app.children[1].children)
    assert all(box.layout.flex_flow == "row wrap" for box in app.children)  # narrow windows stack, never clip


def test_a_figure_slot_replaces_its_figure_whole_in_one_output_and_stays_one_widget():
    slot = FigureSlot()
    assert slot.figure is None and slot.outputs == ()
    slot.draw(go.Figure(go.Bar(y=[1])))
    first, widget = slot.figure, slot.model_id
    slot.draw(go.Figure(go.Bar(y=[2]), layout_title_text="two"))
    (output,) = slot.outputs
    assert slot.figure is not first and slot.figure.data[0].y == (2,) and slot.model_id == widget
    document = output["data"]["application/vnd.plotly.v1+json"]
    assert document["data"][0]["y"] == [2] and document["layout"]["title"]["text"] == "two"
    assert document["layout"]["title"]["pad"]["t"] == 28 and document["layout"]["margin"]["t"] == 54
    assert document["config"]["displaylogo"] is False


def test_memory_bars_stack_activations_on_top_when_the_plans_count_them():
    options = memory_options(7e9, 8, sequence=2048, micro_batch=8)
    figure = memory_bars(options, gpu_nbytes=80e9)
    assert [trace.name for trace in figure.data] == ["weights", "grads", "optimizer", "activations"]
    assert figure.layout.title.text == "Memory per GPU, activations included"
    assert figure.data[3].y[0] == pytest.approx(34 * 2048 * 8 * 4096 * 32 / 1e9)   # 73.0 GB, replicated
    assert [sum(trace.y[i] for trace in figure.data) for i in range(len(options))] == pytest.approx(
        [option["total"] / 1e9 for option in options.values()])


def test_planner_counts_activations_with_the_recomputation_and_sequence_parallelism_chosen():
    app = planner()
    controls, _ = controls_of(app)
    summary = app.children[0].children[1]

    def bars():
        memory = figures_of(app)[0]
        assert memory.data[3].name == "activations"
        return dict(zip(memory.data[3].x, memory.data[3].y, strict=True))
    sbhl = 2048 * 8 * 4096 * 32 / 1e9                           # GB per unit of s b h L
    assert bars()["replicated"] == pytest.approx(34 * sbhl) and bars()["TP x PP over 8"] == pytest.approx(13 * sbhl)
    controls["sequence parallel (TP x PP)"].value = True         # equation 3: the replicated 10 sbh split too
    assert bars()["TP x PP over 8"] == pytest.approx(34 / 8 * sbhl) and bars()["replicated"] == pytest.approx(34 * sbhl)
    controls["flash attention"].value = False                   # the scores come back: + 5as/h = 80 sbh per layer
    assert bars()["replicated"] == pytest.approx(114 * sbhl)
    controls["recomputation"].value = "selective"
    assert bars()["replicated"] == pytest.approx(34 * sbhl)
    controls["sequence length"].value = 4096
    controls["per-device batch"].value = 2
    assert bars()["replicated"] == pytest.approx(34 * sbhl / 2) and "2 x 4,096 tokens" in summary.value
    assert "2 x 4,096 tokens" in figures_of(app)[0].layout.title.text
