"""Instrumented, interruptible collectives on tensors: allreduce, broadcast, allgather, barrier.

Every call is announced to the rank agent (``agent.collective``) so heartbeats show which
collective a rank is in and the dashboard gets a comm span; every wait polls a
non-blocking request so the notebook's stop button lands within milliseconds.

Two transports: MPI (mpi4py on NumPy views of CPU tensors; GPU tensors are staged
through host memory) and torch.distributed (gloo on CPU, NCCL on GPU). ``backend="auto"``
picks MPI for CPU tensors and torch.distributed for GPU tensors. mpilab's own MPI
traffic runs on a private duplicate of COMM_WORLD, so a user's messages on ``comm``
can never match mpilab's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import agent as agent_mod
from . import bootstrap, waiting
from .fast_allreduce import allreduce_inplace
from .waiting import wait_interruptibly

OPS = ("sum", "mean", "max", "min")
BACKENDS = ("auto", "mpi", "torch")
# MPI has no bfloat16 and half-precision sums lose accuracy: reduce these in float32.
_WIDEN = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
_MPI_DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
               torch.int64, torch.int8, torch.uint8}

# mpilab's own communicators (dups of COMM_WORLD): one for the collectives here, one for
# DataParallel's communication thread (two threads must not share a communicator).
_comms: dict[str, Any] = {}


def _make_comms(interruptible: bool = True) -> None:
    """Create both communicators and their allreduce plans, on every rank together.

    The bootstrap calls this eagerly (through private_comm), so no rank ever blocks in
    creating them later while a failed peer never arrives.
    """
    from .fast_allreduce import plan_for

    world = bootstrap.context().comm
    for name in ("collectives", "data_parallel"):
        if interruptible:
            comm, request = world.Idup()
            wait_interruptibly(request)
        else:
            comm = world.Dup()
        plan_for(comm)
        _comms[name] = comm


def _renew_comms() -> None:
    """Recovery (all ranks present, abort still set): the old ones are out of step."""
    _make_comms(interruptible=False)


def private_comm(name: str = "collectives") -> Any:
    """One of mpilab's communicators: "collectives" or "data_parallel"."""
    if not _comms:
        _make_comms()
        waiting.on_recover(_renew_comms)
    return _comms[name]


def resolve_backend(backend: str, tensor: torch.Tensor | None) -> str:
    """auto → MPI for CPU tensors, torch.distributed (NCCL) for GPU tensors."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    return "torch" if tensor is not None and tensor.device.type != "cpu" else "mpi"


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"op {op!r} is not one of {', '.join(OPS)}")


def _divide(buf: torch.Tensor, world_size: int) -> None:
    """The mean from the sum; integer means round down (as tensor fusion does)."""
    if buf.is_floating_point():
        buf.div_(world_size)
    else:
        buf.div_(world_size, rounding_mode="floor")


def tensor_bytes(tensors: torch.Tensor | Sequence[torch.Tensor]) -> int:
    """The bytes of a tensor, or of a list of tensors."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(t.numel() * t.element_size() for t in tensors)


def _shape(tensor: torch.Tensor) -> str:
    return "x".join(str(s) for s in tensor.shape) or "scalar"


def wait_work(work: Any) -> None:
    """Wait for a torch.distributed Work handle, staying responsive to signals and aborts."""
    waiting.poll(work.is_completed)
    work.wait()  # raises the collective's error, if any


def _host_buffer(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of `dtype` with `tensor`'s values (`tensor` itself if it can)."""
    if tensor.device.type == "cpu" and tensor.dtype == dtype and tensor.is_contiguous():
        return tensor
    return tensor.detach().to(device="cpu", dtype=dtype).contiguous()


def _as_bytes(buf: torch.Tensor) -> Any:
    """A zero-copy uint8 NumPy view (works for every dtype, bfloat16 included)."""
    return buf.detach().view(-1).view(torch.uint8).numpy()


def allreduce(tensor: torch.Tensor | Sequence[torch.Tensor], op: str = "sum",
              backend: str = "auto") -> Any:
    """Reduce `tensor` across ranks in place and return it; a list goes through tensor fusion.

    op: sum | mean | max | min (the mean of integer tensors rounds down).
    """
    bootstrap.context()
    _check_op(op)
    if isinstance(tensor, (list, tuple)):
        from .fusion import grouped_allreduce

        nbytes = tensor_bytes(tensor)
        with agent_mod.current().collective("allreduce", nbytes, f"{len(tensor)} tensors"):
            return grouped_allreduce(list(tensor), op=op, backend=backend, comm=private_comm())
    chosen = resolve_backend(backend, tensor)
    with agent_mod.current().collective("allreduce", tensor_bytes(tensor), _shape(tensor)):
        if chosen == "mpi":
            _mpi_allreduce(tensor, op)
        else:
            _torch_allreduce(tensor, op)
    return tensor


def _mpi_allreduce(tensor: torch.Tensor, op: str) -> None:
    if tensor.dtype not in _MPI_DTYPES:
        raise TypeError(f"allreduce over MPI does not support {tensor.dtype}")
    buf = _host_buffer(tensor, _WIDEN.get(tensor.dtype, tensor.dtype))
    with torch.no_grad():
        array = buf.detach().view(-1).numpy()  # parameters too: no autograd on the wire
        allreduce_inplace(array, "sum" if op == "mean" else op, private_comm())
        if op == "mean":
            _divide(buf, bootstrap.context().world_size)
        if buf is not tensor:
            tensor.copy_(buf)


def _torch_allreduce(tensor: torch.Tensor, op: str) -> None:
    import torch.distributed as dist

    reduce_op = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM,
                 "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    buf = tensor if tensor.is_contiguous() else tensor.contiguous()
    with torch.no_grad():
        wait_work(dist.all_reduce(buf, op=reduce_op, async_op=True))
        if op == "mean":
            _divide(buf, dist.get_world_size())
        if buf is not tensor:
            tensor.copy_(buf)


def broadcast(tensor: torch.Tensor, root: int = 0, backend: str = "auto") -> torch.Tensor:
    """Copy rank `root`'s `tensor` into `tensor` on every rank; returns it."""
    ctx = bootstrap.context()
    if not 0 <= root < ctx.world_size:
        raise ValueError(f"root {root} is not a rank of this {ctx.world_size}-rank cluster")
    chosen = resolve_backend(backend, tensor)
    with agent_mod.current().collective("broadcast", tensor_bytes(tensor), _shape(tensor)), \
            torch.no_grad():
        if chosen == "mpi":
            buf = _host_buffer(tensor, tensor.dtype)
            wait_interruptibly(private_comm().Ibcast(_as_bytes(buf), root=root))
            if buf is not tensor:
                tensor.copy_(buf)
        else:
            import torch.distributed as dist

            buf = tensor if tensor.is_contiguous() else tensor.contiguous()
            wait_work(dist.broadcast(buf, src=root, async_op=True))
            if buf is not tensor:
                tensor.copy_(buf)
    return tensor


def allgather(tensor: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Every rank's `tensor` stacked: a new tensor of shape [world_size, *tensor.shape]."""
    ctx = bootstrap.context()
    chosen = resolve_backend(backend, tensor)
    out = torch.empty((ctx.world_size, *tensor.shape), dtype=tensor.dtype,
                      device=tensor.device)
    with agent_mod.current().collective("allgather", tensor_bytes(tensor), _shape(tensor)), \
            torch.no_grad():
        if chosen == "mpi":
            send = _host_buffer(tensor, tensor.dtype)
            recv = out if out.device.type == "cpu" else torch.empty_like(out, device="cpu")
            wait_interruptibly(private_comm().Iallgather(_as_bytes(send), _as_bytes(recv)))
            if recv is not out:
                out.copy_(recv)
        else:
            import torch.distributed as dist

            wait_work(dist.all_gather(list(out.unbind(0)), tensor.contiguous(),
                                      async_op=True))
    return out


def barrier(backend: str = "auto") -> None:
    """Wait until every rank gets here (MPI unless backend="torch")."""
    bootstrap.context()
    chosen = resolve_backend(backend, None)
    with agent_mod.current().collective("barrier"):
        if chosen == "mpi":
            wait_interruptibly(private_comm().Ibarrier())
        else:
            import torch.distributed as dist

            wait_work(dist.barrier(async_op=True))
