"""Every collective this rank makes, torch's own included: count_collectives() sees labkit.parallel's only, and
torch's ZeroRedundancyOptimizer, for one, broadcasts each parameter from the rank that updated it out of sight.

    count_torch_collectives()     a Traffic (calls and nbytes by kind) of every c10d collective dispatched inside
                                  the block on this rank, whoever called it: labkit, torch.distributed's functions,
                                  torch.distributed.optim, FSDP2

How: torch.distributed's functions reach the backend through c10d operators (c10d.allreduce_, c10d.broadcast_, ...)
that run through PyTorch's dispatcher, where a TorchDispatchMode sees each one with its tensors; torch's own
CommDebugMode (torch.distributed.tensor.debug) counts them the same way, without their bytes. The bytes follow
labkit.parallel.counters' convention: an all-reduce or a broadcast its tensor, an all-gather this rank's part, a
reduce-scatter the whole tensor it sums, a send the tensor sent. A receive or a barrier counts nothing; any other
c10d collective (all-to-all, gather, ...) is counted under its operator's name with its first argument's bytes.
Collectives that C++ makes without the dispatcher are not seen; torch's DistributedDataParallel reduces its
buckets that way.

It counts what reaches the backend, where count_collectives counts the algorithm labkit runs: on gloo labkit
runs a reduce-scatter as a whole all-reduce and an all-gather as one broadcast per part (flat_shards.py), which
count there as the reduce-scatter and the all-gather and here as what they are; the pipeline executor's shape
headers are sends here and not there.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # the mechanism CommDebugMode is built on

from labkit.parallel.counters import Traffic

__all__ = ["count_torch_collectives"]

# c10d operator -> (labkit's kind, the argument holding what this rank hands it), as torch 2.x dispatches them
_KINDS = {
    "allreduce_": ("all_reduce", 0),            # (tensors, group, op, sparse indices, async)
    "allreduce_coalesced_": ("all_reduce", 0),
    "broadcast_": ("broadcast", 0),             # (tensors, group, root rank, root tensor, ...)
    "allgather_": ("all_gather", 1),            # (output lists, inputs, group, ...)
    "_allgather_base_": ("all_gather", 1),      # (output, input, group, async)
    "allgather_into_tensor_coalesced_": ("all_gather", 1),
    "reduce_scatter_": ("reduce_scatter", 1),   # (outputs, input lists, group, op, ...)
    "_reduce_scatter_base_": ("reduce_scatter", 1),   # (output, input, group, op, async)
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "send": ("send", 0),                        # (tensors, group, destination, tag)
}
_NOTHING_SENT = {"recv_", "recv_any_source_", "barrier", "monitored_barrier_"}


def _nbytes(value) -> int:
    """Bytes of the tensors in a tensor or a (nested) list of them."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_nbytes(item) for item in value)
    return 0


class _Counting(TorchDispatchMode):
    """Records each c10d collective into `traffic`, then runs it unchanged."""

    def __init__(self, traffic: Traffic):
        super().__init__()
        self.traffic = traffic

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func._overloadpacket.__name__
            if name in _KINDS:
                kind, where = _KINDS[name]
                self.traffic.add(kind, _nbytes(args[where]))
            elif name not in _NOTHING_SENT:
                self.traffic.add(f"c10d.{name}", _nbytes(args[0]) if args else 0)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_torch_collectives():
    """Count every collective dispatched on this rank inside the block, torch's own too (module docstring): a
    Traffic, `calls` and `nbytes` by kind.

    Example: torch's ZeroRedundancyOptimizer, after the gradients' all-reduce, broadcasts every parameter from
    the rank that updated it::

        >>> import labkit, torch
        >>> from torch.distributed.optim import ZeroRedundancyOptimizer
        >>> from labkit.models import mlp
        >>> from labkit.parallel import average_gradients, count_torch_collectives
        >>> def step():
        ...     model = mlp().to(labkit.device())                 # 5508 float32 numbers: 22032 bytes
        ...     optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
        ...     model(torch.randn(8, 16, device=labkit.device())).sum().backward()
        ...     with count_torch_collectives() as counted:
        ...         average_gradients(model)
        ...         optimizer.step()
        ...     return dict(counted.nbytes)
        >>> labkit.run(step, world_size=2)[0]
        {'all_reduce': 22032, 'broadcast': 22032}
    """
    traffic = Traffic()
    with _Counting(traffic):
        yield traffic
