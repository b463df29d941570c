"""labkit.parallel.FullyShardedDP (ZeRO-3) on real gloo processes: N ranks with B/N examples each train as one
process with B does, and as torch's fully_shard (FSDP2) does; the full parameters exist only around each unit's
forward and backward; each rank holds 1/N of the training state and sends 1.5x what DDP sends."""

import copy
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import labkit
from labkit import groups, measure
from labkit.measure import peak_training_state
from labkit.parallel import FullyShardedDP, count_collectives
from labkit.plan import training_memory

BATCH, STEPS, LENGTH, VOCAB = 12, 10, 3, 11  # 12 sequences per step: 6, 4 or 3 per rank on 2, 3 or 4 ranks
ADAMW = {"lr": 0.02, "weight_decay": 0.1}


class Tied(nn.Module):
    """Embedding, an MLP block, a LayerNorm whose bias is frozen, and a head tied to the embedding. Default
    units: `block` (82 numbers) and `norm` (5: its bias is frozen); the tied weight (55) goes to the root's unit.
    No world size of 2 to 4 divides all three."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 5)
        self.block = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 5))
        self.norm = nn.LayerNorm(5)
        self.head = nn.Linear(5, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.norm.bias.requires_grad_(False)
        with torch.no_grad():
            self.norm.bias.uniform_(-0.5, 0.5)  # frozen, but not zero: it must still be used

    def forward(self, tokens):
        return self.head(self.norm(self.block(self.embed(tokens))))


def batches(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(VOCAB, (BATCH, LENGTH + 1), generator=generator) for _ in range(STEPS)]


def loss_of(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def mine(tokens, group=None):
    return tokens.tensor_split(groups.group_size(group))[groups.group_rank(group)].to(labkit.device())


def train_alone(data, compute_dtype=None, world=1):
    """One process, the whole batch; under compute_dtype the casts FullyShardedDP makes: a compute_dtype copy of
    the weights, each rank's share's gradient in it, their sum in it, then cast to fp32 and divided by `world`."""
    model = Tied()
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    for tokens in data:
        optimizer.zero_grad()
        if compute_dtype is None:
            loss_of(model, tokens).backward()
        else:
            copies = [copy.deepcopy(model).to(compute_dtype) for _ in range(world)]
            for replica, share in zip(copies, tokens.tensor_split(world), strict=True):
                loss_of(replica, share).backward()
            for p, *grads in zip(model.parameters(), *(c.parameters() for c in copies), strict=True):
                if p.requires_grad:
                    p.grad = torch.stack([g.grad for g in grads]).sum(0, dtype=compute_dtype).float() / world
        optimizer.step()
    return model.state_dict()


def train_sharded(data, compute_dtype=None, group=None):
    model = FullyShardedDP(Tied().to(labkit.device()), compute_dtype=compute_dtype, group=group)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    for tokens in data:
        optimizer.zero_grad()
        loss_of(model, mine(tokens, group)).backward()
        model.finish()
        optimizer.step()
    return model.full_state_dict()


def train_torch_fsdp(data):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = Tied().to(labkit.device())
    mesh = init_device_mesh(labkit.device().type, (labkit.world_size(),))
    for layer in (model.block, model.norm, model):  # per layer, then the root (which holds the tied weight)
        fully_shard(layer, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    for tokens in data:
        optimizer.zero_grad()
        loss_of(model, mine(tokens)).backward()
        optimizer.step()
    return {name: p.full_tensor() if hasattr(p, "full_tensor") else p for name, p in model.state_dict().items()}


def largest_differences(ours: dict, theirs: dict) -> dict[str, float]:
    assert list(ours) == list(theirs)
    return {name: (ours[name].float() - theirs[name].float()).abs().max().item() for name in ours}


# --- equal to one process, and to torch's fully_shard ---

@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_equals_one_process_with_the_whole_batch(world_size):
    expected = train_alone(batches())
    for result in labkit.run(train_sharded, batches(), world_size=world_size):
        assert list(result) == list(expected)  # every key, the tied head and the frozen bias too
        assert max(largest_differences(result, expected).values()) < 1e-5
    assert not torch.equal(expected["block.0.weight"], Tied().state_dict()["block.0.weight"])  # it trained


class Reused(nn.Module):
    """A layer applied twice in one forward, and a unit of 2 numbers, fewer than 4 ranks: some ranks' shards
    are empty."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.shared, self.gain = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(1, 1)

    def forward(self, x):
        return self.shared(torch.tanh(self.shared(self.inp(x)))) * self.gain(x[:, :1])


def train_reused(sharded: bool):
    net = FullyShardedDP(Reused().to(labkit.device())) if sharded else Reused()
    optimizer = torch.optim.AdamW(net.parameters(), **ADAMW)
    x = torch.randn(STEPS, BATCH, 4, generator=torch.Generator().manual_seed(0))
    for inputs in x:
        optimizer.zero_grad()
        net(mine(inputs) if sharded else inputs).pow(2).mean().backward()
        if sharded:
            net.finish()
        optimizer.step()
    return net.full_state_dict() if sharded else net.state_dict()


def test_a_layer_used_twice_and_a_unit_smaller_than_the_group():
    expected = train_reused(sharded=False)
    for result in labkit.run(train_reused, True, world_size=4):
        assert max(largest_differences(result, expected).values()) < 1e-5


def torch_and_ours(data):
    return train_torch_fsdp(data), train_sharded(data)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_equals_torch_fully_shard(world_size):
    for theirs, ours in labkit.run(torch_and_ours, batches(), world_size=world_size):
        assert max(largest_differences(ours, theirs).values()) < 1e-5


def test_compute_dtype_bfloat16_equals_one_process_making_the_same_casts():
    expected = train_alone(batches(), torch.bfloat16, world=2)
    fp32 = train_alone(batches())
    for result in labkit.run(train_sharded, batches(), torch.bfloat16, world_size=2):
        assert all(t.dtype == torch.float32 for t in result.values())  # the state_dict's dtypes, as before
        assert max(largest_differences(result, expected).values()) < 1e-3
        assert max(largest_differences(result, fp32).values()) > 1e-3  # bf16 made a difference


def pairs_train():
    pairs = [groups.new_group([0, 2]), groups.new_group([1, 3])]
    pair = labkit.rank() % 2
    return train_sharded(batches(seed=pair), group=pairs[pair])


def test_on_a_sub_group_while_the_other_pair_trains_on_its_own():
    results = labkit.run(pairs_train, world_size=4)
    for rank, result in enumerate(results):
        assert max(largest_differences(result, train_alone(batches(seed=rank % 2))).values()) < 1e-5
    assert not torch.equal(results[0]["block.0.weight"], results[1]["block.0.weight"])


# --- what a rank holds, and when ---

def held_during_a_step():
    model = FullyShardedDP(Tied().to(labkit.device()))
    held = []  # bytes of gathered full buffers when each unit's forward begins
    for unit in model.units[:-1]:
        unit.module.register_forward_pre_hook(lambda *_: held.append(model.gathered_nbytes))
    with torch.no_grad():
        model(mine(batches()[0])[:, :-1])  # evaluation: no backward follows, so it frees at its end
    after_evaluation, held[:] = model.gathered_nbytes, []
    loss = loss_of(model, mine(batches()[0]))
    after_forward = [unit.nbytes for unit in model.units]
    slots_after_forward = [model.module.block[0].weight.untyped_storage().nbytes(),
                           model.module.head.weight.untyped_storage().nbytes()]
    loss.backward()
    model.finish()
    return held, after_evaluation, after_forward, slots_after_forward, [unit.nbytes for unit in model.units], \
        [(unit.full.numel() * unit.full.element_size()) for unit in model.units]


def test_full_parameters_are_freed_after_forward_and_after_backward():
    for held, after_evaluation, after_forward, slots, after_backward, sizes in labkit.run(held_during_a_step,
                                                                                       world_size=2):
        assert after_evaluation == 0 and after_forward == [0, 0, 0] and slots == [0, 0] and after_backward == [0, 0, 0]
        root, block, norm = sizes[-1], sizes[0], sizes[1]
        # inside block's forward: the root's, its own and the prefetched norm's; inside norm's: root and norm
        assert held == [root + block + norm, root + norm]


def state_per_rank():
    torch.manual_seed(0)
    model = FullyShardedDP(nn.Sequential(nn.Linear(13, 17), nn.Tanh(), nn.Linear(17, 3)).to(labkit.device()))
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    with peak_training_state(model, optimizer) as peak:
        for _ in range(2):
            optimizer.zero_grad()
            model(torch.randn(4, 13, device=labkit.device())).sum().backward()
            model.finish()
            optimizer.step()
    return peak.nbytes, len(model.units)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_each_rank_holds_one_nth_of_weights_gradients_and_adam_state(world_size):
    parameters = 13 * 17 + 17 + 17 * 3 + 3  # 292: a unit of 238 and one of 54
    predicted = training_memory(parameters, weight_bytes=4, grad_bytes=4, optimizer_bytes=8,  # fp32 AdamW: m, v
                                zero_stage=3, dp=world_size)
    for peak, units in labkit.run(state_per_rank, world_size=world_size):
        for kind, nbytes_per_element in (("weights", 4), ("grads", 4), ("optimizer", 8)):
            assert abs(peak[kind] - predicted[kind]) <= nbytes_per_element * units  # one element per unit


def traffic_of_a_step():
    model = FullyShardedDP(Tied().to(labkit.device()))
    with count_collectives() as counted:
        loss_of(model, mine(batches()[0])).backward()
        model.finish()
    return dict(counted.calls), dict(counted.nbytes), [unit.numel for unit in model.units]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_traffic_per_step_is_one_and_a_half_times_ddps(world_size):
    n = world_size
    for calls, nbytes, numels in labkit.run(traffic_of_a_step, world_size=n):
        assert calls == {"all_gather": 2 * len(numels), "reduce_scatter": len(numels)}  # gather twice, reduce once
        # a ring all-gather sends (N-1) pieces of this rank's contribution; a reduce-scatter (N-1)/N of its input
        sent = (n - 1) * nbytes["all_gather"] + (n - 1) / n * nbytes["reduce_scatter"]
        parameter_bytes = 4 * sum(numels)
        padding = 3 * (n - 1) * 4 * len(numels)  # each piece padded by at most one element
        assert 0 <= sent - 3 * (n - 1) / n * parameter_bytes <= padding
        ddp = 2 * (n - 1) / n * parameter_bytes  # DDP's ring all_reduce of every gradient
        assert sent / ddp == pytest.approx(1.5, abs=padding / ddp)


def timeline_of_a_step():
    model = FullyShardedDP(Tied().to(labkit.device()))
    loss_of(model, mine(batches()[0])).backward()
    model.finish()
    return [(e.kind, e.unit, e.phase, e.start, e.end) for e in model.timeline]


def test_the_next_units_all_gather_starts_before_the_current_units_compute_ends():
    for timeline in labkit.run(timeline_of_a_step, world_size=2):
        def bar(kind, unit, phase, timeline=timeline):
            (found,) = [(start, end) for k, u, p, start, end in timeline if (k, u, p) == (kind, unit, phase)]
            return found
        block, norm = 0, 1
        assert bar("all_gather", norm, "forward")[0] < bar("compute", block, "forward")[1]  # prefetched
        assert bar("all_gather", block, "backward")[0] < bar("compute", norm, "backward")[1]
        assert all(start <= end for _, _, _, start, end in timeline)  # every bar complete, in seconds


class EventMark:
    """A stand-in for torch.cuda.Event(enable_timing=True) as labkit.measure.Stopwatch uses it on CUDA: a mark
    that must be synchronized and is read with elapsed_time."""

    def __init__(self):
        self.seconds = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, later):
        return (later.seconds - self.seconds) * 1e3  # milliseconds, as CUDA events count


class EventStopwatch(measure.Stopwatch):
    """labkit.measure.Stopwatch's CUDA path, on the CPU: marks are events; seconds() synchronizes one, as it does on
    CUDA (a mark that is not an event fails there, as it would on a GPU)."""

    def __init__(self, device):
        super().__init__("cpu")
        self.cuda, self.start = True, EventMark()

    def mark(self):
        return EventMark()


class Failing(nn.Linear):
    fail = False

    def forward(self, x):
        if self.fail:
            raise RuntimeError("this unit's forward failed")
        return super().forward(x)


def timelines_with_event_marks():
    """A step, then a step whose middle unit raises in its forward: finish() closes both timelines with event-like
    marks (the CUDA path), the bar that never ended as NaN."""
    saved, measure.Stopwatch = measure.Stopwatch, EventStopwatch
    try:
        model = FullyShardedDP(nn.Sequential(nn.Linear(4, 6), Failing(6, 6), nn.Linear(6, 2)).to(labkit.device()))
        x = torch.ones(3, 4, device=labkit.device())
        model(x).sum().backward()
        model.finish()
        complete = [(e.kind, e.unit, e.phase, e.start, e.end) for e in model.timeline]
        model.module[1].fail = True
        try:
            model(x)
        except RuntimeError:
            model.finish()
        return complete, [(e.kind, e.unit, e.phase, e.end) for e in model.timeline]
    finally:
        measure.Stopwatch = saved


def test_finish_closes_a_timeline_with_a_bar_that_never_ended():
    for complete, broken in labkit.run(timelines_with_event_marks, world_size=2):
        assert complete and all(0 <= start <= end for _, _, _, start, end in complete)  # in seconds, from events
        never_ended = [bar for bar in broken if bar[3] != bar[3]]
        assert [bar[:3] for bar in never_ended] == [("compute", 1, "forward")], broken
        assert all(end >= 0 for *_, end in broken if end == end)


# --- bad input, said clearly ---

def refusals():
    said = []
    model = Tied().to(labkit.device())
    for bad in ({"compute_dtype": torch.int8}, {"units": [nn.Linear(2, 2)]}, {"units": [model.block, model.block[0]]},
                {"units": 3}, {"module": nn.Linear(2, 2, device="meta")}, {"module": "a model"}):
        try:
            FullyShardedDP(**{"module": model, **bad})
        except (TypeError, ValueError) as error:
            said.append(f"{type(error).__name__}: {error}")
    return said


def test_bad_arguments_are_refused_with_what_to_pass():
    said = labkit.run(refusals, world_size=1)[0]
    assert len(said) == 6
    assert said[0].startswith("ValueError: compute_dtype=torch.int8: pass None") and "torch.bfloat16" in said[0]
    assert "is not a submodule of module" in said[1]
    assert "'block' and 'block.0' overlap" in said[2]
    assert said[3].startswith("TypeError: units=3: pass a list of submodules of module")
    assert "rank 0: 'weight' is on meta, not on labkit.device() = cpu. Move it there first: " \
           "module.to(labkit.device())" in said[4]
    assert said[5] == "TypeError: module='a model': pass a torch.nn.Module, not a str."


def wrap_with_rank_1_off_the_device():
    model = Tied().to("meta" if labkit.rank() == 1 else labkit.device())
    try:
        FullyShardedDP(model)
    except ValueError as error:
        return str(error)
    return "wrapped"


def test_a_module_off_the_device_on_one_rank_is_named_on_every_rank():
    said = labkit.run(wrap_with_rank_1_off_the_device, world_size=2, timeout=30)
    assert said[0] == said[1] and "rank 1: 'embed.weight' is on meta" in said[0], said
