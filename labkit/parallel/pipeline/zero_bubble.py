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
    dualpipe_v(p, m)          every stage's DualPipeV order: DualPipe (DeepSeek-AI 2024, "DeepSeek-V3 Technical
                              Report", arXiv:2412.19437, section 3.2.1) cut in half, fed from one end
                              (github.com/deepseek-ai/DualPipe, its "DualPipeV"): two chunks per
                              stage laid out as a V (layout.py), F and B of two micro-batches paired in the steady
                              state, some backwards whole ("BW": B and W at once), the rest split to fill the ends.

The ZB-H1 order equals torch 2.13's ScheduleInterleavedZeroBubble with one stage per rank (its docstring says
"ZB1P", the paper's name for its automatic scheduler's output; the order it builds is ZB-H1's hand-made one),
DualPipeV's torch's ScheduleDualPipeV, its paired F+B written as F then BW
(tests/distributed/test_pipeline_zero_bubble.py, test_pipeline_dualpipe.py). run_pipeline splits each chunk's
backward for ZB-H1 (split_backward.py); DualPipeV is simulated only (simulate_pipeline).
"""

from __future__ import annotations

from collections import Counter, deque

from labkit._refusals import refuse_while_graded
from labkit.parallel.pipeline.action import Action

__all__ = ["dualpipe_v", "zero_bubble_h1"]


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
    refuse_while_graded("labkit.parallel.pipeline's schedule")  # without its W's, it is 1F1B: notebook 06 grades that
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


def dualpipe_v(stages: int, microbatches: int) -> list[list[Action]]:
    """Each stage's DualPipeV actions for p stages and m >= 2p micro-batches: "F", "B" (input gradient), "W"
    (weight gradient) and "BW" (a whole backward), chunk 0 the V's way down, chunk 1 its way up.

    Stage r: 2(p-r-1) forwards of chunk 0; r+1 pairs of forwards (chunk 0, chunk 1); p-r-1 times B of chunk
    1, a W, a forward of chunk 1 (zero bubble in the warm-up); then the steady state's pairs, F of one chunk with
    the whole backward of the other (DeepSeek overlaps each pair, hiding one's communication behind the other's
    compute; here they are written one after the other); and the cool-down's backwards, the later half of them
    split so that W's fill the end. It is torch 2.13's ScheduleDualPipeV._calculate_single_rank_operations,
    step for step (tested).

    >>> " ".join(map(str, dualpipe_v(2, 4)[1]))   # the V's bottom: stage 1 holds the model's pieces 1 and 2
    'F0 F0.1 F1 F1.1 F2 BW0.1 F2.1 BW0 F3 BW1.1 F3.1 BW1 BW2.1 BW2 B3.1 B3 W3.1 W3'
    """
    return [_DualPipeStage(r, stages, microbatches).actions() for r in range(stages)]


class _DualPipeStage:
    """One stage's DualPipeV order, built step by step as torch builds it: counters per (kind, chunk), and the
    queue of split backwards whose W has not run."""

    def __init__(self, stage: int, stages: int, microbatches: int):
        self.r, self.p, self.m = stage, stages, microbatches
        self.order: list[Action] = []
        self.next: Counter = Counter()  # (kind, chunk) -> its next micro-batch ("B" counts whole ones too)
        self.weights: deque[tuple[int, int]] = deque()  # (micro-batch, chunk) split, W not yet run

    def forward(self, chunk: int) -> None:
        self.order.append(Action("F", self.next["F", chunk], chunk))
        self.next["F", chunk] += 1

    def backward(self, chunk: int, whole: bool) -> None:
        i = self.next["B", chunk]
        self.next["B", chunk] += 1
        self.order.append(Action("BW" if whole else "B", i, chunk))
        if not whole:
            self.weights.append((i, chunk))

    def weight(self) -> None:
        if self.weights:
            self.order.append(Action("W", *self.weights.popleft()))

    def actions(self) -> list[Action]:
        """Torch's eight steps (ScheduleDualPipeV's comments name them), in order."""
        r, p = self.r, self.p
        for _ in range(2 * (p - r - 1)):
            self.forward(0)
        for _ in range(r + 1):
            self.forward(0), self.forward(1)
        for _ in range(p - r - 1):
            self.backward(1, whole=False), self.weight(), self.forward(1)
        for _ in range(self.m - 2 * p + r + 1):  # the steady state: F0 with BW1, F1 with BW0
            self.forward(0), self.backward(1, whole=True), self.forward(1), self.backward(0, whole=True)
        for _ in range(p - r - 1):
            self.backward(1, whole=True), self.forward(1), self.backward(0, whole=True)
        self._cool_down()
        return self.order

    def _cool_down(self) -> None:
        """Steps 6 to 8: backwards of both chunks, split from the middle on (which chunk first depends on r's
        parity), then the W's and backwards left, then the W's."""
        r, p, split = self.r, self.p, False
        for i in range(r + 1):
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            self.backward(1, whole=not split)
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            self.backward(0, whole=not split)
        for _ in range(p - r - 1):
            self.weight(), self.backward(0, whole=not split)
        for _ in range(r + 1):
            self.weight()
