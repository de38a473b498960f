"""Interruptible waiting on non-blocking MPI requests.

A blocking MPI call cannot be interrupted: Python's signal handlers only run between
bytecodes. Polling a non-blocking request with short sleeps lets KeyboardInterrupt
(the notebook's stop button) and mpilab's abort land within milliseconds.
"""

from __future__ import annotations

import time

# Spin briefly first (small messages finish in microseconds), then back off.
_SPIN_S = 0.0002
_MAX_SLEEP_S = 0.002


def wait_interruptibly(request) -> None:
    """Wait for an mpi4py Request, staying responsive to signals."""
    if request.Test():
        return
    start = time.perf_counter()
    sleep = 0.0
    while not request.Test():
        if time.perf_counter() - start > _SPIN_S:
            sleep = min(_MAX_SLEEP_S, sleep * 2 or 0.00005)
            time.sleep(sleep)
