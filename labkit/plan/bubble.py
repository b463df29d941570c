"""The pipeline bubble: the share of a step during which pipeline stages sit idle."""

from __future__ import annotations

from labkit.checks import whole

__all__ = ["bubble_fraction"]


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
