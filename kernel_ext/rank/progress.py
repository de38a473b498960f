"""`mpilab.progress(iterable)`: a progress bar for a training loop on the ranks.

Every rank iterates; rank 0 reports its position over the record channel (at most
five times a second), and the notebook draws one bar under the cell that updates in
place: one bar for the run, however many ranks, kept in the saved notebook as text.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

from . import agent as agent_mod

T = TypeVar("T")
REPORT_INTERVAL_S = 0.2


def progress(iterable: Iterable[T], total: int | None = None, desc: str = "") -> Iterator[T]:
    """`iterable`, item by item, with a bar under the cell (rank 0's position). Its
    argument is checked at the call: the loop is a generator, which would fail only at its
    first step, in mpilab's code."""
    if not (hasattr(iterable, "__iter__") or hasattr(iterable, "__getitem__")):
        hint = f": range({iterable})?" if isinstance(iterable, int) else ""
        raise TypeError(f"mpilab.progress takes an iterable (range(n), a DataLoader), got "
                        f"{type(iterable).__name__}{hint}")
    return _progress(iterable, total, desc)


def _progress(iterable: Iterable[T], total: int | None, desc: str) -> Iterator[T]:
    agent = agent_mod.current()
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = 0
    if agent.rank != 0:
        yield from iterable
        return
    start = last = time.time()
    n = 0

    def report() -> None:
        agent.emit("event", what="progress", n=n, total=int(total or 0), desc=desc,
                   elapsed=time.time() - start)

    report()
    for item in iterable:
        yield item
        n += 1
        now = time.time()
        if now - last >= REPORT_INTERVAL_S:
            last = now
            report()
    report()
