"""Step time with communication, data-parallel speedup, and the bandwidth a target speedup needs.

One model of overlap, used by data parallelism (notebook 08) and by the data-parallel axis of a pipeline
(notebook 13). A step is `compute_seconds` of forward and backward plus a gradient AllReduce of `comm_seconds`.
The AllReduce can start only once gradients exist, so it can hide behind backward compute alone (PyTorch DDP's
bucketed AllReduce; Li et al. 2020, "PyTorch Distributed", VLDB, section 3.2.3), and with gradient accumulation
only behind the **last micro-batch's** backward: the earlier ones run under no_sync and sync nothing (section
3.2.4). The backward is BACKWARD_SHARE = 2/3 of the compute: 4 of the 6 FLOPs per parameter and token (2 forward,
4 backward; Kaplan et al. 2020, "Scaling Laws for Neural Language Models", section 2.1). So of a step of
accumulation_steps micro-batches,

    hideable_seconds = 2/3 x compute_seconds / accumulation_steps

can hide communication, and `overlap` (0 to 1) says how much of the AllReduce is started early enough to use it
(buckets: the last bucket's gradients are ready only when the backward ends). In a pipeline a stage r > 0 also
idles `drain_seconds` after its last backward while the earlier stages finish theirs (r backwards of the last
micro-batch, for GPipe and 1F1B): its AllReduce runs there for free.

    hidden  = min(overlap x comm, hideable_seconds)
    exposed = max(0, comm - hidden - drain_seconds)
    step    = compute + exposed

The same condition in tokens (Austin et al. 2025, "How to Scale Your Model", part 5, "Data Parallelism": compute
bound when the tokens per chip exceed C / W): the AllReduce hides entirely when the last micro-batch's tokens per
GPU are at least about C / W, the GPU's FLOP/s over its link's bytes/s in one direction (`tokens_to_hide_allreduce`).
The book's W is its "bidirectional" bandwidth, which it defines (part 2) as the bytes a chip sends out per second
along an axis, what a GPU's one-direction figure measures; its T_math and T_comm each count half of what this module
counts (2 FLOPs per parameter and token for the backward and 2 bytes per parameter on the wire, against 4 and
2(N-1)/N x 2), so the ratio and the threshold are the same.
"""

from __future__ import annotations

import math

from labkit.checks import finite_result, fraction, number, shown, whole

__all__ = ["BACKWARD_SHARE", "bandwidth_for_speedup", "data_parallel_speedup", "hideable_seconds", "step_seconds",
           "tokens_to_hide_allreduce"]

BACKWARD_SHARE = 2 / 3  # backward FLOPs / (forward + backward): 4 of 6 per parameter and token (Kaplan et al. 2020)
BACKWARD_FLOPS_PER_PARAM_TOKEN = 4


def hideable_seconds(compute_seconds: float, accumulation_steps: int = 1) -> float:
    """Seconds of compute a step's gradient AllReduce can hide behind: the last micro-batch's backward,
    BACKWARD_SHARE x compute_seconds / accumulation_steps (module docstring).

    >>> round(hideable_seconds(1.0, accumulation_steps=2), 6)   # the lesson's step: 2/3 x 0.5 s
    0.333333
    """
    compute = number("compute_seconds", compute_seconds)
    return BACKWARD_SHARE * compute / whole("accumulation_steps", accumulation_steps)


def step_seconds(compute_seconds: float, comm_seconds: float, overlap: float = 0.0, accumulation_steps: int = 1,
                 drain_seconds: float = 0.0) -> float:
    """Seconds per step: compute + the AllReduce's exposed part (module docstring).

    `overlap` is the fraction of the AllReduce started during the backward; what it hides is capped by
    `hideable_seconds(compute_seconds, accumulation_steps)`, the last micro-batch's backward, so a step never
    takes less than compute + comm - that. `drain_seconds`: the time a pipeline stage idles after its last
    backward (the AllReduce's rest runs there); a pipeline's bubble is not in compute_seconds, add it apart.

    >>> round(step_seconds(1.0, 0.5, overlap=0.8), 6)          # 0.4 s hidden behind 2/3 s of backward
    1.1
    >>> round(step_seconds(1.0, 2.0, overlap=1.0, accumulation_steps=2), 6)   # only 1/3 s can hide
    2.666667
    """
    compute = number("compute_seconds", compute_seconds)
    comm = number("comm_seconds", comm_seconds)
    hidden = min(fraction("overlap", overlap) * comm, hideable_seconds(compute, accumulation_steps))
    exposed = max(0.0, comm - hidden - number("drain_seconds", drain_seconds))
    return finite_result("step_seconds", compute + exposed, compute_seconds=compute_seconds,
                         comm_seconds=comm_seconds)


def data_parallel_speedup(devices: int, compute_seconds: float, comm_seconds: float, overlap: float = 0.0,
                          accumulation_steps: int = 1) -> float:
    """How many times faster `devices` data-parallel GPUs get through the same examples as one GPU.

    Each device keeps the single GPU's per-step work (`compute_seconds`), so one data-parallel step does the
    work of `devices` single-GPU steps, which need no communication:
        speedup = devices x compute / step_seconds(compute, comm, overlap, accumulation_steps).
    It ignores the rounding of steps per epoch (the lesson's 2,500 / 313 = 7.99 rather than 8).

    >>> data_parallel_speedup(8, 1.0, 0.0)                    # ignoring communication
    8.0
    >>> round(data_parallel_speedup(8, 1.0, 24.5e9 / 14.7e9), 6)   # the lesson's 24.5 GB over 14.7 GB/s
    3.0
    """
    n = whole("devices", devices)
    compute = number("compute_seconds", compute_seconds, inclusive=False)
    step = step_seconds(compute, comm_seconds, overlap, accumulation_steps)
    return n * (compute / step)  # compute / step <= 1: cannot overflow


def bandwidth_for_speedup(target_speedup: float, devices: int, compute_seconds: float, nbytes_per_rank: float,
                          overlap: float = 0.0, accumulation_steps: int = 1) -> float:
    """The per-rank bandwidth (bytes/s) below which `devices` GPUs fall short of `target_speedup`.

    Inverts `data_parallel_speedup` with comm = nbytes_per_rank / bandwidth: the step may take
    devices x compute / target seconds, so the AllReduce may expose E = that minus compute. With H =
    hideable_seconds(compute, accumulation_steps) and overlap o, the longest AllReduce is
        comm = min(E / (1 - o), E + H)
    (the first while o x comm <= H, then only H hides). Returns math.inf when only infinitely fast links reach the
    target (E = 0 and nothing can hide).

    >>> round(bandwidth_for_speedup(3, 8, 1.0, 24.5e9) / 1e9, 6)   # "your 8x becomes 3x": 14.7 GB/s
    14.7
    >>> round(bandwidth_for_speedup(3, 8, 1.0, 24.5e9, overlap=1.0, accumulation_steps=2) / 1e9, 6)  # 1/3 s hides
    12.25
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
    exposed = finite_result("bandwidth_for_speedup", compute * (slowdown - 1), **inputs)
    hideable = hideable_seconds(compute, accumulation_steps)
    comm = exposed + hideable if hidden == 1 else min(exposed / (1 - hidden), exposed + hideable)
    comm = finite_result("bandwidth_for_speedup", comm, **inputs)  # 1e308 s of exposure + hideable: inf
    if nbytes == 0:
        return 0.0
    return math.inf if comm == 0 else finite_result("bandwidth_for_speedup", nbytes / comm, **inputs)


def tokens_to_hide_allreduce(flops_per_second: float, bandwidth: float, devices: int, accumulation_steps: int = 1,
                             gradient_bytes_per_param: float = 2) -> float:
    """Tokens per GPU per optimizer step at and above which the ring AllReduce of the gradients hides entirely
    behind the last micro-batch's backward, for GPUs doing `flops_per_second` (achieved, not peak) over links
    of `bandwidth` bytes/s per rank, one direction.

    The AllReduce sends 2(N-1)/N x g bytes per parameter (g = `gradient_bytes_per_param`); the last micro-batch's
    backward, T / k tokens of the step's T, computes 4 FLOPs per parameter and token. Equal when
        T = k x 2(N-1)/N x g / 4 x C / W,
    for BF16 gradients k (N-1)/N x C / W: the scaling book's "tokens per chip against C / W" (module docstring),
    per micro-batch. The parameter count cancels out.

    >>> tokens_to_hide_allreduce(500e12, 50e9, devices=8)      # half an H100 over 400 Gb/s InfiniBand
    8750.0
    """
    flops = number("flops_per_second", flops_per_second, inclusive=False)
    link = number("bandwidth", bandwidth, inclusive=False)
    n, k = whole("devices", devices), whole("accumulation_steps", accumulation_steps)
    per_param = 2 * (n - 1) / n * number("gradient_bytes_per_param", gradient_bytes_per_param)
    tokens = k * per_param / BACKWARD_FLOPS_PER_PARAM_TOKEN * (flops / link)
    return finite_result("tokens_to_hide_allreduce", tokens, flops_per_second=flops_per_second, bandwidth=bandwidth,
                         devices=devices, accumulation_steps=accumulation_steps,
                         gradient_bytes_per_param=gradient_bytes_per_param)
