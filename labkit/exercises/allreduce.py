"""The AllReduce graders of notebooks 02 and 03: run the student's code on real ranks and say what is wrong.

`check_naive_allreduce(fn)` and `check_ring_allreduce(fn)` call `fn(t)` on 2, 3 and 4 ranks, where rank r's
`t` is `rank_input(r, numel)` (float32), for sizes that N divides and sizes it does not. A solution passes
only if, in every case, on every rank:

- `t` itself ends with the sum over ranks, in its own memory (in place: returning a new tensor fails);
- it called no collective. The exercise is built from dist.send/dist.recv, dist.isend/dist.irecv or
  dist.batch_isend_irecv. The last is allowed: it posts a list of those same isend/irecv together, each
  counted as one message (on gloo it is exactly a loop of them; NCCL ring code uses it to post a step's
  send and receive at once). The guard that switches collectives off and counts messages is in
  `labkit.exercises.guard`;
- it waited for the handle of every dist.isend and dist.irecv it posted (work.wait(), or each request that
  dist.batch_isend_irecv returns): the guard keeps the handles, so an unwaited message still arrives instead
  of being lost with its dropped handle (on gloo the ranks would hang), and names the rank that left them;
- its traffic is the algorithm's: every message through rank 0 for the hub, 2(N-1) chunks to the right
  neighbour for the ring, exactly the bytes each sends (`labkit.exercises.diagnosis`);
- its messages, in the order each rank posted them, would also complete on NCCL (GPUs), checked with
  labkit.comm.stream_model: there a send or receive posted on its own blocks the rank's stream until its peer
  runs the matching one, so a dist.isend before the dist.recv of the same step, which runs on gloo, hangs when
  every rank does it (NCCL docs: ncclSend/ncclRecv are "blocking for the GPU"). Safe on both backends: each
  step's send and receive in one dist.batch_isend_irecv, or by parity (even ranks send first, odd receive
  first), as labkit.comm's Transport.exchange does.
"""

from __future__ import annotations

from collections import Counter

import labkit
from labkit.checks import timeout_seconds as checked_timeout
from labkit.comm.stream_model import stream_deadlock
from labkit.exercises.diagnosis import hub_traffic, ring_traffic, unmatched, wrong_values
from labkit.exercises.guard import (
    POINT_TO_POINT,
    attempt,
    first_failure,
    forbidden_message,
    messages_of_last_attempt,
    rank_input,
    stop_pool,
    where_ranks_waited,
)
from labkit.exercises.progress import graded
from labkit.exercises.verdict import Verdict
from labkit.launch.errors import NoReply

__all__ = ["NAIVE_CASES", "RING_CASES", "TIMEOUT_SECONDS", "check_naive_allreduce", "check_ring_allreduce"]

TIMEOUT_SECONDS = 10.0  # per case; a right solution needs milliseconds, so a wait this long is a hang
# (world_size, numel). Three ranks first: on two, left and right are the same rank, and so are hub and leaf.
NAIVE_CASES = [(3, 5), (2, 3), (4, 4), (4, 1)]
RING_CASES = [(3, 6), (2, 4), (4, 8), (3, 7), (2, 5), (4, 10), (4, 2)]  # sizes N divides first, then not


@graded("naive_allreduce")
def check_naive_allreduce(fn, *, timeout_seconds: float = TIMEOUT_SECONDS) -> Verdict:
    """Grade `fn(t)`: an AllReduce (sum, in place) through the hub, rank 0, built from send and recv."""
    verdict = _grade(fn, "your naive AllReduce", NAIVE_CASES, hub_traffic, ring=False,
                     timeout_seconds=timeout_seconds)
    if verdict:
        verdict.message += (" Every message had rank 0 at one end: each rank sent its tensor to rank 0 once and "
                            "got the sum back into t, in place.")
    return verdict


@graded("ring_allreduce")
def check_ring_allreduce(fn, *, timeout_seconds: float = TIMEOUT_SECONDS) -> Verdict:
    """Grade `fn(t)`: a ring AllReduce (sum, in place) from send/recv, also on sizes that N does not divide.

    In a ring every rank sends only to its right neighbour, rank + 1: one chunk per step, 2(N-1) steps."""
    verdict = _grade(fn, "your ring AllReduce", RING_CASES, ring_traffic, ring=True, timeout_seconds=timeout_seconds)
    if verdict:
        verdict.message += (" Every rank sent only to its right neighbour, 2(N-1) messages of one chunk each: "
                            "2(N-1)/N x S bytes, the ring's traffic, whatever N.")
    return verdict


def _grade(fn, what: str, cases: list[tuple[int, int]], traffic, ring: bool, timeout_seconds: float) -> Verdict:
    """Run fn on every case in turn; the first case's problem, or a pass that says what was checked."""
    timeout_seconds = checked_timeout("timeout_seconds", timeout_seconds)
    if not callable(fn):
        return Verdict(False, f"pass your function itself, e.g. check(my_allreduce), not {type(fn).__name__}.")
    order_problem = None  # the first case whose order would hang on NCCL: said once every case is right on gloo
    for world_size, numel in cases:
        problem = _case_problem(fn, world_size, numel, traffic, ring, timeout_seconds)
        if problem and problem.startswith(_NCCL_HANG):
            order_problem = order_problem or _in_case(world_size, numel, problem)
        elif problem:
            return Verdict(False, _in_case(world_size, numel, problem))
    if order_problem:
        return Verdict(False, order_problem)
    return Verdict(True, f"{what} gives torch.distributed.all_reduce's answer on 2, 3 and 4 ranks, "
                         "for sizes that N divides and sizes it does not.")


def _in_case(world_size: int, numel: int, problem: str) -> str:
    nbytes = numel * rank_input(0, 1).element_size()
    return f"On {world_size} ranks with a tensor of {numel} float32 elements (S = {nbytes} bytes), {problem}"


def _case_problem(fn, world_size: int, numel: int, traffic, ring: bool, timeout_seconds: float) -> str | None:
    """What is wrong with fn on one (world_size, numel), or None. A wrong attempt may leave messages
    that nobody received: then the pool is stopped, or the next call's receives would take them."""
    try:
        outcomes = labkit.run(attempt, fn, numel, world_size=world_size, timeout=timeout_seconds)
    except labkit.RankTimeout as hang:  # labkit stops a pool whose call timed out
        return _hang_message(hang, ring, timeout_seconds)
    except labkit.RankError as error:
        no_reply = any(f.kind in (NoReply.STOPPED, NoReply.DIED) for f in error.failures)
        if not (error.pool_stopped or no_reply):
            try:
                _stop_pool_if_unmatched(world_size, labkit.run(messages_of_last_attempt, world_size=world_size))
            except labkit.RankError:
                pass  # then labkit has stopped the pool itself
        return _error_message(error)
    problem = next((forbidden_message(rank, o.forbidden[0], True, _why_forbidden)
                    for rank, o in enumerate(outcomes) if o.forbidden), None)
    problem = problem or _unwaited_message(outcomes)
    if problem:  # a handle never waited: the pool is stopped, whatever its messages did
        stop_pool(world_size)
        return problem
    problem = wrong_values(outcomes, numel, ring) or traffic(outcomes, numel)
    if problem:
        _stop_pool_if_unmatched(world_size, [(o.sends, o.recvs) for o in outcomes])
    return problem or _nccl_order_message([o.posts for o in outcomes], ring)


def _unwaited_message(outcomes) -> str | None:
    """The first rank that posted a dist.isend or dist.irecv and never waited for its handle, or None."""
    rank, outcome = next(((r, o) for r, o in enumerate(outcomes) if o.unwaited), (None, None))
    if outcome is None:
        return None
    counts = Counter(outcome.unwaited)
    posted = ", ".join(f"{count} {_call(verb)}{'s' * (count > 1)} {'to' if verb == 'send' else 'from'} rank {peer}"
                       for (verb, peer), count in sorted(counts.items()))
    kinds = "/".join(sorted({_call(verb) for verb, _ in counts}))
    return (f"rank {rank}'s {kinds} handle(s) were never waited ({posted}). "
            "dist.isend and dist.irecv (and each request of dist.batch_isend_irecv) return at once, before the "
            "message has moved: a dropped, unwaited handle can lose its message (on gloo the ranks then hang) or "
            "let t change while it is still being sent.")


def _call(verb: str) -> str:
    """The call that posts an unwaited message of ProcessGroup `verb` ("send" or "recv")."""
    return "isend" if verb == "send" else "irecv"


def _stop_pool_if_unmatched(world_size: int, messages: list[tuple[list, list]]) -> None:
    """Stop the pool of `world_size` ranks if their sends and receives did not match (a message left waiting)."""
    if unmatched(messages):
        stop_pool(world_size)


def _hang_message(hang: labkit.RankTimeout, ring: bool, timeout_seconds: float) -> str:
    """A call that never finished: where the first ranks waited, and how sends and receives deadlock."""
    where = where_ranks_waited(hang)
    agree = "the same neighbours: left and right" if ring else "the same hub, rank 0"
    return (f"it never finished (stopped after {timeout_seconds:g} s): some rank waited for a message that never "
            f"came. {where}. Every send needs a matching recv on the other rank, in an order that cannot leave "
            f"ranks all waiting: a blocking dist.send waits for its recv. {_SAFE_ORDER} Do all ranks agree on "
            f"{agree}?")


_NCCL_HANG = "it works here on gloo, but it would hang on NCCL (GPUs)"
_SAFE_ORDER = ("The orders that cannot leave every rank waiting: a send posted together with the receive that must "
               "run alongside it, in one dist.batch_isend_irecv, every request it returns waited; or sends and "
               "receives ordered by rank parity. A dist.isend before a blocking dist.recv is not enough: it runs on "
               "gloo, but on NCCL the two still run one after the other on the rank's GPU stream, and every rank "
               "waits in its send.")
_RING_FIX = ("The orders that are safe on both backends: each step's send and receive posted together in one "
             "dist.batch_isend_irecv, every request it returns waited; or ordered by rank parity.")
_HUB_FIX = ("The orders that are safe on both backends: every send posted where its peer has already reached the "
            "matching receive, or a rank's send and receive posted together in one dist.batch_isend_irecv, every "
            "request it returns waited.")


def _nccl_order_message(posts: list[list[tuple]], ring: bool) -> str | None:
    """None if the messages, as each rank posted them, complete under NCCL's rules (labkit.comm.stream_model);
    else where every rank would wait, and the orders that are safe on both backends."""
    stuck = stream_deadlock(posts)
    if stuck is None:
        return None
    waiting = "; ".join(f"rank {rank} in its {_group_text(group)}" for rank, group in enumerate(stuck) if group)
    return (f"{_NCCL_HANG}. A send or a receive posted on its own waits on its stream until its peer runs the "
            "matching one (NCCL docs, ncclSend/ncclRecv: \"blocking for the GPU\"; operations that must progress "
            "together go in one group), and torch puts them on one stream per communicator: in labkit's NCCL "
            "groups (started with a device_id) the group's one, so a rank's sends and receives queue behind each "
            "other; in a group started without one, a two-rank communicator per pair of ranks made on first use, "
            "where 3 or more ranks hang even earlier, each first send waiting to create the communicator with a "
            "neighbour busy creating its own (ProcessGroupNCCL::pointToPoint); this check's one-stream rule is the "
            "safe, conservative one. In the order your ranks posted their messages, these "
            f"ranks would wait for ever: {waiting}. dist.isend returning at once does not help: it frees the CPU, "
            f"not the stream. {_RING_FIX if ring else _HUB_FIX}")


def _group_text(group: list[tuple]) -> str:
    """'send to rank 1', or 'batch_isend_irecv of send to rank 1, recv from rank 2': a stuck group of
    stream_deadlock, whose operations are (op, (src, dst), index, what)."""
    ops = [f"send to rank {dst}" if op == "send" else f"recv from rank {src}" for op, (src, dst), *_ in group]
    return ops[0] if len(ops) == 1 else "batch_isend_irecv of " + ", ".join(ops)


def _error_message(error: labkit.RankError) -> str:
    """A call that raised: the first switched-off call it made, else the first rank's own error."""
    first, spelling = first_failure(error)
    if spelling is not None:
        return forbidden_message(first.rank, spelling, False, _why_forbidden)
    return f"rank {first.rank} raised {first.summary}"


def _why_forbidden(spelling: str, name: str) -> str:
    """Why the call `spelling` (function `name`) is switched off while an AllReduce is graded, and what instead."""
    if "labkit.comm" in spelling:
        return ("labkit.comm's ring_allreduce and naive_allreduce are the course's own answer; this exercise is "
                f"to write one yourself, from {POINT_TO_POINT}.")
    if name.startswith("recv_any"):
        return ("A dist.recv without src takes a message from whichever rank sends first, not from the rank the "
                "algorithm expects.")
    if name in ("send_object_list", "recv_object_list"):
        return ("It sends a pickled Python object in two messages (its size, then its bytes); send the tensor "
                "itself with dist.send or dist.isend.")
    return (f"That is a ready-made collective, which does the exercise for you. Build the AllReduce from "
            f"{POINT_TO_POINT}: torch's collectives and labkit.comm's are switched off while it is graded.")
