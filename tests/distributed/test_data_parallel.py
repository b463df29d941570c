"""labkit.parallel.data on real gloo processes: averaging by hand and BucketedDDP give what one process
with the whole batch gives, and what torch's DistributedDataParallel gives, step for step."""

import contextlib
import hashlib
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import labkit
from labkit.models import TinyGPT, char_batches, lesson_text, make_classification, mlp
from labkit.parallel import BucketedDDP, average_gradients, broadcast_parameters, count_allreduces

pytestmark = pytest.mark.numerics  # compares floating-point results: make unit runs it again on other kernels

BATCH, STEPS = 24, 4  # 24 examples per step: 24, 12, 8 or 6 per rank on 1 to 4 ranks
SMALL_MB = 0.001  # buckets of about 1 KiB (one closes past it): mlp()'s 5.5 k parameters fill three


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def checksum(vector: torch.Tensor) -> str:
    return hashlib.sha256(vector.numpy().tobytes()).hexdigest()[:16]


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "sgd+decay":  # moves a parameter whose gradient is zero, but not one whose gradient is None
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)
    return torch.optim.Adam(params, lr=0.01)


def my_share(t: torch.Tensor, step: int, batch: int = BATCH) -> torch.Tensor:
    """This rank's contiguous part of step `step`'s global batch."""
    return t[step * batch:(step + 1) * batch].tensor_split(labkit.world_size())[labkit.rank()]


# --- N ranks with B/N each equal one process with B ---

def train_on_ranks(method, optimizer, dtype):
    x, y = (t.to(labkit.device()) for t in make_classification(BATCH * STEPS, dtype=dtype))
    model = mlp(dtype=dtype, seed=labkit.rank()).to(labkit.device())  # different on every rank until broadcast
    if method == "naive":
        broadcast_parameters(model)
        net = model
    else:
        net = BucketedDDP(model, bucket_mb=SMALL_MB)
    opt = make_optimizer(optimizer, model.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        F.cross_entropy(net(my_share(x, step)), my_share(y, step)).backward()
        average_gradients(model) if method == "naive" else net.finish()
        opt.step()
    return flat(model)


def train_in_one_process(optimizer, dtype):
    x, y = make_classification(BATCH * STEPS, dtype=dtype)
    model = mlp(dtype=dtype, seed=0)
    opt = make_optimizer(optimizer, model.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        F.cross_entropy(model(x[step * BATCH:(step + 1) * BATCH]), y[step * BATCH:(step + 1) * BATCH]).backward()
        opt.step()
    return flat(model)


CASES = [(m, o, d) for m in ("naive", "bucketed") for o in ("sgd", "adam") for d in (torch.float64, torch.float32)]


def every_case():
    return [train_on_ranks(*case) for case in CASES]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_n_ranks_with_a_share_each_equal_one_process_with_the_whole_batch(world_size):
    per_rank = labkit.run(every_case, world_size=world_size)
    for i, (method, optimizer, dtype) in enumerate(CASES):
        expected = train_in_one_process(optimizer, dtype)
        tolerance = 1e-12 if dtype == torch.float64 else 2e-5
        for rank, results in enumerate(per_rank):
            error = (results[i] - expected).abs().max() / expected.abs().max()
            assert error <= tolerance, (method, optimizer, dtype, rank, error.item())
            assert torch.equal(results[i], per_rank[0][i]), (method, optimizer, dtype, rank)  # same all-reduced bits


# --- Without averaging the replicas drift apart; with it they stay bit-identical ---

def replicas(average: bool, steps: int = 8):
    x, y = make_classification(BATCH)  # every step the same batch: each rank keeps pulling its own way
    model = mlp(seed=labkit.rank())
    broadcast_parameters(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snapshots = [flat(model)]
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(my_share(x, 0)), my_share(y, 0)).backward()
        if average:
            average_gradients(model)
        opt.step()
        snapshots.append(flat(model))
    return snapshots


def test_replicas_diverge_without_averaging_and_stay_identical_with_it():
    alone = labkit.run(replicas, False, world_size=2)
    drift = [(a - b).abs().max().item() for a, b in zip(*alone, strict=True)]
    assert drift[0] == 0  # the broadcast made them identical
    assert all(later >= earlier for earlier, later in zip(drift[1:], drift[2:], strict=False)), drift
    assert 0 < drift[1] < drift[-1], drift
    assert checksum(alone[0][-1]) != checksum(alone[1][-1])
    together = labkit.run(replicas, True, world_size=2)
    assert all(torch.equal(a, b) for a, b in zip(*together, strict=True))
    assert checksum(together[0][-1]) == checksum(together[1][-1])


# --- BucketedDDP against torch's DistributedDataParallel ---

class Branchy(nn.Module):
    """A body and two heads: head_a always used, head_b only when asked; and a spare layer, never used."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.spare, self.body, self.head_a, self.head_b = nn.Linear(32, 4), nn.Linear(8, 32), nn.Linear(32, 4), \
            nn.Linear(32, 4)

    def forward(self, x, use_b: bool):
        hidden = torch.relu(self.body(x))
        return self.head_a(hidden) + self.head_b(hidden) if use_b else self.head_a(hidden)


def mlp_batches(step):
    x, y = make_classification(16 * 5, seed=1)
    return (my_share(x, step, 16),), lambda out: F.cross_entropy(out, my_share(y, step, 16))


def branchy_batches(step):
    x, y = make_classification(16 * 5, features=8, seed=1)
    return (my_share(x, step, 16), labkit.rank() == 1), lambda out: F.cross_entropy(out, my_share(y, step, 16))


def gpt_batches(step):
    inputs, targets = list(char_batches(lesson_text(), 4, 16, 5, seed=labkit.rank()))[step]
    return (inputs,), lambda out: F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))


def make_gpt(seed):
    return TinyGPT(len(set(lesson_text())), d_model=16, layers=1, heads=2, context=16, seed=seed)


def make_frozen_mlp(seed):
    model = mlp(seed=seed)
    model[0].requires_grad_(False)
    return model


def against_torch_ddp(make_model, batches, optimizer, find_unused=False, steps=4, bucket_mb=SMALL_MB):
    """Train the same model with BucketedDDP and with torch DDP side by side; report what the tests check."""
    ours_model, torch_model = make_model(seed=labkit.rank()), make_model(seed=labkit.rank())
    initial = flat(make_model(seed=0))
    ours = BucketedDDP(ours_model, bucket_mb=bucket_mb)
    theirs = DistributedDataParallel(torch_model, bucket_cap_mb=bucket_mb, find_unused_parameters=find_unused)
    opt_ours, opt_theirs = make_optimizer(optimizer, ours.parameters()), make_optimizer(optimizer, theirs.parameters())
    with count_allreduces() as counted:  # counts labkit's all_reduces only, not torch DDP's
        for step in range(steps):
            inputs, loss_of = batches(step)
            for net, opt in ((ours, opt_ours), (theirs, opt_theirs)):
                opt.zero_grad()
                loss_of(net(*inputs)).backward()
                if net is ours:
                    ours.finish()
                opt.step()
    return {
        "same": [torch.equal(a, b) for a, b in zip(ours_model.parameters(), torch_model.parameters(), strict=True)],
        "params": flat(ours_model), "initial": initial, "buckets": ours.buckets, "timeline": ours.timeline,
        "counted": counted, "steps": steps, "ours_layout": our_buckets(ours), "torch_layout": torch_buckets(theirs),
        "no_grad": [n for n, p in ours_model.named_parameters() if p.grad is None],
        "unique": {n: p.numel() for n, p in ours_model.named_parameters()},
    }


def torch_buckets(ddp: DistributedDataParallel) -> list[list[int]] | None:
    """torch DDP's buckets as it rebuilt them after its first backward, in the order the gradients arrived: lists
    of parameter indices, from DDP's logging data (torch 2.13's "rebuilt_per_bucket_param_indices"); None where
    it never rebuilds them (find_unused_parameters=True keeps its first layout)."""
    rebuilt = ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")
    return None if rebuilt is None else [[int(i) for i in bucket.split()] for bucket in rebuilt.split(",")]


def our_buckets(ddp: BucketedDDP) -> list[list[int]]:
    """BucketedDDP's buckets, as lists of indices into the model's trainable parameters."""
    index = {n: i for i, (n, _) in enumerate((n, p) for n, p in ddp.module.named_parameters() if p.requires_grad)}
    return [[index[n] for n in bucket.names] for bucket in ddp.buckets]


def check_same_as_torch(results):
    """Bit for bit (2 ranks): the same model on the same data with the same kernels, side by side in one process,
    and the average of two ranks is exact whichever way each divides ((a + b) / 2 = a / 2 + b / 2 for a power of
    two; a + b = b + a). Replicas: every rank applies the same all-reduced bits."""
    for rank, r in enumerate(results):
        assert all(r["same"]), (rank, r["same"])
        assert torch.equal(r["params"], results[0]["params"])
        assert not torch.equal(r["params"], r["initial"])  # it trained
        messages = sum(b.nbytes for b in r["buckets"])
        assert (r["counted"].calls, r["counted"].nbytes) == (r["steps"] * len(r["buckets"]), r["steps"] * messages)


def test_bucketed_ddp_equals_torch_ddp_with_several_buckets():
    results = labkit.run(against_torch_ddp, mlp, mlp_batches, "adam", world_size=2)
    check_same_as_torch(results)
    buckets, timeline = results[0]["buckets"], results[0]["timeline"]
    assert len(buckets) > 2
    assert [n for b in buckets for n in b.names] == [n for n, _ in mlp().named_parameters()][::-1]
    # torch's rule: a bucket closes with the gradient that takes it to the cap or past it; the layout is torch's
    cap = SMALL_MB * 2**20
    gradient_nbytes = [(b.numel - b.params[-1].numel()) * 4 for b in buckets]  # without its last gradient
    assert all(b.numel * 4 >= cap > before for b, before in zip(buckets[:-1], gradient_nbytes, strict=False))
    assert results[0]["ours_layout"] == results[0]["torch_layout"] and len(buckets) == 3
    # the timeline: every gradient once, then its bucket launched, completed after; all before finish ends
    grads = [e for e in timeline if e.kind == "grad"]
    reduces = [e for e in timeline if e.kind == "all_reduce"]
    finish = next(e for e in timeline if e.kind == "finish")
    assert sorted(e.name for e in grads) == sorted(n for n, _ in mlp().named_parameters())
    assert [e.bucket for e in reduces] == list(range(len(buckets)))
    for event in reduces:
        last_grad = max(e.start for e in grads if e.bucket == event.bucket)
        assert 0 <= last_grad <= event.start <= event.end <= finish.end
        assert event.start < finish.start  # launched during the backward: overlapped
        assert event.nbytes == buckets[event.bucket].nbytes


def default_buckets(steps=3):
    """BucketedDDP and torch DDP with their default bucket sizes on a model of 1.4 MB: their buckets, in bytes
    and as parameter indices, and whether the trained parameters agree."""
    x, y = (t.to(labkit.device()) for t in make_classification(BATCH * steps))
    ours_model, torch_model = (mlp(hidden=256, classes=8, layers=6, seed=labkit.rank()) for _ in range(2))
    ours, theirs = BucketedDDP(ours_model), DistributedDataParallel(torch_model)
    for net in (ours, theirs):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(steps):
            optimizer.zero_grad()
            F.cross_entropy(net(my_share(x, step)), my_share(y, step)).backward()
            if net is ours:
                ours.finish()
            optimizer.step()
    sizes = theirs._get_ddp_logging_data()["rebuilt_bucket_sizes"]
    return {"ours": our_buckets(ours), "theirs": torch_buckets(theirs),
            "ours nbytes": [b.numel * 4 for b in ours.buckets], "theirs nbytes": [int(n) for n in sizes.split(",")],
            "gap": max((a - b).abs().max().item() for a, b in zip(ours_model.parameters(), torch_model.parameters(),
                                                                   strict=True))}


def test_default_buckets_are_torch_ddps_with_a_first_bucket_of_1_mib():
    # torch DDP without bucket_cap_mb: a first bucket closed at 1 MiB (dist._DEFAULT_FIRST_BUCKET_BYTES), so the
    # first all_reduce starts early, then 25 MiB buckets; BucketedDDP by default lays them out the same way
    for r in labkit.run(default_buckets, world_size=2):
        assert r["ours"] == r["theirs"] and r["ours nbytes"] == r["theirs nbytes"]
        first, rest = r["ours nbytes"]
        # closed by the 256 x 256 weight that took it past 1 MiB
        assert first >= torch.distributed._DEFAULT_FIRST_BUCKET_BYTES == 2**20 > first - 256 * 256 * 4
        assert rest < 25 * 2**20
        assert r["gap"] < 1e-6  # float32: the same sums, possibly added in another order


def test_frozen_parameters_are_in_no_bucket_and_do_not_hold_up_the_others():
    results = labkit.run(against_torch_ddp, make_frozen_mlp, mlp_batches, "sgd", world_size=2)
    check_same_as_torch(results)
    r = results[0]
    assert not {"0.weight", "0.bias"} & {n for b in r["buckets"] for n in b.names}
    assert sum(b.numel for b in r["buckets"]) == sum(p.numel() for p in mlp().parameters()) - 16 * 64 - 64
    frozen = 16 * 64 + 64  # 0.weight and 0.bias come first in flat()
    assert torch.equal(r["params"][:frozen], r["initial"][:frozen]) and set(r["no_grad"]) == {"0.weight", "0.bias"}
    # a frozen parameter in a bucket would keep that bucket from launching before finish()
    finish = next(e for e in r["timeline"] if e.kind == "finish")
    assert all(e.start < finish.start for e in r["timeline"] if e.kind == "all_reduce")


def test_unused_parameters_match_torch_ddp_with_find_unused_parameters():
    # Buckets of at most 528 bytes: [head_b], [head_a], [body.bias], [body.weight], [spare]. Rank 1 uses
    # head_b, rank 0 does not: on rank 0 bucket 0 never fills and every bucket goes out in finish(), while
    # rank 1 launches all but the last during the backward; the same all_reduces in the same order all the
    # same. "spare" is used nowhere: its grad must stay None, so that weight decay leaves it alone (zeros
    # would shrink it).
    results = labkit.run(against_torch_ddp, Branchy, branchy_batches, "sgd+decay", True, bucket_mb=528 / 2**20,
                         world_size=2)
    check_same_as_torch(results)
    head = 32 * 4 + 4  # spare's elements come first in flat(), head_b's last
    for r in results:
        assert r["no_grad"] == ["spare.weight", "spare.bias"]
        assert torch.equal(r["params"][:head], r["initial"][:head])
        assert not torch.equal(r["params"][-head:], r["initial"][-head:])  # head_b trained, on rank 0 too
    buckets = [b.names for b in results[0]["buckets"]]
    assert buckets[0] == ["head_b.bias", "head_b.weight"] and buckets[-1] == ["spare.bias", "spare.weight"]
    early = [[e.start < next(f.start for f in r["timeline"] if f.kind == "finish")
              for e in r["timeline"] if e.kind == "all_reduce"] for r in results]
    assert early == [[False] * len(buckets), [True] * (len(buckets) - 1) + [False]]


def test_tied_weights_are_bucketed_and_reduced_once():
    results = labkit.run(against_torch_ddp, make_gpt, gpt_batches, "adam", steps=3, world_size=2)
    check_same_as_torch(results)
    r = results[0]
    names = [n for b in r["buckets"] for n in b.names]
    assert names.count("0.tok.weight") == 1 and "2.linear.weight" not in names  # the head (layer 2) is tied
    assert sorted(names) == sorted(r["unique"])
    assert sum(b.numel for b in r["buckets"]) == sum(r["unique"].values())  # the tied matrix counted once


# --- Accumulation: K micro-batches, uneven ones included, equal one batch K times the size ---

def accumulate(mode: str, steps: int = 3, micro: int = 5, batch: int = 25):
    x, y = make_classification(batch * steps, dtype=torch.float64)
    model = mlp(dtype=torch.float64, seed=labkit.rank())
    naive = mode == "naive"
    net = broadcast_parameters(model) or model if naive else BucketedDDP(model, bucket_mb=SMALL_MB)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sizes = []
    with count_allreduces() as counted:
        for step in range(steps):
            opt.zero_grad()
            pieces = list(zip(my_share(x, step, batch).split(micro), my_share(y, step, batch).split(micro),
                              strict=True))  # 13 examples on rank 0: 5, 5, 3; 12 on rank 1: 5, 5, 2
            sizes = [len(xm) for xm, _ in pieces]
            for i, (xm, ym) in enumerate(pieces):
                sync = mode == "every micro-batch" or i == len(pieces) - 1
                with contextlib.nullcontext() if sync or naive else net.no_sync():
                    # each example weighs 1/batch over all micro-batches and ranks (x world size: we divide by it)
                    (F.cross_entropy(net(xm), ym, reduction="sum") * labkit.world_size() / batch).backward()
                if sync and not naive:
                    net.finish()
            if naive:
                average_gradients(model)  # once, after the K backwards
            opt.step()
    return flat(model), counted.calls, 0 if naive else len(net.buckets), sizes


def test_accumulating_uneven_micro_batches_equals_one_big_batch_and_no_sync_saves_all_reduces():
    steps, batch = 3, 25
    x, y = make_classification(batch * steps, dtype=torch.float64)
    model = mlp(dtype=torch.float64, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x[step * batch:(step + 1) * batch]), y[step * batch:(step + 1) * batch]).backward()
        opt.step()
    expected = flat(model)
    calls, buckets = {}, {}
    for mode in ("no_sync", "every micro-batch", "naive"):
        results = labkit.run(accumulate, mode, world_size=2)
        assert [r[3] for r in results] == [[5, 5, 3], [5, 5, 2]]
        for params, *_ in results:
            assert (params - expected).abs().max() <= 1e-12 * expected.abs().max(), mode
        calls[mode], buckets[mode] = results[0][1], results[0][2]
    micro_batches = 3
    assert buckets["no_sync"] > 1 and calls["no_sync"] == steps * buckets["no_sync"]
    assert calls["every micro-batch"] == micro_batches * calls["no_sync"]
    assert calls["naive"] == steps * len(list(mlp().parameters()))


# --- A rank with another model: a clear error, not a hang ---

def mismatched(which: str):
    model = mlp(hidden=9 if labkit.rank() == 1 else 8, layers=3 if labkit.rank() == 2 else 2)
    BucketedDDP(model) if which == "BucketedDDP" else broadcast_parameters(model)


@pytest.mark.parametrize("which", ["BucketedDDP", "broadcast_parameters"])
def test_a_rank_with_a_different_model_gets_a_clear_error_not_a_hang(which):
    with pytest.raises(labkit.RankError) as raised:
        labkit.run(mismatched, which, world_size=3, timeout=30)
    assert not isinstance(raised.value, labkit.RankTimeout)
    text = str(raised.value)
    assert "ranks 0-2: ValueError" in text, text
    assert f"{which}: every rank needs the same model, but 2 rank(s) differ from rank 0" in text, text
    assert "rank 1: parameter '0.weight' (9, 16) float32 where rank 0 has parameter '0.weight' (8, 16) float32" in text
    assert "rank 2: 8 parameters and buffers where rank 0 has 6; parameter '4.weight' (8, 8) float32 where rank 0 " \
        "has parameter '4.weight' (4, 8) float32" in text, text


def test_outside_a_rank_or_with_a_bad_bucket_size_the_errors_say_what_to_do():
    for call in (lambda: broadcast_parameters(mlp()), lambda: average_gradients(mlp()), lambda: BucketedDDP(mlp())):
        with pytest.raises(RuntimeError, match="needs a torch.distributed process group: call it inside a rank"):
            call()
    with pytest.raises(ValueError, match=re.escape("bucket_mb=0: pass a finite number > 0")):
        BucketedDDP(mlp(), bucket_mb=0)
    with pytest.raises(TypeError, match="first_bucket_mb='1'"):
        BucketedDDP(mlp(), first_bucket_mb="1")


def off_the_device():
    model = mlp().to(labkit.device())
    broadcast_parameters(model.to("meta") if labkit.rank() == 1 else model)


def test_a_model_off_labkit_device_gets_a_clear_error_on_every_rank():
    with pytest.raises(labkit.RankError) as raised:
        labkit.run(off_the_device, world_size=2, timeout=30)
    text = str(raised.value)
    assert "ranks 0-1: ValueError" in text, text
    assert "broadcast_parameters: the model must live on each rank's labkit.device() (the CPU under gloo, " \
           "cuda:LOCAL_RANK under NCCL), but rank 1: parameter '0.weight' is on meta, not on labkit.device() = " in text
    assert ". Move it there first: model.to(labkit.device())." in text, text


# --- The counter ---

def count_naive():
    x, y = make_classification(16, features=8)
    model = Branchy(labkit.rank())
    model.body.bias.requires_grad_(False)  # frozen
    broadcast_parameters(model)
    F.cross_entropy(model(x, False), y).backward()  # head_b and spare get no gradient
    with count_allreduces() as outer:
        with count_allreduces() as inner:
            average_gradients(model)
        average_gradients(model)
    average_gradients(model)  # not counted
    return inner, outer, {n: p.grad.nbytes for n, p in model.named_parameters() if p.grad is not None}


def test_counter_sees_one_all_reduce_per_gradient_and_their_bytes():
    for inner, outer, grads in labkit.run(count_naive, world_size=2):
        assert sorted(grads) == ["body.weight", "head_a.bias", "head_a.weight"]
        assert (inner.calls, inner.nbytes) == (3, sum(grads.values())) == (3, (32 * 8 + 4 * 32 + 4) * 4)
        assert (outer.calls, outer.nbytes) == (6, 2 * inner.nbytes)


# --- Misuse: clear errors, and a model wrapped twice (a notebook cell run again) reduces once ---

def misuse():
    x, y = make_classification(16)
    model = mlp(seed=labkit.rank())
    BucketedDDP(model, bucket_mb=SMALL_MB)
    ddp = BucketedDDP(model, bucket_mb=SMALL_MB)  # the first wrapper's hooks are removed
    errors = []
    with count_allreduces() as counted:
        F.cross_entropy(ddp(x), y).backward()
        try:
            ddp(x)  # forward before finish()
        except RuntimeError as error:
            errors.append(str(error))
        ddp.finish()
    try:
        F.cross_entropy(ddp(x), y).backward()
        F.cross_entropy(ddp.module(x), y).backward()  # a second backward before finish()
    except RuntimeError as error:
        errors.append(str(error))
    ddp.finish()  # every rank launches the rest: the pool stays in step
    return counted.calls, len(ddp.buckets), errors


def test_misuse_gets_clear_errors_and_a_second_wrapper_replaces_the_first():
    for calls, buckets, errors in labkit.run(misuse, world_size=2):
        assert calls == buckets
        assert len(errors) == 2
        assert "forward before the last backward's gradients were averaged: call finish()" in errors[0]
        assert "received a second gradient before finish()" in errors[1]


def stopwatch_marks():
    """Inside a rank: one synchronised backward of a BucketedDDP whose labkit.measure.Stopwatch is a recorder
    (each mark a fresh number, read back as 10 x that number): where it was made, how often it marked, and
    the timeline it produced."""
    from labkit import measure

    made = []

    class Recorder(measure.Stopwatch):
        def __init__(self, device):
            made.append(str(device))
            self.cuda, self.count = False, 0
            self.start = self.mark()

        def mark(self):
            self.count += 1
            return self.count

        def seconds(self, mark):
            return 10.0 * mark

    real = measure.Stopwatch
    measure.Stopwatch = Recorder
    try:
        model = BucketedDDP(mlp(), bucket_mb=0.01)
        F.cross_entropy(model(torch.randn(8, 16)), torch.randint(4, (8,))).backward()
        model.finish()
    finally:
        measure.Stopwatch = real
    return made, len(model.buckets), [(e.kind, e.start, e.end) for e in model.timeline]


def test_bucketed_ddp_times_its_timeline_with_the_stopwatch():
    """Every time on the timeline is a Stopwatch mark read back by Stopwatch.seconds (CUDA events on a GPU,
    which NCCL's complete-at-enqueue futures need): none comes from the host clock directly."""
    made, buckets, timeline = labkit.run(stopwatch_marks, world_size=2)[0]
    assert made == ["cpu"]  # one per synchronised backward, on the parameters' device
    kinds = [kind for kind, _, _ in timeline]
    assert kinds.count("grad") == 6 and kinds.count("all_reduce") == buckets > 1 and kinds[-1] == "finish"
    times = [t for _, start, end in timeline for t in (start, end)]
    assert all(t % 10 == 0 and t >= 20 for t in times)  # each a mark after the start (10 x 1), read back
    assert len({start for kind, start, _ in timeline if kind != "grad"}) == buckets + 1  # its own mark each
