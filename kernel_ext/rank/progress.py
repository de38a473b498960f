"""`mpilab.progress(iterable)`: a progress bar for a training loop on the ranks.

Every rank iterates; rank 0 reports its position over the record channel (at most
five times a second), and the notebook draws one bar under the cell that updates in
place: one bar for the run, however many ranks, kept in the saved notebook as text.

In a batch script there is no notebook to draw it: rank 0 writes a line to stderr every
`PRINT_INTERVAL_S` and one when the loop ends, with the newest values `mpilab.log` was
given (`train: 40/100 (40%) · 12.0 s · 3.33/s · loss 0.3123`). Lines, not a bar redrawn
with carriage returns: mpiexec passes a rank's output on through pipes, into a
terminal or a job's log file, where one line every few seconds stays readable.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

from . import agent as agent_mod

T = TypeVar("T")
REPORT_INTERVAL_S = 0.2
PRINT_INTERVAL_S = 10.0  # a batch script's progress lines


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
    if agent.address is None:  # a batch script: lines on stderr (the module's docstring)
        interval = PRINT_INTERVAL_S

        def report(n: int, elapsed: float) -> None:
            print(progress_line(desc, n, total, elapsed, agent.state.logged),
                  file=sys.stderr, flush=True)
    else:
        interval = REPORT_INTERVAL_S

        def report(n: int, elapsed: float) -> None:
            agent.emit("event", what="progress", n=n, total=int(total or 0), desc=desc,
                       elapsed=elapsed)

        report(0, 0.0)  # the bar appears as the loop begins
    start = last = time.time()
    n = 0
    try:
        for item in iterable:
            yield item
            n += 1
            now = time.time()
            if now - last >= interval:
                last = now
                report(n, now - start)
    finally:  # the loop's end, or a `break` out of it: where it stopped
        report(n, time.time() - start)


def progress_line(desc: str, n: int, total: int, elapsed: float, logged: dict) -> str:
    """'train: 40/100 (40%) · 12.0 s · 3.33/s · loss 0.3123' (a slower loop: '· 65.2 s ·
    21.7 s each')."""
    where = f"{n}/{total} ({100 * n // total}%)" if total else f"{n}"
    rate = ""
    if elapsed > 0 and n:
        per_s = n / elapsed
        rate = (f" · {per_s:.0f}/s" if per_s >= 100 else f" · {per_s:.3g}/s" if per_s >= 1
                else f" · {elapsed / n:.3g} s each")
    values = "".join(f" · {name} {value:.4g}" for name, value in logged.items())
    return f"{desc or 'progress'}: {where} · {elapsed:.1f} s{rate}{values}"
