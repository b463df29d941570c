"""labkit's data parallelism next to torch's DistributedDataParallel: training step time on 2 gloo ranks.

One MLP (512 -> 4 x 768 -> 16, 2.2 M parameters, 8.7 MB of float32 gradients), batch 32 per rank, SGD.
Variants: "local" (forward, backward and step with no communication: the floor), "naive" (one all_reduce
per gradient after the backward, labkit.parallel.average_gradients), "bucketed" (labkit.parallel.BucketedDDP)
and "torch" (DistributedDataParallel), the last two with the same bucket size, uniform (torch 2.13 uses no
smaller first bucket when bucket_cap_mb is given; BucketedDDP gets first_bucket_mb = bucket_mb to match).
The variants take turns, in rotating order, several steps each per round; the median round counts, and a
round's time is its slowest rank's. Target (issue: data parallelism): bucketed <= 1.15 x torch.

    python benchmarks/ddp.py
"""

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import labkit
from labkit.measure import synchronize
from labkit.models import mlp
from labkit.parallel import BucketedDDP, average_gradients, broadcast_parameters

BUCKETS_MB = [25, 4]
ROUNDS, STEPS, WARMUP = 9, 5, 3
BATCH, FEATURES, HIDDEN, LAYERS, CLASSES = 32, 512, 768, 4, 16
TARGET = 1.15


def make_variants(bucket_mb: float) -> dict:
    """name -> one training step, each on its own copy of the same model."""
    def model():
        return mlp(FEATURES, HIDDEN, CLASSES, LAYERS, seed=0).to(labkit.device())

    generator = torch.Generator().manual_seed(labkit.rank())
    x, y = torch.randn(BATCH, FEATURES, generator=generator), torch.randint(CLASSES, (BATCH,), generator=generator)
    x, y = x.to(labkit.device()), y.to(labkit.device())
    local, naive = model(), model()
    broadcast_parameters(naive)
    bucketed = BucketedDDP(model(), bucket_mb=bucket_mb, first_bucket_mb=bucket_mb)
    theirs = DistributedDataParallel(model(), bucket_cap_mb=bucket_mb)

    def step(net, optimizer, after_backward=None):
        def run():
            optimizer.zero_grad()
            F.cross_entropy(net(x), y).backward()
            if after_backward is not None:
                after_backward()
            optimizer.step()
        return run

    def sgd(net):
        return torch.optim.SGD(net.parameters(), lr=1e-3)

    return {
        "local": step(local, sgd(local)),
        "naive": step(naive, sgd(naive), lambda: average_gradients(naive)),
        "bucketed": step(bucketed, sgd(bucketed), bucketed.finish),
        "torch": step(theirs, sgd(theirs)),
    }, len(bucketed.buckets)


def measure(bucket_mb: float):
    """On every rank: seconds per step of each variant, one entry per round; and BucketedDDP's bucket count."""
    variants, buckets = make_variants(bucket_mb)
    for run in variants.values():
        for _ in range(WARMUP):  # buffers, connections, torch DDP's bucket rebuild after its first step
            run()
    names = list(variants)
    rounds = {name: [] for name in names}
    for i in range(ROUNDS):
        for name in names[i % len(names):] + names[:i % len(names)]:
            dist.barrier()
            synchronize(labkit.device())  # on a GPU: time the steps as run, not as queued
            start = time.perf_counter()
            for _ in range(STEPS):
                variants[name]()
            synchronize(labkit.device())
            rounds[name].append((time.perf_counter() - start) / STEPS)
    return rounds, buckets


def slowest_rank_median(per_rank: list[dict], name: str) -> float:
    return statistics.median(max(rank[name][i] for rank in per_rank) for i in range(ROUNDS))


def main():
    params = sum(p.numel() for p in mlp(FEATURES, HIDDEN, CLASSES, LAYERS).parameters())
    print(f"ddp: one SGD step on 2 gloo ranks, mlp {FEATURES}-{LAYERS}x{HIDDEN}-{CLASSES} ({params / 1e6:.2f} M "
          f"parameters, {params * 4 / 1e6:.1f} MB of gradients), batch {BATCH} per rank, median of {ROUNDS} rounds "
          f"of {STEPS} steps, torch {torch.__version__}")
    print(f"{'bucket':>7} {'buckets':>7} | {'local ms':>8} | {'naive ms':>8} {'ratio':>5} | {'bucketed ms':>11} "
          f"{'ratio':>5} | {'torch ms':>8}")
    met = True
    for bucket_mb in BUCKETS_MB:
        results = labkit.run(measure, bucket_mb, world_size=2, timeout=600)
        per_rank = [rounds for rounds, _ in results]
        ms = {name: slowest_rank_median(per_rank, name) * 1e3 for name in per_rank[0]}
        ratio = {name: ms[name] / ms["torch"] for name in ms}
        met &= ratio["bucketed"] <= TARGET
        print(f"{bucket_mb:>3} MiB {results[0][1]:>7} | {ms['local']:8.2f} | {ms['naive']:8.2f} "
              f"{ratio['naive']:5.2f} | {ms['bucketed']:11.2f} {ratio['bucketed']:5.2f} | {ms['torch']:8.2f}")
    print("ratio = step time / torch DDP's step time; local = the same step without any communication")
    print(f"target: bucketed <= {TARGET:.2f} x torch DDP at every bucket size: {'met' if met else 'NOT met'}")
    labkit.shutdown()


if __name__ == "__main__":
    main()
