"""labkit.checkpoint's folders and files are the run's own (issue 28): a load never says "no checkpoint" while a
saving run rotates one in, another local user can neither stop a save with a flock nor have a folder or file of
theirs taken for the run's.

Probed at 919f816 (root plus uid 65534 as another local user): in about 1,900 loads beside a process saving with
keep=1, twice a CheckpointError ("no intact checkpoint ... No such file") and twice None; checkpoint folders were
created 0755, and the stranger's `flock` on one made every save fail "in use by another run"; a run directory
pre-created 0777 by the stranger was used silently and a forged file in labkit's format there loaded as the run's
own; a planted symbolic link folder was followed. The rotation tests make the saving run's rotation happen at the
worst moment of a load, in this process; `python tests/distributed/test_checkpoint_files.py 2000` measures the
real thing, N loads beside a saving process. The other-user tests run as uid 65534 (as_another_user)."""

import os
import stat
import subprocess
import sys
import tempfile
import warnings

import pytest

import labkit.checkpoint.files
from labkit.checkpoint import CheckpointWarning, load_latest_checkpoint, save_checkpoint
from labkit.checkpoint.lock import LOCK_NAME
from labkit.models import mlp


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def rotate_once(directory, step):
    """What a run saving with keep=1 does: step `step` in, the one before out (after it is on disk)."""
    save_checkpoint(directory, mlp(seed=step), None, step, step, keep=1)


def test_a_checkpoint_rotated_away_right_after_the_listing_is_not_taken_for_none(tmp_path, monkeypatch):
    """The listing names step 10; the saving run then puts step 11 in and takes step 10 out, before the load looks at
    step 10 (at 919f816: None, "no checkpoint", and a resume from step 0)."""
    rotate_once(tmp_path, 10)
    listdir, rotated = os.listdir, []

    def list_then_rotate(path="."):
        names = listdir(path)
        if not rotated and "step-000010.pt" in names:
            rotated.append(True)
            rotate_once(tmp_path, 11)
        return names
    monkeypatch.setattr(os, "listdir", list_then_rotate)
    state = load_latest_checkpoint(tmp_path, mlp())
    assert rotated and state is not None and state["step"] == 11


def test_a_checkpoint_rotated_away_just_before_it_is_read_is_not_taken_for_damage(tmp_path, monkeypatch):
    """The load found step 10 and is about to read it when the saving run rotates it away (at 919f816:
    CheckpointError "no intact checkpoint ... step-000010.pt is unreadable (No such file or directory)")."""
    rotate_once(tmp_path, 10)
    read, rotated = labkit.checkpoint.files.read_checkpoint, []

    def rotate_then_read(path):
        if not rotated and path.name == "step-000010.pt":
            rotated.append(True)
            rotate_once(tmp_path, 11)
        return read(path)
    monkeypatch.setattr(labkit.checkpoint.files, "read_checkpoint", rotate_then_read)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)  # nothing was damaged: no "skipped" warning either
        state = load_latest_checkpoint(tmp_path, mlp())
    assert rotated and state["step"] == 11


def test_a_save_makes_its_folder_and_files_the_runs_own(tmp_path):
    directory = tmp_path / "runs" / "a"
    save_checkpoint(directory, mlp(), None, 10, 10)
    assert mode(directory) == 0o700                                                # at 919f816: 0755
    assert (mode(directory / "step-000010.pt"), mode(directory / LOCK_NAME)) == (0o600, 0o600)


def test_a_linked_checkpoint_file_is_not_followed(tmp_path):
    save_checkpoint(tmp_path / "elsewhere", mlp(seed=2), None, 50, 50)
    save_checkpoint(tmp_path / "run", mlp(), None, 10, 10)
    (tmp_path / "run" / "step-000020.pt").symlink_to(tmp_path / "elsewhere" / "step-000050.pt")
    with pytest.warns(CheckpointWarning, match="step-000020.pt is refused .*is a symbolic link .*; using "
                                               "step-000010.pt"):
        assert load_latest_checkpoint(tmp_path / "run", mlp())["step"] == 10


def test_another_users_flock_on_a_checkpoint_folder_stops_no_save(shared_folder, another_users_flock):
    directory = shared_folder / "run"
    directory.mkdir(mode=0o755)  # the student's own, made with a plain mkdir: others may open it
    assert another_users_flock(directory)                      # as `flock run sleep 120`, before the run's first save
    save_checkpoint(directory, mlp(), None, 10, 10)            # at 919f816: "in use by another run"
    assert not another_users_flock(directory / LOCK_NAME)      # 0600: they cannot open it
    save_checkpoint(directory, mlp(), None, 20, 20)
    assert load_latest_checkpoint(directory, mlp())["step"] == 20


def test_a_folder_made_by_a_save_cannot_be_opened_by_another_user(shared_folder, another_users_flock,
                                                                   as_another_user):
    directory = shared_folder / "run"
    save_checkpoint(directory, mlp(), None, 10, 10)
    assert not another_users_flock(directory)                  # at 919f816: 0755, and held
    assert as_another_user(["ls", str(directory)]).returncode != 0


def forged_checkpoint(folder) -> str:
    """A checkpoint in labkit's own format, for another user to plant: theirs, with their step 99."""
    forged = folder / "forged.pt"
    forged.write_bytes(labkit.checkpoint.files.checkpoint_bytes(
        {"format": 1, "step": 99, "data_position": 0, "extra": "theirs", "model": mlp(seed=9).state_dict(),
         "optimizer": None, "rng": []}))
    forged.chmod(0o644)
    return str(forged)


@pytest.mark.parametrize("folder_mode", ["0777", "0755"])
def test_a_run_directory_planted_by_another_user_is_refused(as_another_user, shared_folder, folder_mode):
    directory = shared_folder / "run"
    planted = as_another_user(["sh", "-c", f'mkdir -m {folder_mode} "$0" && cp "$1" "$0/step-000099.pt"',
                               str(directory), forged_checkpoint(shared_folder)])
    assert planted.returncode == 0, planted.stderr
    why = (rf"checkpoint directory {directory} belongs to nobody \(uid 65534\), not you \(root \(uid 0\)\), mode "
           f"{folder_mode}: another user could put their files in your place")
    with pytest.raises(PermissionError, match=why):
        load_latest_checkpoint(directory, mlp())               # at 919f816: their step 99, as the run's own
    with pytest.raises(PermissionError, match=why):
        save_checkpoint(directory, mlp(), None, 10, 10)


def test_a_folder_of_the_students_that_others_can_write_in_is_refused(shared_folder):
    directory = shared_folder / "run"
    directory.mkdir()
    directory.chmod(0o777)
    with pytest.raises(PermissionError, match=f"checkpoint directory {directory} is yours but has mode 0777: its "
                                              rf"group and every user can write to it.*`chmod go-w {directory}`"):
        save_checkpoint(directory, mlp(), None, 10, 10)
    assert os.listdir(directory) == []


def test_a_planted_link_folder_is_not_followed(as_another_user, shared_folder):
    theirs, directory = shared_folder / "theirs", shared_folder / "run"
    planted = as_another_user(["sh", "-c", 'mkdir -m 777 "$0" && ln -s "$0" "$1"', str(theirs), str(directory)])
    assert planted.returncode == 0, planted.stderr
    with pytest.raises(PermissionError, match=f"checkpoint directory {directory} is a symbolic link made by nobody"):
        save_checkpoint(directory, mlp(), None, 10, 10)
    assert os.listdir(theirs) == []                            # at 919f816: the run's checkpoints, in their folder


SAVER = """
import sys
from labkit.checkpoint import save_checkpoint
from labkit.models import mlp
model, step = mlp(), 1
save_checkpoint(sys.argv[1], model, None, 0, 0, keep=1)
print("ready", flush=True)
while True:
    save_checkpoint(sys.argv[1], model, None, step, step, keep=1)
    step += 1
"""


def loads_beside_a_saver(loads: int) -> dict:
    """`loads` loads of a folder into which another process saves with keep=1 as fast as it can: how many loaded,
    returned None, raised (and the first errors)."""
    counts, errors = {"loaded": 0, "None": 0, "raised": 0}, []
    with tempfile.TemporaryDirectory() as directory:
        saver = subprocess.Popen([sys.executable, "-c", SAVER, directory], stdout=subprocess.PIPE, text=True)
        try:
            assert saver.stdout.readline().strip() == "ready"
            for _ in range(loads):
                try:
                    counts["loaded" if load_latest_checkpoint(directory, mlp()) else "None"] += 1
                except Exception as error:  # noqa: BLE001 - counted and shown
                    counts["raised"] += 1
                    errors.append(f"{type(error).__name__}: {error}")
        finally:
            saver.kill()
            saver.wait()
    return counts | {"errors": errors[:3]}


if __name__ == "__main__":
    print(loads_beside_a_saver(int(sys.argv[1]) if len(sys.argv) > 1 else 2000))
