"""Who am I, process groups, and do all their ranks agree: the leaf the rest of labkit reads. It imports only torch
and the standard library (as picotron's process_group_manager.py does), so code on a rank started by torchrun
loads none of labkit's launcher.

Who am I: `rank()`, `world_size()`, `local_rank()` and `device()`, which `labkit.rank()` and its siblings are.
They work the same under labkit's pool and under torchrun: both initialise torch.distributed's default process
group and set LOCAL_RANK, and the backend says where tensors live (NCCL: this rank's GPU).

Groups: every distributed primitive in labkit takes `group=`: None for the whole world (torch's default group), or
a sub-group from `torch.distributed.new_group` or a `labkit.parallel.Mesh` axis. These helpers are the one place
that asks torch.distributed those questions, so each primitive reads the same way and fails with the same
message outside a rank. Ranks inside a group are numbered 0 .. size-1 (torch's "group rank"); messages name
the global rank too, the number `labkit.rank()` prints.

Example::

    >>> import labkit
    >>> from labkit import groups
    >>> def where_am_i():
    ...     evens = groups.new_group([0, 2])   # every rank must call new_group, members or not
    ...     if labkit.rank() % 2:
    ...         return None
    ...     return groups.group_rank(evens), groups.group_size(evens), groups.global_rank(evens, 1)
    >>> labkit.run(where_am_i, world_size=4)
    [(0, 2, 2), None, (1, 2, 2), None]
"""

from __future__ import annotations

import os

__all__ = ["broadcast_object", "check_gathered", "check_placed", "check_same", "device", "first_misplaced",
           "gather_objects", "global_rank", "group_is_up", "group_rank", "group_ranks", "group_size", "local_rank",
           "new_group", "rank", "require_group", "require_member", "world_size"]

OUTSIDE = ("{caller} needs a torch.distributed process group: call it inside a rank (in a function given to "
           "labkit.run, in a %%ranks cell, or in a script started by torchrun). Here none is initialised.")


def _dist():
    import torch.distributed as dist

    return dist


def group_is_up() -> bool:
    """True inside a rank: torch.distributed is built in and its default process group is initialised."""
    dist = _dist()
    return dist.is_available() and dist.is_initialized()


def require_group(caller: str) -> None:
    """RuntimeError naming `caller` unless a process group is up."""
    if not group_is_up():
        raise RuntimeError(OUTSIDE.format(caller=caller))


def rank() -> int:
    """This process's rank in the default process group (0 .. world_size() - 1): `labkit.rank()`."""
    require_group("labkit.rank()")
    return _dist().get_rank()


def world_size() -> int:
    """Number of ranks in the default process group: `labkit.world_size()`."""
    require_group("labkit.world_size()")
    return _dist().get_world_size()


def local_rank() -> int:
    """Rank among the processes on this machine (LOCAL_RANK, which torchrun and labkit's pool set for each rank;
    the rank itself where it is unset, as on one node)."""
    value = os.environ.get("LOCAL_RANK")
    return int(value) if value is not None else rank()


def device():
    """Where this rank's tensors belong (`labkit.device()`): cuda:LOCAL_RANK when NCCL is in the group, the CPU
    otherwise. Under labkit's NCCL pools, CPU tensors still work: they travel over gloo."""
    import torch

    require_group("labkit.device()")
    if "nccl" in _dist().get_backend():  # "nccl", or "cpu:gloo,cuda:nccl"
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def require_member(caller: str, group=None, *, alone_ok: bool = False) -> None:
    """`require_group`, then a ValueError naming `caller` unless this rank belongs to `group`. On a rank outside
    it, torch.distributed.new_group returned a placeholder (GroupMember.NON_GROUP_MEMBER), and torch's
    collectives on it only warn and return, leaving the tensor as it was: here that is an error instead.

    `alone_ok`: for callers that also run without ranks (labkit.checkpoint), where this process is rank 0 of 1
    (as `group_rank` and `gather_objects` have it): then there is nothing to check."""
    if alone_ok and not group_is_up():
        return
    require_group(caller)
    if _dist().get_rank(group) < 0:
        raise ValueError(f"{caller}: global rank {_dist().get_rank()} is not in the group passed as group=. Call it "
                         "only on the group's ranks (every rank creates the group; only its members use it).")


def new_group(ranks: list[int]):
    """torch.distributed.new_group over `ranks` (global ranks). Every rank of the world must call it, in the
    same order, members or not: it is a collective of the whole world."""
    return _dist().new_group(ranks=sorted(ranks))


def group_rank(group=None) -> int:
    """This rank's number inside `group` (None: the world); 0 when no process group is up, where a single process
    is rank 0 of 1 (as for `gather_objects`, so that code which also runs without ranks can ask).

        >>> from labkit import groups
        >>> groups.group_rank(), groups.group_size(), groups.group_ranks()   # here, outside any rank
        (0, 1, [0])
    """
    return _dist().get_rank(group) if group_is_up() else 0


def group_size(group=None) -> int:
    """How many ranks `group` holds (None: the world); 1 when no process group is up."""
    return _dist().get_world_size(group) if group_is_up() else 1


def global_rank(group, rank_in_group: int) -> int:
    """The global rank of `group`'s rank `rank_in_group`: what error messages name, and what torch.distributed's
    `src`/`dst`/`peer` arguments (send, recv, broadcast, P2POp...) take even when a `group` is given. In torch 2.13
    those functions also take the group rank itself, as `group_src`/`group_dst`/`group_peer`."""
    if group is None:
        return rank_in_group
    return _dist().get_global_rank(group, rank_in_group)


def group_ranks(group=None) -> list[int]:
    """`group`'s global ranks, in group-rank order."""
    return [global_rank(group, r) for r in range(group_size(group))]


def gather_objects(obj, group=None) -> list:
    """Every rank's `obj` in group-rank order, on every rank of `group` (all_gather_object); [obj] when no
    process group is up, so that single-process code can call it too."""
    if not group_is_up():
        return [obj]
    everyone: list = [None] * group_size(group)
    _dist().all_gather_object(everyone, obj, group=group)
    return everyone


def broadcast_object(obj, group=None):
    """Group rank 0's `obj` on every rank of `group` (broadcast_object_list, through labkit.device() so that it
    also works under NCCL); `obj` itself when no process group is up or the group has one rank.

        >>> import labkit
        >>> from labkit import groups
        >>> def from_first_of_pair():
        ...     pairs = [groups.new_group([0, 2]), groups.new_group([1, 3])]
        ...     return groups.broadcast_object(f"rank {labkit.rank()}'s", pairs[labkit.rank() % 2])
        >>> labkit.run(from_first_of_pair, world_size=4)
        ["rank 0's", "rank 1's", "rank 0's", "rank 1's"]
    """
    if group_size(group) == 1:
        return obj
    box = [obj]
    _dist().broadcast_object_list(box, src=global_rank(group, 0), group=group, device=device())
    return box[0]


def check_same(value, caller: str, what: str, fix: str, group=None) -> None:
    """ValueError on every rank of `group` when its ranks passed different `value`s (any picklable, comparable
    description: shapes, dtypes, names). Mismatched tensors in a collective hang or abort the backend instead
    of saying why; this says which ranks differ from group rank 0, and what each passed.

    `what` names the thing ("tensors", "models"); `fix` tells the student what to do."""
    everyone = gather_objects(value, group)
    check_gathered(everyone, caller, what, fix, group_ranks(group))


def check_gathered(everyone: list, caller: str, what: str, fix: str, ranks: list[int]) -> None:
    """`check_same` once every rank's value is at hand (`everyone`, in group-rank order; `ranks`: their global
    ranks, for the message): for callers that exchange the values their own, faster way (labkit.comm's
    transport sends its tensor signatures point to point, and runs in its simulator too)."""
    differ = [r for r, theirs in enumerate(everyone) if theirs != everyone[0]]
    if differ:
        described = "; ".join(f"rank {ranks[r]}: {everyone[r]}" for r in [0, *differ])
        raise ValueError(f"{caller}: the ranks passed different {what} ({described}). {fix}")


def first_misplaced(named_tensors) -> str:
    """The first of `named_tensors` ((name, tensor) pairs) that is not on this rank's labkit.device(), described;
    "" if none. Under NCCL a CPU tensor would quietly travel over gloo, and one on another rank's GPU would hang
    or fail, so every primitive that communicates a model's tensors asks this first."""
    home = device()
    for name, tensor in named_tensors:
        if tensor.device != home:
            return f"{name} is on {tensor.device}, not on labkit.device() = {home}"
    return ""


def check_placed(named_tensors, caller: str, fix: str, group=None) -> None:
    """The same ValueError on every rank of `group` unless every rank's `named_tensors` are on its
    labkit.device(): a rank that raised alone would leave the others waiting in their next collective."""
    everyone = gather_objects(first_misplaced(named_tensors), group)
    ranks = group_ranks(group)
    misplaced = [f"rank {ranks[r]}: {where}" for r, where in enumerate(everyone) if where]
    if misplaced:
        raise ValueError(f"{caller}: every tensor must live on its rank's labkit.device() (the CPU under gloo, "
                         f"cuda:LOCAL_RANK under NCCL), but " + "; ".join(misplaced) + f". {fix}")
