"""The pipeline bubble: the share of a step during which pipeline stages sit idle."""

from __future__ import annotations

from labkit.checks import number, whole

__all__ = ["bubble_fraction", "zero_bubble_fraction"]


def bubble_fraction(stages: int, microbatches: int, chunks: int = 1) -> float:
    """Idle share of total pipeline time with p stages, m micro-batches and v model chunks per device.

    With equal stage times, filling and draining the pipeline idles each device (p-1) stage-slots while its
    useful work is v m slots of 1/v the size: bubble/ideal = (p-1)/(v m) (Narayanan et al. 2021, "Efficient
    Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", section 2.2.2, interleaved 1F1B).
    As a share of the total, x/(1+x) = (p-1)/(v m + p-1); v = 1 is GPipe's (p-1)/(m+p-1) (Huang et al.
    2019), which 1F1B shares. More micro-batches or chunks shrink it; one stage has none. The schedules of
    labkit.parallel.pipeline reproduce it exactly in their simulator (simulate_pipeline) for all three when
    handing a tensor to the next stage is free; priced hand-overs (its HandOver, fitted on a machine by
    measure_handover) only add idle time (benchmarks/pipeline.py compares both with real runs).

    >>> bubble_fraction(4, 8)            # 3 / 11
    0.2727272727272727
    >>> bubble_fraction(4, 8, chunks=2)  # interleaved: 3 / 19
    0.15789473684210525
    """
    p, m, v = whole("stages", stages), whole("microbatches", microbatches), whole("chunks", chunks)
    return (p - 1) / (v * m + p - 1)


def zero_bubble_fraction(stages: int, microbatches: int, forward: float = 1.0, backward_input: float = 1.0,
                         backward_weight: float = 1.0) -> float:
    """Idle share of ZB-H1's step (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", arXiv:2401.10241,
    section 3.1): with a forward F, the input-gradient half of the backward B and its weight-gradient half W,
    each stage idles (p-1)(F+B-W) of a step that also holds its m (F+B+W) of work; 1F1B idles (p-1)(F+B+W)
    (with B+W its whole backward: bubble_fraction). Deferred W's fill the cool-down that 1F1B leaves empty.

    It holds for m >= p micro-batches and W <= min(F, B), as the paper assumes (its equal-cost case F = B = W
    gives (p-1)/(3m+p-1), a third of 1F1B's idle time); simulate_pipeline("zb-h1", ...) reproduces it exactly
    there (tested), and gives the step's timeline elsewhere.

    >>> zero_bubble_fraction(4, 8)        # 3 / 27
    0.1111111111111111
    >>> bubble_fraction(4, 8)             # 1F1B with the same work: 9 of 33 time units
    0.2727272727272727
    """
    p, m = whole("stages", stages), whole("microbatches", microbatches)
    f, b, w = (number(name, value) for name, value in
               (("forward", forward), ("backward_input", backward_input), ("backward_weight", backward_weight)))
    if m < p:
        raise ValueError(f"microbatches={m} < stages={p}: (p-1)(F+B-W) holds from m >= p on (a stage that never "
                         "reaches the steady state has fewer W's to defer); simulate_pipeline('zb-h1', ...) gives "
                         "the timeline for fewer.")
    if w > min(f, b):
        raise ValueError(f"backward_weight={w} > min(forward, backward_input)={min(f, b)}: the formula assumes W "
                         "no longer than F and B (a longer W no longer fits the gaps it fills); simulate_pipeline("
                         "'zb-h1', ..., weight_seconds=...) gives the timeline.")
    scale = max(f, b) or 1.0  # only the costs' ratios matter: scaled to at most 1, no sum overflows
    f, b, w = f / scale, b / scale, w / scale
    idle = (p - 1) * (f + b - w)
    return idle / (m * (f + b + w) + idle) if idle else 0.0
