"""labkit.checkpoint must never lose data: a save succeeds only if its file loads back (values that
torch.load(weights_only=True) refuses are named at save time, and rotation never removes the last good
checkpoint); two runs saving into one directory cannot clobber each other (the second is refused, naming the
holder); a load that fails changes nothing; write errors name the path, and on ranks the others say rank 0
failed and why. File-level tests run in this process (rank 0 of 1); the concurrency ones in fresh processes."""

import copy
import datetime
import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import labkit
import labkit.checkpoint.files
import labkit.checkpoint.fits
from labkit import groups
from labkit.checkpoint import CheckpointError, load_latest_checkpoint, save_checkpoint
from labkit.checkpoint.lock import LOCK_NAME
from labkit.models import make_classification, mlp


def trained(model, optimizer, seed=0):
    """One SGD step on a small batch: the optimizer gets a state (momentum buffers) to lose."""
    x, y = make_classification(16, classes=model[-1].out_features, seed=seed)
    optimizer.zero_grad()
    F.cross_entropy(model(x.to(next(model.parameters()).dtype)), y).backward()
    optimizer.step()
    return model, optimizer


def sgd(model, groups=1):
    parameters = list(model.parameters())
    chunks = [parameters[i::groups] for i in range(groups)]
    return torch.optim.SGD([{"params": chunk} for chunk in chunks], lr=0.1, momentum=0.9)


def checkpoint_names(directory) -> list[str]:
    """What the directory holds but the run's lock file (there for good)."""
    return sorted(name for name in os.listdir(directory) if name != LOCK_NAME)


def digests(directory) -> dict[str, str]:
    return {name: hashlib.sha256((Path(directory) / name).read_bytes()).hexdigest()
            for name in checkpoint_names(directory)}


def two_checkpoints(directory):
    model = mlp()
    optimizer = sgd(model)
    for step in (10, 20):
        trained(model, optimizer, seed=step)
        save_checkpoint(directory, model, optimizer, step, step, extra={"loss": 0.5})
    return model, optimizer


# --- D1: a checkpoint that could never be loaded is refused, and nothing is rotated away ---

WHEN = datetime.datetime(2024, 5, 1, 12, 0)
UNLOADABLE = {  # (data_position, extra) -> the key path and type the error must name
    "numpy scalar": (20, {"loss": np.float64(0.5)}, "extra['loss'] is a numpy.float64"),
    "numpy array": ({"order": np.arange(4)}, None, "data_position['order'] is a numpy.ndarray"),
    "path": (20, {"source": Path("/data/train")}, "extra['source'] is a pathlib.PosixPath"),
    "datetime": (20, {"when": WHEN}, "extra['when'] is a datetime.datetime"),
    "slice": (slice(0, 16), None, "data_position is a slice"),
    "nested numpy int": (20, {"log": [1, np.int64(2)]}, "extra['log'][1] is a numpy.int64"),
}


@pytest.mark.skipif(os.name == "nt", reason="PosixPath")
@pytest.mark.parametrize("case", UNLOADABLE)
def test_a_value_torch_load_refuses_is_named_at_save_time_and_nothing_is_rotated(tmp_path, case):
    data_position, extra, named = UNLOADABLE[case]
    model, optimizer = two_checkpoints(tmp_path)
    before = digests(tmp_path)
    with pytest.raises(TypeError) as raised:
        save_checkpoint(tmp_path, model, optimizer, 30, data_position, extra, keep=1)
    message = str(raised.value)
    assert message.startswith(f"save_checkpoint: {named}, which torch.load(weights_only=True) cannot read "
                              "back"), message
    assert "Convert it" in message and "Nothing was written" in message, message
    assert digests(tmp_path) == before  # keep=1 removed nothing, and no temporary file is left
    assert load_latest_checkpoint(tmp_path, mlp(seed=3), sgd(mlp()))["step"] == 20


def test_the_written_file_is_loaded_back_before_anything_is_replaced_or_rotated(tmp_path, monkeypatch):
    """With the up-front check switched off, the read-back still catches a file torch.load refuses."""
    model, optimizer = two_checkpoints(tmp_path)
    before = digests(tmp_path)
    monkeypatch.setattr(labkit.checkpoint.fits, "refuse_unloadable", lambda payload: None)
    with pytest.raises(CheckpointError, match=r"step-000030.pt would not load back \(unloadable \(UnpicklingError"):
        save_checkpoint(tmp_path, model, optimizer, 30, 30, {"when": WHEN}, keep=1)
    assert digests(tmp_path) == before
    assert load_latest_checkpoint(tmp_path, mlp(seed=3), sgd(mlp()))["step"] == 20


# --- D2: two runs, one directory ---

SAVER = """
import json, os, sys, time
from labkit.checkpoint import save_checkpoint
from labkit.models import mlp

model, directory, seconds = mlp(), os.environ["CKPT_DIR"], float(os.environ["CKPT_SECONDS"])
print("ready", flush=True)
while not os.path.exists(os.environ["CKPT_GO"]):
    time.sleep(0.01)
saved, error, began = 0, None, time.monotonic()
while time.monotonic() - began < seconds:
    try:
        save_checkpoint(directory, model, None, saved + 1, saved + 1, {"run": os.environ["CKPT_RUN"]}, keep=2)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        break
    saved += 1
print(json.dumps({"pid": os.getpid(), "saved": saved, "error": error}), flush=True)
sys.stdin.read()  # stay alive (holding whatever it holds) until the test closes stdin
"""


def start_saver(directory, go, run, seconds):
    env = {**os.environ, "CKPT_DIR": str(directory), "CKPT_GO": str(go), "CKPT_RUN": run, "CKPT_SECONDS": str(seconds)}
    return subprocess.Popen([sys.executable, "-c", SAVER], cwd=os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)


@pytest.mark.skipif(sys.platform != "linux", reason="flock and /proc/locks as on Linux")
def test_two_runs_saving_into_one_directory_at_once_the_second_is_refused(tmp_path):
    """Two processes save as fast as they can into one directory for two seconds. One holds the directory;
    the other is refused at its first save, naming the directory and the holder's pid. Every save of the
    holder succeeds and the directory holds only its checkpoints (nothing deleted under it)."""
    go = tmp_path / "go"
    directory = tmp_path / "checkpoints"
    savers = {run: start_saver(directory, go, run, seconds=2.0) for run in ("a", "b")}
    try:
        for saver in savers.values():
            assert saver.stdout.readline().strip() == "ready"
        go.touch()
        results = {run: json.loads(saver.stdout.readline()) for run, saver in savers.items()}
    finally:
        for saver in savers.values():
            saver.communicate("", timeout=30)
    refused = [run for run, result in results.items() if result["error"] is not None]
    assert len(refused) == 1, results
    loser, holder = refused[0], ({"a", "b"} - set(refused)).pop()
    assert results[loser]["saved"] == 0, results
    assert results[loser]["error"].startswith(f"CheckpointError: checkpoint directory {directory} is in use by "
                                              f"another run: process {results[holder]['pid']} holds its lock"), results
    last = results[holder]["saved"]
    assert last >= 2, results
    assert checkpoint_names(directory) == [f"step-{step:06d}.pt" for step in (last - 1, last)]
    assert load_latest_checkpoint(directory, mlp())["extra"] == {"run": holder}


def two_pairs_saving_into_one_directory(directory):
    """Ranks {0, 2} and {1, 3} of 4 each save as a group into the same directory. Returns (this rank's pid,
    what the save said)."""
    pairs = [groups.new_group([0, 2]), groups.new_group([1, 3])]
    try:
        save_checkpoint(directory, mlp(), None, 10, 10, group=pairs[labkit.rank() % 2])
        return os.getpid(), "saved"
    except CheckpointError as error:
        return os.getpid(), str(error)


@pytest.mark.skipif(sys.platform != "linux", reason="flock and /proc/locks as on Linux")
def test_two_groups_saving_into_one_directory_the_second_is_refused(tmp_path):
    """Two groups of one job are two runs to the directory: the writer of one (rank 0 or 1) holds it, the other
    pair is refused, its writer naming the holder's pid and its other rank saying that its writer failed."""
    results = labkit.run(two_pairs_saving_into_one_directory, str(tmp_path), world_size=4, timeout=120)
    holder = next(p for p in (0, 1) if results[p][1] == "saved")
    loser = 1 - holder
    assert results[holder + 2][1] == "saved", results
    refusal = (f"checkpoint directory {tmp_path} is in use by another run: process {results[holder][0]} holds "
               "its lock")
    assert results[loser][1].startswith(refusal), results
    assert results[loser + 2][1].startswith(f"save_checkpoint: rank {loser} failed to save: CheckpointError: "
                                            f"{refusal}"), results
    assert checkpoint_names(tmp_path) == ["step-000010.pt"]


HOLDER = """
import sys
from labkit.checkpoint import save_checkpoint
from labkit.models import mlp
save_checkpoint(sys.argv[1], mlp(), None, 10, 10)
print("saved", flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(sys.platform != "linux", reason="flock and /proc/locks as on Linux")
def test_the_directory_is_free_again_once_its_holder_has_ended(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == "saved"
        with pytest.raises(CheckpointError) as raised:
            save_checkpoint(tmp_path, mlp(), None, 20, 20)
    finally:
        holder.communicate("", timeout=30)
    assert f"in use by another run: process {holder.pid} holds its lock" in str(raised.value)
    assert "Save into another directory" in str(raised.value)
    assert checkpoint_names(tmp_path) == ["step-000010.pt"]
    save_checkpoint(tmp_path, mlp(), None, 20, 20)  # its holder is gone: this process takes the directory over
    assert checkpoint_names(tmp_path) == ["step-000010.pt", "step-000020.pt"]


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


@pytest.mark.skipif(os.name == "nt", reason="process ids as on POSIX")
def test_only_temporary_files_of_writers_that_are_gone_are_removed(tmp_path):
    alive = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        (tmp_path / f".step-000020.pt.{alive.pid}.abcd1234.tmp").write_bytes(b"another run, still writing")
        (tmp_path / f".step-000020.pt.{dead_pid()}.beef0000.tmp").write_bytes(b"left by a crashed save")
        save_checkpoint(tmp_path, mlp(), None, 10, 10)
        assert checkpoint_names(tmp_path) == [f".step-000020.pt.{alive.pid}.abcd1234.tmp", "step-000010.pt"]
    finally:
        alive.communicate(b"", timeout=30)


# --- D3: a load that fails changes nothing ---

def snapshot(model, optimizer):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()), torch.get_rng_state()


def identical(a, b) -> bool:
    """Bit-identical, all the way down: tensors by torch.equal (and dtype), the rest by ==."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b, strict=True))
    return a == b


MISFITS = {  # the model and optimizer a checkpoint of mlp() + SGD (or without one) is loaded into
    "a layer of another shape": (lambda: mlp(classes=8, seed=4), 1, True,
                                 "4.weight: shape (8, 64) here, (4, 64) in the checkpoint"),
    "a missing layer": (lambda: mlp(layers=3, seed=4), 1, True, "missing from the checkpoint: 6.weight, 6.bias"),
    "another dtype": (lambda: mlp(seed=4, dtype=torch.float64), 1, True,
                      "0.weight: torch.float64 here, torch.float32 in the checkpoint"),
    "no optimizer state saved": (lambda: mlp(seed=4), 1, False, "was saved without an optimizer state"),
    "other parameter groups": (lambda: mlp(seed=4), 2, True, "2 parameter groups here, 1 in the checkpoint"),
}


@pytest.mark.parametrize("case", MISFITS)
def test_a_load_that_fails_leaves_model_optimizer_and_rng_bit_identical(tmp_path, case):
    make, groups, with_optimizer, problem = MISFITS[case]
    saved_model = mlp()
    saved_optimizer = trained(saved_model, sgd(saved_model), seed=1)[1]
    save_checkpoint(tmp_path, saved_model, saved_optimizer if with_optimizer else None, 10, 10)
    model = make()
    optimizer = trained(model, sgd(model, groups), seed=2)[1]
    before = snapshot(model, optimizer)
    with pytest.raises(ValueError) as raised:
        load_latest_checkpoint(tmp_path, model, optimizer)
    assert problem in str(raised.value) and "step-000010.pt" in str(raised.value), str(raised.value)
    assert identical(snapshot(model, optimizer), before)


def test_a_checkpoint_without_a_model_entry_is_named_with_the_missing_key(tmp_path):
    without_model = {"format": 1, "step": 10, "data_position": 0, "extra": None, "optimizer": None, "rng": []}
    (tmp_path / "step-000010.pt").write_bytes(labkit.checkpoint.files.checkpoint_bytes(without_model))
    model = mlp()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(CheckpointError) as raised:
        load_latest_checkpoint(tmp_path, model)
    assert str(raised.value).startswith(f"checkpoint {tmp_path / 'step-000010.pt'} has no 'model' entry"), raised.value
    assert identical(model.state_dict(), before)


# --- Write errors name the path; on ranks, the others say that rank 0 failed and why ---

@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE as on Linux (Python ignores SIGXFSZ)")
def test_a_write_error_names_the_checkpoint_and_leaves_the_previous_one(tmp_path):
    """RLIMIT_FSIZE makes the kernel refuse writes past `limit` bytes (EFBIG), as a full disk (ENOSPC) does."""
    model, optimizer = two_checkpoints(tmp_path)
    before = digests(tmp_path)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))
    try:
        with pytest.raises(OSError) as raised:
            save_checkpoint(tmp_path, model, optimizer, 30, 30, keep=1)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    assert str(raised.value).startswith(f"[Errno 27] could not write checkpoint {tmp_path / 'step-000030.pt'}: "
                                        "File too large"), str(raised.value)
    assert digests(tmp_path) == before


def save_with_a_small_disk_on_rank_0(directory):
    """Rank 0 may write only 4 KiB per file (RLIMIT_FSIZE; SIGXFSZ is ignored, so writes fail with EFBIG)."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if labkit.rank() == 0:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))
    try:
        save_checkpoint(directory, mlp(), None, 10, 10)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE as on Linux (Python ignores SIGXFSZ)")
def test_on_ranks_the_others_say_that_rank_0_failed_to_save_and_why(tmp_path):
    began = time.monotonic()
    with pytest.raises(labkit.RankError) as raised:
        labkit.run(save_with_a_small_disk_on_rank_0, str(tmp_path), timeout=30)
    assert time.monotonic() - began < 20  # no rank waited for a timeout
    text = str(raised.value)
    reason = f"OSError: [Errno 27] could not write checkpoint {tmp_path / 'step-000010.pt'}: File too large"
    assert f"--- root cause, rank 0: {reason}" in text, text
    assert f"rank 1: labkit.checkpoint.CheckpointError: save_checkpoint: rank 0 failed to save: {reason}" in text, text
    assert checkpoint_names(tmp_path) == []


def save_in_pairs_with_a_small_disk_on_rank_1(directories):
    """Ranks {1, 3} save into directories[1], rank 1 (their writer) with 4 KiB per file; ranks {0, 2} save into
    directories[0] without trouble."""
    pairs = [groups.new_group([0, 2]), groups.new_group([1, 3])]
    mine = labkit.rank() % 2
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if labkit.rank() == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))
    try:
        return save_checkpoint(directories[mine], mlp(), None, 10, 10, group=pairs[mine]).name
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE as on Linux (Python ignores SIGXFSZ)")
def test_in_a_group_its_other_ranks_say_that_its_writer_failed_and_the_other_group_saves(tmp_path):
    directories = [tmp_path / "even", tmp_path / "odd"]
    with pytest.raises(labkit.RankError) as raised:
        labkit.run(save_in_pairs_with_a_small_disk_on_rank_1, [str(d) for d in directories], world_size=4,
                   timeout=60)
    text = str(raised.value)
    reason = f"OSError: [Errno 27] could not write checkpoint {directories[1] / 'step-000010.pt'}: File too large"
    assert f"--- root cause, rank 1: {reason}" in text, text
    assert f"rank 3: labkit.checkpoint.CheckpointError: save_checkpoint: rank 1 failed to save: {reason}" in text, text
    assert "rank 0:" not in text and "rank 2:" not in text, text  # the other pair saved
    assert checkpoint_names(directories[0]) == ["step-000010.pt"] and checkpoint_names(directories[1]) == []
