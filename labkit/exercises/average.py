"""The grader of notebook 01's "your turn": gradients averaged by hand after backward(), on real ranks.

`check_average_gradients(fn)` trains small models on 3, 2 and 4 ranks, each rank on its own equal shard of one batch,
a few SGD steps, calling the student's `fn(model)` between backward() and optimizer.step(). `fn` should replace every
parameter's .grad by its average over the ranks: dist.all_reduce (SUM), then divide by N (Li et al., "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020, 3.2.1). Because the loss is a mean and
the shards are equal, that average is the gradient of the whole batch in one process.

What a right solution must not depend on is drawn afresh for each case of each grading (`draw_case`): the model's
sizes (never the notebook's), the batch's values, the lr and the number of steps (2-4); and each case trains two
models one after the other, so that a function that keeps something from an earlier call fails. It runs on the
graders' kit (`labkit.exercises._kit._runner`: one `Spec`, the one rule after a RankError). A solution passes only
if, on every case, on every rank:

- it communicated through dist.all_reduce only (torch's DistributedDataParallel and labkit.parallel's
  average_gradients and BucketedDDP do the exercise for you and are switched off, where they run: from a thread
  or a forked subprocess too), reduced the gradients rather than the parameters, with ReduceOp.SUM (or AVG), and
  waited for every async_op=True handle: handle.wait(), a loop on handle.is_completed(), or its future's wait()
  (handle.get_future().wait(), torch.futures.wait_all); taking the future, chaining then() on it, or a loop on its
  done() or value(), does not wait (on GPUs done() is True once the all_reduce is queued: _kit/_wait_watch.py);
- what every all_reduce took in is this rank's gradients of this call (one, or several flattened together, as
  they are or already divided by N): counting that an all_reduce was made is not checking that it averaged the
  gradients (a scratch tensor all-reduced while the average came from elsewhere fails);
- after fn, every gradient equals the full-batch gradient of one process (float64, within 1e-9), at every step
  of every model;
- the replicas stay identical, and equal to one process trained on the whole batch.

On a rank (the first half of this file): the training runs, the guard, and what the student's function left
behind.

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
from labkit.exercises._kit._guard import Guard
from labkit.exercises._kit._messages import failure_sentence, first_failure, hang_message
from labkit.exercises._kit._record import Call, Recorder
from labkit.exercises._kit._runner import Case, Spec, grade
from labkit.exercises._kit._stack import outermost_caller
from labkit.exercises._kit._wait_watch import FUTURE_POLLS
from labkit.exercises.allreduce import TIMEOUT_SECONDS
from labkit.exercises.progress import graded
from labkit.exercises.verdict import Verdict
from labkit.models import mlp

__all__ = ["BATCH", "READY_MADE", "AverageGuard", "OutOfStep", "attempt_average", "average_batch",
           "check_average_gradients", "draw_case", "made_of_gradients", "reference_run", "sgd_step",
           "with_dead_rank"]  # what ddp_hook.py shares and the tests call; the rest is this file's own


# ==== on a rank: the model, the run, the guard =====================================================================

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
                             "steps": rng.randint(2, 4), "dead_rank": None})


def with_dead_rank(case: Case, rng: random.Random) -> Case:
    """`case` with the hidden layer dead on one drawn rank's shard (_case_model, _case_batch): there the first
    layer's gradients are exactly zero while the other ranks' are not, so a solution that skips a gradient that is
    zero on its rank ("nothing to average") leaves the other ranks a call behind, as a dead ReLU unit, a class
    missing from a shard or an unused branch would in real training."""
    return Case(case.world_size, {**case.drawn, "dead_rank": rng.randrange(case.world_size)})


def _numel(features: int, hidden: int, classes: int = 3) -> int:
    """The number of parameters of average_model(features, hidden)."""
    return features * hidden + hidden + hidden * classes + classes


def made_of_gradients(values: list[float], grads: list[list[float]], world_size: int) -> bool:
    """Whether `values` (what went into an all_reduce) are some of `grads` (this rank's gradients of this call)
    one after the other, each once, all as they are or all divided by `world_size` (a division before the sum is
    right too): what checks that an all_reduce carried the gradients, not only that one was made."""
    return any(_segments(values, grads, scale) for scale in (1.0, 1.0 / world_size))


def _segments(values: list[float], grads: list[list[float]], scale: float) -> bool:
    """Whether `values` split into whole gradients of `grads` x scale, each used at most once. A search, not a
    greedy match: gradients may be equal (all zero where a layer is dead), and the first that fits may not be the
    one that went in."""
    def fits(position: int, unused: frozenset[int]) -> bool:
        if position == len(values):
            return True
        return any(fits(position + len(grads[i]), unused - {i}) for i in sorted(unused)
                   if grads[i] and _same(values[position:position + len(grads[i])], [scale * x for x in grads[i]]))

    return bool(values) and fits(0, frozenset(range(len(grads))))


def _same(got: list[float], want: list[float]) -> bool:
    """Equal within VALUES_TOLERANCE, relative to the value's size beyond 1: a wrong solution's training may grow
    its gradients large (or to inf and NaN, equal to themselves here) while they are still what went in."""
    return len(got) == len(want) and all(_close(a, b) for a, b in zip(got, want, strict=True))


def _close(a: float, b: float) -> bool:
    return a == b or (a != a and b != b) or abs(a - b) <= VALUES_TOLERANCE * max(1.0, abs(b))


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
    """The case's model; with a dead rank (with_dead_rank), its first layer's weights positive and biases negative,
    so that the dead rank's inputs, all negative, switch every hidden ReLU off there (relu'(z) = 0 for z < 0)."""
    model = average_model(device, case["features"], case["hidden"], seed)
    if case.drawn.get("dead_rank") is not None:
        first = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
        with torch.no_grad():
            first.weight.abs_()
            first.bias.abs_().neg_()
    return model


def _case_batch(case: Case, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The case's whole batch; with a dead rank, that rank's rows all negative (_case_model)."""
    x, y = average_batch(device, case["features"], case["batch_seed"])
    dead = case.drawn.get("dead_rank")
    if dead is not None:
        shard = BATCH // case.world_size
        x[dead * shard:(dead + 1) * shard] = -x[dead * shard:(dead + 1) * shard].abs()
    return x, y


def reference_run(case: Case, model_of=None) -> tuple[list[list[list[float]]], list[list[list[float]]]]:
    """One process trained on the whole batch, each of the case's models in turn: every step's gradients (models
    one after the other), and each model's parameters at the end. `model_of(case, seed)` builds a model: this
    grader's by default; notebook 04's grader passes its own."""
    (x, y), grads, finals = _case_batch(case), [], []
    for seed in case["seeds"]:
        model = (model_of or _case_model)(case, seed)
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
        # The gradients as backward() left them, kept alive while the guard is on: a solution that rebinds p.grad
        # frees them, and a tensor it allocates next (a clone) could take a freed address on some ranks and not on
        # others, which _check_in_step and _target would read as a gradient there and a buffer here.
        # The same for earlier models' gradients (a garbage collection during fn may free a model no one holds).
        self._kept = [p.grad for p in model.parameters()] + [p.grad for p in list(_graded.values())]
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


# ==== in the notebook: the grader ==================================================================================

AVERAGE_CASES = (3, 2, 4)  # three first: rank + 1, N - 1 and N differ there
TOLERANCE = 1e-9  # float64: a right average is within 1e-15; every mistake is off by far more
_NAMES = [name for name, _ in average_model().named_parameters()]  # the same whatever the sizes drawn
_ORDINAL = ("first", "second", "third")
_KEPT = ("something was kept from an earlier call (the parameters, their gradients or a buffer, on a global, a "
         "default argument or a class attribute). Your function is called on every step, and on more than one model: "
         "average the gradients of the model it is given, each time.")


@graded("average_gradients")
def check_average_gradients(fn, *, timeout_seconds: float = TIMEOUT_SECONDS) -> Verdict:
    """Grade `fn(model)`: every parameter's .grad replaced by its average over the ranks (module docstring).

    Example::

        >>> import torch.distributed as dist
        >>> def summed(model):                       # all-reduced, but never divided by N
        ...     for p in model.parameters():
        ...         dist.all_reduce(p.grad)
        >>> check_average_gradients(summed)
        Not yet. On 3 ranks (a batch of 24 rows, 8 per rank; ...is 3x one process's...summed, not averaged.
    """
    return grade(SPEC, fn, timeout_seconds=timeout_seconds)


def _draw_cases() -> list[Case]:
    """The cases of one grading, drawn afresh (draw_case)."""
    rng = random.Random()
    cases = [draw_case(world_size, rng) for world_size in AVERAGE_CASES]
    return [*cases[:-1], with_dead_rank(cases[-1], rng)]  # the last: most of the catalogue fails before it


def _describe(case: Case) -> str:
    """How a verdict starts: the ranks, the batch, and what was drawn for the case."""
    n = case.world_size
    return (f"On {n} ranks (a batch of {BATCH} rows, {BATCH // n} per rank; models of {case['features']} features "
            f"and {case['hidden']} hidden units, lr {case['lr']:g}, {case['steps']} SGD steps each"
            + (f"; the hidden layer dead on rank {case['dead_rank']}'s shard, its gradients zero there"
               if case.drawn.get("dead_rank") is not None else "") + ")")


def _passed(cases) -> str:
    return ("on 2, 3 and 4 ranks, with the model's sizes, the batch, the lr and the number of steps drawn afresh, "
            f"and {MODELS} models in turn (on 4 ranks one rank's hidden layer dead on its shard, its gradients zero), "
            "every all_reduce carried the rank's own gradients, and after your "
            "function every rank's gradients equal the gradient of the whole batch in one process, at each SGD "
            "step; the replicas stayed identical and equal to one process trained on the whole batch. That is "
            "data parallelism: one all_reduce (SUM) per gradient, then a division by N.")


def _calls_problem(outcomes, case: Case) -> str | None:
    """An all_reduce of the wrong thing, with the wrong op, or never waited for; else None."""
    for rank, outcome in enumerate(outcomes):
        if not outcome.calls:
            return (f"rank {rank} made no all_reduce: each rank kept its own gradient, so the replicas step with "
                    "different gradients.")
        call = next((c for c in outcome.calls if c.op not in ("SUM", "AVG")), None)
        if call:
            return (f"rank {rank} all-reduced with ReduceOp.{call.op}: that keeps the {call.op.lower()} over the "
                    "ranks, not their sum.")
        if any(c.target == "data" for c in outcome.calls):
            return (f"rank {rank} all-reduced a parameter's values (p or p.data), not its gradient: that sums the "
                    "weights over the ranks, while the gradients that backward() left in p.grad stay each rank's own.")
        if any(c.target == "earlier" for c in outcome.calls):
            return (f"rank {rank} all-reduced the gradients of a model from an earlier call of your function, not "
                    f"those of the model it was given: {_KEPT}")
        if outcome.unwaited:
            return _unwaited_message(rank, outcome, case)
    return None


def _unwaited_message(rank: int, outcome, case: Case) -> str:
    """All_reduces started with async_op=True that nobody waited for: through their handle, or their future."""
    futures = [call for call in outcome.unwaited if call.future]
    if not futures:
        return (f"rank {rank} started {len(outcome.unwaited)} all_reduce(s) with async_op=True and never called "
                "wait() on the handle: the values were read (and divided, and stepped with) before the "
                "reduction finished.")
    waited = sum(call.future for call in outcome.calls) - len(futures)
    others = f", though it waited for {waited} other(s): one future's wait() promises only its own all_reduce" \
        if waited else ""
    return (f"rank {rank} took the futures (handle.get_future()) of {len(futures)} all_reduce(s) with "
            f"async_op=True in {len(outcome.averaged)} calls of your function ({MODELS} models, {case['steps']} "
            f"SGD steps each) and never waited for them{others}. get_future() and then() do not wait: the "
            "gradients were read (and divided, and stepped with) before the reduction finished, or changed later "
            f"under a callback. {FUTURE_POLLS}")


def _contents_problem(outcomes, case: Case) -> str | None:
    """What every all_reduce took in must be this rank's gradients of this call (as they are, or divided by N,
    one or several flattened together): else it reduced a scratch tensor, or gradients kept from an earlier call."""
    n = case.world_size
    for rank, outcome in enumerate(outcomes):
        for call in outcome.calls:
            index = call.facts["call"]
            if made_of_gradients(call.values, outcome.local[index], n):
                continue
            where = _where(index, case)
            earlier = [grads for i in range(index) for grads in (outcome.local[i], outcome.averaged[i])]
            if any(made_of_gradients(call.values, grads, n) for grads in earlier):
                return (f"{where} rank {rank} all-reduced gradients of an earlier call of your function, not this "
                        "call's: something was kept from an earlier call (the parameters or their gradients on a "
                        "global, a default argument or a class attribute). Work on the model you are given, each "
                        "time.")
            total = sum(len(g) for g in outcome.local[index])
            if call.numel and call.nbytes != 8 * call.numel:
                return (f"{where} rank {rank} all-reduced a buffer of {call.nbytes // call.numel}-byte numbers, "
                        "while the gradients are float64 (8 bytes): the sum lost precision on the way. Make the "
                        "buffer in the gradients' dtype (torch.cat keeps it; torch.zeros(..., dtype=p.grad.dtype)).")
            return (f"{where} rank {rank} all-reduced a tensor of {call.numel} numbers whose values are not its "
                    f"gradients (this model's gradients hold {total} numbers): an all_reduce of a scratch tensor, "
                    "while the average came from elsewhere (or from sizes written in by hand, which change here), "
                    "is not the gradients averaged by it. All-reduce the gradients themselves (or a flat copy of "
                    "them) and take the average from what comes back.")
    return None


def _where(index: int, case: Case) -> str:
    """'On the second model, at SGD step 2 of 3,': which call of fn `index` is."""
    model, step = divmod(index, case["steps"])
    return f"on the {_ORDINAL[model]} model, at SGD step {step + 1} of {case['steps']},"


def _values_problem(outcomes, case: Case) -> str | None:
    """Gradients after fn against the whole batch's, call by call; then the replicas and the trained models."""
    ref_grads, ref_finals = reference_run(case)
    world_size = len(outcomes)
    for index, reference in enumerate(ref_grads):
        problem = _step_problem([o.averaged[index] for o in outcomes], [o.local[index] for o in outcomes],
                                reference, world_size, [o.averaged[:index] for o in outcomes])
        if problem:
            return f"{_where(index, case)} {problem}"
    for model, ref_final in enumerate(ref_finals):
        for rank, outcome in enumerate(outcomes):
            said = f"after the {_ORDINAL[model]} model's {case['steps']} steps"
            if _gap(outcome.final[model], outcomes[0].final[model]) > TOLERANCE:
                return f"the replicas drifted apart: rank {rank}'s parameters differ from rank 0's {said}."
            if _gap(outcome.final[model], ref_final) > TOLERANCE:
                return (f"rank {rank}'s model {said} differs from one process trained on the whole batch by "
                        f"{_gap(outcome.final[model], ref_final):.3g}: did your function change anything but .grad?")
    return None


def _step_problem(averaged, local, reference, world_size: int, before) -> str | None:
    """One call of fn: which parameters kept their own gradient, a result kept from an earlier call, or by what
    factor every gradient is off, per rank."""
    wrong = [[i for i, (got, want) in enumerate(zip(grads, reference, strict=True)) if _gap([got], [want]) > TOLERANCE]
             for grads in averaged]
    if not any(wrong):
        return None
    rank = next(r for r, w in enumerate(wrong) if w)
    if any(_gap(averaged[rank], earlier) <= TOLERANCE for earlier in before[rank]):
        return f"rank {rank}'s gradients after your function are what it left at an earlier step: {_KEPT}"
    kept = [i for i in wrong[rank] if _gap([averaged[rank][i]], [local[rank][i]]) <= TOLERANCE]
    if kept and len(kept) < len(reference):
        return (f"rank {rank}'s gradients of {_named(kept)} are still its own (not averaged), while "
                f"{_named([i for i in range(len(reference)) if i not in kept])} were: those parameters were left "
                "out of the average.")
    if kept:
        return f"rank {rank}'s gradients are all still its own: the average never reached p.grad."
    divisors = [_divisor(grads, reference, world_size) for grads in averaged]
    return _factor_message(rank, divisors, world_size, _named(wrong[rank][:1])) or (
        f"rank {rank}'s gradient of {_named(wrong[rank][:1])} differs from one process's on the whole batch by "
        f"{_gap([averaged[rank][wrong[rank][0]]], [reference[wrong[rank][0]]]):.3g}: it is neither its own "
        "gradient nor the average over the ranks.")


def _divisor(grads, reference, world_size: int) -> float | None:
    """d when grads = sum over ranks / d (the whole batch's gradient is sum / N), for one d; else None."""
    flat_got = [x for g in grads for x in g]
    flat_want = [x * world_size for g in reference for x in g]
    scale = sum(a * b for a, b in zip(flat_got, flat_want, strict=True)) / sum(b * b for b in flat_want)
    if scale == 0 or _gap([flat_got], [[scale * b for b in flat_want]]) > TOLERANCE * world_size:
        return None
    return round(1 / scale, 6)


def _factor_message(rank: int, divisors: list[float | None], world_size: int, name: str) -> str | None:
    """The message for gradients off by one factor: not divided, divided by the wrong N, or twice; `name` is the
    first wrong parameter's, where the factor shows."""
    d = divisors[rank]
    if d is None:
        return None
    if len(set(divisors)) > 1 and None not in divisors:
        each = ", ".join(f"rank {r}: {x:g}" for r, x in enumerate(divisors))
        return (f"the ranks divided the sum by different numbers ({each}): a divisor that depends on the rank, "
                "so the replicas step differently.")
    said = f"rank {rank}'s gradient of {name} is"
    if d == 1:
        return (f"{said} {world_size}x one process's on the whole batch: the {world_size} ranks' gradients were "
                "summed, not averaged.")
    if abs(d - world_size ** 2) < 1e-6:
        return (f"{said} 1/{world_size} of one process's: the sum over the ranks was divided by N twice (by {d:g} "
                f"= {world_size}^2). ReduceOp.AVG, if you used it, already divides.")
    return f"{said} the sum over the ranks divided by {d:g}, not by N = {world_size}: a number other than N."


def _gap(got, want) -> float:
    """The largest absolute difference between two lists of lists of floats (inf if their shapes differ)."""
    if [len(g) for g in got] != [len(w) for w in want]:
        return float("inf")
    return max((abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True)), default=0.0)


def _named(indices: list[int]) -> str:
    return ", ".join(_NAMES[i] for i in indices)


def _hang_message(hang: labkit.RankTimeout, case: Case, timeout_seconds: float) -> str:
    """A run that never finished: where the first ranks waited, and why all_reduce waits."""
    return hang_message(hang, timeout_seconds, "a rank waited in an all_reduce that the others did not join with "
                                               "the same tensor. Every rank must all-reduce the same gradients in "
                                               "the same order.")


def _error_message(error: labkit.RankError, attempts, case: Case) -> str:
    """A run that raised (not a refused call: the runner says those): ranks out of step, else the first rank's
    error, and what the ranks reduced, or what was drawn when the sizes did not fit."""
    first, _ = first_failure(error)
    if first.raised(OutOfStep) and first.exception_args:
        said = str(first.exception_args[0]).strip().removesuffix(".")
        return (f"{said}: the ranks all-reduced the gradients in different orders. On real "
                "ranks that sums unrelated tensors, or hangs, or aborts (gloo: 'Received data size doesn't match "
                "expected size'). Every rank must all-reduce the same gradients in the same order, whatever the rank "
                "and whatever its values: a rank that skips a gradient (one that is zero on its shard, say) leaves "
                "the others a call behind.")
    message = f"{failure_sentence(first)}."
    sizes = [[call.numel for call in attempt.calls] for attempt in attempts] if attempts else None
    if "AVG" in first.summary:
        message += " gloo has no ReduceOp.AVG (NCCL has): on gloo the average is built from a sum."
    elif sizes and any(s != sizes[0] for s in sizes):
        message += (f" The ranks all-reduced tensors of different sizes in turn (rank 0: {sizes[0]}, rank "
                    f"{next(r for r, s in enumerate(sizes) if s != sizes[0])}: "
                    f"{next(s for s in sizes if s != sizes[0])} elements): every rank must reduce the same "
                    "gradients in the same order.")
    elif any(word in first.summary for word in ("size", "shape", "split")):
        message += (f" The model's sizes are drawn for each grading (here {case['features']} features and "
                    f"{case['hidden']} hidden units, not the notebook's 6 and 8), and each case trains {MODELS} "
                    "models: sizes written into your function, or a tensor kept from an earlier call (on a global or "
                    "a class attribute), do not fit. Take them from this call's gradients (p.grad.numel(), "
                    "p.grad.shape).")
    return message


def _why_forbidden(spelling: str, name: str) -> str:
    """Why the call `spelling` is switched off while the gradient average is graded, and what to use instead."""
    if "labkit.parallel" in spelling or "DistributedDataParallel" in spelling:
        return "That is a ready-made average, which does the exercise for you: it is switched off here."
    return ("This exercise allows one collective only, dist.all_reduce: other communication is switched off "
            "while it is graded.")


SPEC = Spec(attempt=attempt_average, cases=_draw_cases, checks=(_calls_problem, _contents_problem, _values_problem),
            describe=_describe, why_forbidden=_why_forbidden, on_hang=_hang_message, on_error=_error_message,
            passed=_passed, example="check_average_gradients(average_gradients)", ready_made=READY_MADE)
