"""The ranks' torch.distributed group: which transport a tensor takes, waiting on the
group's work, and making the group again after an abort.

Transport: a collective's ``backend`` argument names it: "mpi" (mpilab's MPI path,
shared memory on one node), "torch" (torch.distributed: NCCL on GPUs, gloo on CPUs) or
"auto", which picks torch.distributed for a GPU tensor when the ranks' group runs a
GPU backend on it (NCCL), and MPI otherwise: for CPU tensors (mpilab's shared-memory
path beats gloo), and for GPU tensors of ranks that share GPUs over gloo.

Recovery: after an abort (``waiting.recover``), the group is aborted and made again on
every rank when it may hold a broken collective: always for NCCL (a user's direct call
may have left one queued on the GPU), and for gloo when a wait on it was abandoned. A
group torch cannot abort makes the recovery fail, and the notebook then restarts the
ranks.
"""

from __future__ import annotations

import functools
import inspect
from datetime import timedelta
from typing import Any

from . import waiting
from .context import context

TRANSPORTS = ("auto", "mpi", "torch")


# ------------------------------------------------------------------ choosing a transport
@functools.lru_cache(maxsize=16)
def device_backends(backend: str) -> dict[str, str]:
    """The backend serving each device type in a group of `backend`: 'nccl' →
    {'cuda': 'nccl'}, 'gloo' → {'cpu': 'gloo', 'cuda': 'gloo'}, 'cpu:gloo,cuda:nccl' as
    written."""
    from torch.distributed import distributed_c10d as c10d

    return dict(c10d.BackendConfig(c10d.Backend(backend)).get_device_backend_map())


def group_backends() -> dict[str, str]:
    """What the ranks' default torch.distributed group runs on each device type ({}
    without one)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return {}
    return device_backends(str(dist.get_backend()))


def auto_transport(device_type: str, backends: dict[str, str]) -> str:
    """"torch" where the group runs a device backend on `device_type` (NCCL on CUDA):
    the GPU's own interconnect, no host staging. "mpi" otherwise: CPU tensors (mpilab's
    shared-memory allreduce), and GPU tensors of a gloo group (GPUs shared by ranks),
    staged through pinned memory."""
    if device_type == "cpu":
        return "mpi"
    chosen = backends.get(device_type)
    return "torch" if chosen is not None and chosen != "gloo" else "mpi"


def check_transport(backend: str) -> None:
    """One line naming the transports when `backend` is not one."""
    if backend not in TRANSPORTS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(TRANSPORTS)}")


def resolve_transport(backend: str, tensor: Any) -> str:
    """auto → see auto_transport (a barrier, with no tensor, goes over MPI)."""
    check_transport(backend)
    if backend != "auto":
        return backend
    if tensor is None or tensor.device.type == "cpu":
        return "mpi"
    return auto_transport(tensor.device.type, group_backends())


# ------------------------------------------------------------------ waiting on its work
# A wait on a torch.distributed work was given up since the last recovery: its group
# may hold a collective the peers never joined.
_abandoned = [False]
_generation = [0]  # groups that recovery made; DataParallel rebuilds DDP when it moves


def abandoned_torch_work() -> None:
    """Note that this rank gave up waiting on a torch.distributed work (see recovery)."""
    _abandoned[0] = True


def torch_group_generation() -> int:
    """How many times recovery made the torch.distributed group again (DDP holds the
    group it was made with, so a wrapper made before must be made again)."""
    return _generation[0]


def wait_work(work: Any) -> None:
    """Wait for a torch.distributed Work handle, staying responsive to signals and aborts."""
    try:
        waiting.poll(work.is_completed)
    except BaseException:
        abandoned_torch_work()
        raise
    work.wait()  # raises the collective's error, if any


# ------------------------------------------------------------------ at exit
# How long the exit releases the GIL for threads of groups that outlive their destroy.
EXIT_SETTLE_S = 0.05


def release_at_exit() -> None:
    """End this rank's torch.distributed groups while Python still runs (a batch
    script's ``atexit``, batch.py; it runs before MPI is finalized; the notebook's
    ranks are ended by their supervisors and never get here).

    Why: a gloo worker thread lets go of a finished collective's tensors after the
    caller has seen it complete, and that takes the GIL. If the interpreter is already
    finalizing, the thread is ended inside C++ code that may not be unwound, and the
    process aborts ("terminate called without an active exception", SIGABRT; mpiexec
    reports the job failed): about half of all 2- and 3-rank batch jobs that ended right
    after a gloo collective, with torch's own scripts as with mpilab's (mpilab keeps its
    group through the user's ``destroy_process_group``, so a script that destroys it
    could not avoid this). Destroying a group joins its threads; a group the script
    still holds (a DDP model in its globals) outlives the destroy, so the GIL is then
    released for a moment, which lets its threads finish. NCCL warns at exit unless
    the group was destroyed. A group holding a wait this rank gave up on is left as
    it is: destroying it would wait for a collective its peers may never join.
    """
    import sys
    import time

    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or _abandoned[0]:
        return
    from . import torchrun

    torchrun.uninstall()  # torch's destroy, and torchrun.py keeps no group alive
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the process is ending; nothing is left to tell
            pass
    time.sleep(EXIT_SETTLE_S)


# ------------------------------------------------------------------ a script's end
# The TCP connections of the ranks' gloo group to its peers, as (fd, "socket:[inode]"):
# noted when the bootstrap makes the group, shut by a batch script's exit.
_connections: list[tuple[int, str]] = []


def open_sockets() -> dict[int, str]:
    """This process's sockets, fd → "socket:[inode]" ({} where there is no /proc)."""
    import os

    sockets = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return {}
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile, or the listing's own fd
        if link.startswith("socket:"):
            sockets[int(name)] = link
    return sockets


def note_connections(before: dict[int, str], store_port: int) -> None:
    """Keep the TCP connections this process opened since `before` (taken just before
    the gloo group was made), other than the rendezvous store's (`store_port`, an end
    of every store connection): gloo connects every pair of ranks as the group is made."""
    import os
    import socket

    for fd, link in open_sockets().items():
        if before.get(fd) == link:
            continue
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                if sock.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                ports = (sock.getsockname()[1], sock.getpeername()[1])
        except OSError:
            continue  # a listening socket (no peer), or one gone meanwhile
        if store_port not in ports:
            _connections.append((fd, link))


def disconnect_peers() -> None:
    """Shut this rank's connections in the ranks' gloo group, as its process's exit would.

    Why: a batch script's rank that ended waits at exit for the others with its process
    alive (batch.py). A peer waiting for it in a torch.distributed collective (DDP's
    step on a rank whose data lasted one batch longer, a ``dist.all_reduce`` that only
    some ranks call) would wait until the collective timeout, 30 minutes, where under
    torchrun the ended process's sockets close and gloo fails the peer's wait at once
    ("Connection closed by peer"). Torch has no call for it: destroying or aborting a
    group keeps its connections while anything holds the group, and DDP does. Data
    already sent still arrives (a shutdown sends what is queued before the end).
    """
    import os
    import socket

    while _connections:
        fd, link = _connections.pop()
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != link:
                continue  # the group closed it and the number now names something else
            with socket.socket(fileno=os.dup(fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            continue


# ------------------------------------------------------------------ after an abort
class RecoveryError(RuntimeError):
    """The ranks' torch.distributed group cannot be made usable again: restart them."""


def needs_new_group(backends: dict[str, str], abandoned_anywhere: bool) -> bool:
    """Must recovery make the torch.distributed group again?

    NCCL (any device backend but gloo): always. Its collectives run on the GPU behind
    the host's back, so a rank whose host code was released may still have one queued
    that its peers never join (a direct ``dist.all_reduce`` returns at once), and
    nothing tells which. gloo: only when some rank abandoned a wait on it; a direct
    gloo call blocks its rank, which the notebook restarts instead.
    """
    if not backends:
        return False
    return abandoned_anywhere or any(b != "gloo" for b in backends.values())


def group_timeout(pg: Any = None) -> timedelta | None:
    """The collective timeout `pg` (default: the default group) was made with."""
    import torch
    from torch.distributed import distributed_c10d as c10d

    pg = pg if pg is not None else c10d._get_default_group()
    for device_type in getattr(pg, "_device_types", ()):
        backend = pg._get_backend(torch.device(device_type))
        timeout = getattr(getattr(backend, "options", None), "_timeout", None)
        if timeout is not None:
            return timeout
    return None


def recover_group(comm: Any) -> None:
    """Recovery (every rank, after mpilab's communicators were made again): decide
    together over `comm` whether the group must be made again, then do it."""
    from mpi4py import MPI

    backends = group_backends()
    anywhere = comm.allreduce(int(_abandoned[0]), op=MPI.MAX)
    if needs_new_group(backends, bool(anywhere)):
        renew_torch_group()
    _abandoned[0] = False


def renew_torch_group() -> None:
    """Abort every torch.distributed group of this rank and make the ranks' group
    again, over mpilab's store under a new prefix, with the same collective timeout
    (collective: every rank calls it, as recovery does).

    Aborting is what releases a collective stuck on the GPU (ncclCommAbort); the new
    communicator shares nothing with the old one. Groups the user made with
    ``new_group`` go too and must be made again.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    ctx = context()
    backend = str(dist.get_backend())
    if ctx.store is None:
        raise RecoveryError(
            f"torch.distributed's {backend} group was not made by mpilab, so it cannot be "
            "made again here: the ranks must be restarted")
    timeout = group_timeout()
    try:
        c10d._abort_process_group()
    except Exception as e:  # noqa: BLE001 - a group torch cannot abort: restart
        raise RecoveryError(
            f"torch {torch.__version__} cannot abort its {backend} group ({e}): the ranks "
            "must be restarted") from e
    _generation[0] += 1
    store = dist.PrefixStore(f"mpilab-recovered/{_generation[0]}/", ctx.store)
    # torch's own init: torchrun.py's stand-in would treat this as the user's call
    init = inspect.unwrap(c10d.init_process_group)
    kwargs: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
    if ctx.device.type == "cuda":
        kwargs["device_id"] = ctx.device  # the communicator now, while every rank is here
    init(ctx.backend, store=store, rank=ctx.rank, world_size=ctx.world_size, **kwargs)
    _adopt(c10d._get_default_group())


def _adopt(pg: Any) -> None:
    """torchrun.py's shared group is the new one (the user's destroy_process_group
    must keep it, as it kept the bootstrap's)."""
    from torch.distributed import distributed_c10d as c10d

    from . import torchrun

    groups = torchrun.shared_groups()
    if groups is not None:
        groups.mpilab_pg = pg
        groups.stand_in = None
        groups.before_user = set(c10d._world.pg_map)
