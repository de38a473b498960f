"""Where a rank listens for its peers: the address and interface of the network the
ranks share. Both sides use it: the notebook to choose where its controller and record
channel listen, the ranks to choose where they listen for each other. Standard library
only, light to import: the engine's supervisor uses it before the engine starts."""

from __future__ import annotations

import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class Endpoint:
    """Where this rank listens: an address and the interface that holds it."""

    address: str
    interface: str


LOOPBACK = Endpoint("127.0.0.1", "lo")


def shared_endpoint(local_size: int, world_size: int, notebook: str | None) -> Endpoint:
    """The address (and its interface) on the network the ranks share.

    Everything the ranks open for each other (torch.distributed's store, gloo's and
    NCCL's sockets) listens there and nowhere else: the loopback when every rank is on
    this node; else the interface this host routes through towards the notebook (the
    ranks and the notebook share that network), or, in a batch job without a notebook,
    the address this host's name resolves to.
    """
    if local_size == world_size:
        return LOOPBACK
    address = route_source(notebook) if notebook else None
    if address is None:
        try:
            address = socket.gethostbyname(socket.gethostname())
        except OSError as e:
            raise OSError(
                f"this host's name {socket.gethostname()!r} does not resolve ({e}): the ranks "
                "need an address the other hosts reach") from None
    interface = interface_of(address)
    if interface is None:
        raise OSError(f"no interface of this host holds {address}; set the host's name to "
                      "resolve to its address on the cluster network")
    return Endpoint(address, interface)


def route_source(url: str) -> str | None:
    """The local address the kernel routes through towards `url` (tcp://IP:PORT or IP).

    A UDP connect sends nothing; it only asks the routing table.
    """
    host = url.rsplit("//", 1)[-1]
    host = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    if host.startswith("127."):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 1))
            return s.getsockname()[0]
        except OSError:
            return None


def interface_of(address: str) -> str | None:
    """The name of the interface that holds `address` (gloo, NCCL and UCX take names)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addresses):
            return name
    return None
