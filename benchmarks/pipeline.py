"""The pipeline bubble and the activations held, measured on real gloo ranks against the formulas.

For p = 2 and 4 stages and m = 1 to 16 micro-batches, GPipe and 1F1B run one training step of a small MLP
with labkit.parallel.run_pipeline, each forward EMULATED to take 20 ms and each backward 40 ms (the real
compute is well under a millisecond; the stages sleep the rest, so that 4 ranks on a 2-core laptop overlap
as GPUs would). Measured bubble = 1 - (sum of action times) / (makespan x p), the median of 3 steps; the
formula is (p-1)/(m+p-1) (labkit.plan.bubble_fraction), which the simulator reproduces exactly. What the
measurement adds over the formula is the real cost of each hand-over between stages (posting sends, waking a
waiting rank: about a millisecond on a loaded 2-core machine), which the formula takes as zero. Peak
in-flight: the most micro-batches whose activations a stage held awaiting their backward; GPipe holds m,
1F1B min(p - r, m) on stage r, so min(p, m) on stage 0.

    python benchmarks/pipeline.py
"""

import statistics

import torch
import torch.nn.functional as F

import labkit
from labkit.groups import gather_objects
from labkit.models import make_classification, mlp
from labkit.parallel import measured_bubble, run_pipeline, simulate_pipeline
from labkit.plan import bubble_fraction

STAGES = [2, 4]
MICROBATCHES = [1, 2, 4, 8, 16]
KINDS = ["gpipe", "1f1b"]
FORWARD_S, BACKWARD_S = 0.020, 0.040
EMULATED = (FORWARD_S, BACKWARD_S)
REPEATS = 3


def measure(configs):
    """On every rank: for each (kind, m), the bubble of each repeat, the makespan, and each stage's peak."""
    x, y = make_classification(64)
    model = mlp(layers=3)  # 7 layers: stages of 4 and 3 layers, or 2, 2, 2, 1
    run_pipeline(model, "1f1b", 4, x, y, F.cross_entropy)  # warm: the first backward of a process is slow
    rows = []
    for kind, m in configs:
        bubbles, makespans = [], []
        for _ in range(REPEATS):
            result = run_pipeline(model, kind, m, x, y, F.cross_entropy, emulate_compute_seconds=EMULATED)
            gathered = gather_objects((result.events, result.peak_in_flight))
            events = [e for stage_events, _ in gathered for e in stage_events]
            bubbles.append(measured_bubble(events))
            makespans.append(max(e.end for e in events) - min(e.start for e in events))
        rows.append((kind, m, bubbles, makespans, [peak for _, peak in gathered]))
    return rows


def main():
    print(f"pipeline: one step of mlp(layers=3) on p gloo ranks, emulated compute {FORWARD_S * 1e3:.0f} ms forward / "
          f"{BACKWARD_S * 1e3:.0f} ms backward per stage, median of {REPEATS} steps, torch {torch.__version__}")
    print(f"{'p':>2} {'m':>3} {'schedule':>8} | {'formula':>7} {'simulated':>9} {'measured':>8} {'rel.err':>7} | "
          f"{'makespan ms':>11} {'ideal':>6} | {'peak stage 0':>12} {'max stage':>9} {'expected':>8}")
    worst = 0.0
    for p in STAGES:
        configs = [(kind, m) for m in MICROBATCHES for kind in KINDS]
        for kind, m, bubbles, makespans, peaks in labkit.run(measure, configs, world_size=p, timeout=600)[0]:
            formula = bubble_fraction(p, m)
            simulated = measured_bubble(simulate_pipeline(kind, p, m, FORWARD_S, BACKWARD_S))
            measured = statistics.median(bubbles)
            error = (measured - formula) / formula if formula else 0.0
            worst = max(worst, abs(error))
            ideal = (m + p - 1) * (FORWARD_S + BACKWARD_S) * 1e3
            expected = m if kind == "gpipe" else min(p, m)
            print(f"{p:>2} {m:>3} {kind:>8} | {formula:7.3f} {simulated:9.3f} {measured:8.3f} {error:+7.1%} | "
                  f"{statistics.median(makespans) * 1e3:11.1f} {ideal:6.0f} | {peaks[0]:>12} {max(peaks):>9} "
                  f"{expected:>8}")
    print("bubble = 1 - busy / (makespan x p); formula (p-1)/(m+p-1); ideal makespan (m+p-1)(F+B); "
          "expected peak: GPipe m, 1F1B min(p, m) on stage 0")
    print(f"largest relative difference, measured vs formula: {worst:.1%}")
    labkit.shutdown()


if __name__ == "__main__":
    main()
