"""`make gpu-check`'s logic on the CPU: backend table with faked GPU counts, kernel checks over gloo."""

import labkit
from labkit import gpu_check


def test_backend_table_goes_one_past_the_gpus():
    assert [(n, backend) for n, backend, _ in gpu_check.backend_rows(2)] == [(1, "nccl"), (2, "nccl"), (3, "gloo")]
    assert [(n, backend) for n, backend, _ in gpu_check.backend_rows(0)] == [(1, "gloo")]
    assert "only 2 CUDA GPUs" in gpu_check.backend_rows(2)[-1][2]


def test_kernel_checks_pass_on_cpu_ranks():
    per_rank = labkit.run(gpu_check.check_kernels, 1 << 16, world_size=3)
    names = {row[0] for row in per_rank[0]}
    assert {"ring_allreduce", "naive_allreduce", "ring_reduce_scatter", "ring_allgather", "broadcast",
            "reduce"} <= names
    assert all(row[2] for rows in per_rank for row in rows)


def test_without_cuda_it_says_so_and_succeeds(capsys):
    assert gpu_check.main(gpu_count=0) == 0
    assert "No usable CUDA device here" in capsys.readouterr().out


def test_table_printing(capsys):
    gpu_check.print_table("T", ("a", "bb"), [(1, "x"), (22, "yyy")])
    assert capsys.readouterr().out.splitlines()[-1] == "  22  yyy"
