"""The recovery sequence of torch.distributed's group on the ranks: kept when clean,
made again on every rank when a wait was given up (with its collective timeout, and
adopted by torchrun's shared group), always for NCCL, and a plain failure when torch
cannot abort it."""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist
from mpilab.rank import collectives, torch_group, torchrun, waiting
from torch.distributed import distributed_c10d as c10d

from .common import end_without_finalizing, report_all


def main(ctx: Any, report: Any) -> None:

    def total(value):
        t = torch.tensor([float(value)])
        dist.all_reduce(t)
        return t.item()

    out = {"timeout_before": torch_group.group_timeout().total_seconds()}
    # gloo, nothing abandoned: recovery keeps the group
    first = dist.group.WORLD
    waiting.abort("test")
    waiting.recover()
    out["kept_when_clean"] = dist.group.WORLD is first

    # a wait given up on rank 0 (a peer never joined): every rank makes a new group
    if ctx.rank == 0:
        stuck = torch.ones(2)
        threading.Timer(0.3, waiting.abort, args=("peer failed",)).start()
        try:
            collectives.allreduce(stuck, backend="torch")
        except waiting.CollectiveAborted as e:
            out["abandoned"] = str(e)
    ctx.comm.Barrier()
    waiting.recover()
    out["renewed"] = dist.group.WORLD is not first
    out["generation"] = torch_group.torch_group_generation()
    out["sum_after"] = total(ctx.rank + 1)
    out["timeout_after"] = torch_group.group_timeout().total_seconds()
    # torchrun.py's shared group follows: the user's destroy_process_group keeps it
    shared = torchrun.shared_groups()
    out["adopted"] = shared is not None and shared.mpilab_pg is dist.group.WORLD
    dist.destroy_process_group()
    out["kept_by_destroy"] = dist.is_initialized() and total(1) == ctx.world_size

    # an NCCL group is made again after every abort, abandoned or not
    second = dist.group.WORLD
    torch_group.group_backends = lambda: {"cuda": "nccl"}
    waiting.abort("test")
    waiting.recover()
    out["nccl_rule_renewed"] = dist.group.WORLD is not second
    out["generation_nccl"] = torch_group.torch_group_generation()

    # a group torch cannot abort: recovery fails, and the notebook restarts the ranks
    def cannot(group=None):
        raise RuntimeError("abort is not supported by this backend")
    c10d._abort_process_group = cannot
    waiting.abort("test")
    try:
        waiting.recover()
    except torch_group.RecoveryError as e:
        out["cannot"] = str(e)
    report_all(ctx, report, out)
    end_without_finalizing(ctx)
