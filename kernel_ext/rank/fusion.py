"""Tensor fusion (Horovod's idea): many small allreduces become a few large ones.

Why: every allreduce pays a fixed latency (a barrier, a rendezvous) that dwarfs the
copy for small tensors, and a model has hundreds of them. Packing them into one
buffer of up to `threshold` bytes pays the latency once and streams at bandwidth.

Every rank must pass the same list (same order, shapes and dtypes): the buckets, and
so the collectives, are derived from it deterministically.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import torch

from . import reduction, torch_group, waiting
from .context import context
from .host_memory import kept_zeros

# Horovod's default; MPILAB_FUSION_THRESHOLD (bytes) or the threshold argument change it.
FUSION_THRESHOLD_BYTES = int(os.environ.get("MPILAB_FUSION_THRESHOLD", 64 << 20))

_buffers = threading.local()  # per thread: one fused buffer per (device, dtype), reused


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    op: str = "sum",
    backend: str = "auto",
    threshold: int | None = None,
    comm=None,
) -> list[torch.Tensor]:
    """Allreduce every tensor in place with few collectives; returns the tensors
    (torch tensors: mpilab.allreduce, the caller, checks them with
    collectives.check_tensor_argument).

    op: sum | mean | max | min (mean of integer tensors rounds down, like `//`).
    backend: "mpi" (reduction.allreduce_host on host buffers: the shared-memory path on
    one node; GPU tensors are packed into pinned memory), "torch" (reduction.allreduce_torch
    on the fused buffer: NCCL on GPUs, gloo on CPUs), or "auto" (torch for GPU tensors
    where the ranks' group runs NCCL on them, mpi otherwise: torch_group.auto_transport).
    comm: the MPI communicator of the mpi backend (default: the bootstrap's COMM_WORLD).
    """
    reduction.check_reduce_op(op)
    torch_group.check_transport(backend)
    tensors = list(tensors)
    limit = FUSION_THRESHOLD_BYTES if threshold is None else int(threshold)
    if limit <= 0:
        raise ValueError(f"fusion threshold must be positive bytes, not {limit}")
    backends = torch_group.group_backends() if backend == "auto" else {}
    plans = [_plan(t, backend, backends) for t in tensors]
    if any(p[0] == "mpi" for p in plans) and comm is None:
        comm = context().comm
    with torch.no_grad():  # parameters (requires_grad) are reduced in place too
        for kind, device, wire, members in _buckets(tensors, plans, limit):
            _reduce_bucket([tensors[i] for i in members], kind, device, wire, op, comm)
    return tensors


def _plan(t: torch.Tensor, backend: str, backends: dict[str, str] | None = None,
          ) -> tuple[str, torch.device, torch.dtype]:
    """(transport, buffer device, wire dtype) of one tensor; `backends`: what the ranks'
    group runs on each device type (torch_group.group_backends), for "auto"."""
    if t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"allreduce of {t.dtype} tensors is not supported")
    kind = backend if backend != "auto" else torch_group.auto_transport(t.device.type,
                                                                        backends or {})
    if kind == "mpi":
        return kind, torch.device("cpu"), reduction.host_dtype(t.dtype)
    return kind, t.device, t.dtype


def _buckets(tensors, plans, limit):
    """Greedy packing in list order per (transport, device, dtype); yields in a fixed order."""
    open_: dict[tuple, tuple[list[int], int]] = {}
    for i, (t, key) in enumerate(zip(tensors, plans)):
        nbytes = t.numel() * key[2].itemsize
        members, used = open_.get(key, ([], 0))
        if members and used + nbytes > limit:
            yield (*key, members)
            members, used = [], 0
        open_[key] = (members + [i], used + nbytes)
    for key, (members, _) in open_.items():
        yield (*key, members)


def _fused(device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A reused buffer: allocating (and page-faulting) 64 MiB per call costs ~10 ms."""
    cache = getattr(_buffers, "cache", None)
    if cache is None:
        cache = _buffers.cache = {}
    buf = cache.get((device, dtype))
    if buf is None or buf.numel() < numel:
        buf = cache[(device, dtype)] = kept_zeros(numel, dtype, device)
    return buf[:numel]


def _reduce_bucket(members, kind, device, wire, op, comm) -> None:
    numel = sum(t.numel() for t in members)
    if numel == 0:
        return
    single = members[0]
    packed = not (len(members) == 1 and single.is_contiguous() and single.dtype == wire
                  and single.device == device)
    # GPU tensors reduced over MPI: packed into pinned memory without blocking, waited
    # for interruptibly; a fresh pinned buffer each time, which torch's caching host
    # allocator keeps until the copies back into the tensors have run
    staged = sorted({t.device for t in members if t.device != device}, key=str)
    if not packed:
        buf = single.view(-1)  # one tensor already in wire form: no pack, no unpack
    else:
        buf = _fused(device, wire, numel) if not staged else \
            torch.empty(numel, dtype=wire, pin_memory=True)
        offset = 0
        for t in members:
            buf[offset : offset + t.numel()].copy_(t.reshape(-1), non_blocking=bool(staged))
            offset += t.numel()
        for source in staged:
            waiting.wait_device(source)
    if kind == "mpi":
        reduction.allreduce_host(buf, op, comm)
    else:
        reduction.allreduce_torch(buf, op)
    if packed:
        offset = 0
        for t in members:
            t.copy_(buf[offset : offset + t.numel()].view_as(t),
                    non_blocking=t.device.type != "cpu")
            offset += t.numel()

