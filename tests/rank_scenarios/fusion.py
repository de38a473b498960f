"""grouped_allreduce on the ranks: every dtype, op and transport, shapes from one
element to several buckets, a parameter and a non-contiguous tensor reduced in place.
Each rank reports the cases that failed."""

from __future__ import annotations

from typing import Any

import torch
from mpilab.rank.fusion import grouped_allreduce

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64]
SHAPES = [(1,), (3,), (17, 5), (1000,), (64, 1025), (300_001,)]


def value(rank: int, numel: int) -> torch.Tensor:
    i = torch.arange(numel, dtype=torch.int64)
    return (i * 7 + rank * 13) % 17 - 8


def main(ctx: Any, report: Any) -> None:
    n, r = ctx.world_size, ctx.rank

    def expected(numel: int, op: str) -> torch.Tensor:
        parts = torch.stack([value(q, numel) for q in range(n)])
        return {"sum": parts.sum(0), "max": parts.max(0).values, "min": parts.min(0).values,
                "mean": parts.sum(0).double() / n}[op]

    failures = []
    for backend in ("mpi", "torch"):
        for op in ("sum", "mean", "max", "min"):
            tensors, wants = [], []
            for dt in DTYPES:
                for shape in SHAPES:
                    numel = torch.Size(shape).numel()
                    tensors.append(value(r, numel).to(dt).reshape(shape))
                    want = expected(numel, op)
                    if op == "mean" and not dt.is_floating_point:
                        want = torch.div(expected(numel, "sum"), n, rounding_mode="floor")
                    wants.append(want.reshape(shape))
            # a parameter (requires_grad) and a non-contiguous tensor are reduced in place too
            tensors.append(torch.nn.Parameter(value(r, 9).float()))
            wants.append(expected(9, op))
            base = value(r, 200).float().reshape(10, 20)
            tensors.append(base.t())
            wants.append(expected(200, op).reshape(10, 20).t())
            out = grouped_allreduce(tensors, op=op, backend=backend, threshold=1 << 20)
            assert out is not tensors and all(a is b for a, b in zip(out, tensors))
            for t, want in zip(tensors, wants):
                tol = {torch.float16: 1e-3, torch.bfloat16: 1e-2}.get(t.dtype, 1e-6)
                ok = torch.allclose(t.double(), want.double(), rtol=tol, atol=tol)
                if op != "mean":
                    ok = torch.equal(t.double(), want.double())
                if not ok:
                    failures.append(f"{backend} {op} {t.dtype} {tuple(t.shape)}")
            if not base.t().data_ptr() == tensors[-1].data_ptr():
                failures.append("non-contiguous tensor replaced")
    for q in range(n):
        if q == r:
            report(failures)
        ctx.comm.Barrier()
