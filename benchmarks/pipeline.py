"""The pipeline bubble on real gloo ranks, against the formula and against the simulator priced with this
machine's hand-over cost; and the activations held.

For p = 1 to 4 stages and m = 1 to 16 micro-batches, GPipe, 1F1B and zero-bubble ZB-H1 run training steps of a
small MLP with labkit.parallel.run_pipeline, each forward EMULATED to take 20 ms and each backward 40 ms (ZB-H1:
its B and W 20 ms each; the real compute is well under a millisecond; the stages sleep the rest, so that 4 ranks
on a 2-core laptop overlap as GPUs would).
Measured bubble = 1 - (sum of action times) / (makespan x p): the least of ROUNDS steps, the settings taking
turns (labkit.parallel.pipeline.steps_taking_turns: a busy machine mostly adds idle time); "spread" is the most
minus the least of them, the noise the measurement was taken in.

The formula (p-1)/(m+p-1) (labkit.plan.bubble_fraction; ZB-H1's (p-1)(F+B-W) of its step,
labkit.plan.zero_bubble_fraction, which holds from m >= p: below that its column shows the simulator's bubble
with free hand-overs) counts hand-overs between stages as free. They are not:
each costs its sender the time to post it, its receiver the time to post the receive, and the message its time
on the way. handover_seconds_by_size times exactly that on labkit's transport, before each round and in the same
ranks (a ping-pong between ranks 0 and 1, each message sent after 20 ms of emulated compute to a rank waiting for
it; alpha + n beta fitted with plan.fit_point_to_point, fitted_handover), so that both see the same load; and
"simulated" is simulate_pipeline with that HandOver, walking the plan the executor posts on gloo (receives
ahead). The last lines give the worst |simulated - measured| and |formula - measured| per schedule, and whether
the simulator met its target, within TARGET = 0.01 of the measured bubble everywhere: a printed verdict, not an
assert (on a shared machine a busy moment is not a failure of the model; rerun and compare).

    python benchmarks/pipeline.py            about 9 minutes on 2 cores
"""

import math
import os

import torch
import torch.nn.functional as F

import labkit
from labkit.models import make_classification, mlp
from labkit.parallel import run_pipeline, simulate_pipeline
from labkit.parallel.pipeline import (
    HANDOVER_SIZES,
    HandOver,
    bubbles_by_round,
    fitted_handover,
    handover_seconds_by_size,
    measured_bubble,
    steps_taking_turns,
)
from labkit.plan import bubble_fraction, zero_bubble_fraction
from labkit.tables import text_table

STAGES = [1, 2, 3, 4]
MICROBATCHES = list(range(1, 17))
KINDS = ["gpipe", "1f1b", "zb-h1"]
FORWARD_S, BACKWARD_S = 0.020, 0.040
EMULATED = (FORWARD_S, BACKWARD_S)
ROUNDS = 5
TARGET = 0.01  # issue 25: the simulator within 0.01 (absolute) of the measured bubble at every p <= 4, m <= 16
EXAMPLES, HIDDEN = 64, 64  # the batch; every activation between stages is HIDDEN float32 wide
HEADER = ("p", "m", "schedule", "formula", "simulated", "measured", "spread", "sim - meas", "formula - meas",
          "peak held", "expected")


def steps(settings):
    """On every rank: each setting's events in each of ROUNDS rounds, the most micro-batches it held, and the
    hand-over readings taken before each round (handover_seconds_by_size: ranks 0 and 1), in the same conditions."""
    x, y = make_classification(EXAMPLES)
    model = mlp(layers=3, hidden=HIDDEN)  # 7 layers: enough for 4 stages
    run_pipeline(model, "1f1b", 4, x, y, F.cross_entropy)  # warm: the first backward of a process is slow
    peaks, readings = {}, []

    def step(kind, m):
        result = run_pipeline(model, kind, m, x, y, F.cross_entropy, emulate_compute_seconds=EMULATED)
        peaks[kind, m] = max(peaks.get((kind, m), 0), result.peak_in_flight)
        return result

    events = {setting: [] for setting in settings}
    for _ in range(ROUNDS):
        if labkit.world_size() > 1:
            readings.append(handover_seconds_by_size(HANDOVER_SIZES, FORWARD_S, rounds=3))
        for setting, kept in steps_taking_turns(step, settings, 1).items():
            events[setting] += kept
    return events, peaks, readings


def rows(p: int, settings) -> tuple[list[tuple], str]:
    """The table's lines for `p` stages, with (kind, sim - meas, formula - meas) for the summary, and the
    hand-over fitted during the run."""
    per_rank = labkit.run(steps, settings, world_size=p, timeout=900)
    bubbles = bubbles_by_round([events for events, _, _ in per_rank])
    handover, said = HandOver(), "p = 1: no hand-overs"
    if p > 1:
        handover, one_way = fitted_handover([readings for _, _, readings in per_rank])
        said = f"p = {p}: {described(handover, one_way)}"
    lines = []
    for kind, m in settings:
        formula, measured = formula_bubble(kind, p, m), min(bubbles[kind, m])
        simulated = measured_bubble(simulate_pipeline(kind, p, m, FORWARD_S, BACKWARD_S, handover=handover,
                                                      message_nbytes=activation_nbytes(m), receives_ahead=True))
        peak, expected = per_rank[0][1][kind, m], m if kind == "gpipe" else min(p, m)
        lines.append(((p, m, kind, f"{formula:.3f}", f"{simulated:.3f}", f"{measured:.3f}",
                       f"{max(bubbles[kind, m]) - measured:.3f}", f"{simulated - measured:+.4f}",
                       f"{formula - measured:+.4f}", peak, expected), (kind, simulated - measured, formula - measured)))
    return lines, said


def formula_bubble(kind: str, p: int, m: int) -> float:
    """The schedule's bubble with free hand-overs: its formula, or for ZB-H1 with m < p, where (p-1)(F+B-W) does
    not hold, the simulator's."""
    if kind != "zb-h1":
        return bubble_fraction(p, m)
    if m >= p:
        return zero_bubble_fraction(p, m, FORWARD_S, BACKWARD_S / 2, BACKWARD_S / 2)
    return measured_bubble(simulate_pipeline(kind, p, m, FORWARD_S, BACKWARD_S))


def described(handover, one_way) -> str:
    """The fitted hand-over in a line."""
    return ("one-way " + ", ".join(f"{n} B {s * 1e6:.0f} us" for n, s in one_way.items()) +
            f"; alpha {handover.alpha_seconds * 1e6:.0f} us, beta {handover.beta_seconds_per_byte * 1e9:.2f} ns/B, "
            f"posting a send {handover.send_post_seconds * 1e6:.0f} us, a receive "
            f"{handover.recv_post_seconds * 1e6:.0f} us, rendezvous {handover.rendezvous}")


def activation_nbytes(microbatches: int) -> int:
    """Bytes of the largest micro-batch's activation between two stages (float32, HIDDEN wide)."""
    return math.ceil(EXAMPLES / microbatches) * HIDDEN * 4


def verdict(lines, summary) -> str:
    """Whether every simulated bubble was within TARGET of the measured one: the worst gap, and where it missed."""
    gaps = [abs(sim) for _, sim, _ in summary]
    worst = max(gaps)
    if worst <= TARGET:
        return f"worst |sim - measured| {worst:.4f} <= {TARGET}: met"
    missed = ", ".join(f"{line[2]} p={line[0]} m={line[1]} ({gap:.4f})"
                       for line, gap in zip(lines, gaps, strict=True) if gap > TARGET)
    return f"worst |sim - measured| {worst:.4f} > {TARGET}: not met at {missed}"


def main():
    load = os.getloadavg()[0]
    print(f"pipeline: mlp(layers=3) on p gloo ranks, emulated compute {FORWARD_S * 1e3:.0f} ms forward / "
          f"{BACKWARD_S * 1e3:.0f} ms backward per stage, least of {ROUNDS} steps, torch {torch.__version__}, "
          f"{os.cpu_count()} cores, load average {load:.1f}")
    settings = [(kind, m) for m in MICROBATCHES for kind in KINDS]
    lines, summary = [], []
    for p in STAGES:
        table, said = rows(p, settings)
        print(f"hand-over measured during {said}")
        lines += [line for line, _ in table]
        summary += [numbers for _, numbers in table]
    print(text_table(HEADER, lines, align=">" * len(HEADER)))
    print("bubble = 1 - busy / (makespan x p); formula (p-1)/(m+p-1), ZB-H1 (p-1)(F+B-W) of its step (m < p: "
          "simulated with free hand-overs); simulated: simulate_pipeline with the hand-over measured during the same "
          "run; spread: most - least of the steps; expected peak held on stage 0: GPipe m, 1F1B and ZB-H1 min(p, m)")
    for kind in KINDS:
        sim = max((abs(s), i) for i, (k, s, _) in enumerate(summary) if k == kind)
        formula = max((abs(f), i) for i, (k, _, f) in enumerate(summary) if k == kind)
        print(f"{kind}: worst |simulated - measured| {sim[0]:.4f} (p={lines[sim[1]][0]}, m={lines[sim[1]][1]}); "
              f"worst |formula - measured| {formula[0]:.4f} (p={lines[formula[1]][0]}, m={lines[formula[1]][1]})")
    print(verdict(lines, summary))
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    labkit.shutdown()


if __name__ == "__main__":
    main()
