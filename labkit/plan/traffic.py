"""How many bytes a collective moves, how long the alpha-beta model says it takes, and nccl-tests' bandwidths.

Units: bytes and seconds; bandwidths in GB/s with GB = 1e9 bytes (nccl-tests' convention).
Sources: Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in MPICH"
(IJHPCA 2005) for the costs; NVIDIA/nccl-tests doc/PERFORMANCE.md for algbw and busbw.
"""

from __future__ import annotations

import math

GB = 1e9

# busbw = algbw x factor (nccl-tests PERFORMANCE.md): the per-rank share of traffic a link must carry.
_BUSBW_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def ring_allreduce_nbytes_per_rank(nbytes: float, world_size: int) -> float:
    """Bytes each rank sends (and receives) in a ring AllReduce of `nbytes`: 2(N-1)/N x S.

    >>> ring_allreduce_nbytes_per_rank(14.0e9, 8)      # the lesson's 7B example, BF16 gradients
    24500000000.0
    """
    _check_world_size(world_size)
    return 2 * (world_size - 1) / world_size * nbytes


def ring_reduce_scatter_nbytes_per_rank(nbytes: float, world_size: int) -> float:
    """Bytes each rank sends in a ring ReduceScatter (or AllGather) of `nbytes` in all: (N-1)/N x S."""
    _check_world_size(world_size)
    return (world_size - 1) / world_size * nbytes


def naive_allreduce_hub_nbytes(nbytes: float, world_size: int) -> float:
    """Bytes the hub of a naive AllReduce receives, and again sends: (N-1) x S, linear in N."""
    _check_world_size(world_size)
    return (world_size - 1) * nbytes


def busbw_factor(collective: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor for `collective` on `world_size` ranks."""
    _check_world_size(world_size)
    if collective not in _BUSBW_FACTORS:
        raise ValueError(f"collective={collective!r}: use one of {', '.join(_BUSBW_FACTORS)}.")
    return _BUSBW_FACTORS[collective](world_size)


def algbw_gbps(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth: the whole array's size over the time, in GB/s."""
    return nbytes / seconds / GB


def busbw_gbps(collective: str, nbytes: float, seconds: float, world_size: int) -> float:
    """Bus bandwidth in GB/s: algbw x factor; the figure to compare with a link's speed."""
    return algbw_gbps(nbytes, seconds) * busbw_factor(collective, world_size)


def ring_allreduce_seconds(nbytes: float, world_size: int, alpha_seconds: float,
                           beta_seconds_per_byte: float, gamma_seconds_per_byte: float = 0.0) -> float:
    """Alpha-beta time of a ring AllReduce: 2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma."""
    p = world_size
    return (2 * (p - 1) * alpha_seconds + 2 * (p - 1) / p * nbytes * beta_seconds_per_byte
            + (p - 1) / p * nbytes * gamma_seconds_per_byte)


def naive_allreduce_seconds(nbytes: float, world_size: int, alpha_seconds: float,
                            beta_seconds_per_byte: float) -> float:
    """Alpha-beta time of the hub AllReduce: the hub receives, then sends, N-1 whole tensors in turn."""
    return 2 * (world_size - 1) * (alpha_seconds + nbytes * beta_seconds_per_byte)


def recursive_doubling_allreduce_seconds(nbytes: float, world_size: int, alpha_seconds: float,
                                         beta_seconds_per_byte: float,
                                         gamma_seconds_per_byte: float = 0.0) -> float:
    """lg(p) alpha + n lg(p) (beta + gamma): fewer steps, more bytes; wins for small messages."""
    steps = math.ceil(math.log2(world_size)) if world_size > 1 else 0
    return steps * (alpha_seconds + nbytes * (beta_seconds_per_byte + gamma_seconds_per_byte))


def fit_alpha_beta(nbytes: list[float], seconds: list[float], world_size: int) -> tuple[float, float]:
    """Least-squares (alpha, beta) of the ring AllReduce model to measured times.

    The model is linear in alpha and beta: t = 2(p-1) alpha + 2(p-1)/p n beta (gamma folded into beta)."""
    if len(nbytes) != len(seconds) or len(nbytes) < 2:
        raise ValueError("fit_alpha_beta needs at least two (nbytes, seconds) measurements of equal count.")
    _check_world_size(world_size, minimum=2)
    p = world_size
    xs = [2 * (p - 1) / p * n for n in nbytes]  # bytes each rank sends
    k = 2 * (p - 1)  # messages each rank sends
    count = len(xs)
    mean_x, mean_t = sum(xs) / count, sum(seconds) / count
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        raise ValueError("fit_alpha_beta needs measurements at more than one size.")
    beta = sum((x - mean_x) * (t - mean_t) for x, t in zip(xs, seconds, strict=True)) / spread
    alpha = (mean_t - beta * mean_x) / k
    if alpha < 0:  # noise can push the intercept below zero; a latency cannot be negative
        return 0.0, sum(x * t for x, t in zip(xs, seconds, strict=True)) / sum(x * x for x in xs)
    return alpha, beta


def _check_world_size(world_size: int, minimum: int = 1) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < minimum:
        raise ValueError(f"world_size must be a whole number >= {minimum}, got {world_size!r}.")
