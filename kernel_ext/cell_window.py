"""Which of the store's records belong to one cell: per rank, those between the cell's
start and end events there (a cell may wait on the ranks behind a --noblock one)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .metrics_store import MetricsStore

Bounds = dict[int, tuple[float, float]]  # rank -> (from, until), epoch s: one run's records


@dataclass(frozen=True)
class CellMarks:
    """One cell on one rank, from its cell-start and cell-end events."""

    start: float
    end: float  # inf while it runs
    number: int  # the rank's count of cells: its heartbeats carry it


@dataclass
class CellWindow:
    """Which records are one cell's. A cell may wait on the ranks behind a --noblock one,
    so per rank they are those between its cell-start and cell-end events there, which
    name the cell's execute request. Without `msg_ids`: every rank's from `since` on."""

    since: float  # epoch s: when the cell was run (it begins on the ranks later)
    msg_ids: dict[int, str] | None = None  # rank -> the cell's execute request there
    _marks: dict[int, CellMarks] = field(default_factory=dict)
    _events_read: int = -1  # the store's count of events when the marks were read
    _bounds: Bounds = field(default_factory=dict)  # bounds() of the marks
    _numbers: dict[int, int] = field(default_factory=dict)  # numbers() of the marks

    def bounds(self, store: MetricsStore) -> Bounds:
        """The ranks whose records count now, and from when until when (the same dict
        while they stay so: read it, do not change it)."""
        if self.msg_ids is None:
            if len(self._bounds) != store.world_size:
                self._bounds = {r: (self.since, math.inf) for r in range(store.world_size)}
            return self._bounds
        self._read(store)
        return self._bounds

    def numbers(self, store: MetricsStore) -> dict[int, int]:
        """rank -> the cell's number there (its heartbeats carry it), once begun there;
        none without `msg_ids`, as the numbers come from the ranks' cell-start events
        (the same dict while they stay so)."""
        self._read(store)
        return self._numbers

    def _read(self, store: MetricsStore) -> dict[int, CellMarks]:
        # read again until the cell ends everywhere, when an event came since (the
        # watchdog asks 20 times a second: at 1,024 ranks a read cost ~10 ms)
        events = store.events
        if events != self._events_read and (
                len(self._marks) < len(self.msg_ids or ()) or any(
                    m.end == math.inf for m in self._marks.values())):
            self._events_read = events
            marks = self._marks = store.cell_marks(self.msg_ids or {})
            # what the runner, the watchdog and the dashboard read on every tick, made
            # once per reading of the marks (1,024 ranks)
            self._bounds = {r: (m.start, m.end) for r, m in marks.items()}
            self._numbers = {r: m.number for r, m in marks.items()}
        return self._marks

    def started(self, store: MetricsStore) -> float | None:
        """When the first rank began the cell (epoch s, the notebook's clock), once one
        has."""
        bounds = self.bounds(store)
        to_notebook = store.clocks.to_notebook
        return min(to_notebook(r, start) for r, (start, _) in bounds.items()) \
            if bounds else None

    def ended(self, store: MetricsStore) -> set[int]:
        return {r for r, (_, end) in self.bounds(store).items() if end != math.inf}
