"""How a batch script's ranks end when one of them fails.

A script under ``mpiexec`` that calls ``mpilab.init()`` has no notebook and no watchdog.
When an exception ends the script on one rank, that rank would go on into MPI's
finalization, which waits for every rank, while the others wait for it in their next
collective: the job would hang until its time limit, with the traceback long scrolled
by. So the rank prints its traceback, one line says that every rank is being ended, and
``MPI_Abort`` ends them (torchrun likewise stops the other workers when one fails, and
``python -m mpi4py`` aborts). The notebook's ranks are engines: a cell's exception never
reaches ``sys.excepthook`` there, and the watchdog releases the peers instead.
"""

from __future__ import annotations

import sys
from typing import Any

ABORT_CODE = 1  # the exit status of a Python script that ends with an exception


def end_every_rank_on_error(comm: Any, rank: int, world_size: int) -> None:
    """Make an exception that ends the script on this rank end every rank of `comm`."""
    if world_size < 2:
        return
    previous = sys.excepthook

    def excepthook(kind, value, tb) -> None:
        try:
            previous(kind, value, tb)  # the traceback, as the script would print it
        finally:
            what = ("was interrupted" if issubclass(kind, KeyboardInterrupt)
                    else f"ended with {kind.__name__}")
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001 - a closed stream has nothing to lose
                    pass
            print(f"mpilab: rank {rank} {what}: ending all {world_size} ranks",
                  file=sys.stderr, flush=True)
            comm.Abort(ABORT_CODE)

    sys.excepthook = excepthook
