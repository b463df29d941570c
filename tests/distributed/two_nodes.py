"""Two "nodes" on this machine for the attached-rank tests: torchrun launched twice, as a cluster's two nodes would.

As root (CI runs as root), each node is a network namespace of its own (network_namespaces(7)) and a UTS namespace
with its own host name, node-a and node-b, joined to the notebook's namespace through a Linux bridge (`ip link add
... type bridge`, veth pairs, `eth0` in each node). The nodes also share a link of their own, `eth1` (one veth pair
between node-a and node-b, as a cluster's inter-node fabric), which the ranks use among themselves: torchrun's
rendezvous and gloo (GLOO_SOCKET_IFNAME=eth1, the classic multi-node setting) go over it, the notebook's control
connections over eth0. So the kernel's byte counters of eth1 (`inter_node_nbytes`) are the bytes that crossed
between the nodes, and nothing else.
Without root, both nodes share loopback and the tests say so (`Nodes.network`).

Everything made here is removed by `close()`: the torchrun process groups (killed), the namespaces, the bridge.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NAMESPACES = "namespaces"  # two network namespaces joined through a bridge (root)
LOOPBACK = "loopback"  # both nodes on this machine's loopback (without root)


_made = itertools.count()


def names_tag(pid: int, serial: int) -> str:
    """What names the namespaces and links of the `serial`-th Nodes of process `pid` (interface names: 15 chars)."""
    return f"{pid % 10000}{serial % 100:02d}"


def remove_namespaces(tag: str, count: int = 2) -> None:
    """Remove what a Nodes named by `tag` made, if its process died before its close()."""
    for i in range(count):
        _ip("link", "del", f"lkv{tag}-{i}", check=False)  # now: a namespace lingers while sockets made in it do
        _ip("netns", "del", f"lknode{tag}-{i}", check=False)
        shutil.rmtree(f"/etc/netns/lknode{tag}-{i}", ignore_errors=True)
    _ip("link", "del", f"lkbr{tag}", check=False)


def can_make_namespaces() -> bool:
    return os.geteuid() == 0 and sys.platform.startswith("linux") and subprocess.run(
        ["ip", "-V"], capture_output=True).returncode == 0


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True)


@dataclass
class Nodes:
    """`count` nodes; `notebook_host` is the address the notebook listens at, `addresses[i]` node i's."""

    count: int = 2
    network: str = field(default_factory=lambda: NAMESPACES if can_make_namespaces() else LOOPBACK)
    launches: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self):
        tag = names_tag(os.getpid(), next(_made))
        self._bridge = f"lkbr{tag}"
        self._names = [f"lknode{tag}-{i}" for i in range(self.count)]
        self.veths = [f"lkv{tag}-{i}" for i in range(self.count)]  # the notebook's side of each node's link
        self.hosts = [f"node-{chr(ord('a') + i)}" for i in range(self.count)]
        subnet = f"10.{100 + os.getpid() % 150}.{int(tag) % 250}"
        if self.network == LOOPBACK:
            self.notebook_host, self.addresses = "127.0.0.1", ["127.0.0.1"] * self.count
            return
        self.notebook_host = f"{subnet}.1"
        self.addresses = [f"{subnet}.{2 + i}" for i in range(self.count)]  # on eth0, where the notebook is
        self.fabric = [f"{subnet}.{130 + i}" for i in range(self.count)]  # on eth1, between the nodes
        try:
            _ip("link", "add", self._bridge, "type", "bridge")
            _ip("addr", "add", f"{self.notebook_host}/24", "dev", self._bridge)
            _ip("link", "set", self._bridge, "up")
            # a node's name is its address on the nodes' own link (torchrun's c10d rendezvous hosts its store on the
            # node whose name resolves to the endpoint's address)
            names = zip(self.fabric if self.count == 2 else self.addresses, self.hosts, strict=True)
            hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for a, h in names)
            for name, veth, address in zip(self._names, self.veths, self.addresses, strict=True):
                # `ip netns exec` mounts /etc/netns/NAME/hosts over /etc/hosts (ip-netns(8)): each node resolves
                # both nodes' names, as a cluster's DNS would (torchrun's c10d rendezvous looks its own name up)
                Path(f"/etc/netns/{name}").mkdir(parents=True, exist_ok=True)
                Path(f"/etc/netns/{name}/hosts").write_text(hosts)
                _ip("netns", "add", name)
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
                _ip("link", "set", veth, "master", self._bridge)
                _ip("link", "set", veth, "up")
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
                _ip("-n", name, "link", "set", "lo", "up")
            if self.count == 2:
                _ip("link", "add", "eth1", "netns", self._names[0], "type", "veth", "peer", "name", "eth1", "netns",
                    self._names[1])
                for name, address in zip(self._names, self.fabric, strict=True):
                    _ip("-n", name, "addr", "add", f"{address}/32", "dev", "eth1")
                    _ip("-n", name, "link", "set", "eth1", "up")
                for name, other in zip(self._names, reversed(self.fabric), strict=True):
                    _ip("-n", name, "route", "add", other, "dev", "eth1")
        except BaseException:
            self.close()
            raise

    def start(self, connect: str, ranks_per_node: int = 2, max_restarts: int = 0, env: dict | None = None,
              rdzv_port: int = 29400, log_dir: Path | None = None) -> None:
        """torchrun on every node, as labkit.attach printed it, with `--node-rank` given (a static rendezvous is
        not needed: c10d at node 0's address)."""
        for i in range(self.count):
            args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.count), "--node-rank", str(i),
                    "--nproc-per-node", str(ranks_per_node), "--max-restarts", str(max_restarts),
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.fabric_addresses[0]}:{rdzv_port}",
                    "--rdzv-id", f"labkit-test-{os.getpid()}", "--local-addr", self.fabric_addresses[i],
                    "-m", "labkit.agent", "--connect", connect]
            node_env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                        "OMP_NUM_THREADS": "1", **(env or {})}
            if self.network == NAMESPACES:
                node_env["GLOO_SOCKET_IFNAME"] = "eth1" if self.count == 2 else "eth0"
                args = ["ip", "netns", "exec", self._names[i], "unshare", "--uts", "sh", "-c",
                        f'hostname {self.hosts[i]} && exec "$@"', "sh", *args]
            else:
                node_env["GLOO_SOCKET_IFNAME"] = "lo"
            out = open(log_dir / f"node{i}.log", "wb") if log_dir else subprocess.DEVNULL
            self.launches.append(subprocess.Popen(args, env=node_env, stdout=out, stderr=subprocess.STDOUT,
                                                  start_new_session=True, cwd=REPO))

    @property
    def fabric_addresses(self) -> list[str]:
        """Where the nodes reach each other: eth1's addresses with two namespaced nodes, else `addresses`."""
        return self.fabric if self.network == NAMESPACES and self.count == 2 else self.addresses

    def inter_node_nbytes(self) -> int:
        """Bytes the two nodes sent each other so far (eth1's tx counters in both, as `ip -s link` reads them:
        Ethernet frames, so TCP/IP headers and acknowledgements included). Namespaces only."""
        total = 0
        for name in self._names:
            shown = subprocess.run(["ip", "-n", name, "-j", "-s", "link", "show", "eth1"], check=True,
                                   capture_output=True, text=True).stdout
            total += json.loads(shown)[0]["stats64"]["tx"]["bytes"]
        return total

    def wait(self, seconds: float) -> list[int | None]:
        """Each torchrun's exit code once all have ended, or None for those still running after `seconds`."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and any(p.poll() is None for p in self.launches):
            time.sleep(0.1)
        return [p.poll() for p in self.launches]

    def close(self) -> None:
        for p in self.launches:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        self.launches.clear()
        if self.network == NAMESPACES:
            remove_namespaces(self._bridge[len("lkbr"):], self.count)
