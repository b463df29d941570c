"""labkit's AllReduce as a command-line entry point, for `torchrun` on one machine or across several.

    torchrun --nproc-per-node 4 -m labkit.commands.allreduce_check
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 \\
        --rdzv-backend c10d --rdzv-endpoint HEAD_NODE:29400 -m labkit.commands.allreduce_check --numel 1000000

torchrun starts the processes and sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous address; each
process joins the default group from those (env://), picks NCCL when this node has a GPU for each
of its local ranks (gloo on the CPU otherwise), runs the kernel, checks it against torch's own
collective and prints one JSON line. The exit status is 0 only if every check on this rank passed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

import labkit
from labkit import comm
from labkit.checks import choice, whole
from labkit.launch import choose_backend, init_process_group, usable_gpu_count

__all__ = ["ALGORITHMS", "check_allreduce", "init_from_environment", "main"]

ALGORITHMS = ("ring_allreduce", "naive_allreduce")


def init_from_environment(backend: str = "auto", timeout_seconds: float = 120.0) -> str:
    """Join torch.distributed's default group from torchrun's environment; the backend's reason."""
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise SystemExit(f"labkit.commands.allreduce_check: {', '.join(missing)} not set: start it with torchrun, "
                         "e.g. `torchrun --nproc-per-node 2 -m labkit.commands.allreduce_check`.")
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    choice = choose_backend(backend, local_ranks, usable_gpu_count())
    init_process_group(choice.backend, labkit.local_rank(), timeout=datetime.timedelta(seconds=timeout_seconds))
    return choice.reason


def check_allreduce(algorithm: str, numel: int) -> dict:
    """Run labkit.comm's `algorithm` (one of ALGORITHMS) and torch's all_reduce on the same input of `numel`
    elements; compare them exactly."""
    algorithm, numel = choice("algorithm", algorithm, ALGORITHMS), whole("numel", numel, minimum=0)
    generator = torch.Generator().manual_seed(1000 + dist.get_rank())
    mine = torch.randint(-8, 9, (numel,), generator=generator).float().to(labkit.device())
    expected = mine.clone()
    dist.all_reduce(expected)
    getattr(comm, algorithm)(mine)
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "backend": dist.get_backend(),
            "device": str(labkit.device()), "algorithm": algorithm, "numel": numel,
            "ok": bool(torch.equal(mine, expected)), "host": os.uname().nodename}


def main(argv: list[str] | None = None) -> int:
    """Check labkit's AllReduce against torch's on this rank and print one JSON line; 0 if they agree."""
    parser = argparse.ArgumentParser(prog="python -m labkit.commands.allreduce_check",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="ring_allreduce")
    parser.add_argument("--numel", type=int, default=1 << 20, help="elements of the float32 tensor")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    options = parser.parse_args(argv)
    try:
        whole("--numel", options.numel, minimum=0)
    except ValueError as error:  # before joining the group: a usage error, exit status 2
        parser.error(str(error))
    reason = init_from_environment(options.backend)
    try:
        result = check_allreduce(options.algorithm, options.numel)
        # One write per line: the local ranks share torchrun's stdout, and print() may write the text and
        # its newline separately, letting another rank's line land in between.
        sys.stdout.write(json.dumps({**result, "why": reason}) + "\n")
        sys.stdout.flush()
        return 0 if result["ok"] else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
