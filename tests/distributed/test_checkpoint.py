"""labkit.checkpoint: a data-parallel run killed for real mid-way resumes from its last checkpoint and ends
bit-identical to a run never stopped; a crash in the middle of a save never leaves a bad newest checkpoint;
truncated and corrupted files are detected and skipped with a clear message. The first tests use real gloo
ranks (labkit.run); the file-level ones run in this process, where no process group exists (rank 0 of 1)."""

import doctest
import hashlib
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import labkit
import labkit.checkpoint.files
from labkit import groups
from labkit.checkpoint import CheckpointError, CheckpointWarning, load_latest_checkpoint, save_checkpoint
from labkit.checkpoint.lock import LOCK_NAME
from labkit.models import make_classification, mlp
from labkit.parallel import average_gradients, broadcast_parameters

BATCH, EXAMPLES, STEPS, EVERY, KILL_AT = 16, 96, 30, 10, 23  # an epoch is 6 steps, reshuffled every epoch


def make_model() -> nn.Sequential:
    model = mlp(seed=0)
    model.insert(2, nn.Dropout(0.3))  # Linear, ReLU, Dropout, Linear, ReLU, Linear: the torch RNG matters
    return model


def batch_at(position: int):
    """The global batch that starts `position` examples into the data stream (a new shuffle each epoch),
    this rank's half of it: resuming at the wrong position trains on other examples."""
    x, y = make_classification(EXAMPLES)
    epoch, offset = divmod(position, EXAMPLES)
    order = torch.randperm(EXAMPLES, generator=torch.Generator().manual_seed(epoch))[offset:offset + BATCH]
    mine = order.tensor_split(labkit.world_size())[labkit.rank()]
    return x[mine], y[mine]


def train(directory, kill_at=None, sabotage=None):
    """Data-parallel training with Adam, dropout (torch RNG) and input noise whose scale comes from Python's
    random and whose values from numpy's: every piece of state a resume must restore. Resumes from the
    newest checkpoint in `directory`; rank 1 kills itself at step `kill_at`; `sabotage` spoils one piece of
    the restored state, to show that the test notices."""
    model = make_model()
    broadcast_parameters(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.manual_seed(100 + labkit.rank())  # workers live on between calls: seed every run, per rank
    random.seed(200 + labkit.rank())
    np.random.seed(300 + labkit.rank())
    step, position = 0, 0
    state = load_latest_checkpoint(directory, model, optimizer)
    if state is not None:
        step, position = state["step"], state["data_position"]
    first = step
    if sabotage == "torch RNG":
        torch.manual_seed(7)
    elif sabotage == "python RNG":
        random.seed(7)
    elif sabotage == "numpy RNG":
        np.random.seed(7)
    elif sabotage == "data position":
        position = 0
    while step < STEPS:
        if step == kill_at and labkit.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch_at(position)
        position += BATCH
        noise = torch.from_numpy(np.random.standard_normal(tuple(x.shape))).float()
        x = x + noise * random.uniform(0.0, 0.5)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        average_gradients(model)
        optimizer.step()
        step += 1
        if step % EVERY == 0:
            save_checkpoint(directory, model, optimizer, step, position)
    return first, position, model.state_dict(), optimizer.state_dict()


def same_state(a, b) -> bool:
    """Every parameter and every optimizer state tensor bit-identical (torch.equal), and the rest equal: a resumed
    run replays the same steps on the same ranks (the same kernels on the same shapes), so nothing may differ."""
    (_, pos_a, model_a, opt_a), (_, pos_b, model_b, opt_b) = a, b
    return (pos_a == pos_b and model_a.keys() == model_b.keys()
            and all(torch.equal(model_a[k], model_b[k]) for k in model_a)
            and opt_a["param_groups"] == opt_b["param_groups"] and opt_a["state"].keys() == opt_b["state"].keys()
            and all(opt_a["state"][i].keys() == opt_b["state"][i].keys()
                    and all(torch.equal(opt_a["state"][i][k], opt_b["state"][i][k]) for k in opt_a["state"][i])
                    for i in opt_a["state"]))


def names(directory) -> list[str]:
    """What the directory holds but the run's lock file (labkit.checkpoint.lock.LOCK_NAME, there for good)."""
    return sorted(name for name in os.listdir(directory) if name != LOCK_NAME)


def test_a_run_killed_mid_way_resumes_bit_identical_to_one_never_stopped(tmp_path):
    reference_dir, run_dir = tmp_path / "reference", tmp_path / "run"
    reference_dir.mkdir()
    run_dir.mkdir()
    reference = labkit.run(train, str(reference_dir))
    assert [r[0] for r in reference] == [0, 0] and same_state(reference[0], reference[1])

    with pytest.raises(labkit.RankError) as killed:  # really killed: the process, at step 23
        labkit.run(train, str(run_dir), KILL_AT)
    assert "rank 1: process killed by SIGKILL" in str(killed.value), str(killed.value)
    assert names(run_dir) == ["step-000010.pt", "step-000020.pt"]
    for sabotage in ("torch RNG", "python RNG", "numpy RNG", "data position"):
        shutil.copytree(run_dir, tmp_path / sabotage)

    resumed = labkit.run(train, str(run_dir))
    assert [r[0] for r in resumed] == [20, 20]  # it did resume, from the last checkpoint
    for rank in range(2):
        assert same_state(resumed[rank], reference[rank]), rank
    assert names(run_dir) == ["step-000010.pt", "step-000020.pt", "step-000030.pt"]

    # Each piece of restored state matters: spoil one, and the run ends elsewhere.
    for sabotage in ("torch RNG", "python RNG", "numpy RNG", "data position"):
        spoiled = labkit.run(train, str(tmp_path / sabotage), sabotage=sabotage)
        assert spoiled[0][0] == 20 and not same_state(spoiled[0], reference[0]), sabotage


# --- A crash during a save: SIGXFSZ kills rank 0 in the middle of writing the file ---

def save_and_crash(directory, limit=None, naive=False):
    """Load step 10, train a step, save step 20 with keep=1. With `limit`, rank 0 is killed by the kernel
    (SIGXFSZ) as soon as it has written `limit` bytes to a file: a crash mid-write, wherever the writer
    puts its bytes. With `naive`, save_checkpoint writes straight onto the final name (a control)."""
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = load_latest_checkpoint(directory, model, optimizer)
    x, y = batch_at(state["data_position"])
    F.cross_entropy(model(x), y).backward()
    average_gradients(model)
    optimizer.step()
    atomic, file_size_limit = labkit.checkpoint.files.write_atomically, resource.getrlimit(resource.RLIMIT_FSIZE)
    if labkit.rank() == 0 and naive:
        labkit.checkpoint.files.write_atomically = write_in_place
    if labkit.rank() == 0 and limit is not None:
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it: writes would fail with EFBIG
        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, file_size_limit[1]))
    try:
        save_checkpoint(directory, model, optimizer, 20, state["data_position"] + BATCH, keep=1)
    finally:  # only reached if the crash did not happen
        if limit is not None and labkit.rank() == 0:
            resource.setrlimit(resource.RLIMIT_FSIZE, file_size_limit)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        labkit.checkpoint.files.write_atomically = atomic
    return state["step"], [str(w.message) for w in caught]


def write_in_place(path, payload):
    """What a non-atomic save does: the same bytes, written straight onto the final name."""
    with open(path, "wb") as file:
        file.write(labkit.checkpoint.files.checkpoint_bytes(payload))


def save_step_10(directory):
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    F.cross_entropy(model(batch_at(0)[0]), batch_at(0)[1]).backward()
    average_gradients(model)
    optimizer.step()
    return save_checkpoint(directory, model, optimizer, 10, 10 * BATCH).name


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE and SIGXFSZ as on Linux")
def test_a_crash_in_the_middle_of_a_save_leaves_the_previous_checkpoint_as_the_newest(tmp_path):
    assert labkit.run(save_step_10, str(tmp_path)) == ["step-000010.pt"] * 2
    before = digest(tmp_path / "step-000010.pt")
    limit = (tmp_path / "step-000010.pt").stat().st_size // 2  # step 20's file is as large: half of it written

    with pytest.raises(labkit.RankError) as crashed:
        labkit.run(save_and_crash, str(tmp_path), limit)
    assert "rank 0: process killed by SIGXFSZ" in str(crashed.value), str(crashed.value)
    # The write really was cut short: a partial file of exactly `limit` bytes, under a temporary name...
    partial = [n for n in names(tmp_path) if n != "step-000010.pt"]
    assert len(partial) == 1 and (tmp_path / partial[0]).stat().st_size == limit, partial
    # ...while step 10 is still the newest checkpoint, byte for byte (keep=1 has not removed it either).
    assert not partial[0].startswith("step-") and digest(tmp_path / "step-000010.pt") == before

    # Every rank resumes from step 10 without a warning; the next save cleans up and rotates.
    assert labkit.run(save_and_crash, str(tmp_path)) == [(10, [])] * 2
    assert names(tmp_path) == ["step-000020.pt"]


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE and SIGXFSZ as on Linux")
def test_the_same_crash_breaks_a_save_that_writes_in_place(tmp_path):
    """The control that makes the test above honest: the same crash, with save_checkpoint's atomic write
    swapped for one straight onto the final name, leaves a truncated step-000020.pt as the newest file.
    The loader detects it and falls back to step 10, saying so."""
    labkit.run(save_step_10, str(tmp_path))
    limit = (tmp_path / "step-000010.pt").stat().st_size // 2
    with pytest.raises(labkit.RankError, match="rank 0: process killed by SIGXFSZ"):
        labkit.run(save_and_crash, str(tmp_path), limit, naive=True)
    assert names(tmp_path) == ["step-000010.pt", "step-000020.pt"]
    assert (tmp_path / "step-000020.pt").stat().st_size == limit
    for step, messages in labkit.run(save_and_crash, str(tmp_path)):
        assert step == 10
        assert len(messages) == 1 and messages[0].startswith("checkpoint step-000020.pt is truncated ("), messages
        assert messages[0].endswith(" payload bytes); using step-000010.pt"), messages


# --- Collective checks: the ranks must agree ---

def save_different_steps(directory):
    save_checkpoint(directory, mlp(), None, step=10 + labkit.rank(), data_position=0)


def load_from_different_directories(directories):
    return load_latest_checkpoint(directories[labkit.rank()], mlp())


def test_ranks_that_disagree_get_the_same_clear_error_not_a_hang(tmp_path):
    with pytest.raises(labkit.RankError) as raised:
        labkit.run(save_different_steps, str(tmp_path), timeout=30)
    assert "ranks 0-1: ValueError" in str(raised.value)
    assert ("save_checkpoint: the ranks passed different steps (rank 0: 10; rank 1: 11). Call save_checkpoint at "
            "the same step on every rank.") in str(raised.value)
    assert names(tmp_path) == []

    save_checkpoint(tmp_path / "a", mlp(), None, step=5, data_position=0)
    (tmp_path / "b").mkdir()
    with pytest.raises(labkit.RankError) as raised:
        labkit.run(load_from_different_directories, [str(tmp_path / "a"), str(tmp_path / "b")], timeout=30)
    assert "ranks 0-1: RuntimeError" in str(raised.value)
    assert (f"the ranks found different checkpoints (rank 0: step-000005.pt in {tmp_path / 'a'}; rank 1: no "
            f"checkpoint in {tmp_path / 'b'}). Is the directory on storage that every rank sees?") in str(raised.value)


# --- Sub-groups: ranks {1, 3} checkpoint together while ranks {0, 2} do on their own ---

def checkpoint_in_pairs(directories):
    """Pair p (ranks p and p + 2 of 4) saves its own model into directories[p] and loads it back into a fresh
    model, with the RNG states each rank had at the save. Returns (step, data_position, model as saved, RNG as
    at the save, what a rank outside the other pair is told when it passes that pair's group)."""
    pairs = [groups.new_group([0, 2]), groups.new_group([1, 3])]  # every rank creates both
    mine = labkit.rank() % 2
    pair, directory = pairs[mine], directories[mine]
    try:
        save_checkpoint(directory, mlp(), None, step=0, data_position=0, group=pairs[1 - mine])
        outsider = "no error"
    except ValueError as error:
        outsider = str(error)
    model = mlp(seed=10 + mine)
    torch.manual_seed(100 + labkit.rank())
    save_checkpoint(directory, model, None, step=5 + mine, data_position=labkit.rank(), group=pair)
    draw = torch.rand(3)  # what this rank's torch RNG gives after the save, and must give again after the load
    torch.manual_seed(7)
    fresh = mlp(seed=99)
    state = load_latest_checkpoint(directory, fresh, group=pair)
    same_model = all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
    return state["step"], state["data_position"], same_model, torch.equal(torch.rand(3), draw), outsider


def test_two_groups_checkpoint_apart_each_rank_getting_its_own_rng_back(tmp_path):
    directories = [str(tmp_path / "even"), str(tmp_path / "odd")]
    results = labkit.run(checkpoint_in_pairs, directories, world_size=4, timeout=120)
    outsider = "is not in the group passed as group="
    assert [r[:4] for r in results] == [(5, 0, True, True), (6, 1, True, True)] * 2  # the writer's data position
    assert all(f"save_checkpoint: global rank {rank} {outsider}" in r[4] for rank, r in enumerate(results)), results
    assert names(tmp_path / "even") == ["step-000005.pt"] and names(tmp_path / "odd") == ["step-000006.pt"]
    with pytest.warns(CheckpointWarning, match="saved by 2 ranks and is loaded by 1"):  # the pair's RNGs, not 4
        state = load_latest_checkpoint(tmp_path / "odd", mlp())
    assert state["step"] == 6


# --- Files, in this process: no process group, so rank 0 of 1 ---

def three_checkpoints(directory):
    """Steps 10, 20, 30 of a model; returns each step's parameters."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    saved = {}
    for step in (10, 20, 30):
        optimizer.zero_grad()
        x, y = make_classification(BATCH, seed=step)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        save_checkpoint(directory, model, optimizer, step, step * BATCH, extra={"loss": float(step)})
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return saved


def flip_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "truncated": (truncate, "is truncated ("),
    "byte flipped in the payload": (lambda p: flip_byte(p, p.stat().st_size - 100), "is corrupt (checksum mismatch)"),
    "byte flipped in the checksum": (lambda p: flip_byte(p, 20), "is corrupt (checksum mismatch)"),
    "byte flipped in the magic": (lambda p: flip_byte(p, 0), "is corrupt (not a labkit checkpoint: bad header)"),
    "empty": (lambda p: p.write_bytes(b""), "is truncated (0 bytes, shorter than its header)"),
    "bytes appended": (lambda p: p.write_bytes(p.read_bytes() + b"junk"), "is corrupt (4 bytes more than"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newest_checkpoint_is_named_and_the_previous_one_used(tmp_path, damage):
    saved = three_checkpoints(tmp_path)
    spoil, problem = DAMAGE[damage]
    spoil(tmp_path / "step-000030.pt")
    model, optimizer = mlp(seed=5), torch.optim.SGD(mlp().parameters(), lr=0.1, momentum=0.9)
    with pytest.warns(CheckpointWarning) as caught:
        state = load_latest_checkpoint(tmp_path, model, optimizer)
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert message.startswith(f"checkpoint step-000030.pt {problem}") and message.endswith("; using step-000020.pt")
    assert (state["step"], state["data_position"], state["extra"]) == (20, 20 * BATCH, {"loss": 20.0})
    assert state["path"] == tmp_path / "step-000020.pt"
    assert all(torch.equal(v, saved[20][k]) for k, v in model.state_dict().items())


def test_the_truncation_message_gives_the_byte_counts(tmp_path):
    three_checkpoints(tmp_path)
    size = (tmp_path / "step-000030.pt").stat().st_size
    truncate(tmp_path / "step-000030.pt")
    with pytest.warns(CheckpointWarning) as caught:
        load_latest_checkpoint(tmp_path, mlp())
    payload = size - 48  # the header: 8 bytes of magic, 8 of length, 32 of SHA-256
    assert str(caught[0].message) == (f"checkpoint step-000030.pt is truncated ({size // 2 - 48} of {payload} "
                                      "payload bytes); using step-000020.pt")


def test_two_bad_ones_are_both_named_and_all_bad_is_an_error(tmp_path):
    saved = three_checkpoints(tmp_path)
    truncate(tmp_path / "step-000030.pt")
    flip_byte(tmp_path / "step-000020.pt", 1000)
    model = mlp(seed=5)
    with pytest.warns(CheckpointWarning) as caught:
        assert load_latest_checkpoint(tmp_path, model)["step"] == 10
    messages = [str(w.message) for w in caught]
    assert messages[0].startswith("checkpoint step-000030.pt is truncated (") and messages[0].endswith(
        "; using step-000010.pt")
    assert messages[1] == "checkpoint step-000020.pt is corrupt (checksum mismatch); using step-000010.pt"
    assert all(torch.equal(v, saved[10][k]) for k, v in model.state_dict().items())

    (tmp_path / "step-000010.pt").write_bytes(b"")
    with pytest.raises(CheckpointError) as raised:
        load_latest_checkpoint(tmp_path, model)
    assert str(raised.value).startswith(f"no intact checkpoint in {tmp_path}: step-000030.pt is truncated (")
    assert "; step-000020.pt is corrupt (checksum mismatch); step-000010.pt is truncated (0 bytes" in str(raised.value)


def test_missing_directory_empty_directory_and_a_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint directory .*missing does not exist. Create it"):
        load_latest_checkpoint(tmp_path / "missing", mlp())
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / ".step-000040.pt.123.abcd.tmp").write_bytes(b"left by a crash")
    (tmp_path / "step-40.pt.bak").write_bytes(b"")
    assert load_latest_checkpoint(tmp_path, mlp()) is None  # nothing named step-NNNNNN.pt: start from scratch
    with pytest.raises(NotADirectoryError, match="notes.txt is a file, not a checkpoint directory"):
        load_latest_checkpoint(tmp_path / "notes.txt", mlp())


def test_keeps_the_newest_k_and_removes_what_crashed_saves_left(tmp_path):
    crashed = subprocess.Popen([sys.executable, "-c", "pass"])
    crashed.wait()  # a writer whose process is gone: its temporary file is a crashed save's
    (tmp_path / f".step-000005.pt.{crashed.pid}.beef.tmp").write_bytes(b"partial")
    for step in (10, 20, 30, 40, 50):
        save_checkpoint(tmp_path, mlp(), None, step, step, keep=3)
    assert names(tmp_path) == ["step-000030.pt", "step-000040.pt", "step-000050.pt"]
    save_checkpoint(tmp_path, mlp(), None, 35, 35, keep=2)  # a rerun from 30: older trimmed, newer left alone
    assert names(tmp_path) == ["step-000030.pt", "step-000035.pt", "step-000040.pt", "step-000050.pt"]
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=rf"step={bad}: pass a whole number >= 0 \(an int, not a bool\)"):
            save_checkpoint(tmp_path, mlp(), None, bad, 0)
    with pytest.raises(ValueError, match="keep=0: pass a whole number >= 1"):
        save_checkpoint(tmp_path, mlp(), None, 60, 0, keep=0)
    with pytest.raises(TypeError, match="step='10': pass a whole number >= 0"):
        save_checkpoint(tmp_path, mlp(), None, "10", 0)


def test_rng_states_optimizer_and_extra_come_back(tmp_path):
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    F.cross_entropy(model(make_classification(BATCH)[0]), make_classification(BATCH)[1]).backward()
    optimizer.step()
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    np.random.standard_normal()  # numpy caches a second Gaussian: part of its state
    save_checkpoint(tmp_path, model, optimizer, 1, {"epoch": 0, "offset": 16}, extra={"ids": torch.arange(3)})
    draws = torch.rand(3), random.random(), np.random.standard_normal(3)
    fresh_model = mlp(seed=9)
    fresh_optimizer = torch.optim.Adam(fresh_model.parameters(), lr=0.01)
    state = load_latest_checkpoint(tmp_path, fresh_model, fresh_optimizer)
    again = torch.rand(3), random.random(), np.random.standard_normal(3)
    assert torch.equal(draws[0], again[0]) and draws[1] == again[1] and np.array_equal(draws[2], again[2])
    assert state["data_position"] == {"epoch": 0, "offset": 16} and torch.equal(state["extra"]["ids"], torch.arange(3))
    assert same_state((0, 0, model.state_dict(), optimizer.state_dict()),
                      (0, 0, fresh_model.state_dict(), fresh_optimizer.state_dict()))
    save_checkpoint(tmp_path, model, None, 2, 0)
    with pytest.raises(ValueError, match="step-000002.pt was saved without an optimizer state"):
        load_latest_checkpoint(tmp_path, model, optimizer)


def test_rng_states_of_another_world_size_are_not_restored(tmp_path):
    labkit.run(save_step_10, str(tmp_path))  # two ranks wrote it
    with pytest.warns(CheckpointWarning, match="saved by 2 ranks and is loaded by 1: RNG states not restored"):
        assert load_latest_checkpoint(tmp_path, make_model())["step"] == 10


def test_docstring_example():
    result = doctest.testmod(labkit.checkpoint)
    assert result.attempted > 0 and result.failed == 0
