"""Compressed DataParallel on the ranks: least squares, y = x·A + noise (A is 32×16: a
matrix for PowerSGD), the full batch split over the ranks, plain SGD, every compression
against uncompressed DataParallel over both paths; what each reports against what the
collectives (MPI) or torch.distributed (DDP) actually sent."""

from __future__ import annotations

from typing import Any

import mpilab
import torch
import torch.distributed as dist
from torch import nn

from .common import error_of, record_agent, report_all, spread, traffic

N, D, OUT = 256, 32, 16


def spy_on_torch(wire: list[int]) -> None:
    """Count the bytes of every all_reduce and all_gather (DDP's hooks call these)."""
    for name in ("all_reduce", "all_gather"):
        setattr(dist, name, _spy(getattr(dist, name), wire))


def _spy(real: Any, wire: list[int]) -> Any:
    def spy(tensor_or_list, tensor=None, *args, **kwargs):
        sent = tensor if tensor is not None else tensor_or_list
        wire.append(sent.numel() * sent.element_size())
        return real(tensor_or_list, *args, **kwargs) if tensor is None else \
            real(tensor_or_list, tensor, *args, **kwargs)
    return spy


def main(ctx: Any, report: Any) -> None:
    records = record_agent()
    wire: list[int] = []
    spy_on_torch(wire)
    g = torch.Generator().manual_seed(5)
    X, A = torch.randn(N, D, generator=g), torch.randn(D, OUT, generator=g)
    Y = X @ A + 0.01 * torch.randn(N, OUT, generator=g)
    mine = slice(ctx.rank * N // 2, (ctx.rank + 1) * N // 2)

    def least_squares(backend: str, compression: Any, steps: int = 150) -> dict:
        torch.manual_seed(1)
        model = mpilab.DataParallel(nn.Linear(D, OUT), backend=backend, compression=compression)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        records.clear()
        wire.clear()
        for _ in range(steps):
            opt.zero_grad()
            ((model(X[mine]) - Y[mine]) ** 2).sum(1).mean().backward()
            opt.step()
        logs = [f["values"] for k, f in records if k == "log"]
        with torch.no_grad():
            loss = ((model(X) - Y) ** 2).sum(1).mean().item()
        return {"loss": loss, "spread": spread(ctx, model), "traffic": traffic(records),
                "wire": sum(wire), "reported": sum(v["bytes_sent"] for v in logs),
                "steps": sum(1 for k, _ in records if k == "step"),
                "ratio": logs[-1]["compression_ratio"] if logs else None}

    out: dict[str, Any] = {}
    for backend in ("mpi", "torch"):
        for name, compression in [("dense", None), ("powersgd", "powersgd"),
                                  ("topk", mpilab.TopK(ratio=0.05))]:
            out[f"{backend}-{name}"] = least_squares(backend, compression)
    out["errors"] = [
        error_of(lambda: mpilab.DataParallel(nn.Linear(2, 2), compression="zip")),
        error_of(lambda: mpilab.DataParallel(nn.Linear(2, 2),
                                             compression=mpilab.TopK(ratio=2))),
    ]
    report_all(ctx, report, out)
