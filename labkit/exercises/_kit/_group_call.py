"""One wrapper of ProcessGroup methods for every grader: `wrap_group_method(interceptor, kind, callback)`.

Every dist.* collective and point-to-point call arrives at a method of the ProcessGroup (dist.all_reduce at
ProcessGroup.allreduce, dist.isend at ProcessGroup.send, ...), in one of its overloads: (tensors, opts),
(tensors, op), (tensor, op), (outputs, inputs, opts), (tensors, peer, tag). The callback sees one `GroupCall`,
which reads them one way: its kind, its tensors, its options object (the argument that has `asyncOp`, if any),
whether it is asynchronous (the options' asyncOp, else what a default options object says) and its reduce op
(the options' reduceOp, else a ReduceOp passed by itself, else SUM, the default of every reducing overload).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from labkit.launch.protocol import TextEnum  # enum.StrEnum, for Python 3.10 too

__all__: list[str] = []


class Kind(TextEnum):
    """A ProcessGroup method a grader watches. Convention: the member's value is the method's name on
    torch.distributed.ProcessGroup (so `getattr(ProcessGroup, kind)` is the method), its name that in capitals,
    leading underscore dropped."""

    ALLREDUCE = "allreduce"
    BROADCAST = "broadcast"
    BARRIER = "barrier"
    SEND = "send"
    RECV = "recv"
    ALLGATHER = "allgather"
    ALL_GATHER_SINGLE = "all_gather_single"
    ALLGATHER_BASE = "_allgather_base"
    REDUCE_SCATTER = "reduce_scatter"
    REDUCE_SCATTER_SINGLE = "reduce_scatter_single"
    REDUCE_SCATTER_BASE = "_reduce_scatter_base"


_REDUCE_OPS = ("SUM", "AVG", "MAX", "MIN", "PRODUCT", "BAND", "BOR", "BXOR", "PREMUL_SUM")


@dataclass
class GroupCall:
    """One call of a ProcessGroup method, as a grader's callback sees it: `proceed()` makes it (once, with its own
    arguments), `original` is the method below the wrapper, for calls of the grader's own."""

    kind: Kind
    group: object
    args: tuple
    kwargs: dict
    original: Callable

    def proceed(self):
        """Make the call as it was made; its work handle (or None)."""
        return self.original(self.group, *self.args, **self.kwargs)

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The tensors of its first argument (the tensors, or a gather's outputs), in order."""
        return flat_tensors(self.args[0]) if self.args else []

    @property
    def tensor(self) -> torch.Tensor | None:
        """Its first tensor, or None (a barrier)."""
        return next(iter(self.tensors), None)

    @property
    def options(self):
        """Its options object (AllreduceOptions, BroadcastOptions, ...): the argument with an `asyncOp`; or None."""
        return next((a for a in (*self.args, *self.kwargs.values()) if hasattr(a, "asyncOp")), None)

    @property
    def asynchronous(self) -> bool:
        """Whether it returns at once, its handle to be waited: the options' asyncOp, else the default options'
        (True: a ProcessGroup method called without options, or send and recv, always is)."""
        return bool(getattr(self.options, "asyncOp", _DEFAULT_ASYNC))

    @property
    def reduce_op(self) -> str:
        """'SUM', 'MAX', ...: the options' reduceOp, else a ReduceOp passed by itself, else SUM (the default)."""
        import torch.distributed as dist

        if self.options is not None:
            return op_name(getattr(self.options, "reduceOp", None))
        passed = (*self.args, *self.kwargs.values())
        given = (a for a in passed if isinstance(a, dist.ReduceOp.RedOpType | dist.ReduceOp))
        return op_name(next(given, dist.ReduceOp.SUM))


_DEFAULT_ASYNC = True  # torch.distributed's *Options() objects start with asyncOp True


def op_name(op) -> str:
    """'SUM', 'MAX', ...: the name of a ReduceOp (or of its RedOpType); str(op) for another value."""
    import torch.distributed as dist

    return next((name for name in _REDUCE_OPS if op == getattr(dist.ReduceOp, name)), str(op))


def flat_tensors(value) -> list[torch.Tensor]:
    """The tensors in a tensor or a (nested) list of them, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for item in value for t in flat_tensors(item)]
    return []


def wrap_group_method(interceptor, kind: Kind, callback: Callable[[GroupCall], object]) -> None:
    """ProcessGroup.`kind` replaced, for the interceptor's time, by a method that hands each call to
    callback(GroupCall) and returns what it returns: the callback records, refuses or checks the call, makes it
    with `call.proceed()` and returns the work handle."""
    import torch.distributed as dist

    def make(original):
        def wrapped(group, *args, **kwargs):
            return callback(GroupCall(Kind(kind), group, args, kwargs, original))
        return wrapped

    interceptor.wrap(dist.ProcessGroup, str(kind), make)
