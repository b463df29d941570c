"""On a rank, while a grader runs the student's AllReduce: its input, the guard, and what the call left behind.

While `fn` runs, a guard is on in each rank, and always removed afterwards (try/finally), even when `fn`
raises, or is interrupted after a hang (a rank that does not stop is killed with its pool). It replaces,
for the whole process: torch.distributed's collective functions (in `torch.distributed` and in
`torch.distributed.distributed_c10d`), the collective methods of the ProcessGroup and Backend classes (so
`dist.group.WORLD.allreduce` too), every c10d operator under torch.ops (`torch.ops.c10d.allreduce_`,
functional collectives), and labkit.comm's transport. They raise `ForbiddenCall`, which is reported even
if `fn` catches it. Messages are counted in ProcessGroup.send and ProcessGroup.recv, where dist.send,
dist.isend and dist.batch_isend_irecv all arrive, once per message, with a copy of what each send carries
(`Guard(keep_values=True)`) and t's dtype enforced (`Guard(dtype=...)`: a message of another dtype raises
WrongDtype before it is posted, where gloo would kill the receiving rank). Data moved any other way (the
rendezvous store, files, sockets) is not counted, so such a solution fails the traffic check, or, if it sends
the right messages from a scratch copy, the check of what they carried. labkit.comm's ready-made collectives
refuse themselves while graded (`READY_MADE`, labkit._refusals), in any thread. The handle
each message returns is kept (a dropped, unwaited isend can lose its message on gloo, and the run then hangs)
and, in `attempt`, watched: a dist.isend or dist.irecv whose handle graded code never waited is reported. The
messages are also kept in the order NCCL would run them (`Outcome.posts`: one group per dist.batch_isend_irecv
call, one per message posted on its own), for labkit.comm.stream_model to say whether they would hang on NCCL.

Graded code may import parts of torch for the first time while the guard is on (its first torch.optim step
imports torch._dynamo, and through it FSDP and DTensor). Those imports work: torch's functional collectives,
which register autograd formulas on the c10d operators when imported (that needs the operators themselves), are
imported before the guard goes on; a replaced operator still has its schema and its overloads (`.default`, which
refuse to be called too), and refuses only to be called; and what a module imported under the guard binds
(DTensor binds dist.broadcast) calls the original once the guard is off.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field

import torch

import labkit
from labkit._refusals import ForbiddenCall
from labkit.checks import whole
from labkit.exercises._kit import _store
from labkit.exercises._kit._group_call import GroupCall, Kind, wrap_group_method
from labkit.exercises._kit._intercept import Interceptor, RefusedOperator
from labkit.exercises._kit._messages import (
    first_failure,
    forbidden_message,
    forbidden_spelling,
    where_ranks_waited,
)
from labkit.exercises._kit._record import Recorder
from labkit.exercises._kit._wait_watch import WaitWatch

__all__ = ["CALLS", "DTYPES", "POINT_TO_POINT", "READY_MADE", "ForbiddenCall", "Guard", "Outcome",
           "RefusedOperator", "WrongDtype", "attempt", "drawn_input", "first_failure", "forbidden_message",
           "forbidden_spelling", "rank_input", "stop_pool", "where_ranks_waited"]

POINT_TO_POINT = "dist.send/dist.recv (or dist.isend/dist.irecv, dist.batch_isend_irecv)"

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
_POINT_TO_POINT_FUNCTIONS = ("send", "recv", "isend", "irecv", "batch_isend_irecv")  # switched off where not taught
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
# What torch imports lazily and which, on import, looks up the c10d operators (torch.library.register_autograd
# reads each one's .default) and keeps them (torch.fx.node.has_side_effect): imported before the guard goes on,
# so that it keeps the operators themselves, not the guard's stand-ins.
_IMPORTED_FIRST = ("torch.distributed._functional_collectives",)


def rank_input(rank: int, numel: int, device=None) -> torch.Tensor:
    """Rank r's input: (r + 1) x [1, 2, ..., numel]. Distinct per rank, so every mistake shows.

    >>> rank_input(1, 3)
    tensor([2., 4., 6.])
    """
    rank, numel = whole("rank", rank, minimum=0), whole("numel", numel, minimum=0)
    return (rank + 1) * torch.arange(1.0, numel + 1, device=device)


DTYPES = (torch.float32, torch.float64, torch.float16)  # what t may be: a solution must not depend on it
CALLS = 2  # calls of the student's function per case, each on new values: a result kept from a call fails the next
_LARGEST_INPUT = 100  # inputs are whole numbers 1..100: every sum of them (4 ranks, even added twice) is exact in
# float16 (exact to 2048), in any order of addition, so a right answer is exactly right whatever the algorithm
# READY_MADE: labkit.comm's helpers that do the exercise; each refuses itself while graded (labkit._refusals), in
# any thread or subprocess, where the guard's switched-off transport would not see it
READY_MADE = tuple(f"labkit.comm's {name}" for name in (
    "naive_allreduce", "ring_allreduce", "tree_allreduce", "ring_reduce_scatter", "ring_allgather", "broadcast",
    "reduce"))


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


def stop_pool(world_size: int) -> None:
    """Stop the pool of `world_size` ranks, whose collectives are out of step after a wrong answer (a call left
    waiting), and only it (labkit.shutdown(world_size=...)): the next call starts a fresh one."""
    labkit.shutdown(world_size=world_size)


@dataclass
class Outcome:
    """What one rank's call left behind: t's values, what fn returned, and every message it posted (with the values
    each send carried, `sent_values`, copied as it was posted)."""

    tensor: list[float]
    returned: list | None  # a tensor fn returned other than t, as a list
    same_memory: bool  # t still uses the memory it came in
    sends: list[tuple[int, int]] = field(default_factory=list)  # (dst, nbytes) per message, in order
    recvs: list[tuple[int, int]] = field(default_factory=list)  # (src, nbytes)
    forbidden: list[str] = field(default_factory=list)  # what it called that is switched off
    unwaited: list[tuple[str, int]] = field(default_factory=list)  # ("send" or "recv", peer) never waited
    posts: list[tuple] = field(default_factory=list)  # groups of ("send"/"recv", peer) as NCCL runs them
    sent_values: list[list[float]] = field(default_factory=list)  # per send, in order: the values it carried


@dataclass
class Guard(Interceptor):
    """While graded code runs on a rank: collectives raise, point-to-point messages are counted.

    Everything is replaced where Python looks it up, for the whole process (threads too): torch.distributed's
    functions, the ProcessGroup and Backend classes' methods, the c10d operators under torch.ops, and
    labkit.comm's transport. Messages are counted in ProcessGroup.send and ProcessGroup.recv, where
    dist.send, dist.isend and dist.batch_isend_irecv all arrive, once per message. An `Interceptor`: what
    `install` (extended by each grader's guard) replaces is put back when the `with` ends, however it ends."""

    def __init__(self, keep_values: bool = False, dtype: torch.dtype | None = None):
        """`keep_values`: copy what each send carries into `sent_values` (the AllReduce graders check contents, not
        only sizes); `dtype`: the dtype every message must have (t's), else WrongDtype before it is posted."""
        super().__init__()
        self.keep_values, self.dtype = keep_values, dtype
        self.recorder = Recorder()  # every message as the kit's Call (peer, bytes, values kept), with its handle
        self.sends: list[tuple[int, int]] = []
        self.recvs: list[tuple[int, int]] = []
        self.forbidden: list[str] = []
        self.posted = self.recorder.works  # (handle, Call) per watched message, kept alive
        self.posts: list[tuple] = []  # the messages as NCCL would run them: groups of ("send"/"recv", peer)
        self._batch = None  # the frame of the dist.batch_isend_irecv call that posted the last message

    def install(self) -> None:
        """The ring grader's guard: every collective (labkit.comm's too) off, send and recv counted."""
        super().install()
        self.on_exit(setattr, self, "_batch", None)
        self._switch_off_collectives()
        self._count(self.sends, Kind.SEND)
        self._count(self.recvs, Kind.RECV)

    def refuse(self, spelling: str):
        """Note that graded code called `spelling`, and raise ForbiddenCall (reported even if it is caught)."""
        self.forbidden.append(spelling)
        _store.refused(spelling)
        raise ForbiddenCall(spelling)

    def _switch_off_collectives(self) -> None:
        from labkit.comm.torch_transport import TorchTransport

        self.switch_off_torch_distributed()
        for name in ("_post_send", "_post_recv"):
            self.switch_off(TorchTransport, name, "a labkit.comm collective")

    def switch_off_torch_distributed(self, allowed: tuple[str, ...] = (), point_to_point: bool = True) -> None:
        """Make every way into torch.distributed's communication raise ForbiddenCall: its functions, the process
        group's and its backend's methods, and every c10d operator of torch.ops. An exercise leaves on the
        functions and ProcessGroup methods it teaches, by name (`allowed`, e.g. ("all_reduce", "allreduce")), and
        send/recv unless `point_to_point` is False."""
        functions = [name for name in (*_TORCH_FUNCTIONS, *(() if point_to_point else _POINT_TO_POINT_FUNCTIONS))
                     if name not in allowed]
        group_methods = [name for name in (*_GROUP_METHODS, *(() if point_to_point else ("send", "recv")))
                         if name not in allowed]
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        for module in _IMPORTED_FIRST:
            importlib.import_module(module)
        for module, prefix in ((dist, "torch.distributed"), (distributed_c10d, "torch.distributed.distributed_c10d")):
            for name in functions:
                self.switch_off(module, name, f"{prefix}.{name}")
        for name in group_methods:
            self.switch_off(dist.ProcessGroup, name, f"ProcessGroup.{name} (as in dist.group.WORLD.{name})")
        for name in _BACKEND_METHODS:
            self.switch_off(torch._C._distributed_c10d.Backend, name, f"the process group's backend's {name}")
        for qualified in torch._C._dispatch_get_all_op_names():  # "c10d::allreduce_", "_c10d_functional::..."
            namespace, _, name = qualified.partition("::")
            if "c10d" in namespace:
                self.switch_off(getattr(torch.ops, namespace), name, f"torch.ops.{namespace}.{name}", operator=True)

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
        waits (labkit.exercises._kit._wait_watch.WaitWatch: wait(), is_completed(), the handle's future)."""
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


def attempt(fn, case) -> list[Outcome]:
    """On a rank: call fn CALLS times, each on new drawn values of the case's size and dtype, under a fresh guard
    (the kit's runner has labkit.comm's ready-made helpers refuse themselves meanwhile, READY_MADE); what each call
    left, for the grader."""
    return [_attempt_once(fn, case, call) for call in range(CALLS)]


def _attempt_once(fn, case, call: int) -> Outcome:
    """One call of fn on this rank's input for call `call` of `case` (a labkit.exercises._kit._runner.Case with
    numel, dtype and seed drawn)."""
    global _last_handles
    t = drawn_input(case["seed"], labkit.rank(), case["numel"], case["dtype"], call, device=labkit.device())
    memory = t.data_ptr()
    guard = Guard(keep_values=True, dtype=t.dtype)
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
