"""Measurements the notebooks set next to labkit.plan's predictions: collective times and training-state bytes;
and the two clocks every labkit timing uses, so that GPU work is timed when it runs, not when it is queued.

    synchronize(device)   wait for `device`'s queued work before reading the host clock (no-op on the CPU)
    Stopwatch(device)     marks read later: CUDA events on a GPU, time.perf_counter on the CPU

and the one way labkit, gpu-check and the benchmarks time a call on ranks: every rank waits at a barrier, the
device is synchronized, the host clock runs over one round of calls, and the median of several rounds counts:

    seconds_per_call(fn, calls, device, group)          one timed round
    median_seconds(fn, repeats, device, group)          the median round
    seconds_taking_turns(fns, rounds, calls, ...)       several functions, rounds in rotating order
    slowest_rank_median(per_rank)                       each round's slowest rank, then the median
    training_step(model, optimizer, inputs, targets)    one training step as a function of nothing, to time
    timing_check(holds, claim, measured)                a timing claim's verdict, printed: never an assert

and the bytes a rank holds in weights, gradients and optimizer state, keyed like labkit.plan.training_memory, under
any strategy (a plain optimizer, DDP, labkit.parallel's ShardedOptimizer and FullyShardedDP):

    training_state_nbytes(model, optimizer)             now, each storage counted once
    peak_training_state(model, optimizer)               at the peak of the steps inside a with block

CUDA kernels and NCCL collectives run asynchronously: a host clock read right after launching them measures
the launch (PyTorch docs, "CUDA semantics: asynchronous execution", which times GPU work with
torch.cuda.Event(enable_timing=True) or after torch.cuda.synchronize()).
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Hashable, Iterable

import torch
import torch.distributed as dist

import labkit
from labkit.checks import whole
from labkit.groups import group_is_up
from labkit.tables import wrapped

__all__ = ["PeakTrainingState", "Stopwatch", "allreduce_seconds_by_size", "allreduce_sweep", "median_seconds",
           "peak_training_state", "seconds_per_call", "seconds_taking_turns", "slowest_rank_median", "synchronize",
           "timing_check", "training_state_nbytes", "training_step"]


def synchronize(device: torch.device | str) -> None:
    """Wait until every stream of `device` has run the work queued on it (torch.cuda.synchronize), so that a
    host clock read next includes that work; nothing on the CPU, whose work is done when the call returns."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """Seconds since it was made, for marks set while work is still queued, read once that work is done.

    On a CUDA `device` a mark is a torch.cuda.Event(enable_timing=True) recorded on the current stream: its time
    is when the GPU reaches it, however early the host queued it, and marking does not stall the GPU as
    torch.cuda.synchronize would (a backward overlapping its all_reduces keeps overlapping). On the CPU a mark
    is time.perf_counter(). `seconds(mark)` waits for the mark's event, so call it after the work."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self.start = self.mark()

    def mark(self):
        """Now: on the current CUDA stream (an event), or on the host clock."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, mark) -> float:
        """Seconds from the stopwatch's start to `mark` (waiting for a CUDA mark to be reached)."""
        if not self.cuda:
            return mark - self.start
        mark.synchronize()
        return self.start.elapsed_time(mark) / 1e3  # elapsed_time counts milliseconds


def seconds_per_call(fn: Callable[[], object], calls: int = 1, device: torch.device | str | None = None,
                     group=None) -> float:
    """One timed round: seconds per call of `fn()`, called `calls` times back to back.

    Inside a rank, every rank of `group` (None: the world) first waits at a barrier, so that they start the
    round together and a collective is not timed waiting for a late peer. `device` (None: labkit.device()
    inside a rank, the CPU outside one) is synchronized before the clock starts and before it stops, so that
    GPU work is timed as run, not as queued. Outside a rank (no process group up) there is nobody to wait for
    and no barrier."""
    calls = whole("calls", calls)
    device = _timing_device(device)
    if group_is_up():
        dist.barrier(group=group)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / calls


def _timing_device(device: torch.device | str | None) -> torch.device:
    """`device`, or labkit.device() inside a rank and the CPU outside one."""
    if device is not None:
        return torch.device(device)
    return labkit.device() if group_is_up() else torch.device("cpu")


def median_seconds(fn: Callable[[], object], repeats: int = 5, device: torch.device | str | None = None,
                   group=None, calls: int = 1, warm_up: bool = True) -> float:
    """The median of `repeats` rounds of `seconds_per_call(fn, calls, device, group)`: on a shared machine single
    rounds swing by tens of percent, and the median does not follow the outliers. `warm_up` first calls `fn`
    once, untimed (buffers, connections, a kernel's first launch).

    >>> def sleep_10_ms():
    ...     return median_seconds(lambda: time.sleep(0.01), repeats=3) >= 0.01
    >>> labkit.run(sleep_10_ms, world_size=2)
    [True, True]
    """
    repeats = whole("repeats", repeats)
    if warm_up:
        fn()
    return statistics.median(seconds_per_call(fn, calls, device, group) for _ in range(repeats))


def seconds_taking_turns(fns: dict[Hashable, Callable[[], object]], rounds: int, calls: int | dict = 1,
                         device: torch.device | str | None = None, group=None) -> dict[Hashable, list[float]]:
    """Seconds per call of each of `fns` (name -> function), one entry per round, `rounds` rounds.

    Each round times every function once (`seconds_per_call` of `calls` calls; a dict gives each name its own
    count), starting from the next name each round and wrapping around: every function takes every place in
    turn, so that a slow moment of the machine, or one function warming the caches for the next, falls on all
    of them alike."""
    names = list(fns)
    counts = calls if isinstance(calls, dict) else dict.fromkeys(names, calls)
    seconds = {name: [] for name in names}
    for i in range(whole("rounds", rounds) if names else 0):
        for name in names[i % len(names):] + names[:i % len(names)]:
            seconds[name].append(seconds_per_call(fns[name], counts[name], device, group))
    return seconds


def slowest_rank_median(per_rank: list[dict[Hashable, list[float]]]) -> dict[Hashable, float]:
    """name -> the median over rounds of each round's slowest rank, from every rank's `seconds_taking_turns`: a
    collective is done when its last rank is done.

    >>> slowest_rank_median([{"ring": [1.0, 5.0, 2.0]}, {"ring": [3.0, 1.0, 1.0]}])
    {'ring': 3.0}
    """
    return {name: statistics.median(max(times) for times in zip(*(rank[name] for rank in per_rank), strict=True))
            for name in per_rank[0]}


def training_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
                  targets: torch.Tensor, after_backward: Callable[[], object] | None = None,
                  loss_fn: Callable = torch.nn.functional.cross_entropy) -> Callable[[], None]:
    """A function of nothing that runs one training step: zero_grad, forward, `loss_fn`, backward, then
    `after_backward()` if given (BucketedDDP.finish, FullyShardedDP.finish, average_gradients), then the
    optimizer's step: what the benchmarks hand to seconds_taking_turns.

    >>> import torch
    >>> model = torch.nn.Linear(4, 3)
    >>> step = training_step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.ones(2, 4), torch.tensor([0, 2]))
    >>> before = model.weight.clone(); step(); bool((model.weight != before).any())
    True
    """
    def step() -> None:
        optimizer.zero_grad()
        loss_fn(model(inputs), targets).backward()
        if after_backward is not None:
            after_backward()
        optimizer.step()
    return step


def allreduce_seconds_by_size(sizes_nbytes: Iterable[int], allreduce: Callable | None = None,
                              repeats: int = 9, warm_up: bool = True) -> list[float]:
    """Inside a rank: seconds per call of `allreduce` (default torch's `dist.all_reduce`) on a float32 tensor
    of each size. Sizes take turns (`seconds_taking_turns`), `repeats` rounds of back-to-back calls each
    (several calls for small tensors), and the median round counts: on a shared laptop single calls swing by
    tens of percent, and taking turns spreads slow moments over every size alike. `warm_up` first calls it once
    per size, untimed. Each round is synchronized on labkit.device(): on a GPU the calls are timed as run."""
    allreduce = allreduce or dist.all_reduce
    sizes = list(sizes_nbytes)
    tensors = [torch.randn(max(1, nbytes // 4), device=labkit.device()) for nbytes in sizes]
    calls = {i: max(1, min(20, (8 << 20) // max(1, nbytes))) for i, nbytes in enumerate(sizes)}
    for tensor in tensors if warm_up else ():
        allreduce(tensor)  # warm up: buffers, connections
    rounds = seconds_taking_turns({i: functools.partial(allreduce, tensor) for i, tensor in enumerate(tensors)},
                                  whole("repeats", repeats), calls, device=labkit.device())
    return [statistics.median(rounds[i]) for i in range(len(sizes))]


def allreduce_sweep(sizes_nbytes: Iterable[int], allreduces: dict[str, Callable], world_size: int,
                    repeats: int = 3, timeout: float = 300.0) -> dict[str, list[float]]:
    """In the notebook: rank 0's seconds per call of each of `allreduces` (name -> function, e.g.
    dist.all_reduce) at every size, on `world_size` ranks, with a progress bar.

    Each round is one `labkit.run` of `allreduce_seconds_by_size` (one timed round per size, the functions
    taking turns), so the bar moves between runs: a rank cannot draw it. The median over `repeats` rounds
    counts, as in `allreduce_seconds_by_size`; only the first round warms up."""
    from labkit.tables import progress_bar

    sizes = list(sizes_nbytes)
    rounds = {name: [] for name in allreduces}
    # the bar counts runs (each times every size once), so its text says what makes the total: 3 rounds x 2 = 6
    desc = f"AllReduce sweep: {len(sizes)} sizes, {repeats} rounds x {len(allreduces)} AllReduces"
    with progress_bar(total=repeats * len(allreduces), desc=desc, unit="run") as bar:
        for repeat in range(repeats):
            for name, allreduce in allreduces.items():
                rounds[name].append(labkit.run(allreduce_seconds_by_size, sizes, allreduce, repeats=1,
                                               warm_up=repeat == 0, world_size=world_size, timeout=timeout)[0])
                bar.update()
    return {name: [statistics.median(seconds) for seconds in zip(*runs, strict=True)] for name, runs in rounds.items()}


def training_state_nbytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                          master_params: Iterable[torch.Tensor] = ()) -> dict[str, int]:
    """Bytes this rank holds in weights, gradients and optimizer state now, keyed like labkit.plan.training_memory.

    Counted by storage, each storage once, so that views are not counted twice and freed storage counts 0:

    - "weights": the storages of `model.parameters()` (a tied weight once; FullyShardedDP's flat shards, and its
      gathered full parameters while they exist);
    - "grads": the storages of the `.grad` of the model's parameters, of the optimizer's parameters and of the
      tensors its state is kept for (labkit.parallel.ShardedOptimizer's gradient shard, held by its pieces);
    - "optimizer": the optimizer's per-parameter state (Adam's m and v, SGD's momentum) and any fp32
      `master_params` (the mixed-precision copies the optimizer updates);
    - "counters": Adam's scalar `step` counters, left out of "total": a few bytes per tensor, not per
      parameter, which the per-parameter model ignores.

    `peak_training_state` samples this through a step, to find its peak.
    """
    weights = _storages(model.parameters())
    grads = _storages(t.grad for t in [*model.parameters(), *_optimized(optimizer)] if t.grad is not None)
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    nbytes = {"weights": _held(weights), "grads": _held(grads, weights),
              "optimizer": _held(_storages([*master_params, *(v for v in state if v.dim() > 0)]), weights),
              "counters": sum(v.numel() * v.element_size() for v in state if v.dim() == 0)}
    nbytes["total"] = nbytes["weights"] + nbytes["grads"] + nbytes["optimizer"]
    return nbytes


def _optimized(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors `optimizer` updates: its param_groups' parameters and the keys of its state (which, for an
    optimizer that keeps an inner one, are the inner one's parameters)."""
    return [*(p for group in optimizer.param_groups for p in group["params"]),
            *(t for t in optimizer.state if torch.is_tensor(t))]


def _storages(tensors: Iterable[torch.Tensor]) -> dict[tuple, int]:
    """(device, address) -> bytes of each distinct storage behind `tensors`; storage freed (resized to 0) left out."""
    held = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            held[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return held


def _held(storages: dict[tuple, int], counted: dict[tuple, int] | None = None) -> int:
    """Bytes of `storages`, less those already `counted` in another part."""
    return sum(nbytes for key, nbytes in storages.items() if key not in (counted or {}))


class PeakTrainingState:
    """`training_state_nbytes` sampled through a step: `nbytes` is the sample with the largest total so far (all
    zeros before the first), `samples` how many were taken. `sample()` takes one now; `peak_training_state` takes
    them at the moments a step's memory grows or moves."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 master_params: Iterable[torch.Tensor] = ()):
        self.model, self.optimizer, self.master_params = model, optimizer, list(master_params)
        self.nbytes = dict.fromkeys(("weights", "grads", "optimizer", "counters", "total"), 0)
        self.samples = 0

    def sample(self, *_) -> None:
        """Measure now; keep the measurement if its total is the largest yet. Takes (and ignores) any arguments,
        so that it can be registered as a hook directly."""
        now = training_state_nbytes(self.model, self.optimizer, self.master_params)
        self.samples += 1
        if now["total"] > self.nbytes["total"]:
            self.nbytes = now


@contextlib.contextmanager
def peak_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        master_params: Iterable[torch.Tensor] = ()):
    """Inside the block, the bytes of weights, gradients and optimizer state a rank holds at the peak of its
    training steps: `training_state_nbytes` sampled when the block opens and closes, before and after every
    submodule's forward (where FullyShardedDP's gathered parameters live), after every parameter's gradient is
    accumulated (where ZeRO-2's buckets fill), and before and after each optimizer step. Yields a
    PeakTrainingState; read its `nbytes` after the block. Activations and communication buffers are not
    counted, under any strategy: only what labkit.plan.training_memory predicts.

    Sampling walks every parameter, so keep the model to a few hundred tensors.

    >>> model = torch.nn.Linear(100, 10)
    >>> optimizer = torch.optim.Adam(model.parameters())
    >>> with peak_training_state(model, optimizer) as peak:
    ...     model(torch.randn(4, 100)).sum().backward()
    ...     optimizer.step()
    >>> peak.nbytes["total"] == 1010 * 4 * 4          # weights, grads, m and v: 16 bytes per parameter
    True
    """
    peak = PeakTrainingState(model, optimizer, master_params)
    handles = [optimizer.register_step_pre_hook(peak.sample), optimizer.register_step_post_hook(peak.sample)]
    for module in model.modules():
        handles += [module.register_forward_pre_hook(peak.sample), module.register_forward_hook(peak.sample)]
    handles += [p.register_post_accumulate_grad_hook(peak.sample) for p in model.parameters() if p.requires_grad]
    peak.sample()
    try:
        yield peak
    finally:
        peak.sample()
        for handle in handles:
            handle.remove()


def timing_check(holds: bool, claim: str, measured: str) -> bool:
    """Print whether the timing `claim` held in this run, with what was `measured`, and return `holds`; never raise.

    A notebook's timings run on a laptop's shared cores: another program, or 8 ranks on 2 cores, can push a single
    run past any tolerance (a bubble measured at 26 % against a formula's 33 %), and an assert there would stop a
    student's Run All with the cells below it unrun. So a timing claim gets a sentence saying what this run measured
    and that rerunning is fine; what does not depend on the clock (bytes counted, formulas, results) still asserts.
    Where a timing target must be met, a benchmark prints it (benchmarks/).

    >>> timing_check(True, "8 passes take over twice one pass", "41.0 ms against 12.0 ms")
    ✅ 8 passes take over twice one pass: 41.0 ms against 12.0 ms.
    True
    >>> timing_check(False, "bubble near (p-1)/(m+p-1)", "26 % against 33 %")
    ⚠️ bubble near (p-1)/(m+p-1): not in this run (26 % against 33 %). A busy machine ... rerunning the cell is fine.
    False
    """
    if holds:
        print(wrapped(f"✅ {claim}: {measured}."))
    else:  # a long claim and measurement make a line longer than JupyterLab shows unbroken (notebook 08's did)
        print(wrapped(f"⚠️ {claim}: not in this run ({measured}). A busy machine can push one run's timing off; "
                      "rerunning the cell is fine."))
    return bool(holds)
