"""LocalSGD and EASGD on the ranks: averaging periods, warm-up, the bytes they report,
rewrapping, wrapped optimizers, one EASGD step by hand, the centre, bad input."""

from __future__ import annotations

import gc
from typing import Any

import mpilab
import torch
from torch import nn

from .common import error_of, flat, record_agent, report_all, spread, traffic

LOSS = nn.CrossEntropyLoss()


def main(ctx: Any, report: Any) -> None:
    records = record_agent()

    def make() -> nn.Module:
        torch.manual_seed(10 + ctx.rank)  # different on purpose: the wrappers broadcast rank 0's
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))

    g = torch.Generator().manual_seed(2)
    X, Y = torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)

    def train(model, steps, after_step=None, lr=0.3):
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        for k in range(steps):
            lo = (2 * k + ctx.rank) * 4 % 64  # each rank its own batch of 4
            opt.zero_grad()
            LOSS(model(X[lo:lo + 4]), Y[lo:lo + 4]).backward()
            opt.step()
            if after_step:
                after_step(k + 1)
        return model

    out: dict[str, Any] = {}
    dp = train(mpilab.DataParallel(make()), 8)
    local = train(mpilab.LocalSGD(make(), period=1), 8)
    out["period1_vs_dp"] = (flat(dp) - flat(local)).abs().max().item()

    model = mpilab.LocalSGD(make(), period=3)
    spreads: list[float] = []
    records.clear()
    with mpilab.traffic() as counted:
        train(model, 7, lambda k: spreads.append(spread(ctx, model)))
    out["period3_counted"] = [counted.nbytes, counted.steps]
    out["period3_spreads"] = spreads
    out["period3_traffic"] = traffic(records)
    out["period3_ratio"] = [f["values"].get("compression_ratio") for k, f in records
                            if k == "log"]
    out["param_bytes"] = sum(p.numel() * 4 for p in model.parameters())

    model = mpilab.LocalSGD(make(), period=4, warmup=2)
    spreads = []
    train(model, 6, lambda k: spreads.append(spread(ctx, model)))
    out["warmup_spreads"] = spreads

    plain = make()
    mpilab.LocalSGD(plain, period=1)
    model = mpilab.LocalSGD(plain, period=1)  # a rerun cell: replaces the first wrap
    records.clear()
    train(model, 2)
    out["rewrap_logs"] = sum(1 for k, _ in records if k == "log")
    dp = mpilab.DataParallel(plain)  # and DataParallel replaces a strategy
    records.clear()
    train(dp, 2)
    out["replaced_by_dp_logs"] = sum(1 for k, _ in records if k == "log")
    plain = make()
    mpilab.LocalSGD(plain, period=1)
    ddp = mpilab.DataParallel(plain, backend="torch")  # DDP's hooks: none of mpilab's
    records.clear()
    train(ddp, 2)
    out["replaced_by_ddp_logs"] = sum(1 for k, _ in records if k == "log")
    out["replaced_by_ddp_steps"] = sum(1 for k, _ in records if k == "step")

    net = make()
    mpilab.LocalSGD(net, period=2)  # the wrapper is not kept: the model keeps it alive
    gc.collect()
    spreads = []
    train(net, 2, lambda k: spreads.append(spread(ctx, net)))
    out["unkept_wrapper_spreads"] = spreads

    # the large-batch wrappers around the optimizer: the strategy still sees every step
    model = mpilab.LocalSGD(make(), period=2)
    opt = mpilab.ScaledLR(mpilab.LARS(torch.optim.SGD(model.parameters(), lr=0.1,
                                                      momentum=0.9)), warmup_steps=2)
    spreads = []
    for k in range(4):
        opt.zero_grad()
        mine = slice(k * 8 + ctx.rank * 4, k * 8 + ctx.rank * 4 + 4)
        LOSS(model(X[mine]), Y[mine]).backward()
        opt.step()
        spreads.append(spread(ctx, model))
    out["wrapped_optimizer_spreads"] = spreads
    out["wrapped_optimizer_lr"] = opt.param_groups[0]["lr"]

    out.update(_easgd_by_hand(ctx, make, records))
    out.update(_easgd_centre(ctx, make, train))

    out["errors"] = [
        error_of(lambda: mpilab.LocalSGD(make(), period=0)),
        error_of(lambda: mpilab.LocalSGD(make(), warmup=-1)),
        error_of(lambda: mpilab.EASGD(make(), alpha=0.9)),
        error_of(lambda: mpilab.LocalSGD(mpilab.DataParallel(make()))),
        error_of(lambda: mpilab.LocalSGD(make(), backend="nccl2")),
    ]
    report_all(ctx, report, out)


def _easgd_by_hand(ctx: Any, make: Any, records: list) -> dict:
    """One averaging step by hand: lr 0 keeps the ranks where we put them."""
    model = make()
    easgd = mpilab.EASGD(model, alpha=0.2, period=2)
    c0 = [c.clone() for c in easgd.center]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * (ctx.rank + 1))  # x_i = x̃ + 0.1 (i + 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    records.clear()
    opt.step()
    moved_early = max((c - c1).abs().max().item() for c, c1 in zip(easgd.center, c0))
    opt.step()
    # x_i ← x_i − α (x_i − x̃) ;  x̃ ← x̃ + α Σ_i (x_i − x̃) = x̃ + 0.2 × (0.1 + 0.2)
    want_x = [c + 0.1 * (ctx.rank + 1) * (1 - 0.2) for c in c0]
    want_c = [c + 0.2 * 0.3 for c in c0]
    return {
        "easgd_before_period": moved_early,
        "easgd_x_error": max((p - w).abs().max().item()
                             for p, w in zip(model.parameters(), want_x)),
        "easgd_c_error": max((c - w).abs().max().item() for c, w in zip(easgd.center, want_c)),
        "easgd_traffic": traffic(records),
    }


def _easgd_centre(ctx: Any, make: Any, train: Any) -> dict:
    """A real run: the centre is the same on every rank, bit for bit, after every step."""
    model = mpilab.EASGD(make(), alpha=0.1, period=2)
    centers: list[float] = []

    def center_spread(k: int) -> None:
        mine = torch.cat([c.reshape(-1) for c in model.center])
        everyone = ctx.comm.allgather(mine)
        centers.append(max((t - everyone[0]).abs().max().item() for t in everyone))

    train(model, 6, center_spread)
    center = model.center_module()
    centre = torch.cat([c.reshape(-1) for c in model.center])
    return {"easgd_center_spreads": centers,
            "center_module": (flat(center) - centre).abs().max().item()}
