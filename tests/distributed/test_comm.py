"""labkit.comm's collectives on real gloo processes (2 to 5 ranks) against torch.distributed's own.

Inputs are small whole numbers, so that sums are exact in every dtype and results can be compared
for equality whatever order the additions happen in."""

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import labkit
from labkit import comm
from labkit.comm.wire import DTYPES as COMM_DTYPES
from labkit.comm.wire import NCCL_DTYPES, Carriage, carriage, carrier, on_the_wire

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64]
SETTINGS = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
shapes = st.lists(st.integers(0, 7), min_size=0, max_size=3)


def rank_input(shape, dtype, seed):
    generator = torch.Generator().manual_seed(seed * 101 + labkit.rank())
    return torch.randint(-8, 9, shape, generator=generator).to(dtype)


def allreduce_both(algorithm, shape, dtype, seed):
    mine = rank_input(shape, dtype, seed)
    expected = mine.clone()
    dist.all_reduce(expected)
    out = getattr(comm, algorithm)(mine)
    return out is mine, torch.equal(mine, expected)


@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
@pytest.mark.parametrize("algorithm", ["ring_allreduce", "naive_allreduce", "tree_allreduce"])
@SETTINGS
@given(shape=shapes, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 1000))
def test_allreduce_matches_torch_in_place(world_size, algorithm, shape, dtype, seed):
    results = labkit.run(allreduce_both, algorithm, shape, dtype, seed, world_size=world_size)
    assert results == [(True, True)] * world_size


def reduce_scatter_both(numel, dtype, seed):
    mine = rank_input([numel], dtype, seed)
    before = mine.clone()
    total = mine.clone()
    dist.all_reduce(total)
    chunk = comm.ring_reduce_scatter(mine)
    same_as_torch = True
    if numel % labkit.world_size() == 0:
        out = torch.empty(numel // labkit.world_size(), dtype=dtype)
        dist.reduce_scatter(out, list(mine.chunk(labkit.world_size())))
        same_as_torch = torch.equal(chunk, out)
    return torch.equal(chunk, total.tensor_split(labkit.world_size())[labkit.rank()]) and same_as_torch, \
        torch.equal(mine, before)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@SETTINGS
@given(numel=st.integers(0, 40), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 1000))
def test_reduce_scatter_gives_each_rank_its_reduced_chunk(world_size, numel, dtype, seed):
    assert labkit.run(reduce_scatter_both, numel, dtype, seed, world_size=world_size) == [(True, True)] * world_size


def allgather_both(numel, dtype, uneven):
    n = numel + (labkit.rank() if uneven else 0)
    mine = torch.full((n,), labkit.rank() + 1).to(dtype)
    gathered = comm.ring_allgather(mine)
    expected = torch.cat([torch.full((numel + (r if uneven else 0),), r + 1).to(dtype)
                          for r in range(labkit.world_size())])
    if not uneven:
        parts = [torch.empty_like(mine) for _ in range(labkit.world_size())]
        dist.all_gather(parts, mine)
        assert torch.equal(torch.cat(parts), expected)
    return torch.equal(gathered, expected)


@pytest.mark.parametrize("world_size", [2, 3, 5])
@pytest.mark.parametrize("uneven", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather_matches_torch_and_takes_uneven_chunks(world_size, uneven, dtype):
    assert labkit.run(allgather_both, 3, dtype, uneven, world_size=world_size) == [True] * world_size


def broadcast_and_reduce(shape, dtype, root, seed):
    mine = rank_input(shape, dtype, seed)
    theirs = mine.clone()
    dist.broadcast(theirs, root)
    broadcast_ok = torch.equal(comm.broadcast(mine.clone(), root), theirs)
    before = mine.clone()
    expected = mine.clone()
    dist.reduce(expected, root)
    comm.reduce(mine, root)
    reduce_ok = torch.equal(mine, expected) if labkit.rank() == root else torch.equal(mine, before)
    return broadcast_ok, reduce_ok


@pytest.mark.parametrize("world_size", [2, 3, 5])
@SETTINGS
@given(shape=shapes, dtype=st.sampled_from(DTYPES), root=st.integers(0, 4), seed=st.integers(0, 1000))
def test_broadcast_and_reduce_match_torch_from_any_root(world_size, shape, dtype, root, seed):
    root %= world_size
    assert labkit.run(broadcast_and_reduce, shape, dtype, root, seed, world_size=world_size) == \
        [(True, True)] * world_size


def other_ops():
    mine = torch.tensor([labkit.rank() + 1.0, -labkit.rank() - 2.0, 3.0])
    results = {}
    for name, op in [("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN), ("product", dist.ReduceOp.PRODUCT)]:
        expected = mine.clone()
        dist.all_reduce(expected, op=op)
        results[name] = all(torch.equal(allreduce(mine.clone(), op=how), expected)
                            for allreduce in (comm.ring_allreduce, comm.tree_allreduce) for how in (op, name))
    total = mine.clone()
    dist.all_reduce(total)
    results["avg"] = all(torch.allclose(allreduce(mine.clone(), op="avg"), total / labkit.world_size())
                         for allreduce in (comm.ring_allreduce, comm.tree_allreduce))
    return results


def test_other_reduction_ops_match_torch():
    for result in labkit.run(other_ops, world_size=3):
        assert result == {"max": True, "min": True, "product": True, "avg": True}


def non_contiguous():
    t = (torch.arange(12.0).reshape(3, 4) + labkit.rank()).t()
    expected = t.clone()
    dist.all_reduce(expected)
    comm.ring_allreduce(t)
    return torch.equal(t, expected)


def test_non_contiguous_tensor_is_reduced_in_place():
    assert labkit.run(non_contiguous, world_size=2) == [True, True]


def parameters_that_require_grad():
    weight = torch.nn.Parameter(torch.full((3,), float(labkit.rank() + 1)))
    comm.ring_allreduce(weight)
    comm.naive_allreduce(weight)
    comm.broadcast(weight, 0)
    comm.reduce(weight, 0)
    return weight.detach().tolist(), weight.requires_grad


def test_parameters_that_require_grad_work_like_with_torch():
    n = 3
    once = sum(range(1, n + 1))  # after ring_allreduce; naive_allreduce multiplies by n; reduce by n again on 0
    results = labkit.run(parameters_that_require_grad, world_size=n)
    assert results[0] == ([float(once * n * n)] * 3, True)
    assert results[1] == ([float(once * n)] * 3, True)


def many_segments():
    from labkit.comm import ring
    ring.SEGMENT_NBYTES = 12  # three float32 elements per message: exercises the pipeline
    try:
        mine = rank_input([53], torch.float32, 7)
        expected = mine.clone()
        dist.all_reduce(expected)
        return torch.equal(comm.ring_allreduce(mine), expected)
    finally:
        ring.SEGMENT_NBYTES = 4 << 20


@pytest.mark.parametrize("world_size", [2, 3])
def test_pipeline_of_many_segments(world_size):
    assert labkit.run(many_segments, world_size=world_size) == [True] * world_size


def one_rank():
    t = torch.tensor([1.0, 2.0])
    return [comm.ring_allreduce(t.clone()).tolist(), comm.naive_allreduce(t.clone()).tolist(),
            comm.ring_reduce_scatter(t).tolist(), comm.ring_allgather(t).tolist(),
            comm.broadcast(t.clone(), 0).tolist(), comm.reduce(t.clone(), 0).tolist(),
            comm.tree_allreduce(t.clone()).tolist()]


def test_world_size_one_is_the_identity():
    assert labkit.run(one_rank, world_size=1) == [[[1.0, 2.0]] * 7]


# ---- how tensors travel per backend (the rules that matter on GPUs, checked here as pure functions) -----

LABKIT_NCCL = "cpu:gloo,cuda:nccl"  # labkit's NCCL pools: CUDA tensors over NCCL, CPU tensors over gloo
GLOO = "cpu:gloo,cuda:gloo"


def test_the_carrier_is_the_backend_for_the_tensors_device():
    assert carrier(LABKIT_NCCL, "cuda") == "nccl" and carrier(LABKIT_NCCL, "cpu") == "gloo"
    assert carrier(GLOO, "cuda") == carrier("gloo", "cuda") == "gloo"
    assert carrier("cuda:nccl", "cpu") is None


@pytest.mark.parametrize("config", [LABKIT_NCCL, "cuda:nccl", "nccl"])
@pytest.mark.parametrize("dtype", COMM_DTYPES, ids=str)
def test_on_nccl_every_dtype_travels_as_one_nccl_has(config, dtype):
    how = carriage(dtype, "cuda", config)
    assert how.backend == "nccl" and how.batched and not how.via_host
    assert how.wire_dtype in NCCL_DTYPES
    expected = {torch.complex64: torch.float32, torch.complex128: torch.float64, torch.int16: torch.uint8}
    assert how.wire_dtype == expected.get(dtype, dtype)
    t = torch.arange(6).to(dtype)[1:5]
    wire = on_the_wire(t, how.wire_dtype)
    assert wire.data_ptr() == t.data_ptr() and wire.numel() * wire.element_size() == t.numel() * t.element_size()


@pytest.mark.parametrize("dtype", COMM_DTYPES, ids=str)
def test_on_gloo_every_dtype_travels_as_it_is_and_cuda_tensors_through_the_host(dtype):
    assert carriage(dtype, "cpu", GLOO) == Carriage("gloo", dtype, via_host=False, batched=False)
    assert carriage(dtype, "cpu", LABKIT_NCCL) == Carriage("gloo", dtype, via_host=False, batched=False)
    assert carriage(dtype, "cuda", GLOO) == Carriage("gloo", dtype, via_host=True, batched=False)
    assert carriage(dtype, "cpu", GLOO, batched=True).batched


def complex_input(dtype, seed):
    generator = torch.Generator().manual_seed(seed * 101 + labkit.rank())
    parts = torch.randint(-8, 9, (2, 29), generator=generator).to(dtype.to_real())
    return torch.complex(parts[0], parts[1])


def every_kernel_through(dtype, rule, batched, via_host):
    """labkit.comm's kernels on `dtype` with a transport that follows `rule` (a backend config) and `batched`,
    over this gloo group's wire; with `via_host` every tensor is staged through a host copy, as CUDA tensors
    are on gloo. Each result against torch.distributed's all_reduce or broadcast (int16 as int32: gloo's
    collectives have no int16; the sums of small numbers fit)."""
    transport = comm.TorchTransport(batched=batched)
    transport.backend_config = rule
    if via_host:
        decided = transport.carriage
        transport.carriage = lambda t: Carriage(**{**vars(decided(t)), "via_host": True})
    n, rank = labkit.world_size(), labkit.rank()
    mine = complex_input(dtype, 3) if dtype.is_complex else rank_input([29], dtype, 3)
    wide = torch.int32 if dtype == torch.int16 else dtype
    total, root = mine.to(wide, copy=True), mine.to(wide, copy=True)
    dist.all_reduce(total)
    dist.broadcast(root, 1)
    placed = torch.zeros(n * 5, dtype=wide)
    placed[rank * 5:(rank + 1) * 5] = mine[:5]
    dist.all_reduce(placed)  # every rank's first five, in rank order
    total, root, placed = total.to(dtype), root.to(dtype), placed.to(dtype)
    got = {
        "ring_allreduce": torch.equal(comm.ring_allreduce(mine.clone(), transport=transport), total),
        "naive_allreduce": torch.equal(comm.naive_allreduce(mine.clone(), transport=transport), total),
        "ring_reduce_scatter": torch.equal(comm.ring_reduce_scatter(mine, transport=transport),
                                           total.tensor_split(n)[rank]),
        "ring_allgather": torch.equal(comm.ring_allgather(mine[:5].contiguous(), transport=transport), placed),
        "broadcast": torch.equal(comm.broadcast(mine.clone(), 1, transport=transport), root),
        "reduce": torch.equal(comm.reduce(mine.clone(), 0, transport=transport), total if rank == 0 else mine),
    }
    used = set() if via_host else {(c.backend, c.wire_dtype, c.batched) for c in transport._carriages.values()}
    return got, used


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128, torch.int16], ids=str)
@pytest.mark.parametrize("rule, batched, via_host", [(GLOO, None, False), (GLOO, True, False), (GLOO, None, True),
                                                     ("cpu:nccl", None, False), ("cpu:nccl", False, False)],
                         ids=["gloo", "gloo-batched", "gloo-via-host", "nccl-rule", "nccl-rule-unbatched"])
def test_complex_and_int16_through_every_kernel_equal_torch(dtype, rule, batched, via_host):
    """Complex and int16 on gloo as they are; under NCCL's rule (over gloo's wire, the closest this machine
    gets) as floats and bytes, batched; also the batched path forced on gloo and the host staging."""
    results = labkit.run(every_kernel_through, dtype, rule, batched, via_host, world_size=3)
    for got, _ in results:
        assert all(got.values()), got
    wire = {torch.complex64: torch.float32, torch.complex128: torch.float64, torch.int16: torch.uint8}[dtype]
    if rule == "cpu:nccl":
        assert ("nccl", wire, batched is None) in results[0][1]
    elif not via_host:
        assert ("gloo", dtype, bool(batched)) in results[0][1]


def batched_traffic(batched):
    transport = comm.TorchTransport(batched=batched)
    with comm.traced(transport) as events:
        comm.ring_allreduce(torch.full((10,), float(labkit.rank())), transport=transport)
    return transport.sent_nbytes, transport.received_nbytes, [e.key() for e in events]


def test_the_batched_ring_sends_the_same_messages_as_the_paired_one():
    paired, batched = (labkit.run(batched_traffic, b, world_size=3) for b in (False, True))
    assert paired == batched
    assert [sent for sent, _, _ in paired] == [80 - 16 - 12, 80 - 12 - 12, 80 - 12 - 16]  # chunks of 16, 12, 12 B
    assert all(len(keys) == 4 for _, _, keys in paired)


def batch_around_the_ring():
    transport = comm.TorchTransport(batched=True)
    mine, theirs = torch.full((3,), float(transport.rank)), torch.empty(3)
    with transport.batch() as batch:
        sent = transport.isend(mine, transport.right, tag=5)
        received = transport.irecv(theirs, transport.left, tag=5)
        with pytest.raises(RuntimeError, match="the batch is posted when the block ends"):
            received.wait()
        with pytest.raises(RuntimeError, match="do not nest"), transport.batch():
            pass
    assert sent is received is batch and len(batch.ops) == 2
    received.wait()
    return theirs.tolist(), transport.sent_nbytes


def test_a_batch_posts_its_sends_and_receives_together_when_the_block_ends():
    assert labkit.run(batch_around_the_ring, world_size=3) == [([2.0] * 3, 12), ([0.0] * 3, 12), ([1.0] * 3, 12)]


def complex_min():
    comm.ring_allreduce(torch.zeros(2, dtype=torch.complex64), op="min")


def test_complex_min_is_a_clear_error_like_torchs():
    with pytest.raises(labkit.RankError, match="op=MIN has no meaning for complex numbers"):
        labkit.run(complex_min, world_size=2, timeout=20)


# ---- bad input ------------------------------------------------------------------------------------

def mismatched(kind, algorithm):
    t = torch.zeros(4 + labkit.rank()) if kind == "shape" else \
        torch.zeros(4, dtype=torch.float32 if labkit.rank() == 0 else torch.int64)
    getattr(comm, algorithm)(t)


@pytest.mark.parametrize("algorithm", ["ring_allreduce", "naive_allreduce", "ring_reduce_scatter", "broadcast",
                                       "reduce"])
@pytest.mark.parametrize("kind", ["shape", "dtype"])
def test_mismatched_tensors_are_a_clear_error_on_every_rank(kind, algorithm):
    with pytest.raises(labkit.RankError) as info:
        labkit.run(mismatched, kind, algorithm, world_size=3, timeout=20)
    assert {f.kind for f in info.value.failures} == {"error"}
    assert len(info.value.failures) == 3
    message = str(info.value)
    assert "ranks 0-2: ValueError" in message and "the ranks passed different tensors" in message
    assert ("rank 0: float32[4]; rank 1: float32[5]; rank 2: float32[6]" if kind == "shape"
            else "rank 0: float32[4]; rank 1: int64[4]; rank 2: int64[4]") in message


def test_allgather_of_different_dtypes_is_a_clear_error():
    def f():
        comm.ring_allgather(torch.zeros(2, dtype=torch.float32 if labkit.rank() else torch.float64))
    expected = r"ranks 0-1: ValueError: ring_allgather: the ranks passed different chunk dtypes \(rank 0: float64; "
    with pytest.raises(labkit.RankError, match=expected):
        labkit.run(f, world_size=2, timeout=20)


def test_bad_root_is_a_clear_error():
    expected = r"broadcast's src=2: pass a rank from 0 to 1 \(its number in group=, not its global rank\)\."
    with pytest.raises(labkit.RankError, match=expected):
        labkit.run(lambda: comm.broadcast(torch.zeros(1), 2), world_size=2, timeout=20)


@pytest.mark.parametrize("src, error", [("0", TypeError), (None, TypeError), (True, ValueError), (-1, ValueError)])
def test_a_root_that_is_no_rank_is_refused_by_kind(src, error):
    # labkit.checks' rule: no number at all is a TypeError (a string was a ValueError), a bool or -1 a ValueError
    with pytest.raises(labkit.RankError, match=rf"ranks 0-1: {error.__name__}: reduce's dst={src!r}: pass a whole"):
        labkit.run(lambda: comm.reduce(torch.zeros(1), src), world_size=2, timeout=20)


def test_outside_a_process_group_is_a_clear_error():
    with pytest.raises(RuntimeError, match="needs a torch.distributed process group"):
        comm.ring_allreduce(torch.zeros(2))


# ---- traffic and traces -----------------------------------------------------------------------------

def count_bytes(algorithm, numel):
    transport = comm.TorchTransport()
    getattr(comm, algorithm)(torch.zeros(numel), transport=transport)
    return transport.sent_nbytes, transport.received_nbytes


@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
@pytest.mark.parametrize("numel", [60, 61, 7, 1])
def test_ring_sends_two_n_minus_one_over_n_of_the_tensor(world_size, numel):
    nbytes, n = 4 * numel, world_size
    chunk_nbytes = [4 * len(c) for c in torch.zeros(numel).tensor_split(n)]
    counts = labkit.run(count_bytes, "ring_allreduce", numel, world_size=n)
    for r, (sent, received) in enumerate(counts):
        # Every chunk but one in each phase. Sent: all but chunk r (reduce-scatter), all but r+1 (all-gather).
        # Received: all but r-1, then all but r.
        assert sent == 2 * nbytes - chunk_nbytes[r] - chunk_nbytes[(r + 1) % n]
        assert received == 2 * nbytes - chunk_nbytes[(r - 1) % n] - chunk_nbytes[r]
        if numel % n == 0:
            assert sent == received == 2 * (n - 1) * nbytes // n


@pytest.mark.parametrize("world_size", [2, 4, 5])
def test_naive_hub_carries_n_minus_one_tensors_each_way(world_size):
    nbytes = 4 * 10
    counts = labkit.run(count_bytes, "naive_allreduce", 10, world_size=world_size)
    assert counts[0] == ((world_size - 1) * nbytes, (world_size - 1) * nbytes)
    assert counts[1:] == [(nbytes, nbytes)] * (world_size - 1)


def trace(algorithm, numel, *args):
    with comm.traced() as events:
        getattr(comm, algorithm)(torch.zeros(numel), *args)
    return events


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("algorithm, args", [("ring_allreduce", ()), ("naive_allreduce", ()),
                                             ("ring_reduce_scatter", ()), ("ring_allgather", ()),
                                             ("broadcast", (1,)), ("reduce", (1,))])
def test_a_real_trace_and_the_simulator_agree(world_size, algorithm, args):
    numel = 11
    real = sorted(e.key() for rank_events in labkit.run(trace, algorithm, numel, *args, world_size=world_size)
                  for e in rank_events)
    simulated = [e.key() for e in comm.simulate(algorithm, world_size, numel, torch.float32, *args)]
    assert real == sorted(simulated)
    assert len(real) > 0


def test_real_trace_times_are_ordered():
    for events in labkit.run(trace, "ring_allreduce", 1000, world_size=3):
        assert [e.step for e in events] == list(range(4))
        assert all(e.start <= e.end for e in events)
