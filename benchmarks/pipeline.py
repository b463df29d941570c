"""The pipeline bubble and the activations held, measured on real gloo ranks against the formulas.

For p = 2 and 4 stages and m = 1 to 16 micro-batches, GPipe and 1F1B run one training step of a small MLP
with labkit.parallel.run_pipeline, each forward EMULATED to take 20 ms and each backward 40 ms (the real
compute is well under a millisecond; the stages sleep the rest, so that 4 ranks on a 2-core laptop overlap
as GPUs would). Measured bubble = 1 - (sum of action times) / (makespan x p), the median of 3 steps; the
formula is (p-1)/(m+p-1) (labkit.plan.bubble_fraction), which the simulator reproduces exactly. The makespan
runs from the barrier that starts every stage's clock to the last action's end: each step's slowest rank,
then the median of the steps (labkit.measure.slowest_rank_median). What the measurement adds over the
formula is the real cost of each hand-over between stages (posting sends, waking a waiting rank: about a
millisecond on a loaded 2-core machine), which the formula takes as zero. Peak in-flight: the most
micro-batches whose activations a stage held awaiting their backward; GPipe holds m, 1F1B min(p - r, m) on
stage r, so min(p, m) on stage 0.

    python benchmarks/pipeline.py
"""

import statistics

import torch
import torch.nn.functional as F

import labkit
from labkit.measure import slowest_rank_median
from labkit.models import make_classification, mlp
from labkit.parallel import measured_bubble, run_pipeline, simulate_pipeline
from labkit.plan import bubble_fraction
from labkit.tables import text_table

STAGES = [2, 4]
MICROBATCHES = [1, 2, 4, 8, 16]
KINDS = ["gpipe", "1f1b"]
FORWARD_S, BACKWARD_S = 0.020, 0.040
EMULATED = (FORWARD_S, BACKWARD_S)
REPEATS = 3
HEADER = ("p", "m", "schedule", "formula", "simulated", "measured", "rel.err", "makespan ms", "ideal ms",
          "peak stage 0", "max stage", "expected")


def measure(configs):
    """On every rank: for each (kind, m), this stage's events in each of REPEATS steps (seconds from the barrier
    that starts every stage's clock) and the most micro-batches it held in any step."""
    x, y = make_classification(64)
    model = mlp(layers=3)  # 7 layers: stages of 4 and 3 layers, or 2, 2, 2, 1
    run_pipeline(model, "1f1b", 4, x, y, F.cross_entropy)  # warm: the first backward of a process is slow
    steps = {}
    for kind, m in configs:
        results = [run_pipeline(model, kind, m, x, y, F.cross_entropy, emulate_compute_seconds=EMULATED)
                   for _ in range(REPEATS)]
        steps[kind, m] = [result.events for result in results], max(result.peak_in_flight for result in results)
    return steps


def rows(p: int) -> list[tuple[tuple, float]]:
    """The table's lines for `p` stages, each with its relative error of the measured bubble against the formula."""
    configs = [(kind, m) for m in MICROBATCHES for kind in KINDS]
    per_rank = labkit.run(measure, configs, world_size=p, timeout=600)
    makespans = slowest_rank_median([{config: [max(e.end for e in events) for events in steps]
                                      for config, (steps, _) in rank.items()} for rank in per_rank])
    return [row(p, kind, m, [rank[kind, m] for rank in per_rank], makespans[kind, m]) for kind, m in configs]


def row(p: int, kind: str, m: int, stages: list, makespan_seconds: float) -> tuple[tuple, float]:
    """One line of the table from each stage's (events of each step, peak), and the bubble's relative error."""
    formula = bubble_fraction(p, m)
    steps = zip(*(events for events, _ in stages), strict=True)  # step -> each stage's events
    measured = statistics.median(measured_bubble([e for events in step for e in events]) for step in steps)
    error = (measured - formula) / formula if formula else 0.0
    simulated = measured_bubble(simulate_pipeline(kind, p, m, FORWARD_S, BACKWARD_S))
    ideal_ms = (m + p - 1) * (FORWARD_S + BACKWARD_S) * 1e3
    peaks = [peak for _, peak in stages]
    return (p, m, kind, f"{formula:.3f}", f"{simulated:.3f}", f"{measured:.3f}", f"{error:+.1%}",
            f"{makespan_seconds * 1e3:.1f}", f"{ideal_ms:.0f}", peaks[0], max(peaks),
            m if kind == "gpipe" else min(p, m)), error


def main():
    print(f"pipeline: one step of mlp(layers=3) on p gloo ranks, emulated compute {FORWARD_S * 1e3:.0f} ms forward / "
          f"{BACKWARD_S * 1e3:.0f} ms backward per stage, median of {REPEATS} steps, torch {torch.__version__}")
    lines, errors = zip(*(line for p in STAGES for line in rows(p)), strict=True)
    print(text_table(HEADER, lines, align=">" * len(HEADER)))
    print("bubble = 1 - busy / (makespan x p); formula (p-1)/(m+p-1); ideal makespan (m+p-1)(F+B); "
          "expected peak: GPipe m, 1F1B min(p, m) on stage 0")
    print(f"largest relative difference, measured vs formula: {max(abs(e) for e in errors):.1%}")
    labkit.shutdown()


if __name__ == "__main__":
    main()
