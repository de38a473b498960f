"""Rank bootstrap: MPI, node-local rank, device, torch.distributed, threads, agent.

The same function serves the notebook's engines and batch jobs under mpiexec, so a
training cell written in the notebook runs unchanged as a script. What the rank learns
goes to ``context`` (``mpilab.context()``); the services that start with a rank (mpilab's
communicators, torchrun's environment) are start-up hooks that ``init`` runs last, and
nothing they import imports the bootstrap.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from datetime import timedelta

from ..endpoint import Endpoint, shared_endpoint
from ..wire import COLLECTIVE_TIMEOUT_ENV, DEFAULT_COLLECTIVE_TIMEOUT_S, gpu_spec
from . import agent as agent_mod
from . import torch_group
from .context import BootstrapError, RankContext, context, is_initialized, set_context

__all__ = ["BootstrapError", "RankContext", "context", "init", "is_initialized",
           "parse_gpus", "choose_backend", "gpu_for_rank", "placement_error"]

StartHook = Callable[[RankContext], None]


def parse_gpus(gpus: str | None, available: int) -> list[int]:
    """The GPUs of this node that `gpus` (see mpilab.wire.gpu_spec) names."""
    try:
        chosen = gpu_spec(gpus)
    except ValueError as e:
        raise BootstrapError(str(e)) from None
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
    start_hooks: Sequence[StartHook] | None = None,
) -> RankContext:
    """Bootstrap this rank (idempotent) and return its context.

    Call it once in a script started by ``mpiexec -n N python train.py``; the notebook's
    ``%mpilab start`` calls it on every engine. `timeout` bounds the start (the
    rendezvous); `collective_timeout` is how long torch.distributed's own collectives may
    wait before torch gives up on them (default 30 minutes, or $MPILAB_COLLECTIVE_TIMEOUT):
    in a notebook mpilab's watchdog releases hung ranks long before, and a slow first step
    of a large model must not be taken for a hang. `start_hooks` run last, in order, with
    the context on every rank (default: ``default_start_hooks()``). In a script (no
    notebook), a rank that fails ends the job, a start that cannot work is one line, a
    collective that can never complete or is not reached within `collective_timeout` ends
    the job naming the ranks (batch.py), and at exit the torch.distributed groups end
    before MPI does.
    """
    if is_initialized():
        return context()

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world_size = comm.Get_rank(), comm.Get_size()
    notebook = agent_address or os.environ.get("MPILAB_AGENT")
    if notebook is None:  # a batch script: see batch.py
        from . import batch

        batch.install(comm, rank, world_size)
        apart = batch.launched_apart(world_size)
        if apart:
            raise BootstrapError(apart)
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

    cpus = _cpus()
    threads = max(1, len(cpus) // local_size)
    torch.set_num_threads(threads)

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

    ctx = RankContext(
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
        cpus=cpus,
        endpoint=endpoint,
        store=store,
        store_address=store_address,
    )
    agent = agent_mod.Agent(rank, world_size, notebook)
    if device.type == "cuda":
        agent.device_memory = lambda: torch.cuda.memory_allocated(device)
    agent_mod.install(agent)
    set_context(ctx)
    for hook in default_start_hooks() if start_hooks is None else start_hooks:
        hook(ctx)
    if notebook is None:
        from . import batch

        batch.watch(ctx, collective_timeout)
    from .waiting import on_recover

    on_recover(_align_collective_numbers)
    return ctx


def default_start_hooks() -> list[StartHook]:
    """What starts with every rank: mpilab's communicators, made now on every rank
    together (``collectives.prepare_communicators``: made later, a rank whose peer had
    failed would block in their creation), then torchrun's environment, so code
    written for torchrun runs as it is (``torchrun.install``). Imported here, when a
    rank starts: importing the bootstrap stays light, and neither module imports it."""
    from .collectives import prepare_communicators
    from .torchrun import install

    return [prepare_communicators, install]


def realign() -> list[int] | None:
    """After a cell that ended with an error on some ranks, or ran on some ranks only,
    none left waiting (the watchdog releases those): every rank's collective number
    where they differ, after a recovery as after a stop; else None. All ranks call it
    together.

    Ranks at different numbers mean one finished a collective another never began: a
    broadcast's root does, without its leaves. Left so, the next collectives would pair
    with the wrong calls: a leaf's next broadcast would take the one it missed, and each
    after it one call late, without an error."""
    from .waiting import abort, recover

    numbers = context().comm.allgather(agent_mod.current().state.seq)
    if len(set(numbers)) == 1:
        return None
    abort("the ranks ended the cell at different collectives")
    recover()
    return numbers


def _align_collective_numbers() -> None:
    """After an abort ranks may have started different numbers of collectives; agree on
    the highest so the numbers compare again (all ranks run this in `recover()`)."""
    from mpi4py import MPI

    state = agent_mod.current().state
    state.seq = context().comm.allreduce(state.seq, op=MPI.MAX)
    state.recent.clear()


def _bind_device(torch, gpus, local_rank):
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
    gpu = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None
    line = placement_error(node_comm.allgather(gpu), backend, host)
    first = next((e for e in comm.allgather(line) if e), None)
    if first:
        raise BootstrapError(first)


# ------------------------------------------------------------------------ GPU placement
def gpu_for_rank(local_rank: int, gpus: Sequence[int]) -> int | None:
    """The GPU (an index among the visible ones, CUDA_VISIBLE_DEVICES applied) of the
    node-local rank `local_rank`: one rank per GPU, in order. Where Slurm binds each task
    to its own GPU, every rank sees one and takes it. Ranks past the GPUs wrap around
    and share; placement_error says when that cannot work. None: no GPU (CPU)."""
    if not gpus:
        return None
    return gpus[local_rank % len(gpus)]


def placement_error(gpu_ids: Sequence[str | None], backend: str,
                    host: str = "this node") -> str | None:
    """One line when ranks of one node would share a GPU under NCCL (it refuses two
    ranks on one GPU); None when the placement works.

    gpu_ids: for each node-local rank, the identity (UUID) of the GPU it took, or None
    on CPU. Identities, not indices: with Slurm's per-task binding every rank's GPU is
    its index 0. backend: the torch.distributed backend of the ranks' group; sharing
    GPUs works over gloo (mpilab's collectives then stage GPU tensors through MPI).
    """
    cuda_backend = torch_group.device_backends(backend).get("cuda") if backend else None
    if cuda_backend in (None, "gloo"):
        return None
    users: dict[str, list[int]] = {}
    for local_rank, gpu in enumerate(gpu_ids):
        if gpu is not None:
            users.setdefault(gpu, []).append(local_rank)
    shared = next((ranks for ranks in users.values() if len(ranks) > 1), None)
    if shared is None:
        return None
    ranks, gpus = sum(len(r) for r in users.values()), len(users)
    return (f"{ranks} ranks on {host} but {gpus} GPU{'s' if gpus != 1 else ''} for them "
            f"(node-local ranks {shared[0]} and {shared[1]} would share one), and "
            f"{cuda_backend.upper()} cannot put two ranks on one GPU: start at most {gpus} "
            f"rank{'s' if gpus != 1 else ''} per node, or share the GPUs over gloo and "
            "MPI with --backend gloo")


def _cpus() -> tuple[int, ...]:
    """The CPUs this process may run on: its affinity (a Slurm or mpiexec binding, a
    container's cpuset), else every CPU."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:
        return tuple(range(os.cpu_count() or 1))


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
    before = torch_group.open_sockets() if backend == "gloo" else None
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=collective_timeout), **eager)
    if before is not None:
        torch_group.note_connections(before, address[1])
    return store, address
