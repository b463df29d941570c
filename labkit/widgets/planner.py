"""The planner: the worked 7B example with your own model, hardware and budget, recomputed on every change."""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go

from labkit import plan
from labkit.plan import GB
from labkit.viz.plan import memory_bars, speedup_chart

# bytes per parameter as (weights, grads, optimizer state). Sources: 16 B, Rajbhandari et al. 2020 ("ZeRO", section
# 3.1); 18 B, EleutherAI's "Transformer Math 101" (2023); 20 B, DeepSpeed's estimate_zero2_model_states_mem_needs.
CONVENTIONS = {
    "16 B: bf16 weights and grads, fp32 master + Adam (ZeRO paper)": (2, 2, 12),
    "18 B: fp32 grads (Megatron-LM, EleutherAI cookbook)": (2, 4, 12),
    "20 B: DeepSpeed's estimator (fp32 grads with the optimizer)": (2, 2, 16),
}


def planner(params: float = 7e9, gpu_memory_gb: float = 80) -> widgets.VBox:
    """Sliders for the scenario; a summary, the memory per GPU against the GPU's and the speedup against
    bandwidth, all redrawn from labkit.plan whenever a control moves."""
    style, wide = {"description_width": "170px"}, widgets.Layout(width="460px")

    def slider(kind, description, **kw):
        return kind(description=description, style=style, layout=wide, continuous_update=False, **kw)

    controls = {
        "params": slider(widgets.FloatLogSlider, "parameters", value=params, base=10, min=7, max=12, step=0.05),
        "per_device_batch": slider(widgets.IntSlider, "per-device batch", value=8, min=1, max=64),
        "devices": slider(widgets.IntSlider, "GPUs (data parallel)", value=8, min=1, max=64),
        "accumulation_steps": slider(widgets.IntSlider, "accumulation steps", value=2, min=1, max=64),
        "examples": slider(widgets.IntSlider, "examples per epoch", value=40_000, min=1_000, max=1_000_000,
                           step=1_000),
        "step_compute_seconds": slider(widgets.FloatSlider, "compute per step (s)", value=1.0, min=0.05, max=10,
                                       step=0.05),
        "bandwidth_gb": slider(widgets.FloatLogSlider, "per-rank bandwidth GB/s", value=25, base=10, min=-1, max=3,
                               step=0.05),
        "overlap": slider(widgets.FloatSlider, "AllReduce hidden", value=0.0, min=0, max=1, step=0.05,
                          readout_format=".0%"),
        "convention": widgets.Dropdown(options=list(CONVENTIONS), description="bytes per parameter", style=style,
                                       layout=wide),
        "zero_stage": slider(widgets.IntSlider, "ZeRO stage (0 = DDP)", value=0, min=0, max=3),
        "lora_rank": slider(widgets.IntSlider, "LoRA rank (0 = full)", value=0, min=0, max=256),
        "d_model": slider(widgets.IntSlider, "LoRA: model width", value=4096, min=256, max=16384, step=256),
        "layers": slider(widgets.IntSlider, "LoRA: layers", value=32, min=1, max=128),
        "gpu_memory_gb": slider(widgets.FloatSlider, "GPU memory GB", value=gpu_memory_gb, min=8, max=192, step=1),
    }
    summary = widgets.HTML()
    memory, speed = go.FigureWidget(), go.FigureWidget()

    def redraw(_=None) -> None:
        values = {name: control.value for name, control in controls.items()}
        weight_bytes, grad_bytes, optimizer_bytes = CONVENTIONS[values["convention"]]
        options = plan.memory_options(values["params"], values["devices"], lora_rank=values["lora_rank"],
                                      zero_stage=values["zero_stage"], weight_bytes=weight_bytes,
                                      grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes,
                                      d_model=values["d_model"], layers=values["layers"])
        summary.value = describe(values, options)
        memory_bars(options, values["gpu_memory_gb"] * GB, figure=memory)
        bandwidths = [10 ** (k / 10) * GB for k in range(-10, 31)]
        speedup_chart(values["devices"], values["step_compute_seconds"],
                      values["params"] * grad_bytes, bandwidths, overlaps=(values["overlap"],),
                      figure=speed, marker_bandwidth=values["bandwidth_gb"] * GB)

    for control in controls.values():
        control.observe(redraw, "value")
    redraw()
    left = widgets.VBox(list(controls.values()))
    return widgets.VBox([widgets.HBox([left, summary]), widgets.HBox([memory, speed])])


def describe(values: dict, options: dict[str, dict[str, float]]) -> str:
    """The planner's summary as HTML, from its control `values` and `memory_options`' result: batch, steps,
    clock, traffic, and whether your choice fits (with the ways out that do)."""
    weight_bytes, grad_bytes, optimizer_bytes = CONVENTIONS[values["convention"]]
    scenario = ("params", "per_device_batch", "devices", "accumulation_steps", "examples", "step_compute_seconds",
                "overlap")
    example = plan.worked_example(**{name: values[name] for name in scenario}, gradient_bytes_per_param=grad_bytes,
                                  bytes_per_param=weight_bytes + grad_bytes + optimizer_bytes,
                                  bandwidth=values["bandwidth_gb"] * GB)
    gpu_memory_gb, devices = values["gpu_memory_gb"], values["devices"]
    yours = options[plan.YOUR_CHOICE]["total"]
    fits = [name for name, option in options.items() if option["total"] <= gpu_memory_gb * GB]
    ways_out = ", ".join(fits) or "more GPUs with ZeRO-3 or tensor x pipeline parallelism, or a smaller model"
    replicated = values["zero_stage"] == 0 and values["lora_rank"] == 0
    why = "replicated data parallelism (DDP) pools no memory; " if replicated else ""
    verdict = ("<b style='color:#54a24b'>fits</b>" if yours <= gpu_memory_gb * GB else
               f"<b style='color:#e45756'>does not fit</b>: {why}try {ways_out}")
    rows = [
        ("effective batch", f"{example.parallel_batch:,} (1 GPU: {example.baseline_batch:,})"),
        ("steps per epoch", f"{example.parallel_steps:,} (1 GPU: {example.baseline_steps:,})"),
        ("epoch wall-clock", f"{example.parallel_epoch_seconds / 60:,.1f} min (1 GPU: "
                             f"{example.baseline_epoch_seconds / 60:,.1f} min)"),
        ("AllReduce traffic per step", f"{example.ring_bytes_per_rank / GB:,.2f} GB per rank"),
        ("its time at this bandwidth", f"{example.comm_seconds:,.3f} s, step {example.parallel_step_seconds:,.3f} s"),
        ("speedup over 1 GPU", f"{example.speedup:,.2f}x of {devices}x"),
        ("memory per GPU", f"{yours / GB:,.1f} GB of {gpu_memory_gb:g} GB: {verdict}"),
    ]
    body = "".join(f"<tr><td>{name}</td><td style='text-align:left'>{value}</td></tr>" for name, value in rows)
    return f"<table>{body}</table>"


def what_is_running_out(params_billions: float = 7, largest_layer_billions: float = 0.2,
                        gpu_memory_gb: float = 80) -> widgets.VBox:
    """Sliders for the model's and its largest layer's parameters and the GPU's memory; the strategy that
    `labkit.plan.parallelism_for` names first, and why (16 bytes per parameter: mixed-precision Adam)."""
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
        if layer.value > params.value:
            answer.value = "A layer cannot hold more than the whole model: lower the largest layer."
            return
        strategy, why = plan.parallelism_for(params.value * 1e9, layer.value * 1e9, gpu.value * GB)
        answer.value = f"<b>{strategy}</b>: {why}."

    for slider in (params, layer, gpu):
        slider.observe(redraw, "value")
    redraw()
    return widgets.VBox([params, layer, gpu, answer])
