"""The sharded-step grader's machinery (notebook 11): the notebook's solution passes, the reference is torch's own
SGD step, the traffic model is the ring's, every collective is recorded once where the process group receives it,
refused calls raise, the guard always goes away, and a hang leaves no rank behind. The catalogue of mistakes is in
test_grader_catalogue.py."""

import os

import pytest
import torch
import torch.distributed as dist
from processes import alive_after

import labkit
from labkit.exercises import ForbiddenCall, Verdict, check_sharded_step, ring_nbytes_per_rank, step_inputs
from labkit.exercises._kit._group_call import Kind
from labkit.exercises._kit._record import Call
from labkit.exercises._kit._runner import GRADERS
from labkit.exercises._step_diagnosis import (
    LR,
    TOLERANCES,
    StepCase,
    StepOutcome,
    collective,
    reference_step,
    sent_nbytes,
    step_facts,
    step_nbytes_bounds,
    wrong_step,
)
from labkit.exercises.sharded_step import DRAWN, StepGuard, draw_cases, padded, unpad_into
from labkit.launch import pools_apart
from labkit.plan.counts import shard_sizes
from labkit.plan.traffic import ring_allreduce_bytes

HANG_SECONDS = 2.0


def notebook_11_solution(param, grad, lr):
    """The reference solution in notebook 11 (notebooks/11_zero.ipynb, the cell tagged solution): the rows of
    the padded copies that the exercise hands over."""
    rank, n = dist.get_rank(), dist.get_world_size()
    grads = padded(grad, n).view(n, -1)
    params = padded(param, n).view(n, -1)
    my_grad = torch.empty_like(grads[rank])
    dist.reduce_scatter(my_grad, list(grads))
    params[rank].sub_(lr * my_grad / n)
    dist.all_gather(list(params), params[rank].clone())
    unpad_into(param, params, n)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("numel", [1, 2, 5, 6, 7, 10])
def test_the_padded_copy_has_one_equal_row_per_rank_and_unpads_back(numel, world_size):
    flat = torch.arange(1.0, numel + 1, dtype=torch.float64)
    rows = padded(flat, world_size).view(world_size, -1)
    sizes = shard_sizes(numel, world_size)
    assert rows.dtype == flat.dtype and rows.shape[1] == sizes[0]
    for row, piece, size in zip(rows, flat.split(sizes), sizes, strict=True):
        assert torch.equal(row[:size], piece) and not row[size:].any()       # slice r, then zeros
    param = torch.zeros_like(flat)
    memory = param.data_ptr()
    unpad_into(param, rows, world_size)
    assert torch.equal(param, flat) and param.data_ptr() == memory


def test_the_notebook_s_solution_passes_and_says_what_was_checked():
    verdict = check_sharded_step(notebook_11_solution)
    assert verdict and isinstance(verdict, Verdict), verdict
    assert "only its own slice" in verdict.message and "2(N-1)/N x S" in verdict.message, verdict
    assert repr(verdict).startswith("Correct! ")


def test_a_grader_wants_the_function_itself():
    verdict = check_sharded_step("sharded_sgd_step")
    assert not verdict and "pass your function itself, e.g. check_sharded_step(sharded_sgd_step)" in verdict.message


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda: check_sharded_step(print, timeout_seconds=0), ValueError, "timeout_seconds=0: pass a finite number > 0"),
    (lambda: step_inputs(-1, 3), ValueError, "rank=-1: pass a whole number >= 0"),
    (lambda: step_inputs(0, 2.5), ValueError, "numel=2.5"),
    (lambda: step_nbytes_bounds(10, 0), ValueError, "world_size=0: pass a whole number >= 1"),
])
def test_bad_arguments_are_refused_by_name_before_any_rank_starts(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize(("numel", "world_size", "dtype"), [(6, 3, torch.float32), (10, 4, torch.float32),
                                                             (5, 3, torch.float64)])
def test_the_reference_is_torch_s_sgd_step_on_the_averaged_gradient(numel, world_size, dtype):
    """torch.optim.SGD's answer, which is the formula's up to a rounding (the grader's tolerance)."""
    case = StepCase(world_size, numel, dtype)
    param, _ = step_inputs(0, numel, dtype)
    average = sum(step_inputs(r, numel, dtype)[1] for r in range(world_size)) / world_size
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(reference_step(case), param - LR * average, rtol=tolerance, atol=tolerance)
    assert not torch.allclose(reference_step(case), param - LR * average * world_size)


@pytest.mark.parametrize("draw", [None, 1, 2**31 - 1])
def test_no_rank_s_gradient_is_the_average_so_every_mistake_shows(draw):
    for world_size in (2, 3, 4):
        grads = [step_inputs(r, 5, draw=draw)[1] for r in range(world_size)]
        average = sum(grads) / world_size
        assert not any(torch.allclose(g, average) for g in grads)
        assert all((g.abs() > 0.1).all() for g in grads), "no zero: every element's update shows"


def test_drawn_inputs_are_the_same_on_every_rank_but_the_gradient_and_differ_per_draw():
    params = [step_inputs(r, 7, torch.float64, draw=5)[0] for r in range(3)]
    assert all(torch.equal(p, params[0]) for p in params)
    assert not torch.equal(step_inputs(0, 7, draw=5)[0], step_inputs(0, 7, draw=6)[0])
    assert not torch.equal(step_inputs(0, 7, draw=5)[0], step_inputs(0, 7)[0])


def test_each_grading_draws_two_runs_of_calls_with_their_own_sizes_dtype_and_lr():
    for _ in range(20):
        runs = [case["steps"] for case in draw_cases() if case["steps"][0].draw is not None]
        assert len(runs) == 2 and len({run[0].world_size for run in runs}) == 2
        assert {run[0].dtype for run in runs} == {torch.float32, torch.float64}, "a hard-coded dtype always shows"
        for run in runs:
            assert len(run) == DRAWN["calls"] >= 2 and len({c.world_size for c in run}) == 1
            assert len({c.numel for c in run}) == len(run) and len({c.lr for c in run}) == len(run)
            assert all(c.lr != LR and c.draw is not None for c in run), "lr is never the fixed cases' constant"
            assert all(not any(abs(LR - c.lr * n) < 1e-12 for n in (1, 2, 3, 4)) for c in run), "0.1 never N x lr"


def test_wrong_elements_in_several_slices_are_not_said_to_be_in_one():
    """A param left all zeros on 3 ranks: the run of wrong elements covers every slice, and the message says so."""
    outcomes = [StepOutcome([0.0] * 6, None, True, "float32 on cpu", "float32 on cpu") for _ in range(3)]
    message = wrong_step(outcomes, StepCase(3, 6))
    assert "on rank 0, elements 0 to 5 hold [0, 0, 0, 0, 0, 0]" in message, message
    assert "They span the slices of ranks 0 to 2." in message and "rank 0's slice" not in message, message


KINDS = {"reduce_scatter": Kind.REDUCE_SCATTER, "all_gather": Kind.ALLGATHER, "broadcast": Kind.BROADCAST,
         "all_reduce": Kind.ALLREDUCE}


def collective_call(kind, chunk_nbytes, rank, n, root=None):
    """The kit's Call of a float32 collective, with the sharded-step grader's facts."""
    return Call(KINDS[kind], facts=step_facts(chunk_nbytes, 4, rank, n, root))


def ring_collective(kind, numel, n, rank, root=None):
    return collective_call(kind, [4 * s for s in shard_sizes(numel, n)] if kind != "broadcast" else [4 * numel],
                           rank, n, root)


@pytest.mark.parametrize(("numel", "world_size"), [(12, 2), (12, 3), (12, 4), (7, 3), (10, 4), (2, 4)])
def test_a_reduce_scatter_and_an_all_gather_send_what_the_ring_all_reduce_sends(numel, world_size):
    """Per rank: the ring's exact bytes (notebook 03), which are 2(N-1)/N x S when N divides; an all-gather made
    of one broadcast per owner sends the same; so does an all_reduce, which is both phases."""
    for rank in range(world_size):
        step = [ring_collective("reduce_scatter", numel, world_size, rank),
                ring_collective("all_gather", numel, world_size, rank)]
        expected = ring_nbytes_per_rank(numel, world_size)[rank]
        assert sum(map(sent_nbytes, step)) == expected == step_nbytes_bounds(numel, world_size)[rank][0]
        broadcasts = [collective_call("broadcast", [4 * size], rank, world_size, owner)
                      for owner, size in enumerate(shard_sizes(numel, world_size))]
        assert sum(map(sent_nbytes, broadcasts)) == sent_nbytes(step[1])
        assert sent_nbytes(collective_call("all_reduce", [4 * numel], rank, world_size)) == expected
        if numel % world_size == 0:
            assert expected == ring_allreduce_bytes(4 * numel, world_size)


def test_padding_every_slice_to_the_largest_is_the_most_a_rank_may_send():
    sizes = shard_sizes(10, 4)
    padded = [collective_call(kind, [4 * max(sizes)] * 4, 0, 4) for kind in ("reduce_scatter", "all_gather")]
    assert sum(map(sent_nbytes, padded)) == step_nbytes_bounds(10, 4)[0][1] == 2 * 3 * 3 * 4


def each_way_of_calling():
    """On 2 ranks: every collective the step may use, each spelling once, under a StepGuard; then the refused."""
    rank, device = labkit.rank(), labkit.device()
    t, pair = torch.arange(4.0, device=device) + rank, torch.zeros(2, device=device)
    with StepGuard() as guard:
        dist.reduce_scatter(pair[:1], list(t[:2].split(1)))
        dist.reduce_scatter_single(pair, t)
        dist.all_gather(list(t.split(2)), pair)
        dist.all_gather_single(t, pair)
        dist.broadcast(pair, src=1)
        dist.all_reduce(t)
        dist.group.WORLD.allreduce([t]).wait()
        dist.barrier()
        refused = []
        for call in (lambda: dist.send(t, 1 - rank), lambda: dist.group.WORLD.send([t], 1 - rank, 0),
                     lambda: dist.all_gather_object([None, None], 1), lambda: dist.reduce(t, 0),
                     lambda: torch.ops._c10d_functional.all_reduce(t, "sum", "0")):
            try:
                call()
            except ForbiddenCall as error:
                refused.append(str(error).split(" is switched off")[0])
    after = torch.ones(1, device=device)
    dist.all_reduce(after)  # the group works after the guard, unguarded
    return [(collective(c), c.facts["chunk_nbytes"], c.facts["root"], c.facts["sent"]) for c in guard.recorder.calls], \
        refused, after.item()


def test_every_collective_is_recorded_once_where_the_group_receives_it_and_the_rest_is_refused():
    (calls, refused, after), (calls_1, _, _) = labkit.run(each_way_of_calling, world_size=2)
    assert [c[0] for c in calls] == ["reduce_scatter", "reduce_scatter", "all_gather", "all_gather", "broadcast",
                                     "all_reduce", "all_reduce", "barrier"]
    assert [c[1] for c in calls[:5]] == [[4, 4], [8, 8], [8, 8], [8, 8], [8]]
    assert calls[2][3] == calls[3][3] and calls[4][3] is None and calls_1[4][3] is not None  # only the root sends
    assert refused == ["torch.distributed.send", "ProcessGroup.send (as in dist.group.WORLD.send)",
                       "torch.distributed.all_gather_object", "torch.distributed.reduce",
                       "torch.ops._c10d_functional.all_reduce"]
    assert after == 2.0


def test_the_guard_always_restores_what_it_replaced():
    """In this process, without a process group: everything replaced is put back, even when the step raises."""
    watched = [(dist, "send"), (dist, "all_gather_object"), (dist.ProcessGroup, "allgather"),
               (dist.ProcessGroup, "reduce_scatter"), (dist.ProcessGroup, "send"),
               (torch._C._distributed_c10d.Backend, "allreduce")]
    before = {(owner, name): vars(owner)[name] for owner, name in watched}
    with pytest.raises(ValueError, match="the student's own error"):
        with StepGuard():
            assert all(vars(owner)[name] is not before[owner, name] for owner, name in watched)
            raise ValueError("the student's own error")
    assert all(vars(owner)[name] is before[owner, name] for owner, name in watched)
    assert isinstance(torch.ops._c10d_functional.all_reduce, torch._ops.OpOverloadPacket)


def rank_pids():
    return os.getpid()  # run by reference to this module, which the rank then imports, the grader's side with it


def graders_rank_pids() -> list[int]:
    """The pids of the graders' own 3 ranks (they grade apart from the student's)."""
    with pools_apart(GRADERS):
        return labkit.run(rank_pids, world_size=3)


def hangs_on_rank_0(param, grad, lr):
    if labkit.rank() == 0:
        dist.broadcast(param, src=0)  # the others never join


def test_a_hang_is_stopped_with_a_clear_message_and_leaves_no_rank_behind():
    pids = graders_rank_pids()
    verdict = check_sharded_step(hangs_on_rank_0, timeout_seconds=HANG_SECONDS)
    assert not verdict and "it never finished (stopped after 2 s)" in verdict.message, verdict
    assert "rank 0 was still running in broadcast" in verdict.message, verdict
    assert "rank(s) [1, 2] had returned" in verdict.message, verdict
    assert alive_after(pids, 10) == []
    assert check_sharded_step(notebook_11_solution)  # on fresh ranks


def leaves_a_broadcast_posted(param, grad, lr):
    """Right, except that rank 0 also posts a broadcast that nobody joins and returns without waiting for it."""
    notebook_11_solution(param, grad, lr)
    if labkit.rank() == 0:
        dist.broadcast(torch.zeros(1, device=param.device), src=0, async_op=True)


def test_a_collective_left_unmatched_is_reported_and_its_ranks_replaced():
    pids = graders_rank_pids()
    verdict = check_sharded_step(leaves_a_broadcast_posted, timeout_seconds=HANG_SECONDS)
    assert not verdict and "a broadcast of 4 bytes from rank 0" in verdict.message, verdict
    assert set(graders_rank_pids()).isdisjoint(pids)  # the pool was replaced
    assert check_sharded_step(notebook_11_solution)


# ---- issue 27: honest mistakes that fixed lr, dtype, sizes and inputs, one call per pool, and counting let pass --

def lr_hard_coded(param, grad, lr):
    """The notebook's solution with the lr it was tried with written in: right only where lr is 0.1."""
    notebook_11_solution(param, grad, 0.1)


def float32_scratch(param, grad, lr):
    """The notebook's solution on float32 scratch rows, copied back: right in float32, rounded in float64."""
    rank, n = dist.get_rank(), dist.get_world_size()
    grads = padded(grad, n).view(n, -1).float()
    params = padded(param, n).view(n, -1).float()
    my_grad = torch.empty_like(grads[rank])
    dist.reduce_scatter(my_grad, list(grads))
    params[rank].sub_(lr * my_grad / n)
    dist.all_gather(list(params), params[rank].clone())
    unpad_into(param, params.to(param.dtype), n)


class CachedRows:
    """Padded rows made on the first call and kept on the class, to save allocations: stale on every later call
    (the ranks' processes, and so the class, outlive one call and one grading)."""

    rows = None

    @classmethod
    def step(cls, param, grad, lr):
        rank, n = dist.get_rank(), dist.get_world_size()
        if cls.rows is None:
            cls.rows = padded(param, n).view(n, -1)
        params, grads = cls.rows, padded(grad, n).view(n, -1)
        my_grad = torch.empty_like(grads[rank])
        dist.reduce_scatter(my_grad, list(grads))
        params[rank].sub_(lr * my_grad / n)
        dist.all_gather(list(params), params[rank].clone())
        unpad_into(param, params, n)


def averaged_from_the_fixed_inputs(param, grad, lr):
    """The averaged gradient computed from labkit's step_inputs for every rank, with a reduce-scatter of zeros and
    the right all-gather around it: right traffic, right values on the fixed inputs, and no gradient summed."""
    rank, n = dist.get_rank(), dist.get_world_size()
    average = sum(step_inputs(r, param.numel(), param.dtype, param.device)[1] for r in range(n)) / n
    zeros = padded(torch.zeros_like(grad), n).view(n, -1)
    dist.reduce_scatter(torch.empty_like(zeros[rank]), list(zeros))
    params = padded(param, n).view(n, -1)
    params[rank].sub_(lr * padded(average, n).view(n, -1)[rank])
    dist.all_gather(list(params), params[rank].clone())
    unpad_into(param, params, n)


def scattered_from_a_scratch_copy(param, grad, lr):
    """A reduce-scatter of a scratch copy whose values come from elsewhere (this rank's gradient times N, an
    'average' computed as if every rank's were the same), the right count and bytes."""
    rank, n = dist.get_rank(), dist.get_world_size()
    scratch = padded(grad * 0, n).view(n, -1)
    dist.reduce_scatter(torch.empty_like(scratch[rank]), list(scratch))
    params = padded(param, n).view(n, -1)
    params[rank].sub_(lr * padded(grad, n).view(n, -1)[rank])
    dist.all_gather(list(params), params[rank].clone())
    unpad_into(param, params, n)


ISSUE_27_WRONG = [  # (wrong step, what its verdict must say on every draw)
    (lr_hard_coded, "its param moved by 0.1 x the averaged gradient, but lr is"),
    (float32_scratch, "its float64 param is right only to float32's precision"),
    (CachedRows.step, "rank "),  # stale rows: wrong values or a size error, whichever call meets them first
    (averaged_from_the_fixed_inputs, "into its reduce-scatter toward rank 0, whose slice of rank 0's gradient"),
    (scattered_from_a_scratch_copy, "the gradients were never summed over the ranks"),
]
GRADINGS = 2  # each issue-27 row is graded on this many fresh draws: it must be refused on every one


@pytest.mark.parametrize(("mistake", "phrase"), ISSUE_27_WRONG, ids=lambda x: getattr(x, "__qualname__", "phrase"))
def test_mistakes_that_fixed_cases_and_counting_let_pass_are_refused_on_every_draw(mistake, phrase):
    for _ in range(GRADINGS):
        verdict = check_sharded_step(mistake, record=False)
        assert not verdict and phrase in verdict.message and "rank " in verdict.message, verdict


def right_with_its_own_buffers_each_call(param, grad, lr):
    """Right, written differently: slices of param itself and ReduceOp.AVG, a fresh buffer per call, the lr given."""
    rank, n = dist.get_rank(), dist.get_world_size()
    sizes = shard_sizes(param.numel(), n)
    params, grads = param.split(sizes), grad.split(sizes)
    my_grad = torch.empty_like(grads[rank])
    dist.reduce_scatter(my_grad, list(grads), op=dist.ReduceOp.AVG)
    params[rank].add_(my_grad, alpha=-lr)
    for owner in range(n):
        dist.broadcast(params[owner], src=owner)


def test_right_steps_pass_on_drawn_inputs_called_more_than_once():
    verdict = check_sharded_step(right_with_its_own_buffers_each_call, record=False)
    assert verdict and "called more than once on the same ranks" in verdict.message, verdict
