"""The graders' machinery: the notebooks' solutions pass, the guard counts each message once and always goes
away, and the ring's expected bytes are the lesson's formula. The catalogue of mistakes is in
test_grader_catalogue.py."""

import itertools
import threading

import pytest
import torch
import torch.distributed as dist

import labkit
from labkit import comm
from labkit.comm.torch_transport import TorchTransport
from labkit.exercises import (
    ForbiddenCall,
    Verdict,
    check_naive_allreduce,
    check_ring_allreduce,
    rank_input,
    ring_nbytes_per_rank,
)
from labkit.exercises.allreduce import (
    DTYPES,
    NAIVE_WORLD_SIZES,
    READY_MADE,
    RING_CASES,
    AllReduceGuard,
    drawn_input,
    naive_cases,
    ring_cases,
)
from labkit.exercises.diagnosis import Outcome, hub_contents, ring_contents
from labkit.plan.traffic import ring_allreduce_bytes


def notebook_02_solution(t):
    """The solution in notebook 02's folded cell."""
    rank, n = labkit.rank(), labkit.world_size()
    if rank == 0:
        incoming = torch.empty_like(t)
        for src in range(1, n):
            dist.recv(incoming, src)
            t += incoming
        for dst in range(1, n):
            dist.send(t, dst)
    else:
        dist.send(t, 0)
        dist.recv(t, 0)


def notebook_03_solution(t):
    """The solution in notebook 03's folded cell."""
    rank, n = labkit.rank(), labkit.world_size()
    chunks = list(t.tensor_split(n))
    right, left = (rank + 1) % n, (rank - 1) % n

    def hop(outgoing, incoming):
        for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, outgoing, right),
                                               dist.P2POp(dist.irecv, incoming, left)]):
            request.wait()

    for step in range(n - 1):
        send, receive = (rank - step - 1) % n, (rank - step - 2) % n
        incoming = torch.empty_like(chunks[receive])
        hop(chunks[send], incoming)
        chunks[receive] += incoming
    for step in range(n - 1):
        send, receive = (rank - step) % n, (rank - step - 1) % n
        hop(chunks[send], chunks[receive])


def test_the_notebooks_solutions_pass_and_say_what_was_checked():
    naive = check_naive_allreduce(notebook_02_solution)
    assert naive and isinstance(naive, Verdict) and "rank 0 at one end" in naive.message, naive
    assert repr(naive).startswith("Correct! ") and naive._repr_markdown_().startswith("**✅ Correct!**")
    ring = check_ring_allreduce(notebook_03_solution)
    assert ring and "only to its right neighbour" in ring.message and "2(N-1)/N x S" in ring.message, ring


def test_a_grader_wants_the_function_itself():
    verdict = check_naive_allreduce(42)
    assert not verdict and "pass your function itself" in verdict.message
    assert repr(verdict).startswith("Not yet. ")


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda: check_ring_allreduce(print, timeout_seconds=0), ValueError, "timeout_seconds=0: pass a finite number > 0"),
    (lambda: check_naive_allreduce(print, timeout_seconds="10"), TypeError, "timeout_seconds='10': pass a finite"),
    (lambda: ring_nbytes_per_rank(10, 0), ValueError, "world_size=0: pass a whole number >= 1"),
    (lambda: ring_nbytes_per_rank(-1, 2), ValueError, "numel=-1: pass a whole number >= 0"),
    (lambda: ring_nbytes_per_rank(10, 2, element_size=True), ValueError, "element_size=True"),
    (lambda: rank_input(-1, 3), ValueError, "rank=-1: pass a whole number >= 0"),
    (lambda: rank_input(0, 2.5), ValueError, "numel=2.5"),
])
def test_bad_arguments_are_refused_by_name_before_any_rank_starts(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("world_size", [2, 3, 4, 6, 8])
def test_ring_bytes_are_the_lesson_s_formula_when_n_divides(world_size):
    numel = 12 * world_size
    orders = list(itertools.permutations(range(world_size)))[:30] if world_size > 4 else \
        itertools.permutations(range(world_size))
    for order in orders:
        assert ring_nbytes_per_rank(numel, world_size, 4, order) == \
            [ring_allreduce_bytes(4 * numel, world_size)] * world_size


@pytest.mark.parametrize(("numel", "world_size"), [(7, 3), (10, 4), (2, 4), (5, 2), (13, 5)])
def test_ring_bytes_for_uneven_chunks_are_each_chunk_sent_2n_minus_2_times_in_all(numel, world_size):
    sizes = [len(c) for c in torch.arange(numel).tensor_split(world_size)]
    per_rank = ring_nbytes_per_rank(numel, world_size, element_size=1)
    assert sum(per_rank) == 2 * (world_size - 1) * numel  # every chunk goes N-1 times in each phase
    assert per_rank == [2 * numel - sizes[r] - sizes[(r + 1) % world_size] for r in range(world_size)]
    assert max(per_rank) - min(per_rank) <= 2  # chunks differ by one element at most


def test_the_guard_switches_off_collectives_and_always_restores_them():
    """In this process, without a process group: what the guard replaces, it puts back, even on an error."""
    import torch.distributed.distributed_c10d as c10d

    watched = [(dist, "all_reduce"), (c10d, "all_reduce"), (dist, "all_gather_object"), (dist, "gather"),
               (dist.ProcessGroup, "allreduce"), (dist.ProcessGroup, "send"), (dist.ProcessGroup, "recv"),
               (torch._C._distributed_c10d.Backend, "allreduce"), (TorchTransport, "_post_send")]
    before = {(owner, name): vars(owner)[name] for owner, name in watched}
    with pytest.raises(ValueError, match="the student's own error"):
        with AllReduceGuard() as guard:
            assert all(vars(owner)[name] is not before[owner, name] for owner, name in watched)
            for call in (lambda: dist.all_reduce(torch.ones(1)), lambda: c10d.all_gather_object([], 1),
                         lambda: torch.ops.c10d.allreduce_([torch.ones(1)]),
                         lambda: torch.ops._c10d_functional.all_reduce(torch.ones(1), "sum", "0")):
                with pytest.raises(ForbiddenCall, match="is switched off while this exercise is graded"):
                    call()
            raise ValueError("the student's own error")
    assert guard.forbidden == ["torch.distributed.all_reduce", "torch.distributed.distributed_c10d.all_gather_object",
                               "torch.ops.c10d.allreduce_", "torch.ops._c10d_functional.all_reduce"]
    assert all(vars(owner)[name] is before[owner, name] for owner, name in watched)
    assert isinstance(torch.ops.c10d.allreduce_, torch._ops.OpOverloadPacket)


def count_each_way_of_sending():
    """Rank 0 sends four messages of 12 bytes, each a different way; rank 1 receives them."""
    t = torch.arange(3.0) if labkit.rank() == 0 else torch.empty(3)
    with AllReduceGuard() as guard:
        if labkit.rank() == 0:
            dist.send(t, 1)
            dist.isend(t, 1).wait()
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, 1)]):
                work.wait()
            dist.group.WORLD.send([t], 1, 0).wait()
        else:
            dist.recv(t, 0)
            dist.irecv(t, 0).wait()
            for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, 0)]):
                work.wait()
            dist.group.WORLD.recv([t], 0, 0).wait()
    return guard.sends, guard.recvs, t.tolist()


def test_every_message_is_counted_once_with_its_peer_and_bytes():
    (sent, received, _), (sent_by_1, received_by_1, t) = labkit.run(count_each_way_of_sending, world_size=2)
    assert sent == [(1, 12)] * 4 and received == []
    assert sent_by_1 == [] and received_by_1 == [(0, 12)] * 4 and t == [0.0, 1.0, 2.0]


def post_in_groups():
    """Rank 0: two batches back to back (two groups), then a batch of two, then an isend on its own; rank 1 the
    matching receives. The guard keeps them in the groups NCCL would run."""
    t = torch.arange(3.0)
    peer = 1 - labkit.rank()
    op = dist.isend if labkit.rank() == 0 else dist.irecv
    with AllReduceGuard() as guard:
        works = dist.batch_isend_irecv([dist.P2POp(op, t, peer)])
        works += dist.batch_isend_irecv([dist.P2POp(op, t, peer)])
        works += dist.batch_isend_irecv([dist.P2POp(op, t, peer), dist.P2POp(op, t.clone(), peer)])
        works.append(op(t, peer))
        for work in works:
            work.wait()
    return guard.posts


def test_the_guard_keeps_each_batch_as_one_group_and_each_lone_message_as_its_own():
    sent, received = labkit.run(post_in_groups, world_size=2)
    assert sent == [(("send", 1),), (("send", 1),), (("send", 1), ("send", 1)), (("send", 1),)]
    assert received == [(("recv", 0),), (("recv", 0),), (("recv", 0), ("recv", 0)), (("recv", 0),)]


def guarded_error_then_collectives():
    """On a rank: the guard is gone after the student's code raised inside it, and the group still works."""
    t = rank_input(labkit.rank(), 4, device=labkit.device())
    try:
        with AllReduceGuard():
            raise RuntimeError("the student's code failed")
    except RuntimeError:
        pass
    dist.all_reduce(t)
    dist.group.WORLD.allreduce([t]).wait()
    comm.ring_allreduce(t)
    return t.tolist()


def test_after_a_failure_inside_the_guard_collectives_work_again_on_the_ranks():
    total = sum(rank_input(r, 4) for r in range(3))  # the first all-reduce; each next one multiplies by 3
    assert labkit.run(guarded_error_then_collectives, world_size=3) == [(9 * total).tolist()] * 3


# ---- issue 27: what is drawn per grading, ready-made helpers refusing themselves, what messages carried --------

@pytest.mark.parametrize("draw", [naive_cases, ring_cases])
def test_every_grading_draws_every_dtype_new_sizes_and_new_seeds(draw):
    first, second = draw(), draw()
    for cases in (first, second):
        assert {case["dtype"] for case in cases} == set(DTYPES)  # a float32-only solution always meets another
        assert all(case["numel"] >= 1 for case in cases)
    assert [c["seed"] for c in first] != [c["seed"] for c in second]
    if draw is naive_cases:
        assert [c.world_size for c in first] == list(NAIVE_WORLD_SIZES)
        assert len({c["numel"] for c in first}) == len(first)  # distinct: a solution sized for one size fails
    else:
        kinds = [kind for _, kind in RING_CASES]
        for case, kind in zip(first, kinds, strict=True):
            n, numel = case.world_size, case["numel"]
            assert {"divides": numel % n == 0, "not": numel % n != 0 and numel > n, "fewer": numel < n}[kind]


def test_drawn_inputs_are_whole_numbers_of_the_dtype_fixed_by_the_seed_and_new_per_rank_and_call():
    x = drawn_input(7, 1, 50, torch.float16)
    assert x.dtype == torch.float16 and torch.equal(x, drawn_input(7, 1, 50, torch.float16))
    assert torch.equal(x, x.round()) and x.min() >= 1 and x.max() <= 100
    others = [drawn_input(7, 2, 50, torch.float16), drawn_input(7, 1, 50, torch.float16, call=1),
              drawn_input(8, 1, 50, torch.float16)]
    assert not any(torch.equal(x, other) for other in others)


@pytest.mark.parametrize("helper", ["naive_allreduce", "ring_allreduce", "tree_allreduce", "ring_reduce_scatter",
                                    "ring_allgather", "broadcast", "reduce"])
def test_labkit_comm_s_ready_made_collectives_refuse_while_graded_in_any_thread(helper):
    """Refused by the helper itself, first thing (no process group is needed to see it), in another thread too."""
    from labkit._refusals import refusing

    seen = []

    def call():
        try:
            getattr(comm, helper)(torch.ones(2))
        except ForbiddenCall as refused:
            seen.append(refused.spelling)

    with refusing(READY_MADE) as made:
        thread = threading.Thread(target=call)
        thread.start()
        thread.join()
    assert seen == made == [f"labkit.comm's {helper}"]


def lesson_ring_sends(inputs: list[torch.Tensor]) -> list[list[list[float]]]:
    """What each rank of the lesson's ring sends, in order, for these inputs (computed here, in one process)."""
    n = len(inputs)
    chunks = [list(x.double().clone().tensor_split(n)) for x in inputs]
    sent = [[] for _ in range(n)]
    for phase, first in (("reduce-scatter", 1), ("all-gather", 0)):
        for step in range(n - 1):
            moving = [chunks[r][(r - step - first) % n].clone() for r in range(n)]
            for r in range(n):
                sent[r].append(moving[r].tolist())
                receive, incoming = (r - step - first - 1) % n, moving[(r - 1) % n]
                chunks[r][receive].add_(incoming) if phase == "reduce-scatter" else chunks[r][receive].copy_(incoming)
    return sent


def outcomes_sending(sent: list[list[list[float]]], hub: bool = False) -> list[Outcome]:
    n = len(sent)
    peers = [[0] * len(s) if r else list(range(1, n)) for r, s in enumerate(sent)] if hub else \
        [[(r + 1) % n] * len(s) for r, s in enumerate(sent)]
    return [Outcome([], None, True, sends=[(p, 0) for p in peers[r]], sent_values=sent[r]) for r in range(n)]


def test_a_ring_s_messages_must_carry_running_partial_sums_then_reduced_chunks():
    inputs = [drawn_input(3, r, 7) for r in range(3)]
    sent = lesson_ring_sends(inputs)
    assert ring_contents(outcomes_sending(sent), inputs) is None
    scratch = [[[0.0] * len(m) for m in s] for s in sent]  # the right sizes, from a scratch copy
    told = ring_contents(outcomes_sending(scratch), inputs)
    assert "rank 0's message at step 1 of the reduce-scatter carried [0.0, 0.0], which is not one of rank 0's" in told
    sent[2][3] = sent[2][0]  # an all-gather message that carries a partial sum
    assert "rank 2's message at step 2 of the all-gather" in ring_contents(outcomes_sending(sent), inputs)


def test_the_hub_s_messages_must_carry_each_rank_s_t_then_the_sum():
    inputs = [drawn_input(4, r, 3) for r in range(3)]
    total = sum(x.double() for x in inputs).tolist()
    right = [[total, total], [inputs[1].double().tolist()], [inputs[2].double().tolist()]]
    assert hub_contents(outcomes_sending(right, hub=True), inputs) is None
    wrong = [[total, [0.0] * 3], *right[1:]]
    assert "rank 0's message to rank 2 carried [0.0, 0.0, 0.0], not the sum" in \
        hub_contents(outcomes_sending(wrong, hub=True), inputs)
