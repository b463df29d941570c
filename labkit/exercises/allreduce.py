"""The AllReduce graders of notebooks 02 and 03: run the student's code on real ranks and say what is wrong.

`check_naive_allreduce(fn)` and `check_ring_allreduce(fn)` call `fn(t)` on 2, 3 and 4 ranks. What a right
solution must not depend on is drawn afresh on every grading (`naive_cases`, `ring_cases`): t's size (for the
ring, sizes that N divides and sizes it does not, and one smaller than N), its dtype (every one of
float32, float64 and float16 in each grading, so a solution that only works for float32, or counts 4 bytes an
element, always meets a case it fails) and its values (`drawn_input`: whole numbers drawn from a seed drawn per
case, so no rank can recompute another's input). In each case fn is called twice on every rank, on new values
(a result kept from the first call fails the second). A solution passes only if, in every case and call, on
every rank:

- `t` itself ends with the sum over ranks, in its own memory (in place: returning a new tensor fails);
- every message it sends or receives has t's dtype (a buffer made with torch.empty(n) is float32);
- labkit.comm's ready-made collectives are not called, from any thread (they refuse themselves while graded,
  labkit._refusals);
- it called no collective. The exercise is built from dist.send/dist.recv, dist.isend/dist.irecv or
  dist.batch_isend_irecv. The last is allowed: it posts a list of those same isend/irecv together, each
  counted as one message (on gloo it is exactly a loop of them; NCCL ring code uses it to post a step's
  send and receive at once). The guard that switches collectives off and counts messages is
  `AllReduceGuard`, below, on the kit's `Guard`;
- it waited for the handle of every dist.isend and dist.irecv it posted (work.wait(), or each request that
  dist.batch_isend_irecv returns): the guard keeps the handles, so an unwaited message still arrives instead
  of being lost with its dropped handle (on gloo the ranks would hang), and names the rank that left them;
- its traffic is the algorithm's: every message through rank 0 for the hub, 2(N-1) chunks to the right
  neighbour for the ring, exactly the bytes each sends, and what each message carried (the hub: each rank's t,
  then the sum; the ring: running partial sums of a chunk, then reduced chunks) (`labkit.exercises.diagnosis`);
- its messages, in the order each rank posted them, would also complete on NCCL (GPUs), checked with
  labkit.comm.stream_model: there a send or receive posted on its own blocks the rank's stream until its peer
  runs the matching one, so a dist.isend before the dist.recv of the same step, which runs on gloo, hangs when
  every rank does it (NCCL docs: ncclSend/ncclRecv are "blocking for the GPU"). Safe on both backends: each
  step's send and receive in one dist.batch_isend_irecv, or by parity (even ranks send first, odd receive
  first), as labkit.comm's Transport.exchange does. Told once every case is right on gloo.

Each grader is a `Spec` of the graders' kit (`NAIVE_SPEC`, `RING_SPEC`), run by its runner
(labkit.exercises._kit._runner.grade: the cases, the ready-made helpers refused, refusals and errors told, the one
rule after a RankError; the NCCL order is its final check), with the rank-side attempt below and the checks of
labkit.exercises.diagnosis.

On a rank, while fn runs, an `AllReduceGuard` is on, and always removed afterwards (the kit's Interceptor), even
when fn raises, or is interrupted after a hang (a rank that does not stop is killed with its pool). Besides what
the kit's Guard switches off (torch.distributed's collectives: functions, ProcessGroup and Backend methods, the
c10d operators), it switches off labkit.comm's transport, and counts messages in ProcessGroup.send and
ProcessGroup.recv, where dist.send, dist.isend and dist.batch_isend_irecv all arrive, once per message, with a
copy of what each send carries and t's dtype enforced (a message of another dtype raises WrongDtype before it is
posted, where gloo would kill the receiving rank). Data moved any other way (the rendezvous store, files, sockets)
is not counted, so such a solution fails the traffic check, or, if it sends the right messages from a scratch
copy, the check of what they carried. The handle each message returns is kept (a dropped, unwaited isend can lose
its message on gloo, and the run then hangs) and watched. The messages are also kept in the order NCCL would run
them (`Outcome.posts`: one group per dist.batch_isend_irecv call, one per message posted on its own).
"""

from __future__ import annotations

import functools
import random
import sys
from collections import Counter

import torch

import labkit
from labkit.checks import whole
from labkit.comm.stream_model import stream_deadlock
from labkit.exercises._kit._group_call import GroupCall, Kind, wrap_group_method
from labkit.exercises._kit._guard import Guard
from labkit.exercises._kit._messages import failure_sentence, first_failure, hang_message
from labkit.exercises._kit._record import Recorder
from labkit.exercises._kit._runner import Case, Spec, grade
from labkit.exercises._kit._store import LastAttempt
from labkit.exercises._kit._wait_watch import WaitWatch
from labkit.exercises.diagnosis import (
    Outcome,
    hub_contents,
    hub_traffic,
    ring_contents,
    ring_traffic,
    unmatched,
    wrong_values,
)
from labkit.exercises.progress import graded
from labkit.exercises.verdict import Verdict

__all__ = ["DTYPES", "NAIVE_WORLD_SIZES", "READY_MADE", "RING_CASES", "TIMEOUT_SECONDS", "AllReduceGuard",
           "check_naive_allreduce", "check_ring_allreduce", "drawn_input", "naive_cases", "rank_input", "ring_cases"]

TIMEOUT_SECONDS = 10.0  # per case; a right solution needs milliseconds, so a wait this long is a hang
# Three ranks first: on two, left and right are the same rank, and so are hub and leaf.
NAIVE_WORLD_SIZES = (3, 2, 4, 4)
NAIVE_LARGEST = 12  # the naive cases' sizes: distinct, drawn from 1..12 (a solution sized for one of them fails)
# (world_size, what N does to the size): sizes N divides first, then not (a few chunks one longer), then fewer
# elements than ranks (empty chunks)
RING_CASES = [(3, "divides"), (2, "divides"), (4, "divides"), (3, "not"), (2, "not"), (4, "not"), (4, "fewer")]
_DRAW = random.SystemRandom()  # not the student's random.seed: a seeded notebook must not fix the grader's draws
DTYPES = (torch.float32, torch.float64, torch.float16)  # what t may be: a solution must not depend on it
_CALLS = 2  # calls of the student's function per case, each on new values: a result kept from a call fails the next
_LARGEST_INPUT = 100  # inputs are whole numbers 1..100: every sum of them (4 ranks, even added twice) is exact in
# float16 (exact to 2048), in any order of addition, so a right answer is exactly right whatever the algorithm
# READY_MADE: labkit.comm's helpers that do the exercise; each refuses itself while graded (labkit._refusals), in
# any thread or subprocess, where the guard's switched-off transport would not see it
READY_MADE = tuple(f"labkit.comm's {name}" for name in (
    "naive_allreduce", "ring_allreduce", "tree_allreduce", "ring_reduce_scatter", "ring_allgather", "broadcast",
    "reduce"))
_POINT_TO_POINT = "dist.send/dist.recv (or dist.isend/dist.irecv, dist.batch_isend_irecv)"


def naive_cases() -> list[Case]:
    """The hub's cases, drawn afresh: distinct sizes, every dtype of DTYPES at least once, a seed for the values."""
    sizes = _DRAW.sample(range(1, NAIVE_LARGEST + 1), len(NAIVE_WORLD_SIZES))
    return [_case(n, numel, dtype) for n, numel, dtype in zip(NAIVE_WORLD_SIZES, sizes, _dtypes(len(sizes)),
                                                                strict=True)]


def ring_cases() -> list[Case]:
    """The ring's cases, drawn afresh (RING_CASES): sizes of 1 to 3 chunks per rank, every dtype at least once."""
    def size(n: int, kind: str) -> int:
        if kind == "fewer":
            return _DRAW.randint(1, n - 1)
        return n * _DRAW.randint(1, 3) + (0 if kind == "divides" else _DRAW.randint(1, n - 1))

    dtypes = _dtypes(len(RING_CASES))
    return [_case(n, size(n, kind), dtype) for (n, kind), dtype in zip(RING_CASES, dtypes, strict=True)]


def _dtypes(count: int) -> list:
    """`count` dtypes in a random order, each of DTYPES at least once."""
    dtypes = list(DTYPES) + [_DRAW.choice(DTYPES) for _ in range(count - len(DTYPES))]
    _DRAW.shuffle(dtypes)
    return dtypes


def _case(world_size: int, numel: int, dtype) -> Case:
    return Case(world_size, {"numel": numel, "dtype": dtype, "seed": _DRAW.randrange(1 << 62)})


# ==== on a rank: the inputs, the guard, the attempt ================================================================

def rank_input(rank: int, numel: int, device=None) -> torch.Tensor:
    """Rank r's input: (r + 1) x [1, 2, ..., numel]. Distinct per rank, so every mistake shows.

    >>> rank_input(1, 3)
    tensor([2., 4., 6.])
    """
    rank, numel = whole("rank", rank, minimum=0), whole("numel", numel, minimum=0)
    return (rank + 1) * torch.arange(1.0, numel + 1, device=device)


def drawn_input(seed: int, rank: int, numel: int, dtype: torch.dtype = torch.float32, call: int = 0,
                device=None) -> torch.Tensor:
    """Rank r's input on call `call` of one case: whole numbers 1..100 drawn from `seed`, which the grader draws
    afresh for each case (so no solution can recompute another rank's input), in `dtype`.

    Positive, so that no mistake hides behind a zero (an input added twice changes every element); whole, so that
    every sum of them is exact in each of DTYPES."""
    generator = torch.Generator().manual_seed(hash((seed, rank, call)) & 0x7FFF_FFFF_FFFF_FFFF)
    drawn = torch.randint(1, _LARGEST_INPUT + 1, (numel,), generator=generator)
    return drawn.to(dtype=dtype, device=device)


class WrongDtype(RuntimeError):
    """Raised on a rank, before the message is posted, when graded code sends or receives a tensor of another dtype
    than t's (gloo would kill the receiving rank over the size mismatch). Its arguments: ("send" or "recv", peer,
    the message's dtype, t's dtype), read by the grader from a rank's Failure."""

    def __str__(self) -> str:
        verb, peer, got, wanted = self.args
        return f"a {verb} {'to' if verb == 'send' else 'from'} rank {peer} of a {got} tensor, but t is {wanted}"


class AllReduceGuard(Guard):
    """While graded code runs on a rank: every collective (labkit.comm's transport too) off, point-to-point
    messages counted (module docstring), in ProcessGroup.send and ProcessGroup.recv, once per message."""

    def __init__(self, keep_values: bool = False, dtype: torch.dtype | None = None):
        """`keep_values`: copy what each send carries into `sent_values` (the graders check contents, not only
        sizes); `dtype`: the dtype every message must have (t's), else WrongDtype before it is posted."""
        super().__init__()
        self.keep_values, self.dtype = keep_values, dtype
        self.recorder = Recorder()  # every message as the kit's Call (peer, bytes, values kept), with its handle
        self.sends: list[tuple[int, int]] = []
        self.recvs: list[tuple[int, int]] = []
        self.posted = self.recorder.works  # (handle, Call) per watched message, kept alive
        self.posts: list[tuple] = []  # the messages as NCCL would run them: groups of ("send"/"recv", peer)
        self._batch = None  # the frame of the dist.batch_isend_irecv call that posted the last message

    def install(self) -> None:
        """Every collective (labkit.comm's too) off, send and recv counted."""
        from labkit.comm.torch_transport import TorchTransport

        self.on_exit(setattr, self, "_batch", None)
        self.switch_off_torch_distributed(point_to_point=True)
        for name in ("_post_send", "_post_recv"):
            self.switch_off(TorchTransport, name, "a labkit.comm collective")
        self._count(self.sends, Kind.SEND)
        self._count(self.recvs, Kind.RECV)

    def _count(self, messages: list[tuple[int, int]], kind: Kind) -> None:
        """Record (peer, nbytes) for each ProcessGroup.send or .recv (tensors, peer, tag), then post it."""
        def counted(call: GroupCall):
            peer, tensors = int(call.args[1]), call.tensors
            wrong = next((t.dtype for t in tensors if self.dtype is not None and t.dtype != self.dtype), None)
            if wrong is not None:
                raise WrongDtype(str(kind), peer, str(wrong).removeprefix("torch."),
                                 str(self.dtype).removeprefix("torch."))
            messages.append((peer, sum(t.numel() * t.element_size() for t in tensors)))
            # kept in the last-attempt store too (after an error the grader reads what was posted); a send's values
            # copied now, as the algorithm had them when it sent
            record = self.recorder.record(call, keep_values=self.keep_values and kind == Kind.SEND)
            batch = _batch_call()
            self._note_post(str(kind), peer, batch)
            work = call.proceed()
            if not (tensors[0].is_cuda and batch is not None):
                self.recorder.launched(work, record)
            return work

        wrap_group_method(self, kind, counted)

    def _note_post(self, verb: str, peer: int, batch) -> None:
        """Add a message to `posts`: to the last group if it comes from the same dist.batch_isend_irecv call
        (`batch`, that call's frame, kept so that a later call cannot take its identity), else as a group of
        its own (NCCL runs an unbatched send or receive as one operation on the stream)."""
        if batch is not None and batch is self._batch:
            self.posts[-1] += ((verb, peer),)
        else:
            self.posts.append(((verb, peer),))
        self._batch = batch

    def watch_waits(self) -> None:
        """From now until the guard ends, note which posted messages' handles graded code waits for, however it
        waits (the kit's WaitWatch: wait(), is_completed(), the handle's future)."""
        WaitWatch(self.posted).install(self)

    def unwaited(self) -> list[tuple[str, int]]:
        """("send" or "recv", peer) of each posted message whose handle graded code never waited for."""
        return [(str(message.kind), message.peer) for _, message in self.posted if not message.waited]

    @property
    def sent_values(self) -> list[list[float]]:
        """The values each send carried, in order (with keep_values)."""
        return [call.values for call in self.recorder.calls if call.kind == Kind.SEND and call.values is not None]


def _batch_call():
    """The frame of the dist.batch_isend_irecv call on this thread's stack, or None. Its messages are one group
    (on NCCL one ncclGroupStart/End, and one handle, the one it returns: the handles of the single messages are
    torch's, not graded code's)."""
    frame = sys._getframe(2)
    while frame is not None and not (frame.f_code.co_name == "batch_isend_irecv"
                                     and frame.f_code.co_filename.endswith("distributed_c10d.py")):
        frame = frame.f_back
    return frame


_last_handles: list = []  # on a rank: the last graded call's message handles, kept until the next call


def _attempt(fn, case: Case) -> list[Outcome]:
    """On a rank: call fn _CALLS times, each on new drawn values of the case's size and dtype, under a fresh guard
    (the kit's runner has labkit.comm's ready-made helpers refuse themselves meanwhile, READY_MADE); what each call
    left, for the grader."""
    return [_attempt_once(fn, case, call) for call in range(_CALLS)]


def _attempt_once(fn, case: Case, call: int) -> Outcome:
    """One call of fn on this rank's input for call `call` of `case` (numel, dtype and seed drawn)."""
    global _last_handles
    t = drawn_input(case["seed"], labkit.rank(), case["numel"], case["dtype"], call, device=labkit.device())
    memory = t.data_ptr()
    guard = AllReduceGuard(keep_values=True, dtype=t.dtype)
    try:
        with guard:
            guard.watch_waits()
            returned = fn(t)
    finally:
        _last_handles = [work for work, _ in guard.posted]  # an unwaited message still arrives
    if isinstance(returned, torch.Tensor) and returned is not t:
        returned = returned.detach().double().tolist()
    else:
        returned = None
    return Outcome(t.double().tolist(), returned, t.data_ptr() == memory, guard.sends, guard.recvs, guard.forbidden,
                   guard.unwaited(), guard.posts, guard.sent_values)


# ==== the grading: the checks of what each rank's calls left, and the messages =====================================


@graded("naive_allreduce")
def check_naive_allreduce(fn, *, timeout_seconds: float = TIMEOUT_SECONDS) -> Verdict:
    """Grade `fn(t)`: an AllReduce (sum, in place) through the hub, rank 0, built from send and recv."""
    return grade(NAIVE_SPEC, fn, timeout_seconds=timeout_seconds)


@graded("ring_allreduce")
def check_ring_allreduce(fn, *, timeout_seconds: float = TIMEOUT_SECONDS) -> Verdict:
    """Grade `fn(t)`: a ring AllReduce (sum, in place) from send/recv, also on sizes that N does not divide.

    In a ring every rank sends only to its right neighbour, rank + 1: one chunk per step, 2(N-1) steps."""
    return grade(RING_SPEC, fn, timeout_seconds=timeout_seconds)


def _passed(what: str, how: str):
    """The verdict of a pass: what was checked, then how the algorithm moved its data."""
    dtypes = ", ".join(sorted(str(d).removeprefix("torch.") for d in DTYPES))
    return lambda cases: (f"{what} gives torch.distributed.all_reduce's answer on 2, 3 and 4 ranks, for sizes that N "
                          f"divides and sizes it does not, in {dtypes}, called twice on new values each time, and "
                          f"its messages carried what the algorithm sends. {how}")


def _describe(case: Case) -> str:
    """How a verdict starts: 'On 3 ranks with a tensor of 7 float64 elements (S = 56 bytes)'."""
    numel, dtype = case["numel"], case["dtype"]
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    return f"On {case.world_size} ranks with a tensor of {numel} {str(dtype).removeprefix('torch.')} elements " \
           f"(S = {nbytes} bytes)"


def _by_call(outcomes: list[list]) -> list[list]:
    """Each rank's outcomes per call (the attempt's list) as calls[k][rank]."""
    return [list(call) for call in zip(*outcomes, strict=True)]


def _unwaited_check(outcomes: list[list], case: Case) -> str | None:
    """A handle never waited, on any call: said, and the pool stopped, whatever its messages did."""
    problem = next(filter(None, map(_unwaited_message, _by_call(outcomes))), None)
    if problem:
        labkit.shutdown(world_size=case.world_size)
    return problem


def _calls_check(outcomes: list[list], case: Case, ring: bool) -> str | None:
    """Each call in turn: its values, its traffic, then what its messages carried. A wrong call may leave messages
    that nobody received: then the pool is stopped, or the next case's receives would take them."""
    earlier = None  # the sum the first call gave
    for index, by_rank in enumerate(_by_call(outcomes)):
        inputs = [drawn_input(case["seed"], r, case["numel"], case["dtype"], index) for r in range(case.world_size)]
        problem = _call_problem(by_rank, inputs, ring, earlier)
        if problem:
            _stop_pool_if_unmatched(case.world_size, [(o.sends, o.recvs) for o in by_rank])
            again = "" if index == 0 else ("on its second call (new values in t, the same size and dtype; the "
                                           "first call was right), ")
            return again + problem
        earlier = sum(x.double() for x in inputs)
    return None


def _order_check(outcomes: list[list], case: Case, ring: bool) -> str | None:
    """Whether the first call's messages, in the order each rank posted them, would also complete on NCCL. The
    spec's final check: told once every case is right on gloo (a problem gloo shows, in a later case, is the one
    to fix first), from the first case it shows in."""
    return _nccl_order_message([o.posts for o in _by_call(outcomes)[0]], ring)


def _call_problem(outcomes: list, inputs: list, ring: bool, earlier) -> str | None:
    """One call on every rank: its values, its traffic, then what its messages carried."""
    numel, element_size = inputs[0].numel(), inputs[0].element_size()
    traffic, contents = (ring_traffic, ring_contents) if ring else (hub_traffic, hub_contents)
    return (wrong_values(outcomes, inputs, ring, earlier) or traffic(outcomes, numel, element_size)
            or contents(outcomes, inputs))


def _on_error(error: labkit.RankError, attempts: list[LastAttempt] | None, case: Case) -> str:
    """A call that raised: a message of the wrong dtype (the pool is stopped: raised inside a
    dist.batch_isend_irecv, it leaves the group coalescing), else the first rank's own error. Messages the ranks
    left unmatched (read from their last attempts) stop the pool too."""
    wrong = next((f for f in sorted(error.failures, key=lambda f: (f.time, f.rank)) if f.raised(WrongDtype)), None)
    if wrong is not None:
        labkit.shutdown(world_size=case.world_size)
        return _dtype_message(wrong.rank, *wrong.exception_args)
    if attempts is not None:
        _stop_pool_if_unmatched(case.world_size, [_messages_of(attempt) for attempt in attempts])
    first, _ = first_failure(error)
    return failure_sentence(first)


def _messages_of(attempt: LastAttempt) -> tuple[list, list]:
    """A rank's (sends, recvs) as (peer, nbytes), from its last attempt's records."""
    return tuple([(call.peer, call.nbytes) for call in attempt.calls if call.kind == kind]
                 for kind in (Kind.SEND, Kind.RECV))


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
        labkit.shutdown(world_size=world_size)


def _hang_message(hang: labkit.RankTimeout, case: Case, timeout_seconds: float, ring: bool) -> str:
    """A call that never finished: how sends and receives deadlock, and where the first ranks waited."""
    agree = "the same neighbours: left and right" if ring else "the same hub, rank 0"
    return hang_message(hang, timeout_seconds, "some rank waited for a message that never came. Every send needs a "
                        "matching recv on the other rank, in an order that cannot leave ranks all waiting: a blocking "
                        f"dist.send waits for its recv. {_SAFE_ORDER} Do all ranks agree on {agree}?")


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


def _dtype_message(rank: int, verb: str, peer: int, got: str, wanted: str) -> str:
    """A message of another dtype than t's (WrongDtype), stopped by the guard before gloo took it."""
    way = "sent a" if verb == "send" else "received into a"
    return (f"rank {rank} {way} {got} tensor ({'to' if verb == 'send' else 'from'} rank {peer}), but t is {wanted}: "
            "every message of an AllReduce carries t's own dtype (gloo kills a rank whose receive does not fit the "
            "message). A buffer made with torch.empty(n) or torch.zeros(n) is float32 whatever t is: make it with "
            "torch.empty_like(...) of a chunk of t, or pass dtype=t.dtype and device=t.device. Does your solution "
            "work for every dtype, not only float32?")


def _why_forbidden(spelling: str, name: str) -> str:
    """Why the call `spelling` (function `name`) is switched off while an AllReduce is graded, and what instead."""
    if "labkit.comm" in spelling:
        return ("labkit.comm's collectives (ring_allreduce, naive_allreduce, tree_allreduce, and the reduce-scatter, "
                "all-gather, reduce and broadcast they are made of) are the course's own answer, switched off while "
                f"it is graded, in every thread; this exercise is to write one yourself, from {_POINT_TO_POINT}.")
    if name.startswith("recv_any"):
        return ("A dist.recv without src takes a message from whichever rank sends first, not from the rank the "
                "algorithm expects.")
    if name in ("send_object_list", "recv_object_list"):
        return ("It sends a pickled Python object in two messages (its size, then its bytes); send the tensor "
                "itself with dist.send or dist.isend.")
    return (f"That is a ready-made collective, which does the exercise for you. Build the AllReduce from "
            f"{_POINT_TO_POINT}: torch's collectives and labkit.comm's are switched off while it is graded.")


def _spec(ring: bool) -> Spec:
    """The hub's or the ring's grading, for the kit's runner (labkit.exercises._kit._runner)."""
    what, how = (("your ring AllReduce", "Every rank sent only to its right neighbour, 2(N-1) messages of one chunk "
                  "each: 2(N-1)/N x S bytes, the ring's traffic, whatever N.") if ring else
                 ("your naive AllReduce", "Every message had rank 0 at one end: each rank sent its tensor to rank 0 "
                  "once and got the sum back into t, in place."))
    return Spec(
        attempt=_attempt, cases=ring_cases if ring else naive_cases,
        checks=(_unwaited_check, functools.partial(_calls_check, ring=ring)),
        final_checks=(functools.partial(_order_check, ring=ring),),
        describe=_describe, why_forbidden=_why_forbidden,
        on_hang=functools.partial(_hang_message, ring=ring), on_error=_on_error, passed=_passed(what, how),
        example=f"check_{'ring' if ring else 'naive'}_allreduce(my_allreduce)", ready_made=READY_MADE)


NAIVE_SPEC, RING_SPEC = _spec(ring=False), _spec(ring=True)
