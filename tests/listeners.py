"""Every listening socket of a process tree, for the tests of where mpilab listens."""

from __future__ import annotations

from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class Listener:
    pid: int
    command: str
    ip: str
    port: int


def listeners_of(root_pid: int) -> list[Listener]:
    """The TCP listeners of `root_pid` and all its descendants."""
    root = psutil.Process(root_pid)
    found = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            command = " ".join(proc.cmdline())
            connections = proc.net_connections("inet")
        except psutil.Error:
            continue
        found += [Listener(proc.pid, command, c.laddr.ip, c.laddr.port)
                  for c in connections if c.status == psutil.CONN_LISTEN]
    return found


def is_hydra(listener: Listener) -> bool:
    """MPICH hydra's control port (mpiexec and its local proxy share one socket): hydra
    binds every interface and has no option to bind one."""
    return "mpiexec" in listener.command.split()[0] or "hydra_pmi_proxy" in listener.command
