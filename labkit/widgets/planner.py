"""The planner: the worked 7B example with your own model, hardware and budget, recomputed on every change."""

from __future__ import annotations

import html

import ipywidgets as widgets

from labkit import plan
from labkit.checks import number
from labkit.plan import GB
from labkit.viz.plan import memory_bars, speedup_chart
from labkit.viz.style import GREEN, RED
from labkit.widgets.app import App, prose
from labkit.widgets.figure_slot import FigureSlot
from labkit.widgets.typed import typed

__all__ = ["CONVENTIONS", "describe", "planner", "what_is_running_out"]

# bytes per parameter as (weights, grads, optimizer state). Sources: 16 B, Rajbhandari et al. 2020 ("ZeRO", section
# 3.1: bf16 weights and grads, fp32 master weights + Adam); 18 B, fp32 grads, as in Megatron-LM and EleutherAI's
# "Transformer Math 101" (2023); 20 B, DeepSpeed's estimate_zero2_model_states_mem_needs (fp32 grads with the
# optimizer). The labels stay short enough to read whole in the dropdown.
CONVENTIONS = {
    "16 B (ZeRO paper)": (2, 2, 12),
    "18 B (fp32 grads: Megatron-LM)": (2, 4, 12),
    "20 B (DeepSpeed's estimator)": (2, 2, 16),
}
RECOMPUTATION = {"none": "none", "selective (the attention scores)": "selective",
                 "full (keep each layer's input)": "full"}  # the dropdown's labels: plan.RECOMPUTE's choices
SEQUENCES = [2**k for k in range(7, 16)]  # 128 to 32,768 tokens
HEADS = [2**k for k in range(8)]  # 1 to 128: powers of two, so tp_in_node's degree divides every sequence above
LABEL_WIDTH, CONTROL_WIDTH = "180px", "450px"  # fit a 1280 px window with the file browser open
_LABEL_STYLE = {"description_width": LABEL_WIDTH}
NOTE = "<div style='font-size:0.9em; line-height:1.3'>{}</div>"  # under the parameters field, 3 lines at most


def planner(params: float = 7e9, gpu_memory_gb: float = 80) -> App:
    """Controls for the scenario (the model's size typed as people write it: 70B, 6.7 billion, 7e9); a summary,
    the memory per GPU against the GPU's and the speedup against bandwidth, all redrawn from labkit.plan whenever
    a control changes. The ZeRO stage (0 = replicated DDP, 1-3 sharded) sets "your choice"'s memory
    (plan.memory_options) and the traffic per step that the clock and the speedup count (ZeRO-3: 1.5x DDP's).
    Every way's memory includes its activations (plan.activation_nbytes): one micro-batch of "per-device batch"
    sequences of the sequence length through a model of the width, layers and heads given, with the recomputation
    chosen; sequence parallelism applies to the "TP x PP" way, the only one that splits layers.
    A size that does not read as a count is refused with a message; the last good one stays, and so does a
    slider's value typed as no value it takes (labkit.widgets.typed)."""
    good = {"params": number("params", params, inclusive=False)}
    size = _control(widgets.Text, "parameters", value=plan.format_count(params), placeholder="70B, 6.7 billion, 7e9")
    size_note = widgets.HTML(layout=widgets.Layout(width=CONTROL_WIDTH, height="4.2em"))  # 3 lines: never moves
    controls = _controls(gpu_memory_gb)
    # the summary takes the room beside the controls, whatever its text: a longer verdict wraps, nothing moves
    summary = widgets.HTML(layout=widgets.Layout(flex="1 1 300px", min_width="300px"))
    memory, speed = FigureSlot.in_row(), FigureSlot.in_row()  # side by side where they fit, else each full width

    def redraw(_=None) -> None:
        values = {"params": good["params"], **{name: control.value for name, control in controls.items()}}
        _draw(values, summary, memory, speed)

    size.observe(lambda _: _read_size(size.value, good, size_note) and redraw(), "value")
    for control in controls.values():
        control.observe(redraw, "value")
    _read_size(size.value, good, size_note)
    redraw()
    left = widgets.VBox([size, size_note, *map(typed, controls.values())], layout=widgets.Layout(flex="0 0 auto"))
    wrap = widgets.Layout(flex_flow="row wrap", align_items="flex-start", width="100%")
    return App([widgets.HBox([left, summary], layout=wrap), widgets.HBox([memory, speed], layout=wrap)])


def _control(kind, description: str, **kw) -> widgets.Widget:
    """A planner control: its label in the labels' column, its width the controls', read when let go (a slider)
    or when typed (a text field)."""
    return kind(description=description, style=_LABEL_STYLE, layout=widgets.Layout(width=CONTROL_WIDTH),
                continuous_update=False, **kw)


def _controls(gpu_memory_gb: float) -> dict[str, widgets.Widget]:
    """The planner's controls by the name the plan takes: the hardware, the training run, the ways to save
    memory, then the model's shape and what its activations keep."""
    return {
        "devices": _control(widgets.IntSlider, "GPUs (data parallel)", value=8, min=1, max=64),
        "gpu_memory_gb": _control(widgets.FloatSlider, "GPU memory GB", value=gpu_memory_gb, min=8, max=192, step=1),
        "bandwidth_gb": _control(widgets.FloatLogSlider, "per-rank bandwidth GB/s", value=25, base=10, min=-1, max=3,
                                step=0.05),
        "overlap": _control(widgets.FloatSlider, "AllReduce hidden", value=0.0, min=0, max=1, step=0.05,
                           readout_format=".0%"),
        "step_compute_seconds": _control(widgets.FloatSlider, "compute per step (s)", value=1.0, min=0.05, max=10,
                                        step=0.05),
        "per_device_batch": _control(widgets.IntSlider, "per-device batch", value=8, min=1, max=64),
        "accumulation_steps": _control(widgets.IntSlider, "accumulation steps", value=2, min=1, max=64),
        "examples": _control(widgets.IntSlider, "examples per epoch", value=40_000, min=1_000, max=1_000_000,
                            step=1_000),
        "convention": widgets.Dropdown(options=list(CONVENTIONS), description="bytes per parameter",
                                       style=_LABEL_STYLE, layout=widgets.Layout(width=CONTROL_WIDTH)),
        "zero_stage": _control(widgets.IntSlider, "ZeRO stage (0 = DDP)", value=0, min=0, max=3),
        "lora_rank": _control(widgets.IntSlider, "LoRA rank (0 = full)", value=0, min=0, max=256),
        "d_model": _control(widgets.IntSlider, "model width", value=4096, min=256, max=16384, step=256),
        "layers": _control(widgets.IntSlider, "layers", value=32, min=1, max=128),
        "heads": _control(widgets.SelectionSlider, "attention heads", options=HEADS, value=32),
        "sequence": _control(widgets.SelectionSlider, "sequence length", options=SEQUENCES, value=2048),
        "recompute": widgets.Dropdown(options=list(RECOMPUTATION.items()), value="none", description="recomputation",
                                      style=_LABEL_STYLE, layout=widgets.Layout(width=CONTROL_WIDTH)),
        "flash_attention": widgets.Checkbox(value=True, description="flash attention", style=_LABEL_STYLE,
                                            layout=widgets.Layout(width=CONTROL_WIDTH)),
        "sequence_parallel": widgets.Checkbox(value=False, description="sequence parallel (TP x PP)",
                                              style=_LABEL_STYLE, layout=widgets.Layout(width=CONTROL_WIDTH)),
    }


def _read_size(text: str, good: dict, note: widgets.HTML) -> bool:
    """Take the typed size into good["params"] if it reads as a count (the note says what it read); else the note
    says why, and the last good size stays."""
    try:
        good["params"] = plan.parse_count(text)
    except ValueError as error:
        note.value = NOTE.format(f"<span style='color:{RED}'>{html.escape(str(error))}</span> Still "
                                 f"planning for {plan.format_count(good['params'])}.")
        return False
    note.value = NOTE.format(f"= {good['params']:,.0f} parameters (70B, 6.7 billion, 7e9, 350M, 1.5T all work)")
    return True


def _draw(values: dict, summary: widgets.HTML, memory: FigureSlot, speed: FigureSlot) -> None:
    """Recompute the plan for the controls' `values`: the summary, the memory bars, the speedup chart."""
    weight_bytes, grad_bytes, optimizer_bytes = CONVENTIONS[values["convention"]]
    options = plan.memory_options(values["params"], values["devices"], lora_rank=values["lora_rank"],
                                  zero_stage=values["zero_stage"], weight_bytes=weight_bytes,
                                  grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes,
                                  d_model=values["d_model"], layers=values["layers"], **_activation_settings(values))
    summary.value = describe(values, options)
    memory.draw(memory_bars(options, values["gpu_memory_gb"] * GB, title=(
        f"Memory per GPU, {plan.format_count(values['params'])} parameters, "
        f"{values['per_device_batch']} x {values['sequence']:,} tokens"
    )))
    bandwidths = [10 ** (k / 10) * GB for k in range(-10, 31)]
    speed.draw(speedup_chart(values["devices"], values["step_compute_seconds"],
                             values["params"] * _traffic_bytes_per_param(values), bandwidths,
                             overlaps=(values["overlap"],), marker_bandwidth=values["bandwidth_gb"] * GB,
                             accumulation_steps=values["accumulation_steps"]).update_layout(
        legend={"orientation": "h", "x": 0, "y": -0.3, "yanchor": "top"}, height=430))


def _activation_settings(values: dict) -> dict:
    """memory_options' activation arguments from the controls: a micro-batch is the per-device batch."""
    return {"sequence": values["sequence"], "micro_batch": values["per_device_batch"], "heads": values["heads"],
            "recompute": values["recompute"], "flash_attention": values["flash_attention"],
            "sequence_parallel": values["sequence_parallel"], "accumulation_steps": values["accumulation_steps"]}


def describe(values: dict, options: dict[str, dict[str, float]]) -> str:
    """The planner's summary as HTML, from its control `values` and `memory_options`' result: batch, steps,
    clock, traffic, your choice's activations, and whether it fits with them (with the ways out that do)."""
    weight_bytes, grad_bytes, optimizer_bytes = CONVENTIONS[values["convention"]]
    scenario = ("params", "per_device_batch", "devices", "accumulation_steps", "examples", "step_compute_seconds",
                "overlap")
    example = plan.worked_example(**{name: values[name] for name in scenario},
                                  gradient_bytes_per_param=_traffic_bytes_per_param(values),
                                  bytes_per_param=weight_bytes + grad_bytes + optimizer_bytes,
                                  bandwidth=values["bandwidth_gb"] * GB)
    gpu_memory_gb, devices = values["gpu_memory_gb"], values["devices"]
    yours, activations = options[plan.YOUR_CHOICE]["total"], options[plan.YOUR_CHOICE].get("activations", 0)
    fits = [name for name, option in options.items() if option["total"] <= gpu_memory_gb * GB]
    ways_out = ", ".join(fits) or "more GPUs with ZeRO-3 or tensor x pipeline parallelism, or a smaller model"
    if values["recompute"] != "full" and yours - activations <= gpu_memory_gb * GB:   # the activations tip it over
        ways_out += "; or full activation recomputation, or fewer sequences per micro-batch"
    replicated = values["zero_stage"] == 0 and values["lora_rank"] == 0
    why = "replicated data parallelism (DDP) pools no memory; " if replicated else ""
    verdict = (f"<b style='color:{GREEN}'>fits</b>" if yours <= gpu_memory_gb * GB else
               f"<b style='color:{RED}'>does not fit</b>: {why}try {ways_out}")
    kept = {"none": "no recomputation", "selective": "the attention scores recomputed",
            "full": "each layer's input only"}[values["recompute"]]
    rows = [
        ("effective batch", f"{example.parallel_batch:,} (1 GPU: {example.baseline_batch:,})"),
        ("steps per epoch", f"{example.parallel_steps:,} (1 GPU: {example.baseline_steps:,})"),
        ("epoch wall-clock", f"{example.parallel_epoch_seconds / 60:,.1f} min (1 GPU: "
                             f"{example.baseline_epoch_seconds / 60:,.1f} min)"),
        ("traffic per step", f"{example.ring_bytes_per_rank / GB:,.2f} GB per rank: {_collectives(values)}"),
        ("its time at this bandwidth", f"{example.comm_seconds:,.3f} s, step {example.parallel_step_seconds:,.3f} s"),
        ("speedup over 1 GPU", f"{example.speedup:,.2f}x of {devices}x"),
        ("activations", f"{activations / GB:,.1f} GB per GPU: {values['per_device_batch']} x "
                        f"{values['sequence']:,} tokens, {kept}"),
        ("memory per GPU", f"{yours / GB:,.1f} GB of {gpu_memory_gb:g} GB: {verdict}"),
    ]
    body = "".join(f"<tr><td style='white-space:nowrap; vertical-align:top'>{name}</td>"
                   f"<td style='text-align:left'>{value}</td></tr>" for name, value in rows)
    return f"<table style='line-height:1.4'>{body}</table>"


def _traffic_bytes_per_param(values: dict) -> float:
    """Bytes per parameter of the one AllReduce that moves what a step of the chosen ZeRO stage moves: the planner
    clocks communication as an AllReduce (worked_example, speedup_chart), and an AllReduce of b bytes is a
    ReduceScatter and an AllGather of b, so b is half of what the stage's collectives carry
    (plan.zero_collective_bytes_per_param): the gradient bytes for DDP, 1.5x them for ZeRO-3 with bf16 throughout."""
    weight_bytes, grad_bytes, _ = CONVENTIONS[values["convention"]]
    return plan.zero_collective_bytes_per_param(values["zero_stage"], weight_bytes, grad_bytes) / 2


def _collectives(values: dict) -> str:
    """What the chosen ZeRO stage's collectives are, and how their bytes compare with DDP's AllReduce."""
    stage = values["zero_stage"]
    if stage == 0:
        return "the gradients' AllReduce (DDP)"
    weight_bytes, grad_bytes, _ = CONVENTIONS[values["convention"]]
    ratio = plan.zero_collective_bytes_per_param(stage, weight_bytes, grad_bytes) / (2 * grad_bytes)
    gathered = "the weights before the forward and again before the backward" if stage == 3 else "the new weights"
    return f"ZeRO-{stage} ReduceScatters the gradients and AllGathers {gathered}: {ratio:.3g}x DDP's"


def what_is_running_out(params_billions: float = 7, largest_layer_billions: float = 0.2,
                        gpu_memory_gb: float = 80) -> App:
    """Sliders for the model's and its largest layer's parameters and the GPU's memory; the strategy that
    `labkit.plan.parallelism_for` names first, and why (16 bytes per parameter: mixed-precision Adam). A largest
    layer above the whole model is refused with a message, as parallelism_for refuses it."""
    style, wide = {"description_width": "220px"}, widgets.Layout(width="540px")
    params = widgets.FloatLogSlider(value=params_billions, base=10, min=-1, max=3, step=0.05,
                                    description="parameters, billions", style=style, layout=wide,
                                    continuous_update=False)
    layer = widgets.FloatLogSlider(value=largest_layer_billions, base=10, min=-3, max=3, step=0.05,
                                   description="largest layer, billions of params", style=style, layout=wide,
                                   continuous_update=False)
    gpu = widgets.FloatSlider(value=gpu_memory_gb, min=8, max=192, step=1, description="GPU memory, GB", style=style,
                              layout=wide, continuous_update=False)
    answer = widgets.HTML()

    def redraw(_=None) -> None:
        try:
            strategy, why = plan.parallelism_for(params.value * 1e9, layer.value * 1e9, gpu.value * GB)
        except ValueError:  # the sliders allow only one nonsense: a layer larger than the model it is part of
            answer.value = prose(f"<span style='color:{RED}'>A layer is part of the model: the largest layer "
                                 f"({layer.value:.3g} billion parameters) cannot hold more than the whole model "
                                 f"({params.value:.3g} billion).</span> Lower the largest layer or raise the "
                                 "parameters.")
            return
        answer.value = prose(f"<b>{strategy}</b>: {why}.")

    for slider in (params, layer, gpu):
        slider.observe(redraw, "value")
    redraw()
    return App([*map(typed, (params, layer, gpu)), answer])
