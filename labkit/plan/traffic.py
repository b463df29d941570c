"""How many bytes a collective moves, how long the alpha-beta model says it takes, and nccl-tests' bandwidths.

Units: bytes, seconds, and bandwidths in bytes/s (divide by GB = 1e9 to print GB/s, nccl-tests' convention).
Sources: Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in MPICH"
(IJHPCA 2005) for the costs; NVIDIA/nccl-tests doc/PERFORMANCE.md for algbw and busbw.
"""

from __future__ import annotations

import math

from labkit.checks import choice, finite_result, number, numbers_list, overflow_named, shown, whole

__all__ = ["ALLREDUCE_ALGORITHMS", "GB", "allreduce_seconds", "bus_bandwidth", "busbw_factor", "ddp_bucket_count",
           "fit_alpha_beta", "fit_point_to_point", "naive_allreduce_bytes", "ring_allreduce_bytes",
           "ring_reduce_scatter_bytes", "tree_beats_ring_below_nbytes"]

GB = 1e9
MiB = 2**20  # torch DDP's bucket_cap_mb counts MiB

# busbw = algbw x factor (nccl-tests PERFORMANCE.md): the per-rank share of traffic a link must carry.
_BUSBW_FACTORS = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "alltoall": lambda n: (n - 1) / n,
}
ALLREDUCE_ALGORITHMS = ("ring", "naive", "recursive_doubling", "tree")


def ring_allreduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes each rank sends (and receives) in a ring AllReduce of `nbytes`: 2(N-1)/N x S.

    Scatter-reduce then all-gather, N-1 steps each, one chunk of S/N per step: below 2 S for any N, which
    is why the ring scales (Thakur et al. 2005; Patarasuk & Yuan 2009).

    >>> ring_allreduce_bytes(14.0e9, 8)      # the lesson's 7B example, BF16 gradients
    24500000000.0
    """
    p = whole("world_size", world_size)
    per_rank = 2 * (p - 1) / p * number("nbytes", nbytes)
    return finite_result("ring_allreduce_bytes", per_rank, nbytes=nbytes, world_size=world_size)


def ring_reduce_scatter_bytes(nbytes: float, world_size: int) -> float:
    """Bytes each rank sends in a ring ReduceScatter (or AllGather) of `nbytes` in all: (N-1)/N x S.

    >>> ring_reduce_scatter_bytes(8.0, 4)
    6.0
    """
    world_size = whole("world_size", world_size)
    return (world_size - 1) / world_size * number("nbytes", nbytes)


def naive_allreduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes the hub of a central AllReduce receives, and again sends: (N-1) x S, linear in N.

    Every other rank sends its whole tensor to the hub and gets the sum back, so the hub's link is the
    bottleneck as N grows (the contrast that motivates the ring; Thakur et al. 2005).

    >>> naive_allreduce_bytes(14.0e9, 8)
    98000000000.0
    """
    hub = (whole("world_size", world_size) - 1) * number("nbytes", nbytes)
    return finite_result("naive_allreduce_bytes", hub, nbytes=nbytes, world_size=world_size)


def allreduce_seconds(nbytes: float, world_size: int, bandwidth: float, latency: float = 0.0,
                      algorithm: str = "ring", *, gamma_seconds_per_byte: float = 0.0) -> float:
    """Alpha-beta time of an AllReduce of `nbytes` on `world_size` ranks (Thakur et al. 2005, section 4).

    `bandwidth` is bytes/s per direction per rank (beta = 1 / bandwidth), `latency` the seconds per message
    (alpha), `gamma_seconds_per_byte` the reduction's cost per byte (0: arithmetic is free next to the link).
      ring:               2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma
      naive (hub):        2(p-1) (alpha + n beta) + (p-1) n gamma: the hub receives, then sends, p-1 tensors
      recursive_doubling: lg p (alpha + n beta + n gamma): fewer messages, more bytes; wins for small n
      tree:               2 lg p (alpha + n beta) + lg p n gamma: a binomial reduce into one rank, then a binomial
                          broadcast from it (labkit.comm.tree_allreduce), each lg p whole-tensor steps
      (lg p is ceil(log2 p): a tree over p ranks that are not a power of two still needs that many steps)

    >>> allreduce_seconds(14.0e9, 8, bandwidth=24.5e9)          # the lesson's 24.5 GB over 24.5 GB/s
    1.0
    """
    p, n = float(whole("world_size", world_size)), number("nbytes", nbytes)  # float: 2(p-1) may pass 1.8e308
    alpha = number("latency", latency)
    beta = 1 / number("bandwidth", bandwidth, inclusive=False)
    gamma = number("gamma_seconds_per_byte", gamma_seconds_per_byte)
    algorithm = choice("algorithm", algorithm, ALLREDUCE_ALGORITHMS)
    if algorithm == "ring":
        seconds = 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta + (p - 1) / p * n * gamma
    elif algorithm == "naive":
        seconds = 2 * (p - 1) * (alpha + n * beta) + (p - 1) * n * gamma
    elif algorithm == "tree":
        steps = (int(p) - 1).bit_length()
        seconds = 2 * steps * (alpha + n * beta) + steps * n * gamma
    else:
        seconds = math.ceil(math.log2(p)) * (alpha + n * (beta + gamma))
    return finite_result("allreduce_seconds", seconds, nbytes=nbytes, world_size=world_size, bandwidth=bandwidth,
                         latency=latency, gamma_seconds_per_byte=gamma_seconds_per_byte)


def tree_beats_ring_below_nbytes(world_size: int, bandwidth: float, latency: float) -> float:
    """The AllReduce size below which the binomial tree is faster than the ring on `world_size` ranks, in the
    alpha-beta model with free arithmetic (gamma = 0); 0.0 where the ring is never slower.

    Setting allreduce_seconds' ring and tree equal, 2(p-1) alpha + 2(p-1)/p n beta = 2L (alpha + n beta) with
    L = ceil(log2 p) steps, gives n = alpha / beta x (p - 1 - L) / (L - (p-1)/p): the ring's latency term
    2(p-1) alpha grows linearly with p, the tree's 2L alpha only logarithmically, so the size below which the
    tree wins grows with p (Thakur, Rabenseifner & Gropp 2005, section 4; why NCCL also has tree algorithms).

    >>> round(tree_beats_ring_below_nbytes(8, bandwidth=10e9, latency=20e-6))     # alpha/beta = 200 kB, x 4/2.125
    376471
    >>> tree_beats_ring_below_nbytes(2, bandwidth=10e9, latency=20e-6)           # one step either way
    0.0
    """
    p = whole("world_size", world_size)
    alpha, bandwidth = number("latency", latency), number("bandwidth", bandwidth, inclusive=False)
    steps = (p - 1).bit_length()
    if p - 1 - steps <= 0:
        return 0.0
    nbytes = alpha * bandwidth * (p - 1 - steps) / (steps - (p - 1) / p)
    return finite_result("tree_beats_ring_below_nbytes", nbytes, world_size=world_size, bandwidth=bandwidth,
                         latency=latency)


def ddp_bucket_count(gradient_nbytes: float, bucket_mb: float = 25.0) -> int:
    """AllReduces per training step of torch DDP, one per gradient bucket: gradients packed into buckets of
    `bucket_mb` MiB (torch's bucket_cap_mb, default 25), ceil(gradient_nbytes / bucket bytes).

    DDP synchronises the gradients once per step, but in one AllReduce per bucket, each launched during the
    backward as soon as its bucket is full, so that it overlaps the rest of the backward (Li et al.,
    "PyTorch Distributed", VLDB 2020, section 3.2.2). For an explicit bucket_cap_mb the count is an upper
    bound, reached when the tensors are small next to a bucket and their size divides it: torch never splits a
    tensor, and a bucket closes with the tensor that takes it to the cap or past it (torch 2.13's
    dist._compute_bucket_assignment_by_size), so every bucket but the last holds at least bucket_mb. With
    torch's defaults (no bucket_cap_mb) it is not a bound: one bucket is capped at 1 MiB
    (dist._DEFAULT_FIRST_BUCKET_BYTES), and torch can make one bucket more (the 7B's 14 GB: up to 536).

    >>> ddp_bucket_count(7e9 * 2)          # the lesson's 7B model, BF16 gradients: 14 GB / 25 MiB = 534.06
    535
    >>> ddp_bucket_count(3 * MiB, bucket_mb=1.5)
    2
    """
    nbytes = number("gradient_nbytes", gradient_nbytes)
    with overflow_named("ddp_bucket_count", gradient_nbytes=gradient_nbytes, bucket_mb=bucket_mb) as finite:
        bucket_nbytes = finite(number("bucket_mb", bucket_mb, inclusive=False) * MiB)
        return math.ceil(finite(nbytes / bucket_nbytes))


def busbw_factor(collective: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor for `collective` on `world_size` ranks (PERFORMANCE.md).

    >>> busbw_factor("allreduce", 8)
    1.75
    """
    world_size = whole("world_size", world_size)
    return _BUSBW_FACTORS[choice("collective", collective, tuple(_BUSBW_FACTORS))](world_size)


def bus_bandwidth(collective: str, nbytes: float, seconds: float, world_size: int) -> float:
    """nccl-tests' busbw in bytes/s: algbw (the whole array over the time) x the collective's factor.

    busbw, unlike algbw, does not depend on the rank count for an ideal algorithm, so it is the figure to
    compare with a link's speed (NVIDIA/nccl-tests doc/PERFORMANCE.md). Collectives: "allreduce"
    2(n-1)/n; "reduce_scatter", "allgather", "alltoall" (n-1)/n; "broadcast", "reduce" 1.

    >>> bus_bandwidth("allreduce", 2e9, 1.0, 2) / GB              # GB/s
    2.0
    """
    factor = busbw_factor(collective, world_size)
    busbw = number("nbytes", nbytes) / number("seconds", seconds, inclusive=False) * factor
    return finite_result("bus_bandwidth", busbw, nbytes=nbytes, seconds=seconds)


def fit_alpha_beta(nbytes: list[float], seconds: list[float], world_size: int) -> tuple[float, float]:
    """Least-squares (alpha, beta) of the ring AllReduce model to measured times.

    The model is linear in alpha and beta: t = 2(p-1) alpha + 2(p-1)/p n beta (gamma folded into beta).
    1 / beta is the link's bandwidth in bytes/s, as `allreduce_seconds` takes it. A latency cannot be negative:
    when noise pushes the intercept below zero, the fit is redone through the origin (alpha = 0, the least-squares
    answer under alpha >= 0). Refused, saying why: sizes that are not positive, times that are negative, NaN or
    inf, fewer than two sizes, and times that do not grow with size (no bandwidth to find)."""
    p = whole("world_size", world_size, minimum=2)
    return _fit_line("fit_alpha_beta", nbytes, seconds, 2.0 * (p - 1), 2 * (p - 1) / p, world_size=world_size)


def fit_point_to_point(nbytes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Least-squares (alpha, beta) of one message's time t = alpha + n beta (Thakur, Rabenseifner & Gropp 2005)
    to measured one-way times of messages of `nbytes`: seconds per message and per byte, fit_alpha_beta's
    convention for a single point-to-point message (a pipeline's hand-over between stages), and its refusals.

    >>> alpha, beta = fit_point_to_point([1e3, 1e6], [1.01e-4, 1.1e-3])   # 0.1 ms + 1 ns per byte
    >>> round(alpha * 1e6, 1), round(beta * 1e9, 3)
    (100.0, 1.0)
    """
    return _fit_line("fit_point_to_point", nbytes, seconds, 1.0, 1.0)


def _fit_line(name: str, nbytes, seconds, messages: float, share: float, **shown_too) -> tuple[float, float]:
    """Least squares of t = messages alpha + share n beta over the (nbytes, seconds) pairs, alpha >= 0 (else
    through the origin), beta > 0; errors name `name` and its arguments."""
    sizes, times = numbers_list("nbytes", nbytes, inclusive=False), numbers_list("seconds", seconds)
    if len(sizes) != len(times) or len(sizes) < 2:
        raise ValueError(f"{name} needs at least two (nbytes, seconds) measurements of equal count; got "
                         f"{len(sizes)} nbytes and {len(times)} seconds.")
    with overflow_named(name, nbytes=nbytes, seconds=seconds, **shown_too) as finite:
        xs = [share * n for n in sizes]  # bytes each rank sends
        mean_x, mean_t = finite(sum(xs) / len(xs)), finite(sum(times) / len(times))
        spread = finite(sum((x - mean_x) ** 2 for x in xs))
        if spread == 0:
            raise ValueError(f"nbytes={shown(nbytes)}: {name} needs measurements at more than one size.")
        beta = finite(sum((x - mean_x) * (t - mean_t) for x, t in zip(xs, times, strict=True)) / spread)
        alpha = finite((mean_t - beta * mean_x) / messages)
        if alpha < 0:  # noise below a small latency
            products = finite(sum(x * t for x, t in zip(xs, times, strict=True)))
            alpha, beta = 0.0, products / finite(sum(x * x for x in xs))
    if beta <= 0:
        raise ValueError(f"seconds={shown(seconds)} do not grow with nbytes={shown(nbytes)} (fitted beta = "
                         f"{beta:.3g} s per byte): these times give no bandwidth. Time each size over more "
                         "repetitions, with sizes far enough apart that moving the bytes, not latency or noise, "
                         "sets the time.")
    return alpha, beta
