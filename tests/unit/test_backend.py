"""Backend selection with a faked GPU count, and threads per rank."""

import pytest

from labkit.launch.backend import choose_backend, threads_per_rank


@pytest.mark.parametrize("world_size, gpus, backend, reason", [
    (4, 0, "gloo", "no usable CUDA GPU"),
    (4, 2, "gloo", "4 ranks but only 2 CUDA GPUs"),
    (2, 2, "nccl", "2 CUDA GPUs found, one per rank"),
    (1, 8, "nccl", "8 CUDA GPUs"),
])
def test_auto(world_size, gpus, backend, reason):
    choice = choose_backend("auto", world_size, gpus)
    assert choice.backend == backend and reason in choice.reason


def test_gloo_when_asked_even_with_gpus():
    assert choose_backend("gloo", 2, 8).backend == "gloo"


@pytest.mark.parametrize("gpus", [0, 1])
def test_nccl_needs_a_gpu_per_rank(gpus):
    with pytest.raises(ValueError, match="NCCL cannot put two ranks on one GPU"):
        choose_backend("nccl", 2, gpus)


def test_nccl_when_asked_and_possible():
    assert choose_backend("nccl", 2, 2).backend == "nccl"


@pytest.mark.parametrize("world_size, cores, threads", [(4, 2, 1), (2, 8, 4), (3, 8, 2), (1, 1, 1)])
def test_threads_per_rank(world_size, cores, threads):
    assert threads_per_rank(world_size, cores) == threads
