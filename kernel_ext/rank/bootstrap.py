"""Rank bootstrap: MPI, node-local rank, device, torch.distributed, threads, agent.

The same function serves the notebook's engines and batch jobs under mpiexec, so a
training cell written in the notebook runs unchanged as a script.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..wire import COLLECTIVE_TIMEOUT_ENV, DEFAULT_COLLECTIVE_TIMEOUT_S
from . import agent as agent_mod
from .endpoint import Endpoint, shared_endpoint


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
    backend: str
    comm: Any  # mpi4py COMM_WORLD, for the user
    node_comm: Any  # ranks sharing this node (COMM_TYPE_SHARED)
    torch_threads: int
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
        }


_context: RankContext | None = None


def context() -> RankContext:
    """The bootstrapped context; a clear error when there is none."""
    if _context is None:
        raise BootstrapError(
            "mpilab is not initialised on this process: start ranks with `%mpilab start` "
            "in the notebook, or call mpilab.init() in a script run under mpiexec"
        )
    return _context


def is_initialized() -> bool:
    return _context is not None


def gpu_spec(gpus: str | None) -> list[int] | None:
    """`auto` → None (whatever the node has), `none` → [], `0,2` → [0, 2]; checked before
    the ranks start, so a typo is one line rather than a failed start."""
    spec = (gpus or "auto").strip().lower()
    if spec == "auto":
        return None
    if spec == "none":
        return []
    try:
        chosen = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        chosen = []
    if not chosen or any(g < 0 for g in chosen):
        raise BootstrapError(f"--gpus {gpus!r} is not auto, none or a list like 0,1")
    return chosen


def parse_gpus(gpus: str | None, available: int) -> list[int]:
    """The GPUs of this node that `gpus` (see gpu_spec) names."""
    chosen = gpu_spec(gpus)
    if chosen is None:
        return list(range(available))
    bad = [g for g in chosen if g >= available]
    if bad:
        has = f"has {available}" if available else "has none: use --gpus auto or none"
        raise BootstrapError(f"--gpus names GPU {bad[0]} but this node {has}")
    return chosen


def choose_backend(requested: str, device_type: str) -> str:
    requested = (requested or "auto").lower()
    if requested == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    if requested not in ("nccl", "gloo"):
        raise BootstrapError(f"backend {requested!r} is not auto, nccl or gloo")
    if requested == "nccl" and device_type != "cuda":
        raise BootstrapError("backend nccl needs GPUs; use --backend gloo on CPU ranks")
    return requested


def init(
    gpus: str | None = "auto",
    backend: str = "auto",
    agent_address: str | None = None,
    timeout: float = 120.0,
    collective_timeout: float | None = None,
) -> RankContext:
    """Bootstrap this rank (idempotent) and return its context.

    Call it once in a script started by ``mpiexec -n N python train.py``; the notebook's
    ``%mpilab start`` calls it on every engine. `timeout` bounds the start (the
    rendezvous); `collective_timeout` is how long torch.distributed's own collectives may
    wait before torch gives up on them (default 30 minutes, or $MPILAB_COLLECTIVE_TIMEOUT):
    mpilab's watchdog releases hung ranks long before, and a slow first step of a large
    model must not be taken for a hang.
    """
    global _context
    if _context is not None:
        return _context

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world_size = comm.Get_rank(), comm.Get_size()
    node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = node_comm.Get_rank(), node_comm.Get_size()
    host = socket.gethostname()

    import torch
    import torch.distributed as dist

    device, error = _bind_device(torch, gpus, local_rank)
    # Everyone learns about a bad --gpus at once rather than hanging in rendezvous.
    errors = comm.allgather(error)
    first = next((e for e in errors if e), None)
    if first:
        raise BootstrapError(first)
    chosen_backend = choose_backend(backend, device.type)
    _check_placement(torch, comm, node_comm, device, chosen_backend, host)
    if collective_timeout is None:
        collective_timeout = float(os.environ.get(COLLECTIVE_TIMEOUT_ENV)
                                   or DEFAULT_COLLECTIVE_TIMEOUT_S)

    cores = _cores()
    threads = max(1, cores // local_size)
    torch.set_num_threads(threads)

    notebook = agent_address or os.environ.get("MPILAB_AGENT")
    try:
        endpoint = shared_endpoint(local_size, world_size, notebook)
    except OSError as e:
        raise BootstrapError(str(e)) from None
    _pin_transports(endpoint)
    store, store_address = None, None
    if not dist.is_initialized():
        store, store_address = _init_process_group(
            dist, comm, chosen_backend, rank, world_size, endpoint, timeout,
            collective_timeout, device)

    _context = RankContext(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_size=local_size,
        host=host,
        device=device,
        backend=chosen_backend,
        comm=comm,
        node_comm=node_comm,
        torch_threads=threads,
        endpoint=endpoint,
        store=store,
        store_address=store_address,
    )
    agent = agent_mod.Agent(rank, world_size, notebook)
    if device.type == "cuda":
        agent.device_memory = lambda: torch.cuda.memory_allocated(device)
    agent_mod.install(agent)
    _prepare_communicators()
    from .torchrun import install  # torchrun's environment: code written for it runs as is
    install(_context)
    return _context


def _prepare_communicators() -> None:
    """Make mpilab's own communicator and its shared-memory plan now, on every rank.

    Made lazily, a rank whose peer failed before its first collective would block in
    their creation (a blocking, uninterruptible MPI call) instead of in a wait mpilab
    can release.
    """
    from .collectives import private_comm
    from .waiting import on_recover

    private_comm()  # makes the communicators and their allreduce plans
    on_recover(_align_collective_numbers)


def _align_collective_numbers() -> None:
    """After an abort ranks may have started different numbers of collectives; agree on
    the highest so the numbers compare again (all ranks run this in `recover()`)."""
    from mpi4py import MPI

    state = agent_mod.current().state
    state.seq = context().comm.allreduce(state.seq, op=MPI.MAX)
    state.recent.clear()


def _bind_device(torch, gpus, local_rank):
    from .collectives import gpu_for_rank

    try:
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        chosen = parse_gpus(gpus, available)
    except BootstrapError as e:
        return torch.device("cpu"), str(e)
    if not chosen:
        return torch.device("cpu"), None
    index = gpu_for_rank(local_rank, chosen)
    torch.cuda.set_device(index)
    return torch.device("cuda", index), None


def _check_placement(torch, comm, node_comm, device, backend: str, host: str) -> None:
    """Every rank learns at once when the node's ranks cannot share its GPUs this way."""
    from .collectives import placement_error

    gpu = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None
    line = placement_error(node_comm.allgather(gpu), backend, host)
    first = next((e for e in comm.allgather(line) if e), None)
    if first:
        raise BootstrapError(first)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _pin_transports(endpoint: Endpoint) -> None:
    """gloo and NCCL open their sockets on this interface only (they read these once,
    when their first process group is made)."""
    os.environ["GLOO_SOCKET_IFNAME"] = endpoint.interface
    os.environ["NCCL_SOCKET_IFNAME"] = endpoint.interface


def _listening_socket(address: str) -> socket.socket:
    """A socket listening on `address` alone, on a free port, for the store's server
    (torch's TCPStore itself would listen on every interface)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((address, 0))
    sock.listen(1024)
    return sock


def _init_process_group(dist, comm, backend, rank, world_size, endpoint, timeout,
                        collective_timeout, device):
    """Rank 0 opens the store on its endpoint and broadcasts where over MPI: no guessing.

    Returns the store and its (address, port); the store's server lives as long as the
    store object, which the rank context keeps. With NCCL the communicator is made now,
    while every rank is here (`device_id`), not in the first collective, where a failed
    peer would leave the others blocked in NCCL's setup, which nothing interrupts.
    """
    wait = timedelta(seconds=timeout)
    address = None
    store = None
    if rank == 0:
        try:
            listener = _listening_socket(endpoint.address)
            port = listener.getsockname()[1]
            store = dist.TCPStore(endpoint.address, port, world_size, is_master=True,
                                  timeout=wait, wait_for_workers=False,
                                  master_listen_fd=listener.detach())
            address = (endpoint.address, port)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            address = ("error", f"rank 0 could not open the rendezvous store on "
                                f"{endpoint.address}: {e}")
    address = comm.bcast(address, root=0)
    if address[0] == "error":
        raise BootstrapError(address[1])
    if store is None:
        store = dist.TCPStore(address[0], address[1], world_size, is_master=False, timeout=wait)
    eager = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=collective_timeout), **eager)
    return store, address
