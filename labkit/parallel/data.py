"""Data parallelism by hand: every rank of a group holds a whole replica and its own slice of the batch, and the
ranks average their gradients before each optimizer step, so that the replicas stay identical.

    broadcast_parameters(model)   step 0: group rank 0's parameters and buffers copied to every rank
    average_gradients(model)      the naive way: one all_reduce per gradient, after the backward
    BucketedDDP(model)            torch DDP's way: gradients in buckets (a first one of 1 MiB, then 25 MiB),
                                  last layer first, each bucket all-reduced as soon as it is full, while the
                                  backward goes on

Each takes `group=`: None for the whole world, or a sub-group (torch.distributed.new_group, the `dp` axis of a
labkit.parallel.Mesh), whose ranks then average among themselves only, as torch's DistributedDataParallel does
with `process_group=`. labkit.parallel.counters counts their collectives (`count_allreduces()`).

Source: Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020,
section 3.2 (a naive solution, gradient bucketing, overlapping computation with communication, gradient
accumulation with no_sync, unused parameters). Averages are SUM then divide: ReduceOp.AVG is missing or
buggy on gloo in some torch releases. Every collective runs on labkit.device() (CPU under gloo, the rank's
GPU under NCCL), where broadcast_parameters and BucketedDDP require the model to be; BucketedDDP's timeline is
kept with labkit.measure.Stopwatch (CUDA events on a GPU), the only place torch.cuda is touched.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from labkit import groups, measure
from labkit._refusals import refuse_while_graded
from labkit.checks import number, shown, whole
from labkit.parallel._collectives import broadcast
from labkit.parallel.counters import all_reduce_sum

__all__ = ["DEFAULT_BUCKET_MB", "FIRST_BUCKET_MB", "Bucket", "BucketedDDP", "Event", "MiB", "average_gradients",
           "broadcast_parameters", "bucket_caps_mb",
           "pack_buckets"]

MiB = 2**20  # torch DDP's bucket_cap_mb counts MiB
DEFAULT_BUCKET_MB = 25.0  # torch DDP's bucket_cap_mb when none is given
FIRST_BUCKET_MB = 1.0  # torch's dist._DEFAULT_FIRST_BUCKET_BYTES: a small first bucket starts traffic early


# --- Every rank of the group holds the same model, on its labkit.device() ---

def _signature(model: nn.Module) -> list[tuple]:
    """(what, shape, dtype, trainable) of every parameter and buffer, in order: what the replicas must share."""
    return ([(f"parameter {n!r}", tuple(p.shape), str(p.dtype).removeprefix("torch."), p.requires_grad)
             for n, p in model.named_parameters()] +
            [(f"buffer {n!r}", tuple(b.shape), str(b.dtype).removeprefix("torch."), False)
             for n, b in model.named_buffers()])


def _named_tensors(model: nn.Module) -> list:
    """The model's parameters and buffers, named for an error message."""
    return [(f"parameter {n!r}", p) for n, p in model.named_parameters()] + \
        [(f"buffer {n!r}", b) for n, b in model.named_buffers()]


def _check_replicas(model: nn.Module, src, caller: str, group) -> int:
    """`src` as a group rank, once every rank of `group` has its model on its labkit.device(), passed the same
    src, and holds the same model (names, shapes, dtypes, frozen or not); else the same ValueError on every
    rank: a broadcast or bucket of mismatched tensors would hang or abort the backend instead of saying why."""
    groups.require_member(caller, group)
    everyone = groups.gather_objects((groups.first_misplaced(_named_tensors(model)), src, _signature(model)),
                                     group)
    ranks = groups.group_ranks(group)
    misplaced = [f"rank {ranks[r]}: {where}" for r, (where, _, _) in enumerate(everyone) if where]
    if misplaced:
        raise ValueError(f"{caller}: the model must live on each rank's labkit.device() (the CPU under gloo, "
                         f"cuda:LOCAL_RANK under NCCL), but " + "; ".join(misplaced) +
                         ". Move it there first: model.to(labkit.device()).")
    groups.check_gathered([s for _, s, _ in everyone], caller, "src", "Pass the same src on every rank.", ranks)
    src = whole("src", src, minimum=0)
    if src >= len(ranks):
        raise ValueError(f"{caller}: src={shown(src)}: pass a rank of the group, 0 to {len(ranks) - 1} (group ranks; "
                         f"the group holds global ranks {ranks}).")
    problems = [f"rank {ranks[r]}: {_first_difference(everyone[src][2], signature, ranks[src])}"
                for r, (_, _, signature) in enumerate(everyone) if signature != everyone[src][2]]
    if problems:
        raise ValueError(f"{caller}: every rank needs the same model, but "
                         f"{len(problems)} rank(s) differ from rank {ranks[src]}. " + "; ".join(problems))
    return src


def _first_difference(ref: list, other: list, src: int) -> str:
    def show(entry):
        return f"{entry[0]} {entry[1]} {entry[2]}" + ("" if entry[3] or entry[0].startswith("buffer") else " frozen")
    count = "" if len(ref) == len(other) else f"{len(other)} parameters and buffers where rank {src} has {len(ref)}; "
    for a, b in zip(ref, other, strict=False):
        if a != b:
            return f"{count}{show(b)} where rank {src} has {show(a)}"
    if len(other) > len(ref):
        return f"{count}{show(other[len(ref)])} is extra"
    return f"{count}{show(ref[len(other)])} is missing"


# --- Step 0 and the naive averaging ---

def broadcast_parameters(model: nn.Module, src: int = 0, group=None) -> None:
    """Copy the parameters and buffers of `group`'s rank `src` into every rank's model, so that all replicas
    start identical. `src` is a group rank (0 .. group size - 1, not a global rank); `group` None is the world.

    Checks first that every rank of the group has the same model, on its labkit.device(), and passed the same
    src (a clear ValueError otherwise, not a hang).

    Example::

        >>> import labkit
        >>> from labkit.models import mlp
        >>> from labkit.parallel import broadcast_parameters
        >>> def first_weight():
        ...     model = mlp(seed=labkit.rank()).to(labkit.device())   # a different initialisation on every rank
        ...     broadcast_parameters(model)                           # now rank 0's everywhere
        ...     return model[0].weight[0, 0].item()
        >>> a, b = labkit.run(first_weight, world_size=2); a == b
        True
    """
    src = _check_replicas(model, src, "broadcast_parameters", group)
    _broadcast(model, src, group)


def _broadcast(model: nn.Module, src: int, group) -> None:
    """Group rank `src`'s parameters and buffers to the group's other ranks."""
    for tensor in [*model.parameters(), *model.buffers()]:
        broadcast(tensor.detach(), src, group=group)


def average_gradients(model: nn.Module, group=None) -> None:
    """Replace every gradient by its average over the ranks of `group` (None: the world): one all_reduce (SUM,
    then divide by the group's size) per parameter, after the whole backward (Li et al. 2020, 3.2.1, "a naive
    solution"). Parameters that are frozen or have no gradient are skipped, so every rank must have gradients
    for the same ones.

    Example::

        >>> import labkit, torch
        >>> from labkit.models import mlp
        >>> from labkit.parallel import average_gradients, broadcast_parameters
        >>> def step():
        ...     model = mlp().to(labkit.device())
        ...     broadcast_parameters(model)
        ...     x = torch.randn(8, 16, device=labkit.device()) + labkit.rank()   # different data per rank
        ...     model(x).sum().backward()
        ...     average_gradients(model)
        ...     return model[0].bias.grad
        >>> g0, g1 = labkit.run(step, world_size=2); torch.equal(g0, g1)
        True
    """
    refuse_while_graded("labkit.parallel's average_gradients")  # the exercise of notebook 01, in any thread
    groups.require_member("average_gradients", group)
    size = groups.group_size(group)
    for param in model.parameters():
        if param.requires_grad and param.grad is not None:
            all_reduce_sum(param.grad, group=group)
            param.grad.div_(size)


# --- Buckets overlapped with the backward ---

@dataclass
class Bucket:
    """Parameters whose gradients travel in one all_reduce. `nbytes` is the message: the gradients plus
    one "used" flag per parameter (how many ranks produced that gradient; see BucketedDDP)."""
    index: int
    names: list[str]
    params: list[nn.Parameter] = field(repr=False)
    numel: int
    nbytes: int
    ready: list[bool] = field(default_factory=list, repr=False)  # got its gradient in this synced backward
    used: list[bool] = field(default_factory=list, repr=False)  # gradient arrived since the last sync
    flat: torch.Tensor | None = field(default=None, repr=False)  # kept from step to step, as torch DDP does
    work: object = field(default=None, repr=False)
    done: object = field(default=None, repr=False)

    def reset(self) -> None:
        self.ready, self.used = [False] * len(self.params), [False] * len(self.params)
        self.work = self.done = None


@dataclass
class Event:
    """One mark on BucketedDDP.timeline, in seconds since the backward started. kind "grad": a parameter's
    gradient became ready (start == end); "all_reduce": a bucket's, launched at start, completed at end;
    "finish": finish() called at start, every gradient averaged at end."""
    kind: str
    name: str
    bucket: int
    start: float
    end: float
    nbytes: int


_hooks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its wrapper's hook handles


class BucketedDDP(nn.Module):
    """A model whose gradients are averaged in buckets, each all-reduced as soon as the backward has filled
    it, so communication overlaps the rest of the backward (Li et al. 2020, 3.2.2-3.2.3; torch's
    DistributedDataParallel). After the backward, `finish()` (or `step(optimizer)`) waits for every bucket
    and writes the averaged gradients back into `.grad`.

    - `group`: the ranks that average together (None: the world), as torch DDP's `process_group=`. At
      construction group rank 0's parameters and buffers are copied to the group's other ranks, after checking
      that every rank wraps the same model, on its labkit.device().

    - Buckets are packed as torch DDP packs them (torch 2.13, `dist._compute_bucket_assignment_by_size`): a
      bucket closes with the gradient that takes it to its cap or past it, so it can exceed the cap by that
      one gradient, and a tensor is never split. The first bucket's cap is `first_bucket_mb`, the others'
      `bucket_mb`. Left at None, they follow torch's DistributedDataParallel: with no bucket_mb, 25 MiB
      buckets after a first one of 1 MiB (`dist._DEFAULT_FIRST_BUCKET_BYTES`), so that the first all_reduce
      starts early in the backward; with a bucket_mb, the first bucket gets the same cap (torch 2.13 uses
      its small first bucket only when bucket_cap_mb is not given). Buckets are filled in reverse parameter
      order, roughly the order the backward produces gradients, and launched strictly in bucket order, so
      every rank issues the same collectives in the same order. torch instead, when find_unused_parameters=False
      (its default) or static_graph=True, starts with one bucket for everything and, after the first backward,
      rebuilds them in the order the gradients really arrived, its small bucket first in that order (the
      Reducer's rebuild_buckets; DDP_SET_LAST_BUCKET_CAP=1 puts it last); where that order is the reverse
      parameter order (a stack of layers), its buckets are these.
    - Frozen parameters are in no bucket; a tied parameter (one tensor in two modules) is in one.
    - Unused parameters: a bucket that a missing gradient keeps from filling is launched by finish(), with
      zeros for the missing gradients. Each bucket also sums one flag per parameter, how many ranks produced
      its gradient: used somewhere, every rank gets the average (sum / group size); used nowhere, its
      `.grad` is left as it was (None). That is torch DDP with find_unused_parameters=True, except that a
      stale `.grad` of an unused parameter counts as zero (torch sends it). Buckets after such a bucket lose
      their overlap.
    - `no_sync()`: backwards inside it only accumulate; the next synchronised backward reduces the sum.
    - `timeline` lists the Events of the last synchronised backward (read it after finish()), in seconds
      from the moment the model's output received its gradient (else from the first ready gradient), kept
      with a labkit.measure.Stopwatch on the parameters' device: on the CPU time.perf_counter; on a GPU
      CUDA events recorded on the current stream, so each mark is when the GPU got there, not when the host
      queued it (an NCCL future completes at enqueue). An all_reduce's end is marked in its future's
      callback, which runs on a stream that waits for the all_reduce (torch.futures.Future.then).

    Example::

        >>> import labkit, torch, torch.nn.functional as F
        >>> from labkit.models import make_classification, mlp
        >>> from labkit.parallel import BucketedDDP
        >>> def train(steps=3):
        ...     x, y = (t.to(labkit.device()) for t in make_classification())
        ...     model = BucketedDDP(mlp(seed=labkit.rank()).to(labkit.device()), bucket_mb=0.01)  # rank 0's weights
        ...     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ...     mine = slice(labkit.rank() * 32, (labkit.rank() + 1) * 32)     # this rank's half of 64
        ...     for _ in range(steps):
        ...         optimizer.zero_grad()
        ...         F.cross_entropy(model(x[mine]), y[mine]).backward()         # buckets go out meanwhile
        ...         model.step(optimizer)                                        # finish(), then step
        ...     return len(model.buckets), model.module[0].weight.sum().item()
        >>> (buckets, w0), (_, w1) = labkit.run(train, world_size=2)
        >>> buckets > 1, w0 == w1                                                # identical replicas
        (True, True)
    """

    def __init__(self, model: nn.Module, bucket_mb: float | None = None, first_bucket_mb: float | None = None,
                 group=None):
        refuse_while_graded("labkit.parallel's BucketedDDP")  # the exercise of notebooks 01 and 04, in any thread
        super().__init__()
        bucket_mb, first_bucket_mb = bucket_caps_mb(bucket_mb, first_bucket_mb)
        self.module, self.group = model, group
        self.timeline: list[Event] = []
        self._sync, self._next, self._t0 = True, 0, None
        _check_replicas(model, 0, "BucketedDDP", group)
        _broadcast(model, 0, group)  # identical replicas, as torch DDP does at construction
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.buckets = pack_buckets(trainable[::-1], bucket_mb * MiB, first_bucket_mb * MiB)
        for handle in _hooks.pop(model, []):  # a model wrapped again: the old wrapper's hooks go
            handle.remove()
        _hooks[model] = [p.register_post_accumulate_grad_hook(
            lambda param, b=bucket, i=i, name=name: self._grad_ready(b, i, name, param))
            for bucket in self.buckets for i, (name, p) in enumerate(zip(bucket.names, bucket.params, strict=True))]

    def forward(self, *args, **kwargs):
        if self._t0 is not None and torch.is_grad_enabled():
            raise RuntimeError("BucketedDDP: forward before the last backward's gradients were averaged: call "
                               "finish() or step(optimizer) after each synchronised backward.")
        out = self.module(*args, **kwargs)
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda grad: self._start_clock())
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside only accumulate into `.grad`; the first backward after it averages the sum."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """finish(), then optimizer.step()."""
        self.finish()
        optimizer.step()

    def _start_clock(self) -> None:
        if self._sync and self._t0 is None:
            self._t0, self.timeline = measure.Stopwatch(self.buckets[0].flat.device if self.buckets else "cpu"), []

    def _grad_ready(self, bucket: Bucket, i: int, name: str, param: nn.Parameter) -> None:
        bucket.used[i] = True
        if not self._sync:
            return
        self._start_clock()
        if bucket.ready[i] or bucket.work is not None:
            raise RuntimeError(f"BucketedDDP: {name!r} received a second gradient before finish(): call finish() "
                               "(or step) after each backward, and accumulate inside no_sync().")
        bucket.ready[i] = True
        now = self._t0.mark()
        self.timeline.append(Event("grad", name, bucket.index, now, now, param.numel() * param.element_size()))
        while self._next < len(self.buckets) and all(self.buckets[self._next].ready):
            self._launch(self.buckets[self._next])

    def _launch(self, bucket: Bucket) -> None:
        """All-reduce a flat copy of the bucket's gradients (zeros where a rank has none) and the used flags."""
        params = bucket.params
        have = [used and p.grad is not None for used, p in zip(bucket.used, params, strict=True)]
        parts = [p.grad.reshape(-1) if ok else p.new_zeros(p.numel()) for ok, p in zip(have, params, strict=True)]
        torch.cat([*parts, torch.tensor(have, dtype=bucket.flat.dtype, device=bucket.flat.device)], out=bucket.flat)
        start = self._t0.mark()
        bucket.work = all_reduce_sum(bucket.flat, group=self.group, async_op=True)
        event = Event("all_reduce", f"bucket {bucket.index}", bucket.index, start, float("nan"), bucket.nbytes)
        self.timeline.append(event)
        clock = self._t0
        bucket.done = bucket.work.get_future().then(lambda _: setattr(event, "end", clock.mark()))
        self._next += 1

    def finish(self) -> None:
        """Launch the buckets the backward left (unused parameters), wait for all, and write the averages
        (SUM / group size) into `.grad`. Call it once after every synchronised backward."""
        if not self._sync:
            raise RuntimeError("BucketedDDP.finish() inside no_sync(): gradients are averaged after the "
                               "first backward outside it.")
        if self._t0 is None:
            self._start_clock()
        finishing = Event("finish", "finish", -1, self._t0.mark(), float("nan"), 0)
        while self._next < len(self.buckets):  # bucket order, so the same collectives on every rank
            self._launch(self.buckets[self._next])
        world = groups.group_size(self.group)
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.done.wait()
            counts = bucket.flat[bucket.numel:].tolist()
            views = bucket.flat[:bucket.numel].split([p.numel() for p in bucket.params])
            for p, count, view in zip(bucket.params, counts, views, strict=True):
                if count > 0:  # used on some rank; else leave .grad alone, as torch DDP does
                    if p.grad is None:
                        p.grad = (view / world).view_as(p)
                    else:
                        torch.div(view.view_as(p), world, out=p.grad)
            bucket.reset()
        finishing.end = self._t0.mark()
        self.timeline.append(finishing)
        for event in self.timeline:  # marks to seconds, now that the work they mark is done
            event.start, event.end = self._t0.seconds(event.start), self._t0.seconds(event.end)
        self._next, self._t0 = 0, None


def bucket_caps_mb(bucket_mb: float | None, first_bucket_mb: float | None) -> tuple[float, float]:
    """(bucket_mb, first_bucket_mb) as torch 2.13's DistributedDataParallel sets them from bucket_cap_mb
    (torch/nn/parallel/distributed.py, _BucketCapacityConfig): with none given, 25 MiB after a first bucket of
    1 MiB; with one given, the same cap for the first bucket too. A first_bucket_mb given wins.

    >>> bucket_caps_mb(None, None), bucket_caps_mb(4.0, None), bucket_caps_mb(4.0, 0.5)
    ((25.0, 1.0), (4.0, 4.0), (4.0, 0.5))
    """
    default = bucket_mb is None
    bucket_mb = DEFAULT_BUCKET_MB if default else number("bucket_mb", bucket_mb, minimum=0, inclusive=False)
    if first_bucket_mb is None:
        return bucket_mb, FIRST_BUCKET_MB if default else bucket_mb
    return bucket_mb, number("first_bucket_mb", first_bucket_mb, minimum=0, inclusive=False)


def pack_buckets(named: list[tuple[str, nn.Parameter]], cap: float, first_cap: float) -> list[Bucket]:
    """Group parameters (given in the order their gradients are expected) into buckets of one device and
    dtype, in the order given, by torch DDP's rule (torch 2.13's dist._compute_bucket_assignment_by_size): a
    bucket closes as soon as it holds at least `cap` bytes (the first of each kind `first_cap`), with the
    tensor that took it there, so it can exceed its cap by that one tensor; what is left forms the last."""
    closed: list[list[int]] = []
    open_: dict[tuple, list[int]] = {}
    sizes: dict[tuple, int] = {}
    had_one: set[tuple] = set()  # kinds whose first bucket is closed
    for position, (_, p) in enumerate(named):
        kind, nbytes = (p.device, p.dtype), p.numel() * p.element_size()
        open_.setdefault(kind, []).append(position)
        sizes[kind] = sizes.get(kind, 0) + nbytes
        if sizes[kind] >= (cap if kind in had_one else first_cap):
            closed.append(open_.pop(kind))
            sizes[kind] = 0
            had_one.add(kind)
    packed = sorted(closed + list(open_.values()), key=min)  # launched in the order they should fill
    buckets = []
    for index, positions in enumerate(packed):
        params = [named[i][1] for i in positions]
        numel = sum(p.numel() for p in params)
        buckets.append(Bucket(index, [named[i][0] for i in positions], params, numel,
                              (numel + len(params)) * params[0].element_size(),
                              flat=params[0].new_empty(numel + len(params))))
        buckets[-1].reset()
    return buckets
