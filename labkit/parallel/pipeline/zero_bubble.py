"""Zero-bubble pipeline schedules: the backward split in two, its second half filling the bubble.

A backward through a stage computes two things (Qi et al. 2023, "Zero Bubble Pipeline Parallelism",
arXiv:2401.10241, section 2): B, the gradient with respect to the stage's input, which the previous stage waits
for, and W, the gradients with respect to its weights, which nobody downstream waits for (only the optimizer step
at the end). 1F1B runs them as one, so every stage waits on the whole backward of the stages after it. Run B
first and W later, and a W can go where 1F1B idles.

    zero_bubble_h1(r, p, m)   stage r's ZB-H1 order (the paper's section 3.1, figure 3): 1F1B's warm-up
                              and steady state with B alone, stage r putting off its first r W's to the
                              cool-down, where they fill the idle slots. 1F1B's peak memory (p micro-batches
                              held), a bubble of (p-1)(F+B-W) instead of (p-1)(F+B+W)
                              (labkit.plan.zero_bubble_fraction).

The order equals torch 2.13's ScheduleInterleavedZeroBubble with one stage per rank (its ZB1P, the same
schedule; tests/distributed/test_pipeline_zero_bubble.py). run_pipeline splits each chunk's backward so
(split_backward.py).
"""

from __future__ import annotations

from collections import deque

from labkit.parallel.pipeline.action import Action

__all__ = ["zero_bubble_h1"]


def zero_bubble_h1(stage: int, stages: int, microbatches: int) -> list[Action]:
    """Stage r's ZB-H1 actions (F, B: input gradient, W: weight gradient), for p stages and m micro-batches.

    Warm-up: min(p - r - 1, m) forwards (1F1B's). Then each backward k = 0 .. m-1 in turn, after one forward
    while forwards remain (1F1B's steady state), and from the (r+1)-th backward on, one W after each: the
    oldest not yet run. The r W's left over run at the end. Stage r so defers r W's: the last stage, whose
    backwards come first, defers p - 1 of them into the cool-down, where 1F1B idles, and the first stage, whose
    backwards come last, none. Every stage holds at most p micro-batches' activations (from F to W).

    >>> " ".join(map(str, zero_bubble_h1(0, 3, 4)))
    'F0 F1 F2 B0 W0 F3 B1 W1 B2 W2 B3 W3'
    >>> " ".join(map(str, zero_bubble_h1(2, 3, 4)))   # the last stage: two W's for the cool-down
    'F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3'
    """
    warmup = min(stages - stage - 1, microbatches)
    actions = [Action("F", i) for i in range(warmup)]
    deferred: deque[int] = deque()  # micro-batches whose B has run and W not yet, oldest first
    for k in range(microbatches):
        if warmup + k < microbatches:
            actions.append(Action("F", warmup + k))
        actions.append(Action("B", k))
        deferred.append(k)
        if k >= stage:
            actions.append(Action("W", deferred.popleft()))
    return actions + [Action("W", k) for k in deferred]
