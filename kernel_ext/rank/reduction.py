"""How a tensor is reduced across ranks, defined once: the reduce ops, the dtypes each
transport reduces in, the mean's division, and the two reductions themselves.

Every allreduce of mpilab goes through here: ``mpilab.allreduce`` of one tensor, tensor
fusion of a list (``fusion.grouped_allreduce``), DataParallel's buckets and the
compressors. So a tensor reduced alone, in a list or as a gradient gives the same bits.

- ``allreduce_host``: a contiguous CPU tensor over MPI (mpilab's shared-memory path on
  one node, ``fast_allreduce``), every wait interruptible there.
- ``allreduce_torch``: a contiguous tensor over torch.distributed (NCCL, gloo), its work
  polled with ``waiting.poll`` (``torch_group.wait_work``), so an abort or Ctrl-C lands.

Widening: MPI (and NumPy, which the shared-memory path reduces with) has no bfloat16,
and half-precision sums lose accuracy, so callers that stage a copy anyway
(``mpilab.allreduce``, fusion) stage 16-bit floats as float32: ``host_dtype``. A 16-bit
buffer handed to ``allreduce_host`` as it is (DataParallel's fp16/bf16 compression,
which must send 16 bits) is reduced in its own width: float16 by NumPy, bfloat16 by
gathering every rank's 16-bit words and summing them in float32, in rank order on every
rank, so the ranks agree bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from . import torch_group
from .fast_allreduce import allreduce_inplace, plan_for

REDUCE_OPS = ("sum", "mean", "max", "min")
# what each op sends: a mean is a sum, divided afterwards
WIRE_OP = {"sum": "sum", "mean": "sum", "max": "max", "min": "min"}

# 16-bit floats are reduced in float32 where a staging copy is made anyway
_WIDEN = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
# the dtypes the MPI path reduces through a NumPy view, as they are
NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64,
                torch.float16: np.float16, torch.int32: np.int32, torch.int64: np.int64,
                torch.int8: np.int8, torch.uint8: np.uint8}
HOST_DTYPES = frozenset((*NUMPY_DTYPES, torch.bfloat16))  # what allreduce_host takes


def check_reduce_op(op: str) -> None:
    """One line naming the ops when `op` is not one."""
    if op not in REDUCE_OPS:
        raise ValueError(f"op {op!r} is not one of {', '.join(REDUCE_OPS)}")


def host_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of `dtype` is staged in for the MPI path (16-bit floats widen
    to float32; everything else travels as it is)."""
    return _WIDEN.get(dtype, dtype)


def divide_for_mean(buf: torch.Tensor, world_size: int) -> None:
    """The mean from the sum, in place; integer means round down (like ``//``)."""
    if buf.is_floating_point():
        buf.div_(world_size)
    else:
        buf.div_(world_size, rounding_mode="floor")


def array_mean(world_size: int, floating: bool, dtype: Any) -> Callable[[np.ndarray], None]:
    """divide_for_mean for a NumPy view of a tensor (the per-tensor plans of
    collectives.py): the same rounding, without a torch call per reduction."""
    world = np.dtype(dtype).type(world_size)
    divide = np.divide if floating else np.floor_divide

    def run(array: np.ndarray) -> None:
        divide(array, world, out=array)

    return run


def allreduce_host(buf: torch.Tensor, op: str, comm: Any) -> None:
    """Reduce a contiguous CPU tensor of a HOST_DTYPES dtype in place over `comm` (an
    mpi4py communicator). Every rank gets the same bits."""
    wire_op = WIRE_OP[op]
    with torch.no_grad():  # parameters too: no autograd on the wire
        if buf.dtype == torch.bfloat16:
            _allreduce_bfloat16(buf, wire_op, comm)
        else:
            allreduce_inplace(buf.detach().view(-1).numpy(), wire_op, comm)
        if op == "mean":
            divide_for_mean(buf, comm.Get_size())


def _allreduce_bfloat16(buf: torch.Tensor, op: str, comm: Any) -> None:
    """Gather every rank's 16-bit words (what a 16-bit reduction sends between two
    ranks) and reduce them in float32, in rank order on every rank."""
    flat = buf.detach().view(-1)
    recv = torch.empty((comm.Get_size(), flat.numel()), dtype=torch.bfloat16)
    plan_for(comm).allgather(flat.view(torch.uint8).numpy(),
                             recv.view(torch.uint8).view(-1).numpy())
    wide = recv.float()
    flat.copy_(wide.sum(0) if op == "sum" else wide.amax(0) if op == "max" else wide.amin(0))


def allreduce_torch(buf: torch.Tensor, op: str) -> None:
    """Reduce a contiguous tensor in place over torch.distributed's default group."""
    import torch.distributed as dist

    wire_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
               "min": dist.ReduceOp.MIN}[WIRE_OP[op]]
    with torch.no_grad():
        torch_group.wait_work(dist.all_reduce(buf, op=wire_op, async_op=True))
        if op == "mean":
            divide_for_mean(buf, dist.get_world_size())
