"""A class on one server, tested with a real hub: JupyterHub, its proxy, and 8 local students at once.

Each student logs in through the hub's login form and REST API, gets a server running as their own Unix user,
opens a kernel on the course's kernelspec over its websocket and runs notebook 00's first AllReduce and one graded
exercise (notebook 01's, the course's solution typed as theirs). Then, with every student's server running: what a
student cannot reach of another's (files, rendezvous, kernel, ranks), the class's caps and a student's memory
bound, the instructor's gradebook over the hub's class list (a right notebook passes, a wrong one fails, a progress
file edited by hand changes nothing), and that nothing is left running after the hub stops. The tests run in file
order on one hub; the last stops it.
"""

from __future__ import annotations

import csv
import json
import os
import pwd
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.hub.conftest import MEMORY_GIB, REPOSITORY, processes_of

pytestmark = pytest.mark.timeout(900)

FIRST_ALLREDUCE = """
import torch, torch.distributed as dist, labkit
def sum_of_rank_ids():
    t = torch.tensor([float(labkit.rank())], device=labkit.device())
    dist.all_reduce(t)
    return t.item()
print("totals", labkit.run(sum_of_rank_ids, world_size=2))
"""

AVERAGE_GRADIENTS = """
import torch.distributed as dist
from labkit.exercises import check_average_gradients
def my_average_gradients(model):
    n = dist.get_world_size()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= n
print(check_average_gradients(my_average_gradients))
"""

SESSIONS: dict[str, object] = {}  # student: their logged-in Student
KERNELS: dict[str, object] = {}  # student: their open kernel, kept across the tests of this module
TIMES: dict[str, dict[str, float]] = {}


def a_class_day(hub, name: str) -> dict[str, float]:
    """One student's first minutes: log in, server, kernel, the first AllReduce, a graded exercise; seconds each."""
    seconds, started = {}, time.monotonic()
    student = hub.student(name)
    student.log_in()
    SESSIONS[name] = student
    seconds["log in"] = time.monotonic() - started
    student.start_server()
    seconds["server"] = time.monotonic() - started - seconds["log in"]
    kernel = student.open_kernel()
    KERNELS[name] = kernel
    allreduce = kernel.execute(FIRST_ALLREDUCE)
    assert allreduce.error is None, f"{name}: {allreduce.error}\n{allreduce.output}"
    assert "totals [1.0, 1.0]" in allreduce.output, allreduce.output
    seconds["AllReduce"] = allreduce.seconds
    graded = kernel.execute(AVERAGE_GRADIENTS)
    assert graded.error is None, f"{name}: {graded.error}\n{graded.output}"
    assert graded.output.startswith("Correct!"), graded.output
    seconds["exercise"] = graded.seconds
    seconds["total"] = time.monotonic() - started
    return seconds


def test_eight_students_at_once_each_run_the_first_allreduce_and_an_exercise(class_hub):
    names = list(class_hub.students)
    with ThreadPoolExecutor(len(names)) as pool:
        for name, seconds in zip(names, pool.map(lambda n: a_class_day(class_hub, n), names), strict=True):
            TIMES[name] = seconds
    print(f"\n{len(names)} students at once, 2 ranks each (seconds):")
    for phase in TIMES[names[0]]:
        values = [TIMES[name][phase] for name in names]
        print(f"  {phase:<10} median {statistics.median(values):6.1f}   max {max(values):6.1f}")
    for name in names:  # each server as its student, with the course copied into a private home
        home = Path(pwd.getpwnam(name).pw_dir)
        assert home.stat().st_mode & 0o077 == 0, f"{home} is {oct(home.stat().st_mode)}"
        assert (home / "my-notebooks" / "00_setup.ipynb").is_file()
        servers = [p for p in processes_of([name]) if "jupyterhub.singleuser" in " ".join(p.cmdline())]
        assert servers, f"no server of {name}'s own uid"


def test_the_progress_is_the_students_own(class_hub):
    name = next(iter(class_hub.students))
    progress = Path(pwd.getpwnam(name).pw_dir) / ".labkit" / "progress.json"
    assert progress.stat().st_uid == pwd.getpwnam(name).pw_uid and progress.stat().st_mode & 0o077 == 0
    assert json.loads(progress.read_text())  # the exercise above was recorded in the student's own file


PROBE = """
import json, os, socket
def attempt(what, action):
    try:
        action()
        return what + ": REACHED"
    except OSError as error:
        return what + ": refused (" + type(error).__name__ + ")"
target = json.loads(%r)
results = [attempt("list their home", lambda: os.listdir(target["home"])),
           attempt("read their notebook", lambda: open(target["notebook"]).read()),
           attempt("read their progress", lambda: open(target["progress"]).read()),
           attempt("read their kernel's connection file", lambda: open(target["connection_file"]).read())]
results += [attempt("open their rendezvous " + path, lambda path=path: open(path, "r+b")) for path in target["stores"]]

def garbage(port):
    with socket.create_connection(("127.0.0.1", port), timeout=2) as connection:
        connection.sendall(os.urandom(4096))
results += [attempt(f"garbage to their rank's port {port}", lambda port=port: garbage(port))
            for port in target["rank_ports"]]
print(json.dumps(results))
"""


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` itself listens on (its sockets' inodes in /proc/PID/net/tcp, state 0A), in
    whichever network namespace it is."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def ranks_of(name: str) -> list:
    return [p for p in processes_of([name]) if "labkit.launch" in " ".join(p.cmdline())]


def test_a_student_cannot_reach_another_students_files_rendezvous_kernel_or_ranks(class_hub):
    a, b = list(class_hub.students)[:2]
    home = Path(pwd.getpwnam(b).pw_dir)
    before = KERNELS[b].execute(FIRST_ALLREDUCE)
    assert before.error is None, before.error
    pids = sorted(p.pid for p in ranks_of(b))
    stores = [str(path) for folder in Path("/tmp").glob("labkit-*") if folder.stat().st_uid == pwd.getpwnam(b).pw_uid
              for path in folder.iterdir()]
    target = {"home": str(home), "notebook": str(home / "my-notebooks" / "00_setup.ipynb"),
              "progress": str(home / ".labkit" / "progress.json"),
              "connection_file": str(next((home / ".local/share/jupyter/runtime").glob("kernel-*.json"))),
              "stores": stores, "rank_ports": sorted(set().union(*(listening_ports(pid) for pid in pids)))}
    assert target["stores"] and target["rank_ports"], target  # B's pool is up: its rendezvous and gloo's ports
    probed = KERNELS[a].execute(PROBE % json.dumps(target))
    assert probed.error is None, probed.error
    results = json.loads(probed.output.strip().splitlines()[-1])
    print("\n" + "\n".join(results))
    assert not [r for r in results if r.endswith("REACHED")], results
    # through the hub: A's own token opens neither B's server nor B's kernel
    assert SESSIONS[a].api("GET", f"/user/{b}/api/kernels", allow_redirects=False).status_code == 403
    assert SESSIONS[a].api("GET", f"/user/{b}/api/kernels/{KERNELS[b].id}",
                           allow_redirects=False).status_code == 403
    after = KERNELS[b].execute(FIRST_ALLREDUCE)
    assert after.error is None and "totals [1.0, 1.0]" in after.output, after
    assert sorted(p.pid for p in ranks_of(b)) == pids  # the same ranks: none was disturbed or replaced


CAPS = """
import torch, labkit
try:
    labkit.run(lambda: 0, world_size=16)
except ValueError as error:
    print("refused:", error)
print("threads", labkit.run(torch.get_num_threads, world_size=2))
"""

RUNAWAY = """
import torch, labkit
def runaway():
    if labkit.rank() == 1:
        hog = []
        while True:  # 64 MiB at a time, every page written: past the student's bound in seconds
            hog.append(torch.ones(16 * 2**20))
    return labkit.rank()
try:
    labkit.run(runaway, world_size=2, timeout=180)
except Exception as error:
    print(type(error).__name__, error)
"""


def test_the_class_caps_say_what_was_asked_and_the_cap(class_hub):
    name = list(class_hub.students)[2]
    reply = KERNELS[name].execute(CAPS)
    assert reply.error is None, reply.error
    assert "refused:" in reply.output and "world_size=16" in reply.output, reply.output
    assert "LABKIT_MAX_WORLD_SIZE=4" in reply.output, reply.output  # the cap and who set it
    assert "threads [1, 1]" in reply.output, reply.output


def test_a_runaway_rank_dies_in_its_students_bound_and_the_others_cells_succeed(class_hub):
    names = list(class_hub.students)
    runaway, others = names[3], names[4:]
    with ThreadPoolExecutor(len(others) + 1) as pool:
        blown = pool.submit(KERNELS[runaway].execute, RUNAWAY, 300)
        calm = [pool.submit(KERNELS[name].execute, FIRST_ALLREDUCE) for name in others]
        replies = [future.result() for future in calm]
        report = blown.result()
    for name, reply in zip(others, replies, strict=True):
        assert reply.error is None and "totals [1.0, 1.0]" in reply.output, (name, reply)
    print("\n" + report.output)
    assert report.error is None, report.error
    assert "RankError" in report.output and "out-of-memory" in report.output, report.output
    assert f"{MEMORY_GIB:g} GiB" in report.output or "MiB" in report.output, report.output  # the bound named
    after = KERNELS[runaway].execute(FIRST_ALLREDUCE)  # the student's kernel and server lived through it
    assert after.error is None and "totals [1.0, 1.0]" in after.output, after


RIGHT_IN_THE_NOTEBOOK = """def my_average_gradients(model):
    world_size = dist.get_world_size()
    for parameter in model.parameters():  # written otherwise than the course's solution: one flat tensor
        flat = parameter.grad.reshape(-1)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        parameter.grad.copy_((flat / world_size).view_as(parameter.grad))

check_average_gradients(my_average_gradients)"""

WRONG_IN_THE_NOTEBOOK = """def my_average_gradients(model):
    n = dist.get_world_size()
    for p in model.parameters():
        dist.all_reduce(p.grad)  # summed, never divided: the N ranks' sum, N times the gradient

check_average_gradients(my_average_gradients)"""

CLAIM_BY_HAND = """
import json, pathlib
path = pathlib.Path.home() / ".labkit" / "progress.json"
path.write_text(json.dumps({"average_gradients": {"passed": True, "attempts": 1,
                                                  "passed_at": "2026-01-05T10:00:00+00:00"}}))
print("claimed")
"""
STANDS = "the re-graded verdict stands"


def save_exercise(student, code: str) -> None:
    """The student's copy of notebook 01 with its "your turn" cell holding `code`, saved through their server's
    contents API, as JupyterLab saves it."""
    path = f"/user/{student.name}/api/contents/01_training_step.ipynb"
    answer = student.api("GET", path)
    answer.raise_for_status()
    notebook = answer.json()["content"]
    cell = next(c for c in notebook["cells"] if c["cell_type"] == "code"
                and "check_average_gradients(my_average_gradients)" in c["source"])
    cell["source"] = code
    student.api("PUT", path, json={"type": "notebook", "format": "json", "content": notebook}).raise_for_status()


def test_the_gradebook_regrades_every_students_notebook_through_the_hub(class_hub, tmp_path):
    """As the instructor runs it: the class listed by the hub's API with the hub's gradebook token, each student's
    saved notebook re-graded as them. Every student passed the exercise in their kernel (the first test), so every
    progress file says passed; what their notebooks hold decides."""
    names = list(class_hub.students)
    right, wrong, claimer = names[:3]
    save_exercise(SESSIONS[right], RIGHT_IN_THE_NOTEBOOK)
    save_exercise(SESSIONS[wrong], WRONG_IN_THE_NOTEBOOK)
    save_exercise(SESSIONS[claimer], WRONG_IN_THE_NOTEBOOK)
    claim = KERNELS[claimer].execute(CLAIM_BY_HAND)
    assert claim.error is None and "claimed" in claim.output, claim
    table = tmp_path / "gradebook.csv"
    started = time.monotonic()
    graded = subprocess.run(
        [sys.executable, "-m", "labkit.classroom.gradebook", "--hub", class_hub.base,
         "--token-file", str(class_hub.state / "hub" / "gradebook-token"), "--exercises", "average_gradients",
         "--csv", str(table)], capture_output=True, text=True, timeout=600, cwd=REPOSITORY)
    seconds = time.monotonic() - started
    assert graded.returncode == 0, graded.stderr + graded.stdout
    print(f"\n{graded.stdout}\ngradebook: {len(names)} students in {seconds:.0f} s")
    rows = {row["student"]: row for row in csv.DictReader(table.open())}
    assert sorted(rows) == sorted(names), rows  # the hub's class list: every student, no one else
    assert rows[right]["passed"] == "yes" and rows[right]["re-graded"] == "passed", rows[right]
    assert rows[right]["first passed at"] and rows[right]["note"] == "", rows[right]
    for name in (wrong, claimer):
        assert rows[name]["passed"] == "no" and rows[name]["re-graded"] == "failed", rows[name]
        assert STANDS in rows[name]["note"] and rows[name]["first passed at"] == "", rows[name]
    # the hand-edited claim is shown, beside the verdict that stands
    assert rows[claimer]["progress file says"] == "passed at 2026-01-05T10:00:00+00:00", rows[claimer]
    assert rows[claimer]["attempts recorded"] == "1", rows[claimer]
    for name in names[3:]:  # the stub as the course left it in the notebook, whatever the kernel ran
        assert rows[name]["re-graded"] == "not attempted" and rows[name]["passed"] == "no", rows[name]
        assert STANDS in rows[name]["note"], rows[name]


def test_nothing_is_left_running_after_the_hub_stops(class_hub):
    class_hub.stop()
    deadline = time.monotonic() + 30
    while processes_of(list(class_hub.students)) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [f"{p.pid} {p.username()} {' '.join(p.cmdline())[:80]}" for p in processes_of(list(class_hub.students))]
    assert not left, "left running after the hub stopped:\n" + "\n".join(left)
    assert not re.search(r"configurable-http-proxy", " ".join(
        " ".join(p.cmdline()) for p in __import__("psutil").process_iter() if p.pid != class_hub.process.pid))
    assert MEMORY_GIB
