"""`mpilab.progress(iterable)`: a progress bar for a training loop on the ranks.

Every rank iterates; rank 0 reports its position over the record channel (at most
five times a second), and the notebook draws one bar under the cell that updates in
place. Engines have no widget frontend of their own, so tqdm's notebook bar cannot be
shown from a rank; this is the equivalent, and `use_text_bars` gives `tqdm.auto` the
text bar there, whose line the notebook follows as it is redrawn.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
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


class _TextBars(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`tqdm.autonotebook`, and `tqdm.auto` built on it, on a rank: tqdm's text bar, as
    they give in a terminal. In any IPython kernel they choose tqdm's notebook widget,
    which on an engine has no frontend to update: the notebook would show the bar's first
    state for ever (`[rank 0] 0%| | 0/20`).

    Nested bars draw on one line: a terminal's bars below the first are reached with
    line breaks and cursor-up codes, which a notebook's output does not move back over,
    so every redraw of an inner bar would be a new line. On one line the newest redraw
    shows (the inner bar while it runs), and a finished bar that is left (`leave=True`)
    is a line of the output, as in a terminal."""

    def find_spec(self, fullname, path, target=None):
        return importlib.util.spec_from_loader(fullname, self) \
            if fullname == "tqdm.autonotebook" else None

    def create_module(self, spec):
        return None  # the default module

    def exec_module(self, module) -> None:
        from tqdm.std import tqdm as text_bar

        class tqdm(text_bar):  # noqa: N801 - tqdm's own name, which users import
            __module__ = module.__name__

            def moveto(self, n: int) -> None:
                """No line breaks or cursor moves between nested bars: see _TextBars."""

        def trange(*args, **kwargs):
            return tqdm(range(*args), **kwargs)

        module.tqdm, module.trange, module.__all__ = tqdm, trange, ["tqdm", "trange"]


def use_text_bars() -> None:
    """Make later imports of `tqdm.auto` and `tqdm.autonotebook` give the text bar (the
    engine bootstrap calls it; nothing is imported until a cell imports them)."""
    if not any(isinstance(finder, _TextBars) for finder in sys.meta_path):
        sys.meta_path.insert(0, _TextBars())
