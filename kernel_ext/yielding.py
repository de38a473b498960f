"""The notebook kernel gives way to the ranks while it only waits for them.

Where the ranks keep every core busy (a CPU host, or more ranks than cores), the kernel's
own work in a training cell competes with them. That work is relaying output, filing
records and redrawing the dashboard. Linux groups the kernel's threads in one
scheduling group (its session's autogroup). Each rank has its own group, and all groups
get equal shares. So a kernel thread that wakes up preempts a rank at once. Because the
ranks step together, the other ranks then wait for that rank, and the whole job loses
the time. With a lower autogroup priority, the kernel mostly runs when a rank waits for
communication anyway. It still gets its share, so its work is delayed by tens of ms, not
starved.

The priority is lowered only while a blocking `%%ranks` cell runs: the kernel has
nothing else to do then. It is restored when the cell ends, however it ends. Only a
kernel that leads its own session does this (Jupyter starts kernels that way), so a
terminal session's shell is never affected. Without autogroups (another OS, or a kernel
built without them) this does nothing.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

AUTOGROUP = Path("/proc/self/autogroup")
# At nice 8 the autogroup weighs a sixth of a rank's. Measured on a 2-core host with 2
# ranks, the 95th percentile of a record's way to the dashboard grew from 250 ms to about
# 260 ms; at nice 10 to 260-296 ms, too close to the 300-ms target; at nice 19 to 520 ms.
WAITING_NICE = 8
# Unprivileged processes may change an autogroup's priority only once per 0.1 s,
# across the whole system
RETRY_S, RETRIES = 0.1, 20


@contextmanager
def yielding_to_ranks(nice: int = WAITING_NICE, autogroup: Path = AUTOGROUP) -> Iterator[None]:
    """Lower this process's autogroup priority to `nice` for the block, then restore it."""
    previous = autogroup_nice(autogroup)
    if previous is None or previous >= nice or os.getsid(0) != os.getpid():
        yield
        return
    lowered = _set_nice(autogroup, nice)
    try:
        yield
    finally:
        if lowered and not _set_nice(autogroup, previous):
            logging.getLogger("mpilab").warning(
                "could not restore the kernel's scheduling priority (nice %d): it stays at "
                "nice %d until `echo %d > /proc/%d/autogroup`",
                previous, nice, previous, os.getpid())


def autogroup_nice(autogroup: Path = AUTOGROUP) -> int | None:
    """The nice value of this process's autogroup; None without autogroups."""
    try:
        text = autogroup.read_text()  # "/autogroup-123 nice 0"
        return int(text.split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def _set_nice(autogroup: Path, nice: int) -> bool:
    for _ in range(RETRIES):
        try:
            autogroup.write_text(str(nice))
            return True
        except BlockingIOError:  # EAGAIN: another change within the last 0.1 s
            time.sleep(RETRY_S)
        except OSError:
            return False
    return False
