"""A network of their own for each local CPU pool's ranks: a Linux network namespace with only loopback.

Why: gloo does not authenticate peers, and every connection a rank accepts on its port stays open in the rank after
the other end closes it. Any local user could connect to 127.0.0.1:<port>; with the common 1024-fd limit about
1,100 idle connections aborted a rank ("accept: Too many open files", SIGABRT) and labkit replaced the pool,
its `%%ranks` variables gone. A pool's ranks need no network beyond loopback among themselves: the owner talks to
them over pipes and socketpairs it hands them, and they meet in a FileStore. In a namespace of their own their
ports exist nowhere else, so no other user can reach them at all.

How (namespaces(7), network_namespaces(7), user_namespaces(7)): the fork server makes each namespace in a short-
lived holder child, which calls unshare(CLONE_NEWNET) where it may (root, CAP_SYS_ADMIN), otherwise
unshare(CLONE_NEWUSER | CLONE_NEWNET) mapping only the user's own uid and gid, and brings `lo` up with the
SIOCSIFFLAGS ioctl (netdevice(7); `ip` is not installed everywhere). The server keeps the namespace's file
descriptors (an open /proc/<pid>/ns file keeps a namespace alive after its last process), and each rank forked for
the pool joins it with setns(2) before anything else; a rank in a user namespace then drops the capabilities it
holds there. Root ranks never get a user namespace: inside one, root's capabilities would stop applying to the
host's files. A spare namespace is made ahead, at an idle moment, so that a pool's start does not wait for one.
A cost of the user namespace (user_namespaces(7), "Unmapped user and group IDs"): in such a rank every uid but the
user's own, root's included, reads as the overflow uid (65534, `nobody`), so an ownership check made inside a rank
cannot tell root's files from another user's; make such checks in the owner, or compare with the user's own uid.

Where the kernel refuses (no unprivileged user namespaces, not Linux), the ranks share the host's network and
`warn_once` says so in the notebook, once. `LABKIT_RANK_NETWORK=shared` opts out. NCCL pools stay in the host's
namespace: NCCL's intra-node paths (P2P over NVLink or PCIe through CUDA IPC, SHM through /dev/shm) need no
network, but its bootstrap opens sockets on an interface (NCCL_SOCKET_IFNAME), and that has not been verified
on a GPU inside such a namespace, so only CPU (gloo) pools get one.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import struct
import sys
from dataclasses import dataclass

__all__ = ["PRIVATE", "SHARED", "Namespace", "PoolNetworks", "enter", "make_namespace", "rank_network",
           "warn_once"]

PRIVATE = "private"  # the pool's ranks get a namespace of their own (the default)
SHARED = "shared"  # the ranks stay in the host's namespace
_CLONE_NEWNET = 0x40000000  # <linux/sched.h>
_CLONE_NEWUSER = 0x10000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1  # <linux/sockios.h>, <net/if.h>
_IFREQ = "16sH22x"  # struct ifreq: the interface's name, then ifr_flags in its 24-byte union
_LINUX_CAPABILITY_VERSION_3 = 0x20080522  # <linux/capability.h>

FALLBACK_MESSAGE = ("labkit: other users on this machine can connect to the ranks' ports: the ranks could not get "
                    "a network of their own ({why}). gloo does not authenticate peers, and a flood of connections "
                    "aborts a rank ('accept: Too many open files'). To protect them, allow unprivileged user "
                    "namespaces here; LABKIT_RANK_NETWORK=shared silences this.")
TOO_MANY_FILES_CAUSE = ("gloo aborts a rank that runs out of file descriptors: its own files and sockets, or, where "
                        "the ranks share the host's network (labkit says so when they start), other users on this "
                        "machine flooding its port with connections")
# Why unshare(CLONE_NEWUSER | CLONE_NEWNET) fails, by errno (user_namespaces(7), unshare(2)).
_USER_NAMESPACE_REFUSALS = {
    errno.EPERM: "unprivileged user namespaces are disabled (sysctl kernel.unprivileged_userns_clone, or "
                 "AppArmor's kernel.apparmor_restrict_unprivileged_userns)",
    errno.ENOSPC: "the limit of user namespaces is reached (sysctl user.max_user_namespaces; 0 disables them)",
    errno.EINVAL: "this kernel has no user namespaces",
    errno.EUSERS: "user namespaces are nested too deep here",
}
_warned = False


def rank_network(backend: str) -> str:
    """PRIVATE or SHARED: the network a new pool's ranks on `backend` get, by LABKIT_RANK_NETWORK (read at each
    pool's start). NCCL pools stay SHARED (module docstring)."""
    asked = os.environ.get("LABKIT_RANK_NETWORK", PRIVATE)
    if asked not in (PRIVATE, SHARED):
        raise ValueError(f"LABKIT_RANK_NETWORK={asked!r}: use {PRIVATE!r} (the default: each CPU pool's ranks in a "
                         f"network namespace of their own) or {SHARED!r} (the host's network).")
    return SHARED if backend == "nccl" else asked


def warn_once(why: str) -> None:
    """Owner side: say once per process that the ranks share the host's network, and why."""
    global _warned
    if not _warned:
        _warned = True
        print(FALLBACK_MESSAGE.format(why=why), file=sys.stderr)


@dataclass
class Namespace:
    """A network namespace kept alive by open descriptors: `net_fd`, and `user_fd` for the user namespace that
    owns it where one was needed (None for root)."""

    net_fd: int
    user_fd: int | None

    def close(self) -> None:
        for fd in (self.net_fd, self.user_fd):
            if fd is not None:
                os.close(fd)


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"{what}: {os.strerror(number)}")


def make_namespace() -> Namespace:
    """A new network namespace with `lo` up; OSError saying why where the kernel refuses. Forks a holder child
    that enters it, opens its /proc/<pid>/ns files, then lets the child exit."""
    if not sys.platform.startswith("linux"):
        raise OSError(errno.ENOSYS, "network namespaces are Linux's")
    report_r, report_w = os.pipe()
    release_r, release_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(report_r)
        os.close(release_w)
        _hold_namespace(report_w, release_r)
    os.close(report_w)
    os.close(release_r)
    try:
        with os.fdopen(report_r, "rb") as report:
            answer = report.readline().decode().strip()
        if not answer.startswith("ok"):
            raise OSError(errno.EPERM, answer or "the namespace's holder process ended")
        net_fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        user_fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC) if answer == "ok user" else None
        return Namespace(net_fd, user_fd)
    finally:
        os.close(release_w)  # the holder exits
        os.waitpid(pid, 0)


def _hold_namespace(report_fd: int, release_fd: int) -> None:
    """The holder child: unshare, bring `lo` up, report "ok" or "ok user" (or why not), wait to be released."""
    try:
        answer = "ok user" if _unshare_network() else "ok"
        _bring_loopback_up()
    except BaseException as exc:  # noqa: BLE001 - any failure is the refusal's reason, told to the server
        answer = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    try:
        os.write(report_fd, answer.encode() + b"\n")
        os.read(release_fd, 1)  # end of file: the server has opened our namespace files
    finally:
        os._exit(0)


def _unshare_network() -> bool:
    """Enter a new network namespace; True if a user namespace was needed for it (not root)."""
    libc = _libc()
    if libc.unshare(_CLONE_NEWNET) == 0:
        return False
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
        number = ctypes.get_errno()
        why = _USER_NAMESPACE_REFUSALS.get(number, "unshare(CLONE_NEWUSER | CLONE_NEWNET) failed")
        raise OSError(number, f"{why}: {os.strerror(number)}")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    return True


def _bring_loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        name = b"lo"
        _, flags = struct.unpack(_IFREQ, fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack(_IFREQ, name, 0)))
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack(_IFREQ, name, flags | _IFF_UP))


def enter(namespace: Namespace) -> None:
    """In a freshly forked, single-threaded rank: join `namespace`; in a user namespace, then drop the
    capabilities that joining it gave (setns(2): a process joining a user namespace gets them all there)."""
    libc = _libc()
    if namespace.user_fd is not None:
        _check(libc.setns(namespace.user_fd, _CLONE_NEWUSER), "setns(user namespace)")
    _check(libc.setns(namespace.net_fd, _CLONE_NEWNET), "setns(network namespace)")
    if namespace.user_fd is not None:
        _drop_capabilities(libc)


def _drop_capabilities(libc) -> None:
    header = struct.pack("Ii", _LINUX_CAPABILITY_VERSION_3, 0)
    data = ctypes.create_string_buffer(24)  # two struct __user_cap_data_struct, all zero: no capability
    _check(libc.capset(ctypes.c_char_p(header), data), "capset (dropping the user namespace's capabilities)")


class PoolNetworks:
    """The fork server's namespaces: one per pool (its ranks share the pool's store path), released when the pool's
    last rank has been reaped; a spare made ahead. After one refusal no more are tried: `refusal` says why."""

    def __init__(self):
        self._spare: Namespace | None = None
        self._by_pool: dict[str, Namespace] = {}
        self._pool_of: dict[int, str] = {}  # rank pid -> its pool's store path
        self.refusal: str | None = None

    def make_spare(self) -> bool:
        """Make the spare namespace if there is none; True if one was made (the server's idle work)."""
        if self._spare is not None or self.refusal is not None:
            return False
        try:
            self._spare = make_namespace()
        except OSError as exc:
            self.refusal = exc.strerror or str(exc)
            return False
        return True

    def for_pool(self, pool: str) -> Namespace | None:
        """The namespace of the pool whose store path is `pool`, taking the spare for a new pool; None if refused."""
        if pool not in self._by_pool:
            self.make_spare()
            if self._spare is None:
                return None
            self._by_pool[pool], self._spare = self._spare, None
        return self._by_pool[pool]

    def joined(self, pool: str, pid: int) -> None:
        """Rank `pid` of `pool` has been started in the pool's namespace."""
        self._pool_of[pid] = pool

    def close(self) -> None:
        """Close every namespace's descriptors: in a forked rank, once it has joined its own (the server's are
        its own to release)."""
        for namespace in [self._spare, *self._by_pool.values()]:
            if namespace is not None:
                namespace.close()

    def release_ended(self, running_pids) -> None:
        """Forget ranks no longer in `running_pids`; close the namespaces no rank is left in."""
        for pid in [p for p in self._pool_of if p not in running_pids]:
            del self._pool_of[pid]
        for pool in [p for p in self._by_pool if p not in self._pool_of.values()]:
            self._by_pool.pop(pool).close()
