"""`make gpu-check`: what labkit does with this machine's GPUs, in three tables.

1. the CUDA devices torch sees (and the NCCL version);
2. the backend `auto` picks for 1 .. GPUs+1 ranks, and why;
3. each of labkit's kernels on CUDA tensors under NCCL, with one rank per GPU, checked against
   torch's own collective and timed.

Without CUDA it says so and exits 0: the same kernels are checked on the CPU by `make test`.
Exit status 1 if any check fails.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import labkit
from labkit.launch.backend import choose_backend, usable_gpu_count

TIMED_NBYTES = 64 << 20


def backend_rows(gpu_count: int) -> list[tuple]:
    """(ranks, backend, reason) for 1 .. gpu_count + 1 ranks: one past the GPUs shows the fallback."""
    return [(n, choose_backend("auto", n, gpu_count).backend, choose_backend("auto", n, gpu_count).reason)
            for n in range(1, gpu_count + 2)]


def device_rows() -> list[tuple]:
    """(index, name, memory GiB, compute capability) of each CUDA device."""
    return [(i, torch.cuda.get_device_name(i), f"{torch.cuda.get_device_properties(i).total_memory / 2**30:.0f}",
             "{}.{}".format(*torch.cuda.get_device_capability(i))) for i in range(torch.cuda.device_count())]


def check_kernels(timed_nbytes: int = TIMED_NBYTES) -> list[tuple]:
    """On a rank: every labkit.comm kernel against torch's counterpart, on labkit.device(); one row each:
    (kernel, dtype, exact match, labkit ms, torch ms), timed for a `timed_nbytes` tensor."""
    import torch.distributed as dist

    from labkit import comm

    n, rank, device = labkit.world_size(), labkit.rank(), labkit.device()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        mine = torch.randint(-8, 9, (1001,), generator=torch.Generator().manual_seed(rank)).to(dtype).to(device)
        total = mine.clone()
        dist.all_reduce(total)
        pieces = [torch.empty(7, dtype=dtype, device=device) for _ in range(n)]
        dist.all_gather(pieces, mine[:7].contiguous())
        whole = torch.cat(pieces)
        root = mine.clone()
        dist.broadcast(root, src=n - 1)
        outcomes = {  # (what labkit's kernel gave, what torch's collective gave)
            "ring_allreduce": (comm.ring_allreduce(mine.clone()), total),
            "naive_allreduce": (comm.naive_allreduce(mine.clone()), total),
            "ring_reduce_scatter": (comm.ring_reduce_scatter(mine), total.tensor_split(n)[rank]),
            "ring_allgather": (comm.ring_allgather(mine[:7].contiguous()), whole),
            "broadcast": (comm.broadcast(mine.clone(), n - 1), root),
            "reduce": (comm.reduce(mine.clone(), 0), total if rank == 0 else mine),
        }
        rows += [(name, str(dtype).removeprefix("torch."), bool(torch.equal(got, expected)), "", "")
                 for name, (got, expected) in outcomes.items()]
    big = torch.randn(timed_nbytes // 4, device=device)
    rows.append((f"ring_allreduce, {timed_nbytes >> 20} MiB", "float32", True,
                 _median_ms(lambda: comm.ring_allreduce(big)), _median_ms(lambda: dist.all_reduce(big))))
    return rows


def _median_ms(fn, repeats: int = 5) -> str:
    import torch.distributed as dist

    fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return f"{statistics.median(times) * 1e3:.2f}"


def print_table(title: str, header: tuple, rows: list[tuple]) -> None:
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows, strict=True)]
    print(f"\n{title}")
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  " + "  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)))


def main(gpu_count: int | None = None) -> int:
    gpus = usable_gpu_count() if gpu_count is None else gpu_count
    print(f"labkit gpu-check: torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}")
    if gpus == 0:
        print("No usable CUDA device here: nothing to check on a GPU. `make test` checks the same kernels on "
              "the CPU over gloo.")
        return 0
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "unknown"
    print_table(f"CUDA devices (NCCL {nccl})", ("index", "name", "GiB", "capability"), device_rows())
    print_table("Backend chosen by labkit (backend='auto')", ("ranks", "backend", "why"), backend_rows(gpus))
    per_rank = labkit.run(check_kernels, world_size=gpus, backend="nccl", timeout=300)
    rows = [(*per_rank[0][i][:2], all(rank[i][2] for rank in per_rank), *per_rank[0][i][3:])
            for i in range(len(per_rank[0]))]
    print_table(f"labkit.comm on CUDA tensors, NCCL, {gpus} ranks (one per GPU), against torch's collectives",
                ("kernel", "dtype", "same as torch", "labkit ms", "torch ms"), rows)
    labkit.shutdown()
    failed = [row[0] for row in rows if not row[2]]
    print("\nall checks passed" if not failed else f"\nFAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
