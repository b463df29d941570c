"""The TCP sockets a process listens on, read in the process's own network namespace.

psutil matches a process's sockets against /proc/net/tcp, the table of the reader's namespace, so it finds none of
a rank that has a namespace of its own (labkit/launch/netns.py); /proc/<pid>/net/tcp* is the table of the namespace
process <pid> is in."""
import os
import socket


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed while we look
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _address(hex_address: str, family: int) -> str:
    """/proc/net/tcp*'s address: 32-bit words in the kernel's (little-endian) byte order."""
    raw = bytes.fromhex(hex_address)
    return socket.inet_ntop(family, b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))


def _listeners(pid: int) -> list[tuple[str, int, str]]:
    """(address, port, socket inode) of every TCP socket listening in process `pid`'s network namespace."""
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                (address, port), state, inode = fields[1].split(":"), fields[3], fields[9]
                if state == "0A":  # TCP_LISTEN
                    found.append((_address(address, family), int(port, 16), inode))
    return found


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on."""
    mine = _socket_inodes(pid)
    return [(address, port) for address, port, inode in _listeners(pid) if inode in mine]


def ports_of_others(pids) -> set[int]:
    """The ports listened on in this process's network namespace by processes other than `pids`."""
    theirs = set().union(*map(_socket_inodes, pids))
    return {port for _, port, inode in _listeners(os.getpid()) if inode not in theirs}
