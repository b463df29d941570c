"""The base of every grader's guard: torch.distributed's communication switched off on a rank, but what the
exercise teaches, each refusal noted and raised as `ForbiddenCall`.

`Guard.switch_off_torch_distributed` replaces, for the whole process (threads too): torch.distributed's
collective functions (in `torch.distributed` and in `torch.distributed.distributed_c10d`), the collective
methods of the ProcessGroup and Backend classes (so `dist.group.WORLD.allreduce` too) and every c10d operator
under torch.ops (`torch.ops.c10d.allreduce_`, functional collectives). A refused call raises `ForbiddenCall`,
which the last-attempt store keeps, so it is reported even if graded code catches it. A `Guard` is the kit's
`Interceptor`: whatever `install` (each grader's guard extends or replaces it) patched is put back when the
`with` ends, however it ends.

Graded code may import parts of torch for the first time while a guard is on (its first torch.optim step
imports torch._dynamo, and through it FSDP and DTensor). Those imports work: torch's functional collectives,
which register autograd formulas on the c10d operators when imported (that needs the operators themselves), are
imported before the guard goes on; a replaced operator still has its schema and its overloads (`.default`, which
refuse to be called too), and refuses only to be called; and what a module imported under the guard binds
(DTensor binds dist.broadcast) calls the original once the guard is off.
"""

from __future__ import annotations

import importlib

import torch

from labkit._refusals import ForbiddenCall
from labkit.exercises._kit import _store
from labkit.exercises._kit._intercept import Interceptor

__all__: list[str] = []

# What a guard switches off: torch.distributed's functions other than point-to-point, ...
_TORCH_FUNCTIONS = (
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
    "all_gather_coalesced", "all_gather_single", "all_gather_object", "gather", "gather_object", "scatter",
    "scatter_object_list", "broadcast_object_list", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    "send_object_list", "recv_object_list", "_all_gather_base", "_reduce_scatter_base", "new_group",
    "new_subgroups", "new_subgroups_by_enumeration", "split_group", "shrink_group", "init_device_mesh",
    "init_process_group", "destroy_process_group",
)
_POINT_TO_POINT_FUNCTIONS = ("send", "recv", "isend", "irecv", "batch_isend_irecv")  # off where not taught
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


class Guard(Interceptor):
    """While graded code runs on a rank: every way into torch.distributed's communication raises ForbiddenCall
    (`forbidden` lists what was called), but what the grader's guard leaves on. The base's `install` switches all
    of it off; a grader's guard replaces `install`, choosing what stays on and what it records."""

    def __init__(self):
        super().__init__()
        self.forbidden: list[str] = []

    def install(self) -> None:
        """Everything off, point-to-point included."""
        self.switch_off_torch_distributed()

    def refuse(self, spelling: str):
        """Note that graded code called `spelling`, and raise ForbiddenCall (reported even if it is caught)."""
        self.forbidden.append(spelling)
        _store.refused(spelling)
        raise ForbiddenCall(spelling)

    def switch_off_torch_distributed(self, allowed: tuple[str, ...] = (), point_to_point: bool = False) -> None:
        """Make every way into torch.distributed's communication raise ForbiddenCall: its functions, the process
        group's and its backend's methods, and every c10d operator of torch.ops. An exercise leaves on the
        functions and ProcessGroup methods it teaches, by name (`allowed`, e.g. ("all_reduce", "allreduce")), and
        send/recv with `point_to_point`."""
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
