"""On CUDA: notebook 17's context parallelism on GPU tensors, and torch's own context_parallel, which runs only
there (torch 2.13 shards the CUDA scaled_dot_product_attention kernels alone: flash, memory-efficient, cuDNN; on a
CPU it raises NotImplementedError, which tests/distributed/test_context_parallel.py asserts). Every test skips,
saying why, where CUDA or a second GPU is missing.

Not run on the machines that wrote it (no GPU there): designed from PyTorch's documentation of
torch.distributed.tensor.experimental.context_parallel (the buffers are sharded in place along `buffer_seq_dims`,
reordered head-tail for load balance, SDPA inside the context runs as ring attention, and
context_parallel_unshard puts an output back in order) and of NCCL (one GPU per rank; point-to-point in
batch_isend_irecv).
"""

from __future__ import annotations

import pytest
import torch

import labkit
from labkit.parallel import context

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
NO_CUDA = f"CUDA is not available (torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'})"
ONE_GPU = f"{GPUS} GPU: NCCL needs one GPU per rank, and context parallelism two ranks at least"
needs_two = pytest.mark.skipif(GPUS < 2, reason=NO_CUDA if GPUS == 0 else ONE_GPU)
LENGTH = 32  # torch's head-tail balancer needs 2 cp to divide the length: 32 for 2, 4 and 8 ranks


def sequence(dtype=torch.float64):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, LENGTH, 8, dtype=dtype, generator=generator) for _ in range(4)]


def ring_on_gpu():
    cp, rank = labkit.world_size(), labkit.rank()
    q, k, v, grad = (context.shard_sequence(t, cp, rank).to(labkit.device()) for t in sequence())
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = context.ring_attention(q, k, v, LENGTH)
    out.backward(grad)
    return str(out.device), [t.detach().cpu() for t in (out, q.grad, k.grad, v.grad)]


@needs_two
def test_ring_attention_on_nccl_equals_one_process():
    per_rank = labkit.run(ring_on_gpu, world_size=2, backend="nccl")
    assert [device for device, _ in per_rank] == ["cuda:0", "cuda:1"]
    q, k, v, grad = sequence()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = context.reference_attention(q, k, v)
    out.backward(grad)
    for i, want in enumerate((out, q.grad, k.grad, v.grad)):
        got = context.unshard_sequence([tensors[i] for _, tensors in per_rank])
        assert (got - want.detach()).abs().max() < 1e-10  # float64 on the GPU: the merges' order only


def torch_cp_on_gpu():
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    mesh = init_device_mesh("cuda", (labkit.world_size(),), mesh_dim_names=("cp",))
    q, k, v, _ = (t.to(labkit.device()) for t in sequence(torch.bfloat16))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    (out,) = context_parallel_unshard(mesh, [out], [2])
    return (out.float() - want.float()).abs().max().item()


@needs_two
def test_torchs_context_parallel_equals_full_attention_on_gpus():
    """bfloat16 (the flash kernel's type): the ring's merges in float32 differ from one kernel's by rounding."""
    gaps = labkit.run(torch_cp_on_gpu, world_size=2, backend="nccl")
    assert max(gaps) < 2e-2, gaps
