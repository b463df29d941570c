"""labkit's ring_allreduce next to torch's own gloo all_reduce, on 2 and 4 ranks, 1 KiB to 64 MiB.

For each size the three variants (torch, labkit, labkit with tracing on) take turns, in rotating
order, several rounds of back-to-back calls each, and the median round counts: this machine's
timings jump around, and taking turns spreads the noise evenly. Time is the slowest rank's.
"check" times the shape/dtype check alone (one round of small messages that every labkit collective
sends before its data, so that mismatched ranks get an error instead of a gloo abort): its latency is
what separates labkit from torch at 1-16 MiB, shown by the ratio without it.
Bandwidths follow nccl-tests: algbw = S / t and busbw = algbw x 2(N-1)/N, in GB/s (GB = 1e9).
Target (issue 3): labkit's busbw >= 0.9 x torch's at every size >= 1 MiB; tracing costs <= 10 %.

    python benchmarks/collectives.py
"""

import statistics
import time

import torch
import torch.distributed as dist

import labkit
from labkit.comm import default_transport, ring_allreduce, traced
from labkit.plan.traffic import GB, bus_bandwidth

SIZES = [1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
ROUNDS = 9


def ring_traced(t):
    with traced():
        ring_allreduce(t)


def check_only(t):
    default_transport().check_same_tensors(t, "benchmark")


VARIANTS = {"torch": dist.all_reduce, "labkit": ring_allreduce, "traced": ring_traced, "check": check_only}


def measure(nbytes: int) -> dict[str, list[float]]:
    """On every rank: seconds per call of each variant, one entry per round."""
    t = torch.randn(nbytes // 4)
    calls = max(1, min(50, (8 << 20) // nbytes))
    rounds = {name: [] for name in VARIANTS}
    for fn in VARIANTS.values():
        fn(t)  # warm up: buffers, connections
    names = list(VARIANTS)
    for i in range(ROUNDS):
        for name in names[i % len(names):] + names[:i % len(names)]:  # each variant takes each place in turn
            fn = VARIANTS[name]
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                fn(t)
            rounds[name].append((time.perf_counter() - start) / calls)
    return rounds


def slowest_rank_median(per_rank: list[dict[str, list[float]]], name: str) -> float:
    return statistics.median(max(rank[name][i] for rank in per_rank) for i in range(ROUNDS))


def main():
    print(f"collectives: all_reduce of float32 over gloo, median of {ROUNDS} rounds, torch {torch.__version__}")
    print(f"{'N':>2} {'size':>8} | {'torch ms':>9} {'busbw':>6} | {'labkit ms':>9} {'busbw':>6} {'ratio':>5} | "
          f"{'traced ms':>9} {'cost':>6} | {'check ms':>8} {'ratio w/o':>9}")
    for world_size in (2, 4):
        for nbytes in SIZES:
            per_rank = labkit.run(measure, nbytes, world_size=world_size, timeout=600)
            seconds = {name: slowest_rank_median(per_rank, name) for name in VARIANTS}
            busbw = {name: bus_bandwidth("allreduce", nbytes, s, world_size) / GB for name, s in seconds.items()}
            size = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
            print(f"{world_size:>2} {size:>8} | {seconds['torch'] * 1e3:9.3f} {busbw['torch']:6.2f} | "
                  f"{seconds['labkit'] * 1e3:9.3f} {busbw['labkit']:6.2f} {busbw['labkit'] / busbw['torch']:5.2f} | "
                  f"{seconds['traced'] * 1e3:9.3f} {seconds['traced'] / seconds['labkit'] - 1:+6.1%} | "
                  f"{seconds['check'] * 1e3:8.3f} {seconds['torch'] / (seconds['labkit'] - seconds['check']):9.2f}")
    print("busbw in GB/s as nccl-tests defines it (algbw x 2(N-1)/N); ratio = labkit busbw / torch busbw; "
          "cost = time with tracing on / off - 1; ratio w/o = torch time / (labkit time - check time)")
    labkit.shutdown()


if __name__ == "__main__":
    main()
