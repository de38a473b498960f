"""mpilab.allreduce, broadcast, allgather and barrier on the ranks: every dtype, op and
transport, non-contiguous tensors, parameters, a list (tensor fusion), bad input."""

from __future__ import annotations

from typing import Any

import mpilab
import numpy as np
import torch
from mpilab.rank import agent

from .common import error_of, report_all

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int64": torch.int64}


def main(ctx: Any, report: Any) -> None:
    out: dict[str, Any] = {"allreduce": {}, "errors": {}}
    seq0 = agent.current().state.seq
    calls = 0
    for backend in ("mpi", "torch", "auto"):
        for name, dtype in DTYPES.items():
            for op in ("sum", "mean", "max", "min"):
                # rank r holds r + 1 + (position / 4): half-precision exact values
                x = (torch.arange(6, dtype=torch.float64).reshape(2, 3) / 4 + ctx.rank + 1)
                x = x.to(dtype) if dtype.is_floating_point else (x * 4).to(dtype)
                got = mpilab.allreduce(x, op=op, backend=backend)
                calls += 1
                out["allreduce"][f"{backend}/{name}/{op}"] = [
                    got is x, str(got.dtype), got.double().flatten().tolist()]
        # non-contiguous input is reduced in place too
        t = (torch.arange(6.0).reshape(2, 3) + ctx.rank).t()
        mpilab.allreduce(t, backend=backend)
        out[f"{backend}/transposed"] = t.flatten().tolist()
        b = torch.full((3,), float(ctx.rank), dtype=torch.bfloat16)
        out[f"{backend}/broadcast"] = mpilab.broadcast(b, root=1, backend=backend).tolist()
        g = mpilab.allgather(torch.tensor([ctx.rank, 10 * ctx.rank]), backend=backend)
        out[f"{backend}/allgather"] = [list(g.shape), g.tolist()]
        mpilab.barrier(backend="mpi" if backend == "auto" else backend)
        calls += 4
    param = torch.nn.Parameter(torch.ones(3) * (ctx.rank + 1))  # requires_grad: in place too
    mpilab.allreduce(param, op="mean")
    mpilab.broadcast(param, root=1)
    out["param"] = param.tolist()
    calls += 2
    out["seq_counted"] = agent.current().state.seq - seq0 == calls

    out["errors"]["op"] = error_of(lambda: mpilab.allreduce(torch.ones(2), op="avg"))
    out["errors"]["backend"] = error_of(lambda: mpilab.allreduce(torch.ones(2),
                                                                 backend="nccl"))
    odd = mpilab.allreduce(torch.tensor([ctx.rank, -ctx.rank], dtype=torch.int64), op="mean")
    out["int_mean_floor"] = odd.tolist()
    out["errors"]["root"] = error_of(lambda: mpilab.broadcast(torch.ones(2), root=5))
    out["errors"]["bool"] = error_of(lambda: mpilab.allreduce(torch.ones(2, dtype=torch.bool)))
    out["errors"]["root_text"] = error_of(lambda: mpilab.broadcast(torch.ones(2), root="0"))
    at_numpy_root = torch.ones(2) * ctx.rank
    mpilab.broadcast(at_numpy_root, root=np.int64(1))  # any integer type names a rank
    out["numpy_root"] = at_numpy_root.tolist()
    out["errors"]["list"] = error_of(lambda: mpilab.allreduce([1, 2]))
    out["errors"]["array"] = error_of(lambda: mpilab.broadcast(np.ones(2)))
    out["errors"]["out"] = error_of(lambda: mpilab.allgather(torch.ones(2), out=[0, 0]))
    pair = [torch.ones(3) * (ctx.rank + 1), torch.ones(2, 2, dtype=torch.float64)]
    mpilab.allreduce(pair, op="sum")
    out["fused"] = [p.flatten().tolist() for p in pair]
    report_all(ctx, report, out)
