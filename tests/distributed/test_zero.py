"""labkit.parallel.ShardedOptimizer (ZeRO-1 and ZeRO-2) on real gloo processes: N ranks with a share of the batch
each equal one process with the whole batch, and torch's ZeroRedundancyOptimizer over DDP, step for step; each
rank holds 1/N of the optimizer state (and, under ZeRO-2, of the gradients), measured; and a step sends what DDP
sends, counted."""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import labkit
from labkit import groups
from labkit.measure import peak_training_state, training_state_nbytes
from labkit.parallel import ShardedOptimizer, average_gradients, count_collectives
from labkit.parallel.flat_shards import FlatLayout
from labkit.plan import training_memory
from labkit.plan.counts import shard_sizes

pytestmark = pytest.mark.numerics  # compares floating-point results: make unit runs it again on other kernels

BATCH, STEPS, VOCAB = 24, 10, 11  # 24 examples a step: 12, 8 or 6 on 2 to 4 ranks
TRAINABLE = 275  # TiedNet's trainable numbers: no world size from 2 to 4 divides them
SMALL_MB = 160 / 2**20  # buckets of at most 160 bytes (20 float64 numbers, or one larger parameter)
OPTIMIZERS = {"adamw": (torch.optim.AdamW, {}), "sgd": (torch.optim.SGD, {"momentum": 0.9}),
              "adam": (torch.optim.Adam, {})}


class TiedNet(nn.Module):
    """An embedding tied to the output layer, a frozen offset, two param groups' worth of layers."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float64):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, 7)
        self.hidden = nn.Linear(7, 12)
        self.offset = nn.Parameter(torch.linspace(-1, 1, 12), requires_grad=False)  # the same on every rank
        self.proj = nn.Linear(12, 7)
        self.out_bias = nn.Parameter(torch.zeros(VOCAB))
        self.to(dtype)

    def forward(self, tokens):
        h = torch.tanh(self.hidden(self.embed(tokens)) + self.offset)
        return self.proj(h) @ self.embed.weight.T + self.out_bias


def param_groups(model: TiedNet) -> list[dict]:
    """Two groups with their own learning rate and weight decay; the frozen offset listed, as users do."""
    return [{"params": [model.embed.weight, model.hidden.weight, model.hidden.bias, model.offset], "lr": 0.02,
             "weight_decay": 0.1},
            {"params": [model.proj.weight, model.proj.bias, model.out_bias], "lr": 0.01}]


def batches(steps: int = STEPS):
    generator = torch.Generator().manual_seed(1)
    return (torch.randint(VOCAB, (steps, BATCH), generator=generator),
            torch.randint(VOCAB, (steps, BATCH), generator=generator))


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def loss(model, tokens, targets, group=None):
    """This rank's contiguous share of the batch, its mean loss (equal shares: their average is the batch's); the
    whole batch outside a rank."""
    if groups.group_is_up():
        mine, parts = groups.group_rank(group), groups.group_size(group)
        tokens, targets = (t.tensor_split(parts)[mine].to(labkit.device()) for t in (tokens, targets))
    return F.cross_entropy(model(tokens), targets)


def train(model, optimizer, steps: int = STEPS, group=None):
    """`steps` steps; halfway, group 0's learning rate is halved in param_groups, as a schedule would."""
    tokens, targets = batches(steps)
    for step in range(steps):
        if step == steps // 2:
            optimizer.param_groups[0]["lr"] /= 2
        optimizer.zero_grad()
        loss(model, tokens[step], targets[step], group).backward()
        optimizer.step()
    return flat(model)


def one_process(name: str, dtype=torch.float64) -> torch.Tensor:
    model = TiedNet(dtype=dtype)
    cls, kwargs = OPTIMIZERS[name]
    return train(model, cls(param_groups(model), **kwargs))


def sharded(name: str, stage: int, bucket_mb: float = 25.0, dtype=torch.float64, group=None):
    """A model initialised differently on every rank but the group's first (the constructor broadcasts it)."""
    model = TiedNet(seed=0 if groups.group_rank(group) == 0 else 100 + labkit.rank(), dtype=dtype)
    model.to(labkit.device())
    cls, kwargs = OPTIMIZERS[name]
    optimizer = ShardedOptimizer(param_groups(model), cls, group=group, shard_gradients=stage == 2,
                                 bucket_mb=bucket_mb, **kwargs)
    return model, optimizer


def torch_zero(name: str) -> torch.Tensor:
    model = TiedNet().to(labkit.device())
    ddp = DistributedDataParallel(model)
    cls, kwargs = OPTIMIZERS[name]
    return train(ddp, ZeroRedundancyOptimizer(param_groups(model), optimizer_class=cls, **kwargs))


# --- N ranks equal one process, and torch's ZeroRedundancyOptimizer ---

CASES = [("adamw", 1, 25.0), ("adamw", 1, SMALL_MB), ("adamw", 2, 25.0), ("adamw", 2, SMALL_MB), ("sgd", 1, 25.0),
         ("sgd", 2, SMALL_MB), ("adam", 1, SMALL_MB), ("adam", 2, 25.0)]


def every_case():
    ours = [train(*sharded(*case)) for case in CASES]
    in_float32 = train(*sharded("adamw", 2, SMALL_MB, torch.float32))
    return ours, in_float32, [torch_zero(name) for name in ("adamw", "sgd")]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_n_ranks_equal_one_process_and_torch_zero_redundancy_optimizer(world_size):
    alone = {name: one_process(name) for name in OPTIMIZERS}
    per_rank = labkit.run(every_case, world_size=world_size)
    for ours, in_float32, theirs in per_rank:
        for case, result in zip(CASES, ours, strict=True):
            # each slice is stepped on its owner and all-gathered: every rank holds the owner's bits
            assert torch.equal(result, per_rank[0][0][CASES.index(case)]), f"{case}: replicas differ"
            torch.testing.assert_close(result, alone[case[0]], rtol=1e-9, atol=1e-12, msg=f"{case}")
        torch.testing.assert_close(in_float32, one_process("adamw", torch.float32), rtol=1e-5, atol=1e-6)
        for name, result in zip(("adamw", "sgd"), theirs, strict=True):
            torch.testing.assert_close(result, alone[name], rtol=1e-9, atol=1e-12, msg=f"torch's, {name}")
    assert not torch.allclose(alone["adamw"], flat(TiedNet()), atol=1e-3)  # it trained


# --- On a sub-group: ranks {1, 3} of 4 while {0, 2} train on theirs ---

def torch_zero_on(group) -> torch.Tensor:
    model = TiedNet().to(labkit.device())
    ddp = DistributedDataParallel(model, process_group=group)
    return train(ddp, ZeroRedundancyOptimizer(param_groups(model), torch.optim.AdamW, process_group=group),
                 group=group)


def on_pairs():
    pairs = [groups.new_group([1, 3]), groups.new_group([0, 2])]
    mine = pairs[labkit.rank() % 2 == 0]
    if labkit.rank() % 2:
        model, optimizer = sharded("adamw", 2, SMALL_MB, group=mine)
        with count_collectives() as counted:
            ours = train(model, optimizer, group=mine)
        return ours, torch_zero_on(mine), (dict(counted.calls), len(optimizer.buckets))
    return train(*sharded("sgd", 1, group=mine), group=mine), None, None


def test_on_a_sub_group_each_pair_trains_on_its_own_and_equals_torch_on_that_group():
    per_rank = labkit.run(on_pairs, world_size=4)
    for rank, (ours, theirs, calls) in enumerate(per_rank):
        if rank % 2:
            torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(ours, one_process("adamw"), rtol=1e-9, atol=1e-12)
            calls, buckets = calls
            assert buckets == 5 and calls == {"reduce_scatter": STEPS * buckets, "all_gather": STEPS * buckets}
        else:
            torch.testing.assert_close(ours, one_process("sgd"), rtol=1e-9, atol=1e-12)
    assert torch.equal(per_rank[1][0], per_rank[3][0]) and torch.equal(per_rank[0][0], per_rank[2][0])


# --- Saving and loading ---

def resume(stage: int):
    tokens, targets = batches()

    def steps(model, optimizer, which):
        for step in which:
            optimizer.zero_grad()
            loss(model, tokens[step], targets[step]).backward()
            optimizer.step()

    model, optimizer = sharded("adamw", stage, SMALL_MB)
    steps(model, optimizer, range(5))
    optimizer.param_groups[0]["lr"] = 0.005
    saved_model, saved = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    steps(model, optimizer, range(5, 10))
    again, reloaded = sharded("adamw", stage, SMALL_MB)  # fresh: rank 0's seed, new state, lr 0.02
    again.load_state_dict(saved_model)
    reloaded.load_state_dict(saved)
    lr = reloaded.param_groups[0]["lr"]
    steps(again, reloaded, range(5, 10))
    return flat(model), flat(again), lr, refusals(reloaded, saved)


def refusals(optimizer, saved) -> list[str]:
    """What load_state_dict says to the other rank's state_dict, another layout's, and a plain optimizer's."""
    theirs = groups.gather_objects(saved)[1 - labkit.rank()]
    _, other_layout = sharded("adamw", 1, 25.0)
    said = []
    for wrong in (theirs, other_layout.state_dict(), torch.optim.AdamW(TiedNet().parameters()).state_dict()):
        with pytest.raises(ValueError) as refused:
            optimizer.load_state_dict(wrong)
        said.append(str(refused.value))
    return said


@pytest.mark.parametrize("stage", [1, 2])
def test_a_saved_and_loaded_state_continues_training_identically_and_a_mismatched_one_is_refused(stage):
    for rank, (straight, resumed, lr, said) in enumerate(labkit.run(resume, stage, world_size=2)):
        assert torch.equal(straight, resumed)  # the same steps from the same state: the same kernels on the same shapes
        assert lr == 0.005
        assert f"group rank {1 - rank} saved, {rank} here" in said[0] and "Load, on each rank" in said[0]
        assert "bucket 0:" in said[1] and "no 'layout'" in said[2]


# --- Memory per rank, measured; traffic per step, counted ---

LAYERS, WIDTH = 8, 32  # 8 layers of 32 x 32 + 32 = 1056 numbers: 8448 in all, and every world size 2-4 divides 1056
LAYER_MB = (WIDTH * WIDTH + WIDTH) * 4 / 2**20  # one layer per bucket
PLANNED = ("weights", "grads", "optimizer", "total")  # what plan.training_memory predicts


def deep_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh()))).to(labkit.device())


def measured(stage: int, bucket_mb: float):
    """One warm-up step (so that AdamW's state exists), then a measured and counted one; and DDP's count."""
    model = deep_mlp()
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, shard_gradients=stage == 2,
                                 bucket_mb=bucket_mb, lr=0.01)
    x = torch.randn(8, WIDTH, device=labkit.device())
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    with peak_training_state(model, optimizer) as peak, count_collectives() as counted:
        model(x).square().mean().backward()
        after_backward = training_state_nbytes(model, optimizer)["grads"], [p.grad is None for p in model.parameters()]
        optimizer.step()
    return peak.nbytes, after_backward, dict(counted.nbytes), len(optimizer.buckets)


def ddp_sent() -> int:
    model = deep_mlp()
    model(torch.randn(8, WIDTH, device=labkit.device())).square().mean().backward()
    with count_collectives() as ddp:
        average_gradients(model)
    return ddp.nbytes["all_reduce"]


def memory_and_traffic():
    return measured(1, 25.0), measured(2, LAYER_MB), ddp_sent()


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_each_rank_holds_its_share_of_state_and_gradients_and_a_step_sends_what_ddp_sends(world_size):
    params, n = LAYERS * (WIDTH * WIDTH + WIDTH), world_size
    for zero1, zero2, ddp_nbytes in labkit.run(memory_and_traffic, world_size=world_size):
        peak, (grads_after_backward, dropped), sent, buckets = zero1
        assert {k: peak[k] for k in PLANNED} == training_memory(params, 4, 4, 8, zero_stage=1, dp=n)
        assert not any(dropped) and grads_after_backward == 4 * params
        peak, (grads_after_backward, dropped), sent, buckets = zero2
        plan = training_memory(params, 4, 4, 8, zero_stage=2, dp=n)
        assert buckets == LAYERS and all(dropped) and grads_after_backward == plan["grads"]  # only its gradient shard
        assert peak["optimizer"] == plan["optimizer"] and peak["weights"] == plan["weights"]
        assert plan["grads"] <= peak["grads"] <= plan["grads"] + 4 * params / LAYERS  # 1/N, + at most one bucket
        assert peak["grads"] < 4 * params  # less than DDP's or ZeRO-1's whole gradient
        for _, _, sent, _ in (zero1, zero2):
            assert sent == {"reduce_scatter": 4 * params, "all_gather": 4 * params // n}
            ring = (n - 1) / n * sent["reduce_scatter"] + (n - 1) * sent["all_gather"]  # sent by each rank
            assert ddp_nbytes == 4 * params and ring == 2 * (n - 1) / n * ddp_nbytes


def uneven():
    """275 numbers in 5 buckets: each rank's slice of each is shard_sizes', padded by at most one to travel."""
    model, optimizer = sharded("adam", 1, SMALL_MB)
    train(model, optimizer, steps=1)
    state = sum(t.numel() for s in optimizer.state.values() for t in s.values() if t.dim())
    return state, [b.numel for b in optimizer.buckets]


def test_with_sizes_no_world_size_divides_each_rank_holds_one_nth_of_the_state_up_to_one_number_per_bucket():
    per_rank = labkit.run(uneven, world_size=3)
    sizes = per_rank[0][1]
    assert sum(sizes) == TRAINABLE and any(size % 3 for size in sizes)
    for rank, (state, _) in enumerate(per_rank):
        assert state == 2 * sum(shard_sizes(size, 3)[rank] for size in sizes)  # Adam's m and v, its slices only
        assert abs(state / 2 - TRAINABLE / 3) <= len(sizes)


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 12])
def test_the_flat_layout_both_stages_share_pads_each_slice_to_the_largest_and_back(parts):
    """FlatLayout, which ShardedOptimizer's buckets and FullyShardedDP's units both use: 11 numbers in three tensors
    cut as torch.tensor_split cuts (12 ranks: one empty slice); each slice padded to the largest for gloo."""
    layout, flat = FlatLayout([(2, 3), (1,), (4,)], parts), torch.arange(1.0, 12.0)
    slices = flat.tensor_split(parts)
    assert layout.sizes == [len(s) for s in slices] and layout.piece == len(slices[0])
    pieces = torch.cat([layout.padded([s]) for s in slices])  # what the ranks send: each piece zero-padded
    assert pieces.numel() == parts * layout.piece and torch.equal(pieces[pieces != 0], flat)
    buffer = torch.full((parts * layout.piece,), float("nan"))
    buffer[:flat.numel()] = flat
    layout.spread(buffer)
    assert torch.equal(buffer, pieces)  # a reduce-scatter's input, made in place
    layout.compact(buffer)
    assert torch.equal(buffer[:flat.numel()], flat)  # an all-gather's output, back to the flat vector
    tensors = layout.views(flat)
    assert [t.shape for t in tensors] == [(2, 3), (1,), (4,)]
    assert torch.equal(torch.cat([t.reshape(-1) for t in tensors]), flat)
    for rank, mine in enumerate(slices):  # the parts of each tensor that each rank's slice covers
        owned = [tensors[i].reshape(-1)[start:start + n] for i, start, _, n in layout.owned(rank)]
        assert torch.equal(torch.cat([flat[:0], *owned]), mine)
        offsets = [offset for _, _, offset, _ in layout.owned(rank)]
        assert offsets == [sum(t.numel() for t in owned[:k]) for k in range(len(owned))]


# --- Accumulation, a closure, a second optimizer over the same model ---

def accumulate_and_rebuild():
    """Each step as two backwards of half the rank's share (ZeRO-1 and ZeRO-2), or as one inside a closure given to
    step(), by a ZeRO-2 optimizer that replaced another one over the same model (whose hooks must go)."""
    tokens, targets = batches()
    results = []
    for stage, how in ((1, "halves"), (2, "halves"), (2, "closure")):
        model, optimizer = sharded("adamw", stage, SMALL_MB)
        if how == "closure":
            optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, shard_gradients=True)
        for step in range(STEPS):
            optimizer.param_groups[0]["lr"] /= 2 if step == STEPS // 2 else 1
            optimizer.zero_grad()
            if how == "closure":
                optimizer.step(functools.partial(backward, model, tokens[step], targets[step]))
                continue
            mine = [t[step].tensor_split(labkit.world_size())[labkit.rank()] for t in (tokens, targets)]
            for half_tokens, half_targets in zip(mine[0].tensor_split(2), mine[1].tensor_split(2), strict=True):
                F.cross_entropy(model(half_tokens), half_targets).div(2).backward()
            optimizer.step()
        results.append(flat(model))
    return results


def backward(model, tokens, targets):
    loss(model, tokens, targets).backward()


def test_accumulated_backwards_a_closure_and_a_replaced_optimizer_train_as_one_process():
    alone = one_process("adamw")
    for results in labkit.run(accumulate_and_rebuild, world_size=2):
        for result in results:
            torch.testing.assert_close(result, alone, rtol=1e-9, atol=1e-12)


MICROBATCHES = 3  # a rank's 12 or 8 examples in 3 micro-batches: 4, 4, 4 or 3, 3, 2


def accumulated_inside_no_sync():
    """Each step as MICROBATCHES backwards (each loss weighted by its share of the rank's examples), for both stages:
    all inside no_sync() (step() reduces), or all but the last (its backward reduces). The parameters, the
    collectives counted over the steps, and whether each parameter held a whole gradient inside no_sync() and
    after the last backward."""
    tokens, targets = batches()
    results = {}
    for stage in (1, 2):
        for last_outside in (False, True):
            model, optimizer = sharded("adamw", stage, SMALL_MB)
            with count_collectives() as counted:
                held = [accumulation_step(model, optimizer, tokens[step], targets[step], last_outside,
                                          lr_halved=step == STEPS // 2) for step in range(STEPS)]
            results[stage, last_outside] = flat(model), dict(counted.calls), len(optimizer.buckets), held[-1]
    return results


def accumulation_step(model, optimizer, tokens, targets, last_outside: bool, lr_halved: bool):
    """One step of accumulation; whether every trainable parameter held a whole gradient inside no_sync(), and
    after the last backward."""
    optimizer.param_groups[0]["lr"] /= 2 if lr_halved else 1
    optimizer.zero_grad()
    mine = [t.tensor_split(labkit.world_size())[labkit.rank()] for t in (tokens, targets)]
    micro = list(zip(mine[0].tensor_split(MICROBATCHES), mine[1].tensor_split(MICROBATCHES), strict=True))
    trainable = [p for p in model.parameters() if p.requires_grad]
    with optimizer.no_sync():
        for micro_tokens, micro_targets in micro[:-1] if last_outside else micro:
            F.cross_entropy(model(micro_tokens), micro_targets, reduction="sum").div(len(mine[0])).backward()
        inside = all(p.grad is not None and p.grad.shape == p.shape for p in trainable)
    if last_outside:
        F.cross_entropy(model(micro[-1][0]), micro[-1][1], reduction="sum").div(len(mine[0])).backward()
    after = all(p.grad is not None for p in trainable)
    optimizer.step()
    return inside, after


@pytest.mark.parametrize("world_size", [2, 3])
def test_accumulation_inside_no_sync_trains_as_one_process_with_one_reduce_scatter_per_bucket_per_step(world_size):
    """Without no_sync each micro-batch's backward would reduce-scatter every bucket: MICROBATCHES x as many."""
    alone = one_process("adamw")
    for results in labkit.run(accumulated_inside_no_sync, world_size=world_size):
        for (stage, last_outside), (trained, calls, buckets, (inside, after)) in results.items():
            torch.testing.assert_close(trained, alone, rtol=1e-9, atol=1e-12, msg=f"ZeRO-{stage}, {last_outside}")
            assert buckets > 3 and calls == {"reduce_scatter": STEPS * buckets, "all_gather": STEPS * buckets}
            assert inside, stage  # ZeRO-2 too holds the whole gradient inside no_sync(), as FSDP's no_sync does
            assert after == (stage == 1 or not last_outside), (stage, last_outside)  # ZeRO-2's reduce drops it


def reduced_during_backward_and_kept_without_zero_grad():
    """What each stage sends during the backward and during step(); and training that never calls zero_grad, so
    that every backward adds to the gradients of all the earlier ones (as in one process)."""
    tokens, targets = batches()
    sent, trained = {}, {}
    for stage in (1, 2):
        model, optimizer = sharded("sgd", stage, SMALL_MB)
        with count_collectives() as backward_calls:
            loss(model, tokens[0], targets[0]).backward()
        with count_collectives() as step_calls:
            optimizer.step()
        sent[stage] = dict(backward_calls.calls), dict(step_calls.calls), len(optimizer.buckets)
        if stage == 1:
            for step in range(1, STEPS):
                loss(model, tokens[step], targets[step]).backward()
                optimizer.step()
            trained[stage] = flat(model)
    return sent, trained


def test_both_stages_reduce_during_the_backward_and_zero1_accumulates_across_steps_without_zero_grad():
    model = TiedNet()
    optimizer = torch.optim.SGD(param_groups(model), **OPTIMIZERS["sgd"][1])
    tokens, targets = batches()
    for step in range(STEPS):
        loss(model, tokens[step], targets[step]).backward()
        optimizer.step()
    for sent, trained in labkit.run(reduced_during_backward_and_kept_without_zero_grad, world_size=3):
        for stage in (1, 2):
            in_backward, in_step, buckets = sent[stage]
            assert buckets > 3 and in_backward == {"reduce_scatter": buckets}, (stage, sent[stage])
            assert in_step == {"all_gather": buckets}
        torch.testing.assert_close(trained[1], flat(model), rtol=1e-9, atol=1e-12)


def collectives_on_an_older_torch() -> tuple[list, list]:
    """flat_shards' all_gather_single and reduce_scatter_single (NCCL's path) on a torch before 2.13, which has
    only all_gather_into_tensor and reduce_scatter_tensor, next to those."""
    import torch.distributed as dist

    from labkit.parallel.flat_shards import all_gather_single, reduce_scatter_single
    mine = torch.arange(3.0) + 10 * labkit.rank()
    results = []
    for name in ("all_gather_single", "reduce_scatter_single"):
        saved = getattr(dist, name)
        delattr(dist, name)
        try:
            gathered, scattered = torch.empty(6), torch.empty(3)
            all_gather_single(gathered, mine)
            reduce_scatter_single(scattered, torch.cat([mine, 2 * mine]))
            results.append([gathered, scattered])
        finally:
            setattr(dist, name, saved)
    return results


def test_the_2_13_collective_names_fall_back_to_the_old_ones_on_an_older_torch():
    for rank, results in enumerate(labkit.run(collectives_on_an_older_torch, world_size=2)):
        for gathered, scattered in results:
            assert gathered.tolist() == [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]
            assert scattered.tolist() == [(1 + rank) * (10 + 2 * i) for i in range(3)]


# --- Clear errors, on every rank, instead of hangs ---

def misuse():
    said = {}
    model = TiedNet().to(labkit.device())
    for name, build in {
        "instance": lambda: ShardedOptimizer(model.parameters(), torch.optim.SGD(model.parameters(), lr=0.1)),
        "bucket_mb": lambda: ShardedOptimizer(model.parameters(), torch.optim.SGD, bucket_mb=0, lr=0.1),
        "off the device": lambda: ShardedOptimizer(
            TiedNet().to("meta" if labkit.rank() == 1 else "cpu").parameters(), torch.optim.SGD, lr=0.1),
        "another model": lambda: ShardedOptimizer(
            nn.Linear(3, 2 + labkit.rank()).to(labkit.device()).parameters(), torch.optim.SGD, lr=0.1),
    }.items():
        with pytest.raises((TypeError, ValueError)) as raised:
            build()
        said[name] = str(raised.value)
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.SGD, shard_gradients=True, bucket_mb=SMALL_MB, lr=0.1)
    with pytest.raises(RuntimeError) as raised:
        optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    said["add_param_group"] = str(raised.value)
    tokens, targets = batches(1)
    hidden = torch.tanh(model.hidden(model.embed(tokens[0]).detach()) + model.offset)
    (model.proj(hidden).sum() + model.out_bias.sum()).backward()  # the embedding's bucket, reduced last, waits
    with pytest.raises(RuntimeError) as raised:
        F.cross_entropy(model(tokens[0]), targets[0]).backward()
    said["second backward"] = str(raised.value)
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.SGD, bucket_mb=SMALL_MB, lr=0.1)
    F.cross_entropy(model(tokens[0]), targets[0]).backward()  # reduces every bucket
    with optimizer.no_sync(), pytest.raises(RuntimeError) as raised:
        F.cross_entropy(model(tokens[0]), targets[0]).backward()
    said["no_sync after"] = str(raised.value)
    return said


def test_misuse_gets_a_clear_error_on_every_rank_not_a_hang():
    for said in labkit.run(misuse, world_size=2, timeout=60):
        assert "pass a torch optimizer class" in said["instance"] and "bucket_mb=0" in said["bucket_mb"]
        assert "rank 1: a parameter of param group 0 (shape (11,)) is on meta" in said["off the device"]
        assert "the ranks passed different (bucket_mb, parameters)" in said["another model"]
        assert "pass all param groups to the constructor" in said["add_param_group"]
        assert "call step() after each backward" in said["second backward"]
        assert "a backward inside no_sync() after a backward outside it" in said["no_sync after"]
    with pytest.raises(RuntimeError, match="call it inside a rank"):
        ShardedOptimizer(TiedNet().parameters(), torch.optim.SGD, lr=0.1)
