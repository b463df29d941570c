"""labkit's ring_allreduce next to torch's own gloo all_reduce, on 2 and 4 ranks, 1 KiB to 64 MiB.

For each size the three variants (torch, labkit, labkit with tracing on) take turns, in rotating
order, several rounds of back-to-back calls each, and the median round counts: this machine's
timings jump around, and taking turns spreads the noise evenly. A round's time is its slowest rank's
(labkit.measure.seconds_taking_turns and slowest_rank_median).
"check" times the shape/dtype check alone (one round of small messages that every labkit collective
sends before its data, so that mismatched ranks get an error instead of a gloo abort): its latency is
what separates labkit from torch at 1-16 MiB, shown by the ratio without it.
Bandwidths follow nccl-tests: algbw = S / t and busbw = algbw x 2(N-1)/N, in GB/s (GB = 1e9).
Target (issue 3): labkit's busbw >= 0.9 x torch's at every size >= 1 MiB; tracing costs <= 10 %.

    python benchmarks/collectives.py
"""

import functools

import torch
import torch.distributed as dist

import labkit
from labkit.comm import default_transport, ring_allreduce, traced
from labkit.measure import seconds_taking_turns, slowest_rank_median
from labkit.plan.traffic import GB, bus_bandwidth
from labkit.tables import text_table

SIZES = [1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
ROUNDS = 9
HEADER = ("N", "size", "torch ms", "torch busbw", "labkit ms", "labkit busbw", "ratio", "traced ms", "cost",
          "check ms", "ratio w/o")


def ring_traced(t):
    with traced():
        ring_allreduce(t)


def check_only(t):
    default_transport().check_same_tensors(t, "benchmark")


VARIANTS = {"torch": dist.all_reduce, "labkit": ring_allreduce, "traced": ring_traced, "check": check_only}


def measure(nbytes: int) -> dict[str, list[float]]:
    """On every rank: seconds per call of each variant, one entry per round (labkit.measure: the variants take
    turns, each round after a barrier)."""
    t = torch.randn(nbytes // 4)
    variants = {name: functools.partial(fn, t) for name, fn in VARIANTS.items()}
    for run in variants.values():
        run()  # warm up: buffers, connections
    return seconds_taking_turns(variants, ROUNDS, calls=max(1, min(50, (8 << 20) // nbytes)))


def row(world_size: int, nbytes: int) -> tuple:
    """One line of the table: each variant's slowest-rank median at this size and world size."""
    per_rank = labkit.run(measure, nbytes, world_size=world_size, backend="gloo", timeout=600)
    seconds = slowest_rank_median(per_rank)
    busbw = {name: bus_bandwidth("allreduce", nbytes, s, world_size) / GB for name, s in seconds.items()}
    size = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
    return (world_size, size, f"{seconds['torch'] * 1e3:.3f}", f"{busbw['torch']:.2f}",
            f"{seconds['labkit'] * 1e3:.3f}", f"{busbw['labkit']:.2f}", f"{busbw['labkit'] / busbw['torch']:.2f}",
            f"{seconds['traced'] * 1e3:.3f}", f"{seconds['traced'] / seconds['labkit'] - 1:+.1%}",
            f"{seconds['check'] * 1e3:.3f}", f"{seconds['torch'] / (seconds['labkit'] - seconds['check']):.2f}")


def main():
    print(f"collectives: all_reduce of float32 over gloo, median of {ROUNDS} rounds, torch {torch.__version__}")
    for world_size in (2, 4):
        print(f"\n{text_table(HEADER, [row(world_size, nbytes) for nbytes in SIZES], align='>' * len(HEADER))}",
              flush=True)
    print("\nbusbw in GB/s as nccl-tests defines it (algbw x 2(N-1)/N); ratio = labkit busbw / torch busbw; "
          "cost = time with tracing on / off - 1; ratio w/o = torch time / (labkit time - check time)")
    labkit.shutdown()


if __name__ == "__main__":
    main()
