"""Which torch.distributed backend a world of N ranks gets, and why.

NCCL needs one GPU per rank: since NCCL 2.5 two ranks on one device fail with "Duplicate GPU
detected" (NVIDIA/nccl#103). So "auto" picks NCCL only when CUDA works and ranks <= GPUs, and
otherwise gloo on CPU, saying which rule decided. Gloo on CUDA tensors supports only broadcast
and all_reduce, so under gloo every rank computes on the CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from labkit.classroom.caps import capped_threads

__all__ = ["BACKENDS", "BackendChoice", "choose_backend", "cpu_count", "init_process_group", "threads_per_rank",
           "usable_gpu_count"]

BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class BackendChoice:
    backend: str  # "gloo" or "nccl"
    reason: str


def choose_backend(requested: str, world_size: int, gpu_count: int) -> BackendChoice:
    """Pick the backend for `world_size` ranks on a machine with `gpu_count` usable GPUs.

    >>> choose_backend("auto", 4, 0).backend
    'gloo'
    >>> choose_backend("auto", 2, 8).backend
    'nccl'
    """
    if requested not in BACKENDS:
        raise ValueError(f"backend={requested!r} is not one of {', '.join(map(repr, BACKENDS))}.")
    gpus = f"{gpu_count} CUDA GPU{'s' if gpu_count != 1 else ''}"
    if requested == "nccl":
        if gpu_count < world_size:
            raise ValueError(
                f"backend='nccl' needs one CUDA GPU per rank: {world_size} ranks, {gpus} found. "
                "NCCL cannot put two ranks on one GPU. Use backend='gloo' (CPU) or 'auto', "
                "or ask for at most as many ranks as GPUs."
            )
        return BackendChoice("nccl", f"nccl, one GPU per rank, as asked ({gpus} found)")
    if requested == "gloo":
        return BackendChoice("gloo", "gloo on CPU, as asked")
    if gpu_count == 0:
        return BackendChoice("gloo", "gloo on CPU: no usable CUDA GPU found")
    if world_size > gpu_count:
        return BackendChoice(
            "gloo",
            f"gloo on CPU: {world_size} ranks but only {gpus}, and NCCL needs one GPU per rank",
        )
    return BackendChoice("nccl", f"nccl: {gpus} found, one per rank")


def init_process_group(backend: str, local_rank: int, **kwargs) -> None:
    """Join torch.distributed's default group with `backend` ("gloo" or "nccl"), for labkit's pools and
    for torchrun alike. Under NCCL the rank takes GPU `local_rank`, and the group is
    "cpu:gloo,cuda:nccl": CUDA tensors go over NCCL, and the CPU tensors of the same cells over gloo."""
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, **kwargs)


def usable_gpu_count() -> int:
    """GPUs torch can use here; 0 without a CUDA build or driver. Never raises."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA install must not stop the CPU lab
        return 0


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no sched_getaffinity
        return os.cpu_count() or 1


def threads_per_rank(world_size: int, cores: int | None = None) -> int:
    """max(1, cores // ranks): R ranks on C cores must not start R x C threads; in a class, at most the
    instructor's LABKIT_MAX_THREADS_PER_RANK (labkit.classroom.caps), since the machine's cores are shared."""
    return capped_threads(max(1, (cores or cpu_count()) // world_size))
