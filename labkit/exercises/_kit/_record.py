"""One record of a call graded code made on a process group, for every grader: `Call`, and the `Recorder` that
makes them.

A guard's callback (labkit.exercises._kit._group_call) sees each ProcessGroup call as a `GroupCall`; the
recorder turns it into a `Call`, keeps its work handle for the wait watcher (_kit/_wait_watch.py), and puts it
in the last-attempt store (labkit.exercises._kit._store) as it is made, so a run that raises still says what
each rank had made. What one grader alone needs about a call (which operator made it, whether backward() was
running) goes in `facts`, named by that grader.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from labkit.exercises._kit import _store
from labkit.exercises._kit._group_call import GroupCall, Kind, flat_tensors

__all__: list[str] = []

_REDUCING = (Kind.ALLREDUCE, Kind.REDUCE_SCATTER, Kind.REDUCE_SCATTER_SINGLE, Kind.REDUCE_SCATTER_BASE)
_POINT_TO_POINT = (Kind.SEND, Kind.RECV)
_SCATTERING = (Kind.REDUCE_SCATTER, Kind.REDUCE_SCATTER_SINGLE, Kind.REDUCE_SCATTER_BASE)  # output: this rank's slice


@dataclass
class Call:
    """One call of a ProcessGroup method: its kind, size, op (reductions only), peer (send and recv only), what
    its tensor is in the grader's words (`target`: "grad", "data", "bucket", ...), whether graded code waited for
    it (a blocking call waits itself; the wait watcher sets it for the others) and took its future, and the
    values this rank put in when the grader keeps them (`values`, to check what was sent, not only how much)."""

    kind: Kind
    numel: int = 0
    nbytes: int = 0
    op: str | None = None
    peer: int | None = None
    target: str | None = None
    waited: bool = True
    future: bool = False
    values: list[float] | None = None
    facts: dict[str, object] = field(default_factory=dict)

    @classmethod
    def of(cls, made: GroupCall, keep_values: bool = False, **fields) -> Call:
        """The record of `made` (before it is made: `values` are what this rank puts in), with `fields` set. A
        reduce-scatter's size is its input's, which every rank shares (its output is this rank's slice alone)."""
        tensors = flat_tensors(made.args[1]) if made.kind in _SCATTERING and len(made.args) > 1 else made.tensors
        numel = sum(t.numel() for t in tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        values = _values(tensors) if keep_values else None
        peer = made.args[1] if made.kind in _POINT_TO_POINT and len(made.args) > 1 else None
        op = made.reduce_op if made.kind in _REDUCING else None
        return cls(made.kind, numel, nbytes, op, peer, waited=not made.asynchronous, values=values, **fields)

    @property
    def signature(self) -> tuple[str, int] | None:
        """What the ranks must agree on for a collective to match: its kind and size (None for a send or recv,
        whose peer makes the other half)."""
        return None if self.kind in _POINT_TO_POINT else (str(self.kind), self.numel)


def _values(tensors: list[torch.Tensor]) -> list[float]:
    """The tensors' values in order, as floats, copied now (the call may change them)."""
    return [x for t in tensors for x in t.detach().reshape(-1).to("cpu", torch.float64).tolist()]


class Recorder:
    """The calls one guard records, with their work handles (`works`, (handle, call) pairs for the wait watcher);
    each also goes to the last-attempt store as it is made."""

    def __init__(self):
        self.calls: list[Call] = []
        self.works: list[tuple[object, Call]] = []

    def record(self, made: GroupCall, keep_values: bool = False, **fields) -> Call:
        """A `Call` for `made`, kept here and in the store; not yet made (call `launched` with its handle)."""
        call = Call.of(made, keep_values, **fields)
        self.calls.append(call)
        _store.add(call)
        return call

    def watch_waits(self, interceptor) -> None:
        """Mark a call waited only when graded code waits for its handle or its future (WaitWatch), for the
        interceptor's time: call it in the guard's install."""
        from labkit.exercises._kit._wait_watch import WaitWatch

        WaitWatch(self.works).install(interceptor)

    def launched(self, work, call: Call):
        """Keep `work`, the handle of `call`, for the wait watcher; returns it, for the callback to return."""
        if work is not None:
            self.works.append((work, call))
        return work

    def unwaited(self) -> list[Call]:
        """The calls whose handle graded code never waited for; they are waited for now (with Work's own wait), so
        the ranks stay in step for the next case."""
        import torch.distributed as dist

        left = [(work, call) for work, call in self.works if not call.waited]
        for work, _ in left:
            vars(dist.Work)["wait"](work)
        return [call for _, call in left]
