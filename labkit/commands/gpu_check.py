"""`make gpu-check`: can labkit use this machine's GPUs, and do its kernels give torch's answers there?

1. What is here: torch's CUDA build, an NVIDIA driver, the devices torch can use, NCCL.
2. A verdict from those facts (`plan`, a pure function, so that every branch is tested on the CPU):
   - no CUDA build of torch and no NVIDIA driver: nothing to check, exit 0;
   - a CPU-only torch on a machine with an NVIDIA driver, or CUDA present but unusable: exit 1 with why;
   - GPUs: labkit's kernels against torch's collectives, BucketedDDP against torch's
     DistributedDataParallel, tensor parallelism against the unsplit layers, the pipeline executor's
     1F1B against one process, and the pool's health check, one rank per GPU under NCCL (at most
     labkit.MAX_WORLD_SIZE ranks). With one GPU, NCCL runs at world size 1 (it needs one GPU per rank)
     and two ranks share the GPU over gloo, whose collectives on CUDA tensors are broadcast and
     all_reduce only (PyTorch's distributed docs).
3. Exit status 1 if any check fails.
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings
from dataclasses import dataclass, field

import torch

import labkit
from labkit.launch import choose_backend
from labkit.measure import median_seconds
from labkit.tables import text_table

__all__ = ["KERNEL_DTYPES", "TIMED_NBYTES", "TOLERANCE", "DeviceFacts", "Plan", "Run", "backend_rows", "check_ddp",
           "check_health", "check_kernels", "check_pipeline", "check_tp", "device_rows", "execute", "gather_facts",
           "main", "plan", "print_table", "relative_error"]

TIMED_NBYTES = 64 << 20
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.int16, torch.complex64)
TOLERANCE = 1e-5  # relative: the same float32 training, summed in another order by another bucket layout


@dataclass(frozen=True)
class DeviceFacts:
    """What this machine offers, as gather_facts found it (tests build their own)."""

    torch_version: str
    cuda_build: str | None  # torch.version.cuda: None for a CPU-only build
    driver: str | None  # where an NVIDIA driver showed itself (nvidia-smi, /proc/driver/nvidia), or None
    gpu_count: int  # devices torch can use (each ran a tiny kernel)
    cuda_error: str | None  # why CUDA is unusable, when torch said so
    nccl: bool  # torch.distributed was built with NCCL
    visible_devices: str | None = None  # CUDA_VISIBLE_DEVICES, if set


@dataclass(frozen=True)
class Run:
    """One labkit.run world to check: `backend` with `world_size` ranks, tensors on `device` (None: each
    rank's labkit.device()), the checks named in `checks`."""

    backend: str
    world_size: int
    device: str | None
    checks: tuple[str, ...]
    why: str


@dataclass
class Plan:
    """What `plan` decided: an exit status and its message when the facts alone decide, else the runs to check,
    notes to print beside them and problems that fail the check whatever the runs show."""

    exit_code: int | None  # set when the facts alone decide (nothing to run)
    message: str
    runs: list[Run] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # make the exit status 1 even if every check passes


def gather_facts() -> DeviceFacts:
    """This machine's facts; never raises: a broken CUDA install is a fact to report."""
    driver = next((where for where, found in (("nvidia-smi", shutil.which("nvidia-smi")),
                                               ("/proc/driver/nvidia", os.path.exists("/proc/driver/nvidia")))
                   if found), None)
    count, error = 0, None
    if torch.version.cuda:
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                available = torch.cuda.is_available()
            if available:
                count = torch.cuda.device_count()
                for i in range(count):  # a kernel on each: catches a build without code for this GPU
                    torch.ones(1, device=f"cuda:{i}").add_(1).item()
            else:
                error = str(caught[0].message) if caught else None
                torch.cuda.init()  # raises with the reason when there is one
        except Exception as exc:  # noqa: BLE001 - reported, with the exit status 1
            count, error = 0, f"{type(exc).__name__}: {exc}".strip()
    import torch.distributed as dist

    return DeviceFacts(torch.__version__, torch.version.cuda, driver, count, error,
                       dist.is_available() and dist.is_nccl_available(), os.environ.get("CUDA_VISIBLE_DEVICES"))


def plan(facts: DeviceFacts, max_world_size: int = labkit.MAX_WORLD_SIZE) -> Plan:
    """What to check on a machine with these facts, or the verdict when there is nothing to run."""
    torch_is = f"torch {facts.torch_version}"
    if facts.gpu_count == 0:
        if facts.cuda_build is None and facts.driver is None:
            return Plan(0, f"No CUDA here: {torch_is} is a CPU-only build and no NVIDIA driver was found. Nothing "
                           "to check on a GPU; `make test` checks the same kernels on the CPU over gloo.")
        if facts.cuda_build is None:
            return Plan(1, f"This machine has an NVIDIA driver ({facts.driver} found) but {torch_is} is a CPU-only "
                           "build, so labkit runs everything on the CPU. Install a CUDA build: `make clean setup` "
                           "(with a driver present, setup takes PyPI's CUDA build), or set TORCH_INDEX (README).")
        if facts.driver is None and facts.cuda_error is None:
            return Plan(0, f"{torch_is} has CUDA {facts.cuda_build}, but no NVIDIA driver or GPU was found here. "
                           "Nothing to check on a GPU; `make test` checks the same kernels on the CPU over gloo.")
        why = facts.cuda_error or "torch sees no CUDA device"
        if facts.visible_devices is not None and facts.cuda_error is None:
            why += f" (CUDA_VISIBLE_DEVICES={facts.visible_devices!r} hides them?)"
        driver = f"found ({facts.driver})" if facts.driver else "not found"
        return Plan(1, f"CUDA is here but broken: {torch_is} (CUDA {facts.cuda_build}), NVIDIA driver {driver}, "
                       f"yet no GPU is usable: {why}")
    gpus = f"{facts.gpu_count} GPU{'s' if facts.gpu_count != 1 else ''}"
    result = Plan(None, f"{torch_is} (CUDA {facts.cuda_build}) uses {gpus}.")
    if not facts.nccl:
        result.problems.append(f"{torch_is} was built without NCCL: labkit's backend 'auto' will use gloo on the "
                               "CPU. Install a build with NCCL (Linux wheels from PyPI have it).")
        result.runs.append(_shared_gloo_run())
        return result
    world = min(facts.gpu_count, max_world_size)
    if facts.gpu_count > max_world_size:
        result.notes.append(f"{gpus}, but labkit.run takes at most {max_world_size} ranks (labkit.MAX_WORLD_SIZE): "
                            f"checked on {max_world_size}. Beyond that, run under torchrun (README).")
    if world == 1:
        result.notes.append("One GPU: NCCL needs one GPU per rank (two ranks on one device fail, 'Duplicate GPU "
                            "detected'), so NCCL runs at world size 1, where it moves nothing between ranks; two ranks "
                            "then share the GPU over gloo.")
    result.runs.append(Run("nccl", world, None, ("kernels", "ddp", "tp", "pipeline", "health"),
                           f"NCCL, {world} rank{'s' if world > 1 else ''}, one GPU each"))
    if world == 1:
        result.runs.append(_shared_gloo_run())
    return result


def _shared_gloo_run() -> Run:
    """Two ranks on one GPU over gloo: what can be checked between ranks when NCCL cannot pair them."""
    return Run("gloo", 2, "cuda:0", ("kernels",),
               "gloo, 2 ranks sharing cuda:0: gloo's collectives on CUDA tensors are broadcast and all_reduce only, "
               "so torch's answers come from those two, and labkit's sends go through host memory")


# ---- the checks, each run on every rank; rows are (check, detail, passed, labkit ms, torch ms) ----------------

def check_kernels(timed_nbytes: int = TIMED_NBYTES, device: str | None = None) -> list[tuple]:
    """Every labkit.comm kernel against torch, on `device` (default labkit.device()), for each of
    KERNEL_DTYPES; then a `timed_nbytes` ring_allreduce, batched and paired, against dist.all_reduce (0: no
    timing). torch's answers come from all_reduce and broadcast only, which every backend has for CUDA
    tensors; int16 is reduced by torch as int32 (neither NCCL nor gloo reduces int16)."""
    import torch.distributed as dist

    from labkit import comm

    n, rank = labkit.world_size(), labkit.rank()
    device = torch.device(device) if device else labkit.device()
    rows = []
    for dtype in KERNEL_DTYPES:
        mine = _small_numbers(1001, dtype, rank, device)
        wide = torch.int32 if dtype == torch.int16 else dtype
        total, root = mine.to(wide, copy=True), mine.to(wide, copy=True)
        placed = torch.zeros(7 * n, dtype=wide, device=device)
        placed[7 * rank:7 * (rank + 1)] = mine[:7]
        dist.all_reduce(total)
        dist.all_reduce(placed)  # every rank's first 7, in rank order: an all_gather from all_reduce
        dist.broadcast(root, src=n - 1)
        total, placed, root = total.to(dtype), placed.to(dtype), root.to(dtype)
        outcomes = {  # (what labkit's kernel gave, what torch's collectives gave)
            "ring_allreduce": (comm.ring_allreduce(mine.clone()), total),
            "naive_allreduce": (comm.naive_allreduce(mine.clone()), total),
            "ring_reduce_scatter": (comm.ring_reduce_scatter(mine), total.tensor_split(n)[rank]),
            "ring_allgather": (comm.ring_allgather(mine[:7].contiguous()), placed),
            "broadcast": (comm.broadcast(mine.clone(), n - 1), root),
            "reduce": (comm.reduce(mine.clone(), 0), total if rank == 0 else mine),
        }
        rows += [(name, str(dtype).removeprefix("torch."), bool(torch.equal(got, expected)), "", "")
                 for name, (got, expected) in outcomes.items()]
    if timed_nbytes:
        big = torch.randn(timed_nbytes // 4, device=device)
        for batched in (True, False):
            transport = comm.TorchTransport(batched=batched)
            rows.append((f"ring_allreduce {timed_nbytes >> 20} MiB, {'batched' if batched else 'paired'} steps",
                         "float32", True, _median_ms(lambda t=transport: comm.ring_allreduce(big, transport=t), device),
                         _median_ms(lambda: dist.all_reduce(big), device)))
    return rows


def _small_numbers(numel: int, dtype: torch.dtype, seed: int, device: torch.device) -> torch.Tensor:
    """Whole numbers in [-8, 8] (complex: both parts), so that sums are exact in every dtype and order."""
    parts = torch.randint(-8, 9, (2, numel), generator=torch.Generator().manual_seed(seed))
    values = torch.complex(parts[0].float(), parts[1].float()) if dtype.is_complex else parts[0]
    return values.to(device=device, dtype=dtype)


def check_ddp(device: str | None = None, steps: int = 3) -> list[tuple]:
    """BucketedDDP and torch's DistributedDataParallel train the same model side by side on `device`: the
    parameters agree within TOLERANCE (float32 sums in another bucket order need not be bit-equal)."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from labkit.models import make_classification, mlp
    from labkit.parallel import BucketedDDP

    device = torch.device(device) if device else labkit.device()
    n, rank = labkit.world_size(), labkit.rank()
    ours_model, torch_model = mlp(seed=rank).to(device), mlp(seed=rank).to(device)
    ours = BucketedDDP(ours_model, bucket_mb=0.004)
    theirs = DistributedDataParallel(torch_model, device_ids=[device.index] if device.type == "cuda" else None,
                                     bucket_cap_mb=0.004)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    x, y = make_classification(16 * n * steps)
    x, y = x.to(device), y.to(device)
    for step in range(steps):
        share = slice((step * n + rank) * 16, (step * n + rank + 1) * 16)
        for net, optimizer in zip((ours, theirs), optimizers, strict=True):
            optimizer.zero_grad()
            F.cross_entropy(net(x[share]), y[share]).backward()
            if net is ours:
                ours.finish()
            optimizer.step()
    error = max(relative_error(a, b) for a, b in zip(ours_model.parameters(), torch_model.parameters(), strict=True))
    return [("BucketedDDP vs torch DDP", f"{steps} SGD steps, max relative error {error:.1e}",
             error <= TOLERANCE, "", "")]


def check_tp(device: str | None = None) -> list[tuple]:
    """labkit.parallel.tensor's ParallelMLP against the unsplit MLP on `device`, in float64: output and
    input gradient agree to 1e-12."""
    from torch import nn

    from labkit.parallel import ParallelMLP

    device = torch.device(device) if device else labkit.device()
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(16, 24).double().to(device), nn.Linear(24, 16).double().to(device)
    x = torch.randn(5, 16, dtype=torch.float64, device=device)
    grad_out = torch.randn(5, 16, dtype=torch.float64, device=device)
    parallel = ParallelMLP.from_mlp(fc1, fc2, activation=nn.GELU())
    results = []
    for module in (nn.Sequential(fc1, nn.GELU(), fc2), parallel):
        inputs = x.clone().requires_grad_()
        out = module(inputs)
        out.backward(grad_out)
        results.append((out.detach(), inputs.grad))
    error = max(relative_error(a, b) for a, b in zip(*results, strict=True))
    return [("ParallelMLP vs the unsplit MLP", f"output and input gradient, max relative error {error:.1e}",
             error <= 1e-12, "", "")]


def check_pipeline(device: str | None = None) -> list[tuple]:
    """labkit.parallel's pipeline executor, 1F1B over all the ranks (one stage each, 2p micro-batches), against one
    process running the whole model on the whole batch, in float64: the loss and every stage's gradients agree
    to 1e-12 (the executor sums micro-batches' scaled losses, one process takes the mean at once). Its messages
    go between neighbouring stages over the backend's point-to-point (batch_isend_irecv on NCCL). The executor
    puts its layers on labkit.device(); `device` is accepted for the table's sake only."""
    import torch.nn.functional as F

    from labkit.models import make_classification, mlp
    from labkit.parallel import run_pipeline

    stages = labkit.world_size()
    model = mlp(hidden=16, layers=max(2, stages), dtype=torch.float64).to(labkit.device())
    reference = mlp(hidden=16, layers=max(2, stages), dtype=torch.float64).to(labkit.device())
    x, y = make_classification(8 * stages, dtype=torch.float64)
    x, y = x.to(labkit.device()), y.to(labkit.device())
    result = run_pipeline(model, "1f1b", 2 * stages, x, y, F.cross_entropy)
    loss = F.cross_entropy(reference(x), y)
    loss.backward()
    mine = [i for layers in result.layers for i in layers]
    errors = [relative_error(p.grad, q.grad) for i in mine
              for p, q in zip(model[i].parameters(), reference[i].parameters(), strict=True)]
    if result.loss is not None:
        errors.append(relative_error(torch.tensor(result.loss, dtype=torch.float64), loss.detach().cpu()))
    error = max(errors, default=0.0)
    return [("1F1B pipeline vs one process", f"{stages} stage(s), {2 * stages} micro-batches: loss and gradients, "
             f"max relative error {error:.1e}", error <= 1e-12, "", "")]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference between `a` and the reference `b`, over `b`'s largest magnitude (0 when empty)."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item() if b.numel() else 0.0


def _median_ms(fn, device: torch.device) -> str:
    """labkit.measure.median_seconds of `fn` on every rank, in milliseconds as the table shows them."""
    return f"{median_seconds(fn, repeats=5, device=device) * 1e3:.2f}"


def _fail_on_every_rank() -> None:
    raise RuntimeError("gpu-check: a deliberate failure on every rank")


def check_health(world_size: int, backend: str) -> list[tuple]:
    """The pool's health check: after a call that failed on every rank, in step, labkit probes the group
    (a tiny all_reduce on labkit.device()) and keeps the pool only if it answers. Kept = the same processes."""
    before = labkit.run(os.getpid, world_size=world_size, backend=backend)
    try:
        labkit.run(_fail_on_every_rank, world_size=world_size, backend=backend)
    except labkit.RankError:
        pass
    kept = labkit.run(os.getpid, world_size=world_size, backend=backend) == before
    return [("pool health check", "a failed call, then the probe's all_reduce; the pool kept", kept, "", "")]


def _on_ranks(checks: tuple[str, ...], device: str | None, timed_nbytes: int) -> list[tuple]:
    """On a rank: the named checks' rows."""
    rows = []
    if "kernels" in checks:
        rows += check_kernels(timed_nbytes, device)
    if "ddp" in checks:
        rows += check_ddp(device)
    if "tp" in checks:
        rows += check_tp(device)
    if "pipeline" in checks:
        rows += check_pipeline(device)
    return rows


def execute(run: Run, timed_nbytes: int = TIMED_NBYTES) -> list[tuple]:
    """The rows of one Run, each passed only if it passed on every rank (rank 0's details and times)."""
    timed = timed_nbytes if run.backend == "nccl" and run.world_size > 1 else 0
    per_rank = labkit.run(_on_ranks, run.checks, run.device, timed, world_size=run.world_size, backend=run.backend,
                          timeout=300)
    rows = [(*per_rank[0][i][:2], all(rank[i][2] for rank in per_rank), *per_rank[0][i][3:])
            for i in range(len(per_rank[0]))]
    if "health" in run.checks:
        rows += check_health(run.world_size, run.backend)
    return rows


def backend_rows(gpu_count: int, max_world_size: int = labkit.MAX_WORLD_SIZE) -> list[tuple]:
    """(ranks, backend, reason) for 1 .. gpu_count + 1 ranks (one past the GPUs shows the fallback), at most
    `max_world_size` rows."""
    return [(n, choose_backend("auto", n, gpu_count).backend, choose_backend("auto", n, gpu_count).reason)
            for n in range(1, min(gpu_count + 1, max_world_size) + 1)]


def device_rows() -> list[tuple]:
    """(index, name, memory GiB, compute capability) of each CUDA device."""
    return [(i, torch.cuda.get_device_name(i), f"{torch.cuda.get_device_properties(i).total_memory / 2**30:.0f}",
             "{}.{}".format(*torch.cuda.get_device_capability(i))) for i in range(torch.cuda.device_count())]


def print_table(title: str, header: tuple, rows: list[tuple]) -> None:
    """`title`, then the rows under `header` as an indented labkit.tables.text_table."""
    print(f"\n{title}\n{text_table(header, rows, indent='  ')}")


def main(facts: DeviceFacts | None = None) -> int:
    """Print this machine's facts, the verdict and every check's table; 1 if a check failed or a problem was found."""
    facts = facts or gather_facts()
    print(f"labkit gpu-check: torch {facts.torch_version}, CUDA build {facts.cuda_build or 'none'}, NVIDIA driver "
          f"{facts.driver or 'not found'}, usable GPUs {facts.gpu_count}")
    decided = plan(facts)
    print(decided.message)
    if decided.exit_code is not None:
        return decided.exit_code
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if facts.nccl else "not in this build"
    print_table(f"CUDA devices (NCCL {nccl})", ("index", "name", "GiB", "capability"), device_rows())
    print_table("Backend chosen by labkit (backend='auto')", ("ranks", "backend", "why"), backend_rows(facts.gpu_count))
    for note in decided.notes:
        print(f"\nNote: {note}")
    failed, checked = [], []
    for run in decided.runs:
        rows = execute(run)
        print_table(f"{run.why}: labkit against torch", ("check", "detail", "passed", "labkit ms", "torch ms"), rows)
        failed += [f"{row[0]} ({row[1]}, {run.backend})" for row in rows if not row[2]]
        checked.append(f"{len(rows)} checks on {run.backend} with {run.world_size} rank(s) "
                       f"({', '.join(run.checks)})")
    labkit.shutdown()
    print(f"\nChecked: {'; '.join(checked)}.")
    for problem in decided.problems:
        print(f"PROBLEM: {problem}")
    if failed:
        print(f"FAILED: {'; '.join(failed)}")
    elif not decided.problems:
        print("All checks passed.")
    return 1 if failed or decided.problems else 0


if __name__ == "__main__":
    sys.exit(main())
