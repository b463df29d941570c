"""No other local user can reach a CPU pool's ranks over the network (issue 28, "Killing a rank through gloo's port").

gloo does not authenticate peers, and every connection it accepts stays open in the rank after the stranger closes
it: with the common 1024-fd limit, uid 65534 opening and closing 2,200 connections on 127.0.0.1 had 2,112 accepted,
the ranks aborted ("accept: Too many open files") and labkit replaced the pool silently, the `%%ranks` variables
gone. Each local CPU pool's ranks now have a network namespace of their own, with only loopback: the stranger's
connections are refused, the same ranks serve the next call and keep their state.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
from sockets import listening_sockets, ports_of_others

import labkit
from labkit.launch.cells import run_cell
from labkit.launch.owner import OWNER

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLOOD_CONNECTIONS = 2_200  # twice the 1,024 fds a rank may hold: enough to abort it if accepted
FD_LIMIT = 1024  # the common default soft limit, set in the ranks so the flood would exhaust it

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux's")
# Asked of util-linux's unshare, not of labkit: a kernel (or container) that refuses namespaces skips the tests
# that need one rather than failing them; the refusal path has a test of its own below.
UNSHARE_NETWORK = ["unshare", "--net", "true"]
UNSHARE_USER_NETWORK = ["unshare", "--user", "--map-root-user", "--net", "true"]


def _kernel_allows(command: list[str], as_user=None) -> bool:
    if shutil.which("unshare") is None:
        return False
    run = as_user or (lambda c: subprocess.run(c, capture_output=True))
    return run(command).returncode == 0


@pytest.fixture
def namespaces_allowed():
    if not (_kernel_allows(UNSHARE_NETWORK) or _kernel_allows(UNSHARE_USER_NETWORK)):
        pytest.skip("this kernel (or container) refuses network namespaces: the ranks share the host's network")

# Run as the other user: open and close up to FLOOD_CONNECTIONS connections to each (host, port), count those
# accepted. With "--stop-at-first", a port's flood stops at its first accepted connection: the test floods only
# ports nothing listens on in the host's namespace, and must not flood whatever starts listening there meanwhile
# (another test's ranks, on a shared machine).
FLOOD = """
import json, socket, sys
accepted = {}
for host, port in json.loads(sys.argv[1]):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    count = 0
    for _ in range(int(sys.argv[2])):
        with socket.socket(family) as s:
            s.settimeout(2)
            try:
                s.connect((host, port))
                count += 1
            except OSError:
                pass
        if count and "--stop-at-first" in sys.argv:
            break
    accepted[f"{host}:{port}"] = count
print(json.dumps(accepted))
"""


def _limit_fds(soft: int) -> int:
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def test_another_user_cannot_connect_to_a_ranks_port_and_the_ranks_survive_a_flood(as_another_user, monkeypatch,
                                                                                   namespaces_allowed):
    monkeypatch.delenv("LABKIT_RANK_NETWORK", raising=False)
    labkit.shutdown(world_size=2)  # a fresh pool, started under this test's environment
    assert labkit.run(_limit_fds, FD_LIMIT, world_size=2) == [FD_LIMIT, FD_LIMIT]
    labkit.run(run_cell, "kept = 41 + labkit.rank()", "<network test: state>", world_size=2)
    pids = OWNER.kept_pool(2, "gloo").pids()
    ports = [port for pid in pids for port in listening_sockets(pid)]
    assert ports, "gloo's ranks listen on no port: nothing to probe"
    others = ports_of_others(pids)  # the same numbers in the host's namespace: someone else's, not to flood
    ports = [(host, port) for host, port in ports if port not in others]
    if not ports:
        pytest.skip("every port the ranks listen on is also listened on by another process in the host's namespace")
    fds_before = [len(os.listdir(f"/proc/{pid}/fd")) for pid in pids]

    flood = as_another_user([sys.executable, "-c", FLOOD, json.dumps(ports), str(FLOOD_CONNECTIONS),
                             "--stop-at-first"], timeout=300)
    assert flood.returncode == 0, flood.stderr
    accepted = json.loads(flood.stdout)
    assert accepted == {f"{host}:{port}": 0 for host, port in ports}, \
        f"of {FLOOD_CONNECTIONS} connections per port, another user had these accepted: {accepted}"

    assert [len(os.listdir(f"/proc/{pid}/fd")) for pid in pids] == fds_before  # no connection reached them
    assert labkit.run(run_cell, "kept", "<network test: state kept>", world_size=2) == [41, 42]
    assert OWNER.kept_pool(2, "gloo").pids() == pids


def _namespaces(world_size: int) -> set[str]:
    return {os.readlink(f"/proc/{pid}/ns/net") for pid in labkit.run(os.getpid, world_size=world_size)}


def test_each_pool_has_a_network_namespace_of_its_own_unless_labkit_rank_network_is_shared(monkeypatch,
                                                                                            namespaces_allowed):
    monkeypatch.delenv("LABKIT_RANK_NETWORK", raising=False)
    labkit.shutdown()
    host = os.readlink("/proc/self/ns/net")
    two, three = _namespaces(2), _namespaces(3)
    assert len(two) == 1 and len(three) == 1 and two != three and host not in two | three
    held = [os.readlink(f"/proc/{pid}/fd/{fd}") for pid in OWNER.kept_pool(3, "gloo").pids()
            for fd in os.listdir(f"/proc/{pid}/fd")]
    assert not [f for f in held if f.startswith(("net:", "user:"))], "a rank keeps other pools' namespaces alive"
    monkeypatch.setenv("LABKIT_RANK_NETWORK", "shared")  # read at each pool's start
    labkit.shutdown(world_size=2)
    try:
        assert _namespaces(2) == {host}
    finally:
        labkit.shutdown(world_size=2)


# Where the kernel refuses: in a user namespace of its own (root mapped to root) whose limit of nested user
# namespaces is 0, with every capability dropped, the script can create neither a network namespace nor a user one.
REFUSING_KERNEL = ["unshare", "--user", "--map-root-user", "sh", "-c",
                   "echo 0 > /proc/sys/user/max_user_namespaces && "
                   'exec setpriv --inh-caps=-all --bounding-set=-all "$@"', "refusing-kernel"]

FLOODED_WITHOUT_A_NAMESPACE = """
import json, subprocess, sys, time
sys.path.insert(0, "tests/distributed")
import labkit
from labkit.launch.owner import OWNER
from sockets import listening_sockets
from test_launch_network import FLOOD, FD_LIMIT, _limit_fds

labkit.run(_limit_fds, FD_LIMIT, world_size=3)  # a first pool, so that the message is seen to come once
labkit.run(_limit_fds, FD_LIMIT, world_size=2)
pool = OWNER.kept_pool(2, "gloo")
ports = [port for pid in pool.pids() for port in listening_sockets(pid)]
subprocess.run([sys.executable, "-c", FLOOD, json.dumps(ports), "2200"], check=True, capture_output=True)
deadline = time.monotonic() + 60
while pool.healthy() and time.monotonic() < deadline:
    time.sleep(0.1)
print("WHY:", pool.why_unhealthy())
"""


@pytest.mark.skipif(not shutil.which("unshare") or not shutil.which("setpriv"), reason="needs unshare and setpriv")
def test_where_the_kernel_refuses_it_says_so_once_and_names_the_cause_of_a_flooded_ranks_death(monkeypatch):
    monkeypatch.delenv("LABKIT_RANK_NETWORK", raising=False)
    done = subprocess.run(REFUSING_KERNEL + [sys.executable, "-c", FLOODED_WITHOUT_A_NAMESPACE], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    out, err = done.stdout, done.stderr
    assert done.returncode == 0, err
    assert err.count("other users on this machine can connect to the ranks' ports") == 1, err
    assert "the limit of user namespaces is reached" in err
    why = out.split("WHY:", 1)[1]
    assert "died while idle (killed by SIGABRT)" in why and "'Too many open files'" in why, why
    assert "other users on this machine flooding its port with connections" in why


# As a user without privileges: a namespace through a user namespace of its own, joined by a forked child, which
# keeps its uid, has loopback and holds no capability.
UNPRIVILEGED_NAMESPACE = """
import json, os, socket
from labkit.launch import netns
namespace = netns.make_namespace()
read_end, write_end = os.pipe()
if os.fork() == 0:
    netns.enter(namespace)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        socket.create_connection(server.getsockname()).close()
    capabilities = open("/proc/self/status").read().split("CapEff:")[1].split()[0]
    os.write(write_end, json.dumps([os.getuid(), os.readlink("/proc/self/ns/net"), capabilities]).encode())
    os._exit(0)
os.close(write_end)
uid, network, capabilities = json.loads(os.read(read_end, 4096))
print(json.dumps({"user namespace": namespace.user_fd is not None, "uid": uid, "own network":
                  network != os.readlink("/proc/self/ns/net"), "capabilities": capabilities}))
"""


def test_an_unprivileged_user_gets_a_namespace_through_a_user_namespace_and_no_capability(as_another_user):
    if not _kernel_allows(UNSHARE_USER_NETWORK, as_another_user):
        pytest.skip("this kernel (or container) refuses unprivileged user namespaces")
    done = as_another_user([sys.executable, "-c", UNPRIVILEGED_NAMESPACE], env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"user namespace": True, "uid": 65534, "own network": True,
                                       "capabilities": "0000000000000000"}


def test_a_spawned_ranks_command_line_tells_another_user_nothing_of_the_store(as_another_user, monkeypatch):
    """Under LABKIT_START_METHOD=spawn (macOS's default) the RankSpec was pickled into every rank's argv, so any
    user read the store's path from /proc/<pid>/cmdline; it now comes through an unlinked temporary file."""
    labkit.shutdown()  # the start method is the fork server's: a new one, spawning
    monkeypatch.setenv("LABKIT_START_METHOD", "spawn")
    try:
        pids = labkit.run(os.getpid, world_size=2)
        store_path = OWNER.kept_pool(2, "gloo").store_path
        for pid in pids:
            seen = as_another_user(["cat", f"/proc/{pid}/cmdline"])
            assert seen.returncode == 0 and "spawned_main" in seen.stdout, seen
            assert store_path not in seen.stdout and store_path.encode().hex() not in seen.stdout, seen.stdout[:300]
    finally:
        labkit.shutdown()
