"""Graders for the notebooks' "your turn" cells: run the student's code on real ranks and say what is wrong.

`check_naive_allreduce(fn)` and `check_ring_allreduce(fn)` call `fn(t)` on 2, 3 and 4 ranks, where rank r's
`t` is `rank_input(r, numel)` (float32), for sizes that N divides and sizes it does not. A solution passes
only if, in every case, on every rank:

- `t` itself ends with the sum over ranks, in its own memory (in place: returning a new tensor fails);
- it called no collective. The exercise is built from dist.send/dist.recv, dist.isend/dist.irecv or
  dist.batch_isend_irecv. The last is allowed: it posts a list of those same isend/irecv together, each
  counted as one message (on gloo it is exactly a loop of them; NCCL ring code uses it to post a step's
  send and receive at once);
- its traffic is the algorithm's, per rank, S being the tensor's bytes:
    hub (naive): every message has rank 0 at one end; every other rank sends its S bytes to rank 0 and
        receives S back; rank 0 sends S to each of the others, (N-1) x S in all.
    ring: every rank sends only to its right neighbour (r + 1) mod N and receives only from its left
        one, in 2(N-1) messages (one chunk of t.tensor_split(N) per step), and exactly the bytes of the
        chunks a ring sends (`ring_nbytes_per_rank`): 2(N-1)/N x S when N divides S
        (labkit.plan.ring_allreduce_bytes; Patarasuk & Yuan 2009), and for other sizes every chunk but
        the one it completes, then every chunk but the one it receives last. Any consistent numbering of
        the chunks is accepted.

While `fn` runs, a guard is on in each rank, and always removed afterwards (try/finally), even when `fn`
raises, or is interrupted after a hang (a rank that does not stop is killed with its pool). It replaces,
for the whole process: torch.distributed's collective functions (in `torch.distributed` and in
`torch.distributed.distributed_c10d`), the collective methods of the ProcessGroup and Backend classes (so
`dist.group.WORLD.allreduce` too), every c10d operator under torch.ops (`torch.ops.c10d.allreduce_`,
functional collectives), and labkit.comm's transport. They raise `ForbiddenCall`, which is reported even
if `fn` catches it. Messages are counted in ProcessGroup.send and ProcessGroup.recv, where dist.send,
dist.isend and dist.batch_isend_irecv all arrive, once per message. Data moved any other way (the
rendezvous store, files, sockets) is not counted, so such a solution fails the traffic check.
"""

from __future__ import annotations

import itertools
import time
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

import labkit
from labkit.plan.traffic import naive_allreduce_bytes, ring_allreduce_bytes

TIMEOUT_SECONDS = 10.0  # per case; a right solution needs milliseconds, so a wait this long is a hang
# (world_size, numel). Three ranks first: on two, left and right are the same rank, and so are hub and leaf.
NAIVE_CASES = [(3, 5), (2, 3), (4, 4), (4, 1)]
RING_CASES = [(3, 6), (2, 4), (4, 8), (3, 7), (2, 5), (4, 10), (4, 2)]  # sizes N divides first, then not

_POINT_TO_POINT = "dist.send/dist.recv (or dist.isend/dist.irecv, dist.batch_isend_irecv)"

# What the guard switches off: torch.distributed's functions other than point-to-point, ...
_TORCH_FUNCTIONS = (
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
    "all_gather_coalesced", "all_gather_single", "all_gather_object", "gather", "gather_object", "scatter",
    "scatter_object_list", "broadcast_object_list", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    "send_object_list", "recv_object_list", "_all_gather_base", "_reduce_scatter_base", "new_group",
    "new_subgroups", "new_subgroups_by_enumeration", "split_group", "shrink_group", "init_device_mesh",
    "init_process_group", "destroy_process_group",
)
# ... the ProcessGroup's methods other than send and recv, ...
_GROUP_METHODS = (
    "allreduce", "allreduce_coalesced", "reduce", "broadcast", "allgather", "_allgather_base",
    "allgather_coalesced", "allgather_into_tensor_coalesced", "all_gather_single", "all_gather_single_coalesced",
    "gather", "scatter", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
    "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base",
    "all_to_all_single", "barrier", "monitored_barrier", "recv_anysource", "split_group", "merge_remote_group",
)
# ... and every communication method of a backend (gloo, NCCL), reached through ProcessGroup._get_backend.
_BACKEND_METHODS = (
    "allreduce", "allreduce_coalesced", "reduce", "broadcast", "allgather", "_allgather_base",
    "allgather_coalesced", "gather", "scatter", "reduce_scatter", "_reduce_scatter_base", "alltoall",
    "alltoall_base", "barrier", "monitored_barrier", "send", "recv", "recv_anysource",
)
_GROUP_MAKERS = ("new_group", "new_subgroups", "new_subgroups_by_enumeration", "split_group", "shrink_group",
                 "merge_remote_group", "init_device_mesh", "init_process_group", "destroy_process_group")
_FORBIDDEN_PREFIX = "labkit.exercises.ForbiddenCall: "
_FORBIDDEN_SUFFIX = " is switched off while this exercise is graded"


@dataclass
class Verdict:
    """The grade: `passed`, and a message for the student. Shows itself as one line in a notebook."""

    passed: bool
    message: str

    def __bool__(self) -> bool:
        return self.passed

    def __repr__(self) -> str:
        return ("Correct! " if self.passed else "Not yet. ") + self.message

    def _repr_markdown_(self) -> str:
        return ("**✅ Correct!** " if self.passed else "**❌ Not yet.** ") + self.message


def check_naive_allreduce(fn, *, timeout_seconds: float = TIMEOUT_SECONDS) -> Verdict:
    """Grade `fn(t)`: an AllReduce (sum, in place) through the hub, rank 0, built from send and recv."""
    verdict = _grade(fn, "your naive AllReduce", NAIVE_CASES, _hub_traffic, ring=False,
                     timeout_seconds=timeout_seconds)
    if verdict:
        verdict.message += (" Every message had rank 0 at one end: each rank sent its tensor to rank 0 once and "
                            "got the sum back into t, in place.")
    return verdict


def check_ring_allreduce(fn, *, timeout_seconds: float = TIMEOUT_SECONDS) -> Verdict:
    """Grade `fn(t)`: a ring AllReduce (sum, in place) from send/recv, also on sizes that N does not divide.

    In a ring every rank sends only to its right neighbour, rank + 1: one chunk per step, 2(N-1) steps."""
    verdict = _grade(fn, "your ring AllReduce", RING_CASES, _ring_traffic, ring=True, timeout_seconds=timeout_seconds)
    if verdict:
        verdict.message += (" Every rank sent only to its right neighbour, 2(N-1) messages of one chunk each: "
                            "2(N-1)/N x S bytes, the ring's traffic, whatever N.")
    return verdict


def rank_input(rank: int, numel: int, device=None) -> torch.Tensor:
    """Rank r's input: (r + 1) x [1, 2, ..., numel]. Distinct per rank, so every mistake shows."""
    return (rank + 1) * torch.arange(1.0, numel + 1, device=device)


def ring_nbytes_per_rank(numel: int, world_size: int, element_size: int = 4,
                         order: tuple[int, ...] | None = None) -> list[int]:
    """Bytes each rank sends in a ring AllReduce of `numel` elements cut with tensor_split(world_size).

    In a ring what rank r sends at step s is what rank r - 1 sent at step s - 1, so it is chunk
    order[(r - s) mod N] for one numbering `order` of the chunks. Rank r completes chunk order[r + 1], the
    one it never sends in the reduce-scatter; in the all-gather it sends every chunk but order[r + 2], the
    last it receives. The default is the lesson's numbering (rank r sends chunk r - s - 1 and completes
    chunk r). When N divides numel, every rank sends 2(N-1)/N x S bytes (labkit.plan.ring_allreduce_bytes).

    >>> ring_nbytes_per_rank(10, 4)    # chunks of 3, 3, 2, 2 elements, 4 bytes each
    [56, 60, 64, 60]
    """
    base, extra = divmod(numel, world_size)
    sizes = [base + (i < extra) for i in range(world_size)]  # torch.tensor_split's chunk sizes
    order = order or tuple((i - 1) % world_size for i in range(world_size))
    return [element_size * (2 * numel - sizes[order[(r + 1) % world_size]] - sizes[order[(r + 2) % world_size]])
            for r in range(world_size)]


# ---- on a rank: run the student's function under the guard -------------------------------------------

class ForbiddenCall(RuntimeError):
    """Raised on a rank when graded code calls what the exercise asks it to build from send and recv."""


@dataclass
class _Outcome:
    """What one rank's call left behind: t's values, what fn returned, and every message it posted."""

    tensor: list[float]
    returned: list | None  # a tensor fn returned other than t, as a list
    same_memory: bool  # t still uses the memory it came in
    sends: list[tuple[int, int]] = field(default_factory=list)  # (dst, nbytes) per message, in order
    recvs: list[tuple[int, int]] = field(default_factory=list)  # (src, nbytes)
    forbidden: list[str] = field(default_factory=list)  # what it called that is switched off


class _Guard:
    """While graded code runs on a rank: collectives raise, point-to-point messages are counted.

    Everything is replaced where Python looks it up, for the whole process (threads too): torch.distributed's
    functions, the ProcessGroup and Backend classes' methods, the c10d operators under torch.ops, and
    labkit.comm's transport. Messages are counted in ProcessGroup.send and ProcessGroup.recv, where
    dist.send, dist.isend and dist.batch_isend_irecv all arrive, once per message."""

    def __init__(self):
        self.sends: list[tuple[int, int]] = []
        self.recvs: list[tuple[int, int]] = []
        self.forbidden: list[str] = []
        self._saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> _Guard:
        try:
            self._switch_off_collectives()
            self._count(self.sends, "send")
            self._count(self.recvs, "recv")
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self._restore()

    def refuse(self, spelling: str):
        self.forbidden.append(spelling)
        raise ForbiddenCall(spelling + _FORBIDDEN_SUFFIX)

    def _switch_off_collectives(self) -> None:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        from labkit.comm.transport import TorchTransport

        for module, prefix in ((dist, "torch.distributed"), (distributed_c10d, "torch.distributed.distributed_c10d")):
            for name in _TORCH_FUNCTIONS:
                self._replace(module, name, f"{prefix}.{name}")
        for name in _GROUP_METHODS:
            self._replace(dist.ProcessGroup, name, f"ProcessGroup.{name} (as in dist.group.WORLD.{name})")
        for name in _BACKEND_METHODS:
            self._replace(torch._C._distributed_c10d.Backend, name, f"the process group's backend's {name}")
        for qualified in torch._C._dispatch_get_all_op_names():  # "c10d::allreduce_", "_c10d_functional::..."
            namespace, _, name = qualified.partition("::")
            if "c10d" in namespace:
                self._replace(getattr(torch.ops, namespace), name, f"torch.ops.{namespace}.{name}", cached=False)
        for name in ("_post_send", "_post_recv"):
            self._replace(TorchTransport, name, "a labkit.comm collective")

    def _replace(self, owner, name: str, spelling: str, cached: bool = True) -> None:
        """Make owner.name raise; `cached=False` for torch.ops namespaces, which create attributes on first use."""
        original = vars(owner).get(name, _ABSENT)
        if original is _ABSENT and cached:  # not in this torch release
            return

        def refused(*args, **kwargs):
            self.refuse(spelling)

        self._saved.append((owner, name, original))
        setattr(owner, name, refused)

    def _count(self, messages: list[tuple[int, int]], name: str) -> None:
        """Record (peer, nbytes) for each ProcessGroup.send or .recv (tensors, peer, tag), then post it."""
        import torch.distributed as dist

        original = vars(dist.ProcessGroup)[name]

        def counted(group, tensors, peer, *args, **kwargs):
            messages.append((int(peer), sum(t.numel() * t.element_size() for t in tensors)))
            return original(group, tensors, peer, *args, **kwargs)

        self._saved.append((dist.ProcessGroup, name, original))
        setattr(dist.ProcessGroup, name, counted)

    def _restore(self) -> None:
        while self._saved:
            owner, name, original = self._saved.pop()
            if original is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


_ABSENT = object()


_last_messages: tuple[list, list] = ([], [])  # on a rank: (sends, recvs) of the last graded call


def _attempt(fn, numel: int) -> _Outcome:
    """On a rank: call fn on this rank's input under the guard; what happened, for the grader."""
    global _last_messages
    t = rank_input(labkit.rank(), numel, device=labkit.device())
    memory = t.data_ptr()
    guard = _Guard()
    try:
        with guard:
            returned = fn(t)
    finally:
        _last_messages = (guard.sends, guard.recvs)
    if isinstance(returned, torch.Tensor) and returned is not t:
        returned = returned.detach().tolist()
    else:
        returned = None
    return _Outcome(t.tolist(), returned, t.data_ptr() == memory, guard.sends, guard.recvs, guard.forbidden)


def _messages_of_last_attempt() -> tuple[list, list]:
    """On a rank: what the last graded call posted, when it raised instead of returning it."""
    return _last_messages


# ---- in the notebook: from what happened to a verdict ------------------------------------------------

def _grade(fn, what: str, cases: list[tuple[int, int]], traffic, ring: bool, timeout_seconds: float) -> Verdict:
    if not callable(fn):
        return Verdict(False, f"pass your function itself, e.g. check(my_allreduce), not {type(fn).__name__}.")
    for world_size, numel in cases:
        problem = _case_problem(fn, world_size, numel, traffic, ring, timeout_seconds)
        if problem:
            nbytes = numel * rank_input(0, 1).element_size()
            return Verdict(False, f"On {world_size} ranks with a tensor of {numel} float32 elements "
                                  f"(S = {nbytes} bytes), {problem}")
    return Verdict(True, f"{what} gives torch.distributed.all_reduce's answer on 2, 3 and 4 ranks, "
                         "for sizes that N divides and sizes it does not.")


def _case_problem(fn, world_size: int, numel: int, traffic, ring: bool, timeout_seconds: float) -> str | None:
    """What is wrong with fn on one (world_size, numel), or None. A wrong attempt may leave messages
    that nobody received: then the pool is stopped, or the next call's receives would take them."""
    try:
        outcomes = labkit.run(_attempt, fn, numel, world_size=world_size, timeout=timeout_seconds)
    except labkit.RankTimeout as hang:  # labkit stops a pool whose call timed out
        return _hang_message(hang, ring, timeout_seconds)
    except labkit.RankError as error:
        if not ("pool was stopped" in error.headline or any(f.kind in ("stopped", "died") for f in error.failures)):
            try:
                _stop_pool_if_unmatched(world_size, labkit.run(_messages_of_last_attempt, world_size=world_size))
            except labkit.RankError:
                pass  # then labkit has stopped the pool itself
        return _error_message(error)
    problem = next((_forbidden_message(rank, o.forbidden[0], caught=True)
                    for rank, o in enumerate(outcomes) if o.forbidden), None)
    problem = problem or _wrong_values(outcomes, numel, ring) or traffic(outcomes, numel)
    if problem:
        _stop_pool_if_unmatched(world_size, [(o.sends, o.recvs) for o in outcomes])
    return problem


def _stop_pool_if_unmatched(world_size: int, messages: list[tuple[list, list]]) -> None:
    """Have labkit stop the pool of `world_size` ranks if some message was left without its partner.

    labkit.run stops a pool whose call outlasts its timeout (labkit/launch/pool.py), as this one does."""
    if _unmatched(messages):
        try:
            labkit.run(time.sleep, 60, world_size=world_size, timeout=0.1)
        except labkit.RankTimeout:
            pass


def _hang_message(hang: labkit.RankTimeout, ring: bool, timeout_seconds: float) -> str:
    waiting = sorted((f for f in hang.failures if f.kind == "stopped"), key=lambda f: f.rank)[:2]
    where = "; ".join(f"rank {f.rank} {f.summary}" for f in waiting)
    agree = "the same neighbours: left and right" if ring else "the same hub, rank 0"
    return (f"it never finished (stopped after {timeout_seconds:g} s): some rank waited for a message that never "
            f"came. {where}. Every send needs a matching recv on the other rank, in an order that cannot leave "
            "ranks all waiting: a blocking dist.send waits for its recv, so post sends with dist.isend before "
            f"the blocking dist.recv, or order blocking calls by rank parity. Do all ranks agree on {agree}?")


def _error_message(error: labkit.RankError) -> str:
    forbidden = [f for f in error.failures if f.summary.startswith(_FORBIDDEN_PREFIX)]
    if forbidden:
        first = min(forbidden, key=lambda f: (f.time, f.rank))
        spelling = first.summary.removeprefix(_FORBIDDEN_PREFIX).removesuffix(_FORBIDDEN_SUFFIX)
        return _forbidden_message(first.rank, spelling, caught=False)
    first = min((f for f in error.failures if f.kind != "stopped"), key=lambda f: (f.time, f.rank),
                default=error.failures[0])
    return f"rank {first.rank} raised {first.summary}"


def _forbidden_message(rank: int, spelling: str, caught: bool) -> str:
    """Rank `rank` called `spelling`, which the guard switched off: say why, and what to use instead."""
    also = " (and caught the error; it still counts)" if caught else ""
    called = spelling.split(" (")[0].replace("'s ", ".").rsplit(".", 1)[-1].split()[-1]  # the function's own name
    if "labkit.comm" in spelling:
        why = ("labkit.comm's ring_allreduce and naive_allreduce are the course's own answer; this exercise is "
               f"to write one yourself, from {_POINT_TO_POINT}.")
    elif called.startswith("recv_any"):
        why = "A dist.recv without src takes a message from any rank; name the rank you expect: dist.recv(t, src)."
    elif called in ("send_object_list", "recv_object_list"):
        why = ("It sends a pickled Python object in two messages (its size, then its bytes); send the tensor itself "
               "with dist.send or dist.isend.")
    elif called in _GROUP_MAKERS:
        why = "Work in the default process group, which every rank already shares: leave out group=."
    else:
        why = (f"That is a ready-made collective, which does the exercise for you. Build the AllReduce from "
               f"{_POINT_TO_POINT}: torch's collectives and labkit.comm's are switched off while it is graded.")
    return f"rank {rank} called {spelling}{also}. {why}"


def _wrong_values(outcomes: list[_Outcome], numel: int, ring: bool) -> str | None:
    """The first rank whose t does not hold the sum, in its own memory, and the likely reason."""
    world_size = len(outcomes)
    total = sum(rank_input(r, numel) for r in range(world_size))
    for rank, outcome in enumerate(outcomes):
        got, mine = torch.tensor(outcome.tensor), rank_input(rank, numel)
        if not outcome.same_memory:
            return (f"rank {rank}'s t was pointed at new memory (t.set_ or t.data = ...): an AllReduce works in "
                    "place, in t's own memory, so that every view of it (a gradient bucket, a parameter) sees the "
                    "sum. Receive or add into t, or finish with t.copy_(result).")
        if torch.equal(got, total):
            continue
        if outcome.returned is not None and torch.equal(torch.tensor(outcome.returned), total):
            state = "unchanged" if torch.equal(got, mine) else f"{got.tolist()}"
            return (f"rank {rank} returned the sum in a new tensor, but its t is {state}: the AllReduce must work "
                    "in place, so that t itself holds the sum. Receive into t, add into t, or finish with "
                    "t.copy_(result).")
        if got.shape != total.shape:
            return f"rank {rank} ended with {got.numel()} elements in t instead of {numel}."
        if torch.equal(got, mine):
            return (f"rank {rank} still holds its own input {mine.tolist()}: the result never reached it. "
                    "Did the result get sent back to every rank (and received into the same tensor)?")
        if torch.equal(got, total + mine):
            return (f"rank {rank} holds its input plus the sum: it added the result to its own tensor instead "
                    "of replacing it (summed twice). Receive into the tensor, or copy the result over it.")
        missing = [r for r in range(world_size) if torch.equal(total - got, rank_input(r, numel))]
        if missing:
            return (f"rank {rank} got {got.tolist()}, expected {total.tolist()}: the sum is missing rank "
                    f"{missing[0]}'s input {rank_input(missing[0], numel).tolist()}. Did every rank's tensor get "
                    "added, once?")
        if ring:
            return _wrong_ring_values(rank, got, total, world_size, numel)
        return f"rank {rank} got {got.tolist()}, expected {total.tolist()}."
    return None


def _wrong_ring_values(rank: int, got: torch.Tensor, total: torch.Tensor, world_size: int, numel: int) -> str:
    expected = f"rank {rank} got {got.tolist()}, expected {total.tolist()}."
    if numel % world_size:  # the cases that N divides come first, so those passed
        return (f"{expected} {numel} is not a multiple of {world_size}: split with t.tensor_split(N), whose chunks "
                "may differ by one element, and size every buffer like the chunk it receives.")
    chunks = list(zip(got.tensor_split(world_size), total.tensor_split(world_size), strict=True))
    complete = [c for c, (g, t) in enumerate(chunks) if torch.equal(g, t)]
    if len(complete) == 1:
        return (f"on rank {rank} only chunk {complete[0]} is fully reduced: the reduce-scatter worked; the "
                "all-gather that passes the finished chunks around the ring is missing.")
    wrong = [c for c in range(world_size) if c not in complete]
    return (f"{expected} Chunks {wrong} of t.tensor_split({world_size}) are wrong: check which chunk each step "
            "sends and which it adds into. With the lesson's numbering, at reduce-scatter step s rank r sends "
            "chunk (r - s - 1) mod N and adds what it receives into chunk (r - s - 2) mod N; at all-gather step s "
            "it sends chunk (r - s) mod N and receives chunk (r - s - 1) mod N.")


def _ring_traffic(outcomes: list[_Outcome], numel: int) -> str | None:
    """Each rank: only to its right neighbour, only from its left, 2(N-1) messages, exactly a ring's bytes."""
    n = len(outcomes)
    element_size = rank_input(0, 1).element_size()
    nbytes = numel * element_size
    for rank, outcome in enumerate(outcomes):
        right, left = (rank + 1) % n, (rank - 1) % n
        for verb, peers, allowed in (("sent to", outcome.sends, right), ("received from", outcome.recvs, left)):
            strays = sorted({peer for peer, _ in peers} - {allowed})
            if strays:
                backwards = "" if {peer for peer, _ in peers} != {left if allowed == right else right} else \
                    f" (its {'left' if allowed == right else 'right'} neighbour only: your ring runs the wrong way)"
                return (f"rank {rank} {verb} rank(s) {strays}{backwards}. In a ring each rank sends only to its "
                        f"right neighbour, here rank {right}, and receives only from its left one, rank {left}. "
                        "The answer may be right, but this is not a ring.")
    unmatched = _unmatched([(o.sends, o.recvs) for o in outcomes])
    if unmatched:
        return unmatched
    expected = ring_nbytes_per_rank(numel, n, element_size)
    rule = (f"one chunk of t.tensor_split({n}) per step, N-1 steps of reduce-scatter then N-1 of all-gather: "
            f"2(N-1)/N x S = {ring_allreduce_bytes(nbytes, n):g} bytes per rank")
    for rank, outcome in enumerate(outcomes):
        sent = sum(b for _, b in outcome.sends)
        if len(outcome.sends) != 2 * (n - 1):
            largest_chunk = -(-numel // n) * element_size
            whole = "" if nbytes <= largest_chunk or all(b != nbytes for _, b in outcome.sends) else (
                f" Its messages carried the whole tensor ({nbytes} bytes): passing the whole tensor around the ring "
                "gives the right answer but moves (N-1) x S bytes per rank, more for every rank you add.")
            count = f"{len(outcome.sends)} message" + "s" * (len(outcome.sends) != 1)
            return (f"rank {rank} sent {count}, {sent} bytes in all, to rank {(rank + 1) % n}. "
                    f"A ring AllReduce sends 2(N-1) = {2 * (n - 1)} messages, {rule} (exactly {expected[rank]} bytes "
                    f"from rank {rank} here).{whole}")
    sent = tuple(sum(b for _, b in o.sends) for o in outcomes)
    accepted = {tuple(ring_nbytes_per_rank(numel, n, element_size, order))
                for order in itertools.permutations(range(n))}
    if sent not in accepted:
        rank = next(r for r in range(n) if sent[r] != expected[r])
        return (f"rank {rank} sent {sent[rank]} bytes to rank {(rank + 1) % n} in {2 * (n - 1)} messages; expected "
                f"{expected[rank]}: {rule}. Exactly, each rank sends every chunk but the one it completes in the "
                "reduce-scatter, then every chunk but the one it receives last in the all-gather. Check which "
                "chunk each step sends.")
    return None


def _hub_traffic(outcomes: list[_Outcome], numel: int) -> str | None:
    """Every message has rank 0 at one end; S bytes each way between rank 0 and every other rank."""
    n = len(outcomes)
    nbytes = numel * rank_input(0, 1).element_size()
    for rank, outcome in enumerate(outcomes[1:], start=1):
        for verb, peers in (("sent to", outcome.sends), ("received from", outcome.recvs)):
            strays = sorted({peer for peer, _ in peers} - {0})
            if strays:
                return (f"rank {rank} {verb} rank(s) {strays}. In the naive AllReduce every message has rank 0, the "
                        "hub, at one end: every other rank sends to rank 0 and receives from rank 0 only. The answer "
                        "may be right, but it did not go through the hub.")
    unmatched = _unmatched([(o.sends, o.recvs) for o in outcomes])
    if unmatched:
        return unmatched
    per_peer = (f"each rank sends its whole tensor (S = {nbytes} bytes) to rank 0 once and receives the sum back "
                f"once; rank 0 sends S to each of the others, (N-1) x S = {naive_allreduce_bytes(nbytes, n):g} "
                "bytes in all")
    hub = outcomes[0]
    for rank, outcome in enumerate(outcomes[1:], start=1):
        for who, verb, count, peer in (
            (f"rank {rank}", "sent", sum(b for _, b in outcome.sends), "to rank 0"),
            (f"rank {rank}", "received", sum(b for _, b in outcome.recvs), "from rank 0"),
            ("rank 0 (the hub)", "sent", sum(b for p, b in hub.sends if p == rank), f"to rank {rank}"),
            ("rank 0 (the hub)", "received", sum(b for p, b in hub.recvs if p == rank), f"from rank {rank}"),
        ):
            if count != nbytes:
                return f"{who} {verb} {count} bytes {peer}, expected {nbytes}: in the naive AllReduce {per_peer}."
    return None


def _unmatched(messages: list[tuple[list, list]]) -> str | None:
    """A send that no recv took, or a recv that no send filled, given each rank's (sends, recvs): left
    over, it would meet the next call's messages."""
    for src, dst in itertools.permutations(range(len(messages)), 2):
        sent = [b for peer, b in messages[src][0] if peer == dst]
        received = [b for peer, b in messages[dst][1] if peer == src]
        if sent != received:
            return (f"rank {src} sent {len(sent)} message(s) to rank {dst} (bytes: {sent}), but rank {dst} posted "
                    f"{len(received)} receive(s) from rank {src} (bytes: {received}). Every send needs exactly one "
                    "recv of the same size on the other rank, and every recv one send.")
    return None


# ---- the stack map (notebook 10) ---------------------------------------------------------------------

# The lesson's stack map: each NVIDIA component's purpose in one clause.
STACK_MAP = {"NCCL": "communicates", "TensorRT-LLM": "optimizes", "Triton": "serves", "NIM": "packages",
             "NeMo": "builds", "RAPIDS": "processes data"}


def check_stack_map(answers: Mapping[str, str]) -> Verdict:
    """Grade a matching of NVIDIA components to what they do, e.g. {"NCCL": "...", "NeMo": "...", ...}.

    Case, spaces and hyphens in names ("tensorrt llm") and case and spaces in answers do not count; anything
    else must be exact: every component once, each answer one of the choices, all of them right."""
    choices = sorted(STACK_MAP.values())
    if not isinstance(answers, Mapping):
        return Verdict(False, f"pass a dict that maps each component to what it does, like "
                              f"{{'NCCL': '...', 'NeMo': '...'}}; got {type(answers).__name__}.")
    components = {_name_key(name): name for name in STACK_MAP}
    given: dict[str, str] = {}
    for name, answer in answers.items():
        component = components.get(_name_key(name)) if isinstance(name, str) else None
        if component is None:
            return Verdict(False, f"{name!r} is not one of the components: {', '.join(STACK_MAP)}.")
        if component in given:
            return Verdict(False, f"{component} is answered twice; give each component one answer.")
        if answer is not None and not isinstance(answer, str):
            return Verdict(False, f"give {component}'s answer as text, one of: {', '.join(choices)}; "
                                  f"got {type(answer).__name__}.")
        given[component] = _normalized(answer or "")
    missing = [name for name in STACK_MAP if not given.get(name)]
    if missing:
        return Verdict(False, f"match every component; still open: {', '.join(missing)}.")
    unknown = [name for name in STACK_MAP if given[name] not in choices]
    if unknown:
        named = ", ".join(f"{given[name]!r} for {name}" for name in unknown)
        return Verdict(False, f"{named}: not one of the choices, which are {', '.join(choices)}.")
    wrong = [name for name, verb in STACK_MAP.items() if given[name] != verb]
    if not wrong:
        return Verdict(True, "NCCL communicates, TensorRT-LLM optimizes, Triton serves, NIM packages, NeMo builds, "
                             "RAPIDS processes data.")
    shuffled = " Each answer is used once, but not with its component." if sorted(given.values()) == choices else ""
    hint = " NCCL is a communication library: not a training framework, not a scheduler, not a server." \
        if "NCCL" in wrong else ""
    return Verdict(False, f"{len(STACK_MAP) - len(wrong)} of {len(STACK_MAP)} right; look again at "
                          f"{', '.join(wrong)}.{shuffled}{hint}")


def _normalized(text: str) -> str:
    """'  Processes   DATA ' -> 'processes data': case and spacing do not count."""
    return " ".join(unicodedata.normalize("NFKC", text).split()).casefold()


def _name_key(name: str) -> str:
    """'tensorrt llm', 'TensorRT-LLM' and ' TENSORRT-llm' all name the same component."""
    return "".join(_normalized(name).replace("-", " ").split())
