"""What a bootstrapped rank knows about itself, and the one place that holds it.

Light to import (no torch, no MPI): the collectives, the strategies and the bootstrap
read the context from here, so none of them imports another to learn the rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..endpoint import Endpoint


class BootstrapError(RuntimeError):
    """The rank could not be set up; the message says what to do."""


@dataclass
class RankContext:
    """What a rank knows about itself once bootstrapped."""

    rank: int
    world_size: int
    local_rank: int
    local_size: int
    host: str
    device: Any  # torch.device
    backend: str  # torch.distributed's backend of the ranks' group (nccl, gloo)
    comm: Any  # mpi4py COMM_WORLD, for the user
    node_comm: Any  # ranks sharing this node (COMM_TYPE_SHARED)
    torch_threads: int
    cpus: tuple[int, ...] = ()  # the CPUs this process may run on (its affinity)
    endpoint: Endpoint | None = None  # where this rank listens for its peers
    store: Any = None  # torch.distributed's TCPStore of the default group (None: not ours)
    store_address: tuple[str, int] | None = None  # (address, port) of that store

    def summary(self) -> dict:
        """Plain data for the notebook's start line and status table."""
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "host": self.host,
            "pid": os.getpid(),
            "device": str(self.device),
            "backend": self.backend,
            "torch_threads": self.torch_threads,
            "cpus": list(self.cpus),
        }


_context: list[RankContext | None] = [None]


def context() -> RankContext:
    """The bootstrapped context; a clear error when there is none."""
    ctx = _context[0]
    if ctx is None:
        raise BootstrapError(
            "mpilab is not initialised on this process: start ranks with `%mpilab start` "
            "in the notebook, or call mpilab.init() in a script run under mpiexec"
        )
    return ctx


def is_initialized() -> bool:
    return _context[0] is not None


def set_context(ctx: RankContext) -> None:
    """The bootstrap's last step: from now on this process is a rank."""
    _context[0] = ctx
