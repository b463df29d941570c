"""labkit.parallel.context on real gloo ranks (2 to 4) against one process: ring attention and the all-gather variant,
forward and backward, for sequence lengths no world size divides, causal or not, zig-zag or contiguous; the bytes
each rank sent against labkit.plan.context_parallel_nbytes; what each rank's attention saved for the backward
against context_attention_saved_nbytes (about 1/cp of one process's); and torch's own context_parallel, which this
machine's torch cannot run on CPU (asserted with its reason, so a torch that can shows here)."""

import pytest
import torch

import labkit
from labkit.activations import saved_activation_nbytes
from labkit.parallel import context as cp_kernels
from labkit.parallel import count_collectives
from labkit.plan import context_attention_saved_nbytes, context_parallel_nbytes

pytestmark = pytest.mark.numerics  # compares floating-point results: make unit runs it again on other kernels

ROWS, HEADS, HEAD_DIM = 2, 3, 4  # batch x heads = 6 rows of 4-wide heads
TOLERANCE = 1e-10  # float64: the ring sums the same products in another order (merges), ~1e-15 apart
KERNELS = {"ring": cp_kernels.ring_attention, "allgather": cp_kernels.allgather_attention}


def inputs(length, seed=0):
    """q, k, v and the output's gradient of the whole sequence, the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(ROWS, HEADS, length, HEAD_DIM, dtype=torch.float64, generator=generator) for _ in range(4)]


def on_rank(length, causal, zigzag, variant):
    """This rank's output and gradients of its own positions, and what it sent."""
    cp, rank = labkit.world_size(), labkit.rank()
    q, k, v, grad = (cp_kernels.shard_sequence(t, cp, rank, zigzag).to(labkit.device()) for t in inputs(length))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with count_collectives() as counted:
        out = KERNELS[variant](q, k, v, length, causal=causal, zigzag=zigzag)
        forward = dict(counted.nbytes)
        out.backward(grad)
    backward = {kind: counted.nbytes[kind] - forward.get(kind, 0) for kind in counted.nbytes}
    return [t.detach().cpu() for t in (out, q.grad, k.grad, v.grad)], forward, backward


def one_process(length, causal):
    q, k, v, grad = inputs(length)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = cp_kernels.reference_attention(q, k, v, causal)
    out.backward(grad)
    return [t.detach() for t in (out, q.grad, k.grad, v.grad)]


CASES = [(2, 13), (3, 17), (4, 23), (4, 16)]  # (cp, length): 13, 17 and 23 split unevenly; 16 evenly


@pytest.mark.parametrize("variant", sorted(KERNELS))
@pytest.mark.parametrize("cp,length", CASES)
def test_context_parallel_attention_equals_one_process(cp, length, variant):
    for causal in (True, False):
        for zigzag in (True, False):
            per_rank = labkit.run(on_rank, length, causal, zigzag, variant, world_size=cp)
            want = one_process(length, causal)
            for i, name in enumerate(("output", "dq", "dk", "dv")):
                got = cp_kernels.unshard_sequence([outcome[0][i] for outcome in per_rank], zigzag)
                gap = (got - want[i]).abs().max().item()
                assert gap < TOLERANCE, f"{variant} cp={cp} length={length} causal={causal} zigzag={zigzag}: " \
                                        f"{name} differs from one process's by {gap:.3g}"


@pytest.mark.parametrize("variant", sorted(KERNELS))
@pytest.mark.parametrize("cp,length", [(2, 13), (3, 17), (4, 23)])
def test_bytes_sent_are_the_plans(cp, length, variant):
    """Ring: every message is a send of the block, counted as it went. All-gather: the counters take an all_gather
    as this rank's padded part and a reduce_scatter as the whole it sums; a ring moves (cp - 1) parts of either."""
    per_rank = labkit.run(on_rank, length, True, True, variant, world_size=cp)
    planned = context_parallel_nbytes(length, cp, ROWS * HEADS, HEAD_DIM, 8, variant)
    for rank, (_, forward, backward) in enumerate(per_rank):
        if variant == "ring":
            sent = forward.get("send", 0), backward.get("send", 0)
        else:
            sent = (forward["all_gather"] * (cp - 1), backward["reduce_scatter"] * (cp - 1) // cp)
        assert sent == (planned["forward"][rank], planned["backward"][rank]), (rank, sent, planned)
    assert sum(planned["forward"]) == (cp - 1) * length * 2 * ROWS * HEADS * HEAD_DIM * 8 or variant == "allgather"


def saved_on_rank(length, variant):
    """Bytes this rank's attention saved for the backward (q, k, v made activations by one multiply, as a model's
    projections would make them)."""
    cp, rank = labkit.world_size(), labkit.rank()
    leaves = [cp_kernels.shard_sequence(t, cp, rank).to(labkit.device()).requires_grad_() for t in inputs(length)[:3]]

    def attention(q, k, v):
        return KERNELS[variant](q * 1.0, k * 1.0, v * 1.0, length)

    return saved_activation_nbytes(attention, *leaves)


@pytest.mark.parametrize("variant", sorted(KERNELS))
def test_saved_activations_shrink_with_cp_for_the_ring_only(variant):
    length, alone = 23, context_attention_saved_nbytes(23, 1, ROWS * HEADS, HEAD_DIM, 8, variant)[0]
    for cp in (2, 4):
        measured = labkit.run(saved_on_rank, length, variant, world_size=cp)
        assert measured == context_attention_saved_nbytes(length, cp, ROWS * HEADS, HEAD_DIM, 8, variant)
        share = max(measured) / alone
        if variant == "ring":  # 1/cp, up to the uneven split (a rank holds at most 2 tokens more than length/cp)
            assert share <= (length / cp + 2) / length, share
        else:  # the whole sequence's K and V on every rank: more than half of one process's, whatever cp
            assert share > 0.5, share


def wrong_shape():
    q = torch.zeros(1, 1, 5, 4, dtype=torch.float64)
    return cp_kernels.ring_attention(q, q, q, 13)


def test_a_wrongly_sharded_input_is_refused_with_what_to_do():
    with pytest.raises(labkit.RankError, match="holds 7 of the 13 positions.*shard_sequence"):
        labkit.run(wrong_shape, world_size=2)


def torch_context_parallel():
    """torch's own context_parallel on a cp mesh of this world, on CPU: the error it raises, or None."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (labkit.world_size(),), mesh_dim_names=("cp",))
    q, k, v, _ = inputs(16)
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except NotImplementedError as error:
        return str(error)
    return None


def test_torchs_context_parallel_needs_a_gpu_attention_kernel():
    """torch 2.13's context_parallel shards only the CUDA SDPA kernels (flash, efficient, cuDNN: its
    _context_parallel/_attention.py registers those ops); on CPU, SDPA runs _scaled_dot_product_flash_attention_for_cpu,
    which has no sharding rule. tests/gpu/test_context_cuda.py runs it on GPUs."""
    errors = labkit.run(torch_context_parallel, world_size=2)
    assert all(e is not None and "_scaled_dot_product_flash_attention_for_cpu" in e for e in errors), errors
