"""On a rank, while check_average_gradients grades notebook 01's exercise: the training runs, the guard, and what
the student's function left behind.

Each case of a grading draws what a right solution must not depend on (`draw_case`): the model's sizes, the
batch's values, the lr and the number of SGD steps. Each rank builds the same small model (`labkit.models.mlp`,
float64, seeded the same everywhere), takes its own equal shard of one batch (`average_batch`) and trains, calling
the student's `fn(model)` between backward() and step(); then it does the same with a second model (another seed),
so a function that keeps something from an earlier call (a global, a class attribute) shows. While `fn` runs, an
`AverageGuard` is on: every all_reduce is recorded where the process group receives it (the kit's `Call`: what it
reduced, its values going in, with which op, and whether the student's code waited for it, through its handle or
its future: `WaitWatch`), everything else that communicates raises `ForbiddenCall`, and so do the ready-made
averages: torch's DistributedDataParallel, and labkit.parallel's average_gradients and BucketedDDP, which refuse
themselves wherever they run (`READY_MADE`: in a thread or a forked subprocess too) and are also found on the call
stack.
"""

from __future__ import annotations

import random
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

import labkit
from labkit.exercises._kit._group_call import GroupCall, Kind, wrap_group_method
from labkit.exercises._kit._record import Call, Recorder
from labkit.exercises._kit._runner import Case
from labkit.exercises._kit._stack import outermost_caller
from labkit.exercises.guard import Guard
from labkit.exercises.wait_watch import FUTURE_POLLS, WaitWatch, watch_waits
from labkit.models import mlp

__all__ = ["BATCH", "FUTURE_POLLS", "LR", "READY_MADE", "STEPS", "AverageGuard", "AverageOutcome", "OutOfStep",
           "attempt_average", "average_batch", "average_model", "draw_case", "made_of_gradients", "ready_made_caller",
           "reference_run", "sgd_step", "WaitWatch", "watch_waits"]

BATCH, STEPS, LR = 24, 3, 0.1  # 24 rows: 2, 3 and 4 ranks all get equal shards; STEPS and LR: the notebook's
MODELS = 2  # models trained one after the other in each case, the same sizes, other values
NOTEBOOK_SIZES = (6, 8)  # the notebook's model (features, hidden): never drawn, so sizes written in by hand show
READY_MADE = ("labkit.parallel's average_gradients", "labkit.parallel's BucketedDDP")
VALUES_TOLERANCE = 1e-9  # float64: values carried as they are, or divided by N, are within 1e-15
_KEY = 10 ** 9  # _check_in_step's key: (gradient's index + 1) x _KEY + numel, exact in float64
_READY_MADE_FILE = Path(labkit.__file__).parent / "parallel" / "data.py"  # average_gradients, BucketedDDP


def draw_case(world_size: int, rng: random.Random) -> Case:
    """One case on `world_size` ranks with what a right solution must not depend on drawn afresh, small enough that
    a run stays short: features 3-9 and hidden 4-10 (never a model as large as the notebook's 6-8-3, so a size
    written in by hand never fits), the batch's and the models' seeds, lr in [0.05, 0.5], 2-4 SGD steps."""
    notebook_numel = _numel(*NOTEBOOK_SIZES)
    while True:
        features, hidden = rng.randint(3, 9), rng.randint(4, 10)
        if _numel(features, hidden) != notebook_numel:
            break
    seeds = rng.sample(range(1, 10 ** 6), MODELS)
    return Case(world_size, {"features": features, "hidden": hidden, "seeds": tuple(seeds),
                             "batch_seed": rng.randrange(10 ** 6), "lr": round(rng.uniform(0.05, 0.5), 3),
                             "steps": rng.randint(2, 4)})


def _numel(features: int, hidden: int, classes: int = 3) -> int:
    """The number of parameters of average_model(features, hidden)."""
    return features * hidden + hidden + hidden * classes + classes


def made_of_gradients(values: list[float], grads: list[list[float]], world_size: int) -> bool:
    """Whether `values` (what went into an all_reduce) are some of `grads` (this rank's gradients of this call)
    one after the other, each once, all as they are or all divided by `world_size` (a division before the sum is
    right too): what checks that an all_reduce carried the gradients, not only that one was made."""
    return any(_segments(values, grads, scale) for scale in (1.0, 1.0 / world_size))


def _segments(values: list[float], grads: list[list[float]], scale: float) -> bool:
    """Whether `values` split into whole gradients of `grads` x scale, each used at most once."""
    position, unused = 0, list(range(len(grads)))
    while position < len(values):
        match = next((i for i in unused if grads[i] and _same(values[position:position + len(grads[i])],
                                                               [scale * x for x in grads[i]])), None)
        if match is None:
            return False
        position += len(grads[match])
        unused.remove(match)
    return bool(values)


def _same(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(abs(a - b) <= VALUES_TOLERANCE for a, b in zip(got, want, strict=True))


def average_model(device=None, features: int = 6, hidden: int = 8, seed: int = 0) -> torch.nn.Module:
    """The graded model: `features` features, one hidden layer of `hidden`, 3 classes, float64 (so float error
    stays far below any mistake), seeded: the same on every rank."""
    return mlp(features=features, hidden=hidden, classes=3, layers=1, seed=seed, dtype=torch.float64).to(device)


def average_batch(device=None, features: int = 6, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch (x, y), the same on every rank; rank r of N trains on rows [r B/N, (r + 1) B/N)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, features, generator=generator, dtype=torch.float64)
    return x.to(device), torch.randint(0, 3, (BATCH,), generator=generator).to(device)


def _case_model(case: Case, seed: int, device=None) -> torch.nn.Module:
    return average_model(device, case["features"], case["hidden"], seed)


def _case_batch(case: Case, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    return average_batch(device, case["features"], case["batch_seed"])


def reference_run(case: Case) -> tuple[list[list[list[float]]], list[list[list[float]]]]:
    """One process trained on the whole batch, each of the case's models in turn: every step's gradients (models
    one after the other), and each model's parameters at the end."""
    (x, y), grads, finals = _case_batch(case), [], []
    for seed in case["seeds"]:
        model = _case_model(case, seed)
        for _ in range(case["steps"]):
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            grads.append(_grads(model))
            sgd_step(model, case["lr"])
        finals.append(_weights(model))
    return grads, finals


def sgd_step(model: torch.nn.Module, lr: float = LR) -> None:
    """p -= lr x p.grad for every parameter: torch.optim.SGD's step without momentum, written out because building
    a torch optimizer imports torch._dynamo, seconds of CPU in every rank."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad


class AverageGuard(Guard):
    """While the student's fn(model) runs on a rank: all_reduce recorded (the kit's `Call`, with the values that
    went in), its work handles watched, everything else that communicates refused, and the ready-made averages (DDP,
    labkit.parallel's) refused."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.recorder = Recorder()
        mine = {id(p) for p in model.parameters()}
        self._memory = {"grad": _pointers(p.grad for p in model.parameters()),
                        "data": _pointers(p for p in model.parameters()),
                        "earlier": _pointers(p.grad for key, p in list(_graded.items()) if key not in mine)}
        named = list(model.named_parameters())
        self._names = [name for name, _ in named]
        self._index = {p.grad.untyped_storage().data_ptr(): i for i, (_, p) in enumerate(named) if p.grad is not None}

    @property
    def calls(self) -> list[Call]:
        """The all_reduces the student's code made, in order."""
        return self.recorder.calls

    def install(self) -> None:
        """All_reduce recorded and watched; everything else, and DDP, refused."""
        self.switch_off_torch_distributed(allowed=("all_reduce", "allreduce", "barrier"), point_to_point=False)
        self.switch_off(torch.nn.parallel.DistributedDataParallel, "__init__",
                        "torch.nn.parallel.DistributedDataParallel")
        self._record_allreduce()
        self.recorder.watch_waits(self)

    def refuse(self, spelling: str):
        """As Guard.refuse, naming labkit.parallel's ready-made average when that is what made the call."""
        ready_made = ready_made_caller()
        return super().refuse(f"labkit.parallel's {ready_made}" if ready_made else spelling)

    def unwaited(self) -> list[Call]:
        """The all_reduces whose handle nobody waited for; they are waited for now, so the ranks stay in step."""
        return self.recorder.unwaited()

    def _record_allreduce(self) -> None:
        def recorded(made: GroupCall):
            ready_made = ready_made_caller()
            if ready_made:
                self.refuse(f"labkit.parallel's {ready_made}")
            call = self.recorder.record(made, keep_values=True, target=self._target(made.tensor))
            self._check_in_step(made.original, made.group, made.tensor)
            return self.recorder.launched(made.proceed(), call)

        wrap_group_method(self, Kind.ALLREDUCE, recorded)

    def _check_in_step(self, allreduce, group, tensor: torch.Tensor) -> None:
        """Before each all_reduce, agree with the other ranks on what it reduces (a tiny all_reduce MAX of
        [size, gradient's index] and their negatives): ranks that reduce different gradients at the same moment
        raise OutOfStep here, which names both, instead of gloo summing unrelated tensors or aborting."""
        import torch.distributed as dist

        mine = (self._index.get(tensor.untyped_storage().data_ptr(), -1) + 1) * _KEY + tensor.numel()
        both = torch.tensor([mine, -mine], dtype=torch.float64, device=labkit.device())
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        _original_wait(allreduce(group, [both], options))
        largest, smallest = int(both[0]), -int(both[1])
        if largest == smallest:
            return
        raise OutOfStep(f"rank {labkit.rank()} all-reduced {self._describe(mine)} while another rank "
                        f"all-reduced {self._describe(smallest if mine == largest else largest)} at the same moment")

    def _describe(self, key: int) -> str:
        """What a key of _check_in_step names: a gradient (by its parameter's name) or another tensor."""
        index, numel = divmod(key, _KEY)
        return f"the gradient of {self._names[index - 1]} ({numel} elements)" if index else \
            f"a tensor of {numel} elements"

    def _target(self, tensor: torch.Tensor) -> str:
        pointer = tensor.untyped_storage().data_ptr()
        return next((kind for kind, pointers in self._memory.items() if pointer in pointers), "buffer")


class OutOfStep(RuntimeError):
    """Raised on every rank when the ranks' all_reduces at one moment reduce different gradients."""


def _original_wait(work) -> None:
    import torch.distributed as dist

    vars(dist.Work)["wait"](work)


def _pointers(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t is not None}


def ready_made_caller() -> str | None:
    """The ready-made average on the call stack (average_gradients, BucketedDDP.__init__, ...), or None."""
    return outermost_caller(lambda file, name: name if file == _READY_MADE_FILE else None)


@dataclass
class AverageOutcome:
    """What one rank's training left behind, per call of fn (the models one after the other, each step in
    order): its own gradients before fn and what fn left in .grad; each model's parameters at the end; every
    all_reduce fn made (the kit's `Call`, with the values that went in and `facts["call"]`, the index of the
    call of fn that made it), and those never waited for."""

    local: list[list[list[float]]] = field(default_factory=list)
    averaged: list[list[list[float]]] = field(default_factory=list)
    final: list[list[list[float]]] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    unwaited: list[Call] = field(default_factory=list)


# On a rank, by id: the parameters of every model given to fn, while alive (kept by fn, say): an all_reduce of
# their gradients during a later call is of something kept from an earlier one
_graded: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def attempt_average(fn, case: Case) -> AverageOutcome:
    """On a rank: for each of the case's models in turn, its SGD steps on this rank's shard, calling fn(model)
    under the guard after each backward; what happened, for the grader."""
    x, y = _case_batch(case, labkit.device())
    rows = slice(labkit.rank() * BATCH // labkit.world_size(), (labkit.rank() + 1) * BATCH // labkit.world_size())
    outcome = AverageOutcome()
    for seed in case["seeds"]:
        model = _case_model(case, seed, labkit.device())
        for _ in range(case["steps"]):
            model.zero_grad()
            F.cross_entropy(model(x[rows]), y[rows]).backward()
            outcome.local.append(_grads(model))
            _graded_call(fn, model, outcome)
            outcome.averaged.append(_grads(model))
            sgd_step(model, case["lr"])
        outcome.final.append(_weights(model))
    return outcome


def _graded_call(fn, model: torch.nn.Module, outcome: AverageOutcome) -> None:
    """fn(model) under an AverageGuard; its all_reduces (and those left unwaited, then waited) into outcome."""
    _graded.update((id(p), p) for p in model.parameters())
    guard = AverageGuard(model)
    with guard:
        fn(model)
    for call in guard.calls:
        call.facts["call"] = len(outcome.averaged)
    outcome.calls.extend(guard.calls)
    outcome.unwaited.extend(guard.unwaited())


def _grads(model: torch.nn.Module) -> list[list[float]]:
    return [p.grad.flatten().tolist() if p.grad is not None else [] for p in model.parameters()]


def _weights(model: torch.nn.Module) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in model.parameters()]
