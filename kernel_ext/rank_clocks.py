"""How far each rank's clock is from the notebook's.

A rank stamps its records with its own host's wall clock. On one host that is the
notebook's clock; across hosts it is another one, which NTP keeps within milliseconds
where it runs and which may be seconds or minutes off where it does not. Wherever the
notebook sets a rank's time against its own (how long a rank has waited in a
collective, when a cell began for `--timeout`), or ranks' times against each other (a
trace), it goes through here.

The estimate needs no exchange of its own: every heartbeat carries when the rank made
it, and the receiver notes when it arrived. Arrival minus making is the clocks' offset
plus the time on the way, so the smallest of them is the offset, late by the quickest
delivery (well under a millisecond between hosts). The smallest is taken over a sliding
window of about a minute, so a clock that NTP steps is followed within a minute.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WINDOW_S = 30.0  # the estimate is the smallest of the last one to two windows' samples


@dataclass
class _Estimate:
    current: float  # the smallest sample of the window that runs now
    previous: float  # the smallest of the window before it
    window_start: float  # the notebook's time when the current window began


@dataclass
class RankClocks:
    """rank -> the notebook's clock minus that rank's, from its heartbeats."""

    _estimates: dict[int, _Estimate] = field(default_factory=dict)

    def heard(self, rank: int, made: float, arrived: float) -> float:
        """A heartbeat that `rank` made at `made` (its clock) arrived at `arrived` (the
        notebook's): takes it into the estimate and returns `made` on the notebook's
        clock."""
        sample = arrived - made
        est = self._estimates.get(rank)
        if est is None:
            est = self._estimates[rank] = _Estimate(sample, sample, arrived)
        elif arrived - est.window_start > WINDOW_S:
            est.previous, est.current, est.window_start = est.current, sample, arrived
        elif sample < est.current:
            est.current = sample
        return self.to_notebook(rank, made)

    def offset(self, rank: int) -> float:
        """Seconds to add to `rank`'s times to read them on the notebook's clock (0 until
        its first heartbeat)."""
        est = self._estimates.get(rank)
        return 0.0 if est is None else min(est.current, est.previous)

    def to_notebook(self, rank: int, t: float) -> float:
        return t + self.offset(rank)
