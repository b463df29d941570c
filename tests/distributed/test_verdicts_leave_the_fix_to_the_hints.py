"""A wrong attempt's verdict names the mistake and where it shows, and leaves the fix to the notebook's hints
(issue 26): for a representative wrong solution per grader, the message holds none of the reference's code, its
formulas, its chunk indices or its order. Each row also checks that the verdict still names its mistake.

Every wrong solution here is one a student writes on the way, the one whose message used to hand over the fix:
the sum never divided (01, 04, 13), a ring off by one chunk (03), f's and g's code (05), 1F1B's warm-up (06), the
recipe of an atomic save (09), NCCL's job (10), dist.reduce_scatter(...) (11), the coordinate formula (12).
"""

import contextlib
import importlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import labkit
from labkit.exercises import (
    STACK_MAP,
    check_1f1b_order,
    check_atomic_save,
    check_average_gradients,
    check_bucketed_ddp_hook,
    check_fixed_training,
    check_megatron_f_g,
    check_mesh_coordinates,
    check_naive_allreduce,
    check_no_sync_accumulation,
    check_ring_allreduce,
    check_sharded_step,
    check_stack_map,
)
from labkit.exercises._kit._runner import GRADERS
from labkit.exercises.progress import load_progress
from labkit.launch import pools_apart
from labkit.parallel.pipeline import schedule

# The reference solutions' code and formulas, as the old verdicts spelled them: none may appear in a wrong attempt's
# verdict, whichever grader gave it.
REFERENCE_CODE = (
    "/= dist.get_world_size()", "/= n", "p.grad /=", "flat /=",  # 01, 04, 13: the division
    "(r - s - 1)", "(r - s - 2)", "(r - s)", "mod N",  # 03: both phases' chunk indices
    "P2POp(", "dist.recv(t, src)", "copy_(",  # 02, 03: the calls to paste
    "x.clone()", "return grad", "dist.all_reduce(y)",  # 05: f and g
    "min(p - r - 1, m)", "min(p - r, m)", "1F1B's:",  # 06: the warm-up's formula, the reference order
    "len(microbatches)", "no_sync():`",  # 07
    "os.replace(temporary, path)", "mkstemp(", "os.fsync(f.fileno())", "f.flush()",  # 09: the recipe
    "reduce_scatter(", "all_gather(", "src=r)", "sub_(",  # 11: the collectives' calls
    "rank % tp", "rank // (pp * tp)", "(rank // tp) % pp", "pp * tp =",  # 12: the coordinates and strides
    "src=0)", "model.zero_grad()", "p -= lr",  # 13: the broadcast and the update
)


def me():
    return labkit.rank(), labkit.world_size()


# ---- one wrong solution per grader (and two where two kinds of message gave the fix) ------------------------

def average_summed(model):
    """01: all-reduced, never divided by N."""
    for p in model.parameters():
        dist.all_reduce(p.grad)


def hub_returns_the_sum(t):
    """02: the hub's sum returned in a new tensor; t keeps its input."""
    rank, n = me()
    result = t.clone()
    if rank == 0:
        incoming = torch.empty_like(t)
        for src in range(1, n):
            dist.recv(incoming, src)
            result += incoming
        for dst in range(1, n):
            dist.send(result, dst)
    else:
        dist.send(t, 0)
        dist.recv(result, 0)
    return result


def ring_adds_into_the_chunk_it_sent(t):
    """03: the reduce-scatter adds what it receives into the chunk it just sent, one chunk off."""
    rank, n = me()
    chunks = list(t.tensor_split(n))
    right, left = (rank + 1) % n, (rank - 1) % n

    def hop(outgoing, incoming):
        for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, outgoing, right),
                                               dist.P2POp(dist.irecv, incoming, left)]):
            request.wait()

    for step in range(n - 1):
        send = (rank - step - 1) % n
        incoming = torch.empty_like(chunks[send])
        hop(chunks[send].clone(), incoming)
        chunks[send] += incoming
    for step in range(n - 1):
        hop(chunks[(rank - step) % n], chunks[(rank - step - 1) % n])


def ring_isend_before_recv(t):
    """03: right on gloo; on NCCL every rank's stream waits in its send."""
    rank, n = me()
    chunks = list(t.tensor_split(n))
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(2 * (n - 1)):
        reducing = step < n - 1
        s = step if reducing else step - (n - 1)
        send, receive = ((rank - s - 1) % n, (rank - s - 2) % n) if reducing else ((rank - s) % n, (rank - s - 1) % n)
        incoming = torch.empty_like(chunks[receive])
        pending = dist.isend(chunks[send], right)
        dist.recv(incoming, left)
        pending.wait()
        if reducing:
            chunks[receive] += incoming
        else:
            chunks[receive].copy_(incoming)


def buckets_never_divided(model, bucket_nbytes):
    """04: buckets all-reduced from the hooks and copied back, never divided by N."""
    bucket, in_flight = [], []

    def send():
        flat = torch.cat([q.grad.reshape(-1) for q in bucket])
        in_flight.append((dist.all_reduce(flat, async_op=True), flat, list(bucket)))
        bucket.clear()

    def hook(p):
        bucket.append(p)
        if sum(q.grad.numel() * q.grad.element_size() for q in bucket) >= bucket_nbytes:
            send()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)

    def finish():
        if bucket:
            send()
        for handle, flat, params in in_flight:
            handle.wait()
            for q, piece in zip(params, flat.split([q.numel() for q in params]), strict=True):
                q.grad.copy_(piece.view_as(q))
        in_flight.clear()

    return finish


class RightF(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        summed = grad.clone()
        dist.all_reduce(summed)
        return summed


class GInPlace(torch.autograd.Function):
    """05: g all-reduces its input in place, without telling autograd."""

    @staticmethod
    def forward(ctx, x):
        dist.all_reduce(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def warm_up_one_too_many(stage, stages, microbatches):
    """06: a warm-up of p - r forwards."""
    warmup = min(stages - stage, microbatches)
    actions = [("F", i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        actions += [("F", warmup + i), ("B", i)]
    return actions + [("B", i) for i in range(microbatches - warmup, microbatches)]


def loss_not_divided(ddp_model, optimizer, microbatches):
    """07: no_sync right, each micro-batch's loss not divided by k."""
    k = len(microbatches)
    for i, (x, y) in enumerate(microbatches):
        with ddp_model.no_sync() if i < k - 1 else contextlib.nullcontext():
            F.cross_entropy(ddp_model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def save_straight_into_path(state_dict, path):
    """09: torch.save into path itself."""
    torch.save(state_dict, path)


def step_all_reduce_everywhere(param, grad, lr):
    """11: right values and DDP's traffic, nothing sharded."""
    dist.all_reduce(grad)
    param -= lr * grad / dist.get_world_size()


def right_coordinates(rank, dp, pp, tp):
    rest, tp_k = divmod(rank, tp)
    return (*divmod(rest, pp), tp_k)


def right_groups(rank, dp, pp, tp):
    d, p, t = right_coordinates(rank, dp, pp, tp)
    return {"dp": [(i * pp + p) * tp + t for i in range(dp)], "pp": [(d * pp + j) * tp + t for j in range(pp)],
            "tp": [(d * pp + p) * tp + k for k in range(tp)]}


def coordinates_tp_outermost(rank, dp, pp, tp):
    """12: the layout row-major in (tp, pp, dp)."""
    return rank % dp, rank // dp % pp, rank // (dp * pp)


def groups_dp_stride_tp(rank, dp, pp, tp):
    """12: the dp group stepping by tp ranks."""
    return right_groups(rank, dp, pp, tp) | {"dp": [rank % (pp * tp) + i * tp for i in range(dp)]}


def the_broken_loop(model, x, y, steps, lr):
    """15: notebook 15's loop as given, the stub's raise deleted: no broadcast, no division."""
    for _ in range(steps):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad


WRONG = [  # (id, grade(): its verdict, what the verdict must name)
    ("01 summed", lambda: check_average_gradients(average_summed), "were summed, not averaged"),
    ("02 returned", lambda: check_naive_allreduce(hub_returns_the_sum), "returned the sum in a new tensor"),
    ("03 off by one chunk", lambda: check_ring_allreduce(ring_adds_into_the_chunk_it_sent),
     "of t.tensor_split(3) are wrong"),
    ("03 NCCL order", lambda: check_ring_allreduce(ring_isend_before_recv), "it would hang on NCCL"),
    ("04 never divided", lambda: check_bucketed_ddp_hook(buckets_never_divided), "summed, not averaged"),
    ("05 g in place", lambda: check_megatron_f_g(RightF, GInPlace), "your g's forward changed its input in place"),
    ("06 warm-up", lambda: check_1f1b_order(warm_up_one_too_many), "one forward too many"),
    ("07 loss not divided", lambda: check_no_sync_accumulation(loss_not_divided), "not divided by k = "),
    ("09 straight into path", lambda: check_atomic_save(save_straight_into_path), "writes straight into path"),
    ("10 NCCL", lambda: check_stack_map({**STACK_MAP, "NCCL": "builds", "NeMo": "communicates"}),
     "look again at NCCL, NeMo"),
    ("11 all-reduce", lambda: check_sharded_step(step_all_reduce_everywhere), "nothing is sharded"),
    ("12 coordinates", lambda: check_mesh_coordinates(coordinates_tp_outermost, right_groups),
     "row-major in (tp, pp, dp)"),
    ("12 groups", lambda: check_mesh_coordinates(right_coordinates, groups_dp_stride_tp), "Yours steps by tp = 2"),
    ("13 the broken loop", lambda: check_fixed_training(the_broken_loop), "own random initialisation"),
]


# ---- the notebooks' stubs, as they stand ------------------------------------------------------------------

def stub(*args):
    raise NotImplementedError("your turn")


def attach_stub(model, bucket_nbytes):
    """04's stub: the hook and finish() are still to write."""
    def hook(p):
        raise NotImplementedError("your turn")

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)

    def finish():
        raise NotImplementedError("your turn")

    return finish


class Stub(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        raise NotImplementedError("your turn")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("your turn")


STUBS = [  # (exercise, grade the stub)
    ("average_gradients", lambda: check_average_gradients(stub)),
    ("naive_allreduce", lambda: check_naive_allreduce(stub)),
    ("ring_allreduce", lambda: check_ring_allreduce(stub)),
    ("bucketed_ddp_hook", lambda: check_bucketed_ddp_hook(attach_stub)),
    ("megatron_f_g", lambda: check_megatron_f_g(Stub, Stub)),
    ("one_f_one_b", lambda: check_1f1b_order(stub)),
    ("no_sync_accumulation", lambda: check_no_sync_accumulation(stub)),
    ("atomic_save", lambda: check_atomic_save(stub)),
    ("sharded_step", lambda: check_sharded_step(stub)),
    ("mesh_coordinates", lambda: check_mesh_coordinates(stub, stub)),
    ("bug_zoo_fix", lambda: check_fixed_training(stub)),
]


@pytest.fixture(scope="module", autouse=True)
def warm_pools():
    """Start the pools with the graders' rank sides imported, so that no case's timeout is spent starting."""
    with pools_apart(GRADERS):  # the graders' own ranks, apart from the student's
        for world_size in (2, 3, 4):
            labkit.run(importlib.import_module, "labkit.exercises.ddp_hook", world_size=world_size)


@pytest.fixture(autouse=True)
def progress_elsewhere(tmp_path, monkeypatch):
    """These attempts are the test's, not the student's."""
    monkeypatch.setenv("LABKIT_PROGRESS", str(tmp_path / "progress.json"))


@pytest.mark.parametrize(("grade", "named"), [row[1:] for row in WRONG], ids=[row[0] for row in WRONG])
def test_a_wrong_attempt_is_told_its_mistake_not_the_reference_code(grade, named):
    verdict = grade()
    assert not verdict and named in verdict.message, verdict
    given = [code for code in REFERENCE_CODE if code in verdict.message]
    assert not given, f"the verdict hands over {given}: {verdict.message}"


def test_the_1f1b_verdict_does_not_list_the_reference_order():
    """06's messages ended with 1F1B's whole action list for the failing stage: the order to copy."""
    verdict = check_1f1b_order(warm_up_one_too_many)
    reference = " ".join(f"{action.kind}{action.microbatch}" for action in schedule("1f1b", 4, 8)[0])
    assert "Stage 0 of 4 with 8 micro-batches" in verdict.message and reference not in verdict.message, verdict


def test_a_wrong_nccl_is_not_told_what_nccl_does():
    verdict = check_stack_map({**STACK_MAP, "NCCL": "builds", "NeMo": "communicates"})
    assert "communicat" not in verdict.message.lower(), verdict


@pytest.mark.parametrize(("exercise", "grade"), STUBS, ids=[exercise for exercise, _ in STUBS])
def test_running_the_untouched_stub_is_no_attempt_in_any_grader(exercise, grade):
    """labkit.exercises.progress: a notebook run as it stands tries nothing (13 counted it until issue 26)."""
    verdict = grade()
    assert not verdict and "NotImplementedError" in verdict.message, verdict
    assert exercise not in load_progress(), (exercise, verdict.message)
