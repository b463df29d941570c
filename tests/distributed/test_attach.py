"""labkit.attach: ranks that torchrun starts on two "nodes" (tests/distributed/two_nodes.py: as root, two network
namespaces joined through a bridge, hosts node-a and node-b; else loopback), attached to this process as a
notebook's kernel is, and run with local ranks' contract: results in rank order, output labelled with rank and
host, one error naming ranks and hosts, the hang report with every rank's stack, %%ranks variables kept,
labkit.shutdown() ending the ranks and torchrun. Faults: a rank killed, a node's torchrun killed, torchrun's
restart, the notebook's death, another labkit version. Security: tests/distributed/test_attach_security.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from IPython.testing import globalipapp

import labkit
from labkit.launch import owner
from tests.distributed.two_nodes import LOOPBACK, Nodes, names_tag, remove_namespaces

WORLD_SIZE, NODES = 4, 2
ATTACH_SECONDS = 120.0  # four ranks importing torch on two busy cores, and torchrun's rendezvous


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def attach_two_nodes(nodes: Nodes, tmp_path, max_restarts: int = 0, env: dict | None = None):
    port = free_port(nodes.notebook_host)
    rdzv_port = free_port(nodes.addresses[0]) if nodes.network == LOOPBACK else 29400
    nodes.start(f"{nodes.notebook_host}:{port}", ranks_per_node=WORLD_SIZE // NODES, max_restarts=max_restarts,
                env=env, rdzv_port=rdzv_port, log_dir=tmp_path)
    return labkit.attach(world_size=WORLD_SIZE, nodes=NODES, host=nodes.notebook_host, port=port,
                         timeout=ATTACH_SECONDS)


def rank_pids(attachment) -> dict[int, int]:
    return {a.hello.rank: a.hello.pid for a in attachment.pool.arrivals}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.fixture
def cluster(tmp_path):
    """Four ranks on two nodes, attached; at the end labkit.shutdown() must end them and both torchruns. One per
    test: a test's own attach (or shutdown) ends the attachment before it, as in a notebook."""
    nodes = Nodes()
    try:
        attachment = attach_two_nodes(nodes, tmp_path, max_restarts=1)
        yield nodes, attachment
        pids = rank_pids(owner.OWNER.attachment)
        labkit.shutdown()
        assert nodes.wait(30) == [0, 0], "labkit.shutdown() ends the attached ranks, and torchrun with them"
        assert not [pid for pid in pids.values() if alive(pid)]
    finally:
        labkit.shutdown()
        nodes.close()


def test_calls_return_in_rank_order_with_output_labelled_by_rank_and_host(cluster, capfd):
    nodes, attachment = cluster

    def where(x):
        import socket

        import torch
        import torch.distributed as dist
        t = torch.tensor([float(labkit.rank() + x)])
        dist.all_reduce(t)
        print("sum", t.item())
        return labkit.rank(), socket.gethostname(), t.item()

    results = labkit.run(where, 10, world_size=WORLD_SIZE)
    assert [r[0] for r in results] == [0, 1, 2, 3]
    assert {r[2] for r in results} == {46.0}
    out = capfd.readouterr().out
    for rank, host, _ in results:
        assert f"[rank {rank} @ {host}] sum 46.0" in out
    if nodes.network != LOOPBACK:
        assert [r[1] for r in results] == ["node-a", "node-a", "node-b", "node-b"]
    table = repr(attachment)
    assert all(f" {address} " in table for address in nodes.addresses), table
    print(f"two nodes over {nodes.network}")


def test_one_error_names_the_failed_ranks_and_their_hosts(cluster):
    nodes, _ = cluster

    def fail_on_node_b():
        if labkit.rank() >= 2:
            raise ValueError(f"bad shard on rank {labkit.rank()}")
        return labkit.rank()

    with pytest.raises(labkit.RankError) as caught:
        labkit.run(fail_on_node_b, world_size=WORLD_SIZE)
    text = str(caught.value)
    assert "ranks 2-3 of 4 failed" in text and "ValueError: bad shard on rank" in text
    assert f"({nodes.addresses[1]})" in text, text
    assert not caught.value.pool_stopped  # every rank replied in step: the pool is kept
    assert labkit.run(labkit.rank, world_size=WORLD_SIZE) == [0, 1, 2, 3]


def test_a_hang_reports_every_ranks_stack_from_every_node(cluster):
    def ranks_2_and_3_skip_the_collective():
        import torch
        import torch.distributed as dist
        if labkit.rank() < 2:
            dist.all_reduce(torch.ones(1))
        return labkit.rank()

    with pytest.raises(labkit.RankTimeout) as caught:
        labkit.run(ranks_2_and_3_skip_the_collective, world_size=WORLD_SIZE, timeout=4)
    text = str(caught.value)
    assert "ranks 0-1 still running (ranks 2-3 had returned)" in text, text
    assert "all_reduce" in text and "ranks_2_and_3_skip_the_collective" in text
    assert caught.value.pool_stopped
    # the pool was given up, its ranks told to exit 1: torchrun (--max-restarts 1) restarts them, and they attach again
    assert labkit.run(labkit.rank, world_size=WORLD_SIZE) == [0, 1, 2, 3]


@pytest.fixture
def ipython():
    shell = globalipapp.start_ipython() or globalipapp.get_ipython()  # the one shell, whoever started it
    shell.run_cell("%load_ext labkit")
    return shell


def test_ranks_cells_keep_their_variables_on_attached_ranks(tmp_path, ipython, capfd):
    nodes = Nodes()
    try:
        attach_two_nodes(nodes, tmp_path)
        assert ipython.run_cell(f"%%ranks {WORLD_SIZE}\nimport socket\nx = 100 + labkit.rank()").success
        assert ipython.run_cell(f"%%ranks {WORLD_SIZE}\nprint('x is', x, socket.gethostname())").success
        out = capfd.readouterr().out
        assert all(f"x is {100 + r}" in out for r in range(WORLD_SIZE)), out
    finally:
        labkit.shutdown()
        assert nodes.wait(30) == [0, 0]
        nodes.close()


def test_a_killed_rank_fails_the_call_within_seconds_naming_its_node(tmp_path):
    nodes = Nodes()
    try:
        attachment = attach_two_nodes(nodes, tmp_path)
        victim = rank_pids(attachment)[3]

        def sleep_long():
            import time
            time.sleep(60)

        import threading
        threading.Timer(1.0, os.kill, (victim, signal.SIGKILL)).start()
        started = time.monotonic()
        with pytest.raises(labkit.RankError) as caught:
            labkit.run(sleep_long, world_size=WORLD_SIZE, timeout=60)
        assert time.monotonic() - started < 15, "a lost rank fails the call within seconds, not at its timeout"
        text = str(caught.value)
        assert "rank 3" in text and "its connection to the notebook closed" in text
        assert f"({nodes.addresses[1]})" in text
        assert labkit.run(labkit.rank, world_size=2) == [0, 1]  # the notebook stays usable (local ranks)
    finally:
        labkit.shutdown()
        nodes.close()


def test_a_nodes_torchrun_killed_takes_its_ranks_and_fails_the_call(tmp_path):
    nodes = Nodes()
    try:
        attachment = attach_two_nodes(nodes, tmp_path)
        pids = rank_pids(attachment)
        # node-b's launcher is torchrun itself (`ip netns exec ... sh -c 'exec "$@"'` execs it in the same process)
        os.kill(nodes.launches[1].pid, signal.SIGKILL)
        with pytest.raises(labkit.RankError) as caught:
            labkit.run(time.sleep, 30, world_size=WORLD_SIZE, timeout=60)
        assert "ranks 2-3" in str(caught.value)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (alive(pids[2]) or alive(pids[3])):
            time.sleep(0.1)
        assert not alive(pids[2]) and not alive(pids[3]), "ranks die with their torchrun (parent-death signal)"
    finally:
        labkit.shutdown()
        nodes.close()


def test_torchruns_restart_attaches_again_and_says_the_variables_are_lost(tmp_path, capfd):
    nodes = Nodes()
    try:
        attachment = attach_two_nodes(nodes, tmp_path, max_restarts=1)
        old = rank_pids(attachment)
        os.kill(old[1], signal.SIGKILL)  # between calls: torchrun restarts every rank of the world
        time.sleep(1.0)
        assert labkit.run(labkit.rank, world_size=WORLD_SIZE) == [0, 1, 2, 3]
        out = capfd.readouterr().out
        assert "torchrun restarted the 4 attached ranks (restart 1)" in out, out
        assert not set(rank_pids(owner.OWNER.attachment).values()) & set(old.values())
        ended = owner.OWNER.why_ended(owner.OWNER.serial((WORLD_SIZE, owner.ATTACHED, None)) - 1)
        assert ended and "lost their connection" in ended
    finally:
        labkit.shutdown()
        assert nodes.wait(30) == [0, 0]
        nodes.close()


NOTEBOOK = textwrap.dedent("""
    import sys
    sys.path[:0] = [{repo!r}]
    from tests.distributed.test_attach import attach_two_nodes
    from tests.distributed.two_nodes import Nodes
    nodes = Nodes()
    attachment = attach_two_nodes(nodes, __import__("pathlib").Path({log_dir!r}))
    print("PIDS", *[a.hello.pid for a in attachment.pool.arrivals], *[p.pid for p in nodes.launches], flush=True)
    import time
    time.sleep(600)
""")


def test_the_notebooks_death_ends_its_ranks_and_torchrun(tmp_path):
    """A kernel killed (SIGKILL: no atexit, nothing said): the ranks lose their connections and exit 0, and
    torchrun with them; nothing is left on the nodes."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = NOTEBOOK.format(repo=repo, log_dir=str(tmp_path))
    kernel = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=repo,
                              start_new_session=True)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + ATTACH_SECONDS + 30
        for line in kernel.stdout:
            if line.startswith("PIDS"):
                pids = [int(p) for p in line.split()[1:]]
                break
            assert time.monotonic() < deadline
        assert len(pids) == WORLD_SIZE + NODES, "the stand-in notebook attached its ranks"
        kernel.kill()  # the kernel alone: its torchruns live in sessions of their own
        kernel.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(alive(pid) for pid in pids):
            time.sleep(0.2)
        assert not [pid for pid in pids if alive(pid)], "ranks and torchrun end when the notebook dies"
    finally:
        kernel.kill()
        for pid in pids[WORLD_SIZE:]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        remove_namespaces(names_tag(kernel.pid, 0))


def test_ranks_of_another_labkit_version_are_refused_at_attach_with_both_versions_named(tmp_path):
    other = tmp_path / "other_version"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import labkit.version\nlabkit.version.VERSION = '0.0.1-other'\n")
    nodes = Nodes()
    try:
        with pytest.raises(RuntimeError) as caught:
            attach_two_nodes(nodes, tmp_path, env={"PYTHONPATH": f"{other}{os.pathsep}{_repo()}"})
        text = str(caught.value)
        assert "labkit 0.0.1-other" in text and f"labkit {labkit.__version__}" in text, text
        assert owner.OWNER.attachment is None
        codes = nodes.wait(30)
        assert None not in codes and set(codes) != {0}, "refused ranks exit non-zero, and torchrun ends"
    finally:
        labkit.shutdown()
        nodes.close()


def _repo() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_node_whose_network_vanishes_fails_the_call_within_the_keepalive_time(tmp_path):
    """No FIN, no RST: node-b's link to the notebook goes down mid-call (a cable pulled). TCP keepalive (_signed.py:
    5 s idle, then 3 probes 2 s apart) notices in about 11 s, well before the call's 60 s timeout."""
    nodes = Nodes()
    if nodes.network == LOOPBACK:
        nodes.close()
        pytest.skip("needs root for two network namespaces: loopback cannot be pulled from one node alone")
    try:
        attach_two_nodes(nodes, tmp_path)
        import threading
        threading.Timer(1.0, subprocess.run, (["ip", "link", "set", nodes.veths[1], "down"],)).start()
        started = time.monotonic()
        with pytest.raises(labkit.RankError) as caught:
            labkit.run(time.sleep, 50, world_size=WORLD_SIZE, timeout=60)
        assert time.monotonic() - started < 30, "noticed by keepalive, not at the call's timeout"
        assert "ranks 2-3" in str(caught.value) and f"({nodes.addresses[1]})" in str(caught.value)
    finally:
        labkit.shutdown()
        nodes.close()


def test_ctrl_c_stops_attached_ranks_in_step_and_keeps_them(cluster, capfd):
    import threading
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT))
    try:
        labkit.run(labkit.rank, world_size=WORLD_SIZE)
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            labkit.run(time.sleep, 20, world_size=WORLD_SIZE, timeout=60)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert "every rank stopped cleanly and the pool is kept" in capfd.readouterr().err
    pids = rank_pids(owner.OWNER.attachment)
    assert labkit.run(labkit.rank, world_size=WORLD_SIZE) == [0, 1, 2, 3]
    assert rank_pids(owner.OWNER.attachment) == pids  # the same processes: nothing was restarted
