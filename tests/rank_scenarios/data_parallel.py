"""DataParallel on the ranks: every variant (buckets, no_sync, fp16, bf16) over both
paths (MPI, with and without a communication thread; DDP) trains K steps of plain SGD
with batch B per rank, compared with one process training on the same 2B samples per
step (computed on each rank locally). Then rewrapping, a bfloat16 model, an unused
parameter."""

from __future__ import annotations

from typing import Any

import mpilab
import torch
from mpilab.rank import agent, data_parallel
from torch import nn

from .common import error_of, record_agent, report_all

K, B = 4, 8
LOSS = nn.CrossEntropyLoss()
VARIANTS = [("plain", {}, False), ("buckets", {"bucket_mb": 0.002}, False),
            ("no_sync", {"bucket_mb": 0.002}, True), ("fp16", {"compression": "fp16"}, False),
            ("bf16", {"compression": "bf16"}, False)]


def make(extra: bool = False) -> nn.Module:
    torch.manual_seed(1)
    layers = [nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)]
    model = nn.Sequential(*layers)
    if extra:  # a parameter no forward uses: no gradient hook fires for it
        model.register_module("unused", nn.Linear(4, 4))
        model.forward = lambda x: nn.Sequential.forward(model[:5], x)
    return model


def train(model: nn.Module, batches: Any, accumulate: bool = False) -> nn.Module:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for k in range(K):
        x, y = batches(k)
        opt.zero_grad()
        if accumulate:
            h = len(x) // 2
            with model.no_sync():
                (LOSS(model(x[:h]), y[:h]) / 2).backward()
            (LOSS(model(x[h:]), y[h:]) / 2).backward()
        else:
            LOSS(model(x), y).backward()
        opt.step()
    return model


def main(ctx: Any, report: Any) -> None:
    records = record_agent()
    g = torch.Generator().manual_seed(2)
    X = torch.randn(K * 2 * B, 8, generator=g)
    Y = torch.randint(0, 3, (K * 2 * B,), generator=g)

    start = [p.detach().clone() for p in make().parameters()]
    ref = train(make(), lambda k: (X[k * 2 * B:(k + 1) * 2 * B], Y[k * 2 * B:(k + 1) * 2 * B]))
    ref_params = [p.detach().clone() for p in ref.parameters()]

    def mine(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo = k * 2 * B + ctx.rank * B
        return X[lo:lo + B], Y[lo:lo + B]

    out: dict[str, Any] = {}
    for backend in ("mpi", "torch", "mpi-inline"):
        if backend == "mpi-inline":  # an MPI without THREAD_MULTIPLE: no comm thread
            data_parallel._comm_thread.threaded = False
        for name, kw, acc in VARIANTS if backend != "mpi-inline" else VARIANTS[1:3]:
            model = make()
            with torch.no_grad():  # different start on rank 1: the wrap must broadcast rank 0's
                for p in model.parameters():
                    p.add_(ctx.rank)
            records.clear()
            dp = mpilab.DataParallel(model, backend=backend.split("-")[0], **kw)
            train(dp, mine, accumulate=acc)
            err = max((p - r).abs().max().item() for p, r in zip(model.parameters(), ref_params))
            num = sum(((p - r) ** 2).sum() for p, r in zip(model.parameters(), ref_params)) ** 0.5
            den = sum(((r - s) ** 2).sum() for r, s in zip(ref_params, start)) ** 0.5
            steps = [f for kind, f in records if kind == "step"]
            out[f"{backend}-{name}"] = {
                "buckets": len(dp._sync.buckets) if dp._sync else None,
                "err": err, "rel_update_err": float(num / den),
                "steps": [f["step"] for f in steps], "samples": [f["samples"] for f in steps],
                "nbytes_ok": all(f["nbytes"] > 0 for f in steps),
                "nbytes": [f["nbytes"] for f in steps],
                "logged": [f["values"] for kind, f in records if kind == "log"],
                "times_ok": all(0 <= f["compute"] <= f["dur"] + 1e-9 and f["comm"] >= 0
                                for f in steps),
                "agent_step": agent.current().state.step,
                "keys_plain": list(dp.state_dict()) == list(make().state_dict()),
                "forward_same": torch.equal(dp(X[:3]), model(X[:3])),
            }

    # rerunning a notebook cell wraps the same model again: the last wrap wins
    model = make()
    mpilab.DataParallel(model, bucket_mb=0.002)
    train(mpilab.DataParallel(model), mine)
    out["rewrap_err"] = max((p - r).abs().max().item()
                            for p, r in zip(model.parameters(), ref_params))
    out["wrap_twice"] = error_of(lambda: mpilab.DataParallel(mpilab.DataParallel(make())))
    out["not_a_model"] = error_of(lambda: mpilab.DataParallel("resnet"))

    # a model trained in bfloat16 (MPI has no bfloat16 type) keeps the ranks identical
    model = make().to(torch.bfloat16)
    dp = mpilab.DataParallel(model)
    train(dp, lambda k: (mine(k)[0].to(torch.bfloat16), mine(k)[1]))
    out["bf16_params"] = [p.float().sum().item() for p in model.parameters()]

    # an unused parameter (no hook fires for it) must not hang the MPI backend
    model = make(extra=True)
    dp = mpilab.DataParallel(model, bucket_mb=0.002)
    train(dp, mine)
    out["unused_grad_zero"] = bool((model.unused.weight.grad == 0).all())
    report_all(ctx, report, out)
