"""Every listening socket of a set of processes, for the tests of where mpilab listens.

Read from each process's own `/proc/PID/net/tcp` and `tcp6`: those list the sockets of
the process's network namespace, so a process on an emulated host (a namespace of its
own) is seen as it is. psutil's `net_connections` reads the caller's `/proc/net/tcp`,
where a socket of another namespace never appears.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

_LISTEN = "0A"  # the kernel's TCP_LISTEN in /proc/net/tcp's `st` column


@dataclass(frozen=True)
class Listener:
    pid: int
    command: str
    ip: str
    port: int


def listeners_of(root_pid: int) -> list[Listener]:
    """The TCP listeners of `root_pid` and all its descendants."""
    root = psutil.Process(root_pid)
    return listeners_of_pids([root.pid, *(p.pid for p in root.children(recursive=True))])


def listeners_of_pids(pids: Iterable[int]) -> list[Listener]:
    """The TCP listeners of each of `pids` (a process gone meanwhile has none)."""
    found = []
    for pid in pids:
        try:
            command = " ".join(psutil.Process(pid).cmdline())
            inodes = _socket_inodes(pid)
            listening = _listening(pid) if inodes else {}
        except (psutil.Error, OSError):
            continue
        found += [Listener(pid, command, ip, port)
                  for inode, (ip, port) in listening.items() if inode in inodes]
    return found


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    folder = f"/proc/{pid}/fd"
    for fd in os.listdir(folder):
        try:
            target = os.readlink(f"{folder}/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _listening(pid: int) -> dict[str, tuple[str, int]]:
    """inode -> (ip, port) of every listening TCP socket in `pid`'s network namespace."""
    found = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{name}") as table:
                rows = table.read().splitlines()[1:]
        except FileNotFoundError:  # no IPv6 in this kernel
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == _LISTEN:
                found[fields[9]] = _address(fields[1])
    return found


def _address(field: str) -> tuple[str, int]:
    """`0100007F:1F90` (the kernel's hex, each 32-bit word in host byte order) as
    ("127.0.0.1", 8080)."""
    hex_ip, hex_port = field.split(":")
    words = [bytes.fromhex(hex_ip[i:i + 8])[::-1] for i in range(0, len(hex_ip), 8)]
    ip = ipaddress.ip_address(b"".join(words))
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return str(ip), int(hex_port, 16)


def is_hydra(listener: Listener) -> bool:
    """MPICH hydra's control port (mpiexec and its local proxy share one socket): hydra
    binds every interface and has no option to bind one."""
    return "mpiexec" in listener.command.split()[0] or "hydra_pmi_proxy" in listener.command
