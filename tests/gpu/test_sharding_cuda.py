"""On CUDA: issue 17's sharding (ShardedOptimizer: ZeRO-1 and -2; FullyShardedDP: ZeRO-3) and labkit.parallel.Mesh
on GPU tensors. Every test skips, saying why, where torch.cuda.is_available() is False.

- NCCL at world size 1 (one GPU is enough: NCCL needs one GPU per rank): each sharded strategy trains as one
  process does on the same GPU (float32 AdamW; FullyShardedDP also under compute_dtype=torch.bfloat16, against
  one process making the same casts), with parameters and optimizer state on cuda, and every tensor that reaches
  a collective of torch.distributed on cuda (the collectives are watched in the rank).
- Timing waits for the GPU: labkit.measure.seconds_per_call around a ShardedOptimizer step, and FullyShardedDP's
  timeline (CUDA events), each include a kernel that keeps the GPU busy for a known time.
- Two ranks sharing the GPU over gloo: gloo carries CUDA tensors for broadcast and all_reduce only (PyTorch
  docs, torch.distributed, "Backends"). labkit's gloo path of flat_shards.py uses just those two, but under gloo
  labkit.device() is the CPU, so ShardedOptimizer and FullyShardedDP refuse CUDA parameters at construction,
  with a ValueError naming the rank, the device and labkit.device(): asserted here.

labkit's ZeRO calls torch.distributed.all_gather_single and reduce_scatter_single, the torch 2.13 names of
all_gather_into_tensor and reduce_scatter_tensor (a rename: same arguments and behaviour), and the old names on a
torch that predates them (a GPU machine's own torch, 2.11 say): labkit.parallel._collectives picks at each call.
The watched collectives are therefore matched by family: "all_gather" is either name.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten

import labkit
from labkit import measure
from labkit.models import make_classification, mlp
from labkit.parallel import FullyShardedDP, Mesh, ShardedOptimizer

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
NO_CUDA = f"CUDA is not available (torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'})"
needs_cuda = pytest.mark.skipif(GPUS == 0, reason=NO_CUDA)

FAMILIES = {"all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
            "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter"}
WATCHED = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_single", "all_gather_into_tensor",
           "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "all_to_all_single", "send", "recv",
           "isend", "irecv")
ADAMW = {"lr": 0.01, "weight_decay": 0.1}
STEPS = 4
SMALL_MB = 4096 / 2**20  # buckets of at most 4 KiB: mlp()'s 5,508 parameters make several buckets
SLEEP_CYCLES = 100_000_000  # torch.cuda._sleep: about 50 ms at an H200's 1.98 GHz; timed in the rank


@contextlib.contextmanager
def collectives_seen():
    """In a rank: every call of a torch.distributed collective (by its module attribute, as labkit calls them)
    recorded as (name, the devices of the tensors it was handed); the functions restored afterwards."""
    seen, originals = [], {name: getattr(dist, name) for name in WATCHED if hasattr(dist, name)}

    def watched(name, fn):
        def call(*args, **kwargs):
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            seen.append((name, sorted({str(t.device) for t in tensors})))
            return fn(*args, **kwargs)
        return call

    for name, fn in originals.items():
        setattr(dist, name, watched(name, fn))
    try:
        yield seen
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def on_nccl_1(fn, *args):
    """fn(*args) on one rank under NCCL (its GPU: cuda:0); its result."""
    [result] = labkit.run(fn, *args, world_size=1, backend="nccl", timeout=180)
    return result


def devices(tensors) -> set[str]:
    return {str(t.device) for t in tensors}


def state_tensors(optimizer) -> list[torch.Tensor]:
    """The optimizer's per-element state (Adam's m and v): tensors with at least one dimension (torch keeps
    AdamW's `step` counter as a 0-d CPU tensor unless capturable or fused)."""
    return [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]


def largest_difference(ours, theirs) -> float:
    """The largest absolute difference between two lists of tensors (on any devices), pair by pair."""
    return max((a.detach().float().cpu() - b.detach().float().cpu()).abs().max().item()
               for a, b in zip(ours, theirs, strict=True))


def check_collectives(seen: list, expected: set[str]) -> None:
    """Every watched collective was handed cuda tensors only, and each of `expected` ran."""
    off_gpu = [(name, where) for name, where in seen if not all(d.startswith("cuda") for d in where)]
    assert not off_gpu, f"collectives handed tensors that are not on the GPU: {off_gpu}"
    assert expected <= {FAMILIES.get(name, name) for name, _ in seen}, (expected, seen)


# ---- ZeRO-1 and -2: ShardedOptimizer at NCCL world size 1 equals one process ----------------------------------

def zero_against_one_process(shard_gradients: bool, group_of=None) -> dict:
    """ShardedOptimizer(AdamW) and torch's AdamW on the same model, data and steps on this rank's GPU.
    `group_of`: a function of nothing giving the group (called in the rank: e.g. a Mesh axis); None: the world."""
    device = labkit.device()
    x, y = (t.to(device) for t in make_classification())
    model, reference = mlp().to(device), mlp().to(device)
    group = group_of() if group_of else None
    with collectives_seen() as seen:
        sharded = ShardedOptimizer(model.parameters(), torch.optim.AdamW, group=group,
                                   shard_gradients=shard_gradients, bucket_mb=SMALL_MB, **ADAMW)
        grads_kept = []
        for _ in range(STEPS):
            sharded.zero_grad()
            F.cross_entropy(model(x), y).backward()
            grads_kept.append(any(p.grad is not None for p in model.parameters()))
            sharded.step()
    plain = torch.optim.AdamW(reference.parameters(), **ADAMW)
    for _ in range(STEPS):
        plain.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        plain.step()
    return {"difference": largest_difference(model.parameters(), reference.parameters()),
            "moved": largest_difference(model.parameters(), mlp().parameters()),
            "params": devices(model.parameters()), "state": devices(state_tensors(sharded)),
            "state_numel": sum(t.numel() for t in state_tensors(sharded)), "buckets": len(sharded.buckets),
            "grads_kept": grads_kept, "seen": seen}


@needs_cuda
@pytest.mark.parametrize("shard_gradients", [False, True], ids=["zero-1", "zero-2"])
def test_sharded_optimizer_at_nccl_world_1_equals_one_process_on_the_gpu(shard_gradients):
    result = on_nccl_1(zero_against_one_process, shard_gradients)
    assert result["difference"] <= 1e-6 < result["moved"], result
    assert result["params"] == result["state"] == {"cuda:0"}, result
    assert result["state_numel"] == 2 * sum(p.numel() for p in mlp().parameters())  # m and v, all of it: N = 1
    assert result["buckets"] > 1
    assert result["grads_kept"] == [not shard_gradients] * STEPS  # ZeRO-2 drops the gradients it reduced
    check_collectives(result["seen"], {"broadcast", "reduce_scatter", "all_gather"})


# ---- ZeRO-3: FullyShardedDP at NCCL world size 1 equals one process, float32 and bfloat16 ------------------------

def fsdp_against_one_process(compute_dtype) -> dict:
    """FullyShardedDP(mlp) with AdamW on the shards, and one process with AdamW on float32 masters making the
    casts FullyShardedDP makes under compute_dtype: a compute_dtype copy of the weights, the inputs cast to it,
    the gradient in it, then cast to float32 (and divided by the group's size, 1)."""
    device = labkit.device()
    x, y = (t.to(device) for t in make_classification())
    with collectives_seen() as seen:
        model = FullyShardedDP(mlp().to(device), compute_dtype=compute_dtype)
        optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
        losses, logits_dtype = [], None
        for _ in range(STEPS):
            optimizer.zero_grad()
            logits = model(x)
            logits_dtype = str(logits.dtype)
            loss = F.cross_entropy(logits.float(), y)
            loss.backward()
            model.finish()
            optimizer.step()
            losses.append(loss.item())
        full = model.full_state_dict()
    reference, reference_losses = one_process(x, y, compute_dtype)
    return {"difference": largest_difference(full.values(), reference.state_dict().values()),
            "losses": losses, "reference_losses": reference_losses, "logits_dtype": logits_dtype,
            "shards": devices(model.parameters()), "full": devices(full.values()),
            "state": devices(state_tensors(optimizer)), "seen": seen}


def one_process(x, y, compute_dtype):
    """mlp() trained on (x, y) by AdamW on float32 weights, the forward and backward in compute_dtype (None:
    float32 throughout). Returns the model and the losses."""
    model = mlp().to(x.device)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        if compute_dtype is None:
            loss = F.cross_entropy(model(x).float(), y)
            loss.backward()
        else:
            cast = copy.deepcopy(model).to(compute_dtype)
            loss = F.cross_entropy(cast(x.to(compute_dtype)).float(), y)
            loss.backward()
            for p, q in zip(model.parameters(), cast.parameters(), strict=True):
                p.grad = q.grad.float()  # FullyShardedDP then divides by the group's size: 1
        optimizer.step()
        losses.append(loss.item())
    return model, losses


@needs_cuda
@pytest.mark.parametrize("compute_dtype, tolerance", [(None, 1e-6), (torch.bfloat16, 2e-3)],
                         ids=["float32", "bfloat16"])
def test_fully_sharded_dp_at_nccl_world_1_equals_one_process_on_the_gpu(compute_dtype, tolerance):
    result = on_nccl_1(fsdp_against_one_process, compute_dtype)
    assert result["difference"] <= tolerance, result
    assert result["losses"] == pytest.approx(result["reference_losses"], rel=tolerance, abs=tolerance), result
    assert result["logits_dtype"] == str(compute_dtype or torch.float32)
    assert result["shards"] == result["full"] == result["state"] == {"cuda:0"}, result
    check_collectives(result["seen"], {"broadcast", "reduce_scatter", "all_gather"})


# ---- timing waits for the GPU ----------------------------------------------------------------------------------

class SleepyLinear(nn.Linear):
    """nn.Linear whose forward first queues a kernel that keeps the GPU busy for SLEEP_CYCLES clock cycles."""

    def forward(self, x):
        torch.cuda._sleep(SLEEP_CYCLES)
        return super().forward(x)


def gpu_sleep_seconds() -> float:
    """How long torch.cuda._sleep(SLEEP_CYCLES) keeps this rank's GPU busy at least, timed with CUDA events: the
    shortest of three, after one that wakes the clocks (an idle H200 runs at a fraction of its 1.98 GHz)."""
    times = []
    for _ in range(4):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(SLEEP_CYCLES)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return min(times[1:])


def timings() -> dict:
    """Seconds that labkit measured around GPU work of a known length: a ShardedOptimizer step after a sleep
    kernel (measure.seconds_per_call) and the forward of FullyShardedDP's unit that sleeps (its timeline), next
    to the sleep's own length, a step without it, and what the host clock sees while only queueing the sleep."""
    device = labkit.device()
    sleep = gpu_sleep_seconds()
    x, y = (t.to(device) for t in make_classification())
    model = mlp().to(device)
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, **ADAMW)
    F.cross_entropy(model(x), y).backward()
    bare = measure.median_seconds(optimizer.step, repeats=3)
    step = measure.seconds_per_call(lambda: (torch.cuda._sleep(SLEEP_CYCLES), optimizer.step()))
    queued = measure.seconds_per_call(lambda: torch.cuda._sleep(SLEEP_CYCLES), device="cpu")  # no synchronize
    torch.cuda.synchronize()
    layers = mlp()
    layers[2] = SleepyLinear(64, 64)
    sharded = FullyShardedDP(layers.to(device))
    F.cross_entropy(sharded(x), y).backward()
    sharded.finish()
    forward = [e for e in sharded.timeline if e.kind == "compute" and e.phase == "forward"]
    return {"sleep": sleep, "bare": bare, "step": step, "queued": queued,
            "forwards": {e.name: e.end - e.start for e in forward},
            "ordered": all(0 <= e.start <= e.end for e in sharded.timeline)}


@needs_cuda
def test_step_timing_and_the_fsdp_timeline_wait_for_the_gpu():
    result = on_nccl_1(timings)
    sleep = result["sleep"]
    assert sleep > 1e-3, result  # the sleep kernel ran long enough to tell a wait from a launch
    # queueing the sleep, and a step without it, take far less: the two checks below could fail
    assert result["queued"] < 0.5 * sleep and result["bare"] < 0.5 * sleep, result
    assert result["step"] >= 0.8 * sleep, result
    assert result["ordered"], result
    slowest = max(result["forwards"], key=result["forwards"].get)
    assert slowest == "2" and result["forwards"]["2"] >= 0.8 * sleep, result


# ---- Mesh on CUDA ----------------------------------------------------------------------------------------------

def mesh_on_cuda() -> dict:
    """A 1 x 1 x 1 Mesh under NCCL: torch's DeviceMesh on cuda, an all_reduce of a GPU tensor on each axis's
    group, and ZeRO-1 over the dp axis's group equal to one process."""
    mesh = Mesh()
    sums = {}
    for axis in ("dp", "pp", "tp"):
        t = torch.full((3,), 2.0, device=labkit.device())
        dist.all_reduce(t, group=mesh.group(axis))
        sums[axis] = (t.tolist(), mesh.size(axis), mesh.rank_in(axis))
    zero = zero_against_one_process(False, lambda: Mesh().group("dp"))
    return {"device_type": mesh.device_mesh.device_type, "coordinate": mesh.coordinate, "sums": sums,
            "zero": zero, "repr": repr(mesh)}


@needs_cuda
def test_mesh_on_cuda_hands_each_axis_a_gpu_group():
    result = on_nccl_1(mesh_on_cuda)
    assert result["device_type"] == "cuda", result
    assert result["coordinate"] == {"dp": 0, "pp": 0, "tp": 0}
    assert result["sums"] == {axis: ([2.0, 2.0, 2.0], 1, 0) for axis in ("dp", "pp", "tp")}
    assert result["zero"]["difference"] <= 1e-6 and result["zero"]["state"] == {"cuda:0"}, result["zero"]
    check_collectives(result["zero"]["seen"], {"reduce_scatter", "all_gather"})


# ---- two ranks sharing the GPU over gloo: CUDA parameters refused, clearly -----------------------------------------

def shard_elsewhere(kind: str, device: str) -> None:
    """On a gloo rank (labkit.device() is the CPU): shard a model whose parameters are on `device`."""
    model = mlp().to(device)
    if kind == "ShardedOptimizer":
        ShardedOptimizer(model.parameters(), torch.optim.AdamW, **ADAMW)
    else:
        FullyShardedDP(model)


@needs_cuda
@pytest.mark.parametrize("kind, message", [
    ("ShardedOptimizer", r"ShardedOptimizer: every trainable parameter must be contiguous and on its rank's "
                         r"labkit.device\(\), but rank 0: .* is on cuda:0, not on labkit.device\(\) = cpu; rank 1:"),
    ("FullyShardedDP", r"FullyShardedDP: every tensor must live on its rank's labkit.device\(\) \(the CPU under "
                       r"gloo, .*\), but rank 0: .* is on cuda:0, not on labkit.device\(\) = cpu; rank 1:"),
])
def test_sharding_over_gloo_refuses_cuda_parameters_with_a_clear_error(kind, message):
    with pytest.raises(labkit.RankError, match=message):
        labkit.run(shard_elsewhere, kind, "cuda:0", world_size=2, backend="gloo", timeout=120)
    assert labkit.run(lambda: labkit.rank(), world_size=2, backend="gloo") == [0, 1]  # the pool lives on
