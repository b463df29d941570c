"""`make gpu-check`'s logic on the CPU: the verdict for faked machines, and every check over gloo."""

import dataclasses

import pytest
import torch

import labkit
from labkit.commands import gpu_check
from labkit.commands.gpu_check import DeviceFacts, Run, plan

CPU_LAPTOP = DeviceFacts("2.13.0+cpu", None, None, 0, None, nccl=False)
GPU_BOX = DeviceFacts("2.13.0+cu130", "13.0", "nvidia-smi", 8, None, nccl=True)


def facts(**changes) -> DeviceFacts:
    return dataclasses.replace(GPU_BOX, **changes)


def test_no_cuda_build_and_no_driver_is_nothing_to_check():
    verdict = plan(CPU_LAPTOP)
    assert verdict.exit_code == 0 and not verdict.runs
    assert "CPU-only build and no NVIDIA driver" in verdict.message


def test_a_cpu_only_torch_beside_an_nvidia_driver_fails_and_says_how_to_fix_it():
    verdict = plan(dataclasses.replace(CPU_LAPTOP, driver="/proc/driver/nvidia"))
    assert verdict.exit_code == 1
    assert "NVIDIA driver (/proc/driver/nvidia found)" in verdict.message and "CPU-only" in verdict.message
    assert "make clean setup" in verdict.message


def test_a_cuda_build_without_a_driver_is_nothing_to_check():
    verdict = plan(facts(driver=None, gpu_count=0))
    assert verdict.exit_code == 0 and "no NVIDIA driver or GPU" in verdict.message


@pytest.mark.parametrize("driver", ["nvidia-smi", None])
def test_cuda_present_but_broken_fails_with_the_reason(driver):
    error = "RuntimeError: The NVIDIA driver on your system is too old (found version 11040)."
    verdict = plan(facts(driver=driver, gpu_count=0, cuda_error=error))
    assert verdict.exit_code == 1 and "CUDA is here but broken" in verdict.message and error in verdict.message


def test_hidden_gpus_are_named_as_the_likely_reason():
    verdict = plan(facts(gpu_count=0, visible_devices=""))
    assert verdict.exit_code == 1 and "CUDA_VISIBLE_DEVICES=''" in verdict.message


def test_one_gpu_runs_nccl_alone_then_two_ranks_sharing_it_over_gloo():
    verdict = plan(facts(gpu_count=1))
    assert verdict.exit_code is None and not verdict.problems
    assert [(r.backend, r.world_size, r.device) for r in verdict.runs] == [("nccl", 1, None), ("gloo", 2, "cuda:0")]
    assert set(verdict.runs[0].checks) == {"kernels", "ddp", "tp", "pipeline", "health"}
    assert verdict.runs[1].checks == ("kernels",) and "broadcast and all_reduce only" in verdict.runs[1].why
    assert any("NCCL needs one GPU per rank" in note for note in verdict.notes)


@pytest.mark.parametrize("gpus, world", [(2, 2), (8, 8), (16, 16), (20, 16)])
def test_one_rank_per_gpu_up_to_labkits_limit(gpus, world):
    verdict = plan(facts(gpu_count=gpus))
    assert [(r.backend, r.world_size, r.device) for r in verdict.runs] == [("nccl", world, None)]
    assert any("labkit.MAX_WORLD_SIZE" in note for note in verdict.notes) == (gpus > labkit.MAX_WORLD_SIZE)


def test_a_build_without_nccl_is_a_problem_even_if_gloo_works():
    verdict = plan(facts(gpu_count=2, nccl=False))
    assert verdict.problems and "without NCCL" in verdict.problems[0]
    assert [r.backend for r in verdict.runs] == ["gloo"]


def test_main_stops_at_the_verdict_without_starting_ranks(capsys):
    assert gpu_check.main(CPU_LAPTOP) == 0
    assert gpu_check.main(dataclasses.replace(CPU_LAPTOP, driver="nvidia-smi")) == 1
    out = capsys.readouterr().out
    assert "No CUDA here" in out and "CPU-only build, so labkit runs everything on the CPU" in out


def test_the_facts_of_this_machine():
    found = gpu_check.gather_facts()
    assert found.torch_version == torch.__version__ and found.cuda_build == torch.version.cuda
    if not torch.cuda.is_available():
        assert found.gpu_count == 0


def test_a_cuda_that_raises_is_a_fact_not_a_crash(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device")
    monkeypatch.setattr(torch, "ones", broken)
    found = gpu_check.gather_facts()
    assert found.gpu_count == 0 and "no kernel image" in found.cuda_error
    assert plan(found).exit_code == 1


def test_backend_table_goes_one_past_the_gpus_up_to_labkits_limit():
    assert [(n, backend) for n, backend, _ in gpu_check.backend_rows(2)] == [(1, "nccl"), (2, "nccl"), (3, "gloo")]
    assert [(n, backend) for n, backend, _ in gpu_check.backend_rows(0)] == [(1, "gloo")]
    assert "only 2 CUDA GPUs" in gpu_check.backend_rows(2)[-1][2]
    assert len(gpu_check.backend_rows(64)) == labkit.MAX_WORLD_SIZE


def test_kernel_checks_pass_on_cpu_ranks():
    per_rank = labkit.run(gpu_check.check_kernels, 1 << 16, world_size=3)
    names = {row[0] for row in per_rank[0]}
    assert {"ring_allreduce", "naive_allreduce", "ring_reduce_scatter", "ring_allgather", "broadcast",
            "reduce"} <= names
    assert {row[1] for row in per_rank[0]} >= {"float32", "bfloat16", "int16", "complex64"}
    assert sum("batched" in row[0] or "paired" in row[0] for row in per_rank[0]) == 2
    assert all(row[2] for rows in per_rank for row in rows)


def broken_ring(timed_nbytes):
    """check_kernels with a ring that adds one too many: the check must say so."""
    from labkit import comm

    original = comm.ring_allreduce
    comm.ring_allreduce = lambda t, *args, **kwargs: original(t, *args, **kwargs).add_(1)
    try:
        return gpu_check.check_kernels(timed_nbytes)
    finally:
        comm.ring_allreduce = original


def test_a_wrong_kernel_fails_its_check():
    rows = labkit.run(broken_ring, 0, world_size=2)[0]
    assert {row[2] for row in rows if row[0] == "ring_allreduce"} == {False}
    assert all(row[2] for row in rows if row[0] != "ring_allreduce")


def test_every_check_of_a_run_passes_on_cpu_ranks():
    rows = gpu_check.execute(Run("gloo", 2, None, ("kernels", "ddp", "tp", "pipeline", "health"), "gloo on the CPU"),
                             timed_nbytes=0)
    checks = {row[0] for row in rows}
    assert {"BucketedDDP vs torch DDP", "ParallelMLP vs the unsplit MLP", "1F1B pipeline vs one process",
            "pool health check"} <= checks
    assert all(row[2] for row in rows), [row for row in rows if not row[2]]


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_the_pipeline_check_passes_on_cpu_ranks(world_size):
    per_rank = labkit.run(gpu_check.check_pipeline, world_size=world_size)
    assert [rows[0][0] for rows in per_rank] == ["1F1B pipeline vs one process"] * world_size
    assert all(rows[0][2] for rows in per_rank), per_rank
    assert f"{world_size} stage(s), {2 * world_size} micro-batches" in per_rank[0][0][1]


def pipeline_with_a_wrong_gradient():
    """check_pipeline with an executor whose last stage's gradients come out twice too large."""
    from labkit import parallel

    original = parallel.run_pipeline

    def doubled(model, *args, **kwargs):
        result = original(model, *args, **kwargs)
        if labkit.rank() == labkit.world_size() - 1:
            for i in result.layers[-1]:
                for p in model[i].parameters():
                    p.grad *= 2
        return result

    parallel.run_pipeline = doubled
    try:
        return gpu_check.check_pipeline()
    finally:
        parallel.run_pipeline = original


def test_a_wrong_pipeline_fails_its_check_on_the_stage_that_is_wrong():
    rows = labkit.run(pipeline_with_a_wrong_gradient, world_size=2)
    assert [r[0][2] for r in rows] == [True, False]
    assert "max relative error 1.0e+00" in rows[1][0][1]


def test_table_printing(capsys):
    gpu_check.print_table("T", ("a", "bb"), [(1, "x"), (22, "yyy")])
    assert capsys.readouterr().out.splitlines()[-1] == "  22  yyy"


def timings_through_labkit_measure():
    """check_kernels with labkit.measure.median_seconds replaced by a recorder: what it timed, on which device."""
    timed = []
    real = gpu_check.median_seconds
    gpu_check.median_seconds = lambda fn, repeats, device: timed.append((repeats, str(device))) or 0.00125
    try:
        rows = gpu_check.check_kernels(1 << 12)
    finally:
        gpu_check.median_seconds = real
    return timed, [row[3:] for row in rows if row[3]]


def test_the_ring_is_timed_by_labkit_measures_barrier_and_median():
    timed, times = labkit.run(timings_through_labkit_measure, world_size=2)[0]
    assert timed == [(5, "cpu")] * 4  # batched and paired: labkit's ring, then torch's all_reduce
    assert times == [("1.25", "1.25")] * 2
