"""labkit's data parallelism next to torch's DistributedDataParallel: training step time on 2 gloo ranks.

One MLP (512 -> 4 x 768 -> 16, 2.2 M parameters, 8.7 MB of float32 gradients), batch 32 per rank, SGD.
Variants: "local" (forward, backward and step with no communication: the floor), "naive" (one all_reduce
per gradient after the backward, labkit.parallel.average_gradients), "bucketed" (labkit.parallel.BucketedDDP)
and "torch" (DistributedDataParallel), the last two with the same bucket size, uniform (torch 2.13 uses no
smaller first bucket when bucket_cap_mb is given, and neither does BucketedDDP when bucket_mb is).
The variants take turns, in rotating order, several steps each per round; the median round counts, and a
round's time is its slowest rank's (labkit.measure.seconds_taking_turns and slowest_rank_median).
Target (issue: data parallelism): bucketed <= 1.15 x torch.

    python benchmarks/ddp.py
"""

import torch
from torch.nn.parallel import DistributedDataParallel

import labkit
from labkit.measure import seconds_taking_turns, slowest_rank_median, training_step
from labkit.models import mlp
from labkit.parallel import BucketedDDP, average_gradients, broadcast_parameters
from labkit.tables import text_table

BUCKETS_MB = [25, 4]
ROUNDS, STEPS, WARMUP = 9, 5, 3
BATCH, FEATURES, HIDDEN, LAYERS, CLASSES = 32, 512, 768, 4, 16
TARGET = 1.15
HEADER = ("bucket", "buckets", "local ms", "naive ms", "ratio", "bucketed ms", "ratio", "torch ms")


def make_variants(bucket_mb: float) -> dict:
    """name -> one training step, each on its own copy of the same model."""
    def model():
        return mlp(FEATURES, HIDDEN, CLASSES, LAYERS, seed=0).to(labkit.device())

    generator = torch.Generator().manual_seed(labkit.rank())
    x, y = torch.randn(BATCH, FEATURES, generator=generator), torch.randint(CLASSES, (BATCH,), generator=generator)
    x, y = x.to(labkit.device()), y.to(labkit.device())
    local, naive = model(), model()
    broadcast_parameters(naive)
    bucketed = BucketedDDP(model(), bucket_mb=bucket_mb)
    theirs = DistributedDataParallel(model(), bucket_cap_mb=bucket_mb)

    def step(net, optimizer, after_backward=None):
        return training_step(net, optimizer, x, y, after_backward)

    def sgd(net):
        return torch.optim.SGD(net.parameters(), lr=1e-3)

    return {
        "local": step(local, sgd(local)),
        "naive": step(naive, sgd(naive), lambda: average_gradients(naive)),
        "bucketed": step(bucketed, sgd(bucketed), bucketed.finish),
        "torch": step(theirs, sgd(theirs)),
    }, len(bucketed.buckets)


def measure(bucket_mb: float):
    """On every rank: seconds per step of each variant, one entry per round (labkit.measure: the variants take
    turns, each round after a barrier, synchronized on a GPU); and BucketedDDP's bucket count."""
    variants, buckets = make_variants(bucket_mb)
    for run in variants.values():
        for _ in range(WARMUP):  # buffers, connections, torch DDP's bucket rebuild after its first step
            run()
    return seconds_taking_turns(variants, ROUNDS, calls=STEPS), buckets


def row(bucket_mb: float) -> tuple:
    """One line of the table, and whether BucketedDDP met the target at this bucket size."""
    results = labkit.run(measure, bucket_mb, world_size=2, timeout=600)
    ms = {name: seconds * 1e3 for name, seconds in slowest_rank_median([rounds for rounds, _ in results]).items()}
    ratio = {name: ms[name] / ms["torch"] for name in ms}
    return (f"{bucket_mb} MiB", results[0][1], f"{ms['local']:.2f}", f"{ms['naive']:.2f}", f"{ratio['naive']:.2f}",
            f"{ms['bucketed']:.2f}", f"{ratio['bucketed']:.2f}", f"{ms['torch']:.2f}"), ratio["bucketed"] <= TARGET


def main():
    params = sum(p.numel() for p in mlp(FEATURES, HIDDEN, CLASSES, LAYERS).parameters())
    print(f"ddp: one SGD step on 2 gloo ranks, mlp {FEATURES}-{LAYERS}x{HIDDEN}-{CLASSES} ({params / 1e6:.2f} M "
          f"parameters, {params * 4 / 1e6:.1f} MB of gradients), batch {BATCH} per rank, median of {ROUNDS} rounds "
          f"of {STEPS} steps, torch {torch.__version__}")
    rows, met = zip(*(row(bucket_mb) for bucket_mb in BUCKETS_MB), strict=True)
    print(text_table(HEADER, rows, align=">" * len(HEADER)))
    print("ratio = step time / torch DDP's step time; local = the same step without any communication")
    print(f"target: bucketed <= {TARGET:.2f} x torch DDP at every bucket size: {'met' if all(met) else 'NOT met'}")
    labkit.shutdown()


if __name__ == "__main__":
    main()
