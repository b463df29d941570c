"""labkit.parallel.ThreeDGPT on real gloo processes: the small GPT trained with data, pipeline and tensor parallelism
on one Mesh equals one process (float64, 20 AdamW steps on the lesson text, losses and every parameter within
1e-10) for dp=2 x pp=2 x tp=2 on 8 ranks (with BucketedDDP, ZeRO-1 and ZeRO-2 on the dp axis), every 2-axis
layout on 4 ranks, 1 x 1 x 1, sequence parallelism and interleaved 1F1B, and so does torch's own 2D parallelism
(DeviceMesh, parallelize_module, fully_shard); every rank's traffic, counted per axis, equals
labkit.plan.axis_traffic to the byte; its training state equals plan's memory; the pipeline idles as
plan.bubble_fraction says, within 15%; layouts that do not fit are refused on every rank alike. Each layout group
is one labkit.run."""

import copy
import logging
import warnings

import pytest
import torch
import torch.distributed as dist
from test_tensor_parallel_gpt_torch import TorchBlock, TorchEmbeddings, torch_plan
from torch import nn

import labkit
from labkit.models import TinyGPT, char_batches, lesson_text, next_token_loss
from labkit.parallel import AXES, Mesh, ThreeDGPT, count_collectives
from labkit.plan import bubble_fraction

VOCAB = len(set(lesson_text()))  # 82 characters
STEPS, BATCH, LENGTH, LR = 20, 16, 32, 1e-2
TOLERANCE = 1e-10


def model(**sizes):
    return TinyGPT(VOCAB, tied=False, **sizes).double()  # d_model 32, 4 heads, 2 blocks, context 32, seed 0


def batches(steps=STEPS):
    return list(char_batches(lesson_text(), BATCH, LENGTH, steps, seed=0))


def one_process(steps=STEPS):
    """The plain model on the whole batch: its losses and final parameters."""
    full = model()
    optimizer = torch.optim.AdamW(full.parameters(), lr=LR)
    losses = []
    for inputs, targets in batches(steps):
        optimizer.zero_grad()
        loss = next_token_loss(full(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in full.named_parameters()}


def train(dp, pp, tp, sequence_parallel=False, microbatches=2, schedule="1f1b", chunks=1, zero_stage=0):
    """STEPS steps of ThreeDGPT: the losses, the full parameters (rank 0 only), the traffic counted per axis over
    the steps and the plan's for one step, and the training state held against the plan's."""
    run = ThreeDGPT(model(), Mesh(dp, pp, tp), microbatches, schedule, chunks, sequence_parallel, zero_stage, lr=LR)
    with count_collectives() as counted:
        losses = [run.train_step(inputs, targets) for inputs, targets in batches()]
    state = run.full_state_dict()
    per_axis = {axis: dict(traffic.nbytes) for axis, traffic in counted.by_axis(run.mesh).items()}
    return {"losses": losses, "state": state if labkit.rank() == 0 else None, "counted": per_axis,
            "planned": run.planned_traffic(BATCH), "memory": (run.measured_memory(), run.planned_memory())}


def check_run(results, expected, layout):
    """Every rank's losses equal one process's; rank 0's parameters too; each axis's bytes over the steps equal
    STEPS x the plan's, nothing on any other group; the weights, gradients and AdamW state held equal the plan."""
    losses, params = expected
    for rank, result in enumerate(results):
        worst = max(abs(a - b) for a, b in zip(result["losses"], losses, strict=True))
        assert worst <= TOLERANCE, (layout, rank, worst)
        assert set(result["counted"]) == set(AXES), (layout, rank, result["counted"])  # nothing off the axes
        for axis in AXES:
            counted = {kind: n for kind, n in result["counted"][axis].items() if n}
            assert counted == {kind: STEPS * n for kind, n in result["planned"][axis].items()}, (layout, rank, axis)
        measured, planned = result["memory"]
        assert {part: measured[part] for part in planned} == planned, (layout, rank, measured, planned)
    state = results[0]["state"]
    assert list(state) == list(params), layout
    errors = {name: (state[name] - p).abs().max().item() for name, p in params.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOLERANCE, (layout, worst, errors[worst])


@pytest.fixture(scope="module")
def expected():
    return one_process()


EIGHT = [dict(dp=2, pp=2, tp=2), dict(dp=2, pp=2, tp=2, zero_stage=1),
         dict(dp=2, pp=2, tp=2, sequence_parallel=True, zero_stage=2)]  # sequence parallelism with DDP: on 4 ranks


def eight_ranks():
    return [train(**layout) for layout in EIGHT]


def test_dp2_pp2_tp2_on_8_ranks_trains_as_one_process(expected):
    per_rank = labkit.run(eight_ranks, world_size=8, timeout=240)
    for i, layout in enumerate(EIGHT):
        check_run([results[i] for results in per_rank], expected, layout)


FOUR = [dict(dp=2, pp=1, tp=2, microbatches=1), dict(dp=2, pp=2, tp=1), dict(dp=1, pp=2, tp=2),
        dict(dp=2, pp=1, tp=2, microbatches=1, sequence_parallel=True),
        dict(dp=1, pp=2, tp=2, sequence_parallel=True, schedule="interleaved", chunks=2)]


def torch_2d():
    """torch's own 2D parallelism on the same GPT: init_device_mesh with ("dp", "tp"), parallelize_module with
    torchtitan's plan on the tp axis (ColwiseParallel / RowwiseParallel), fully_shard (FSDP2) on the dp axis, each
    replica on its half of the batch. The losses and, on rank 0, the full parameters under labkit's names."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)  # full_tensor's 2 gathers
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # a view returned: nothing edits it in place
    mesh = init_device_mesh(labkit.device().type, (2, 2), mesh_dim_names=("dp", "tp"))
    full = model()
    layers = [TorchEmbeddings(full[0]), *(TorchBlock(block) for block in full.blocks), copy.deepcopy(full[-1])]
    net = parallelize_module(nn.Sequential(*layers), mesh["tp"], torch_plan(False, len(full.blocks)))
    for layer in net:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(net, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR)
    rows = slice(mesh.get_local_rank("dp") * BATCH // 2, (mesh.get_local_rank("dp") + 1) * BATCH // 2)
    losses = []
    for inputs, targets in batches():
        optimizer.zero_grad()
        loss = next_token_loss(net(inputs[rows]), targets[rows])
        loss.backward()
        optimizer.step()
        both = loss.detach().clone()
        dist.all_reduce(both, group=mesh.get_group("dp"))
        losses.append(both.item() / 2)
    params = {name: p.full_tensor().detach().clone() for name, p in net.named_parameters()}
    for i in range(1, len(full.blocks) + 1):
        for kind in ("weight", "bias"):
            params[f"{i}.qkv.{kind}"] = torch.cat([params.pop(f"{i}.{name}.{kind}") for name in "qkv"])
    return {"losses": losses, "state": params if labkit.rank() == 0 else None}


def emulated_bubble(steps=8):
    """pp=2 x tp=2, 4 micro-batches, each stage's forward emulated to last 20 ms and its backward 40 ms: the idle
    share of a step, measured, the best of `steps` steps (load on a shared machine mostly adds idle time)."""
    run = ThreeDGPT(model(), Mesh(dp=1, pp=2, tp=2), microbatches=4, lr=LR)
    bubbles = []
    for inputs, targets in batches(steps):
        run.train_step(inputs, targets, emulate_compute_seconds=(0.02, 0.04))
        bubbles.append(run.pipeline_bubble())
    return min(bubbles)


def four_ranks():
    return [train(**layout) for layout in FOUR], torch_2d(), emulated_bubble()


def test_2_axis_layouts_on_4_ranks_train_as_one_process_and_as_torch_2d_and_idle_as_planned(expected):
    per_rank = labkit.run(four_ranks, world_size=4, timeout=240)
    for i, layout in enumerate(FOUR):
        check_run([ours[i] for ours, _, _ in per_rank], expected, layout)
    losses, params = expected
    for rank, (_, theirs, _) in enumerate(per_rank):  # torch's DeviceMesh + parallelize_module + fully_shard
        worst = max(abs(a - b) for a, b in zip(theirs["losses"], losses, strict=True))
        assert worst <= TOLERANCE, (rank, worst)
    state = per_rank[0][1]["state"]
    assert sorted(state) == sorted(params)
    assert max((state[name] - p).abs().max().item() for name, p in params.items()) <= TOLERANCE
    formula = bubble_fraction(2, 4)  # (p-1)/(m+p-1) = 1/5
    for rank, (_, _, bubble) in enumerate(per_rank):  # the pipeline's idle share, within 15% of the formula
        assert abs(bubble - formula) <= 0.15 * formula, (rank, bubble, formula)


def test_one_by_one_by_one_trains_as_one_process(expected):
    check_run(labkit.run(train, 1, 1, 1, world_size=1, timeout=120), expected, "1 x 1 x 1")


# --- Layouts that do not fit: the same clear error on every rank, before the ranks wait on each other ---

def refusals():
    """Each bad layout or batch, and what each rank got: its message, or None if nothing was raised."""
    cases = {
        "heads": lambda: ThreeDGPT(TinyGPT(VOCAB, heads=2, d_model=16, tied=False), Mesh(dp=1, pp=1, tp=4)),
        "layers": lambda: ThreeDGPT(TinyGPT(VOCAB, layers=1, tied=False), Mesh(dp=1, pp=4, tp=1)),
        "tied": lambda: ThreeDGPT(TinyGPT(VOCAB), Mesh(dp=2, pp=2, tp=1)),
        "batch": lambda: ThreeDGPT(model(), Mesh(dp=2, pp=1, tp=2), microbatches=2).train_step(
            torch.zeros(6, 8, dtype=torch.long), torch.zeros(6, 8, dtype=torch.long)),
        "sequence": lambda: ThreeDGPT(model(), Mesh(dp=1, pp=1, tp=4), sequence_parallel=True).train_step(
            torch.zeros(2, 6, dtype=torch.long), torch.zeros(2, 6, dtype=torch.long)),
        "schedule": lambda: ThreeDGPT(model(), Mesh(dp=2, pp=2, tp=1), microbatches=3, schedule="interleaved",
                                      chunks=2),
        "seeds": lambda: ThreeDGPT(TinyGPT(VOCAB, tied=False, seed=labkit.rank() % 2), Mesh(dp=2, pp=2, tp=1)),
        "batches": lambda: ThreeDGPT(model(), Mesh(dp=2, pp=2, tp=1)).train_step(
            torch.full((4, 8), labkit.rank() // 2), torch.zeros(4, 8, dtype=torch.long)),
        "model": lambda: ThreeDGPT(torch.nn.Linear(2, 2), Mesh(dp=4)),
    }
    said = {}
    for name, case in cases.items():
        try:
            case()
            said[name] = None
        except (TypeError, ValueError) as error:
            said[name] = str(error)
    return said


WHAT_IT_SAYS = {
    "heads": "tp=4: 2 heads do not split over 4 tensor-parallel ranks",
    "layers": "pp=4 x chunks=1: 4 pipeline pieces, but the model has 3 layers",
    "tied": "use an untied model",
    "batch": "batch=6: the batch is cut over dp=2 replicas x microbatches=2, 4 equal parts",
    "sequence": "sequence=6: sequence parallelism cuts each sequence over tp=4 ranks",
    "schedule": "microbatches=3: interleaving runs micro-batches in groups of stages=2",
    "seeds": "ThreeDGPT: the ranks passed different (model, microbatches",
    "batches": "ThreeDGPT.train_step: the ranks passed different batches",
    "model": "pass a labkit.models.TinyGPT",
}


def test_layouts_that_do_not_fit_are_refused_on_every_rank_alike():
    results = labkit.run(refusals, world_size=4, timeout=120)
    for name, fragment in WHAT_IT_SAYS.items():
        messages = {result[name] for result in results}
        assert len(messages) == 1, (name, messages)  # every rank alike: none waits for the others
        message, = messages
        assert message is not None and fragment in message, (name, message)
