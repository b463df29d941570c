"""Step time with communication, data-parallel speedup, and the bandwidth a target speedup needs.

Model: a data-parallel step is `compute_seconds` of forward and backward plus a gradient AllReduce of
`comm_seconds`, of which the fraction `overlap` runs behind the backward pass (PyTorch DDP's bucketed
AllReduce; Li et al. 2020, "PyTorch Distributed", VLDB). Hidden communication cannot outlast the compute it
hides behind, so a step never takes less than its communication.
"""

from __future__ import annotations

import math

from labkit.checks import finite_result, fraction, number, shown, whole

__all__ = ["bandwidth_for_speedup", "data_parallel_speedup", "step_seconds"]


def step_seconds(compute_seconds: float, comm_seconds: float, overlap: float = 0.0) -> float:
    """Seconds per step: compute + (1 - overlap) x comm, and never less than comm.

    `overlap` is the fraction of communication hidden behind compute. While overlap x comm <= compute this is
    exactly compute + (1 - overlap) comm; beyond that the link, not the GPU, sets the pace and the step
    takes comm (Li et al. 2020, section 3.2.3 on overlapping computation with communication).

    >>> step_seconds(1.0, 0.5, overlap=0.8)                   # 0.4 s hidden, 0.1 s exposed
    1.1
    >>> step_seconds(1.0, 4.0, overlap=0.8)                   # only 1 s can hide behind 1 s of compute
    4.0
    """
    compute = number("compute_seconds", compute_seconds)
    comm = number("comm_seconds", comm_seconds)
    step = max(compute + (1 - fraction("overlap", overlap)) * comm, comm)
    return finite_result("step_seconds", step, compute_seconds=compute_seconds, comm_seconds=comm_seconds)


def data_parallel_speedup(devices: int, compute_seconds: float, comm_seconds: float, overlap: float = 0.0) -> float:
    """How many times faster `devices` data-parallel GPUs get through the same examples as one GPU.

    Each device keeps the single GPU's per-step work (`compute_seconds`), so one data-parallel step does the
    work of `devices` single-GPU steps, which need no communication:
        speedup = devices x compute / step_seconds(compute, comm, overlap).
    It ignores the rounding of steps per epoch (the lesson's 2,500 / 313 = 7.99 rather than 8).

    >>> data_parallel_speedup(8, 1.0, 0.0)                    # ignoring communication
    8.0
    >>> round(data_parallel_speedup(8, 1.0, 24.5e9 / 14.7e9), 6)   # the lesson's 24.5 GB over 14.7 GB/s
    3.0
    """
    n = whole("devices", devices)
    compute = number("compute_seconds", compute_seconds, inclusive=False)
    return n * (compute / step_seconds(compute, comm_seconds, overlap))  # compute / step <= 1: cannot overflow


def bandwidth_for_speedup(target_speedup: float, devices: int, compute_seconds: float, nbytes_per_rank: float,
                          overlap: float = 0.0) -> float:
    """The per-rank bandwidth (bytes/s) below which `devices` GPUs fall short of `target_speedup`.

    Inverts `data_parallel_speedup` with comm = nbytes_per_rank / bandwidth: the step may take
    devices x compute / target seconds, so the exposed communication may take that minus compute, giving
        comm <= min(exposed / (1 - overlap), allowed step).
    Returns math.inf when only infinitely fast links reach the target (target = devices, overlap < 1).

    >>> round(bandwidth_for_speedup(3, 8, 1.0, 24.5e9) / 1e9, 6)   # "your 8x becomes 3x": 14.7 GB/s
    14.7
    """
    n = whole("devices", devices)
    target = number("target_speedup", target_speedup, inclusive=False)
    if target > n:
        raise ValueError(f"target_speedup={shown(target_speedup)} exceeds devices={n}: data parallelism over N devices "
                         "is at most N times faster; pass a target <= devices.")
    compute = number("compute_seconds", compute_seconds, inclusive=False)
    nbytes, hidden = number("nbytes_per_rank", nbytes_per_rank), fraction("overlap", overlap)
    inputs = {"target_speedup": target_speedup, "devices": devices, "compute_seconds": compute_seconds,
              "nbytes_per_rank": nbytes_per_rank}
    slowdown = finite_result("bandwidth_for_speedup", n / target, **inputs)  # 1 exactly when target = devices
    allowed_step = finite_result("bandwidth_for_speedup", compute * slowdown, **inputs)
    exposed = compute * (slowdown - 1)
    comm = min(exposed / (1 - hidden), allowed_step) if hidden < 1 else allowed_step
    if nbytes == 0:
        return 0.0
    return math.inf if comm == 0 else finite_result("bandwidth_for_speedup", nbytes / comm, **inputs)
