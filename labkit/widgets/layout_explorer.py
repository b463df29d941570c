"""The layout explorer: choose how a world of ranks trains a GPT (dp x pp x cp x ep x tp, micro-batches, chunks per
stage, sequence parallelism, and experts per block for a mixture of experts) and see what labkit.plan predicts for
that layout: each axis's traffic per rank per step, the pipeline's bubble, the training state each rank holds and
the activations it keeps. Every number is plan's, for every rank, so a run of labkit.parallel.ThreeDGPT with the
same layout can be checked against what the explorer shows (ContextParallelGPT's traffic with cp, and
ExpertParallelGPT's with ep; the training state is AdamW's, as ThreeDGPT trains, where those two use SGD).

    suggested_layout(world_size)                 (dp, pp, tp): tp = 2 and pp = 2 where the world allows
    plan_layout(shape, layout, batch, ...)       LayoutPlan: plan's traffic, memory and bubble, rank by rank
    .network_nbytes(rank, ranks_per_node)        the bytes a rank sends over links between nodes, per axis
    LayoutExplorer(shape, world_size, batch)     the widget; .set_layout(dp=.., pp=.., tp=..) moves its controls
"""

from __future__ import annotations

import html
from dataclasses import dataclass, replace

import ipywidgets as widgets

from labkit.checks import rank_count, whole
from labkit.plan import (
    GPTShape,
    ParallelLayout,
    activation_nbytes,
    axis_traffic,
    axis_wire_bytes,
    bubble_fraction,
    check_fit,
    rank_layers,
    rank_params,
    training_memory,
)
from labkit.plan.context_parallel import held_positions
from labkit.viz.axis_chart import axis_traffic_bars, byte_unit
from labkit.viz.plan import memory_bars
from labkit.viz.style import RED
from labkit.widgets.app import App, prose
from labkit.widgets.figure_slot import FigureSlot
from labkit.widgets.typed import typed

__all__ = ["AXIS_WHEN", "LayoutExplorer", "LayoutPlan", "plan_layout", "suggested_layout"]

AXES = ("dp", "pp", "cp", "ep", "tp")  # outermost to innermost, as labkit.parallel.mesh.ALL_AXES (cp, ep when > 1)
EXPERT_CHOICES = (0, 4, 8, 16, 64)  # experts per block: 0 dense; 8 Mixtral's, 64 the fine-grained (notebook 13)
AXIS_WHEN = {  # when each axis's traffic moves in a step, and what waits for it (Narayanan et al. 2021, section 3)
    "tp": "inside every layer, every micro-batch: the next layer waits for the forward's",
    "cp": "every block's attention, every micro-batch: K and V passed around the ring beside each block's compute; "
          "and once per step the gradients' all-reduce",
    "ep": "every MoE block, every micro-batch: the routing counts, then each token's rows to its experts' ranks and "
          "back (two all-to-alls of rows forward, two backward), the block waiting on each; and once per step the "
          "replicated weights' gradients' all-reduce",
    "pp": "at each stage boundary, every micro-batch: point to point, one neighbour",
    "dp": "once per step, after the last micro-batch's backward: only that backward, and the drain on the later "
          "stages, can overlap it",
}
LABEL_WIDTH, CONTROL_WIDTH = "170px", "330px"
_LABEL_STYLE = {"description_width": LABEL_WIDTH}


def suggested_layout(world_size: int) -> tuple[int, int, int]:
    """(dp, pp, tp) for `world_size` ranks: tp = 2 when the world is even, pp = 2 when 4 divides it, dp the rest,
    so that 8 ranks get every axis at 2 (tp innermost, Narayanan et al. 2021's order), 4 ranks 1 x 2 x 2 and 2 ranks
    1 x 1 x 2.

    >>> [suggested_layout(n) for n in (1, 2, 4, 6, 8, 16)]
    [(1, 1, 1), (1, 1, 2), (1, 2, 2), (3, 1, 2), (2, 2, 2), (4, 2, 2)]
    """
    world = rank_count(world_size)
    tp = 2 if world % 2 == 0 else 1
    pp = 2 if world % 4 == 0 else 1
    return world // (pp * tp), pp, tp


@dataclass(frozen=True)
class LayoutPlan:
    """What labkit.plan predicts for one layout, entry r for global rank r: `traffic[r]` the bytes it hands to each
    axis's collectives per step, by collective (plan.axis_traffic: what count_collectives().by_axis counts),
    `wire[r]` what ring collectives then send per axis (plan.axis_wire_bytes), `memory[r]` its training state
    (plan.training_memory of plan.rank_params: weights, gradients and AdamW's two moments, a number each), and
    `bubble` the pipeline's idle share, (p-1)/(v m + p-1) (plan.bubble_fraction), `activations[r]` the bytes it
    keeps for the backward, and the `shape` planned."""

    layout: ParallelLayout
    traffic: list[dict[str, dict[str, int]]]
    wire: list[dict[str, float]]
    memory: list[dict[str, float]]
    bubble: float
    activations: list[float]
    shape: GPTShape | None = None  # the model planned

    def axis_nbytes(self, rank: int) -> dict[str, int]:
        """Bytes rank `rank` hands to each axis per step, its collectives added up."""
        return {axis: sum(self.traffic[rank].get(axis, {}).values()) for axis in self.layout.axes}

    def network_nbytes(self, rank: int, ranks_per_node: int) -> dict[str, float]:
        """Bytes rank `rank` sends per step over the links between nodes, per axis, when each node holds
        `ranks_per_node` consecutive ranks (a launcher numbers one node's GPUs consecutively, torchrun's local
        ranks): an axis whose group spans two nodes or more counts its wire bytes whole, since a ring's steps run
        in lockstep at its slowest link's pace; an axis kept inside a node counts 0.

        >>> shape = GPTShape(vocab=82, d_model=32, layers=2, heads=4, context=32)
        >>> planned = plan_layout(shape, ParallelLayout(dp=2, pp=2, tp=2, microbatches=2), 16, bytes_per_number=8)
        >>> planned.network_nbytes(5, ranks_per_node=2)   # tp partner 4 shares the node; pp's 7 and dp's 1 do not
        {'dp': 70384.0, 'pp': 65536.0, 'tp': 0.0}
        """
        node = whole("ranks_per_node", ranks_per_node)
        return {axis: self.wire[rank][axis] if len({r // node for r in _group(self.layout, rank, axis)}) > 1 else 0.0
                for axis in self.layout.axes}


def plan_layout(shape: GPTShape, layout: ParallelLayout, batch: int, sequence: int | None = None,
                bytes_per_number: int = 4) -> LayoutPlan:
    """plan's prediction for every rank of `layout` training `shape` on steps of `batch` sequences of `sequence`
    tokens (None: the context), numbers of `bytes_per_number` bytes (8: float64), with AdamW (as
    labkit.parallel.ThreeDGPT trains); ValueError (plan.check_fit's) when the layout cannot split that model and
    batch.

    >>> shape = GPTShape(vocab=82, d_model=32, layers=2, heads=4, context=32)
    >>> layout = ParallelLayout(dp=2, pp=2, tp=2, microbatches=2)
    >>> planned = plan_layout(shape, layout, batch=16, bytes_per_number=8)
    >>> len(planned.traffic), planned.traffic[5] == axis_traffic(shape, layout, 16, 5, bytes_per_number=8)
    (8, True)
    >>> planned.memory[5]["total"] == 4 * 8 * rank_params(shape, layout, 5), round(planned.bubble, 3)
    (True, 0.333)
    """
    check_fit(shape, layout, whole("batch", batch), sequence)
    nbytes = whole("bytes_per_number", bytes_per_number)
    ranks = range(layout.world_size)
    traffic = [axis_traffic(shape, layout, batch, rank, sequence, nbytes) for rank in ranks]
    memory = [training_memory(rank_params(shape, layout, rank), nbytes, nbytes, 2 * nbytes) for rank in ranks]
    activations = [_activations(shape, layout, batch, rank, sequence, nbytes) for rank in ranks]
    return LayoutPlan(layout, traffic, [axis_wire_bytes(t, layout) for t in traffic], memory,
                      bubble_fraction(layout.pp, layout.microbatches, layout.chunks), activations, shape)


def _activations(shape: GPTShape, layout: ParallelLayout, batch: int, rank: int, sequence: int | None,
                 nbytes: int) -> float:
    """Bytes of activations `rank` keeps for the backward at its peak: its blocks' (plan.activation_nbytes,
    Korthikanti et al. 2022, FlashAttention's count) for a micro-batch of its tokens (1/cp of each sequence), times
    the micro-batches 1F1B holds on its stage, min(pp - stage, m) (interleaved: about as many). A MoE block is
    counted as the paper's dense block (the summary says so): its k experts per token keep more."""
    blocks = sum(1 <= layer <= shape.layers for piece in rank_layers(shape, layout, rank) for layer in piece)
    place, s = layout.place(rank), shape.context if sequence is None else sequence
    held = s if layout.cp == 1 else held_positions(s, layout.cp)[place["cp"]]
    one = activation_nbytes(blocks, shape.d_model, shape.heads, held,
                            batch // (layout.dp * layout.ep * layout.microbatches),
                            tp=layout.tp, sequence_parallel=layout.sequence_parallel and layout.tp > 1,
                            bytes_per_value=nbytes) if blocks else 0.0
    return one * min(layout.pp - place["pp"], layout.microbatches)


def _group(layout: ParallelLayout, rank: int, axis: str) -> list[int]:
    """The global ranks of `rank`'s group on `axis`: the ranks that differ from it on that axis alone."""
    place = layout.place(rank)

    def global_rank(i: int) -> int:
        at = {"cp": 0, "ep": 0, **place, axis: i}
        inner = (at["dp"] * layout.pp + at["pp"]) * layout.cp + at["cp"]
        return (inner * layout.ep + at["ep"]) * layout.tp + at["tp"]

    return [global_rank(i) for i in range(layout.size(axis))]


def _span(least: float, most: float, unit: tuple[str, float]) -> str:
    """"least to most", or one amount where every rank holds the same."""
    return _amount(least, unit) if _amount(least, unit) == _amount(most, unit) else \
        f"{_amount(least, unit)} to {_amount(most, unit)}"


def _amount(nbytes: float, unit: tuple[str, float]) -> str:
    name, size = unit
    return f"{nbytes / size:.3g} {name}"


class LayoutExplorer(App):
    """Controls for dp, pp, cp, ep and tp (each a divisor of `world_size`; their product must be the world, or the
    summary says what to change; cp splits every sequence, context parallelism; ep splits each block's experts),
    the micro-batches per step, the chunks per stage (interleaved 1F1B when >= 2), sequence parallelism, and the
    experts per block with the top_k each token goes to (0 experts: `shape`'s dense MLP; each expert an MLP of
    `shape`'s d_ff, which for a MoEGPT labkit.parallel.experts_gpt.moe_gpt_shape reads off its experts); for a
    `shape` with experts the controls start at tp = 1 and ep = 2 where the experts and the world allow (experts
    are planned with tp = 1); beside them a summary of plan's
    prediction for `shape` trained on steps of `batch` sequences (`sequence` tokens each, numbers of
    `bytes_per_number` bytes): each axis's bytes per rank per step, handed to collectives and sent by ring
    collectives, and when they move; the bubble; the training state per rank and the activations it keeps. Below,
    the bytes per axis and the training state of each rank of replica 0 (every replica's equal).

    `controls` names the controls (dp, pp, cp, ep, tp, microbatches, chunks, sequence_parallel, experts, top_k),
    `summary` is the HTML
    beside them, `traffic_chart` and `memory_chart` the figures' FigureSlots, `planned` the LayoutPlan shown and
    `problem` why the controls' layout is not shown (None when it is). A layout that is refused leaves the last
    good one shown. `set_layout(dp=1, pp=2, tp=4)` sets several controls and redraws once.

    >>> explorer = LayoutExplorer(GPTShape(vocab=82, d_model=32, layers=2, heads=4, context=32), 8, batch=16)
    >>> explorer.set_layout(tp=4)
    >>> explorer.problem
    'dp=2 x pp=2 x tp=4 = 16 ranks, but the world has 8: pick sizes whose product is 8 (pp=2 x tp=4 leaves dp=1).'
    >>> explorer.set_layout(dp=1)
    >>> explorer.problem, explorer.planned.layout.tp, round(explorer.planned.bubble, 3)
    (None, 4, 0.333)
    """

    def __init__(self, shape: GPTShape, world_size: int, batch: int, sequence: int | None = None,
                 bytes_per_number: int = 4, microbatches: int = 2):
        if not isinstance(shape, GPTShape):
            raise TypeError(f"shape: a {type(shape).__name__}; pass a labkit.plan.GPTShape (for a TinyGPT: "
                            "labkit.parallel.gpt_shape(model)).")
        self.world_size = rank_count(world_size)
        self._model = {"shape": shape, "batch": whole("batch", batch), "sequence": sequence,
                       "bytes_per_number": whole("bytes_per_number", bytes_per_number)}
        self.controls = _controls(self.world_size, whole("microbatches", microbatches), shape)
        self.summary = widgets.HTML(layout=widgets.Layout(flex="1 1 420px", min_width="420px"))
        self.traffic_chart, self.memory_chart = FigureSlot.in_row(), FigureSlot.in_row()
        self.planned: LayoutPlan | None = None
        self.problem: str | None = None
        self._holding = False
        for control in self.controls.values():
            control.observe(self._redraw, "value")
        self._redraw()
        if self.planned is None:
            raise ValueError(f"LayoutExplorer: {self.problem} Pass a model and batch that "
                             f"dp, pp, tp = {suggested_layout(self.world_size)} can train.")
        wrap = widgets.Layout(flex_flow="row wrap", align_items="flex-start", width="100%")
        left = widgets.VBox(list(map(typed, self.controls.values())), layout=widgets.Layout(flex="0 0 auto"))
        super().__init__([widgets.HBox([left, self.summary], layout=wrap),
                          widgets.HBox([self.traffic_chart, self.memory_chart], layout=wrap)])

    def set_layout(self, **values) -> None:
        """Set the named controls (dp, pp, cp, ep, tp, microbatches, chunks, sequence_parallel, experts, top_k) at
        once, then redraw."""
        unknown = sorted(set(values) - set(self.controls))
        if unknown:
            raise ValueError(f"set_layout: {unknown} are no controls; pass some of {list(self.controls)}.")
        self._holding = True
        try:
            for name, value in values.items():
                self.controls[name].value = value
        finally:
            self._holding = False
        self._redraw()

    def _chosen(self) -> tuple[GPTShape, ParallelLayout]:
        """The model and the layout the controls hold: top_k is 1, and its control off, for a dense model."""
        values = {name: control.value for name, control in self.controls.items()}
        experts, top_k = values.pop("experts"), values.pop("top_k")
        self.controls["top_k"].disabled = not experts
        shape = replace(self._model["shape"], experts=experts, top_k=top_k if experts else 1)
        return shape, ParallelLayout(**values)

    def _redraw(self, _=None) -> None:
        """Plan the controls' layout and show it, or say why not and keep the last good one."""
        if self._holding:
            return
        try:
            shape, layout = self._chosen()
            self.problem = _world_problem(layout, self.world_size)
            if self.problem is None:
                self.planned = plan_layout(layout=layout, **{**self._model, "shape": shape})
        except ValueError as error:
            self.problem = _for_the_controls(str(error))
        if self.problem is None:
            self._draw_charts()
            self.summary.value = prose(_summary(self.planned))
        elif self.planned is not None:  # before the first good layout, __init__ raises with the problem
            self.summary.value = prose(_refusal(self.problem, self.planned))

    def _draw_charts(self) -> None:
        planned, layout = self.planned, self.planned.layout
        replica = range(layout.world_size // layout.dp)  # replica 0's ranks: every replica holds and sends the same
        labels = {rank: f"rank {rank}<br>" + " ".join(f"{axis}{index}" for axis, index in layout.place(rank).items()
                                                      if axis != "dp") for rank in replica}
        shown = _replica_shown(layout)
        title = (f"{_shape(layout)}, {layout.microbatches} micro-batches: bubble {planned.bubble:.1%}<br>"
                 f"<sup>bytes each rank hands to each axis's collectives per step</sup><br>"
                 f"<sup>{shown}</sup>")
        self.traffic_chart.draw(axis_traffic_bars({labels[r]: planned.axis_nbytes(r) for r in replica}, title))
        memory = {labels[r]: planned.memory[r] for r in replica}
        unit = "GB" if max(m["total"] for m in memory.values()) >= 1e9 else "MB"
        title = (f"Training state per rank, {_shape(layout)}<br><sup>weights, gradients, AdamW's m and v</sup><br>"
                 f"<sup>{shown}</sup>")
        self.memory_chart.draw(memory_bars(memory, title=title, unit=unit))


def _for_the_controls(problem: str) -> str:
    """plan's refusal, its remedy said in the explorer's controls."""
    return (problem.replace("pass sequence_parallel=False", "untick sequence parallelism (tp)")
            .replace("pass a GPTShape with experts, or ep=1", "pick experts per block, or ep=1"))


def _replica_shown(layout: ParallelLayout) -> str:
    """Which ranks the charts show, and why only those: replica 0's (dp 0), since every data-parallel replica
    holds and sends the same.

    >>> _replica_shown(ParallelLayout(dp=2, pp=2, tp=2)), _replica_shown(ParallelLayout(dp=1, pp=2, tp=2))
    ('ranks 0-3 of 8: replica dp 0 (dp 1 holds and sends the same)', 'ranks 0-3: every rank')
    """
    last = layout.world_size // layout.dp - 1
    ranks = "rank 0" if last == 0 else f"ranks 0-{last}"
    if layout.dp == 1:
        return f"{ranks}: every rank"
    others = "dp 1 holds and sends" if layout.dp == 2 else f"dp 1-{layout.dp - 1} hold and send"
    return f"{ranks} of {layout.world_size}: replica dp 0 ({others} the same)"


def _controls(world_size: int, microbatches: int, shape: GPTShape) -> dict[str, widgets.Widget]:
    """The explorer's controls, named as ParallelLayout's fields (and GPTShape's experts and top_k), starting at
    suggested_layout(world_size) and `shape`'s experts."""
    divisors = [n for n in range(1, world_size + 1) if world_size % n == 0]
    start = dict(zip(("dp", "pp", "tp"), suggested_layout(world_size), strict=True), cp=1, ep=1)
    if shape.experts:  # experts are planned with tp = 1: its ranks go to ep where the experts split over them
        start["ep"] = start["tp"] if shape.experts % start["tp"] == 0 else 1
        start["dp"], start["tp"] = start["dp"] * start["tp"] // start["ep"], 1
    common = {"style": _LABEL_STYLE, "layout": widgets.Layout(width=CONTROL_WIDTH)}
    controls = {axis: widgets.Dropdown(options=divisors, value=start[axis], description=f"{axis} ({what})",
                                       **common)
                for axis, what in (("dp", "replicas"), ("pp", "stages"), ("tp", "split of each layer"))}
    controls["cp"] = widgets.Dropdown(options=divisors, value=start["cp"], description="cp (sequence split)",
                                      **common)
    controls["ep"] = widgets.Dropdown(options=divisors, value=start["ep"], description="ep (experts split)",
                                      **common)
    controls["microbatches"] = widgets.IntSlider(value=microbatches, min=1, max=16, description="micro-batches m",
                                                 continuous_update=False, **common)
    controls["chunks"] = widgets.IntSlider(value=1, min=1, max=4, description="chunks per stage v",
                                           continuous_update=False, **common)
    controls["sequence_parallel"] = widgets.Checkbox(value=False, description="sequence parallelism (tp)",
                                                     indent=False, layout=widgets.Layout(width=CONTROL_WIDTH))
    experts = sorted({*EXPERT_CHOICES, shape.experts})
    controls["experts"] = widgets.Dropdown(options=[("0 (dense MLP)", 0), *((str(e), e) for e in experts if e)],
                                           value=shape.experts, description="experts per block", **common)
    controls["top_k"] = widgets.Dropdown(options=sorted({1, 2, 4, shape.top_k}),  # more than experts: refused
                                         value=shape.top_k if shape.experts else 2, description="experts per token k",
                                         disabled=not shape.experts, **common)
    return controls


def _shape(layout: ParallelLayout) -> str:
    return " x ".join(f"{axis}={layout.size(axis)}" for axis in layout.axes)


def _world_problem(layout: ParallelLayout, world_size: int) -> str | None:
    """Why `layout` cannot run on `world_size` ranks (its product is another number), or None."""
    if layout.world_size == world_size:
        return None
    rest = layout.world_size // layout.dp
    inner = [axis for axis in layout.axes if axis != "dp"]
    sizes = " x ".join(f"{axis}={layout.size(axis)}" for axis in inner)
    fix = (f"{sizes} leaves dp={world_size // rest}" if world_size % rest == 0 else
           f"{sizes} = {rest} does not divide {world_size}: lower {', '.join(inner[:-1])} or {inner[-1]}")
    return (f"{_shape(layout)} = {layout.world_size} ranks, but the world has {world_size}: pick sizes whose "
            f"product is {world_size} ({fix}).")


def _refusal(problem: str, planned: LayoutPlan) -> str:
    return (f"<div style='color:{RED}'>{html.escape(problem)}</div><div>Still showing {_shape(planned.layout)}, "
            f"{planned.layout.microbatches} micro-batches, below.</div>")


def _summary(planned: LayoutPlan) -> str:
    """The summary as HTML: the layout, a row per axis (bytes handed, bytes on the wire, when), the bubble, memory."""
    layout, ranks = planned.layout, range(planned.layout.world_size)
    handed = {axis: max(planned.axis_nbytes(r)[axis] for r in ranks) for axis in layout.axes}
    wire = {axis: max(planned.wire[r][axis] for r in ranks) for axis in layout.axes}
    unit = byte_unit(max(wire.values()))
    rows = [f"<tr><td><b>{axis}</b></td><td>{layout.size(axis)}</td><td>{_amount(handed[axis], unit)}</td>"
            f"<td>{_amount(wire[axis], unit)}</td><td>{AXIS_WHEN[axis] if layout.size(axis) > 1 else 'nothing'}"
            "</td></tr>" for axis in reversed(layout.axes)]
    totals = [m["total"] for m in planned.memory]
    memory_unit = byte_unit(max(totals))
    p, m, v = layout.pp, layout.microbatches, layout.chunks
    return (f"<div><b>{_shape(layout)} = {layout.world_size} ranks</b>, {m} micro-batches, {v} chunk(s) per stage"
            f"{', sequence parallel' if layout.sequence_parallel and layout.tp > 1 else ''}</div>"
            "<table style='line-height:1.3'><tr><th>axis</th><th>ranks</th><th>handed</th><th>on the wire</th>"
            f"<th style='text-align:left'>when (per rank per step, the busiest rank)</th></tr>{''.join(rows)}</table>"
            f"<div>bubble (p-1)/(vm+p-1) = {p - 1}/{v * m + p - 1} = <b>{planned.bubble:.1%}</b> of the step idle</div>"
            f"<div>training state per rank: <b>{_span(min(totals), max(totals), memory_unit)}</b> (weights, "
            "gradients, AdamW's m and v)</div>"
            f"<div>activations kept for the backward, busiest rank: <b>{_amount(max(planned.activations), memory_unit)}"
            f"</b> (its blocks' for its micro-batches in flight{', 1/cp of each sequence' if layout.cp > 1 else ''}; "
            f"Korthikanti et al. 2022's count{_dense_note(planned.shape)})</div>{_experts_line(planned)}")


def _dense_note(shape: GPTShape | None) -> str:
    return ", as if each block were dense: a MoE block keeps its k experts' MLP inputs and outputs for each token" \
        if shape is not None and shape.experts else ""


def _experts_line(planned: LayoutPlan) -> str:
    """For a mixture of experts: what each rank holds, and what ep's all-to-alls assume."""
    shape, ep = planned.shape, planned.layout.ep
    if shape is None or not shape.experts:
        return ""
    return (f"<div>experts: <b>{shape.experts} per block</b>, each token to k={shape.top_k}; each rank holds "
            f"<b>{shape.experts // ep}</b> of each block's (the router and the rest replicated). ep's all-to-alls: "
            "balanced routing with no choice dropped, each rank's T k rows each way (moe_all_to_all_nbytes)</div>")
