"""What a training step sent and how long it took: the "step" records, the bytes and
compression ratio as "log" records, and ``mpilab.traffic()`` blocks.

Every way of training on the ranks reports here, whatever it sends: DataParallel
(compressed or not, over MPI or DDP) and the averaging strategies (LocalSGD, EASGD).
So the dashboard and ``mpilab.traffic()`` compare them by one measure.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from . import agent as agent_mod


@dataclass
class TrafficMeter:
    """Bytes sent per step and the running compression ratio, as "log" records.

    The ratio compares with uncompressed DataParallel over the same steps: every
    gradient allreduced, in its own dtype, every step (`dense_bytes` per step). Until
    something has been sent there is no ratio: the records carry ``bytes_sent`` only.
    """

    dense_bytes: int
    steps: int = 0
    sent: int = 0

    @property
    def ratio(self) -> float:
        return self.dense_bytes * self.steps / self.sent if self.sent else 0.0

    def report(self, step: int, nbytes: int) -> None:
        self.steps += 1
        self.sent += nbytes
        values = {"bytes_sent": float(nbytes)}
        if self.sent:
            values["compression_ratio"] = self.ratio
        agent_mod.current().emit("log", step=int(step), values=values)


@dataclass
class Traffic:
    """What this rank's training steps sent inside a ``traffic()`` block."""

    nbytes: int = 0
    steps: int = 0


_counting: list[Traffic] = []  # the open traffic() blocks


def count_step(nbytes: int) -> None:
    """A training step sent `nbytes`: every step clock reports here."""
    for counted in _counting:
        counted.nbytes += nbytes
        counted.steps += 1


@contextmanager
def traffic() -> Iterator[Traffic]:
    """Count the bytes this rank's training steps send inside the block, whatever the
    strategy (DataParallel, compressed or not, LocalSGD, EASGD): the same figure as
    their "step" records' ``nbytes``. For comparing strategies side by side in one
    notebook."""
    counted = Traffic()
    _counting.append(counted)
    try:
        yield counted
    finally:
        _counting.remove(counted)


@dataclass
class StepClock:
    """Per-step timing, accumulated by the hooks and emitted once per synchronised step."""

    step: int = 0
    last_sync: float | None = None
    first_forward: float | None = None
    samples: int = 0
    comm_s: float = 0.0
    nbytes: int = 0
    # what a method that sends less than plain DataParallel reports at each step: its
    # bytes and compression ratio, as log records (compression and the strategies)
    meter: TrafficMeter | None = None

    def forward(self, args: tuple, kwargs: dict) -> None:
        """Count the samples: the first dimension of the first tensor argument."""
        if self.first_forward is None:
            self.first_forward = time.perf_counter()
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor):
                self.samples += int(value.shape[0]) if value.dim() else 1
                return

    def synced(self, exposed_wait_s: float) -> None:
        """One synchronisation finished: record it and start the next step."""
        now = time.perf_counter()
        start = self.last_sync if self.last_sync is not None else self.first_forward or now
        dur = now - start
        self.step += 1
        agent = agent_mod.current()
        agent.state.step = self.step
        agent.emit("step", step=self.step, dur=dur, compute=max(0.0, dur - exposed_wait_s),
                   comm=self.comm_s, nbytes=self.nbytes, samples=self.samples)
        count_step(self.nbytes)
        if self.meter is not None:
            self.meter.report(self.step, self.nbytes)
        self.last_sync = now
        self.first_forward = None
        self.samples = 0
        self.comm_s = 0.0
        self.nbytes = 0
