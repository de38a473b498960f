"""What the training scenarios share: the agent's records kept in a list, and the
measures the tests read (parameter spread across ranks, bytes reported against bytes
the collectives counted)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from mpilab.rank import agent
from torch import nn


def record_agent() -> list[tuple[str, dict]]:
    """Keep every record the agent would send, (kind, fields), in the returned list."""
    records: list[tuple[str, dict]] = []
    agent.current().emit = lambda kind, **f: records.append((kind, f))
    return records


def report_all(ctx: Any, report: Callable[[Any], None], obj: Any) -> None:
    """Rank 0 reports every rank's `obj` (long lines from two ranks can interleave)."""
    everyone = ctx.comm.gather(obj, root=0)
    if ctx.rank == 0:
        report(everyone)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def spread(ctx: Any, model: nn.Module) -> float:
    """The largest difference between the ranks' parameters."""
    everyone = ctx.comm.allgather(flat(model))
    return max((t - everyone[0]).abs().max().item() for t in everyone)


def error_of(fn: Callable[[], Any]) -> str | None:
    """'Type: message' of what fn raises, None if nothing."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what the tests read
        return f"{type(e).__name__}: {e}"
    return None


def traffic(records: list[tuple[str, dict]]) -> list[tuple[float, int]]:
    """(reported, counted) bytes per step: log records against the collectives' spans."""
    pairs, counted = [], 0
    for kind, f in records:
        if kind == "span" and f.get("cat") == "comm":
            counted += f["nbytes"]
        elif kind == "log" and "bytes_sent" in f["values"]:
            pairs.append((f["values"]["bytes_sent"], counted))
            counted = 0
    return pairs


def end_without_finalizing(ctx: Any) -> None:
    """End every rank at once, after the others are done. An aborted gloo group keeps a
    receive its peer never matched until the group's timeout (gloo cannot cancel it),
    and the Python callback of its future (DDP's own hooks have one) must not run while
    the interpreter finalizes."""
    import os

    ctx.comm.Barrier()
    os._exit(0)
