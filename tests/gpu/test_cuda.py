"""On CUDA: labkit's kernels and layers on GPU tensors against torch, and the debugging demos under NCCL.

Every test skips, saying why, where torch.cuda.is_available() is False or there are fewer GPUs than it
needs. With one GPU the kernels run twice: NCCL at world size 1 (NCCL needs one GPU per rank) and two
ranks sharing the GPU over gloo, which carries CUDA tensors for broadcast and all_reduce (labkit.comm's
point-to-point goes through host memory there). `make gpu-test` runs this file and run_notebooks.py.
"""

from __future__ import annotations

import functools
import os
import re

import pytest
import torch
import torch.distributed as dist

import labkit
from labkit import comm
from labkit.comm.wire import DTYPES
from labkit.commands import gpu_check

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
NO_CUDA = f"CUDA is not available (torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'})"
NOTEBOOK_10 = os.path.join(os.path.dirname(__file__), "..", "..", "notebooks", "10_nccl_and_debugging.ipynb")


def needs_gpus(count: int):
    reason = NO_CUDA if GPUS == 0 else f"needs {count} GPUs (one per rank under NCCL), {GPUS} here"
    return pytest.mark.skipif(GPUS < count, reason=reason)


def worlds() -> list:
    """(backend, world_size, device) to run in: one rank per GPU (at most 4) under NCCL; with one GPU, NCCL
    alone and two ranks sharing it over gloo. device None: each rank's labkit.device()."""
    if GPUS == 0:
        return [pytest.param(None, marks=pytest.mark.skip(reason=NO_CUDA), id="no-cuda")]
    if GPUS == 1:
        return [pytest.param(("nccl", 1, None), id="nccl-1"), pytest.param(("gloo", 2, "cuda:0"), id="gloo-2-shared")]
    return [pytest.param(("nccl", min(GPUS, 4), None), id=f"nccl-{min(GPUS, 4)}")]


def run_in(world, fn, *args, timeout: float = 120):
    backend, world_size, device = world
    return labkit.run(fn, *args, device, world_size=world_size, backend=backend, timeout=timeout)


def _device(device: str | None) -> torch.device:
    return torch.device(device) if device else labkit.device()


# ---- labkit.comm on CUDA tensors, every dtype ---------------------------------------------------------------

def small_numbers(rank: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Whole numbers in [0, 3] (complex: both parts; bool: 0 or 1), seeded by rank: exact sums in every dtype."""
    parts = torch.randint(0, 4 if dtype != torch.bool else 2, (2, 37), generator=torch.Generator().manual_seed(rank))
    values = torch.complex(parts[0].float(), parts[1].float()) if dtype.is_complex else parts[0]
    return values.to(device=device, dtype=dtype)


def every_dtype(device):
    """Each kernel on each of labkit.comm's dtypes, against sums computed from every rank's (known) input."""
    device = _device(device)
    n, rank = labkit.world_size(), labkit.rank()
    results = {}
    for dtype in DTYPES:
        inputs = [small_numbers(r, dtype, device) for r in range(n)]
        total = functools.reduce(torch.add, inputs)
        mine = inputs[rank]
        checks = {
            "ring_allreduce": torch.equal(comm.ring_allreduce(mine.clone()), total),
            "naive_allreduce": torch.equal(comm.naive_allreduce(mine.clone()), total),
            "ring_reduce_scatter": torch.equal(comm.ring_reduce_scatter(mine), total.tensor_split(n)[rank]),
            "ring_allgather": torch.equal(comm.ring_allgather(mine[:5].contiguous()),
                                          torch.cat([x[:5] for x in inputs])),
            "broadcast": torch.equal(comm.broadcast(mine.clone(), n - 1), inputs[-1]),
            "reduce": torch.equal(comm.reduce(mine.clone(), 0), total if rank == 0 else mine),
        }
        results[str(dtype)] = [name for name, ok in checks.items() if not ok]
    return results


@pytest.mark.parametrize("world", worlds())
def test_every_kernel_on_every_dtype_on_cuda(world):
    for rank, failures in enumerate(run_in(world, every_dtype)):
        assert not any(failures.values()), (rank, {d: f for d, f in failures.items() if f})


def ring_against_torch(device):
    """The ring, batched and paired, on random float32 CUDA tensors, against dist.all_reduce."""
    device = _device(device)
    mine = torch.randn(1 << 20, generator=torch.Generator().manual_seed(labkit.rank())).to(device)
    expected = mine.clone()
    dist.all_reduce(expected)
    errors = {}
    for batched in (True, False):
        got = comm.ring_allreduce(mine.clone(), transport=comm.TorchTransport(batched=batched))
        errors[batched] = ((got - expected).abs().max() / expected.abs().max()).item()
    return errors, str(comm.TorchTransport().carriage(mine))


@pytest.mark.parametrize("world", worlds())
def test_ring_on_cuda_tensors_equals_torchs_all_reduce(world):
    for errors, carriage in run_in(world, ring_against_torch):
        assert max(errors.values()) < 1e-5, errors
        assert ("backend='nccl'" if world[0] == "nccl" else "via_host=True") in carriage


# ---- failures under NCCL raise in the call that caused them ----------------------------------------------

def mismatched_comm(device):
    comm.ring_allreduce(torch.zeros(4 + labkit.rank(), device=_device(device)))


@pytest.mark.parametrize("world", worlds())
def test_mismatched_cuda_tensors_are_a_clear_error_in_their_own_call(world):
    if world[1] == 1:
        pytest.skip("one rank cannot disagree with itself")
    with pytest.raises(labkit.RankError, match="the ranks passed different tensors"):
        run_in(world, mismatched_comm, timeout=30)
    assert run_in(world, lambda device: labkit.rank()) == list(range(world[1]))


def one_rank_all_reduces(device):
    t = torch.ones(3, device=_device(device))
    if labkit.rank() == 0:
        dist.all_reduce(t)
    return t.sum().item()  # waits for the GPU: rank 0 waits for a peer that never comes


@needs_gpus(2)
def test_a_mismatched_nccl_collective_times_out_in_its_own_call_and_the_next_call_works():
    """On NCCL rank 0's all_reduce returns once queued and the rank waits in .item(): the Flight Recorder's line
    still names the all_reduce it is in, and rank 1 as the one that never called it (labkit.launch.inflight)."""
    with pytest.raises(labkit.RankTimeout, match="rank 0") as info:
        labkit.run(one_rank_all_reduces, None, world_size=2, backend="nccl", timeout=10)
    report = str(info.value)
    assert re.search(r"rank 0 is in all_reduce #(\d+); rank 1 never called all_reduce #\1 .*So rank 1 diverged\.",
                     report), report
    assert re.search(r"rank 0: .*; it is in all_reduce #\d+ of the default group", report), report  # (nccl) may follow
    assert labkit.run(lambda: labkit.rank(), world_size=2, backend="nccl") == [0, 1]


# ---- data and tensor parallelism on CUDA -------------------------------------------------------------------

@needs_gpus(1)
def test_bucketed_ddp_equals_torch_ddp_on_cuda():
    world = min(GPUS, 4)
    rows = labkit.run(gpu_check.check_ddp, world_size=world, backend="nccl", timeout=120)
    assert all(row[2] for rank_rows in rows for row in rank_rows), rows


def tp_against_torch():
    """ParallelMLP and torch's parallelize_module(ColwiseParallel, RowwiseParallel) on the same MLP, on CUDA."""
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from labkit.parallel import ParallelMLP

    device = labkit.device()
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(16, 32).double().to(device), nn.Linear(32, 16).double().to(device)
    x = torch.randn(5, 16, dtype=torch.float64, device=device)
    grad_out = torch.randn(5, 16, dtype=torch.float64, device=device)
    ours = ParallelMLP.from_mlp(fc1, fc2, activation=nn.GELU())
    mesh = DeviceMesh("cuda", list(range(labkit.world_size())))
    theirs = parallelize_module(nn.Sequential(fc1, nn.GELU(), fc2), mesh,
                                {"0": ColwiseParallel(), "2": RowwiseParallel()})
    outs = []
    for module in (ours, theirs):
        inputs = x.clone().requires_grad_()
        y = module(inputs)
        y.backward(grad_out)
        outs.append((y.detach(), inputs.grad))
    return max(gpu_check.relative_error(a, b) for a, b in zip(*outs, strict=True))


@needs_gpus(1)
def test_tensor_parallel_layers_equal_torchs_api_and_the_unsplit_layers_on_cuda():
    world = 2 if GPUS >= 2 else 1
    assert max(labkit.run(tp_against_torch, world_size=world, backend="nccl", timeout=120)) <= 1e-12
    rows = labkit.run(gpu_check.check_tp, world_size=world, backend="nccl", timeout=120)
    assert all(row[2] for rank_rows in rows for row in rank_rows), rows


# ---- the whole check, and notebook 10's hang diagnoses under NCCL -------------------------------------------

@needs_gpus(1)
def test_make_gpu_check_passes(capsys):
    labkit.shutdown()
    assert gpu_check.main() == 0, capsys.readouterr().out
    assert "All checks passed." in capsys.readouterr().out


@needs_gpus(2)
def test_notebook_10s_hang_diagnoses_work_under_nccl(tmp_path):
    """Its cells assert each diagnosis (timeout report, monitored_barrier on a gloo group, DETAIL's mismatch)."""
    import nbformat
    import papermill

    out = tmp_path / "10.ipynb"
    papermill.execute_notebook(NOTEBOOK_10, str(out), parameters={"world_size": 2}, kernel_name="python3",
                               cwd=os.path.dirname(NOTEBOOK_10), progress_bar=False, execution_timeout=300)
    printed = "".join(o.get("text", "") for c in nbformat.read(out, as_version=4).cells if c.cell_type == "code"
                      for o in c.outputs)
    assert "2 ranks, nccl" in printed and "Rank 1 failed to pass monitoredBarrier" in printed
