"""Who am I? `rank()`, `world_size()` and `device()` for code running on a rank.

They work the same under labkit's pool and under `torchrun`: both initialise torch.distributed's
default process group, and the backend says where tensors live (NCCL: this rank's GPU).
"""

from __future__ import annotations

import os

from labkit.groups import require_group

__all__ = ["device", "local_rank", "rank", "world_size"]


def _dist(caller: str):
    """torch.distributed, once `caller` (say "labkit.rank()") is known to run inside a rank."""
    import torch.distributed as dist

    require_group(caller)
    return dist


def rank() -> int:
    """This process's rank in the default process group (0 .. world_size() - 1)."""
    return _dist("labkit.rank()").get_rank()


def world_size() -> int:
    """Number of ranks in the default process group."""
    return _dist("labkit.world_size()").get_world_size()


def local_rank() -> int:
    """Rank among the processes on this machine (torchrun's LOCAL_RANK; the rank on one node)."""
    value = os.environ.get("LOCAL_RANK")
    return int(value) if value is not None else rank()


def device():
    """Where this rank's tensors belong: cuda:LOCAL_RANK when NCCL is in the group, the CPU otherwise.

    Under labkit's NCCL pools, CPU tensors still work: they travel over gloo."""
    import torch

    dist = _dist("labkit.device()")
    if "nccl" in dist.get_backend():  # "nccl", or "cpu:gloo,cuda:nccl"
        return torch.device("cuda", local_rank())
    return torch.device("cpu")
