"""The rendezvous is private to the user who started the ranks (issue 14).

A TCP store on 127.0.0.1 let any local user list its keys, read the ranks' addresses and plant keys
for the next pool. Ranks now meet in a FileStore file in a 0700 directory with unguessable names."""

import os
import re
import shutil
import stat
import subprocess

import psutil
import pytest

import labkit
from labkit.launch.owner import OWNER

NOBODY = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]


def store_files() -> list[str]:
    return sorted(os.listdir(OWNER.store_directory))


def test_the_owner_listens_on_no_port():
    labkit.run(os.getpid, world_size=2)
    listening = [c for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert listening == []


def test_store_directory_is_private_and_names_are_unguessable():
    labkit.shutdown()  # no pool kept from earlier tests
    labkit.run(os.getpid, world_size=2)
    labkit.run(os.getpid, world_size=3)
    mode = os.stat(OWNER.store_directory).st_mode
    assert stat.S_IMODE(mode) == 0o700 and os.stat(OWNER.store_directory).st_uid == os.getuid()
    names = store_files()
    assert len(names) == 2 and all(re.fullmatch(r"[0-9a-f]{32}", n) for n in names)
    assert str(os.getpid()) not in "".join(names)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to act as a second user")
def test_another_user_can_neither_read_nor_plant_keys():
    labkit.run(os.getpid, world_size=2)
    directory = OWNER.store_directory
    path = os.path.join(directory, store_files()[0])
    assert os.path.getsize(path) > 0  # the ranks' addresses are in there
    for command in (["ls", directory], ["cat", path], ["sh", "-c", f"echo planted >> {path}"],
                    ["touch", os.path.join(directory, "0" * 32)]):
        result = subprocess.run(NOBODY + command, capture_output=True, text=True)
        assert result.returncode != 0 and "Permission denied" in result.stderr, (command, result)
    assert labkit.run(os.getpid, world_size=2)  # and the pool still works


def test_a_closed_pool_removes_its_file_and_shutdown_the_directory():
    labkit.run(os.getpid, world_size=2)
    pool = OWNER.kept_pool(2, "gloo")
    pool.close()
    assert not os.path.exists(pool.store_path)
    directory = OWNER.store_directory
    labkit.shutdown()
    assert not os.path.exists(directory)
    assert labkit.run(labkit.rank, world_size=2) == [0, 1]
