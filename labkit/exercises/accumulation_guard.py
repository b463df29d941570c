"""On a rank, while check_no_sync_accumulation grades notebook 07's exercise: the training run, what is watched,
and what the student's step left behind.

Each rank wraps the same small model (`accumulation_model`, float64, seeded the same everywhere) in torch's
DistributedDataParallel, makes an SGD optimizer, and calls the student's `fn(ddp_model, optimizer, microbatches)`
once per optimizer step with this rank's micro-batches of that step's batch (`rank_microbatches`). While fn runs,
every way into torch.distributed's communication but all_reduce is switched off (`AccumulationGuard`, the shared
guard of labkit.exercises.guard): DDP's constructor has broadcast the parameters before, and DDP's all_reduce in
the last backward is the step's one communication, so a broadcast, a barrier or a message of the student's own
only adds a round trip. Everything else is watched where DDP and the optimizer report it:

- each forward of the DDP model with gradients on (one under torch.no_grad(), an accuracy logged, is no
  micro-batch), and whether it ran with DDP's gradient synchronisation off (inside
  `no_sync()`): DDP decides at the forward whether that backward will all-reduce (torch's
  DistributedDataParallel.no_sync documentation), so the forward is what counts;
- when each forward's backward reached its output (a tensor hook, Tensor.register_hook), counted in forwards
  run since: accumulation saves memory only if each micro-batch's backward runs before the next forward, so
  that one micro-batch's activations are alive at a time;
- and that memory itself, measured: every tensor autograd saves for backward is packed, through
  torch.autograd.graph.saved_tensors_hooks, into a holder counted under its micro-batch until autograd frees it
  (`SavedActivations`), so a backward(retain_graph=True) whose losses are kept alive shows at the next forward;
- each bucket DDP all-reduces, through a communication hook (`DistributedDataParallel.register_comm_hook`) that
  counts it and then does what DDP does by default (`default_hooks.allreduce_hook`: divide by N, all_reduce);
- every all_reduce the process group receives (ProcessGroup.allreduce), so that one made by hand shows, and
  what it held: a parameter's gradient (or a tensor of a parameter's shape), or another tensor (a loss, say);
- each parameter's .grad right after a backward accumulated into it (Tensor.register_post_accumulate_grad_hook),
  compared at the next forward after a backward inside no_sync(): a gradient changed in between by anything but a
  backward or a zeroing (clip_grad_norm_ on the partial, unsynchronised sum, say) shows;
- the gradient at each `optimizer.step()` (a step pre-hook), and the parameters after each call.

The model is small enough that DDP puts all its gradients in one bucket (its first bucket holds 1 MB), so one
synchronisation is one all_reduce. The inputs are scaled (INPUT_SCALE) so that the gradients are large: the large
batch's norm is 7.7 to 10.4 and one micro-batch's share at least 2.5, so that a clip_grad_norm_(max_norm=1.0) in
the wrong place acts and shows.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import weakref
from dataclasses import dataclass, field

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import labkit
from labkit.exercises._kit._group_call import GroupCall, Kind, wrap_group_method
from labkit.exercises.guard import Guard
from labkit.models import mlp

__all__ = ["CLASSES", "FEATURES", "INPUT_SCALE", "LR", "ROWS_PER_STEP", "STEPS", "AccumulationGuard",
           "SavedActivations", "StepRecord", "Watch", "accumulation_model", "attempt_accumulation", "flat_grads",
           "rank_microbatches", "step_batch", "warm_up"]

FEATURES, HIDDEN, CLASSES = 4, 8, 3
ROWS_PER_STEP = 24  # the large batch of one optimizer step, shared by the ranks and cut into micro-batches
STEPS = 3  # optimizer steps: a second step shows gradients never zeroed
LR = 0.05  # with INPUT_SCALE's large gradients, every mistake moves the parameters far, and no step diverges
INPUT_SCALE = 20.0  # the inputs' scale: gradient norms of 2.5 and more, so that a misplaced clip to 1.0 acts


def accumulation_model(device=None) -> torch.nn.Sequential:
    """The graded model: 4 features, one hidden layer of 8, 3 classes, float64, the same seed on every rank."""
    return mlp(features=FEATURES, hidden=HIDDEN, classes=CLASSES, layers=1, dtype=torch.float64).to(device)


def step_batch(step: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The large batch of optimizer step `step` (ROWS_PER_STEP rows), the same on every rank and in the grader."""
    generator = torch.Generator().manual_seed(100 + step)
    x = INPUT_SCALE * torch.randn(ROWS_PER_STEP, FEATURES, generator=generator, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (ROWS_PER_STEP,), generator=generator)
    return x.to(device), y.to(device)


def rank_microbatches(step: int, rank: int, world_size: int, microbatches: int, device=None) -> list:
    """Rank `rank`'s share of step `step`'s batch (a contiguous block of rows), cut into `microbatches` equal
    (x, y) micro-batches."""
    x, y = step_batch(step, device)
    rows = ROWS_PER_STEP // world_size
    mine = slice(rank * rows, (rank + 1) * rows)
    return list(zip(x[mine].chunk(microbatches), y[mine].chunk(microbatches), strict=True))


@dataclass
class StepRecord:
    """One call of the student's step on one rank: per forward of the DDP model, whether it ran inside no_sync()
    and how many later forwards ran before its backward reached it; forwards of the inner module; the buckets DDP
    all-reduced; what each all_reduce made by hand held; the calls the guard refused; after which micro-batches
    (1-based) a gradient changed before the next forward, by anything but a backward or a zeroing; the flat
    gradient at each optimizer.step(); whether no_sync() was entered at all; the parameters after the call; the
    forwards run without gradients; and, measured, which earlier micro-batches' saved activations were alive at
    each forward."""

    no_sync_forwards: list[bool] = field(default_factory=list)
    backward_lags: list[int | None] = field(default_factory=list)  # None: no backward reached that forward
    module_forwards: int = 0
    syncs: int = 0
    own_allreduces: list[str] = field(default_factory=list)  # "gradient", or what else the tensor was
    forbidden: list[str] = field(default_factory=list)  # what the step called that the guard switched off
    touched: list[int] = field(default_factory=list)  # micro-batches after whose backward .grad was changed
    step_grads: list[list[float]] = field(default_factory=list)
    entered_no_sync: bool = False
    params: list[float] = field(default_factory=list)
    evaluations: int = 0  # forwards under torch.no_grad() (an accuracy logged, say): no micro-batch, no graph
    still_alive: list[list[int]] = field(default_factory=list)  # per forward: the earlier micro-batches (1-based)
    # whose saved activations were still alive when it started


class Watch:
    """Hooks on one DDP model and its optimizer that fill `current`, the StepRecord of the call under way."""

    def __init__(self, ddp: torch.nn.parallel.DistributedDataParallel, optimizer: torch.optim.Optimizer):
        self.current = StepRecord()
        self.saved = SavedActivations(self)
        self.ddp = ddp
        self.in_sync = False  # True while DDP's own all_reduce runs (in the communication hook)
        self.accumulated: dict[int, torch.Tensor] = {}  # parameter index -> its .grad after its last accumulation
        self.parameters = list(ddp.module.parameters())
        for index, parameter in enumerate(self.parameters):
            parameter.register_post_accumulate_grad_hook(functools.partial(self._accumulated, index))
        ddp.register_forward_pre_hook(self._forward)
        ddp.register_forward_hook(self._forward_done)
        ddp.module.register_forward_pre_hook(self._module_forward)
        ddp.register_comm_hook(None, self._sync)
        optimizer.register_step_pre_hook(self._step)
        self._no_sync = ddp.no_sync
        ddp.no_sync = self._watched_no_sync

    def _forward(self, module, args) -> None:
        """Note whether this forward runs inside no_sync(), and whether .grad changed since the previous
        micro-batch's backward, when that one ran inside no_sync() before this forward (DDP's own write of the
        all-reduced gradient comes after the accumulation, so only a backward inside no_sync() is compared), and
        which earlier micro-batches' activations are still alive. A forward under torch.no_grad() (an accuracy
        logged) is no micro-batch: it builds no graph and DDP does not synchronise for it."""
        record = self.current
        if not torch.is_grad_enabled():
            record.evaluations += 1
            return
        record.still_alive.append(self.saved.alive_before(len(record.no_sync_forwards)))
        if record.no_sync_forwards and record.no_sync_forwards[-1] and record.backward_lags[-1] == 0 \
                and self._changed_since_backward():
            record.touched.append(len(record.no_sync_forwards))
        self.accumulated = {}
        record.no_sync_forwards.append(not self.ddp.require_backward_grad_sync)

    def _accumulated(self, index: int, parameter: torch.Tensor) -> None:
        self.accumulated[index] = parameter.grad.detach().clone()

    def _changed_since_backward(self) -> bool:
        """Whether some .grad differs from what the last backward left in it; a zeroing (every .grad zero or
        None: zero_grad()) does not count, the grader names that by its values."""
        grads = [p.grad for p in self.parameters]
        if all(g is None or not g.any() for g in grads):
            return False
        return any(grads[i] is None or not torch.equal(grads[i], saved) for i, saved in self.accumulated.items())

    def _forward_done(self, module, args, output) -> None:
        """Hook the forward's output, so that the record notes how many forwards had run when its backward
        reached it."""
        if not torch.is_grad_enabled():
            return
        record, index = self.current, len(self.current.no_sync_forwards) - 1
        record.backward_lags.append(None)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(functools.partial(_backward_reached, record, index))

    def _module_forward(self, module, args) -> None:
        if torch.is_grad_enabled():
            self.current.module_forwards += 1

    def _sync(self, state, bucket):
        """DDP's default reduction (divide by N, all_reduce), counted."""
        self.current.syncs += 1
        self.in_sync = True
        try:
            return default_hooks.allreduce_hook(None, bucket)
        finally:
            self.in_sync = False

    def _step(self, optimizer, args, kwargs) -> None:
        self.current.step_grads.append(flat_grads(self.ddp.module))

    @contextlib.contextmanager
    def _watched_no_sync(self):
        self.current.entered_no_sync = True
        with self._no_sync():
            yield


class SavedActivations:
    """What autograd saves for backward, per micro-batch, measured while it is alive: while the student's step
    runs, torch.autograd.graph.saved_tensors_hooks packs every saved tensor into a small holder, counted under
    the micro-batch whose forward is running; autograd drops the holder when it frees that graph (after a
    backward without retain_graph=True, or when the last reference to the loss goes), and a finalizer counts it
    out. Deterministic: CPython frees by reference counts (a collection is run before a graph is said alive,
    for graphs held in a cycle)."""

    def __init__(self, watch: Watch):
        self.watch = watch
        self.alive: dict[tuple[int, int], int] = {}  # (id of the step's record, micro-batch index) -> holders

    def hooks(self):
        """The context under which the student's step runs."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, tensor: torch.Tensor):
        holder = _Saved(tensor)
        key = (id(self.watch.current), len(self.watch.current.no_sync_forwards) - 1)
        self.alive[key] = self.alive.get(key, 0) + 1
        weakref.finalize(holder, self._released, key)
        return holder

    def _released(self, key: tuple[int, int]) -> None:
        self.alive[key] -= 1

    def alive_before(self, index: int) -> list[int]:
        """The micro-batches (1-based) before forward `index` of this call whose saved tensors are alive."""
        def held() -> list[int]:
            record = id(self.watch.current)
            return [i + 1 for (r, i), n in sorted(self.alive.items()) if r == record and 0 <= i < index and n]
        if held():
            gc.collect()  # a graph held only by a reference cycle is garbage, not memory kept on purpose
        return held()


class _Saved:
    """A tensor autograd saved for backward, held so that its life can be watched (a weakref to a Tensor would
    follow the tensor, which the model's parameters outlive)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _unpack(holder: _Saved) -> torch.Tensor:
    return holder.tensor


def _backward_reached(record: StepRecord, index: int, grad: torch.Tensor) -> None:
    """A tensor hook: the backward reached forward `index`'s output; note how many forwards ran after it."""
    if record.backward_lags[index] is None:
        record.backward_lags[index] = len(record.no_sync_forwards) - 1 - index


def flat_grads(model: torch.nn.Module) -> list[float]:
    """Every parameter's gradient, flattened into one list (zeros where .grad is None)."""
    return [v for p in model.parameters() for v in (p.grad if p.grad is not None else torch.zeros_like(p))
            .flatten().tolist()]


def warm_up() -> None:
    """On a rank: wrap the model in DDP once, so that what torch imports on DDP's first use is imported before a
    graded call's timeout starts."""
    torch.nn.parallel.DistributedDataParallel(accumulation_model(labkit.device()))


def attempt_accumulation(fn, microbatches: int) -> list[StepRecord]:
    """On a rank: STEPS calls of fn(ddp_model, optimizer, this rank's micro-batches), watched; one record each."""
    device = labkit.device()
    ddp = torch.nn.parallel.DistributedDataParallel(accumulation_model(device))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
    watch, records = Watch(ddp, optimizer), []
    for step in range(STEPS):
        watch.current, guard = StepRecord(), AccumulationGuard(watch)
        with guard, watch.saved.hooks():
            fn(ddp, optimizer, rank_microbatches(step, labkit.rank(), labkit.world_size(), microbatches, device))
        watch.current.forbidden = guard.forbidden
        watch.current.params = [v for p in ddp.module.parameters() for v in p.detach().flatten().tolist()]
        records.append(watch.current)
    return records


class AccumulationGuard(Guard):
    """While the student's step runs on a rank: every all_reduce made outside DDP's communication hook noted in
    watch.current.own_allreduces, with what it held, then made; every other way into torch.distributed's
    communication (broadcast, barrier, send, ...) raises ForbiddenCall: DDP does the step's communication."""

    def __init__(self, watch: Watch):
        super().__init__()
        self.watch = watch

    def install(self) -> None:
        """Every collective but all_reduce off; each all_reduce made outside DDP's own hook noted."""
        self.switch_off_torch_distributed(allowed=("all_reduce", "allreduce"), point_to_point=False)
        wrap_group_method(self, Kind.ALLREDUCE, self._counted)

    def _counted(self, call: GroupCall):
        """Note a ProcessGroup.allreduce (where dist.all_reduce arrives) made outside DDP's own hook, then make it."""
        if not self.watch.in_sync:
            self.watch.current.own_allreduces.append(_held(call.tensor, list(self.watch.ddp.module.parameters())))
        return call.proceed()


def _held(tensor: torch.Tensor, parameters: list) -> str:
    """What an all_reduce made by hand held: "gradient" for a parameter's .grad or a tensor of a parameter's
    shape (a copy of one), else the tensor's shape in words."""
    if any(p.grad is not None and p.grad.data_ptr() == tensor.data_ptr() or p.shape == tensor.shape
           for p in parameters):
        return "gradient"
    return "a scalar (a loss?)" if tensor.dim() == 0 else f"a tensor of shape {tuple(tensor.shape)}"
