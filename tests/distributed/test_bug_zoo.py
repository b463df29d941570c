"""Notebook 15's bug zoo: each broken run shows its own symptom on real ranks, the diagnosis widget grades and
records the answers, and check_fixed_training rejects a catalogue of wrong fixes, each with a message that names
the mistake, and accepts right ones written differently."""

import dataclasses
import importlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import labkit
from labkit.exercises import Verdict, where_ranks_waited
from labkit.exercises._kit._runner import GRADERS
from labkit.exercises.bug_zoo import ANSWERS, BATCH, CAUSES, Symptoms, cause_gap, confirmation, reference_run, zoo_run
from labkit.exercises.bug_zoo_fix import check_fixed_training, draw_cases
from labkit.exercises.progress import load_progress
from labkit.launch import pools_apart
from labkit.parallel import average_gradients, broadcast_parameters
from labkit.widgets.zoo_diagnosis import DiagnosisCard, diagnosis_widget

HANG_SECONDS = 2.0  # a deadlocked fix is stopped after this long (a right one takes milliseconds)


@pytest.fixture(scope="module", autouse=True)
def warm_pools():
    """Start the pools of 2 and 3 ranks with the grader's rank side imported, so no timeout is spent starting."""
    with pools_apart(GRADERS):  # the graders' own ranks, apart from the student's
        for world_size in (2, 3):
            labkit.run(importlib.import_module, "labkit.exercises.bug_zoo_fix", world_size=world_size)


# ---- the zoo: every run shows its symptom, on 3 ranks ---------------------------------------------------

def symptoms(letter):
    return Symptoms(labkit.run(zoo_run, letter, world_size=3), reference_run(batch_norm=letter == "C"))


def test_each_broken_run_shows_its_symptom_and_a_healthy_run_none():
    healthy = symptoms("healthy")
    assert healthy.reference_gap() < 1e-6 and len(set(healthy.end_checksums())) == 1
    same_shard = symptoms("A")                                                  # one loss on every rank
    assert len({round(r.losses[-1], 9) for r in same_shard.records}) == 1
    assert same_shard.reference_gap(reference_run(rows=slice(0, BATCH // 3))) < 1e-6
    assert cause_gap("A", same_shard) < 1e-6 < cause_gap("A", symptoms("healthy"))   # what 13 checks unnamed
    assert "first 1/N of the batch" in confirmation("A", same_shard)
    assert symptoms("B").first_step_ratio() == pytest.approx(3, rel=1e-4)      # no divide: N x the step
    batch_norm = symptoms("C")
    assert len(set(batch_norm.end_checksums())) == 1                            # parameters agree ...
    assert len({round(r.buffer_checksum, 4) for r in batch_norm.records}) == 3  # ... running stats do not
    bf16 = symptoms("D")
    assert 1e-5 < bf16.reference_gap() < 1e-2
    assert bf16.records[0].allreduce_nbytes * 2 == bf16.parameter_nbytes()
    no_broadcast = symptoms("F")
    assert len(set(no_broadcast.start_checksums())) == 3
    assert "identical" not in str(no_broadcast).splitlines()[0]


@pytest.mark.parametrize(("barrier", "expected"), [(None, "rank 2 was still running in all_reduce"),
                                                   ("monitored", "Rank 2 failed to pass monitoredBarrier"),
                                                   ("detail", "Rank 2 is running collective")])
def test_the_extra_batch_hangs_and_each_tool_names_the_rank(barrier, expected):
    with pytest.raises(labkit.RankError) as caught:
        labkit.run(zoo_run, "E", barrier, world_size=3, timeout=5 if barrier is None else 30)
    found = where_ranks_waited(caught.value, 3) if barrier is None else str(caught.value)
    assert expected in found, found


# ---- the diagnosis widget ------------------------------------------------------------------------------

def test_the_widget_says_why_keeps_the_state_and_records_six_right(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_PROGRESS", str(tmp_path / "progress.json"))
    widget = diagnosis_widget()
    cards = [c for c in widget.children if isinstance(c, DiagnosisCard)]
    assert [c.letter for c in cards] == list("ABCDEF")
    first = cards[0]
    first.choose("learning_rate")
    assert "Not this one" in first.feedback.value and CAUSES["learning_rate"].shows in first.feedback.value
    assert load_progress()["bug_zoo_diagnoses"] == {"passed": False, "attempts": 1, "passed_at": None}
    for card in cards:
        card.choose(ANSWERS[card.letter])
        assert "Right" in card.feedback.value
    assert "6 of 6" in widget.children[0].value
    assert load_progress()["bug_zoo_diagnoses"]["passed"]
    first.choose("learning_rate")                      # a later slip is shown, and the pass stays recorded
    assert "5 of 6" in widget.children[0].value and load_progress()["bug_zoo_diagnoses"]["passed"]


def test_a_cause_is_confirmed_only_once_the_student_has_chosen_it(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_PROGRESS", str(tmp_path / "progress.json"))
    asked = []
    card = diagnosis_widget(confirm={"A": lambda: asked.append("A") or "A measurement confirms it."}).children[1]
    assert card.letter == "A" and not asked and "measurement" not in card.feedback.value
    card.choose("learning_rate")
    assert "Not this one" in card.feedback.value and "measurement" not in card.feedback.value and not asked
    card.choose(ANSWERS["A"])
    assert "Right" in card.feedback.value and "A measurement confirms it." in card.feedback.value and asked


def test_every_run_offers_its_answer_and_two_distractors_in_alphabetical_order():
    for card in diagnosis_widget().children[1:]:
        labels, keys = zip(*card.dropdown.options[1:], strict=True)
        assert card.dropdown.value == "" and ANSWERS[card.letter] in keys
        assert len(keys) == 8 and list(labels) == sorted(labels)


# ---- the fix: right solutions ---------------------------------------------------------------------------

def sgd(model, lr):
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad


def fixed_loop(model, x, y, steps, lr):
    """The broken loop with its two lines added: broadcast first, divide after the all_reduce."""
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    for _ in range(steps):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        sgd(model, lr)


def flat_and_async(model, x, y, steps, lr):
    """One flat broadcast, then async all_reduces, each waited, and the division folded into the step."""
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    dist.broadcast(flat, src=0)
    with torch.no_grad():
        for p, piece in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.copy_(piece.view_as(p))
    for _ in range(steps):
        for p in params:
            p.grad = None
        F.cross_entropy(model(x), y).backward()
        handles = [dist.all_reduce(p.grad, async_op=True) for p in params]
        for handle in handles:
            handle.wait()
        with torch.no_grad():
            for p in params:
                p -= lr / dist.get_world_size() * p.grad


def broadcast_in_first_step(model, x, y, steps, lr):
    """The broadcast inside the loop, before the first forward, and ReduceOp.AVG."""
    for step in range(steps):
        if step == 0:
            for tensor in model.state_dict().values():
                dist.broadcast(tensor, 0)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        sgd(model, lr)


def logs_loss(model, x, y, steps, lr):
    """A realistic loop that logs the loss: once before the broadcast (gradients on, no backward) and after each
    update under torch.no_grad(); neither forward is a training step."""
    _ = F.cross_entropy(model(x), y).item()
    for p in model.parameters():
        dist.broadcast(p.data, 0)
    for _ in range(steps):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
            _ = F.cross_entropy(model(x), y).item()


def one_bucket_and_a_logged_loss(model, x, y, steps, lr):
    """Every gradient in one flat bucket, summed by one all_reduce, and the loss averaged over the ranks for a log
    line: the grader checks what an all_reduce carries, and neither is data."""
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    params = list(model.parameters())
    for _ in range(steps):
        model.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        bucket = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(bucket)
        logged = loss.detach().clone()
        dist.all_reduce(logged, op=dist.ReduceOp.AVG)
        with torch.no_grad():
            for p, piece in zip(params, bucket.split([p.numel() for p in params]), strict=True):
                p -= lr * piece.view_as(p) / dist.get_world_size()


RIGHT = [fixed_loop, flat_and_async, broadcast_in_first_step, logs_loss, one_bucket_and_a_logged_loss]


@pytest.mark.parametrize("fix", RIGHT, ids=lambda f: f.__name__)
def test_right_fixes_pass(fix):
    verdict = check_fixed_training(fix, record=False, timeout_seconds=20)
    assert isinstance(verdict, Verdict) and verdict, verdict


# ---- the fix: wrong solutions, each named --------------------------------------------------------------

def broken(model, x, y, steps, lr):
    """The notebook's broken loop as it is: no broadcast, no divide."""
    for _ in range(steps):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        sgd(model, lr)


def no_divide(model, x, y, steps, lr):
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    broken(model, x, y, steps, lr)


def weights_only_broadcast(model, x, y, steps, lr):
    for name, p in model.named_parameters():
        if name.endswith("weight"):
            dist.broadcast(p.data, src=0)
    fixed_loop_without_broadcast(model, x, y, steps, lr)


def fixed_loop_without_broadcast(model, x, y, steps, lr):
    for _ in range(steps):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        sgd(model, lr)


def averaged_parameters(model, x, y, steps, lr):
    for p in model.parameters():
        dist.all_reduce(p.data)
        p.data /= dist.get_world_size()
    fixed_loop_without_broadcast(model, x, y, steps, lr)


def divide_by_n_minus_one(model, x, y, steps, lr):
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    for _ in range(steps):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size() - 1
        sgd(model, lr)


def divide_by_rank_plus_one(model, x, y, steps, lr):
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    for _ in range(steps):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_rank() + 1
        sgd(model, lr)


def no_zero_grad(model, x, y, steps, lr):
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    for _ in range(steps):
        F.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        sgd(model, lr)


def weights_only_averaged(model, x, y, steps, lr):
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    for _ in range(steps):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for name, p in model.named_parameters():
            if name.endswith("weight"):
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        sgd(model, lr)


def only_rank_zero_broadcasts(model, x, y, steps, lr):
    if dist.get_rank() == 0:
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    fixed_loop_without_broadcast(model, x, y, steps, lr)


def ready_made(model, x, y, steps, lr):
    broadcast_parameters(model)
    for _ in range(steps):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        average_gradients(model)
        sgd(model, lr)


def stub(model, x, y, steps, lr):
    raise NotImplementedError("your turn")


def extra_step(model, x, y, steps, lr):
    fixed_loop(model, x, y, steps + 1, lr)


def parameter_averaging(model, x, y, steps, lr):
    """Local SGD steps, then the parameters averaged: equal to plain SGD, but not gradient averaging."""
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    for _ in range(steps):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        sgd(model, lr)
        for p in model.parameters():
            dist.all_reduce(p.data)
            p.data /= dist.get_world_size()


def whole_batch_everywhere(model, x, y, steps, lr):
    """Every rank gathers the whole batch and trains on it: one process's run, N times, not data parallel."""
    xs = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    ys = [torch.empty_like(y) for _ in range(dist.get_world_size())]
    dist.all_gather(xs, x)
    dist.all_gather(ys, y)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    for _ in range(steps):
        model.zero_grad()
        F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        sgd(model, lr)


def hard_coded_steps(model, x, y, steps, lr):
    """The right loop for the grader's old constant, 3 steps, whatever `steps` is."""
    fixed_loop(model, x, y, 3, lr)


def hard_coded_lr(model, x, y, steps, lr):
    """The right loop with the grader's old constant, lr = 0.1, whatever `lr` is."""
    fixed_loop(model, x, y, steps, 0.1)


def whole_batch_through_all_reduce(model, x, y, steps, lr):
    """The whole batch gathered with the allowed collective: each rank's shard in a zero-padded copy, summed;
    then every rank trains on all of it. Only the parameters' path is right: what was all-reduced is data."""
    n, rank, world = x.shape[0], dist.get_rank(), dist.get_world_size()
    xs = torch.zeros(n * world, *x.shape[1:], dtype=x.dtype)
    ys = torch.zeros(n * world, dtype=torch.float64)
    xs[rank * n:(rank + 1) * n], ys[rank * n:(rank + 1) * n] = x, y.to(torch.float64)
    dist.all_reduce(xs)
    dist.all_reduce(ys)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    for _ in range(steps):
        model.zero_grad()
        F.cross_entropy(model(xs), ys.long()).backward()
        sgd(model, lr)


def whole_batch_through_broadcasts(model, x, y, steps, lr):
    """The whole batch gathered with the other allowed collective: each rank broadcasts its shard in turn."""
    shards = []
    for source in range(dist.get_world_size()):
        xs, ys = x.clone(), y.clone()
        dist.broadcast(xs, src=source)
        dist.broadcast(ys, src=source)
        shards.append((xs, ys))
    xs, ys = torch.cat([s for s, _ in shards]), torch.cat([t for _, t in shards])
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    for _ in range(steps):
        model.zero_grad()
        F.cross_entropy(model(xs), ys).backward()
        sgd(model, lr)


def divide_by_two(model, x, y, steps, lr):
    """A hard-coded 2, right on 2 ranks only."""
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    for _ in range(steps):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= 2
        sgd(model, lr)


def async_all_reduce_no_wait(model, x, y, steps, lr):
    """Each gradient all-reduced with async_op=True and divided at once, its handle never waited for."""
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    for _ in range(steps):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, async_op=True)
            p.grad /= dist.get_world_size()
        sgd(model, lr)


def async_broadcast_no_wait(model, x, y, steps, lr):
    """The initial broadcast started with async_op=True, its handles dropped."""
    for p in model.parameters():
        dist.broadcast(p.data, src=0, async_op=True)
    fixed_loop_without_broadcast(model, x, y, steps, lr)


WRONG = [
    (async_all_reduce_no_wait, "all_reduce(s) with async_op=True and never waited for them",
     "the first was dist.all_reduce of the gradient of 0.weight"),
    (async_broadcast_no_wait, "started 4 broadcast(s) with async_op=True and never waited for them",
     "the first was dist.broadcast of the parameter 0.weight"),
    (broken, "own random initialisation"),
    (fixed_loop_without_broadcast, "own random initialisation"),
    (no_divide, "not divided by N = 3"),
    (weights_only_broadcast, "0.bias, 2.bias still held their own initial values at the first step, while "
                             "0.weight, 2.weight came from rank 0: those were left out of the broadcast"),
    (averaged_parameters, "not with rank 0's initial parameters"),
    (divide_by_n_minus_one, "divided by 2 on 3 ranks, not by N = 3"),
    (divide_by_two, "divided by 2 on 3 ranks, not by N = 3"),
    (parameter_averaging, "parameter averaging"),
    (whole_batch_everywhere, "called torch.distributed.all_gather"),
    (whole_batch_through_all_reduce, "called dist.all_reduce of this rank's shard of the data",
     "not data parallelism"),
    (whole_batch_through_broadcasts, "called dist.broadcast of this rank's shard of the data",
     "not data parallelism"),
    (hard_coded_steps, "forward passes with a backward for steps="),
    (hard_coded_lr, "as if it stepped with lr = 0.1,"),
    (divide_by_rank_plus_one, "rank 0: 3 x, rank 1: 1.5 x, rank 2: 1 x"),
    (no_zero_grad, "pile up"),
    (weights_only_averaged, "with its own gradient, not the average"),
    (ready_made, "broadcast_parameters"),
    (stub, "raised NotImplementedError: your turn: delete the stub's `raise`"),
    (extra_step, "forward passes with a backward for steps="),
]


@pytest.mark.parametrize(("fix", "phrases"), [(f, p) for f, *p in WRONG], ids=[f.__name__ for f, *_ in WRONG])
def test_wrong_fixes_are_named(fix, phrases):
    verdict = check_fixed_training(fix, record=False, timeout_seconds=20)
    assert not verdict and all(phrase in verdict.message for phrase in phrases), verdict


def test_a_deadlocked_fix_is_stopped_and_named():
    verdict = check_fixed_training(only_rank_zero_broadcasts, record=False, timeout_seconds=HANG_SECONDS)
    assert not verdict and "did not finish within 2 s" in verdict.message and "on every rank" in verdict.message
    assert check_fixed_training(fixed_loop, record=False), "the pools work again after the hang"


def test_the_untouched_stub_is_no_attempt_and_a_fix_is_one(tmp_path, monkeypatch):
    """As in every other grader (labkit.exercises.progress): running the notebook as it stands tries nothing."""
    monkeypatch.setenv("LABKIT_PROGRESS", str(tmp_path / "progress.json"))
    check_fixed_training(stub)
    assert "bug_zoo_fix" not in load_progress()
    check_fixed_training(broken)
    assert load_progress()["bug_zoo_fix"] == {"passed": False, "attempts": 1, "passed_at": None}


# ---- what each grading draws afresh -------------------------------------------------------------------------

def test_each_grading_draws_its_cases_afresh_and_the_two_cases_differ_in_steps_and_lr():
    draws = [draw_cases() for _ in range(20)]
    for cases in draws:
        assert [case.world_size for case in cases] == [3, 2]
        assert cases[0]["steps"] != cases[1]["steps"] and cases[0]["lr"] != cases[1]["lr"]
    assert len({tuple((c["steps"], c["lr"], c["rows"], c["hidden"]) for c in cases) for cases in draws}) > 1


@pytest.mark.parametrize("fix", [hard_coded_steps, hard_coded_lr], ids=lambda f: f.__name__)
def test_a_fix_that_hard_codes_the_old_constants_fails_even_when_one_case_draws_them(monkeypatch, fix):
    """Case one draws exactly the grader's old constants (3 steps, lr 0.1): the second case still differs."""
    from labkit.exercises import bug_zoo_fix
    from labkit.exercises._kit._runner import Case

    cases = [Case(3, {"steps": 3, "lr": 0.1, "rows": 4, "features": 6, "hidden": 8}),
             Case(2, {"steps": 2, "lr": 0.13, "rows": 5, "features": 5, "hidden": 7})]
    monkeypatch.setattr(bug_zoo_fix, "SPEC", dataclasses.replace(bug_zoo_fix.SPEC, cases=lambda: cases))
    verdict = check_fixed_training(fix, record=False, timeout_seconds=20)
    assert not verdict and verdict.message.startswith("On 2 ranks"), verdict


@pytest.mark.parametrize("smallest", [True, False], ids=["smallest", "largest"])
def test_a_right_fix_passes_at_both_ends_of_the_draw(monkeypatch, smallest):
    """The bounds of every drawn value: the fewest steps, rows and units, and the most."""
    from labkit.exercises import bug_zoo_fix
    from labkit.exercises._kit._runner import Case

    ends = {name: sorted(values, reverse=not smallest) for name, values in bug_zoo_fix.DRAWN.items()}
    cases = [Case(world_size, {"steps": ends["steps"][i], "lr": ends["lr"][i],  # the two cases' differ
                               **{name: ends[name][0] for name in ("rows", "features", "hidden")}})
             for i, world_size in enumerate((3, 2))]
    monkeypatch.setattr(bug_zoo_fix, "SPEC", dataclasses.replace(bug_zoo_fix.SPEC, cases=lambda: cases))
    verdict = check_fixed_training(one_bucket_and_a_logged_loss, record=False, timeout_seconds=20)
    assert verdict, verdict
